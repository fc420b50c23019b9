"""Starting the node's workers on usable devices: a generation's (START), a repair's replacements
(REPLACE). Where no device is usable because one is being reset, the workers wait for it (the repair's
deadline bounds the wait); where none will be, the node reports itself unusable (a node-level fault).

Warm standbys are made off the ranks' own start: a generation's once every rank of the node has committed
its first step (``first_steps``), those a repair took once it is over."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.generations import GenerationEnvs
from ftrun.agent.placement import NoDevice
from ftrun.agent.protocol import NodeProtocol
from ftrun.agent.seat import Seat
from ftrun.agent.workers import Worker, WorkerGroup
from ftrun.messages import Command, CommandKind, ReportKind

log = logging.getLogger(__name__)
#: seconds after a node's ranks were replaced that it starts new warm standbys in place of those taken
REFILL_AFTER = 5.0
#: a generation's warm standbys are made once every rank of the node committed its first step: a standby's
#: torch import beside the ranks' own start delayed their first step (1 x 4 on 2 cores: 11.4 s after launch
#: with one standby per rank, 6.4 s with none, torchrun 6.0 s); or this many seconds after the start at the
#: latest, for ranks that commit no step (a script without ftrun.elastic)
STANDBYS_AT_THE_LATEST = 30.0


@dataclass(frozen=True)
class PendingSpawn:
    """Workers a command asked for that wait for a usable device (one is being reset)."""

    command: Command
    #: REPLACE: the local ranks still to respawn; START: every local rank
    local_ranks: tuple[int, ...]


class Spawner:
    """Starts ``group``'s workers where ``seat`` and ``devices`` place them, each generation's environment
    from ``envs``; ``started`` is told of every worker started. ``protocol`` gives the node's messages now."""

    def __init__(self, group: WorkerGroup, seat: Seat, devices: NodeDevices, envs: GenerationEnvs,
                 protocol: Callable[[], NodeProtocol], started: Callable[[list[Worker]], None],
                 hosts_worker_store: Callable[[], bool] = lambda: False):
        self.group = group
        self.seat = seat
        self.devices = devices
        self.envs = envs
        self._protocol = protocol
        self._started = started
        #: whether this node hosts the generation's worker store (and so a MindSpore job's scheduler)
        self._hosts_worker_store = hosts_worker_store
        #: workers waiting for a device (one is being reset)
        self.pending: PendingSpawn | None = None
        #: when to make the warm standbys (0: none due): at the latest after a start, or after a repair
        self.standbys_due = 0.0
        #: a generation started: its standbys are made once its ranks committed their first step
        self._after_first_steps = False

    def start(self, command: Command) -> None:
        """A generation's workers, every local rank (a MindSpore generation's scheduler first, on the
        node that hosts the worker store, as msrun's)."""
        nproc, group = self.seat.nproc, self.group
        try:
            assigned = self.devices.assign(nproc)
        except NoDevice as e:
            self._wait_for_device(command, tuple(range(nproc)), e)
            return
        cpus = self.devices.binding()
        placements = [self.seat.placement(i, self.devices.placed(assigned.get(i)), cpus.get(i, ())) for i in range(nproc)]
        self.pending = None
        self._protocol().prepare_ranks([p.rank for p in placements])
        gen = self.envs.for_command(command)
        if command.scheduler and self._hosts_worker_store() and group.scheduler is None:
            group.start_scheduler(gen, self.seat.node_rank, self.seat.host)
        group.start(placements, gen)
        self._started(group.workers)
        self.standbys_due, self._after_first_steps = time.monotonic() + STANDBYS_AT_THE_LATEST, True

    def respawn(self, command: Command, local_ranks: tuple[int, ...]) -> None:
        """Process level (repair): start replacements for these local ranks, on usable devices."""
        gen = self.envs.for_command(command, replacement=True)
        for done, local_rank in enumerate(local_ranks):
            try:
                device = self.devices.device_for_respawn(local_rank)
            except NoDevice as e:
                self._wait_for_device(command, local_ranks[done:], e)
                return
            cpus = self.devices.binding().get(local_rank, ())
            self.group.respawn(self.seat.placement(local_rank, self.devices.placed(device), cpus), gen)
            self._started([self.group.workers[local_rank]])
        self.pending = None
        # the standbys taken are made again once the repair is over: a new one's torch import would
        # compete for the CPU with the ranks' repair and their first steps
        self.standbys_due, self._after_first_steps = time.monotonic() + REFILL_AFTER, False

    def waiting_replacements(self) -> tuple[int, ...]:
        """The local ranks a repair before this one still waits to respawn."""
        pending = self.pending
        return pending.local_ranks if pending is not None and pending.command.kind is CommandKind.REPLACE else ()

    def first_steps(self, now: float) -> None:
        """Every rank of the node committed a step since it started: a generation's standbys are due now."""
        if self._after_first_steps:
            self.standbys_due, self._after_first_steps = now, False

    def cancel(self) -> None:
        """The workers waiting for a device are wanted no more (a stop, the exit)."""
        self.pending = None

    def tick(self, now: float) -> None:
        """At each turn of the agent's loop: workers waiting for a device tried again; standbys made
        once they are due."""
        pending = self.pending
        if pending is not None:
            if pending.command.kind is CommandKind.START:
                self.start(pending.command)
            else:
                self.respawn(pending.command, pending.local_ranks)
        if self.standbys_due and now >= self.standbys_due:
            self.standbys_due, self._after_first_steps = 0.0, False
            self.group.fill_standbys()

    def _wait_for_device(self, command: Command, local_ranks: tuple[int, ...], problem: NoDevice) -> None:
        """No usable device now: wait for a reset under way (the repair deadline bounds it), else the
        node cannot run its ranks (a node-level fault)."""
        if not self.devices.resetting:
            self.pending = None
            self._protocol().report(ReportKind.NODE_UNUSABLE, command.generation, detail=str(problem))
            return
        if self.pending is None or self.pending.local_ranks != local_ranks:
            log.warning("local rank%s %s wait%s for a device reset", "s" if len(local_ranks) > 1 else "",
                        ", ".join(map(str, local_ranks)), "" if len(local_ranks) > 1 else "s")
        self.pending = PendingSpawn(command, local_ranks)
