"""scripts/bench_control_plane.py --backend c10d,etcd: what it reads of the journal's writes and how it sets
the two backends side by side (no runs: the run itself is tests/integration/test_control_plane_sim.py's)."""

import importlib
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("bench_control_plane")
    finally:
        sys.path.remove(str(SCRIPTS))


def test_the_decisions_journal_write_is_the_one_before_the_first_stop(bench):
    writes = [(1.0, 40.0, 280_000), (2.0, 3.0, 900), (3.0, 2.5, 950), (4.0, 9.0, 30_000)]
    figures = bench._journal_writes(writes, {"start": 1, "stop": 3, "takeover": 4})
    assert figures == {"journal_first_ms": 40.0, "journal_first_bytes": 280_000, "journal_ms": 2.5,
                       "journal_write_bytes": 950, "journal_writes": 4}


def test_both_backends_share_one_table_and_c10d_has_no_etcd_figures(bench):
    rows = [{"nodes": 8, "backend": "c10d", "decision_fanout_ms": 2.0},
            {"nodes": 8, "backend": "etcd", "decision_fanout_ms": 5.0, "failover_ms": 3100, "etcd_writes_s": 1.0}]
    lines = bench.table(rows, bench.COMPARED_COLUMNS).splitlines()
    assert len(lines) == 3 and "failover ms" in lines[0]
    c10d, etcd = (line.split() for line in lines[1:])
    assert c10d[1] == "c10d" and etcd[1] == "etcd" and "3100" in etcd and "3100" not in c10d
    assert c10d.count("-") > etcd.count("-")
