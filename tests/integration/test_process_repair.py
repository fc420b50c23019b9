"""Process-level recovery on 2 simulated nodes x 2 ranks: only failed ranks are replaced.

Rank 0's replacement is checked with a BatchNorm in the model too: ElasticDDP hands every rank the group's
first rank's buffers at the end of each backward pass, so a replacement rank 0 receives rank 0's buffers
from whichever healthy rank sends the state, and the healthy ranks put back what the forward of the lost
step did to theirs; every rank's parameters, buffers and optimizer state end bit-identical to a fault-free
run's.
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import WORKERS, Launcher, step_reached, unique_mark, wait_for
from tests.links import can_cut_links, cut_links
from tests.parts import unavailable

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
STEPS = 10


def run(launcher, max_restarts: int = 3, script: str = ELASTIC, repair_timeout: int = 60, flags=(), nodes: int = 2,
        **env):
    """The job's 4 ranks on 2 nodes, or on 1 (``nodes``)."""
    env = launcher.env(STEPS=str(STEPS), **env)
    flags = ["--recovery", "process", "--max-restarts", str(max_restarts), "--repair-timeout", str(repair_timeout),
             *flags]
    launcher.start_job(nodes, 4 // nodes, [script], flags=flags, env=env)
    return launcher.wait()


def fault_free_run(tmp_path_factory, name: str, **env) -> dict[int, dict]:
    """Every rank's result of the job run without a fault."""
    runner = Launcher(tmp_path_factory.mktemp(name), unique_mark(name))
    # one agent (its ranks forked from its warm interpreter), no step sleep: the reference depends on neither, and
    # the run starts faster
    assert run(runner, nodes=1, STEP_SLEEP="0", **env) == [0], runner.output()
    results = runner.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {STEPS}
    return results


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    return fault_free_run(tmp_path_factory, "elastic-fault-free")[0]["checksum"]


@pytest.fixture(scope="module")
def fault_free_batchnorm(tmp_path_factory) -> dict[int, dict]:
    return fault_free_run(tmp_path_factory, "batchnorm-fault-free", BATCHNORM="1")


def start_pids(launcher) -> dict[int, list[int]]:
    pids: dict[int, list[int]] = {}
    for path in launcher.out_dir.glob("pid-start-rank*"):
        rank, pid = path.name[len("pid-start-rank"):].split("-")
        pids.setdefault(int(rank), []).append(int(pid))
    return pids


def assert_repaired(launcher, fault_free, replaced: set[int], restarts: int, max_restarts: int = 3):
    """Every rank and each replacement forked from its node's warm interpreter."""
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3], launcher.output()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == {fault_free}  # bit-identical to the fault-free run
    pids = start_pids(launcher)
    for rank, result in results.items():
        if rank in replaced:
            assert result["replacement"] == "1" and len(pids[rank]) >= 2 and result["pid"] in pids[rank]
        else:  # healthy ranks lived through the repair: one process from start to end
            assert pids[rank] == [result["pid"]] and result["replacement"] == "0"
    output = launcher.output()
    assert f"{restarts} of {max_restarts} restarts used" in output
    assert "process-level repair into generation 1" in output
    # the phase breakdown (a fault during the rollback carries the repair on into generation 2)
    assert re.search(r"generation [12] resumed training [0-9.]+s after the fault \(detect .* rollback [0-9]+ ms\)", output)
    forked = re.findall(r"rank (\d) forked from the node's warm interpreter", output)
    assert all(forked.count(str(rank)) >= 2 if rank in replaced else forked.count(str(rank)) == 1 for rank in range(4)), forked


@pytest.mark.parametrize("kind", ["sigkill", "exit1"])
def test_one_failed_rank_is_replaced_while_the_others_live_on(launcher, fault_free, kind):
    assert run(launcher, FAULT=f"1:4:{kind}") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free, replaced={1}, restarts=1)


def test_two_ranks_failing_at_once_cost_one_repair(launcher, fault_free):
    # the long step 3 leaves time for both ranks to finish its all-reduce before either fails
    # (ranks 1 and 2 are on different nodes: one standby each)
    codes = run(launcher, FAULT="1:4:sigkill,2:4:exit1")
    assert codes == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free, replaced={1, 2}, restarts=1)


def test_rank_zero_on_the_controller_node_is_replaced_too_and_every_ranks_buffers_end_bit_identical(
        launcher, fault_free_batchnorm):
    # rank 0 dies as step 4 begins, after the buffers of step 3 were broadcast from it; rank 1 (the
    # lowest healthy rank) sends the replacement its state
    assert run(launcher, BATCHNORM="1", FAULT="0:4:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free_batchnorm[0]["checksum"], replaced={0}, restarts=1)
    for rank, result in sorted(launcher.results().items()):
        assert result["digest"] == fault_free_batchnorm[rank]["digest"], (
            f"rank {rank}: parameters, buffers or optimizer state differ from the fault-free run's")


def test_a_rank_lost_at_step_0_is_replaced_from_the_warm_interpreter_too(launcher, fault_free):
    # rank 1 dies as step 0 begins, before any rank committed one: the warm interpreter its node's ranks were
    # forked from forks its replacement, which receives step 0's state from a healthy rank
    assert run(launcher, FAULT="1:0:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free, replaced={1}, restarts=1)


def test_fault_during_the_repair_is_absorbed(launcher, fault_free):
    # the replacement for rank 3 dies right after joining the repair; a second replacement finishes it
    assert run(launcher, FAULT="3:4:sigkill", FAULT_REPLACEMENT="3") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free, replaced={3}, restarts=1)
    assert "injecting sigkill into a replacement" in launcher.output()


def test_script_without_the_library_falls_back_to_job_level(launcher):
    codes = run(launcher, script=str(WORKERS / "train.py"), FAULT="1:3:exit1")
    assert codes == [0, 0], launcher.output()
    output = launcher.output()
    assert "not every rank runs ftrun.elastic" in output and "using job-level recovery" in output
    assert {r["env"]["TORCHELASTIC_RESTART_COUNT"] for r in launcher.results().values()} == {"1"}


def test_every_rank_lost_goes_to_job_level_without_a_process_level_repair(launcher, fault_free):
    # every rank dies in the same step (the long step 3 lets every rank finish its all-reduce before the
    # first one dies): no healthy replica can hand the state on, so once the failures of every rank are
    # in, the controller restarts at job level (it used to replace every rank at process level first and
    # fall back only when their rollback found nobody to take the state from)
    faults = ",".join(f"{rank}:4:sigkill" for rank in range(4))
    assert run(launcher, FAULT=faults, STEP_SLEEP="0.5", SLOW_STEPS="3") == [0, 0], launcher.output()
    output = launcher.output()
    # the generation it restarts as: 1, or later where the last deaths were reported after the first ones'
    # replacements started (a busy machine), each carrying the repair into a new generation first
    assert re.search(r"job-level repair into generation \d+: rank \d .*; every rank failed, no healthy replica "
                     r"holds the training state", output), output
    assert "falling back to job level" not in output  # no process-level repair got as far as its rollback
    assert "resumed training" not in output
    assert re.search(r"generation \d+ back in training [0-9.]+s after the fault", output), output
    assert "1 of 3 restarts used" in output  # one recovery, one unit of budget
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {r["replacement"] for r in results.values()} == {"0"}  # every rank started anew
    assert {r["checksum"] for r in results.values()} == {fault_free}  # a job-level restart from step 0


def test_repair_past_its_deadline_falls_back_to_job_level(launcher, fault_free):
    # the healthy ranks wait for the replacement longer than --heartbeat-timeout: their heartbeats must
    # go on meanwhile (they have a store connection of their own), or they would be killed as hung
    codes = run(launcher, FAULT="2:4:sigkill", HANG_REPLACEMENT="2", repair_timeout=6,
                flags=("--heartbeat-timeout", "3"))
    assert codes == [0, 0], launcher.output()
    output = launcher.output()
    assert "is hung" not in output
    assert "the repair did not finish within 6s" in output and "falling back to job level" in output
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == {fault_free}
    assert "2 of 3 restarts used" in output  # the repair, then the job-level restart


def test_a_link_cut_while_every_process_lives_is_repaired_in_place(launcher, fault_free_batchnorm):
    # 1 node x 4 ranks; at step 3 every connection between rank 1 and its peers is reset by the kernel (its
    # store connections stay): the online level re-forms the groups and rolls back, no process is replaced
    why = can_cut_links()
    if why:
        unavailable(why)
    env = launcher.env(STEPS=str(STEPS), BATCHNORM="1", STEP_SLEEP="0.2")
    flags = ["--recovery", "process", "--max-restarts", "3", "--warm-standby", "0"]
    launcher.start_job(1, 4, [ELASTIC], flags=flags, env=env)
    wait_for(lambda: step_reached(launcher.out_dir, 1) >= 3
             and len(start_pids(launcher)) == 4, what="rank 1 at step 3")
    pids = {rank: found[0] for rank, found in start_pids(launcher).items()}
    assert cut_links(pids[1], [pids[rank] for rank in (0, 2, 3)]) >= 3  # one connection to each peer at least
    assert launcher.wait() == [0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {STEPS}
    for rank, result in results.items():
        assert result["digest"] == fault_free_batchnorm[rank]["digest"], (
            f"rank {rank}: parameters, buffers or optimizer state differ from the fault-free run's")
    assert start_pids(launcher) == {rank: [pid] for rank, pid in pids.items()}  # no process started
    assert {r["pid"] for r in results.values()} == set(pids.values())
    output = launcher.output()
    assert output.count("online repair into generation 1: a collective of rank") == 1, output  # the level, once
    assert "process-level repair" not in output and "job-level" not in output
    assert re.search(r"generation 1 resumed training [0-9.]+s after the fault \(detect .*\), repaired online", output)
    assert "1 of 3 restarts used" in output
