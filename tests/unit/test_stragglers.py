"""Stragglers: the rank's step clock, the scoring and judging (pure, table-driven, an injected clock), the
controller's watch over a status snapshot, and the policy's answer (report or move to a spare)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from ftrun.controller import policy
from ftrun.controller.inbox import StragglerGain, StragglerSeen
from ftrun.controller.states import JobView, Level, Phase
from ftrun.controller.straggler_watch import StragglerWatch
from ftrun.detection.stragglers import Assessment, Finding, RankTimes, StragglerRule, WatchState, assess, judge
from ftrun.messages import CommandKind, NodeSlot
from ftrun.step_times import WINDOW_STEPS, StepClock, StepTimes
from tests.conftest import FakeClock

RULE = StragglerRule(threshold=1.5, min_excess=0.05, persist=5.0, clear=1.25, min_steps=16)


def times(compute: float, wait: float = 0.0, steps: int = 40) -> StepTimes:
    return StepTimes(steps, compute + wait, compute, wait)


def job(*computes: float, per_node: int = 2, steps: int = 40) -> list[RankTimes]:
    """Ranks 0.. with these compute times, ``per_node`` to a node."""
    return [RankTimes(rank, rank // per_node, times(c, steps=steps)) for rank, c in enumerate(computes)]


# -- the rank's clock --------------------------------------------------------------------------------------------


def test_the_step_clock_gives_medians_over_its_window_and_counts_every_step():
    clock = StepClock(window=4)
    assert clock.times() == StepTimes(pid=os.getpid())
    for step, wait in [(1.0, 0.1), (0.2, 0.1), (0.3, 0.2), (0.25, 0.05), (0.2, 0.5)]:  # the last wait: past its step
        clock.record(step, wait)
    got = clock.times()
    assert got.pid == os.getpid()  # the process that timed them: its rank's key outlives it
    assert got.steps == 5 and got.step == pytest.approx(0.225)  # 1.0 left the window of 4
    assert got.wait == pytest.approx(0.15) and got.compute == pytest.approx(0.1)


def test_the_step_clock_times_a_committed_step_from_its_latest_beginning_and_no_other():
    now = FakeClock()
    clock = StepClock(now=now)
    clock.end(0.1)  # an end with no beginning (a callback's first step): not timed
    clock.begin()
    now.advance(1.0)
    clock.begin()  # begun again (the loop, then the guard): the latest counts
    now.advance(0.3)
    clock.end(0.1)
    clock.begin()
    now.advance(5.0)
    clock.end(0.2, committed=False)  # its collective failed: repaired, not timed
    now.advance(1.0)
    clock.end(0.0)  # nothing begun since
    assert clock.times() == StepTimes(1, pytest.approx(0.3), pytest.approx(0.2), 0.1, os.getpid())


def test_the_step_times_module_imports_the_standard_library_alone():
    """The worker libraries (ftrun.mindspore_elastic has no torch) and the launcher share it."""
    import sys
    from pathlib import Path

    from tests.unit.test_contract import imported_modules

    imported = imported_modules(Path(__file__).resolve().parents[2] / "ftrun" / "step_times.py")
    assert imported and not [name for name in imported if name not in sys.stdlib_module_names and name != "__future__"]


@pytest.mark.parametrize("text, expected", [
    ("12 0.3000 0.2500 0.0500 4242", StepTimes(12, 0.3, 0.25, 0.05, 4242)),  # an older library's: no save
    ("12 0.3000 0.2500 0.0500 4242 31.5000", StepTimes(12, 0.3, 0.25, 0.05, 4242, 31.5)),  # its longest save
    ("", None), ("12 0.3 0.25 0.05", None), ("x 0.3 0.25 0.05 1", None), ("12 0.3 -1 0.05 1", None),
    ("12 0.3 0.25 0.05 pid", None), ("12 0.3 0.25 0.05 1 -2", None), ("12 0.3 0.25 0.05 1 x", None),
    ("12 0.3 0.25 0.05 1 2 3", None),
])
def test_step_times_read_back_what_the_heartbeat_wrote(text, expected):
    assert StepTimes.from_text(text) == expected
    if expected is not None:
        assert StepTimes.from_text(expected.to_text()) == expected


# -- the scores ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("computes, past", [
    ((0.05, 0.05, 0.05, 0.35), {3}),  # one slow rank: 7x the median
    ((0.05, 0.06, 0.05, 0.04), set()),  # noise
    ((0.002, 0.002, 0.002, 0.006), set()),  # 3x, but 4 ms: under the minimum excess
    ((0.05, 0.05, 0.35, 0.35), {2, 3}),  # a slow node: the lower median keeps the fast half the reference
    ((0.5, 0.5, 0.5, 0.7), set()),  # 1.4x of a long step: under the ratio
    ((0.05, 0.35), {1}),  # two ranks: the faster is the reference
])
def test_a_rank_is_past_the_rule_only_by_ratio_and_excess_both(computes, past):
    assessment = assess(job(*computes), RULE)
    assert {r.rank for r in assessment.ranks if r.past} == past
    assert assessment.median_compute == sorted(computes)[(len(computes) - 1) // 2]


def test_ranks_without_a_full_window_are_not_scored_and_one_rank_alone_has_no_median():
    ranks = job(0.05, 0.05, 0.05) + [RankTimes(3, 1, times(0.9, steps=WINDOW_STEPS - 1))]  # a fresh replacement
    assessment = assess(ranks, RULE)
    assert [r.rank for r in assessment.ranks] == [0, 1, 2] and not any(r.past for r in assessment.ranks)
    assert assess(job(0.05, 9.0)[1:], RULE) == Assessment()


def test_a_node_scores_as_its_worst_rank():
    assessment = assess(job(0.05, 0.05, 0.05, 0.2), RULE)
    assert [(n.node, n.score, n.rank) for n in assessment.nodes] == [(0, 1.0, 0), (1, 4.0, 3)]


# -- judging over time ---------------------------------------------------------------------------------------------


def run(rows: list[tuple[float, tuple[float, ...]]]) -> list[tuple[float, int, bool]]:
    """Judge each (time, computes) in turn: (time, rank, named) per finding."""
    state, said = WatchState(), []
    for now, computes in rows:
        state, findings = judge(state, assess(job(*computes), RULE), RULE, now)
        said += [(now, f.rank, f.named) for f in findings]
    return said


FAST, SLOW, HALF = (0.05,) * 4, (0.05, 0.05, 0.05, 0.35), (0.05, 0.05, 0.05, 0.07)


@pytest.mark.parametrize("rows, said", [
    # past the rule from t=10 on: named once, 5 s later, and not again
    ([(t, FAST if t < 10 else SLOW) for t in range(0, 30)], [(15, 3, True)]),
    # slow for 4 s at a time (a checkpoint, a neighbour's burst): never named
    ([(t, SLOW if t % 8 < 4 else FAST) for t in range(0, 40)], []),
    # named, then back to normal: cleared once below the clearing mark for as long
    ([(t, SLOW if t < 12 else FAST) for t in range(0, 30)], [(5, 3, True), (17, 3, False)]),
    # named, then hovering between the clearing mark and the threshold: stays named (hysteresis)
    ([(t, SLOW if t < 8 else (0.05, 0.05, 0.05, 0.07)) for t in range(0, 30)], [(5, 3, True)]),
])
def test_judge_names_only_what_persists_and_clears_with_hysteresis(rows, said):
    assert run(rows) == said


def test_a_named_rank_no_longer_scored_leaves_without_a_word():
    state, _ = judge(WatchState(), assess(job(*SLOW), RULE), RULE, 0.0)
    state, findings = judge(state, assess(job(*SLOW), RULE), RULE, 6.0)
    assert state.named == {3} and [f.named for f in findings] == [True]
    state, findings = judge(state, assess(job(*SLOW[:3]), RULE), RULE, 7.0)  # replaced: not scored yet
    assert state.named == frozenset() and findings == []


# -- the controller's watch ------------------------------------------------------------------------------------------


class Board:
    """The status board as the watch reads it: its snapshot, and the summary it is handed."""

    def __init__(self):
        self.snapshot: dict = {}
        self.stragglers: dict = {}

    def show(self, t: float, computes: tuple[float, ...], generation: int = 0, steps=(40, 40, 40, 40)) -> None:
        self.snapshot = {"time": t, "generation": generation, "ranks": [
            {"rank": r, "node": r // 2, "alive": True, "timed_steps": steps[r], "step_s": max(computes) + 0.01,
             "compute_s": c, "wait_s": max(computes) - c} for r, c in enumerate(computes)]}


VIEW = JobView(node_count=2, max_restarts=2, world_size=4, recovery=Level.PROCESS, library_ranks=4)


def test_the_watch_names_a_straggler_once_shows_it_and_stays_quiet_in_a_fault_free_job():
    board, watch = Board(), StragglerWatch(Board(), "report")
    watch.board = board
    said = []
    for t in range(0, 20):
        board.show(float(t), FAST if t < 5 else SLOW)
        said += watch.observe(VIEW, float(t))
    [seen] = said
    assert isinstance(seen, StragglerSeen) and seen.finding.rank == 3 and not seen.replace
    assert board.stragglers["named_ranks"] == [3] and board.stragglers["named_nodes"] == [1]
    assert board.stragglers["scores"][3] == 7.0 and "rank 3 on node 1: 7.0x" in board.stragglers["named"][0]
    assert watch.baseline == pytest.approx(0.06)  # the step time before the slowdown
    quiet = StragglerWatch(Board(), "report")
    for t in range(0, 60):
        quiet.board.show(float(t), (0.05 + 0.01 * (t % 3), 0.05, 0.06 - 0.01 * (t % 2), 0.05))
        assert quiet.observe(VIEW, float(t)) == []


def test_the_watch_says_what_a_move_gained_once_the_replacements_timed_a_full_window():
    board = Board()
    watch = StragglerWatch(board, "replace")
    events = []
    for t in range(0, 11):  # named at 10: the policy decides at once, before the next look
        board.show(float(t), FAST if t < 5 else SLOW)
        events += watch.observe(VIEW, float(t))
    [seen] = events
    assert seen.replace and not seen.moved_before
    # the policy moved node 1's ranks (its decision quotes the line): generation 1, the replacements fresh
    moved = dataclasses.replace(VIEW, generation=1, replaced_nodes=(f"node 1 (h1) moved to a spare: {seen.finding.line}",))
    board.show(12.0, FAST, generation=1, steps=(60, 60, 3, 3))
    assert watch.observe(moved, 12.0) == [] and watch.moved == {2, 3}
    board.show(13.0, FAST, generation=1, steps=(80, 80, 20, 20))
    [gain] = watch.observe(moved, 13.0)
    assert gain == StragglerGain(1, pytest.approx(0.06), pytest.approx(0.36), pytest.approx(0.06))
    # slow again on the spare: named, but not moved again
    later = []
    for t in range(14, 30):
        board.show(float(t), SLOW, generation=1)
        later += watch.observe(moved, float(t))
    [again] = later
    assert again.moved_before


def test_the_watch_forgets_a_move_the_policy_did_not_make():
    board = Board()
    watch = StragglerWatch(board, "replace")
    for t in range(0, 12):
        board.show(float(t), FAST if t < 5 else SLOW)
        watch.observe(VIEW, float(t))
    board.show(12.0, SLOW)
    watch.observe(VIEW, 12.0)  # no spare: nothing moved
    assert watch._pending is None and watch.moved == frozenset()


# -- the policy ----------------------------------------------------------------------------------------------------

SLOT = NodeSlot(1, "agent-1", "h1", 2, 2)
FINDING = Finding(3, 1, True, 7.0, "straggler: rank 3 on node 1 ...")


@pytest.mark.parametrize("view, replace, spare, moved, controller, refusal", [
    (VIEW, True, "spare-0", False, False, ""),
    (VIEW, False, "spare-0", False, False, "--stragglers report"),
    (VIEW, True, "", False, False, "no idle spare node to take its ranks"),
    (VIEW, True, "spare-0", True, False, "its ranks were moved to a spare once already and are slow still (their work, "
                                         "not the node)"),
    (VIEW, True, "spare-0", False, True, "its node runs the controller"),
    (dataclasses.replace(VIEW, phase=Phase.STOPPING), True, "spare-0", False, False, "a repair is under way (stopping)"),
    (dataclasses.replace(VIEW, restarts_used=2), True, "spare-0", False, False, "the retry budget is spent"),
    (dataclasses.replace(VIEW, recovery=Level.JOB), True, "spare-0", False, False,
     "the job cannot repair at process level"),
])
def test_straggler_refusal(view, replace, spare, moved, controller, refusal):
    assert policy.straggler_refusal(view, replace, True, spare, moved, controller) == refusal


def test_transition_running_to_stopping_when_a_straggler_s_node_moves_to_a_spare():
    seen = StragglerSeen(FINDING, True, slot=SLOT, spare="spare-0")
    view, commands = policy.decide(VIEW, seen)
    assert view.phase is Phase.STOPPING and view.level is Level.PROCESS and view.replacing == {2, 3}
    assert view.restarts_used == 1 and FINDING.line in view.replaced_nodes[0]
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.REPLACE]
    assert commands[0].agent_id == "spare-0" and commands[0].node_rank == 1 and commands[1].ranks == (2, 3)


def test_a_straggler_reported_only_changes_nothing():
    seen = StragglerSeen(FINDING, False, slot=SLOT, spare="spare-0", refusal="--stragglers report")
    assert policy.decide(VIEW, seen) == (VIEW, [])
    assert policy.decide(VIEW, StragglerGain(1, 0.2, 0.3, 0.2)) == (VIEW, [])


# -- the metrics endpoint ----------------------------------------------------------------------------------------------


def test_the_metrics_endpoint_serves_the_snapshot_and_the_events_to_a_scrape():
    import urllib.request

    from ftrun.controller.metrics import JobMetrics

    now = [100.0]
    metrics = JobMetrics("run-7", clock=lambda: now[0])
    board = Board()
    board.show(0.0, SLOW)
    snapshot = {**board.snapshot, "phase": "running", "steps_per_s": 2.5, "step": 40, "max_restarts": 3,
                "restarts_used": 1, "stragglers": ["rank 3 on node 1: ..."], "nodes": [{"node": 1, "straggler_score": 7.0}]}
    snapshot["ranks"][3]["straggler_score"] = 7.0
    events = [{"kind": "fault", "evidence": {"cause": "signal", "level": None}},
              {"kind": "fault", "evidence": {"cause": "device", "level": "RestartNPU"}},
              {"kind": "straggler", "named": True}, {"kind": "node_lost"},
              {"kind": "repair_done", "level": "process", "total": 1.5, "durations": {"stop": 0.5, "repair": 1.0}}]
    metrics.update(snapshot, events)
    now[0] = 130.0  # 30 s running
    metrics.update({**snapshot, "phase": "stopping"}, events)
    now[0] = 140.0  # 10 s repairing
    metrics.update(snapshot, events)
    port = metrics.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            page = answer.read().decode()
    finally:
        metrics.close()
    for line in ["ftrun_steps_per_second 2.5", "ftrun_step 40.0", "ftrun_restarts_left 2.0", "ftrun_stragglers 1.0",
                 'ftrun_rank_compute_seconds{node="1",rank="3"} 0.35', 'ftrun_rank_wait_seconds{node="0",rank="0"} 0.3',
                 'ftrun_straggler_score{node="1",rank="3"} 7.0', 'ftrun_node_straggler_score{node="1"} 7.0',
                 'ftrun_faults_total{kind="signal",level=""} 1.0', 'ftrun_faults_total{kind="device",level="RestartNPU"} 1.0',
                 'ftrun_faults_total{kind="straggler",level=""} 1.0', 'ftrun_faults_total{kind="node_lost",level=""} 1.0',
                 'ftrun_repairs_total{level="process"} 1.0', 'ftrun_repair_phase_seconds_count{level="process",phase="stop"} 1.0',
                 "ftrun_training_seconds_total 30.0", "ftrun_lost_seconds_total 10.0", "ftrun_goodput_ratio 0.75",
                 'ftrun_job_info{run_id="run-7"} 1.0']:
        assert line in page, line


# -- the preflight's speed check -----------------------------------------------------------------------------------


def speeds(*seconds: float) -> list:
    from ftrun.detection.preflight import NodeSpeed

    return [NodeSpeed(f"agent-{i}", f"host{i}", s) for i, s in enumerate(seconds)]


@pytest.mark.parametrize("seconds, room, keep, slow, refuse", [
    ((0.010, 0.011, 0.012), 1, "", [], False),
    ((0.010, 0.011, 0.030), 1, "", ["agent-2"], False),  # left out: the spare takes its place
    ((0.010, 0.010, 0.030, 0.030), 1, "", ["agent-2", "agent-3"], True),  # two slow, one spare
    ((0.010, 0.030), 0, "", ["agent-1"], True),  # no spare
    ((0.030, 0.010, 0.010), 1, "agent-0", ["agent-0"], True),  # the store's host is slow: it cannot leave
    ((0.010, 0.0, 0.040), 1, "", ["agent-2"], False),  # an unmeasured node is neither slow nor the median
    ((0.0, 0.040), 1, "", [], False),  # one measured node: nothing to compare
])
def test_preflight_leaves_out_a_node_past_twice_the_median_or_refuses(seconds, room, keep, slow, refuse):
    from ftrun.detection.preflight import judge_speeds

    verdict = judge_speeds(speeds(*seconds), room, keep)
    assert [agent for agent, _ in verdict.slow] == slow and verdict.refuse is refuse
    if slow:
        assert "its matmul takes 30.0 ms" in verdict.findings[0] or "40.0 ms" in verdict.findings[0]


def test_the_rendezvous_leaves_a_slow_node_out_for_the_spare_and_tells_it_why():
    from ftrun.messages import JoinRecord
    from ftrun.rendezvous import RendezvousPolicy, decide_rendezvous

    joins = [JoinRecord(f"agent-{i}", f"host{i}", 100 + i, 2, matmul_s=s) for i, s in enumerate((0.01, 0.05, 0.011))]
    policy = RendezvousPolicy(2, 2, 30.0, 600.0, spares=1)
    result = decide_rendezvous(joins, policy, "agent-0", 1.0, 1.0)
    assert [s.agent_id for s in result.nodes] == ["agent-0", "agent-2"] and result.spares == ()
    places = dict(result.places())
    assert places["agent-1"].slot is None and places["agent-1"].exit_code == 4
    assert places["agent-1"].error == "preflight: left out: host1: its matmul takes 50.0 ms, 4.5x the median 11.0 ms"
    refused = decide_rendezvous(joins[:2], RendezvousPolicy(2, 2, 30.0, 600.0), "agent-0", 1.0, 1.0)
    assert refused.error == "preflight failed: host1: its matmul takes 50.0 ms, 5.0x the median 10.0 ms"
    assert refused.exit_code == 4


def test_the_matmul_check_reads_its_child_s_times_and_shrugs_off_a_broken_one(tmp_path):
    from ftrun.detection.preflight import matmul_times

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("#!/bin/sh\necho '[0.012, 0.013]'\n")
    bad.write_text("#!/bin/sh\necho 'ModuleNotFoundError: torch' >&2\nexit 1\n")
    for script in (good, bad):
        script.chmod(0o755)
    assert matmul_times("cuda", 2, python=str(good)) == [0.012, 0.013]
    assert matmul_times("cpu", 1, python=str(bad)) == []


# -- what a person sees ------------------------------------------------------------------------------------------------


def test_the_status_view_and_top_name_the_straggler_and_highlight_its_node():
    from rich.console import Console
    from rich.text import Text

    from ftrun.live_view import render
    from ftrun.top_view import panes
    from tests.unit.test_top import SNAPSHOT

    snapshot = {**SNAPSHOT, "stragglers": ["rank 3 on node 1: 7.0x the job's median compute time (0.350s per step "
                                           "against 0.050s)"],
                "nodes": [{**n, "straggler": n["node"] == 1} for n in SNAPSHOT["nodes"]],
                "ranks": [{**r, "step_s": 0.36, "wait_s": 0.01 if r["rank"] == 3 else 0.31,
                           "straggler_score": 7.0 if r["rank"] == 3 else 1.0} for r in SNAPSHOT["ranks"]]}
    console = Console(width=160, record=True)
    console.print(render(snapshot, 160, 60))
    text = console.export_text()
    assert "straggler: rank 3 on node 1: 7.0x the job's median compute time" in text
    assert "step time" in text and "7.0x" in text and "0.310s" in text
    rows = dict(panes.rank_rows(snapshot))
    assert rows[3][8:] == ("0.360s", "0.010s", "7.0x") and rows[0][1:3] == ("0", "gpu0")
    assert isinstance(rows[3][1], Text) and rows[3][1].style == panes.SLOW_STYLE and rows[3][2].plain == "gpu1"


def test_ftrun_probe_speed_says_each_device_s_matmul_time(monkeypatch, capsys):
    import json

    from ftrun.cli import main
    from ftrun.detection import preflight

    asked = []
    monkeypatch.setattr(preflight, "matmul_times", lambda kind, count: asked.append((kind, count)) or [0.0123])
    with pytest.raises(SystemExit) as leaving:
        main(["probe", "--device", "cpu", "--speed", "--json"])
    assert leaving.value.code in (0, None) and asked == [("cpu", 1)]
    assert json.loads(capsys.readouterr().out)["matmul_ms"] == [12.3]
    with pytest.raises(SystemExit):
        main(["probe", "--device", "cpu", "--speed"])
    assert "cpu: a 512 x 512 matmul takes 12.3 ms" in capsys.readouterr().out
