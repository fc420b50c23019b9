"""scripts/gpu_check.sh on a machine without a GPU (CI's): one line and its own exit code, no traceback."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_2():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"gpu_check: no CUDA GPU visible to {sys.executable}'s torch: nothing to check"]


def test_an_unknown_part_is_named():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "check.py"), "--out", "/nonexistent",
                           "--parts", "probe,warp"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown part warp" in done.stderr
