"""Starting the node's workers on usable devices: a generation's (START), a repair's replacements
(REPLACE). Where no device is usable because one is being reset, the workers wait for it (the repair's
deadline bounds the wait); where none will be, the node reports itself unusable (a node-level fault). While
the node's warm interpreter imports torch (``forkserver.py``), the workers wait for it too: forked from it,
they start sooner than each importing torch beside the others."""

from __future__ import annotations

import logging
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


@dataclass(frozen=True)
class PendingSpawn:
    """Workers a command asked for that wait for a usable device (one is being reset), or for the warm
    interpreter."""

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
        #: workers waiting for a device (one is being reset) or for the warm interpreter
        self.pending: PendingSpawn | None = None

    def start(self, command: Command) -> None:
        """A generation's workers, every local rank (a MindSpore generation's scheduler first, on the
        node that hosts the worker store, as msrun's)."""
        nproc, group = self.seat.nproc, self.group
        if self._wait_for_warm(command, tuple(range(nproc))):
            return
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

    def respawn(self, command: Command, local_ranks: tuple[int, ...]) -> None:
        """Process level (repair): start replacements for these local ranks, on usable devices."""
        if self._wait_for_warm(command, local_ranks):
            return
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

    def waiting_replacements(self) -> tuple[int, ...]:
        """The local ranks a repair before this one still waits to respawn."""
        pending = self.pending
        return pending.local_ranks if pending is not None and pending.command.kind is CommandKind.REPLACE else ()

    def cancel(self) -> None:
        """The workers waiting for a device are wanted no more (a stop, the exit)."""
        self.pending = None

    def tick(self) -> None:
        """At each turn of the agent's loop: workers waiting for a device or the warm interpreter tried again."""
        pending = self.pending
        if pending is not None:
            if pending.command.kind is CommandKind.START:
                self.start(pending.command)
            else:
                self.respawn(pending.command, pending.local_ranks)

    def _wait_for_warm(self, command: Command, local_ranks: tuple[int, ...]) -> bool:
        """The warm interpreter still imports: the workers wait for it (True); its own deadline bounds the wait."""
        if not self.group.warming:
            return False
        if self.pending is None:
            log.info("local rank%s %s wait%s for the node's warm interpreter", "s" if len(local_ranks) > 1 else "",
                     ", ".join(map(str, local_ranks)), "" if len(local_ranks) > 1 else "s")
        self.pending = PendingSpawn(command, local_ranks)
        return True

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
