"""MindSpore jobs (the CPU build, real schedulers and workers on loopback), launched as msrun launches them and
restarted at job level: a worker SIGKILLed on 2 nodes x 2 workers started with msrun's flags; the scheduler
killed on 1 node x 2 workers; a worker SIGKILLed in a job that snapshots through ftrun.mindspore_elastic;
bad input.

MindSpore is about 2.5 GB and wants numpy<2, so it lives in an interpreter of its own: FTRUN_TEST_MINDSPORE_PYTHON,
else .msvenv/bin/python in the repository (scripts/test.sh makes it), else ftrun's own python or python on PATH
when either has it. The tests skip, saying so, when none does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from ftrun.mindspore import worker_python
from tests.conftest import ROOT, WORKERS, free_port, ftrun_status, marked_processes, wait_for
from tests.integration.test_bad_input import assert_one_clear_line
from tests.parts import MINDSPORE_WANTED, unavailable

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "ms_train.py")
STEPS = 12


#: how long a test waits for scripts/test.sh's install of .msvenv, under way beside the first tests
INSTALL_DEADLINE = 900


def mindspore_python() -> str:
    """The interpreter with mindspore ("" if none): FTRUN_TEST_MINDSPORE_PYTHON, else .msvenv once complete
    (scripts/test.sh installs it while the first tests run: FTRUN_TEST_MINDSPORE_INSTALL is that install's
    pid), else ftrun's own python or python on PATH."""
    given = os.environ.get("FTRUN_TEST_MINDSPORE_PYTHON", "")
    local = ROOT / ".msvenv"
    installer = os.environ.get("FTRUN_TEST_MINDSPORE_INSTALL", "")
    if not given and installer.isdigit():
        wait_for(lambda: (local / "ready").exists() or not psutil.pid_exists(int(installer)), INSTALL_DEADLINE,
                 "scripts/test.sh's install of mindspore into .msvenv")
    ready = str(local / "bin" / "python") if (local / "ready").exists() else ""
    return worker_python(given or ready, sys.executable)


def needs_mindspore() -> str:
    """The interpreter with mindspore, or the test skips saying why (on CI, unless FTRUN_TEST_MINDSPORE=0
    left MindSpore out, it fails: scripts/test.sh installs it there)."""
    found = mindspore_python()
    if not found:
        unavailable("mindspore is not installed for any python here: scripts/test.sh makes .msvenv "
                    "(mindspore==2.10.0, numpy<2), or set FTRUN_TEST_MINDSPORE_PYTHON", wanted=MINDSPORE_WANTED)
    return found


@pytest.fixture(scope="module")
def python() -> str:
    return needs_mindspore()


def expected_checksum(size: int) -> float:
    """What ms_train.py's parameters sum to: every rank's gradient, averaged, over every step."""
    mean_per_step = sum(range(8)) * (size + 1) / 2  # the ranks' (r + 1) * arange(8), averaged
    return round(-0.01 * (STEPS * mean_per_step + 8 * sum(range(STEPS))), 2)


def check_results(launcher, size: int, restart: str) -> dict[int, dict]:
    results = launcher.results()
    assert sorted(results) == list(range(size)), launcher.output()
    for rank, result in results.items():
        assert result["step"] == STEPS and result["size"] == size and result["restart"] == restart
        assert round(result["checksum"], 2) == expected_checksum(size)
        env = result["env"]
        assert env["MS_ROLE"] == "MS_WORKER" and env["MS_NODE_ID"] == env["RANK_ID"] == str(rank)
        assert env["MS_WORKER_NUM"] == env["RANK_SIZE"] == str(size)
    assert len({r["env"]["MS_SCHED_PORT"] for r in results.values()}) == 1  # one scheduler per generation
    return results


def test_msrun_s_command_line_on_two_nodes_restarts_a_sigkilled_worker_at_job_level(launcher, python):
    port = free_port()
    msrun_flags = ["--worker_num=4", "--local_worker_num=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                   "--join=True", "--cluster_time_out=60", f"--log_dir={launcher.tmp / 'logs'}"]
    env = launcher.env(STEPS=str(STEPS), FAULT="3:4:sigkill", FAULT_RESTARTS="0")
    for _ in range(2):
        launcher.start([*msrun_flags, "--run-id", launcher.mark, "--python", python, "--max-restarts", "2",
                        "--monitor-interval", "0.05", "--status", "plain", TRAIN], env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    results = check_results(launcher, 4, restart="1")
    assert {r["env"]["DEVICE_ID"] for r in results.values()} == {"0", "1"}
    assert {r["env"]["MS_TOPO_TIMEOUT"] for r in results.values()} == {"60"}
    output = launcher.output()
    assert "rank 3 failed: killed by SIGKILL" in output
    assert "MindSpore scheduler of generation 1" in output
    assert "job succeeded" in output and "1 of 2 restarts used" in output
    # as msrun does with --log_dir, every worker's output is in a file there too (per node and restart)
    logs = sorted(str(p.relative_to(launcher.tmp / "logs")) for p in (launcher.tmp / "logs").rglob("stdout.log"))
    schedulers = [log for log in logs if "/scheduler/" in log]
    assert len(logs) == 10 and len(schedulers) == 2, logs  # 4 ranks and a scheduler, 2 generations

def test_the_scheduler_killed_restarts_it_and_every_worker_on_a_fresh_port(launcher, python):
    out = launcher.out_dir
    env = launcher.env(STEPS=str(STEPS), STEP_SLEEP="0.3")
    node = launcher.start(["--standalone", "--nproc-per-node", "2", "--framework", "mindspore", "--python", python,
                           "--max-restarts", "1", "--monitor-interval", "0.05", "--status", "plain", TRAIN], env=env)

    def progress() -> tuple[int, int]:
        """Rank 0's steps done, and in which restart."""
        try:
            _, step, restart = (out / "progress0").read_text().split()
            return int(step), int(restart)
        except (OSError, ValueError):
            return 0, 0

    wait_for(lambda: progress()[0] >= 3, timeout=120, what="the workers' third step")
    fault_step = progress()[0]
    scheduler = json.loads((out / "scheduler0.json").read_text())["pid"]
    os.kill(scheduler, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: progress()[1] == 1 and progress()[0] > fault_step, timeout=120, what="training past the fault")
    print(f"back past step {fault_step} {time.monotonic() - killed_at:.1f}s after the scheduler's SIGKILL")
    assert launcher.wait() == [0], launcher.output()
    results = check_results(launcher, 2, restart="1")
    schedulers = [json.loads((out / f"scheduler{restart}.json").read_text()) for restart in (0, 1)]
    assert schedulers[1]["pid"] != scheduler
    assert schedulers[0]["env"]["MS_SCHED_PORT"] != schedulers[1]["env"]["MS_SCHED_PORT"]  # a fresh port
    for seen in schedulers:
        assert seen["env"]["MS_ROLE"] == "MS_SCHED" and seen["env"]["RANK_ID"] == "0"
        assert seen["env"]["MS_WORKER_NUM"] == seen["env"]["RANK_SIZE"] == "2"
    for rank, result in results.items():  # the workers of the restart, at the new scheduler
        assert (result["env"]["MS_SCHED_HOST"], result["env"]["MS_SCHED_PORT"]) == \
            ("127.0.0.1", schedulers[1]["env"]["MS_SCHED_PORT"])
        assert result["env"]["DEVICE_ID"] == str(rank)
    output = node.output
    assert "the MindSpore scheduler failed: killed by SIGKILL" in output
    assert f"the MindSpore scheduler on node 0 ({os.uname().nodename}), pid {scheduler}: killed by SIGKILL" in output
    assert "job succeeded" in output and "1 of 1 restart used" in output
    assert "MindSpore scheduler of generation 1" in output


BOTH = "import torch\nimport mindspore\n"
BAD_INPUT = [
    # (id, args before the script, the script's text, words the line must say)
    ("not-a-multiple", ["--worker_num=3", "--local_worker_num=2"], "", "--worker_num 3 is not a multiple"),
    ("msrun-with-torch", ["--worker_num=2", "--local_worker_num=2", "--framework", "torch"], "",
     "are msrun's, for a MindSpore job: they do not go with --framework torch"),
    ("join-word", ["--worker_num=2", "--local_worker_num=2", "--join=yes"], "", "--join must be True or False"),
    ("imports-both", ["--standalone"], BOTH, "imports both torch and mindspore"),
    ("from-a-head-node", ["--hostfile", "hosts", "--framework", "mindspore"], "",
     "does not run from a head node (--hostfile) under the c10d store"),
]


@pytest.mark.parametrize("args, text, words", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_mindspore_input_gets_one_clear_line(ftrun_cli, tmp_path, args, text, words):
    (tmp_path / "hosts").write_text("n01\n")
    (tmp_path / "train.py").write_text(text)
    returncode, _, stderr = ftrun_cli(*args, "train.py")
    assert returncode == 2, stderr
    assert_one_clear_line(stderr, words)


def test_msrun_s_flags_from_a_head_node_under_etcd_start_each_host_s_agent_as_msrun_places_it(ftrun_cli, tmp_path):
    (tmp_path / "hosts").write_text("n01 slots=8\nn02 slots=8\n")
    code, out, err = ftrun_cli("--hostfile", "hosts", "--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379",
                               "--worker_num=4", "--local_worker_num=2", "--cluster_time_out=60",
                               "--remote-cwd", str(tmp_path), "--dry-run", "train.py")
    assert code == 0, err
    agents = [shlex.split(shlex.split(line)[-1]) for line in out.splitlines() if line.startswith("ssh ")]
    assert len(agents) == 2
    for node_rank, words in enumerate(agents):
        flags = dict(zip(words, words[1:]))
        assert flags["--framework"] == "mindspore" and flags["--rdzv-backend"] == "etcd"
        assert flags["--nproc-per-node"] == "2" and flags["--node-rank"] == str(node_rank)
        assert flags["--cluster-time-out"] == "60"
        assert "--master-port" not in flags  # the hostfile places the job: msrun's default port is not given


@pytest.mark.skipif(worker_python(sys.executable, sys.executable) != "", reason="ftrun's own python has mindspore")
def test_mindspore_in_a_python_without_it_gets_one_clear_line(ftrun_cli, tmp_path):
    (tmp_path / "train.py").write_text("import mindspore\n")
    returncode, _, stderr = ftrun_cli("--standalone", "--python", sys.executable, "train.py")
    assert returncode == 2, stderr
    assert_one_clear_line(stderr, f"the workers' python cannot import mindspore (--python {sys.executable})")


def test_a_mindspore_script_launched_as_torch_fails_once_saying_which_flag(launcher, python):
    node = launcher.start(["--standalone", "--nproc-per-node", "2", "--framework", "torch", "--python", python,
                           "--max-restarts", "2", "--status", "plain", TRAIN], env=launcher.env(STEPS="1"))
    assert launcher.wait() == [1], node.output
    assert "found no MindSpore cluster (launch it with --framework mindspore)" in node.output
    assert "0 of 2 restarts used" in node.output  # a setting: no retry would help
    assert not marked_processes(launcher.mark)


SNAPSHOT_TRAIN = str(WORKERS / "ms_snapshot_train.py")
EVERY = 3


def test_a_sigkilled_worker_s_job_resumes_from_snapshots_and_ends_as_a_fault_free_run(launcher, python):
    """ftrun.mindspore_elastic under --snapshot-every: the restart redoes at most K steps, its parameters and
    Adam's state end bit-identical to a fault-free run's (run beside it), and the persisted .ckpt files are
    MindSpore's own."""
    out, reference, checkpoints = launcher.out_dir, launcher.tmp / "reference", launcher.tmp / "checkpoints"
    reference.mkdir()
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # the MindSpore python's ftrun
    flags = ["--standalone", "--nproc-per-node", "2", "--framework", "mindspore", "--python", python,
             "--max-restarts", "1", "--monitor-interval", "0.05", "--status", "plain",
             "--snapshot-every", str(EVERY), "--replicate-every", str(EVERY)]
    faulty = launcher.start([*flags, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", str(2 * EVERY),
                             SNAPSHOT_TRAIN], env=launcher.env(STEPS=str(STEPS), FAULT="1:8:sigkill", PYTHONPATH=pythonpath))
    # its steps slower (the restart of the faulty run beside it takes longer still): ftrun status sees them run
    fault_free = launcher.start([*flags, SNAPSHOT_TRAIN], env=launcher.env(STEPS=str(STEPS), STEP_SLEEP="0.3", DUMP="1",
                                                                         OUT_DIR=str(reference), PYTHONPATH=pythonpath))
    endpoint = wait_for(lambda: re.search(r"joined the store at (\S+)", fault_free.output), timeout=120,
                        what="the fault-free run's store").group(1)
    watcher = ftrun_status(endpoint, "--json", "--watch", "--interval", "0.3", into=launcher.tmp / "status")
    assert launcher.wait() == [0, 0], launcher.output()
    watcher.wait(timeout=60)
    # each rank's step times reach the job's status through its agent: all of it compute, its wait 0 (MindSpore's
    # collectives run inside its graph, where the library times nothing)
    timed = [rank for line in (launcher.tmp / "status.out").read_text().splitlines() for rank in json.loads(line)["ranks"]
             if rank["timed_steps"]]
    assert {rank["rank"] for rank in timed} == {0, 1}, (launcher.tmp / "status.out").read_text()
    assert all(r["step_s"] >= 0.3 and r["compute_s"] == r["step_s"] and r["wait_s"] == 0 for r in timed), timed
    assert "1 of 1 restart used" in faulty.output and "0 of 1 restart used" in fault_free.output
    # the ranks' progress reaches the controller through their agents: the summary names the last step run
    for run in (faulty, fault_free):
        assert "job succeeded in " in run.output and f"at step {STEPS};" in run.output, run.output

    done_before = max(int((out / f"progress{rank}-0").read_text()) for rank in (0, 1))
    resumed_at = {int((out / f"begin{rank}-1").read_text()) for rank in (0, 1)}
    assert resumed_at == {2 * EVERY}, faulty.output  # the newest snapshot both ranks held before the fault at 8
    redone = done_before - resumed_at.pop()
    print(f"steps redone after the restart: {redone} (--snapshot-every {EVERY})")
    assert 0 < redone <= EVERY

    check = textwrap.dedent("""
        import sys
        import mindspore, numpy as np
        out, reference, checkpoints = sys.argv[1:]
        for rank in (0, 1):
            got, want = np.load(f"{out}/final{rank}.npz"), np.load(f"{reference}/final{rank}.npz")
            assert sorted(got) == sorted(want) and "moment1.weight" in got, sorted(got)
            for name in want:  # bit for bit: the parameters, Adam's moments and powers, its global step
                assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
            ckpt = mindspore.load_checkpoint(f"{checkpoints}/step-00000006/rank-0000{rank}.ckpt")
            at_six = np.load(f"{reference}/state{rank}-6.npz")
            assert sorted(ckpt) == sorted(at_six), (sorted(ckpt), sorted(at_six))
            for name in at_six:
                assert np.array_equal(ckpt[name].asnumpy(), at_six[name]), name
        print("same")
        """)
    checked = subprocess.run([python, "-c", check, str(out), str(reference), str(checkpoints)], capture_output=True,
                             text=True, timeout=120)
    assert checked.stdout.strip().endswith("same"), checked.stdout + checked.stderr
    manifest = json.loads((checkpoints / "step-00000006" / "manifest.json").read_text())
    assert manifest["format"] == "mindspore.ckpt" and [r["path"] for r in manifest["ranks"]] == \
        ["step-00000006/rank-00000.ckpt", "step-00000006/rank-00001.ckpt"]
    assert "rank 1 failed: killed by SIGKILL" in faulty.output
