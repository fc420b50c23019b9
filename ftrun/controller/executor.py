"""The controller's executor: it applies the policy's decisions, and is the only part that does.

For each decision: the narrator tells what moved (``narrator.py``), each command is made ready (a START
gets its layout, restore and fresh worker store; a REPLACE is held back a moment for more failure
reports; a TAKEOVER hands the node to the spare), the journal is written under etcd (``office.py``),
then the commands are published (``publisher.py``). What it did that the policy must hear of (the
repair's replacements went out) it returns as events, which the controller puts in its inbox.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from ftrun.controller.board import StatusBoard
from ftrun.controller.inbox import Event, NodeLost, OperatorAsked, ReplacementsStarted, StragglerGain, StragglerSeen
from ftrun.controller.narrator import Narrator
from ftrun.controller.office import EtcdOffice
from ftrun.controller.publisher import Publisher
from ftrun.controller.restore_points import RestorePoints
from ftrun.controller.roster import Roster
from ftrun.controller.states import Decision, JobView, Phase
from ftrun.controller.worker_store import WorkerStores
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, board_interval
from ftrun.messages import Command, CommandKind, OperatorAction, RendezvousResult
from ftrun.store import StoreUnavailable

log = logging.getLogger(__name__)


class Executor:
    """Applies decisions to the job: holds its view (what every decision starts from) and what the
    commands it made ready said last (the world a generation started with, its scheduler)."""

    def __init__(self, roster: Roster, publisher: Publisher, narrator: Narrator, board: StatusBoard,
                 restore_points: RestorePoints, worker_stores: WorkerStores, office: EtcdOffice,
                 snapshots: bool, schedulers: bool, gather_timeout: float, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.roster, self.publisher, self.narrator, self.board = roster, publisher, narrator, board
        self.restore_points, self.worker_stores, self.office = restore_points, worker_stores, office
        self.snapshots, self.schedulers = snapshots, schedulers
        #: how long a repair's REPLACE commands are held back for more failure reports (``_ready_replace``)
        self.gather_timeout = gather_timeout
        self.clock, self.wall = clock, wall
        #: the policy's view of the job (None before the rendezvous)
        self.view: JobView | None = None
        #: who is which node, as the rendezvous decided (the journal carries it to a successor)
        self.rendezvous: RendezvousResult | None = None
        #: the world size of the last generation started (0 before the first)
        self.started_world = 0
        #: when the job started, by the wall clock (the journal carries it to a successor)
        self.started_at = wall() - (clock() - narrator.events.started)
        #: when the job entered its current phase (monotonic), for the status's "for 1.2s"
        self.phase_since = clock()
        #: the running generation's scheduler (--framework mindspore): a process-level repair keeps it,
        #: and its replacements rejoin it
        self._scheduler = ""
        #: when the status board is due again, and the (phase, generation) it last showed
        self._next_board = 0.0
        self._board_shows: tuple | None = None
        self._ready: dict[CommandKind, Callable[[Command, JobView | None], Command | None]] = {
            CommandKind.START: self._ready_start,
            CommandKind.REPLACE: self._ready_replace,
            CommandKind.TAKEOVER: self._ready_takeover,
            CommandKind.STOP: self._ready_stop,
            CommandKind.EXIT: self._ready_stop,
        }

    def apply(self, decision: Decision) -> list[Event]:
        """A decision of the policy: the job's new view, told; each command made ready, then published."""
        before = self.view
        self.view, commands = decision
        if self.narrator.decided(before, self.view, self.wall()):
            self.phase_since = self.clock()
            if self.view.phase is Phase.EXITING:
                self.job_finished()
        ready = [command for command in (self._ready[c.kind](c, before) for c in commands) if command is not None]
        self.record()  # before the commands: a successor goes on from here
        self.publisher.commands(ready)
        if any(command.kind is CommandKind.REPLACE and command.ranks for command in ready):  # not held back
            return [ReplacementsStarted()]
        return []

    def record(self) -> None:
        """The journal, under etcd: what a successor goes on from."""
        self.office.record(self.view, self.rendezvous, self.roster, self.started_world, self.started_at)

    def release_held(self) -> list[Event]:
        """The held REPLACE commands go out once their moment has passed: the replacements start from now."""
        return [ReplacementsStarted()] if self.publisher.release_held() else []

    def tell(self, event: Event) -> None:
        """What an event says before it is decided: a node lost, a person's request and its answer."""
        if isinstance(event, NodeLost):
            self.narrator.node_lost(self.view.generation, event.slot, event.detail)
        elif isinstance(event, StragglerSeen):
            self.narrator.straggler(self.view.generation, event)
        elif isinstance(event, StragglerGain):
            self.narrator.straggler_gain(self.view.generation, event)
        elif isinstance(event, OperatorAsked):
            self.narrator.operator(self.view.generation, event.request, event.slot, event.refusal)
            if not event.refusal and event.request.action is OperatorAction.DRAIN and event.slot is not None:
                slot = event.slot
                self.narrator.node_lost(self.view.generation, slot, f"node {slot.node_rank} drained by {event.request.who}")

    # -- each command made ready --------------------------------------------------------------------

    def _ready_start(self, command: Command, before: JobView | None) -> Command:
        """A generation starts: the layout (a scale-in or a grow-back renumbers the global ranks), the
        restore it takes, a fresh worker store."""
        self.narrator.generation_started(command.generation, self.view.world_size,
                                         grow=before is not None and before.free_restart)
        previous, self.started_world = self.started_world, self.publish_layout()
        self.publisher.ranks_started = command.generation
        if command.generation > 0 and self.snapshots:
            restore = self.restore_points.choose(command.generation, self.view, self.roster.present(self.view))
            counts, sources = self.publisher.restore_plans(command.generation, restore)
            self.narrator.restore(command.generation, restore, counts, sources)
        worker_store = self.worker_stores.fresh()
        self._scheduler = self.worker_stores.scheduler() if self.schedulers else ""
        return dataclasses.replace(command, previous_world_size=previous, worker_store=worker_store,
                                   scheduler=self._scheduler)

    def _ready_replace(self, command: Command, before: JobView | None) -> Command | None:
        # the generation before a repair's ran in the same world: a replacement sees no resize
        command = dataclasses.replace(command, worker_store=self.worker_stores.address,
                                      previous_world_size=self.started_world, scheduler=self._scheduler)
        # the healthy ranks leave their groups now, before the journal is written: a rank whose collective
        # failed waits ``fault_wait`` (10 s) for this to tell a peer's fault from its own, and while etcd
        # has no quorum the journal waits longer (announced after it, the healthy ranks took the lost peer
        # for an error of their own, exited and were replaced too: 7 process starts for one fault)
        self.publisher.announce(command.generation, self.view.world_size, online=not command.ranks,
                                replaced=command.ranks)
        if not command.ranks:
            return command  # the online level: nothing to start, the agents only move to the new generation
        if self.gather_timeout <= 0:
            return command
        # The replacements start a moment later (the healthy ranks take longer to stop). If the reports
        # that come meanwhile name every rank (a whole job's crash, whose deaths come a few milliseconds
        # apart), the policy gives the repair up for a job-level restart before any replacement started.
        self.publisher.hold(command, self.gather_timeout)
        return None

    def _ready_takeover(self, command: Command, before: JobView | None) -> Command:
        """The spare holds the node from now on."""
        spare, lost = self.roster.hand_over(command.agent_id, command.node_rank)
        self.publish_layout()
        self.narrator.took_over(command.generation, command.node_rank, spare, lost)
        return command

    def _ready_stop(self, command: Command, before: JobView | None) -> Command:
        """A STOP or an EXIT: the repair's held replacements are not wanted any more."""
        self.publisher.drop_held(command.reason)
        return command

    # -- the nodes ----------------------------------------------------------------------------------

    def publish_layout(self) -> int:
        """The layout of the nodes in the job now, written when it changed; their world size."""
        nodes = self.roster.renumber(self.view)
        self.publisher.write_layout(nodes)
        return sum(slot.nproc for slot in nodes)

    def admit_late_arrivals(self, room_to_grow: bool, spares_wanted: int) -> None:
        """Agents that joined after the rendezvous: spares while the job wants more, else refused."""
        for join in self.roster.arrivals():
            if len(self.roster.spares) < spares_wanted or room_to_grow:
                self.roster.add_spare(join)
                self.publisher.admit_spare(join.agent_id)
                log.info("%s joined as a spare node", join.host)
            else:
                self.publisher.refuse(join.agent_id, f"the job already has its {len(self.roster.nodes)} nodes and "
                                                     f"{spares_wanted} spare{'s' if spares_wanted != 1 else ''}")

    # -- the status ---------------------------------------------------------------------------------

    def status_due(self, now: float) -> None:
        """The status board, at its pace (slower for a large job), and at once when the job moved."""
        if now >= self._next_board or (self.view.phase, self.view.generation) != self._board_shows:
            self._next_board = now + board_interval(self.view.world_size, AGENT_HEARTBEAT_INTERVAL)
            self._board_shows = (self.view.phase, self.view.generation)
            self.refresh_status()

    def refresh_status(self, final: bool = False) -> None:
        saved = self.restore_points.refresh(self.view, self.roster.present(self.view), final)
        snapshot = self.board.refresh(self.view, self.roster.nodes, self.roster.spares, self.phase_since, saved)
        self.publisher.status(snapshot)
        self.publisher.for_top(*self.board.for_top())

    def job_finished(self) -> None:
        try:
            self.refresh_status(final=True)  # the final step, and the last checkpoints
            self.publisher.status_final()
        except StoreUnavailable:
            pass
        self.narrator.job_finished(self.view, self.clock() - self.board.started, self.board.snapshot.get("step"))
