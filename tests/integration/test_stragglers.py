"""A straggler: 2 nodes x 2 ranks + 1 spare (CPU, gloo, ftrun.elastic), rank 3 made slow from step 20 on (a slow
chip on its node: alive, beating, each step 0.3 s late), with --stragglers replace and --metrics-port.

One run, several assertions: the slow rank is named (and no other), its node's ranks move to the spare at
process level and the move's gain is said, the Prometheus endpoint shows the scores and the repair, and the job
ends with the parameters of a fault-free run of as many steps (which names no straggler).
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.conftest import WORKERS, Launcher, free_port, step_reached, unique_mark, wait_for

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
SLOW_FROM = 20


def events_of(launcher: Launcher) -> list[dict]:
    found = list(launcher.tmp.glob("logs/*/events.jsonl"))
    if not found:
        return []
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]


def of_kind(launcher: Launcher, kind: str) -> list[dict]:
    return [e for e in events_of(launcher) if e["kind"] == kind]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def test_a_slow_rank_is_named_and_its_node_s_ranks_move_to_the_spare(launcher, tmp_path_factory):
    metrics = free_port()
    stop_file = launcher.out_dir / "stop"
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--spares", "1", "--rdzv-endpoint", endpoint,
              "--run-id", launcher.mark, "--monitor-interval", "0.05", "--recovery", "process", "--max-restarts", "2",
              "--stragglers", "replace", "--metrics-port", str(metrics), "--log-dir", str(launcher.tmp / "logs")]
    env = launcher.env(STEPS="1000", STEP_SLEEP="0.05", SLOW_RANK=f"3:{SLOW_FROM}:0.3", STOP_FILE=str(stop_file))
    for _ in range(3):
        launcher.start([*common, ELASTIC], env=env)

    wait_for(lambda: step_reached(launcher.out_dir, 3) >= SLOW_FROM, timeout=180, what="rank 3 to reach its slowdown")
    [named] = wait_for(lambda: [e for e in of_kind(launcher, "straggler") if e["named"]], timeout=120,
                       what="the straggler to be named")
    assert named["rank"] == 3 and named["node"] is not None and named["action"] == "replace", named
    assert "straggler: rank 3 on node" in named["detail"] and named["score"] >= 1.5
    [gain] = wait_for(lambda: of_kind(launcher, "straggler_gain"), timeout=180, what="the move's gain")
    assert gain["node"] == named["node"] and gain["after"] < gain["slowed"], gain
    page = scrape(metrics)
    assert 'ftrun_faults_total{kind="straggler",level=""} 1.0' in page
    assert 'ftrun_repairs_total{level="process"} 1.0' in page
    assert 'ftrun_rank_wait_seconds{node=' in page and 'ftrun_straggler_score{node=' in page
    assert "ftrun_goodput_ratio" in page and "ftrun_restarts_left 1.0" in page

    # every rank stops at the same step, a little further on
    final = max(step_reached(launcher.out_dir, rank) for rank in range(4)) + 3
    stop_file.write_text(str(final))
    codes = launcher.wait()
    assert sorted(codes) == [0, 0, 1], launcher.output()  # the slow node's agent leaves, its place given to the spare
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {final}, results
    assert [e["rank"] for e in of_kind(launcher, "straggler") if e["named"]] == [3]
    takeovers = of_kind(launcher, "takeover")
    assert len(takeovers) == 1 and takeovers[0]["node"] == named["node"]
    assert {r["replacement"] for rank, r in results.items() if rank in (2, 3)} == {"1"}
    assert {r["replacement"] for rank, r in results.items() if rank in (0, 1)} == {"0"}

    # a fault-free run of as many steps, on one agent: the same parameters, and no straggler named
    reference = Launcher(tmp_path_factory.mktemp("stragglers-fault-free"), unique_mark("stragglers-fault-free"))
    try:
        reference.start_job(1, 4, [ELASTIC], flags=["--recovery", "process", "--log-dir", str(reference.tmp / "logs")],
                            env=reference.env(STEPS=str(final), STEP_SLEEP="0"))
        assert reference.wait() == [0], reference.output()
    finally:
        reference.kill_all()
    assert {r["checksum"] for r in reference.results().values()} == {r["checksum"] for r in results.values()}
    assert {r["digest"] for r in reference.results().values()} == {r["digest"] for r in results.values()}
    assert not of_kind(reference, "straggler") and of_kind(reference, "job_finished")
