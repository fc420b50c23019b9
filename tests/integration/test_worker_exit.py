"""A rank's process exits with its script's exit code, whatever the worker library's threads are doing.

A daemon thread that comes out of a native torch call (a store call, a snapshot's Tensor.copy_) while
the interpreter tears down aborts the process: "terminate called without an active exception", SIGABRT.
One real rank (tests/workers/ends_busy.py) on a real TCPStore.
"""

from __future__ import annotations

import os
import subprocess
import sys
from subprocess import Popen

import psutil
import pytest
from torch.distributed import TCPStore

from ftrun.elastic.arrays import own_steps
from tests.conftest import WORKERS, wait_for

# torchrun's own path: each rank in a fresh interpreter, as ftrun starts them at job level by default
pytestmark = [pytest.mark.integration, pytest.mark.fresh_interpreters]
SCRIPT = str(WORKERS / "ends_busy.py")
STORE_HOST = """
import sys
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


def rank_env(port: int, **extra: str) -> dict[str, str]:
    return {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "FTRUN_RUN_ID": "exit",
            "FTRUN_GENERATION": "0", "FTRUN_CONTROL_STORE": f"127.0.0.1:{port}", **extra}


def store_connections(pid: int, port: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def rank_beside_its_store(mode: str, code: int, meanwhile=lambda host: None, **extra: str) -> tuple[int, str]:
    """ends_busy.py MODE CODE on a store hosted by a process of its own (its pid in STORE_PID for the
    teardown mode). Once the rank holds its three store connections (its own, the heartbeat's and the
    repair watch's, which is then in its wait), ``meanwhile(host)`` runs and the rank goes on. Its exit
    code and stderr."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    rank = None
    try:
        port = int(host.stdout.readline())
        if mode == "teardown":
            extra["STORE_PID"] = str(host.pid)
        rank = subprocess.Popen([sys.executable, SCRIPT, mode, str(code)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env(port, **extra))
        assert rank.stdout.readline() == "ready\n"
        wait_for(lambda: store_connections(rank.pid, port) == 3, 30, "the rank's three store connections")
        meanwhile(host)
        _, err = rank.communicate("go\n", timeout=60)
        host.wait(timeout=10)  # gone by now, one way or the other
        return rank.returncode, err
    finally:
        for proc in (host, rank):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()


def gone(host: Popen) -> None:
    host.kill()
    host.wait()


def test_a_rank_whose_store_went_exits_with_its_own_code_not_sigabrt():
    """The repair watch met the dead store at each wait and spun on failing store calls until the end.
    With torch's C++ warnings quiet, as many users keep them, each failed wait returns at once."""
    code, err = rank_beside_its_store("store-gone", 3, gone, TORCH_CPP_LOG_LEVEL="FATAL")
    assert "terminate called" not in err
    assert code == 3, err[-3000:]


def test_a_rank_whose_store_goes_as_it_tears_down_exits_with_its_own_code_not_sigabrt():
    """The repair watch was parked in the store's wait when the interpreter tore down, and the store's
    end took it out of there then: the rank rings its own key to let the watch go as it ends."""
    code, err = rank_beside_its_store("teardown", 5)  # the rank's teardown kills the store's host
    assert "terminate called" not in err
    assert code == 5, err[-3000:]


def test_a_script_that_ends_right_after_a_snapshot_step_exits_with_its_own_code(tmp_path):
    """The snapshot's copy behind the loop was still under way as the interpreter tore down."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = rank_env(store.port, FTRUN_SNAPSHOT_DIR=str(tmp_path), FTRUN_SNAPSHOT_EVERY="2")
    done = subprocess.run([sys.executable, SCRIPT, "snapshot", "4"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "terminate called" not in done.stderr
    assert done.returncode == 4, done.stderr[-3000:]
    assert own_steps(str(tmp_path), 0) == [2]  # and the snapshot is complete
