"""The outside view of a script without the worker library: its ranks' CPU time read from /proc (real child
processes, one burning CPU and one asleep), the step its output says (many line shapes, and those that must not
count), the scoring and judging of the CPU shares (an injected clock), the controller's watch over a snapshot,
the policy's refusal to move a rank on it, and what the status view, ftrun top and the metrics show."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from ftrun.agent.cpu_time import CPU_WINDOW, CpuShare, group_cpu_seconds, newest_pid, stat_fields
from ftrun.controller import policy
from ftrun.controller.inbox import StragglerSeen
from ftrun.controller.states import JobView, Level
from ftrun.controller.straggler_watch import StragglerWatch
from ftrun.detection.output_steps import OutputSteps, step_in_line
from ftrun.detection.stragglers import CPU_MEDIAN_FLOOR, OUTSIDE_RULE, RankCpu, WatchState, assess_cpu, judge
from ftrun.messages import CommandKind, NodeSlot, NodeStatus
from tests.unit.test_status import store  # noqa: F401  (the fixture: a real TCPStore)

# -- CPU time from /proc ------------------------------------------------------------------------------------------------

#: a session leader (as the agent starts a rank) that sleeps, and one whose child, in its process group, burns CPU
SLEEPER = "import time; time.sleep(60)"
#: (SIGTERM: it ends its child and reaps it, as a DataLoader does its workers)
BURNER_PARENT = ("import signal, subprocess, sys, time\n"
                 "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
                 "def leave(*_):\n"
                 "    child.kill(); child.wait(); sys.exit(0)\n"
                 "signal.signal(signal.SIGTERM, leave)\n"
                 "time.sleep(60)\n")


def test_a_rank_s_cpu_time_counts_its_process_group_and_a_sleeping_rank_s_stays_put():
    sleeper = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    burner = subprocess.Popen([sys.executable, "-c", BURNER_PARENT], start_new_session=True)
    try:
        groups = {sleeper.pid, burner.pid}
        deadline = time.monotonic() + 60
        first = group_cpu_seconds(groups)
        used = first
        while time.monotonic() < deadline and used.get(burner.pid, 0.0) - first.get(burner.pid, 0.0) < 0.5:
            time.sleep(0.1)
            used = group_cpu_seconds(groups)
        assert set(used) == groups
        # the burning child sleeps under a parent that sleeps: only its group's sum shows it
        assert used[burner.pid] - first[burner.pid] >= 0.5, (first, used)
        assert used[sleeper.pid] - first[sleeper.pid] < 0.1, (first, used)
    finally:
        for proc in (sleeper, burner):
            proc.terminate()
            proc.wait()
    assert group_cpu_seconds({sleeper.pid, burner.pid}) == {}  # gone: nothing left to count


@pytest.mark.parametrize("text, expected", [
    ("42 (python) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 10 5 20 0 3 0", (42, 3.15)),
    ("7 (a b) c)) R 1 7 7 0 -1 0 0 0 0 0 100 0 0 0 20 0 1 0", (7, 1.0)),  # a name with spaces and parentheses
    ("7 (short) R 1 7", None),
    ("garbage", None),
    ("7 (x) R 1 7 7 0 -1 0 0 0 0 0 ten 0 0 0 20 0 1 0", None),
])
def test_stat_fields_read_the_group_and_the_ticks_after_the_name(text, expected, monkeypatch):
    monkeypatch.setattr("ftrun.agent.cpu_time._TICKS", 100)
    assert stat_fields(text) == (expected if expected is None else (expected[0], pytest.approx(expected[1])))


class FakeProc:
    """group_cpu_seconds as the agent's CpuShare calls it: each pid's CPU seconds as the test sets them."""

    def __init__(self):
        self.used: dict[int, float] = {}
        self.calls = 0

    def __call__(self, groups: set[int], everything: bool = False) -> dict[int, float]:
        self.calls += 1
        self.everything = everything
        return {pid: seconds for pid, seconds in self.used.items() if pid in groups}


def test_after_the_pids_wrap_a_child_numbered_below_its_rank_is_read_too(tmp_path, monkeypatch):
    # a /proc of three processes: rank 100's group holds 100 and 7, a child numbered after the pids wrapped round
    monkeypatch.setattr("ftrun.agent.cpu_time._TICKS", 100)
    for pid, group, ticks in ((7, 100, 300), (100, 100, 100), (3, 3, 900)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) S 1 {group} {group} 0 -1 0 0 0 0 0 {ticks} 0 0 0 20")
    (tmp_path / "loadavg").write_text("0.10 0.20 0.30 1/80 42\n")
    assert group_cpu_seconds({100}, proc=str(tmp_path)) == {100: pytest.approx(1.0)}
    assert group_cpu_seconds({100}, everything=True, proc=str(tmp_path)) == {100: pytest.approx(4.0)}
    assert newest_pid(str(tmp_path)) == 42 and newest_pid(str(tmp_path / "none")) is None
    # the share reads every process once the kernel's newest pid is below the oldest rank's, and from then on
    read, newest = FakeProc(), [500]
    share = CpuShare(read, every=2.0, newest=lambda: newest[0])
    share.sample({0: 100}, now=0.0)
    assert read.everything is False
    newest[0] = 42
    share.sample({0: 100}, now=2.0)
    newest[0] = 900
    share.sample({0: 100}, now=4.0)
    assert read.everything is True


def test_the_cpu_share_is_said_over_its_window_and_starts_afresh_for_a_new_process():
    read = FakeProc()
    share = CpuShare(read, every=2.0, newest=lambda: 10**6)
    read.used = {100: 5.0, 101: 1.0}
    share.sample({0: 100, 1: 101}, now=0.0)
    assert share.share(0) is None  # one sample: no window yet
    read.used = {100: 5.5, 101: 1.0}
    share.sample({0: 100, 1: 101}, now=1.0)  # before `every`: not read
    assert read.calls == 1
    for t in range(2, 40, 2):
        read.used = {100: 5.0 + 0.9 * t, 101: 1.0 + 0.1 * t}
        share.sample({0: 100, 1: 101}, now=float(t))
    assert share.share(0) == pytest.approx(0.9) and share.share(1) == pytest.approx(0.1)
    # rank 1 replaced: its new process's samples start afresh; rank 0 ended: its share goes
    read.used = {102: 0.0}
    share.sample({1: 102}, now=40.0)
    assert share.share(1) is None and share.share(0) is None
    read.used = {102: 2.0}
    share.sample({1: 102}, now=40.0 + CPU_WINDOW / 2)
    assert share.share(1) == pytest.approx(2.0 / (CPU_WINDOW / 2))


# -- the step from output -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line, step", [
    ("step 12", 12),
    ("Step: 12/400", 12),
    ("step=12 loss=0.25", 12),
    ("global_step=12", 12),
    ("iter 12", 12),
    ("Iteration 12/400 | lr 1e-4", 12),
    ("[12/400] loss 0.3", 12),
    ("Epoch [1/10], Step [12/400], Loss: 0.3", 12),
    ("epoch 3 step 5 loss 0.2", 5),
    (" 3%|▎         | 12/400 [00:01<00:40,  9.5it/s]", 12),
    ("| 10/400 [00:01\r| 11/400 [00:01\r| 12/400 [00:02", 12),  # a bar redrawn: its last drawing
    ("checkpoint saved at step 100.", 100),
    ("rank 1 tick 5 step 5", 5),
])
def test_a_step_is_read_from_the_common_shapes_of_a_line(line, step):
    assert step_in_line(line) == step


@pytest.mark.parametrize("line", [
    "epoch 3", "loss 0.25", "12 steps done", "steps 12", "max_step=1000", "warmup_steps=100", "step 0.5",
    "step_time 3", "step time: 0.3s", "step 12s", "step 1e3", "step 1,000", "iters/s 3.2", "max_iter=20",
    "Epoch [1/10]", "[3/40] Building CXX object foo.o", "[rank 1]: tick 4", "2024/12/01 10:00:00",
    "step 13/12", "12/400", "lr 1e-4", "rank 0 tick 3", "",
])
def test_a_number_that_is_not_clearly_a_step_counts_nothing(line):
    assert step_in_line(line) is None


def test_output_steps_keep_the_last_step_said_and_when():
    steps = OutputSteps()
    steps.read("loading data", 1.0)
    assert steps.last is None
    steps.read("step 3", 2.0)
    steps.read("loss 0.3", 3.0)  # says no step: the last one stays
    assert steps.last == (3, 2.0)
    steps.read("[4/10]", 4.0)
    assert steps.last == (4, 4.0)


def test_a_worker_s_pump_reads_the_step_from_its_lines():
    from ftrun.agent.output import StreamPump

    read_end, write_end = os.pipe()
    steps = OutputSteps()
    pump = StreamPump(os.fdopen(read_end, "rb"), "ftrun-test-stdout", None, b"", None, steps=steps)
    with os.fdopen(write_end, "wb") as out:
        out.write(b"starting\nstep 7 loss 0.1\nsaving\n")
    pump.drain(10)
    assert steps.last is not None and steps.last[0] == 7


# -- scoring and judging ------------------------------------------------------------------------------------------------


def cpus(*shares: float, per_node: int = 2) -> list[RankCpu]:
    return [RankCpu(rank, rank // per_node, share) for rank, share in enumerate(shares)]


@pytest.mark.parametrize("shares, past", [
    ((1.0, 1.0, 1.0, 2.1), {3}),  # 2.1x and 1.1 more
    ((1.0, 1.0, 1.0, 1.9), set()),  # under twice the median
    ((0.2, 0.2, 0.2, 0.45), set()),  # 2.25x but only 0.25 more: rank 0 logging is not a straggler
    ((0.3, 0.3, 0.3, 0.7), {3}),
    ((1.3, 1.0, 1.0, 1.0), set()),  # rank 0 evaluates and logs more: far under the rule
    ((0.5, 1.2), {1}),  # two ranks: the lower is the reference
])
def test_a_rank_is_past_the_outside_rule_only_by_ratio_and_excess_both(shares, past):
    assessment = assess_cpu(cpus(*shares))
    assert assessment.outside and {r.rank for r in assessment.ranks if r.past} == past


def test_no_rank_is_scored_from_outside_alone_or_while_the_ranks_all_wait():
    assert assess_cpu(cpus(0.9)).ranks == ()
    # rank 0 loads data while the others wait in a barrier: the median is under the floor
    idle = assess_cpu(cpus(1.0, 0.01, 0.02, 0.01))
    assert idle.ranks == () and idle.median_compute < CPU_MEDIAN_FLOOR


def judged(rows: list[tuple[float, tuple[float, ...]]]) -> list:
    state, said = WatchState(), []
    for t, shares in rows:
        state, findings = judge(state, assess_cpu(cpus(*shares)), OUTSIDE_RULE, t)
        said += [(t, f) for f in findings]
    return said


def test_the_outside_view_names_a_rank_after_20_s_past_the_rule_in_one_line_and_clears_it_with_hysteresis():
    slow = (1.0, 1.0, 1.0, 2.4)
    said = judged([(float(t), slow) for t in range(0, 20)])
    assert said == []  # 19 s past the rule: not yet
    said = judged([(float(t), slow) for t in range(0, 21)])
    [(t, finding)] = said
    assert t == 20.0 and finding.named and (finding.rank, finding.node) == (3, 1)
    assert finding.line == ("straggler: rank 3 on node 1 uses 2.4x the job's median CPU time (2.40 CPU-seconds per "
                            "second against 1.00; outside view: the script does not use ftrun's worker library; a rank "
                            "slow on its accelerator may not show here)")
    # back to 1.6x: above the clearing mark (1.5x), it stays named; at 1.2x for 20 s it is cleared
    later = judged([(float(t), slow) for t in range(0, 21)] + [(float(t), (1.0, 1.0, 1.0, 1.6)) for t in range(21, 60)] +
                   [(float(t), (1.0, 1.0, 1.0, 1.2)) for t in range(60, 81)])
    assert [(t, f.named) for t, f in later] == [(20.0, True), (80.0, False)]
    assert "no straggler any more (outside view)" in later[-1][1].line


def test_a_plain_script_s_noisy_ranks_name_no_one():
    # rank 0 logs and evaluates more, every rank's share wobbles, and now and then one rank spikes for a few seconds
    rows = []
    for t in range(0, 600):
        shares = [1.0 + 0.3 * (t % 7 == 0), 0.9 + 0.05 * (t % 3), 0.95, 1.0 - 0.1 * (t % 2)]
        if t % 97 < 15:  # a checkpoint, an evaluation on one rank: a spike shorter than the persistence
            shares[t // 97 % 4] = 2.6
        rows.append((float(t), tuple(shares)))
    assert judged(rows) == []


# -- the controller's watch --------------------------------------------------------------------------------------------

VIEW = JobView(node_count=2, max_restarts=2, world_size=4, recovery=Level.PROCESS)


class Board:
    def __init__(self):
        self.snapshot: dict = {}
        self.stragglers: dict = {}

    def show(self, t: float, shares: tuple[float | None, ...], library: tuple[bool, ...] = (False,) * 4) -> None:
        self.snapshot = {"time": t, "generation": 0, "ranks": [
            {"rank": r, "node": r // 2, "alive": True, "timed_steps": 0, "library": library[r], "cpu_s_per_s": c}
            for r, c in enumerate(shares)]}


@pytest.mark.parametrize("action", ["report", "replace"])
def test_the_watch_names_a_plain_script_s_straggler_from_outside_and_never_moves_it(action):
    board = Board()
    watch = StragglerWatch(board, action)
    said = []
    for t in range(0, 30):
        board.show(float(t), (1.0, 1.0, 1.0, 2.5 if t >= 5 else 1.0))
        said += watch.observe(VIEW, float(t))
    [seen] = said
    assert isinstance(seen, StragglerSeen) and seen.outside and seen.finding.rank == 3 and seen.finding.named
    assert board.stragglers["named_ranks"] == [3] and board.stragglers["named_nodes"] == [1]
    assert board.stragglers["outside"] == [0, 1, 2, 3] and board.stragglers["scores"][3] == 2.5
    assert board.stragglers["named"] == ["rank 3 on node 1: 2.5x the job's median CPU time (2.50 CPU-seconds per second "
                                         "against 1.00; outside view)"]
    assert watch._pending is None  # no move pending, whatever --stragglers says
    slot = NodeSlot(1, "agent-1", "h1", 2, 2)
    refusal = policy.straggler_refusal(VIEW, seen.replace, True, "spare-0", outside=True)
    assert refusal == ("--stragglers replace acts on the worker library's step times, never on the outside view"
                       if action == "replace" else "--stragglers report")
    completed = dataclasses.replace(seen, slot=slot, spare="spare-0", refusal=refusal)
    assert policy.decide(VIEW, completed) == (VIEW, [])
    # even unrefused (a path that skipped the roster), an outside finding moves nothing
    assert policy.on_straggler(VIEW, dataclasses.replace(completed, refusal="")) == (VIEW, [])


def test_ranks_with_the_worker_library_are_left_out_of_the_outside_view():
    board = Board()
    watch = StragglerWatch(board, "report")
    for t in range(0, 40):
        board.show(float(t), (1.0, 1.0, 1.0, 3.0), library=(True, True, True, True))
        assert watch.observe(VIEW, float(t)) == []
    assert watch.outside.ranks == () and board.stragglers["outside"] == []
    # one rank seen with the library: the others have not beaten yet (a library job starting), not a plain script
    board.show(40.0, (1.0, 1.0, 1.0, 3.0), library=(True, False, False, False))
    watch.observe(VIEW, 40.0)
    assert watch.outside.ranks == ()
    board.show(41.0, (1.0, None, 1.0, 3.0))  # a plain script: a rank with no window yet is not scored
    watch.observe(VIEW, 41.0)
    assert [r.rank for r in watch.outside.ranks] == [0, 2, 3]


# -- the agent's status, the board, the views, the metrics -------------------------------------------------------------


def test_the_node_status_carries_each_rank_s_step_from_output_and_its_cpu_share(node):
    n = node("step,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    deadline = time.monotonic() + 30
    while n.group.workers[0].steps.last is None and time.monotonic() < deadline:
        time.sleep(0.02)
    n.supervision.tend(now=time.monotonic())
    status = n.store.try_get(NodeStatus, n.keys.agent_status("agent-a"))
    first, second = status.ranks
    assert (first.output_step, second.output_step, second.output_age) == (7, None, None)
    assert first.output_age is not None and first.output_age >= 0
    assert first.cpu is None  # one sample: no window yet
    n.supervision.next_beat = 0.0
    n.supervision.tend(now=time.monotonic() + CPU_WINDOW)  # the clock passed in: a window later
    status = n.store.try_get(NodeStatus, n.keys.agent_status("agent-a"))
    assert all(r.cpu is not None and r.cpu >= 0 for r in status.ranks), status.ranks


def test_the_board_shows_the_step_from_output_its_rate_and_each_rank_s_outside_view(store):  # noqa: F811
    from ftrun.controller.board import StatusBoard
    from ftrun.events import EventLog
    from ftrun.messages import RankState
    from tests.unit.test_status import KEYS, NODES

    def publish(step: int) -> None:
        ranks = (RankState(0, 0, 100, True, cpu=0.4, output_step=step, output_age=0.5), RankState(1, 1, 101, True, cpu=0.9))
        store.set(KEYS.agent_status("a0"), NodeStatus("a0", "host-a", 0, ranks))

    publish(12)
    board = StatusBoard(store, KEYS, EventLog(), "job1")
    board.stragglers = {"scores": {0: 1.0, 1: 2.25}, "outside": [0, 1]}
    view = JobView(node_count=1, max_restarts=1, world_size=2)
    nodes = {0: NODES[0]}
    s = board.refresh(view, nodes, [], board.started)
    assert (s["step"], s["output_step"], s["output_steps_per_s"]) == (None, 12, 0.0)
    assert {k: s["ranks"][0][k] for k in ("library", "cpu_s_per_s", "output_step", "output_step_age", "straggler_view")} == \
        {"library": False, "cpu_s_per_s": 0.4, "output_step": 12, "output_step_age": 0.5, "straggler_view": "outside"}
    assert s["ranks"][1]["output_step"] is None and s["ranks"][1]["straggler_score"] == 2.25
    time.sleep(0.01)
    publish(20)
    s = board.refresh(view, nodes, [], board.started)
    assert s["output_step"] == 20 and s["output_steps_per_s"] > 0 and s["step"] is None


OUTSIDE_SNAPSHOT = {
    "run_id": "plain", "time": 0, "elapsed": 30.0, "generation": 0, "phase": "running", "level": "", "phase_for": 3.0,
    "recovery": "job", "restarts_used": 0, "max_restarts": 3, "world_size": 2, "step": None, "steps_per_s": 0.0,
    "output_step": 120, "output_steps_per_s": 4.0, "total_steps": None, "eta_s": None, "reason": "", "exit_code": None,
    "events": [], "stragglers": ["rank 1 on node 0: 2.3x the job's median CPU time (0.92 CPU-seconds per second "
                                 "against 0.40; outside view)"],
    "nodes": [{"node": 0, "host": "cpu0", "agent": "a0", "role": "active", "state": "running", "ranks_total": 2,
               "ranks_alive": 2, "standbys": 0, "devices": [], "straggler": True}],
    "ranks": [{"rank": r, "node": 0, "pid": 100 + r, "alive": True, "restarts": 0, "step": None, "heartbeat_age": None,
               "library": False, "cpu_s_per_s": (0.4, 0.92)[r], "output_step": 120 + r, "output_step_age": 0.3,
               "straggler_score": (1.0, 2.3)[r], "straggler_view": "outside"} for r in (0, 1)],
}


def test_status_and_top_say_the_step_from_output_and_the_outside_straggler():
    from rich.console import Console

    from ftrun.live_view import plain_line, render
    from ftrun.top_view import panes

    console = Console(width=160, record=True)
    console.print(render(OUTSIDE_SNAPSHOT, 160, 60))
    text = console.export_text()
    assert "step 120 (from output) · 4.0 steps/s" in text
    assert "straggler: rank 1 on node 0: 2.3x the job's median CPU time" in text and "outside view" in text
    assert "121 (output)" in text and "2.3x cpu" in text
    assert "step 120 from output (4.0 steps/s)" in plain_line(OUTSIDE_SNAPSHOT)
    rows = dict(panes.rank_rows(OUTSIDE_SNAPSHOT))
    assert rows[1][5] == "121 (output)" and rows[1][8:] == ("-", "-", "2.3x cpu") and rows[0][10] == "1.0x cpu"
    detail = panes.rank_detail(OUTSIDE_SNAPSHOT, 1, [], [], []).plain
    assert "outside cpu 0.92 CPU-s/s · step 121 from output, 0.3s ago" in detail


def test_the_metrics_show_each_rank_s_cpu_share_and_outside_score():
    from ftrun.controller.metrics import JobMetrics

    metrics = JobMetrics("plain", clock=lambda: 0.0)
    metrics.update(OUTSIDE_SNAPSHOT, [])
    page = metrics_page(metrics)
    for line in ['ftrun_rank_cpu_seconds_per_second{node="0",rank="1"} 0.92',
                 'ftrun_outside_straggler_score{node="0",rank="1"} 2.3', "ftrun_stragglers 1.0"]:
        assert line in page, line
    assert 'ftrun_straggler_score{node="0"' not in page  # the library's score is the step times' alone
    gone = {**OUTSIDE_SNAPSHOT, "ranks": OUTSIDE_SNAPSHOT["ranks"][:1]}
    metrics.update(gone, [])
    assert 'rank="1"' not in metrics_page(metrics)


def metrics_page(metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()

