"""The recovery policy, as pure transitions over a frozen view of the job.

No clock, store or process in here: each ``on_*`` function takes the job's view
(``states.py``) and one event and returns the next view and the commands to publish;
:func:`decide` picks the function for an event of the controller's inbox (``inbox.py``).
The observers (``observers.py``) turn what the store shows into those events, and the
executor (``executor.py``) applies the results.

Process level (docs/design.md, "The repair, step by step"): a fault moves RUNNING to
STOPPING and names the ranks to replace; the phases then follow the milestones
the ranks and agents reach (healthy ranks left the old group, failed processes
reaped, the new group formed, state rolled back) until RUNNING again. Job level:
STOPPING until every agent stopped its workers, then every worker starts anew.

The online level replaces nobody: a rank's collective failed while every process lived
(:func:`on_collective_failed`, once :func:`on_collective_seen` held it ONLINE_GRACE), so every rank is
healthy and only the groups and the step are redone. Its phases are process level's, with no rank to
reap; a death or a hang during it takes the same repair down to process level, a failure of the
re-formed groups to job level.

When every rank of a generation has failed, no healthy replica can hand the training state on, and
a process-level repair would replace every rank only to find that out at the rollback: the job goes
to job level at once (restoring the snapshots, with --snapshot-every). The failures of several nodes
arrive as separate reports, so the first starts a process-level repair: the report that completes the
set of failed ranks turns that repair into the job-level restart (:func:`_no_replica_left`), with no
second unit of budget. (The controller holds a repair's REPLACE commands back for a moment, so that a
repair given up this way has started no replacement that the restart would kill at once.)

With snapshots (--snapshot-every), once a repair's replacements have started (the agents were told),
the repair is not given up when its healthy ranks die too (staggered deaths: the last one may come a
second later): the replacements already run, and a job-level restart would kill them and start every
rank again. The same repair replaces the later ranks as well, and every rank's rollback goes back to the
newest snapshot all of them hold.
"""

from __future__ import annotations

import dataclasses

from ftrun.contract import CollectiveFailure, Milestone, RollbackFailure
from ftrun.controller import inbox
from ftrun.controller.states import IN_PLACE, MILESTONE_OF, REPAIR_PHASES, Decision, Heard, HeldCollective, JobView, Level, Phase
from ftrun.errors import ExitCode
from ftrun.messages import Command, CommandKind, OperatorAction, OperatorRequest, Report, ReportKind, WorkerFailure


def start(view: JobView) -> Decision:
    """The first generation's start."""
    return view, [_start_command(view)]


def on_report(view: JobView, report: Report) -> Decision:
    """The next view and commands after one agent's report."""
    if report.kind is ReportKind.INTERRUPTED:
        return _exit(view, report.exit_code, report.detail or f"interrupted on node {report.node_rank}")
    if report.kind is ReportKind.EXITED:
        return _acknowledge_exit(view, report.node_rank)
    if report.kind is ReportKind.NODE_UNUSABLE:
        return on_node_unusable(view, report.node_rank, report.detail)
    if report.kind is ReportKind.WORKER_FAILED and _known_failures(view, report):
        return view, []  # said again to a controller whose journal holds it
    if report.kind is ReportKind.WORKER_FAILED and _fails_a_live_rank(view, report):
        return _on_failure(view, report)
    if report.kind is ReportKind.SUCCEEDED and _finished_before_the_repair(view, report):
        return _no_replica_left(view, "", f"the ranks of node {report.node_rank} finished generation "
                                          f"{report.generation} before the repair reached them")
    if report.generation != view.generation:
        return view, []  # a late word about a generation that is already gone
    if report.kind is ReportKind.SUCCEEDED:
        return _on_success(view, report.node_rank)
    if report.kind is ReportKind.STOPPED:
        return _on_stopped(view, report.node_rank)
    if report.kind is ReportKind.CLEARED:
        return _on_cleared(view, report.node_rank)
    raise ValueError(f"unknown report kind {report.kind}")


def _fails_a_live_rank(view: JobView, report: Report) -> bool:
    """A failure in this generation, or, during a process-level repair, in an earlier one since the
    last START: its healthy ranks live on into the repair's generations, and one may die before its
    agent has heard of the newest (a repair that goes on moves on a generation at each later death)."""
    return report.generation == view.generation or _earlier_generation_of_the_repair(view, report.generation)


def _earlier_generation_of_the_repair(view: JobView, generation: int) -> bool:
    """During a process-level repair, a generation since the last START before the repair's own: its healthy
    ranks live on into the repair's generations."""
    return (view.level in IN_PLACE and view.phase in REPAIR_PHASES
            and view.start_generation <= generation < view.generation)


def _known_failures(view: JobView, report: Report) -> bool:
    """Every failure of the report is one the job has already counted: an agent says its failures again to
    each new controller (under etcd), which may or may not have them from its predecessor's journal."""
    known = {_failure_key(f) for f in view.failures}
    return bool(report.failures) and all(_failure_key(f) in known for f in report.failures)


def _failure_key(failure: WorkerFailure) -> tuple:
    """One process's end: a rank's pid, its generation and the time, whatever the record's text."""
    return failure.node_rank, failure.rank, failure.pid, failure.generation, failure.timestamp


def _finished_before_the_repair(view: JobView, report: Report) -> bool:
    """A node's ranks finished their training in a generation that a process-level repair under way
    counted them healthy in: they trained on, to the end, beside the ranks of a node declared lost while
    those lived (its agent stopped past its lease: the controller's, whose successor learns of the success
    only from the node's report sent again to it). None of them can join the repair."""
    return _earlier_generation_of_the_repair(view, report.generation)


def on_library_ranks(view: JobView, count: int) -> Decision:
    """How many ranks of the current generation said hello from ftrun.elastic."""
    return dataclasses.replace(view, library_ranks=max(view.library_ranks, count)), []


def on_process_level_refused(view: JobView, reason: str) -> Decision:
    """The script's ranks say its layout rules process-level repair out (groups ftrun cannot re-form,
    state it cannot tell the replicas of): every later fault goes to job level at once."""
    return dataclasses.replace(view, refusal=reason), []


def on_milestone(view: JobView, milestone: Milestone) -> Decision:
    """Every rank concerned reached ``milestone`` (counted by the controller in the store)."""
    if view.level not in IN_PLACE or view.phase not in MILESTONE_OF:
        return view, []
    expected, after = MILESTONE_OF[view.phase]
    if milestone is not expected:
        return view, []
    if after is Phase.RUNNING:
        return view.move(Phase.RUNNING, replacing=frozenset(), clearing=frozenset(), succeeded=frozenset(),
                         replacements_started=False, stateless=frozenset()), []
    return _advance_clear(view.move(after)), []


def on_repair_failed(view: JobView, detail: str, fallback: RollbackFailure | None = None) -> Decision:
    """A process-level repair cannot finish (deadline; ``fallback``: the ranks found no state to go
    back to, ``detail`` its reason): fall back to job level."""
    if view.phase not in REPAIR_PHASES or view.level not in IN_PLACE:
        return view, []
    if view.budget_left <= 0:
        return _exit(view, ExitCode.JOB_FAILED, f"{detail}; retry budget spent, no job-level fallback left")
    view = view.move(Phase.STOPPING, level=Level.JOB, acknowledged=frozenset(), reason=detail,
                     fallback=fallback)
    return view, [Command(CommandKind.STOP, view.generation, reason=f"{detail}; falling back to job level")]


def on_node_lost(view: JobView, node_rank: int, detail: str, spare: str = "", ranks: tuple[int, ...] = ()) -> Decision:
    """A node stopped sending keepalives (or its ssh session ended). With ``spare`` (an idle spare
    agent) that agent takes the node's rank and its ``ranks`` are started there: alone while the
    others run on (process level), or with every rank restarted (job level). Without one, the job
    goes on without the node if --nnodes MIN allows (scale-in, job level), else it ends."""
    if node_rank in view.lost or node_rank in view.vacant or view.phase is Phase.DONE:
        return view, []
    if view.phase is not Phase.EXITING and not spare and view.min_nodes and len(view.present) - 1 >= view.min_nodes:
        return _scale_in(view, node_rank, detail, len(ranks))
    if view.phase is Phase.EXITING or not spare:
        view = dataclasses.replace(view, lost=view.lost | {node_rank})
        if view.phase is Phase.EXITING:
            return _acknowledge_exit(view, node_rank)
        return _exit(view, ExitCode.JOB_FAILED, detail)
    takeover = Command(CommandKind.TAKEOVER, view.generation, node_rank=node_rank, agent_id=spare, reason=detail)
    view = dataclasses.replace(view, replaced_nodes=view.replaced_nodes + (detail,))
    if view.phase is Phase.STOPPING and view.level is Level.JOB:
        # a job-level restart under way: the spare has nothing to stop, the lost node never will
        view, commands = _on_stopped(view, node_rank)
        return view, [takeover, *commands]
    if view.level in IN_PLACE and view.phase in REPAIR_PHASES and ranks:
        return _repair_goes_on_without(view, node_rank, frozenset(ranks), detail, takeover)
    if view.budget_left <= 0:
        spent = f"retry budget spent ({view.max_restarts} restart{'s' if view.max_restarts != 1 else ''})"
        return _exit(dataclasses.replace(view, lost=view.lost | {node_rank}), ExitCode.JOB_FAILED, f"{detail}; {spent}")
    # nodes whose ranks finished hold no live replica: their ranks cannot join a repair (a node declared lost
    # while its ranks lived, its agent stopped, may see them through to the end with the others)
    if (view.phase is Phase.RUNNING and view.process_level_ready and ranks and not set(ranks) >= view.every_rank
            and not view.succeeded):
        view = view.move(
            Phase.STOPPING,
            level=Level.PROCESS,
            generation=view.next_generation,
            restarts_used=view.restarts_used + 1,
            replacing=frozenset(ranks),
            clearing=frozenset({node_rank}),
            acknowledged=frozenset(),
            reason=detail,
        )
        return view, [takeover, _replace_command(view, frozenset(ranks))]
    finished = bool(ranks) and bool(view.succeeded) and view.phase is Phase.RUNNING
    if finished:
        nodes = ", ".join(str(n) for n in sorted(view.succeeded))
        detail = f"{detail}; the ranks of node {nodes} had finished, no healthy replica holds the training state"
    view = view.move(Phase.STOPPING, level=Level.JOB, acknowledged=frozenset({node_rank}), reason=detail,
                     no_replica=bool(ranks) and (set(ranks) >= view.every_rank or finished))
    return view, [takeover, Command(CommandKind.STOP, view.generation, reason=detail)]


def _repair_goes_on_without(view: JobView, node_rank: int, ranks: frozenset[int], detail: str,
                            takeover: Command) -> Decision:
    """A node (with a spare for it) lost while a process-level repair is under way, the controller's own
    among them (its successor finds the repair in its journal, and none of its milestones): the same
    repair goes on in a new generation, which supersedes the one under way, and replaces the node's ranks
    besides the ranks it was replacing (whose replacements may not have started: they start again). No
    second unit of budget: one fault, one repair; the repair deadline bounds how long it may go on."""
    replacing = view.replacing | ranks
    if view.stateless | replacing >= view.every_rank:
        return _no_replica_left(view, detail)
    view = view.move(
        Phase.STOPPING,
        generation=view.next_generation,
        replacing=replacing,
        clearing=view.clearing | {node_rank},
        acknowledged=frozenset(),
        level=Level.PROCESS,
    )
    return view, [takeover, _replace_command(view, replacing)]


def on_controller_moved(view: JobView) -> Decision:
    """A controller took office from its predecessor's journal while a repair was under way, and no node
    is lost with the move (the same agent took the office again in a new term, its old controller given
    up). What the repair's phase waits for lived in the store the agents left: the announcement and the
    milestones of a process-level repair, its REPLACE commands (held back, or published there), the STOP
    of a job-level restart. A process-level repair goes on in a new generation, which supersedes the one
    under way, replacing the same ranks (left as it was, it sat until the repair deadline, 60 s "stuck in
    stopping", and fell to job level: issue 40); a job-level restart is told again. No second unit of
    budget: one fault, one repair."""
    if view.phase is Phase.STOPPING and view.level is Level.JOB:
        return view, [Command(CommandKind.STOP, view.generation, reason=view.reason)]
    if view.level not in IN_PLACE or view.phase not in REPAIR_PHASES:
        return view, []
    view = view.move(Phase.STOPPING, generation=view.next_generation, acknowledged=frozenset(),
                     replacements_started=False)
    return view, [_replace_command(view, view.replacing)]


def _scale_in(view: JobView, node_rank: int, detail: str, nproc: int) -> Decision:
    """Go on without the node: every rank restarts (job level) in a smaller world."""
    if view.budget_left <= 0:
        spent = f"retry budget spent ({view.max_restarts} restart{'s' if view.max_restarts != 1 else ''})"
        return _exit(dataclasses.replace(view, lost=view.lost | {node_rank}), ExitCode.JOB_FAILED, f"{detail}; {spent}")
    line = f"{detail}; going on with {len(view.present) - 1} nodes"
    view = dataclasses.replace(view, vacant=view.vacant | {node_rank}, world_size=view.world_size - nproc,
                               resized=view.resized + (line,))
    if view.phase is Phase.STOPPING and view.level is Level.JOB:
        return _restart_when_stopped(view)  # the node it waited for is not part of the job any more
    view = view.move(Phase.STOPPING, level=Level.JOB, acknowledged=frozenset(), reason=line)
    return view, [Command(CommandKind.STOP, view.generation, reason=line)]


def on_node_joined(view: JobView, node_rank: int, agent_id: str, nproc: int, host: str) -> Decision:
    """A node joined a job that has fewer nodes than --nnodes MAX (after a scale-in, or one that was
    late for the rendezvous): it takes ``node_rank`` (a vacant one, or the next new one) and the job
    restarts at job level to grow back. Chosen, not a fault: it spends no budget."""
    if view.phase is not Phase.RUNNING:
        return view, []  # a repair or the exit under way: it stays a spare, asked again later
    line = f"{host} joined as node {node_rank}; going on with {len(view.present) + 1} nodes"
    view = dataclasses.replace(
        view, vacant=view.vacant - {node_rank}, node_count=max(view.node_count, node_rank + 1),
        world_size=view.world_size + nproc, resized=view.resized + (line,))
    view = view.move(Phase.STOPPING, level=Level.JOB, acknowledged=frozenset({node_rank}), reason=line,
                     free_restart=True)
    takeover = Command(CommandKind.TAKEOVER, view.generation, node_rank=node_rank, agent_id=agent_id, reason=line)
    return view, [takeover, Command(CommandKind.STOP, view.generation, reason=line)]


def on_stop(view: JobView, exit_code: int, reason: str) -> Decision:
    """The user stopped the job where the controller runs (a head node's Ctrl-C)."""
    return _exit(view, exit_code, reason)


def operator_refusal(view: JobView, request: OperatorRequest, signed: bool, spare: str = "") -> str:
    """Why a person's request from ``ftrun top`` is refused, or "" (then :func:`on_operator` applies it).
    ``signed``: the request verified against the job's token (a job without a token takes none)."""
    if not signed:
        return "the job has no token (--token-file): it takes no actions from ftrun top"
    if view.phase in (Phase.EXITING, Phase.DONE):
        return "the job is ending"
    if request.action is OperatorAction.STOP:
        return ""
    if view.phase is not Phase.RUNNING:
        return f"a repair is under way ({view.phase.value}); try again once the job runs"
    if view.budget_left <= 0:
        return "the retry budget is spent: a drill would end the job"
    if request.action is OperatorAction.RESTART and request.rank not in view.every_rank:
        return f"there is no rank {request.rank}"
    if request.action is OperatorAction.DRAIN:
        if request.node_rank not in view.present:
            return f"there is no node {request.node_rank}"
        if not spare:
            return f"no idle spare node to take node {request.node_rank}'s ranks"
    return ""


def on_operator(view: JobView, request: OperatorRequest, node_rank: int = -1, local_rank: int = -1, host: str = "",
                pid: int = 0, spare: str = "", ranks: tuple[int, ...] = (), at: float = 0.0) -> Decision:
    """A request :func:`operator_refusal` let through. A restart drill is the rank's failure as the
    normal path sees one (its process is killed and replaced at process level where the job allows
    it, with one unit of budget), dated ``at`` (the controller's wall clock: the repair is timed from
    it); a drain is the node's loss with a spare ready; a stop ends the job."""
    why = f"asked by {request.who} from ftrun top"
    if request.action is OperatorAction.STOP:
        return _exit(view, ExitCode.INTERRUPTED, f"stopped by {request.who} from ftrun top")
    if request.action is OperatorAction.DRAIN:
        return on_node_lost(view, request.node_rank, f"node {request.node_rank} drained ({why})", spare, ranks)
    failure = WorkerFailure(rank=request.rank, local_rank=local_rank, node_rank=node_rank, host=host, pid=pid,
                            exit_code=None, generation=view.generation, timestamp=at, cause="drill",
                            detail=f"restart drill {why}")
    return _on_failure(view, Report(ReportKind.WORKER_FAILED, node_rank, view.generation, (failure,)))


def straggler_refusal(view: JobView, replace: bool, named: bool, spare: str = "", moved_before: bool = False,
                      runs_controller: bool = False, outside: bool = False) -> str:
    """Why a straggler's node keeps its ranks ("" when they move to ``spare``): --stragglers report, no idle
    spare, a repair under way, a job that cannot repair at process level, no budget, the node runs the
    controller (its agent would leave with it); or its ranks were moved for straggling once already and are
    slow still, so the slowness is their work's, not the node's. A straggler named from outside (its CPU
    share) is never moved: CPU time is too weak a sign to spend a repair on."""
    if not named:
        return "cleared"
    if outside:
        return ("--stragglers replace acts on the worker library's step times, never on the outside view" if replace
                else "--stragglers report")
    if moved_before:
        return "its ranks were moved to a spare once already and are slow still (their work, not the node)"
    if not replace:
        return "--stragglers report"
    if runs_controller:
        return "its node runs the controller"
    if view.phase is not Phase.RUNNING:
        return f"a repair is under way ({view.phase.value})"
    if not view.process_level_ready:
        return "the job cannot repair at process level"
    if view.budget_left <= 0:
        return "the retry budget is spent"
    if not spare:
        return "no idle spare node to take its ranks"
    return ""


def on_straggler(view: JobView, seen: inbox.StragglerSeen) -> Decision:
    """A straggler named: with --stragglers replace, and nothing in :func:`straggler_refusal`'s way, its node's
    ranks move to the idle spare at process level as a lost node's do (one unit of budget); else it is only
    reported (always, when named from outside)."""
    if seen.refusal or seen.slot is None or seen.outside:
        return view, []
    slot = seen.slot
    detail = f"node {slot.node_rank} ({slot.host}) moved to a spare: {seen.finding.line}"
    return on_node_lost(view, slot.node_rank, detail, seen.spare, tuple(range(slot.first_rank, slot.first_rank + slot.nproc)))


def on_node_unusable(view: JobView, node_rank: int, detail: str) -> Decision:
    """A node has no usable device left for its ranks: a node-level fault. Without a spare node
    to take its place the job cannot go on; no retry would help, so no budget is spent."""
    return _exit(view, ExitCode.DEVICE, f"node {node_rank}: {detail}; no spare node to take its place")


def _on_failure(view: JobView, report: Report) -> Decision:
    view = dataclasses.replace(view, failures=view.failures + report.failures)
    ranks = frozenset(f.rank for f in report.failures)
    first = report.failures[0].describe() if report.failures else f"a worker on node {report.node_rank}"
    if view.phase in (Phase.EXITING, Phase.DONE) or (view.phase in REPAIR_PHASES and view.level is Level.JOB):
        return view, []  # already stopping everything: recorded as a secondary failure
    setting = next((f for f in report.failures if f.cause == "setting"), None)
    if setting is not None:
        return _exit(view, ExitCode.JOB_FAILED, f"{setting.describe()}; not retried: a restart would fail the same way")
    if view.phase in (Phase.STOPPING, Phase.ENV_CLEAR, Phase.REPAIR) and view.level in IN_PLACE:
        if view.stateless | view.replacing | ranks >= view.every_rank and not _repair_goes_on_from_snapshots(view):
            return _no_replica_left(view, first)
        if view.level is Level.ONLINE:
            # the online repair goes down to process level (its peers saw the death first, as a failed
            # collective), in a generation of its own: its ranks may have resumed their communicators in
            # place (MindSpore), which would leave the replacement out
            return _repair_in_a_new_generation(view, ranks, report.node_rank)
        if view.replacements_started:
            # a healthy rank may have counted itself into the new group before it died, and a group that
            # counts a dead rank forms without its replacement and hangs (seen with staggered deaths: 60 s
            # to the repair deadline): the repair goes on in a generation no dead rank has touched
            return _repair_in_a_new_generation(view, ranks, report.node_rank)
        # the reports of one crash, a few milliseconds apart: replace these ranks in the same repair
        view = view.move(
            Phase.STOPPING,
            replacing=view.replacing | ranks,
            clearing=view.clearing | {report.node_rank},
            acknowledged=view.acknowledged - {report.node_rank},
        )
        return view, [_replace_command(view, ranks)]
    if view.phase is Phase.ROLLBACK and view.level in IN_PLACE:
        if view.stateless | ranks >= view.every_rank and not _repair_goes_on_from_snapshots(view):
            return _no_replica_left(view, first)
        # the repair's group broke before it resumed
        return _repair_in_a_new_generation(view, ranks, report.node_rank)
    if view.budget_left <= 0:
        spent = f"retry budget spent ({view.max_restarts} restart{'s' if view.max_restarts != 1 else ''})"
        return _exit(view, ExitCode.JOB_FAILED, f"{first}; {spent}")
    if view.process_level_ready and ranks >= view.every_rank:
        return _no_replica_left(view, first)
    if view.process_level_ready:
        view = view.move(
            Phase.STOPPING,
            level=Level.PROCESS,
            generation=view.next_generation,
            restarts_used=view.restarts_used + 1,
            replacing=ranks,
            clearing=frozenset({report.node_rank}),
            acknowledged=frozenset(),
            reason=first,
        )
        return view, [_replace_command(view, ranks)]
    view = view.move(Phase.STOPPING, level=Level.JOB, acknowledged=frozenset(), reason=first)
    return view, [Command(CommandKind.STOP, view.generation, reason=first)]


def _repair_in_a_new_generation(view: JobView, ranks: frozenset[int], node_rank: int) -> Decision:
    """The same repair goes on in the next generation, replacing ``ranks`` (no second unit of budget; the
    repair deadline bounds how long this may go on). The replacements already started are ranks of it
    that hold no state: the rollback gives them a healthy replica's, or every rank goes to the snapshots."""
    view = view.move(
        Phase.STOPPING,
        generation=view.next_generation,
        replacing=ranks,
        stateless=view.stateless | view.replacing,
        clearing=frozenset({node_rank}),
        acknowledged=frozenset(),
        level=Level.PROCESS,
    )
    return view, [_replace_command(view, ranks)]


def on_collective_failed(view: JobView, failure: CollectiveFailure, node_rank: int = -1, host: str = "") -> Decision:
    """A rank's collective failed and, a moment later (the controller waits ONLINE_GRACE for a death's
    report), no process of the job has died: a link cut or reset, a timeout, a communicator error. The
    online level: every rank leaves the failed step, re-forms its groups in the next generation and rolls
    back to the consistent step, and no process is replaced; one unit of budget, as any repair.

    Inside the online repair's own generation (its groups failed again as they re-formed) no process is
    to blame, and replacing one would not mend a link: the repair falls back to job level. A rank that
    dies or hangs meanwhile is replaced (process level: :func:`_on_failure`)."""
    if failure.generation != view.generation:
        return view, []  # a late word about a generation already left
    record = WorkerFailure(rank=failure.rank, local_rank=-1, node_rank=node_rank, host=host, pid=0, exit_code=None,
                           generation=failure.generation, timestamp=failure.at, cause="collective",
                           detail=failure.error)
    if view.phase is Phase.RUNNING and view.process_level_ready:
        view = dataclasses.replace(view, failures=view.failures + (record,))
        if view.budget_left <= 0:
            spent = f"retry budget spent ({view.max_restarts} restart{'s' if view.max_restarts != 1 else ''})"
            return _exit(view, ExitCode.JOB_FAILED, f"{failure.describe()}; {spent}")
        view = view.move(
            Phase.STOPPING,
            level=Level.ONLINE,
            generation=view.next_generation,
            restarts_used=view.restarts_used + 1,
            replacing=frozenset(),
            clearing=frozenset(),
            acknowledged=frozenset(),
            reason=failure.describe(),
        )
        return view, [_replace_command(view, frozenset())]
    if view.level is Level.ONLINE and view.phase in REPAIR_PHASES:
        view = dataclasses.replace(view, failures=view.failures + (record,))
        return on_repair_failed(view, f"{failure.describe()} during the online repair")
    return view, []


#: how long a rank's failed collective is held before it counts as a fault of its own (the online level):
#: a peer that died breaks the same collectives, and its agent, which sees the death at once (pidfds),
#: reports it within this; the death then decides, and the failed collective was its echo. It is held
#: too until every node's agent has sent a keepalive since (at most AGENT_HEARTBEAT_INTERVAL): a node
#: whose agent died with its ranks reports nothing, and its loss, told by --node-timeout, decides
ONLINE_GRACE = 0.25


def on_collective_seen(view: JobView, seen: inbox.CollectiveFailed) -> Decision:
    """A rank's failed collective, seen again at each turn of the controller while its key holds it: held
    from its first sight, it becomes the online repair (:func:`on_collective_failed`) once ONLINE_GRACE
    passed with no death decided meanwhile and every node's agent was heard from since. Watched only where
    process level is ready (else a rank's own wait for an announcement ends it) or during an online repair."""
    if not view.watches_collectives:
        return view, []
    held = view.held
    if held is None or held.generation != view.generation:
        return dataclasses.replace(view, held=HeldCollective(view.generation, seen.seen, seen.heard)), []
    if seen.seen - held.since < ONLINE_GRACE or not _heard_from_every_node_since(held.heard, seen.heard):
        return view, []
    return on_collective_failed(view, seen.failure, seen.node_rank, seen.host)


def _heard_from_every_node_since(then: tuple[Heard, ...], now: tuple[Heard, ...]) -> bool:
    counts = {heard.node_rank: heard.keepalives for heard in now}
    return all(counts.get(heard.node_rank, 0) > heard.keepalives for heard in then)


def on_link_back(view: JobView, node_rank: int, host: str, rank: int, detail: str, at: float = 0.0) -> Decision:
    """A node's data link came back after it went dark while every process lived (``controller/links.py``):
    the collectives that waited across it may wait on for TCP's backoff (16 s and more after 90 s dark),
    so the job is repaired online at once, as for a failed collective: every rank gives its collective up
    and re-forms its groups on fresh connections; no process is replaced. Only where process level is
    ready: other scripts' collectives go on by themselves once TCP retransmits."""
    if view.phase is not Phase.RUNNING or not view.process_level_ready:
        return view, []
    failure = CollectiveFailure(rank, view.generation, detail, at)
    decided, commands = on_collective_failed(view, failure, node_rank, host)
    if decided.level is Level.ONLINE and decided.phase is Phase.STOPPING:
        record = dataclasses.replace(decided.failures[-1], cause="link")
        decided = dataclasses.replace(decided, reason=detail, failures=decided.failures[:-1] + (record,))
        commands = [_replace_command(decided, frozenset())]
    return decided, commands


def on_link_lost(view: JobView, detail: str) -> Decision:
    """A data link stayed dark past --repair-timeout and no spare can take its node: the job ends, whatever
    budget is left. A job-level restart would not help: the new generation forms its groups over the same
    dark link (on the test bed, its connect failed at once, the online repair that followed stood until its
    own deadline, and the budget went on that, ending the job later with the repair as its reason)."""
    if view.phase is not Phase.RUNNING:
        return view, []
    return _exit(view, ExitCode.JOB_FAILED, detail)


def on_replacements_started(view: JobView) -> Decision:
    """The repair's REPLACE commands went out: its replacements start now."""
    if view.level not in IN_PLACE or view.phase not in REPAIR_PHASES:
        return view, []
    return dataclasses.replace(view, replacements_started=True), []


def _repair_goes_on_from_snapshots(view: JobView) -> bool:
    """Every rank failed during a process-level repair whose replacements already started: with
    snapshots the repair goes on (see the module's note) rather than giving way to a restart."""
    return view.snapshots and view.replacements_started


def _no_replica_left(view: JobView, first: str, why: str = "every rank failed") -> Decision:
    """Every rank of the generation failed (or ``why``: the healthy ones ended): no healthy replica can hand
    the training state on, so the job restarts at job level now (restoring the snapshots, with
    --snapshot-every) instead of replacing every rank at process level and finding that out at the
    rollback (or waiting for ranks that ended until the repair's deadline).

    From RUNNING (one report named every rank) this is the decision itself. During a process-level
    repair (an earlier report started it, this one completes the set) the repair is given up: its
    generation stays spent (its replacements may have written keys there), the restart goes to the
    one after, and its unit of budget comes back, since the restart spends one for the same fault.
    """
    starting = view.phase is Phase.RUNNING
    cause = first if starting else view.reason  # the repair's reason names the root cause
    reason = f"{cause}; {why}, no healthy replica holds the training state"
    refund = 0 if starting else 1
    view = view.move(Phase.STOPPING, level=Level.JOB, restarts_used=view.restarts_used - refund,
                     acknowledged=frozenset(), no_replica=True, reason=reason)
    return view, [Command(CommandKind.STOP, view.generation, reason=f"{reason}; restarting at job level")]


def _on_success(view: JobView, node_rank: int) -> Decision:
    view = dataclasses.replace(view, succeeded=view.succeeded | {node_rank})
    if view.phase is Phase.RUNNING and view.succeeded >= view.present:
        return _exit(view, ExitCode.OK, "every worker finished")
    return view, []


def on_stopped(view: JobView, node_ranks: frozenset[int]) -> Decision:
    """The agents of ``node_ranks`` acknowledged the job-level STOP: no worker of theirs is left."""
    if view.phase is not Phase.STOPPING or view.level is not Level.JOB:
        return view, []
    return _restart_when_stopped(dataclasses.replace(view, acknowledged=view.acknowledged | node_ranks))


def _on_stopped(view: JobView, node_rank: int) -> Decision:
    return on_stopped(view, frozenset({node_rank}))


def _restart_when_stopped(view: JobView) -> Decision:
    """Job level: once every node stopped its workers, the next generation starts everywhere."""
    if view.acknowledged < view.present:
        return view, []
    view = view.move(
        Phase.RUNNING,
        generation=view.next_generation,
        start_generation=view.next_generation,
        restarts_used=view.restarts_used + (0 if view.free_restart else 1),
        free_restart=False,
        no_replica=False,
        fallback=None,
        replacements_started=False,
        stateless=frozenset(),
        library_ranks=0,
        replacing=frozenset(),
        clearing=frozenset(),
        succeeded=frozenset(),
        acknowledged=frozenset(),
    )
    return view, [_start_command(view)]


def _on_cleared(view: JobView, node_rank: int) -> Decision:
    """An agent reaped its failed ranks; the milestone counts once every such node has."""
    if view.level not in IN_PLACE or view.phase not in (Phase.STOPPING, Phase.ENV_CLEAR):
        return view, []
    return _advance_clear(dataclasses.replace(view, acknowledged=view.acknowledged | {node_rank})), []


def _advance_clear(view: JobView) -> JobView:
    if view.phase is Phase.ENV_CLEAR and view.acknowledged >= view.clearing:
        return view.move(Phase.REPAIR)
    return view


def _start_command(view: JobView) -> Command:
    return Command(
        CommandKind.START, view.generation, restart_count=view.restarts_used, max_restarts=view.max_restarts,
        reason=view.reason,
    )


def _replace_command(view: JobView, ranks: frozenset[int]) -> Command:
    return Command(
        CommandKind.REPLACE, view.generation, restart_count=view.restarts_used, max_restarts=view.max_restarts,
        ranks=tuple(sorted(ranks)), reason=view.reason,
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


def decide(view: JobView, event: inbox.Event) -> Decision:
    """The next view and commands after one event of the controller's inbox (a ``HostGone`` is made a
    ``NodeLost`` by the controller, which knows the hosts)."""
    match event:
        case inbox.Reported(report):
            return on_report(view, report)
        case inbox.StopsAcknowledged(generation, nodes):
            return on_stopped(view, nodes) if generation == view.generation else (view, [])
        case inbox.CollectiveFailed():
            return on_collective_seen(view, event)
        case inbox.MilestoneReached(milestone):
            return on_milestone(view, milestone)
        case inbox.RepairFailed(detail, fallback):
            return on_repair_failed(view, detail, fallback)
        case inbox.NodeLost(slot, detail, spare):
            return on_node_lost(view, slot.node_rank, detail, spare, event.ranks)
        case inbox.LibraryRanks(count):
            return on_library_ranks(view, count)
        case inbox.ProcessLevelRefused(reason):
            return on_process_level_refused(view, reason)
        case inbox.OperatorAsked():
            return _on_operator_asked(view, event)
        case inbox.StopAsked(exit_code, reason):
            return on_stop(view, exit_code, reason)
        case inbox.SpareIdle(node_rank, spare):
            return on_node_joined(view, node_rank, spare.agent_id, spare.nproc, spare.host)
        case inbox.ReplacementsStarted():
            return on_replacements_started(view)
        case inbox.ControllerMoved():
            return on_controller_moved(view)
        case inbox.LinkBack(node_rank, host, rank, detail, at):
            return on_link_back(view, node_rank, host, rank, detail, at)
        case inbox.LinkLost(detail):
            return on_link_lost(view, detail)
        case inbox.StragglerSeen():
            return on_straggler(view, event)
        case inbox.StragglerGain():
            return view, []  # told, nothing to do
    raise ValueError(f"no decision for {event!r}")


def _on_operator_asked(view: JobView, asked: inbox.OperatorAsked) -> Decision:
    request, slot = asked.request, asked.slot
    if asked.refusal:
        return view, []
    if request.action is OperatorAction.STOP or slot is None:
        return on_operator(view, request)
    if request.action is OperatorAction.DRAIN:
        return on_operator(view, request, spare=asked.spare, ranks=tuple(range(slot.first_rank, slot.first_rank + slot.nproc)))
    return on_operator(view, request, slot.node_rank, request.rank - slot.first_rank, slot.host, asked.pid, at=asked.at)
