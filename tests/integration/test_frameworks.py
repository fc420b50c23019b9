"""Process-level repair of jobs written for a framework's own training loop, on 2 simulated nodes x 2 ranks: a
Hugging Face Trainer (transformers + accelerate, DDP) and a Lightning Trainer (DDP), each as written for torchrun
(no line of ftrun's: ``--recovery process`` turns the integration on as the Trainer is made) and with ftrun's
line (``ftrun.elastic.hf.enable(trainer)`` after the Trainer is made, the ``Recovery()`` callback); and DeepSpeed
ZeRO-2 jobs (1 node x 2 ranks), with ``ftrun.elastic.integrations.deepspeed`` and through the Trainer's
``deepspeed=`` as written for torchrun, whose lost rank's optimizer partition comes from its snapshot.

Each job runs once without a fault, with ftrun's line (its 4 ranks on one node, in fresh interpreters, made once
for the module) and with rank 1 SIGKILLed: the job ends at its final step, only rank 1 was started again, every
rank's parameters and optimizer and scheduler state equal the fault-free run's bit for bit, and no step is redone.

transformers, accelerate and lightning are not ftrun's dependencies: scripts/test.sh installs them into
.frameworks (scripts/frameworks.txt) while the first tests run, and these tests wait for it
(FTRUN_TEST_FRAMEWORKS_INSTALL); without it they skip, saying why (on CI they fail).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, WORKERS, Launcher, free_port, unique_mark, wait_for
from tests.integration.test_layouts import commits, start_pids
from tests.parts import unavailable

pytestmark = pytest.mark.integration
HF = str(WORKERS / "hf_train.py")
LIGHTNING = str(WORKERS / "lightning_train.py")
LIGHTNING_PLAIN = str(WORKERS / "lightning_plain.py")
DEEPSPEED = str(WORKERS / "deepspeed_train.py")
DEEPSPEED_STATE = str(WORKERS / "deepspeed_state.py")
STEPS = 10
SAVE_STEPS = 4
FRAMEWORKS = ROOT / ".frameworks"
#: how long a test waits for scripts/test.sh's install of .frameworks, under way beside the first tests
INSTALL_DEADLINE = 600


def frameworks_path() -> str:
    """The folder that holds transformers, accelerate and lightning (scripts/test.sh installs it), for
    PYTHONPATH; or the test skips saying why (fails on CI, unless FTRUN_TEST_FRAMEWORKS=0 left it out)."""
    installer = os.environ.get("FTRUN_TEST_FRAMEWORKS_INSTALL", "")
    if installer.isdigit():
        wait_for(lambda: (FRAMEWORKS / "ready").exists() or not psutil.pid_exists(int(installer)), INSTALL_DEADLINE,
                 "scripts/test.sh's install of transformers, accelerate and lightning into .frameworks")
    if not (FRAMEWORKS / "ready").exists():
        unavailable("transformers, accelerate and lightning are not installed: scripts/test.sh installs them into "
                    ".frameworks (scripts/frameworks.txt)", wanted=os.environ.get("FTRUN_TEST_FRAMEWORKS", "1") != "0")
    return str(FRAMEWORKS)


@pytest.fixture(scope="module")
def frameworks() -> str:
    return frameworks_path()


def job_env(launcher: Launcher, frameworks: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH", ""), frameworks]))
    return launcher.env(PYTHONPATH=path, HF_HUB_OFFLINE="1", STEPS=str(STEPS), SAVE_STEPS=str(SAVE_STEPS), **extra)


def run(launcher: Launcher, frameworks: str, script: str = HF, nodes: int = 2, standbys: int = 1, **env: str) -> list[int]:
    """``standbys`` per agent: one, on the node of the rank the tests kill, is what a repair takes (each imports
    torch and the framework: on 2 cores, one per rank slowed every run)."""
    flags = ["--recovery", "process", "--max-restarts", "3", "--repair-timeout", "90", "--warm-standby", str(standbys)]
    launcher.start_job(nodes, 4 // nodes, [script], flags=flags, env=job_env(launcher, frameworks, **env))
    return launcher.wait()


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, frameworks):
    """Each script's fault-free run with the given environment (its results and its output folder), made once
    for the module."""
    made: dict[tuple, tuple[dict[int, dict], Path]] = {}

    def get(script: str = HF, **env: str) -> tuple[dict[int, dict], Path]:
        key = (script, *sorted(env.items()))
        if key not in made:
            name = Path(script).stem
            runner = Launcher(tmp_path_factory.mktemp(f"{name}-fault-free"), unique_mark(f"{name}-fault-free"))
            try:
                assert run(runner, frameworks, script, nodes=1, standbys=0, STEP_SLEEP="0", **env) == [0], \
                    runner.output()
                made[key] = runner.results(), runner.out_dir
            finally:
                runner.kill_all()
            assert sorted(made[key][0]) == [0, 1, 2, 3]
        return made[key]

    return get


def assert_repaired(launcher: Launcher, reference: dict[int, dict], first: int = 0):
    """Rank 1 alone was replaced, every rank ends bit for bit as in ``reference``, and no step from ``first`` on
    ran twice."""
    output = launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3], output
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == {rank: r["digest"] for rank, r in reference.items()}
    pids = start_pids(launcher)
    for rank, result in results.items():
        if rank == 1:
            assert result["replacement"] == "1" and len(pids[1]) == 2 and result["pid"] in pids[1]
        else:  # the healthy ranks lived through the repair in one process
            assert pids[rank] == [result["pid"]] and result["replacement"] == "0", (rank, pids, output)
        assert sorted(commits(launcher, rank)) == list(range(first, STEPS)), (rank, commits(launcher, rank))
    assert "process-level repair into generation 1" in output and "falling back to job level" not in output
    assert "generation 1 resumed training" in output


def test_a_trainer_s_lost_rank_is_replaced_alone_and_the_job_ends_as_a_fault_free_run(launcher, frameworks,
                                                                                      fault_free):
    # the script as written for torchrun (PLAIN=1), against the fault-free run with ftrun's line
    reference, folder = fault_free()
    assert run(launcher, frameworks, FAULT="1:5:sigkill", PLAIN="1") == [0, 0], launcher.output()
    assert_repaired(launcher, reference)
    # save_steps' checkpoints and the logs went on: the same checkpoints, the same logged losses (the first
    # log after the repair takes rank 1's share of the mean from its source: near, not equal)
    assert sorted(p.name for p in (launcher.out_dir / "checkpoints").iterdir()) == \
        sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    for rank, result in launcher.results().items():
        assert result["losses"] == pytest.approx(reference[rank]["losses"], rel=1e-3)


def test_a_replacement_joins_at_its_peers_step_not_at_the_script_s_checkpoint(launcher, frameworks, fault_free):
    # train(resume_from_checkpoint=checkpoint-4) in every rank; rank 1 lost at step 6: its replacement takes
    # steps 6.. from its peers, as the Trainer's own resume gives the fault-free run's state bit for bit. The
    # script has ftrun's line where users put it, after the Trainer is made (issue 52: it ended every rank)
    reference, folder = fault_free()
    checkpoint = folder / "checkpoints" / f"checkpoint-{SAVE_STEPS}"
    assert run(launcher, frameworks, FAULT="1:6:sigkill", RESUME=str(checkpoint)) == [0, 0], launcher.output()
    assert_repaired(launcher, reference, first=SAVE_STEPS)


def test_without_ftrun_the_line_does_nothing(tmp_path, frameworks):
    # plain torchrun, 2 ranks: the Trainer trains as it would without ftrun.elastic.hf
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT_DIR=str(out), PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"),
                                                                                      frameworks])),
               HF_HUB_OFFLINE="1", STEPS="4", STEP_SLEEP="0", FAULT="")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), HF], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [(out / f"rank{rank}.json").read_text() for rank in (0, 1)]
    assert all('"step": 4' in r and '"replacement": null' in r for r in results)


def test_a_lightning_job_s_lost_rank_is_replaced_alone_and_the_job_ends_as_a_fault_free_run(launcher, frameworks,
                                                                                            fault_free):
    # 2 batches an optimizer step (accumulate_grad_batches), 4 batches an epoch: rank 1 is lost as step 5's second
    # batch begins, in the second half of the third epoch: the healthy ranks take the step again from its first
    # batch, the replacement skips the 2 batches its epoch already stepped on. The script as written for torchrun
    # (PLAIN=1: no import, no callback), against the fault-free run with the callback
    reference, folder = fault_free(LIGHTNING, ACCUMULATE="2")
    assert run(launcher, frameworks, LIGHTNING, FAULT="1:5:sigkill", ACCUMULATE="2", PLAIN="1") == [0, 0], \
        launcher.output()
    assert_repaired(launcher, reference)
    # ModelCheckpoint's saves every SAVE_STEPS steps and the CSVLogger's went on: the same checkpoints, holding
    # the same state, and the same logged losses
    names = [f"epoch=1-step={SAVE_STEPS}.ckpt", f"epoch=3-step={2 * SAVE_STEPS}.ckpt"]
    assert sorted(p.name for p in (launcher.out_dir / "checkpoints").iterdir()) == names
    assert {rank: r["checkpoints"] for rank, r in launcher.results().items()} == \
        {rank: r["checkpoints"] for rank, r in reference.items()}
    assert sorted(reference[0]["checkpoints"]) == names
    logged = (folder / "logs" / "version_0" / "metrics.csv").read_text()
    assert len(logged.splitlines()) == 1 + STEPS  # a header, a row a step
    assert (launcher.out_dir / "logs" / "version_0" / "metrics.csv").read_text() == logged


def test_the_lightning_integration_leaves_a_fault_free_run_bit_for_bit_as_it_was(tmp_path_factory, frameworks):
    # issue 52 items 2 and 3: a script of a user's (LayerNorm, AdamW, a StepLR a step, a DataLoader with a
    # generator of its own, deterministic=True, a ModelCheckpoint), run without a fault on 3 ranks: under
    # torchrun; under ftrun as written for torchrun (the integration turned on as its Trainer is made); under
    # ftrun --no-integrations with the import and the callback (the script's own line still works): the same
    # state bit for bit. With more than two ranks, gloo's ring all-reduce sums each part of DDP's bucket from
    # another rank: ftrun's bucket layout of its own (parameter order, from the first step) changed the last bits
    # where DDP's (the order rank 0's gradients came in) did not
    flags = ["--recovery", "process", "--warm-standby", "0"]
    runs = {}
    for name, integration, extra in (("auto", "0", []), ("line", "1", ["--no-integrations"])):
        runner = Launcher(tmp_path_factory.mktemp(f"plain-{name}"), unique_mark(f"plain-{name}"))
        runner.start_job(1, 3, [LIGHTNING_PLAIN], flags=flags + extra,
                         env=job_env(runner, frameworks, INTEGRATION=integration))
        runs[name] = runner
    torchrun = tmp_path_factory.mktemp("plain-torchrun")
    env = dict(job_env(runs["auto"], frameworks, INTEGRATION="0"), OUT_DIR=str(torchrun))
    own = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
                            str(free_port()), LIGHTNING_PLAIN], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        said = own.communicate(timeout=300)[0]
        assert own.returncode == 0, said
        for runner in runs.values():
            assert runner.wait() == [0], runner.output()
        results = {name: runner.results() for name, runner in runs.items()}
    finally:
        own.kill()
        for runner in runs.values():
            runner.kill_all()
    results["torchrun"] = {rank: json.loads((torchrun / f"rank{rank}.json").read_text()) for rank in range(3)}
    assert {r["step"] for r in results["torchrun"].values()} == {STEPS}
    assert len({r["digest"] for r in results["torchrun"].values()}) == 1
    for name in ("auto", "line"):
        assert {r["digest"] for r in results[name].values()} == {r["digest"] for r in results["torchrun"].values()}
        assert all(r["recovery"] for r in results[name].values()), name
    assert not any(r["recovery"] for r in results["torchrun"].values())


def assert_rank_1_alone_replaced_as_the_reference_ended(launcher: Launcher, reference: Launcher) -> str:
    """1 x 2 ranks with ZeRO's partitions (each rank's own): rank 1 alone was started again, at process level, and
    both ranks ended bit for bit as the fault-free reference. The job's output."""
    output, results, expected = launcher.output(), launcher.results(), reference.results()
    assert sorted(results) == sorted(expected) == [0, 1], output
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == {rank: r["digest"] for rank, r in expected.items()}
    assert expected[0]["digest"] != expected[1]["digest"]  # each rank's own partition
    pids = start_pids(launcher)
    assert pids[0] == [results[0]["pid"]] and results[0]["replacement"] == "0", (pids, output)
    assert len(pids[1]) == 2 and results[1]["pid"] in pids[1] and results[1]["replacement"] == "1"
    assert "process-level repair into generation 1" in output and "falling back to job level" not in output
    return output


def test_a_deepspeed_zero2_job_s_lost_rank_is_replaced_alone_and_gets_its_partition_from_its_snapshot(
        tmp_path_factory, launcher, frameworks):
    # 1 node x 2 ranks, ZeRO-2 (each rank alone holds its half of the optimizer's state), 2 micro-batches a step,
    # dropout; rank 1 SIGKILLed as step 4 begins. The fault-free run (beside it) takes no snapshots: rank 0 says
    # in one line as training begins that a fault would restart the job
    reference = Launcher(tmp_path_factory.mktemp("deepspeed-fault-free"), unique_mark("deepspeed-fault-free"))
    reference.start_job(1, 2, [DEEPSPEED], flags=["--recovery", "process"],
                        env=job_env(reference, frameworks, STEP_SLEEP="0"))
    flags = ["--recovery", "process", "--max-restarts", "3", "--repair-timeout", "90", "--snapshot-every", "1"]
    launcher.start_job(1, 2, [DEEPSPEED], flags=flags, env=job_env(launcher, frameworks, FAULT="1:4:sigkill"))
    try:
        assert reference.wait() == [0], reference.output()
        assert launcher.wait() == [0], launcher.output()
    finally:
        reference.kill_all()
    assert "DeepSpeed ZeRO stage 2 keeps one copy of each rank's optimizer state" in reference.output()
    output = assert_rank_1_alone_replaced_as_the_reference_ended(launcher, reference)
    assert "generation 1 resumed training" in output and "keeps one copy" not in output
    # every rank went back to the newest step both hold a snapshot of: the lost step, or the one before it
    for rank in (0, 1):
        starts = [int(line) for line in (launcher.out_dir / f"starts-rank{rank}").read_text().split()]
        assert sorted(set(starts)) == list(range(STEPS)) and len(starts) - STEPS in (1, 2), (rank, starts)


def test_a_trainer_s_deepspeed_zero2_lost_rank_is_replaced_alone_from_its_snapshot(tmp_path_factory, launcher,
                                                                                   frameworks):
    # the Trainer's deepspeed= (ZeRO-2), 1 node x 2 ranks, the script as written for torchrun (PLAIN=1): rank 1
    # SIGKILLed as step 5 begins; both ranks go back to the newest step both hold a snapshot of and end bit for
    # bit as the fault-free run under the same flags (beside it)
    flags = ["--recovery", "process", "--max-restarts", "3", "--repair-timeout", "90", "--snapshot-every", "1"]
    reference = Launcher(tmp_path_factory.mktemp("hf-deepspeed-fault-free"), unique_mark("hf-deepspeed-fault-free"))
    reference.start_job(1, 2, [HF], flags=flags, env=job_env(reference, frameworks, ZERO="2", PLAIN="1",
                                                             STEP_SLEEP="0"))
    launcher.start_job(1, 2, [HF], flags=flags, env=job_env(launcher, frameworks, ZERO="2", PLAIN="1",
                                                            FAULT="1:5:sigkill"))
    try:
        assert reference.wait() == [0], reference.output()
        assert launcher.wait() == [0], launcher.output()
    finally:
        reference.kill_all()
    output = assert_rank_1_alone_replaced_as_the_reference_ended(launcher, reference)
    assert "generation 1 resumed training" in output and "job level" not in reference.output()
    # at most the lost step and the one before it ran again
    for rank in (0, 1):
        done = sorted(commits(launcher, rank))
        assert sorted(set(done)) == list(range(STEPS)) and len(done) - STEPS in (0, 1), (rank, done)


def test_each_zero_stage_s_state_goes_through_a_snapshot_and_back_bit_for_bit(tmp_path, frameworks):
    # one process, world size 1: for ZeRO 1, 2 and 3, the engine's state (model or parameter partitions, fp32
    # master partitions, moments, LR scheduler, counters, RNG) written to a real snapshot file and loaded back
    # after 3 more steps; those 3 steps run again end bit for bit as the first time
    env = dict(os.environ, OUT_DIR=str(tmp_path), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT), frameworks])))
    done = subprocess.run([sys.executable, DEEPSPEED_STATE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["stage"] for row in rows] == [1, 2, 3], done.stdout + done.stderr
    for row in rows:
        assert row["back"] == row["at_snapshot"] != row["went_on"] == row["again"], row
        assert row["steps"] == 5
