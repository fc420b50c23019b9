"""The controller's observers: each reads one thing the store shows and returns what it saw as events
(``inbox.py``). None decides or applies anything; the controller hands their events to the policy.

Each reads as little as its moment needs: one read of the report counter a tick, the running
generation's failure keys only where they can matter, the milestone counter of the phase under way.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ftrun.contract import CollectiveFailure, Milestone, RollbackFailure
from ftrun.controller.inbox import (
    CollectiveFailed,
    Event,
    LibraryRanks,
    MilestoneReached,
    NodeLost,
    OperatorAsked,
    ProcessLevelRefused,
    RepairFailed,
    Reported,
    SpareIdle,
    StopsAcknowledged,
)
from ftrun.controller.roster import Roster
from ftrun.controller.states import IN_PLACE, MILESTONE_OF, REPAIR_PHASES, Heard, JobView, Level, Phase
from ftrun.keys import JobKeys
from ftrun.messages import OperatorRequest, Report
from ftrun.store import ControlStore

log = logging.getLogger(__name__)


class Reports:
    """The agents' new reports, then their acknowledgements of a job-level STOP. The acknowledgements
    are looked for first: an agent reports the ranks that failed as it stopped them before it
    acknowledges, so each of those reports is in the store by then, and counts before the restart."""

    def __init__(self, store: ControlStore, keys: JobKeys, roster: Roster):
        self.store, self.keys, self.roster = store, keys, roster
        self._next = 0

    def observe(self, view: JobView) -> list[Event]:
        stopped = self._stop_acknowledgements(view)
        events: list[Event] = []
        for report in self.store.read_from(self.keys.report_count, self.keys.report, Report, self._next):
            self._next += 1
            if report is not None:  # None: forged, ignored (and logged)
                events.append(Reported(report))
        if stopped is not None:
            events.append(stopped)
        return events

    def _stop_acknowledgements(self, view: JobView) -> StopsAcknowledged | None:
        """During a job-level STOP, once every node waited for has acknowledged it (one ``check`` of their
        agents' keys per tick): the nodes whose acknowledgement holds."""
        if view.phase is not Phase.STOPPING or view.level is not Level.JOB:
            return None
        nodes = self.roster.nodes
        waiting = [(node, nodes[node].agent_id) for node in sorted(view.present - view.acknowledged) if node in nodes]
        if not waiting:
            return None
        acks = self.store.all_set(Report, [self.keys.stopped(view.generation, agent) for _, agent in waiting])
        if acks is None:
            return None
        # a forged one (None) does not count: its node is waited for still
        return StopsAcknowledged(view.generation, frozenset(node for (node, agent), ack in zip(waiting, acks)
                                                            if ack is not None and ack.agent_id == agent))


class Collectives:
    """A rank's failed collective in the running generation (or in an online repair's), with every node's
    keepalive count as it is seen. One read a tick, only where process level is ready (else a rank's own
    wait for an announcement ends it), and the keepalive counters while one is there."""

    def __init__(self, store: ControlStore, keys: JobKeys, roster: Roster):
        self.store, self.keys, self.roster = store, keys, roster

    def observe(self, view: JobView, now: float) -> list[Event]:
        if not view.watches_collectives:
            return []
        said = self.store.try_text(self.keys.collective_failure(view.generation))
        failure = CollectiveFailure.from_text(said) if said else None
        if failure is None:
            return []
        heard = tuple(Heard(node, count) for node, count in self.roster.keepalive_counts(view).items())
        slot = self.roster.holder_of_rank(failure.rank)
        return [CollectiveFailed(failure, slot.node_rank if slot else -1, slot.host if slot else "", now, heard)]


class Repair:
    """During a process-level (or online) repair: the ranks' rollback failure, the repair's deadline, and
    the milestone that ends the phase under way. ``decided_at()``: when the repair was decided (wall clock)."""

    def __init__(self, store: ControlStore, keys: JobKeys, timeout: float, decided_at: Callable[[], float],
                 wall: Callable[[], float] = time.time):
        self.store, self.keys, self.timeout = store, keys, timeout
        self.decided_at, self.wall = decided_at, wall

    def observe(self, view: JobView) -> list[Event]:
        if view.level not in IN_PLACE or view.phase not in REPAIR_PHASES:
            return []
        said = self.store.try_text(self.keys.rollback_failure(view.generation))
        if said:
            failure = RollbackFailure.from_text(said)
            return [RepairFailed(failure.reason if failure else said, failure)]
        if self.wall() - self.decided_at() > self.timeout:
            return [RepairFailed(f"the repair did not finish within {self.timeout:g}s (stuck in {view.phase.value})")]
        if view.phase in MILESTONE_OF:
            milestone, _ = MILESTONE_OF[view.phase]
            expected = view.world_size - len(view.replacing) if milestone is Milestone.STOPPED else view.world_size
            if self.store.counter(self.keys.milestone(view.generation, milestone.value)) >= expected:
                return [MilestoneReached(milestone)]
        return []


class Nodes:
    """The nodes whose agent went silent for ``timeout``; an idle spare with room for a node."""

    def __init__(self, roster: Roster, timeout: float, max_nodes: int):
        self.roster, self.timeout, self.max_nodes = roster, timeout, max_nodes

    def silent(self, view: JobView, now: float) -> list[Event]:
        events: list[Event] = []
        for node in self.roster.silent_nodes(view, now, self.timeout):
            slot = self.roster.nodes[node]
            detail = f"node {node} ({slot.host}) lost: no keepalive from its agent for {self.timeout:g}s"
            log.error(detail)
            events.append(NodeLost(slot, detail))
        return events

    def idle_spare(self, view: JobView) -> list[Event]:
        """An idle spare and room for a node: it may join the job as a node of its own."""
        if not self.roster.spares or not self.room_to_grow(view) or view.phase is not Phase.RUNNING:
            return []
        return [SpareIdle(min(view.vacant) if view.vacant else view.node_count, self.roster.spares[0])]

    def room_to_grow(self, view: JobView) -> bool:
        """Fewer nodes than --nnodes MAX: after a scale-in, or when some were late for the rendezvous."""
        return bool(view.vacant) or view.node_count < self.max_nodes


class Library:
    """Whether every rank runs ftrun.elastic, and whether its layout allows process-level repair."""

    def __init__(self, store: ControlStore, keys: JobKeys):
        self.store, self.keys = store, keys

    def observe(self, view: JobView) -> list[Event]:
        if view.recovery is not Level.PROCESS or view.phase is not Phase.RUNNING or view.refusal:
            return []
        if not view.process_level_ready:
            return [LibraryRanks(self.joined(view.generation))]
        refusal = self.store.try_text(self.keys.process_level_refused)
        return [ProcessLevelRefused(refusal)] if refusal else []

    def joined(self, generation: int) -> int:
        """How many ranks joined the generation's process group: ranks under ftrun.elastic say so."""
        return self.store.counter(self.keys.milestone(generation, Milestone.JOINED.value))


class Operator:
    """A person's requests from ``ftrun top`` (once a keepalive is soon enough), dated by the wall clock; the
    controller adds who holds the rank or node, and the answer, as it takes each."""

    def __init__(self, store: ControlStore, keys: JobKeys, wall: Callable[[], float] = time.time):
        self.store, self.keys, self.wall = store, keys, wall
        self._next = 0

    def observe(self) -> list[Event]:
        events: list[Event] = []
        for request in self.store.read_from(self.keys.operator_count, self.keys.operator_request, OperatorRequest,
                                            self._next):
            self._next += 1
            if request is not None:  # None: forged, ignored (and logged)
                events.append(OperatorAsked(request, None, "", 0, self.wall(), ""))
        return events
