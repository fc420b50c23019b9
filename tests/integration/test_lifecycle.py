"""Stopping: Ctrl-C and SIGTERM stop every node; a SIGKILLed agent leaves no worker behind."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.conftest import WORKERS, marked_processes, wait_for

# torchrun's own path: each rank in a fresh interpreter, as ftrun starts them at job level by default
pytestmark = [pytest.mark.integration, pytest.mark.fresh_interpreters]
SLEEPER = str(WORKERS / "sleeper.py")


def start_sleepers(launcher, flags=(), **env):
    nodes = launcher.start_job(2, 2, [SLEEPER], flags=["--stop-timeout", "2", *flags], env=launcher.env(**env))
    pid_files = [launcher.out_dir / f"pids{rank}" for rank in range(4)]
    wait_for(lambda: all(p.exists() and p.read_text().strip() for p in pid_files), what="4 workers to start")
    pids = [int(pid) for p in pid_files for pid in p.read_text().split()]
    return nodes, pids


def gone(pids) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_interrupt_on_one_node_stops_every_node(launcher, sig, code):
    nodes, pids = start_sleepers(launcher)
    host = next(n for n in nodes if "hosting it" in n.output)
    other = next(n for n in nodes if n is not host)
    os.kill(other.proc.pid, sig)
    assert launcher.wait() == [code, code], launcher.output()
    assert gone(pids)


def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(launcher):
    nodes, pids = start_sleepers(launcher, IGNORE_TERM="1")
    os.kill(nodes[0].proc.pid, signal.SIGINT)
    assert launcher.wait() == [130, 130], launcher.output()
    assert gone(pids)


@pytest.mark.parametrize("which", ["host", "other"])
def test_sigkilled_agent_leaves_no_worker_behind(launcher, which):
    nodes, pids = start_sleepers(launcher, flags=["--node-timeout", "3"])
    host = next(n for n in nodes if "hosting it" in n.output)
    victim = host if which == "host" else next(n for n in nodes if n is not host)
    survivor = next(n for n in nodes if n is not victim)
    victim_workers = [p.pid for p in psutil.Process(victim.proc.pid).children(recursive=True)]
    victim.proc.kill()
    victim.proc.wait()
    # the dead agent's workers and their children go at once (parent-death signal, guardian)
    wait_for(lambda: gone(victim_workers), timeout=10, what="the killed agent's workers to die")
    # the other node notices (lost controller, or lost node) and stops its workers too
    code = launcher.wait([survivor], timeout=60)[0]
    assert code == 1, survivor.output
    assert "lost" in survivor.output
    assert gone(pids)
    assert not marked_processes(launcher.mark)


def test_tee_prefixes_console_lines_and_writes_rank_logs(launcher, tmp_path):
    log_dir = tmp_path / "logs"
    launcher.start_job(
        1, 2, [str(WORKERS / "train.py")], flags=["--tee", "3", "--log-dir", str(log_dir)],
        env=launcher.env(STEPS="2"),
    )
    assert launcher.wait() == [0], launcher.output()
    assert "[rank 1]: rank 1 finished step 2" in launcher.output()
    stdout = log_dir / launcher.mark / "node0" / "attempt_0" / "1" / "stdout.log"
    assert stdout.read_text().strip() == "rank 1 finished step 2"


def test_redirect_keeps_output_off_the_console_and_filter_picks_ranks(launcher, tmp_path):
    log_dir = tmp_path / "logs"
    launcher.start_job(
        1, 2, [str(WORKERS / "train.py")],
        flags=["-r", "0:1", "--local-ranks-filter", "0", "--log-dir", str(log_dir)],
        env=launcher.env(STEPS="2"),
    )
    assert launcher.wait() == [0], launcher.output()
    output = launcher.output()
    assert "rank 0 finished" not in output  # redirected to its file
    assert "rank 1 finished" not in output  # filtered off the console
    assert (log_dir / launcher.mark / "node0" / "attempt_0" / "0" / "stdout.log").read_text().startswith("rank 0 finished")


@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_an_agent_leaves_no_folder_in_the_temp_folder_whether_it_ends_or_is_killed(launcher, request, tmp_path, backend):
    """Its ``ftrun-`` folder (the workers' error files) and, under etcd, its ``ftrun-control-`` folder go
    with the agent: removed at its end, and by its orphan guardian when it is SIGKILLed."""
    temp = tmp_path / "temp"
    temp.mkdir()
    flags = ["--stop-timeout", "2"]
    if backend == "etcd":
        flags += ["--rdzv-backend", "etcd", "--rdzv-endpoint", request.getfixturevalue("etcd").endpoints]
    env = launcher.env(TMPDIR=str(temp))

    def run_then(end) -> None:
        for pids in launcher.out_dir.glob("pids*"):
            pids.unlink()
        [node] = launcher.start_job(1, 2, [SLEEPER], flags=[*flags, "--run-id", f"{launcher.mark}-{end}"], env=env)
        pid_files = [launcher.out_dir / f"pids{rank}" for rank in range(2)]
        wait_for(lambda: all(p.exists() and p.read_text().strip() for p in pid_files), what="2 workers to start")
        made = sorted(p.name for p in temp.iterdir())
        assert any(name.startswith("ftrun-") for name in made), made
        if backend == "etcd":
            assert any(name.startswith("ftrun-control-") for name in made), made
        if end == "sigterm":
            os.kill(node.proc.pid, signal.SIGTERM)
            assert launcher.wait([node], timeout=60) == [143], node.output
        else:
            node.proc.kill()
            node.proc.wait()
        wait_for(lambda: not list(temp.iterdir()), timeout=10, what=f"the temp folder to be empty after a {end}")

    run_then("sigterm")
    run_then("sigkill")
    # the guardian SIGKILLs the workers' groups, removes the folders, then exits: the moment the folder went,
    # it (or a worker the kernel had not yet taken down) could still be there, as once on a loaded CI run
    wait_for(lambda: not marked_processes(launcher.mark), timeout=15, what="every process of the job to end")
