"""--rdzv-backend etcd: the job survives the loss of any node, the controller's included.

A real 3-member etcd cluster on loopback (``tests/etcd.py``), 2 simulated nodes x 2 ranks and a spare
(CPU, gloo), the worker library's script. Agent 0 starts first and takes the controller's office; the
others join once it leads, so that it is node 0 of the rendezvous.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ELASTIC_NODES, ELASTIC_NPROC, ELASTIC_STEPS, WORKERS, ftrun_status, step_reached, wait_for
from tests.parts import tmux_for_a_check
from tests.terminal import Pane

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
#: the job ``fault_free`` (tests/conftest.py) ran without a fault
STEPS = ELASTIC_STEPS
NODES, NPROC = ELASTIC_NODES, ELASTIC_NPROC


def start(launcher, etcd, spares: int = 1, flags=(), **env) -> list:
    """The job's agents; agent i says it is on host 127.0.0.<i+2>. The first one leads."""
    common = ["--nnodes", str(NODES), "--spares", str(spares), "--nproc-per-node", str(NPROC), "--rdzv-backend", "etcd",
              "--rdzv-endpoint", etcd.endpoints, "--run-id", launcher.mark, "--monitor-interval", "0.05",
              "--node-timeout", "3", "--recovery", "process", "--max-restarts", "2", *flags]
    environment = launcher.env(**{"STEPS": str(STEPS), "STEP_SLEEP": "0.1", **env})
    agents = [launcher.start([*common, "--local-addr", "127.0.0.2", ELASTIC], env=environment)]
    wait_for(lambda: "hosting the control store" in agents[0].output, timeout=120, what="the first agent to lead")
    for i in range(1, NODES + spares):
        agents.append(launcher.start([*common, "--local-addr", f"127.0.0.{i + 2}", ELASTIC], env=environment))
    return agents


def wait_for_progress(launcher, rank: int, step: int) -> None:
    wait_for(lambda: step_reached(launcher.out_dir, rank) >= step,
             timeout=120, what=f"rank {rank} to reach step {step}")


def starts(launcher) -> dict[int, int]:
    """How many processes each rank had."""
    return {rank: len(list(launcher.out_dir.glob(f"pid-start-rank{rank}-*"))) for rank in range(NODES * NPROC)}


def test_the_controllers_node_lost_a_spare_takes_its_place_and_the_other_ranks_live_on(launcher, etcd, fault_free,
                                                                                        ftrun_cli, views):
    token = launcher.tmp / "token"  # the job's messages are signed, the successor's as the first one's
    token.write_text("a-secret-of-the-jobs-own-0123456789")
    token.chmod(0o600)
    logs = launcher.tmp / "logs"
    # the job holds after step 1 until the views show it, then steps slowly: time for the kill while it still
    # trains (the digests depend on neither). On a loaded run the views took so long to open that the job had
    # ended first: once the kill came too late (the repair waited for ranks that had ended), once the watcher
    # found the store gone and printed nothing (at a load of 18: 32 s from its start to "connection refused")
    hold = launcher.out_dir / "hold-steps"
    hold.write_text("")
    leader, *others = start(launcher, etcd, flags=["--token-file", str(token), "--log-dir", str(logs)],
                            STEP_SLEEP="0.4", HOLD_AFTER="1")
    assert "node 0 of 2" in wait_for(lambda: "node 0 of" in leader.output and leader.output, timeout=120,
                                     what="the leader's place")
    wait_for_progress(launcher, 1, 1)
    watching = views()  # ftrun status --watch and ftrun top follow the controller (issue 40)
    step_before = watching.opened()
    hold.unlink()
    wait_for_progress(launcher, 1, step_before + 2)
    etcd.kill(2)  # one member of three: no effect
    wait_for_progress(launcher, 1, step_before + 4)
    killed_at = step_reached(launcher.out_dir, 1)
    assert killed_at < STEPS - 5, f"the job reached step {killed_at} of {STEPS} before the kill"
    leader.proc.kill()  # the agent hosting the store and the controller; its guardian takes ranks 0 and 1
    watching.see_the_move()
    assert launcher.wait(others) == [0, 0], launcher.output()
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free  # bit for bit, every rank
    assert starts(launcher) == {0: 2, 1: 2, 2: 1, 3: 1}  # ranks 2 and 3 kept their pids
    successor = next(n for n in others if "hosting the control store" in n.output)
    assert "the controller moved from 127.0.0.2" in successor.output
    # generation 2: the one after the journal's may have been told to the ranks by a controller that died before
    # its journal held it (issue 40), and is never reused
    assert "process-level repair into generation 2" in successor.output
    assert "1 of 2 restarts used" in successor.output  # the failover and the repair: one unit of budget
    assert "not signed" not in launcher.output() and "ignoring a message" not in launcher.output()
    spare = next(n for n in others if "taking the place of node 0" in n.output)
    assert "replacing ranks 0, 1" in spare.output
    # the event log both controllers wrote, one after the other, read back as one job on one clock
    events = logs / launcher.mark / "events.jsonl"
    elapsed = [json.loads(line)["elapsed"] for line in events.read_text().splitlines()]
    assert elapsed == sorted(elapsed), elapsed
    code, out, err = ftrun_cli("report", str(events), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert (report["exit_code"], report["step"], report["restarts_used"], report["nodes_lost"]) == (0, STEPS, 1, 1)
    assert report["repairs"]["process"]["count"] == 1
    # the job's clock went on from the first controller's start: its duration covers every rank's life, from
    # the first rank's start (after the job's) to the last result written (before its end), the successor's
    # term and the predecessor's both. Counted from the test's own start, the launch's torch import was in it
    # too, and on a loaded run that was longer than the job's time after the kill (81.6 s against 82.1)
    lived = max(p.stat().st_mtime for p in launcher.out_dir.glob("rank*.json")) - min(
        p.stat().st_mtime for p in launcher.out_dir.glob("pid-start-rank*"))
    assert report["duration"] > lived, (report["duration"], lived)
    code, out, err = ftrun_cli("report", str(events))
    assert "the controller moved from 127.0.0.2 to" in out and "takes the place of node 0" in out, out
    # the views went on from the new controller's store, and said once that it moved
    watching.followed(f"127.0.0.{others.index(successor) + 3}", step_before)


class Views:
    """``ftrun status --watch --json`` (its lines in files) and, with tmux, ``ftrun top`` in a pane: both
    find the job through etcd."""

    def __init__(self, launcher, etcd):
        found = ["--rdzv-backend", "etcd", "--run-id", launcher.mark]
        self.into = launcher.tmp / "watch"
        self.watcher = ftrun_status(etcd.endpoints, *found, "--watch", "--json", "--interval", "0.5", into=self.into,
                                    env=launcher.env())
        self.top = None
        if tmux_for_a_check("ftrun top through etcd"):
            self.top = Pane(launcher.tmp, "top", ["top", "--rdzv-endpoint", etcd.endpoints, *found], dict(os.environ),
                            size=(240, 30))
        self.screen = ""

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in Path(f"{self.into}.out").read_text().splitlines()]

    def opened(self) -> int:
        """Once both show the job on its first controller: the step they show."""
        # a watcher that ended says why at once (it gave up on the store: issue 48's failure waited out the 60 s)
        wait_for(lambda: self.lines() or self.watcher.poll() is not None, timeout=60,
                 what="ftrun status --watch's first line")
        assert self.lines(), (self.watcher.returncode, Path(f"{self.into}.err").read_text())
        if self.top is not None:
            self.top.wait_for("RUNNING", "controller on 127.0.0.2 ·")
        assert {s["controller"]["host"] for s in self.lines()} == {"127.0.0.2"}
        return max(s["step"] or 0 for s in self.lines())

    def see_the_move(self) -> None:
        """top says that the controller moved while the job still runs (its end says that it ended)."""
        if self.top is not None:
            self.screen = self.top.wait_for("the controller moved to 127.0.0.", "following it", "(moved 1x)", timeout=120)

    def followed(self, host: str, step_before: int) -> None:
        assert self.watcher.wait(timeout=60) == 0, Path(f"{self.into}.err").read_text()
        after = [s for s in self.lines() if s["controller"]["host"] == host]
        assert after and after[-1]["controller"]["moves"] == 1 and after[-1]["step"] > step_before, self.lines()
        assert Path(f"{self.into}.err").read_text().count(f"the controller moved to {host}; following it") == 1
        if self.top is not None:
            assert f"the controller moved to {host}; following it" in self.screen, self.screen
            assert f"controller on {host} (moved 1x)" in self.screen, self.screen
            shown = re.search(r"· step (\d+)", self.top.screen())
            assert shown and int(shown.group(1)) > step_before, self.top.screen()
            self.top.keys("q")
            assert self.top.exit_code() == 0, self.top.screen()  # what it printed as it left

    def close(self) -> None:
        if self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()
        if self.top is not None:
            self.top.close()


@pytest.fixture
def views(launcher, etcd):
    """Opens the views of the launcher's job (``Views``); closes them after the test."""
    opened: list[Views] = []
    yield lambda: opened.append(Views(launcher, etcd)) or opened[-1]
    for view in opened:
        view.close()


def signal_if_alive(process: psutil.Process, number: int) -> None:
    """A short-lived child of the agent may end between the listing and the signal (seen on a loaded
    machine: psutil.NoSuchProcess at the SIGSTOP): a process that is gone takes no part anyway."""
    try:
        process.send_signal(number)
    except psutil.NoSuchProcess:
        pass


def test_a_controller_stopped_past_its_lease_steps_down_and_its_node_is_replaced(launcher, etcd, fault_free):
    leader, *others = start(launcher, etcd)
    wait_for_progress(launcher, 1, 5)
    frozen = [psutil.Process(leader.proc.pid), *psutil.Process(leader.proc.pid).children(recursive=True)]
    for process in frozen:  # the node stops: its agent (and the store it hosts), its ranks
        signal_if_alive(process, signal.SIGSTOP)
    successor = wait_for(lambda: next((n for n in others if "hosting the control store" in n.output), None),
                         timeout=120, what="another agent to take the controller's office")
    wait_for(lambda: "taking the place of node 0" in launcher.output(), timeout=120, what="the spare to take node 0")
    time.sleep(1.0)
    for process in frozen:  # it wakes up believing it leads
        signal_if_alive(process, signal.SIGCONT)
    assert launcher.wait([leader]) != [0]
    assert "steps down" in leader.output and "declared lost" in leader.output, leader.output
    assert launcher.wait(others) == [0, 0], launcher.output()
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free
    assert starts(launcher)[2] == 1 and starts(launcher)[3] == 1
    assert "1 of 2 restarts used" in successor.output


def test_the_controller_lost_in_the_middle_of_a_repair_the_successor_finishes_it(launcher, etcd, fault_free):
    hold = launcher.out_dir / "hold"
    hold.write_text("")  # rank 3's replacement waits before joining the repair while this exists
    leader, *others = start(launcher, etcd, HOLD_REPLACEMENT="3")
    wait_for_progress(launcher, 3, 5)
    victim = next(launcher.out_dir.glob("pid-start-rank3-*")).name.rsplit("-", 1)[1]
    psutil.Process(int(victim)).kill()
    node1 = next(n for n in others if "ranks 2-3" in n.output)
    wait_for(lambda: "replacing rank 3 for generation 1" in node1.output, timeout=120, what="rank 3's replacement")
    leader.proc.kill()  # the repair is under way: rank 3's replacement holds it
    successor = wait_for(lambda: next((n for n in others if "hosting the control store" in n.output), None),
                         timeout=120, what="another agent to take the controller's office")
    hold.unlink()
    assert launcher.wait(others) == [0, 0], launcher.output()
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free
    assert starts(launcher)[2] == 1  # the healthy rank of node 1 kept its pid through both
    assert node1.output.count("replacing rank 3 for generation 1") == 1  # each command applied once
    assert "1 of 2 restarts used" in successor.output, successor.output  # one fault's repair, counted once


def test_a_lost_quorum_holds_decisions_back_and_past_the_store_timeout_stops_the_job(launcher, etcd):
    checkpoints = launcher.tmp / "checkpoints"
    flags = ["--store-timeout", "12", "--snapshot-every", "2", "--snapshot-memory", "64M",
             "--checkpoint-dir", str(checkpoints), "--save-on-failure"]
    leader, *others = start(launcher, etcd, spares=0, flags=flags, STEPS="1000", STEP_SLEEP="0.15")
    wait_for_progress(launcher, 1, 3)
    # ftrun status and ftrun top find the job through etcd
    found = ["--rdzv-backend", "etcd", "--run-id", launcher.mark]
    status = ftrun_status(etcd.endpoints, *found, "--json")
    out, err = status.communicate(timeout=60)
    assert status.returncode == 0, err
    assert json.loads(out)["controller"]["host"] == "127.0.0.2"
    if tmux_for_a_check("ftrun top through etcd"):
        top = Pane(launcher.tmp, "top", ["top", "--rdzv-endpoint", etcd.endpoints, *found], dict(os.environ),
                   size=(240, 30))
        try:
            top.wait_for("RUNNING", "heartbeat", "controller on 127.0.0.2")
            top.keys("q")
            assert top.exit_code() == 0
        finally:
            top.close()
    etcd.kill(1)
    etcd.kill(2)  # the quorum, for 10 s: training goes on
    lost_at = time.monotonic()
    wait_for(lambda: "etcd) is unreachable" in leader.output, timeout=60, what="the controller to say so")
    progress = step_reached(launcher.out_dir, 1)
    wait_for_progress(launcher, 1, progress + 3)
    time.sleep(max(0.0, 10 - (time.monotonic() - lost_at)))
    etcd.revive(1)
    etcd.revive(2)
    wait_for(lambda: "etcd) answers again" in leader.output, timeout=60, what="etcd to answer again")
    assert leader.output.count("(etcd) is unreachable:") == 1  # said once by the controller...
    wait_for(lambda: all("etcd) answers again" in n.output for n in others), timeout=30, what="every agent to say so")
    for node in launcher.nodes:  # ...and once by each agent
        assert node.output.count("(etcd) is unreachable from the controller") == 1, launcher.output()
    etcd.kill(1)
    etcd.kill(2)  # now past --store-timeout: a clean stop, with that root cause
    assert launcher.wait() == [1, 1], launcher.output()
    assert "the control store (etcd) was unreachable for 12s" in leader.output
    assert all("the control store (etcd) was unreachable" in n.output for n in others), launcher.output()
    assert starts(launcher) == {0: 1, 1: 1, 2: 1, 3: 1}  # no rank was restarted meanwhile
    # --save-on-failure: both snapshots each rank held as the job stopped (--snapshot-every 2; a checkpoint is
    # written every 100th step only), on disk. The ranks stop a moment apart, one of them a snapshot behind
    # the others at times (172 and 174 against 174 and 176), and a rank's progress file may lag its newest
    # snapshot by a step (stopped in between): the newest step every rank holds is whole
    last = step_reached(launcher.out_dir, 1)
    held = {rank: sorted(int(p.parent.name[len("step-"):]) for p in checkpoints.glob(f"step-*/rank-{rank:05d}.pt"))
            for rank in range(4)}
    for rank, steps in held.items():
        assert steps[-2:] == [steps[-1] - 2, steps[-1]] and last - 3 <= steps[-1] <= last + 2, (rank, held, last)
    saved = {int(p.name[len("step-"):]): p for p in checkpoints.glob("step-*") if (p / "manifest.json").exists()}
    newest = max(saved)
    assert newest == min(steps[-1] for steps in held.values()) and last - 5 <= newest <= last + 2, (sorted(saved), held, last)
    assert all((saved[newest] / f"rank-{rank:05d}.pt").exists() for rank in range(4))
