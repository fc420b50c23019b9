"""What the controller tells of each decision (ftrun.controller.narrator): the events and their texts,
over the policy's own views, with no store and no clock but the times given."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ftrun.contract import Fallback, RollbackFailure
from ftrun.controller.narrator import Narrator
from ftrun.controller.states import JobView, Level, Phase
from ftrun.controller.policy import on_repair_failed, on_report
from ftrun.events import EventLog
from ftrun.messages import NodeSlot, OperatorAction, OperatorRequest, Report, ReportKind, WorkerFailure
from ftrun.snapshots.plan import Restore

FAULT_AT = 100.0


def job(recovery: Level = Level.PROCESS) -> JobView:
    """A running job of 2 nodes x 2 ranks, every rank under ftrun.elastic."""
    return JobView(node_count=2, max_restarts=3, world_size=4, recovery=recovery, library_ranks=4)


def rank_3_failed(generation: int = 0) -> Report:
    return Report(ReportKind.WORKER_FAILED, 1, generation, failures=(
        WorkerFailure(rank=3, local_rank=1, node_rank=1, host="h1", pid=103, exit_code=-9, signal="SIGKILL",
                      timestamp=FAULT_AT, generation=generation),))


def told(joined: dict[int, int] | None = None) -> tuple[Narrator, EventLog]:
    events = EventLog()
    return Narrator(events, lambda generation: (joined or {}).get(generation, 0)), events


def kinds(events: EventLog) -> list[str]:
    return [e["kind"] for e in events.events]


def test_a_process_level_repair_is_told_as_its_decision_then_its_phases_one_by_one():
    narrator, events = told()
    running = job()
    stopping, _ = on_report(running, rank_3_failed())
    assert narrator.decided(running, stopping, FAULT_AT + 0.5)
    assert kinds(events) == ["fault", "phase", "decision"]
    decision = events.events[-1]
    assert decision["detail"] == f"process-level repair into generation 1: {stopping.reason}"
    assert (decision["level"], decision["target_generation"]) == ("process", 1)
    assert narrator.repair_decided_at == FAULT_AT + 0.5  # the repair deadline counts from here
    phases = [(Phase.ENV_CLEAR, 0.7), (Phase.REPAIR, 1.0), (Phase.ROLLBACK, 1.5), (Phase.RUNNING, 2.0)]
    before = stopping
    for phase, at in phases:
        after = dataclasses.replace(before, phase=phase)
        assert narrator.decided(before, after, FAULT_AT + at)
        before = after
    done = events.events[-1]
    assert done["kind"] == "repair_done" and done["level"] == "process"
    assert done["detail"] == ("generation 1 resumed training 2.00s after the fault (detect 500 ms, stop 200 ms, "
                              "env clear 300 ms, repair 500 ms, rollback 500 ms)")
    assert list(done["durations"]) == ["detect", "stop", "env clear", "repair", "rollback"]
    assert [e["detail"] for e in events.events if e["kind"] == "phase"] == [
        "running -> stopping", "stopping -> env_clear", "env_clear -> repair", "repair -> rollback",
        "rollback -> running"]


def test_a_decision_that_moves_nothing_tells_only_its_faults():
    narrator, events = told()
    view = job()
    assert not narrator.decided(view, view, FAULT_AT)
    assert not narrator.decided(None, view, FAULT_AT)  # the first decision: nothing before it
    assert events.events == []


def test_a_job_level_restart_of_library_ranks_is_back_when_every_new_rank_joined():
    joined = {0: 4}
    narrator, events = told(joined)
    running = job(Level.JOB)
    stopping, _ = on_report(running, rank_3_failed())
    narrator.decided(running, stopping, FAULT_AT + 0.5)
    assert events.events[-1]["detail"] == f"job-level repair into generation 1: {stopping.reason}"
    restarted = dataclasses.replace(stopping, phase=Phase.RUNNING, generation=1)
    narrator.decided(stopping, restarted, FAULT_AT + 1.0)
    assert narrator.restarting == 1 and "repair_done" not in kinds(events)
    joined[1] = 3
    narrator.check_restarted(restarted, FAULT_AT + 1.5)
    assert narrator.restarting == 1 and "repair_done" not in kinds(events)
    joined[1] = 4
    narrator.check_restarted(restarted, FAULT_AT + 2.0)
    assert narrator.restarting is None
    assert events.events[-1]["detail"] == ("generation 1 back in training 2.00s after the fault (detect 500 ms, "
                                           "stop 500 ms, restart 1000 ms)")


def test_a_restart_of_a_script_without_the_library_is_told_as_it_starts():
    narrator, events = told()  # no rank ever joined a group: nothing to wait for
    running = dataclasses.replace(job(Level.JOB), library_ranks=0)
    stopping, _ = on_report(running, rank_3_failed())
    narrator.decided(running, stopping, FAULT_AT + 0.5)
    narrator.decided(stopping, dataclasses.replace(stopping, phase=Phase.RUNNING, generation=1), FAULT_AT + 1.0)
    assert narrator.restarting is None
    assert events.events[-1]["detail"] == "generation 1 starting, 1.00s after the fault (detect 500 ms, stop 500 ms)"


def test_the_end_of_the_job_says_its_outcome_and_its_reason():
    narrator, events = told()
    narrator.job_finished(dataclasses.replace(job(), exit_code=0, reason="all ranks succeeded"), 12.3456, 50)
    narrator.job_finished(dataclasses.replace(job(), exit_code=1, reason="retry budget spent"), 1.0, None)
    assert [(e["detail"], e["duration"], e["step"]) for e in events.events] == [
        ("job succeeded: all ranks succeeded", 12.346, 50), ("job failed (exit code 1): retry budget spent", 1.0, None)]


def test_a_takeover_names_the_spare_and_the_node_it_takes():
    narrator, events = told()
    spare, lost = NodeSlot(-1, "spare", "h9", 2, -1), NodeSlot(1, "agent-1", "h1", 2, 2)
    narrator.took_over(1, 1, spare, lost)
    narrator.took_over(2, 2, spare, None)
    assert [(e["detail"], e["node"], e["host"]) for e in events.events] == [
        ("spare h9 takes the place of node 1 (h1)", 1, "h9"), ("h9 joins the job as node 2", 2, "h9")]


def test_an_operator_s_request_is_told_with_who_asked_and_the_answer():
    narrator, events = told()
    slot = NodeSlot(1, "agent-1", "h1", 2, 2)
    narrator.operator(0, OperatorRequest(OperatorAction.RESTART, "ana@desk", rank=3), slot, "")
    narrator.operator(0, OperatorRequest(OperatorAction.DRAIN, "ana@desk", node_rank=1), slot, "no idle spare")
    first, second = events.events
    assert (first["detail"], first["rank"], first["node"], first["accepted"]) == (
        "ana@desk asked for a restart drill of rank 3", 3, 1, True)
    assert (second["detail"], second["rank"], second["accepted"]) == (
        "ana@desk asked for to drain node 1; refused: no idle spare", None, False)


def test_a_restore_says_its_step_and_where_the_ranks_read_it():
    narrator, events = told()
    narrator.restore(2, Restore(2, {}, step=40), [{"memory": 2}, {"memory": 1, "replica": 1}], {})
    narrator.restore(3, Restore(3, {}, reason="no snapshot yet"), [], {})
    assert [e["detail"] for e in events.events] == [
        "generation 2 restores step 40 (3 from memory, 1 from replica)",
        "generation 3 starts without a snapshot to restore: no snapshot yet"]


def in_rollback() -> JobView:
    """A process-level repair of rank 3 into generation 1, at its rollback."""
    stopping, _ = on_report(job(), rank_3_failed())
    return dataclasses.replace(stopping, phase=Phase.ROLLBACK)


@pytest.mark.parametrize("failure, remedy", [
    (RollbackFailure(Fallback.NO_SNAPSHOTS, replicas=False),
     "--snapshot-every K or a replica dimension (job.mesh({...}, replicate=(...)))"),
    (RollbackFailure(Fallback.NO_SNAPSHOTS, replicas=True), "--snapshot-every K"),
    (RollbackFailure(Fallback.NO_COMMON_SNAPSHOT, replicas=True), "a smaller --snapshot-every K"),
    (RollbackFailure(Fallback.SNAPSHOT_UNREADABLE, replicas=True, detail="step 4 fails its checksum"), ""),
], ids=["sharded-no-snapshots", "replicas-no-snapshots", "no-common-snapshot", "unreadable"])
def test_a_fallback_the_ranks_found_is_said_once_with_what_would_avoid_it(caplog, failure, remedy):
    narrator, events = told()
    rollback = in_rollback()
    fallen, _ = on_repair_failed(rollback, failure.reason, failure)
    with caplog.at_level(logging.WARNING, logger="ftrun.controller.narrator"):
        assert narrator.decided(rollback, fallen, FAULT_AT + 1)
    (event,) = [e for e in events.events if e["kind"] == "repair_failed"]
    line = f"process-level repair of generation 1 falls back to job level: {failure.reason}"
    assert event["detail"] == (f"{line}; {remedy} would keep it at process level" if remedy else line)
    assert (event["cause"], event["remedy"], event["level"]) == (failure.cause.name.lower(), remedy, "job")
    assert [r.getMessage() for r in caplog.records] == [event["detail"]]  # one line, the event's


def test_a_repair_past_its_deadline_falls_back_with_its_reason_and_no_remedy(caplog):
    narrator, events = told()
    rollback = in_rollback()
    fallen, _ = on_repair_failed(rollback, "the repair did not finish within 6s (stuck in rollback)")
    with caplog.at_level(logging.WARNING, logger="ftrun.controller.narrator"):
        narrator.decided(rollback, fallen, FAULT_AT + 1)
    (event,) = [e for e in events.events if e["kind"] == "repair_failed"]
    assert event["detail"] == ("process-level repair of generation 1 falls back to job level: the repair did not "
                               "finish within 6s (stuck in rollback)")
    assert (event["cause"], event["remedy"]) == ("", "")
    assert [r.getMessage() for r in caplog.records] == [event["detail"]]


def test_a_scale_in_of_library_ranks_is_not_said_as_ranks_without_the_library(caplog):
    # found on the test bed: a job-level stop of a job whose 4 ranks all run ftrun.elastic said "not every rank runs
    # ftrun.elastic (4 of 4 said hello)"; a scale-in (one node left out) is such a stop
    narrator, _ = told()
    running = job()
    stopping = running.move(Phase.STOPPING, level=Level.JOB, reason="node 1 lost; going on with 1 nodes")
    stopping = dataclasses.replace(stopping, world_size=2, vacant=frozenset({1}))
    with caplog.at_level(logging.WARNING, logger="ftrun.controller.narrator"):
        narrator.decided(running, stopping, FAULT_AT + 0.5)
    assert "ftrun.elastic" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="ftrun.controller.narrator"):  # a rank without it: said
        narrator.decided(dataclasses.replace(running, library_ranks=3),
                         dataclasses.replace(stopping, library_ranks=3, world_size=4), FAULT_AT + 0.5)
    assert "not every rank runs ftrun.elastic (3 of 4 said hello): using job-level recovery" in caplog.text
