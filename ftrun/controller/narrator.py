"""What the controller tells: a log line and an event (``events.jsonl``, the status, ``ftrun top``) for
each fault, decision, phase and repair, with the phase breakdown of each repair.

The narrator decides nothing and writes nothing to the control store. The controller hands it the
job's view before and after each decision, and what it did about it; every event the controller
records is composed here, with the log line that tells it, so that they read alike and are tested
without a store (``tests/unit/test_narrator.py``).
"""

from __future__ import annotations

import logging
from typing import Callable

from ftrun.contract import Fallback, RollbackFailure
from ftrun.controller.inbox import StragglerGain, StragglerSeen
from ftrun.controller.states import IN_PLACE, REPAIR_PHASES, JobView, Level, Phase
from ftrun.errors import ExitCode
from ftrun.events import EventLog
from ftrun.messages import NodeSlot, OperatorAction, OperatorRequest, RendezvousResult
from ftrun.snapshots.format import size_text
from ftrun.snapshots.plan import DISK, MEMORY, PINNED, REPLICA, Restore, merged_counts

log = logging.getLogger(__name__)
PROCESS_PHASES = (Phase.ENV_CLEAR, Phase.REPAIR, Phase.ROLLBACK)


def fallback_remedy(failure: RollbackFailure) -> str:
    """What would have let the ranks put the state back at process level ("" when nothing the user sets would)."""
    ways = []
    if failure.cause is Fallback.NO_SNAPSHOTS:
        ways.append("--snapshot-every K")  # each rank goes back to its own snapshot
    elif failure.cause is Fallback.NO_COMMON_SNAPSHOT:
        ways.append("a smaller --snapshot-every K")  # the fault came before every rank held one
    if not failure.replicas:  # a replacement receives its state from a replica
        ways.append("a replica dimension (job.mesh({...}, replicate=(...)))")
    return " or ".join(ways)


class RepairClock:
    """When each phase of the repair under way began, for the phase breakdown.

    Wall-clock seconds. The first mark is the fault's detection, timed by the agent that saw it, so
    the "detect" figure includes any clock difference between that host and the controller's.
    """

    def __init__(self):
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str, when: float) -> None:
        self.marks.append((phase, when))

    def breakdown(self, end: float) -> list[tuple[str, float]]:
        times = [t for _, t in self.marks[1:]] + [end]
        return [(name, later - t) for (name, t), later in zip(self.marks, times)]


class Narrator:
    """Tells the job's story as the controller moves it; keeps the clock of the repair under way.

    ``joined(g)`` is how many ranks joined generation ``g``'s process group (the store's count of that
    milestone): whether the ranks run ftrun.elastic, and when a job-level restart is back in training.
    """

    def __init__(self, events: EventLog, joined: Callable[[int], int]):
        #: every fault, decision, phase and repair (the summary, the status view and events.jsonl)
        self.events = events
        self._joined = joined
        self.repair = RepairClock()
        #: --rdzv-backend etcd: etcd is unreachable, and was said to be
        self.etcd_down = False
        #: the generation of a job-level restart whose ranks are still joining their group (else None)
        self.restarting: int | None = None
        #: whether the generation before the restart ran ftrun.elastic: else no rank will join a group,
        #: and the restart is over as its workers start
        self._library_seen = False
        #: the fall back to job level for want of the library is said once a job
        self._said_no_library = False

    @property
    def repair_decided_at(self) -> float:
        """When the controller decided the repair under way (its "stop" mark): the repair deadline
        counts from there, never from another host's clock."""
        return self.repair.marks[1][1]

    # -- the job ----------------------------------------------------------------------------------

    def job_started(self, run_id: str, result: RendezvousResult, view: JobView) -> None:
        """The first event: who is in the job, and how it recovers."""
        nodes = [{"node": n.node_rank, "host": n.host, "nproc": n.nproc} for n in result.nodes]
        spares = [{"host": s.host, "nproc": s.nproc} for s in result.spares]
        self.events.emit("job_started", 0, f"{len(nodes)} nodes, {result.world_size} ranks, {len(spares)} spares, "
                         f"{view.recovery.value}-level recovery, {view.max_restarts} restarts",
                         run_id=run_id, world_size=result.world_size, nodes=nodes, spares=spares,
                         recovery=view.recovery.value, max_restarts=view.max_restarts)

    def took_office(self, journal, agent_id: str, host: str, now: float) -> None:
        """This controller goes on from ``journal`` (``journal.Journal``), its predecessor's (--rdzv-backend
        etcd), at ``now`` (wall clock)."""
        line = f"the controller moved from {journal.host} to {host}: {journal.host}'s lease lapsed"
        log.warning(line)
        if journal.view.phase is not Phase.RUNNING:
            # a repair or restart under way: its clock (and deadline) starts again here, where it goes on
            self.repair = RepairClock()
            self.repair.mark("detect", now)
            self.repair.mark("stop", now)
            self._library_seen = journal.view.library_ranks > 0
        self.events.emit("controller_moved", journal.view.generation, line, host=host, agent=agent_id,
                         previous_host=journal.host, previous_agent=journal.leader, moves=journal.moves + 1)

    def etcd_unreachable(self, generation: int, detail: str) -> None:
        """etcd has no quorum (or is cut off): said once until it answers again."""
        if self.etcd_down:
            return
        self.etcd_down = True
        line = f"the control store (etcd) is unreachable: {detail}; training goes on, decisions wait for it"
        log.error(line)
        self.events.emit("decision", generation, line, action="wait_for_etcd")

    def etcd_back(self, generation: int) -> None:
        self.etcd_down = False
        log.warning("the control store (etcd) answers again")
        self.events.emit("decision", generation, "the control store (etcd) answers again", action="etcd_back")

    def job_finished(self, view: JobView, duration: float, step: int | None) -> None:
        outcome = "succeeded" if view.exit_code == ExitCode.OK else f"failed (exit code {view.exit_code})"
        self.events.emit("job_finished", view.generation, f"job {outcome}: {view.reason}", exit_code=view.exit_code,
                         reason=view.reason, duration=round(duration, 3), step=step, restarts_used=view.restarts_used,
                         max_restarts=view.max_restarts)

    # -- a decision of the policy -----------------------------------------------------------------

    def decided(self, before: JobView | None, after: JobView, now: float) -> bool:
        """Say what a decision changed: its new faults, resizes, and where the job moved (``now``: wall
        clock). True when the job moved (its phase, generation or level)."""
        for failure in after.failures[len(before.failures) if before else 0:]:
            self.events.fault(failure)
        for line in after.resized[len(before.resized) if before else 0:]:
            log.warning(line)
            self.events.emit("resized", after.generation, line, world_size=after.world_size)
        if before is None or (before.phase, before.generation, before.level) == (
                after.phase, after.generation, after.level):
            return False  # nothing moved (a process-level repair that goes to job level may stay STOPPING)
        if before.phase is not after.phase:
            self.events.emit("phase", after.generation, f"{before.phase.value} -> {after.phase.value}",
                             phase=after.phase.value, level=after.level.value)
        if (before.level is Level.ONLINE and before.phase in REPAIR_PHASES and after.level is Level.PROCESS
                and after.phase in REPAIR_PHASES):  # not a new repair after an online one ended (its level stays)
            self._went_down(after)
        if after.phase is Phase.EXITING:
            pass  # the controller says how the job finished, with the final status
        elif before.phase is Phase.RUNNING and after.phase is Phase.STOPPING:
            self._fault_stopped_the_job(before, after, now)
        elif before.level in IN_PLACE and after.level is Level.JOB and after.no_replica:
            self._decision(after)  # the process-level repair under way is given up: every rank failed
        elif before.level in IN_PLACE and after.level is Level.JOB and after.phase is Phase.STOPPING:
            self._fell_back(before, after)
        elif after.phase in PROCESS_PHASES:
            # a decision may pass through several phases at once (reaped before everyone stopped)
            start = PROCESS_PHASES.index(before.phase) + 1 if before.phase in PROCESS_PHASES else 0
            for phase in PROCESS_PHASES[start:PROCESS_PHASES.index(after.phase) + 1]:
                self.repair.mark(phase.value.replace("_", " "), now)
        elif before.phase is not Phase.RUNNING and after.phase is Phase.RUNNING and self.repair.marks:
            if before.level is Level.JOB and not before.free_restart and self._library_seen:
                # the new workers are starting: the repair ends when they all joined their group
                self.repair.mark("restart", now)
                self.restarting = after.generation
            else:
                self._repaired(before.level, before.free_restart, after, now)
        return True

    def check_restarted(self, view: JobView, now: float) -> None:
        """After a job-level restart: once every new rank joined its process group, training is back."""
        if view.generation != self.restarting or view.phase is not Phase.RUNNING:
            self.restarting = None
            return
        if self._joined(view.generation) >= view.world_size:
            self.restarting = None
            self._repaired(Level.JOB, False, view, now)

    def _fault_stopped_the_job(self, before: JobView, after: JobView, now: float) -> None:
        """A fault (or a node joining) stopped the job: the repair's clock starts."""
        self.repair = RepairClock()
        new_failures = after.failures[len(before.failures):]
        self.repair.mark("detect", min((f.timestamp for f in new_failures), default=now))
        self.repair.mark("stop", now)
        self._library_seen = self._joined(before.generation) > 0
        # said only where it is why: a scale-in (a node left out) is job level with every rank under the library
        if (after.level is Level.JOB and after.recovery is Level.PROCESS and not after.no_replica
                and (after.refusal or after.library_ranks < after.world_size) and not self._said_no_library):
            self._said_no_library = True
            if after.refusal:
                log.warning("process-level recovery is off: %s: using job-level recovery", after.refusal)
            else:
                log.warning("not every rank runs ftrun.elastic (%d of %d said hello): using job-level recovery",
                            after.library_ranks, after.world_size)
        self._decision(after)

    def _went_down(self, after: JobView) -> None:
        """The online repair under way goes down to process level: a rank died or hung during it (or its
        peers saw its death first, as a failed collective). Said once, with the rank replaced."""
        ranks = ", ".join(str(rank) for rank in sorted(after.replacing))
        cause = after.failures[-1].describe() if after.failures else "a rank failed"
        line = (f"process-level repair into generation {after.generation}: {cause}; replacing "
                f"rank{'s' if len(after.replacing) != 1 else ''} {ranks} (the online repair under way goes down to it)")
        log.warning(line)
        self.events.emit("decision", after.generation, line, level=Level.PROCESS.value, action="step_down",
                         budget_left=after.budget_left, target_generation=after.generation)

    def _fell_back(self, before: JobView, after: JobView) -> None:
        """The process-level (or online) repair under way gives way to a job-level restart: said here once
        for the whole job (the ranks that found it print nothing), with what would have avoided it."""
        repair = "online repair" if before.level is Level.ONLINE else "process-level repair"
        line = f"{repair} of generation {after.generation} falls back to job level: {after.reason}"
        remedy = fallback_remedy(after.fallback) if after.fallback is not None else ""
        if remedy:
            line += f"; {remedy} would keep it at process level"
        log.warning(line)
        self.events.emit("repair_failed", after.generation, line, level=Level.JOB.value,
                         cause=after.fallback.cause.name.lower() if after.fallback is not None else "", remedy=remedy)

    def _decision(self, after: JobView) -> None:
        """The level the job's recovery takes (the first decision, or the move to job level once every
        rank has failed)."""
        target = after.generation if after.level in IN_PLACE else after.next_generation
        if after.free_restart:
            line = f"job-level restart into generation {target} to grow the job"
        elif after.level is Level.ONLINE:
            line = f"online repair into generation {target}: {after.reason}; no process is replaced"
        else:
            line = f"{after.level.value}-level repair into generation {target}: {after.reason}"
        log.warning(line)
        self.events.emit("decision", after.generation, line, level="grow" if after.free_restart else after.level.value,
                         budget_left=after.budget_left, target_generation=target)

    def _repaired(self, level: Level, free_restart: bool, after: JobView, now: float) -> None:
        """Training runs again: the repair's phase breakdown."""
        phases = self.repair.breakdown(now)
        total = sum(seconds for _, seconds in phases)
        detail = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in phases)
        if level in IN_PLACE:
            line = f"generation {after.generation} resumed training {total:.2f}s after the fault ({detail})"
            line += ", repaired online: no process replaced" if level is Level.ONLINE else ""
        elif free_restart:
            line = f"generation {after.generation} starting with {len(after.present)} nodes"
        elif phases[-1][0] == "restart":
            line = f"generation {after.generation} back in training {total:.2f}s after the fault ({detail})"
        else:  # a script without ftrun.elastic: no sign of its training, only that it started
            line = f"generation {after.generation} starting, {total:.2f}s after the fault ({detail})"
        log.warning(line)
        self.repair = RepairClock()
        if not free_restart:
            self.events.emit("repair_done", after.generation, line, level=level.value,
                             durations={name: round(seconds, 6) for name, seconds in phases}, total=round(total, 6))

    # -- what the controller did --------------------------------------------------------------------

    def generation_started(self, generation: int, world_size: int, grow: bool) -> None:
        level = "start" if generation == 0 else "grow" if grow else "job"
        self.events.emit("generation_started", generation, f"generation {generation} starts with {world_size} ranks",
                         level=level, world_size=world_size)

    def node_lost(self, generation: int, slot: NodeSlot, detail: str) -> None:
        self.events.emit("node_lost", generation, detail, node=slot.node_rank, host=slot.host)

    def took_over(self, generation: int, node_rank: int, spare: NodeSlot, lost: NodeSlot | None) -> None:
        """A spare holds a node from now on: a lost one's, or a new one's when the job grows."""
        if lost is None:
            line = f"{spare.host} joins the job as node {node_rank}"
        else:
            line = f"spare {spare.host} takes the place of node {node_rank} ({lost.host})"
        log.warning(line)
        self.events.emit("takeover", generation, line, node=node_rank, host=spare.host)

    def straggler(self, generation: int, seen: StragglerSeen) -> None:
        """A straggler named or cleared, and whether its node's ranks move to a spare (why not, when not)."""
        finding = seen.finding
        moves = finding.named and not seen.refusal
        if not finding.named:
            line = finding.line
        elif moves:
            line = f"{finding.line}; moving node {finding.node}'s ranks to a spare"
        else:
            line = f"{finding.line}; reported only ({seen.refusal})"
        (log.warning if finding.named else log.info)(line)
        self.events.emit("straggler", generation, line, node=finding.node, rank=finding.rank,
                         host=seen.slot.host if seen.slot is not None else None, score=finding.score,
                         named=finding.named, action="replace" if moves else "report", outside=seen.outside)

    def straggler_gain(self, generation: int, gain: StragglerGain) -> None:
        """What moving a straggler's ranks gained, in the job's step time."""
        before = f"{gain.before:.3f}s before the slowdown, " if gain.before else ""
        line = (f"node {gain.node}'s ranks moved off a straggler: the job's step takes {before}{gain.slowed:.3f}s with "
                f"the straggler, {gain.after:.3f}s after the move")
        log.warning(line)
        self.events.emit("straggler_gain", generation, line, node=gain.node, before=round(gain.before, 4),
                         slowed=round(gain.slowed, 4), after=round(gain.after, 4))

    def operator(self, generation: int, request: OperatorRequest, slot: NodeSlot | None, refusal: str) -> None:
        """A person's request from ``ftrun top``, with who asked and the answer."""
        what = {OperatorAction.RESTART: f"a restart drill of rank {request.rank}",
                OperatorAction.DRAIN: f"to drain node {request.node_rank}",
                OperatorAction.STOP: "to stop the job"}[request.action]
        detail = f"{request.who} asked for {what}" + (f"; refused: {refusal}" if refusal else "")
        (log.warning if refusal else log.info)("ftrun top: %s", detail)
        self.events.emit("operator", generation, detail, node=slot.node_rank if slot is not None else None,
                         rank=request.rank if request.rank >= 0 else None,
                         host=slot.host if slot is not None else None, action=request.action.value, who=request.who,
                         accepted=not refusal)

    def restore(self, generation: int, restore: Restore, counts: list[dict[str, int]], sources: dict) -> None:
        """A job-level restart's restore: the step, and where the ranks read it (``counts``: each node's)."""
        if restore.step < 0:
            line = f"generation {generation} starts without a snapshot to restore: {restore.reason}"
        else:
            total = merged_counts(counts)
            places = ", ".join(f"{total[w]} from {w}" for w in (MEMORY, PINNED, REPLICA, DISK) if w in total)
            line = f"generation {generation} restores step {restore.step} ({places})"
        log.warning(line)
        self.events.emit("restore", generation, line, step=restore.step, sources=sources)

    def checkpoint(self, generation: int, step: int, world: int, nbytes: int, path: str) -> None:
        self.events.emit("checkpoint", generation, f"checkpoint of step {step} on disk: {world} ranks, {size_text(nbytes)}",
                         step=step, path=path)
