"""The job-level recovery policy, as pure transitions over a frozen view of the job.

No clock, store or process in here: :func:`on_report` and :func:`on_node_lost`
take the job's view and one event and return the next view and the commands to
publish. The controller thread (``controller.py``) applies them.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from ftrun.errors import ExitCode
from ftrun.messages import Command, CommandKind, Report, ReportKind, WorkerFailure


class Phase(enum.Enum):
    """Where the job stands, from the controller's point of view."""

    #: the generation's workers are running (or some nodes have finished theirs)
    RUNNING = "running"
    #: a fault was seen; every agent is stopping the generation's workers before a restart
    STOPPING = "stopping"
    #: the job is over (success, budget spent or interrupted); agents are stopping and leaving
    EXITING = "exiting"
    #: every agent has acknowledged the exit (or is gone); the controller can stop
    DONE = "done"


#: every legal edge; anything else is a bug and raises
TRANSITIONS = {
    Phase.RUNNING: {Phase.RUNNING, Phase.STOPPING, Phase.EXITING},
    # all stopped -> the next generation runs; an interrupt or a lost node during the stop -> exit
    Phase.STOPPING: {Phase.STOPPING, Phase.RUNNING, Phase.EXITING},
    Phase.EXITING: {Phase.EXITING, Phase.DONE},
    Phase.DONE: {Phase.DONE},
}


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True)
class JobView:
    node_count: int
    max_restarts: int
    phase: Phase = Phase.RUNNING
    generation: int = 0
    restarts_used: int = 0
    succeeded: frozenset[int] = frozenset()
    acknowledged: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()
    #: every worker failure of the job, oldest first: the first is the root cause
    failures: tuple[WorkerFailure, ...] = ()
    exit_code: int = 0
    reason: str = ""

    def move(self, phase: Phase, **changes) -> "JobView":
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.phase.name} -> {phase.name}")
        return dataclasses.replace(self, phase=phase, **changes)

    @property
    def present(self) -> frozenset[int]:
        return frozenset(range(self.node_count)) - self.lost

    @property
    def budget_left(self) -> int:
        return self.max_restarts - self.restarts_used


Decision = tuple[JobView, list[Command]]


def on_report(view: JobView, report: Report) -> Decision:
    """The next view and commands after one agent's report."""
    if report.kind is ReportKind.INTERRUPTED:
        return _exit(view, report.exit_code, report.detail or f"interrupted on node {report.node_rank}")
    if report.kind is ReportKind.EXITED:
        return _acknowledge_exit(view, report.node_rank)
    if report.generation != view.generation:
        return view, []  # a late word about a generation that is already gone
    if report.kind is ReportKind.WORKER_FAILED:
        return _on_failure(view, report)
    if report.kind is ReportKind.SUCCEEDED:
        return _on_success(view, report.node_rank)
    if report.kind is ReportKind.STOPPED:
        return _on_stopped(view, report.node_rank)
    raise ValueError(f"unknown report kind {report.kind}")


def on_node_lost(view: JobView, node_rank: int, detail: str) -> Decision:
    """A node stopped sending keepalives. Without spares the job cannot go on."""
    if node_rank in view.lost:
        return view, []
    view = dataclasses.replace(view, lost=view.lost | {node_rank})
    if view.phase is Phase.EXITING:
        return _acknowledge_exit(view, node_rank)
    if view.phase is Phase.DONE:
        return view, []
    return _exit(view, ExitCode.JOB_FAILED, detail)


def start(view: JobView) -> Decision:
    """The first generation's start."""
    return view, [_start_command(view)]


def _on_failure(view: JobView, report: Report) -> Decision:
    view = dataclasses.replace(view, failures=view.failures + report.failures)
    if view.phase is not Phase.RUNNING:
        return view, []  # already stopping or exiting: recorded as a secondary failure
    first = report.failures[0].describe() if report.failures else f"a worker on node {report.node_rank}"
    if view.budget_left <= 0:
        spent = f"retry budget spent ({view.max_restarts} restart{'s' if view.max_restarts != 1 else ''})"
        return _exit(view, ExitCode.JOB_FAILED, f"{first}; {spent}")
    view = view.move(Phase.STOPPING, acknowledged=frozenset(), reason=first)
    return view, [Command(CommandKind.STOP, view.generation, reason=first)]


def _on_success(view: JobView, node_rank: int) -> Decision:
    view = dataclasses.replace(view, succeeded=view.succeeded | {node_rank})
    if view.phase is Phase.RUNNING and view.succeeded >= view.present:
        return _exit(view, ExitCode.OK, "every worker finished")
    return view, []


def _on_stopped(view: JobView, node_rank: int) -> Decision:
    if view.phase is not Phase.STOPPING:
        return view, []
    view = dataclasses.replace(view, acknowledged=view.acknowledged | {node_rank})
    if view.acknowledged < view.present:
        return view, []
    view = view.move(
        Phase.RUNNING,
        generation=view.generation + 1,
        restarts_used=view.restarts_used + 1,
        succeeded=frozenset(),
        acknowledged=frozenset(),
    )
    return view, [_start_command(view)]


def _start_command(view: JobView) -> Command:
    return Command(
        CommandKind.START, view.generation, restart_count=view.restarts_used, max_restarts=view.max_restarts,
        reason=view.reason,
    )


def _exit(view: JobView, code: int, reason: str) -> Decision:
    if view.phase in (Phase.EXITING, Phase.DONE):
        return view, []
    view = view.move(Phase.EXITING, acknowledged=frozenset(), exit_code=int(code), reason=reason)
    return _maybe_done(view, [Command(CommandKind.EXIT, view.generation, exit_code=int(code), reason=reason)])


def _acknowledge_exit(view: JobView, node_rank: int) -> Decision:
    if view.phase is not Phase.EXITING:
        return view, []
    return _maybe_done(dataclasses.replace(view, acknowledged=view.acknowledged | {node_rank}), [])


def _maybe_done(view: JobView, commands: list[Command]) -> Decision:
    if view.acknowledged >= view.present:
        view = view.move(Phase.DONE)
    return view, commands
