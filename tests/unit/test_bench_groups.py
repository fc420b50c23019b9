"""scripts/bench_groups.py: a short run prints the table and the JSON of both operations, each timed
directly, through ftrun's group and through it inside a step."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_groups.py"


def test_a_short_run_times_each_operation_three_ways():
    run = subprocess.run([sys.executable, str(SCRIPT), "-n", "20", "--repeat", "1", "--json", "-"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    table, document = run.stdout.split("\n{", 1)
    figures = json.loads("{" + document)
    assert [row["op"] for row in figures["rows"]] == ["all_reduce", "broadcast"]
    assert all(row[way] > 0 for row in figures["rows"] for way in ("gloo_us", "ftrun_us", "ftrun_in_step_us"))
    assert "in a step" in table and "all_reduce" in table
