"""Job-level recovery on 2 simulated nodes x 2 ranks (CPU, gloo, real agents on loopback)."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import WORKERS

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")
STEPS = 10


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """One fault-free run, shared: the reference checksum and the success path's own checks."""
    from tests.conftest import Launcher, unique_mark

    runner = Launcher(tmp_path_factory.mktemp("fault-free"), unique_mark("fault-free-reference"))
    codes = run_with_fault(runner, fault="")
    return runner, codes


@pytest.fixture(scope="module")
def fault_free_checksum(fault_free):
    runner, codes = fault_free
    assert codes == [0, 0], runner.output()
    results = runner.results()
    assert sorted(results) == [0, 1, 2, 3]
    return results[0]["checksum"]


def run_with_fault(launcher, fault: str, max_restarts: int = 2, restarts: str = "0"):
    env = launcher.env(STEPS=str(STEPS), FAULT=fault, FAULT_RESTARTS=restarts)
    launcher.start_job(2, 2, [TRAIN], flags=["--max-restarts", str(max_restarts)], env=env)
    return launcher.wait()


def test_success_path_runs_every_rank_to_the_final_step(fault_free, fault_free_checksum):
    runner, codes = fault_free
    assert codes == [0, 0], runner.output()
    results = runner.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == {fault_free_checksum}
    assert "job succeeded" in runner.output()


def test_worker_environment_follows_the_torchrun_contract(fault_free):
    runner, codes = fault_free
    assert codes == [0, 0], runner.output()
    results = runner.results()
    assert sorted(results) == [0, 1, 2, 3]
    for rank, result in results.items():
        env = result["env"]
        assert env["RANK"] == str(rank) and env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_RANK"] == str(rank // 2)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == env["FTRUN_RUN_ID"] == runner.mark
        assert env["FTRUN_GENERATION"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
    # every rank met at the same per-generation worker store, distinct from the control store
    assert len({r["env"]["MASTER_PORT"] for r in results.values()}) == 1
    assert results[0]["env"]["MASTER_PORT"] != results[0]["env"]["FTRUN_CONTROL_STORE"].rpartition(":")[2]


@pytest.mark.parametrize(
    "fault, evidence",
    [("1:4:sigkill,3:4:segv", ("killed by SIGKILL", "killed by SIGSEGV")), ("2:4:exit1", ("exit code 1",))],
    ids=["sigkill-and-segfault", "exit1"],
)
def test_failed_rank_restarts_the_job_to_completion(launcher, fault_free_checksum, fault, evidence):
    assert run_with_fault(launcher, fault) == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3]
    for result in results.values():
        assert result["step"] == STEPS
        assert result["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert result["env"]["FTRUN_GENERATION"] == "1"
        assert result["checksum"] == fault_free_checksum
    host_output = launcher.nodes[0].output + launcher.nodes[1].output
    assert "1 of 2 restarts used" in host_output  # ranks failing together cost one restart
    for spec, said in zip(fault.split(","), evidence):
        assert re.search(rf"rank {spec.split(':')[0]} \(local rank \d\) on node \d \(\S+\), pid \d+: {said}", host_output)


def test_restarted_gloo_group_reforms_without_stale_keys_pytorch_135712(launcher):
    """torchrun's shared store hands restarted workers the previous attempt's keys; ours must not."""
    # fail in generations 0 and 1: the third generation must still form its group and finish
    codes = run_with_fault(launcher, "0:3:exit1", max_restarts=2, restarts="0,1")
    assert codes == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3]
    assert {r["allreduce"] for r in results.values()} == {0.0 + 1 + 2 + 3}
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in results.values()} == {"2"}
    # each generation's workers met at a store of their own: no key of an earlier attempt to read
    ports = {}
    for path in launcher.out_dir.glob("start-r*-rank*.json"):
        ports.setdefault(path.name.split("-")[1], set()).add(json.loads(path.read_text())["MASTER_PORT"])
    assert sorted(ports) == ["r0", "r1", "r2"]
    assert all(len(p) == 1 for p in ports.values())
    assert len(set.union(*ports.values())) == 3


def test_budget_exhausted_fails_with_the_root_cause_named(launcher):
    codes = run_with_fault(launcher, "3:2:raise", max_restarts=1, restarts="0,1")
    assert codes == [1, 1], launcher.output()
    host = next(n.output for n in launcher.nodes if "hosting it" in n.output)
    assert "job failed" in host
    assert "1 of 1 restart used" in host
    root = host[host.index("root cause"):]
    assert "rank 3 (local rank 1) on node 1" in root
    assert "exit code 1" in root
    assert "ValueError: injected failure at step 2" in root  # from the @record error file
    assert "retry budget spent" in host


def test_budget_zero_means_no_retry(launcher):
    codes = run_with_fault(launcher, "1:2:exit1", max_restarts=0)
    assert codes == [1, 1], launcher.output()
    assert not launcher.results()
    assert "0 of 0 restarts used" in launcher.output()
