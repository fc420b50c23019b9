"""The job-level recovery policy, edge by edge (no store, no processes)."""

from __future__ import annotations

import pytest

from ftrun.controller.policy import IllegalTransition, JobView, Phase, on_node_lost, on_report, start
from ftrun.messages import CommandKind, Report, ReportKind, WorkerFailure


def failure(rank=1, node=0, gen=0, code=1):
    return WorkerFailure(rank=rank, local_rank=rank % 2, node_rank=node, host=f"h{node}", pid=100 + rank,
                         exit_code=code, generation=gen)


def report(kind, node=0, gen=0, **fields):
    return Report(kind, node, gen, **fields)


def failed(node=0, gen=0, rank=1):
    return report(ReportKind.WORKER_FAILED, node, gen, failures=(failure(rank, node, gen),))


def view(**fields):
    return JobView(node_count=2, max_restarts=fields.pop("max_restarts", 2), **fields)


def test_start_publishes_generation_zero():
    _, commands = start(view())
    assert [(c.kind, c.generation, c.restart_count) for c in commands] == [(CommandKind.START, 0, 0)]


def test_transition_running_to_stopping_on_failure_with_budget_left():
    v, commands = on_report(view(), failed())
    assert v.phase is Phase.STOPPING
    assert [c.kind for c in commands] == [CommandKind.STOP]
    assert "rank 1" in commands[0].reason
    assert v.restarts_used == 0  # spent when the restart happens


def test_transition_stopping_to_running_when_every_node_stopped():
    v, _ = on_report(view(), failed())
    v, commands = on_report(v, report(ReportKind.STOPPED, node=0))
    assert v.phase is Phase.STOPPING and commands == []
    v, commands = on_report(v, report(ReportKind.STOPPED, node=1))
    assert v.phase is Phase.RUNNING
    assert (v.generation, v.restarts_used) == (1, 1)
    assert [(c.kind, c.generation, c.restart_count) for c in commands] == [(CommandKind.START, 1, 1)]


def test_transition_running_to_exiting_when_budget_spent():
    v, commands = on_report(view(max_restarts=0), failed())
    assert v.phase is Phase.EXITING and v.exit_code == 1
    assert [c.kind for c in commands] == [CommandKind.EXIT]
    assert "retry budget spent" in v.reason and "rank 1" in v.reason


def test_budget_is_job_wide_whatever_node_fails():
    v = view(max_restarts=2)
    for gen, node in enumerate([0, 1]):
        v, _ = on_report(v, failed(node=node, gen=gen))
        for n in (0, 1):
            v, _ = on_report(v, report(ReportKind.STOPPED, node=n, gen=gen))
    assert (v.generation, v.restarts_used, v.budget_left) == (2, 2, 0)
    v, commands = on_report(v, failed(node=0, gen=2))
    assert v.phase is Phase.EXITING and commands[0].kind is CommandKind.EXIT


def test_second_failure_while_stopping_is_recorded_not_acted_on():
    v, _ = on_report(view(), failed(rank=1))
    v, commands = on_report(v, failed(rank=3, node=1))
    assert commands == [] and v.phase is Phase.STOPPING
    assert [f.rank for f in v.failures] == [1, 3]  # the first is the root cause


def test_late_report_from_an_old_generation_is_ignored():
    v = view(generation=3)
    v2, commands = on_report(v, failed(gen=2))
    assert v2 == v and commands == []


def test_transition_running_to_exiting_when_every_node_succeeded():
    v, commands = on_report(view(), report(ReportKind.SUCCEEDED, node=0))
    assert v.phase is Phase.RUNNING and commands == []
    v, commands = on_report(v, report(ReportKind.SUCCEEDED, node=1))
    assert v.phase is Phase.EXITING and v.exit_code == 0
    assert [(c.kind, c.exit_code) for c in commands] == [(CommandKind.EXIT, 0)]


@pytest.mark.parametrize("code", [130, 143])
def test_transition_to_exiting_on_interrupt_carries_its_code(code):
    v, commands = on_report(view(), report(ReportKind.INTERRUPTED, node=1, exit_code=code, detail="SIGINT on node 1"))
    assert v.phase is Phase.EXITING and v.exit_code == code
    assert commands[0].exit_code == code and commands[0].reason == "SIGINT on node 1"


def test_transition_exiting_to_done_after_every_acknowledgement():
    v, _ = on_report(view(max_restarts=0), failed())
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    assert v.phase is Phase.EXITING
    v, _ = on_report(v, report(ReportKind.EXITED, node=1))
    assert v.phase is Phase.DONE


def test_lost_node_ends_the_job_and_needs_no_acknowledgement():
    v, commands = on_node_lost(view(), 1, "node 1 lost")
    assert v.phase is Phase.EXITING and v.exit_code == 1 and v.reason == "node 1 lost"
    assert commands[0].kind is CommandKind.EXIT
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    assert v.phase is Phase.DONE


def test_node_lost_while_exiting_counts_as_its_acknowledgement():
    v, _ = on_report(view(), report(ReportKind.INTERRUPTED, node=0, exit_code=130))
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    v, _ = on_node_lost(v, 1, "gone")
    assert v.phase is Phase.DONE and v.exit_code == 130


def test_illegal_transition_raises():
    with pytest.raises(IllegalTransition):
        view(phase=Phase.DONE).move(Phase.RUNNING)
