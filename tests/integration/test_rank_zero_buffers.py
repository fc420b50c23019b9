"""Rank 0 replaced at process level: every rank's parameters, buffers (BatchNorm's running statistics)
and optimizer state end bit-identical to a fault-free run's.

ElasticDDP hands every rank the group's first rank's buffers at the end of each backward pass, so a
replacement rank 0 receives rank 0's buffers from whichever healthy rank sends the state; the healthy
ranks put back what the forward of the lost step did to theirs. 2 simulated nodes x 2 ranks.
"""

from __future__ import annotations

import pytest

from tests.conftest import WORKERS, Launcher

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
STEPS = 10


def run(launcher, flags=(), **env) -> list[int]:
    env = launcher.env(STEPS=str(STEPS), BATCHNORM="1", **env)
    launcher.start_job(2, 2, [ELASTIC], flags=["--recovery", "process", "--max-restarts", "3", *flags], env=env)
    return launcher.wait()


@pytest.fixture(scope="module")
def fault_free_digests(tmp_path_factory) -> dict[int, str]:
    runner = Launcher(tmp_path_factory.mktemp("batchnorm-fault-free"), "batchnorm-fault-free")
    # no step sleep, no warm standby: the digests depend on neither, and the run starts faster
    assert run(runner, flags=("--warm-standby", "0"), STEP_SLEEP="0") == [0, 0], runner.output()
    results = runner.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {STEPS}
    return {rank: result["digest"] for rank, result in results.items()}


def test_rank_zero_replaced_leaves_every_ranks_buffers_bit_identical(launcher, fault_free_digests):
    # rank 0 dies as step 4 begins, after the buffers of step 3 were broadcast from it; rank 1 (the
    # lowest healthy rank) sends the replacement its state
    assert run(launcher, FAULT="0:4:sigkill") == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3], launcher.output()
    assert results[0]["replacement"] == "1" and {results[r]["replacement"] for r in (1, 2, 3)} == {"0"}
    assert {r["step"] for r in results.values()} == {STEPS}
    assert "process-level repair into generation 1" in launcher.output()
    for rank, result in sorted(results.items()):
        assert result["digest"] == fault_free_digests[rank], (
            f"rank {rank}: parameters, buffers or optimizer state differ from the fault-free run's")
