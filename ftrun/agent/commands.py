"""How a node carries out the controller's commands: exit, a spare's takeover, a generation's stop and
start, a repair's replacements. Each returns how the node's part of the job ended, or None to go on."""

from __future__ import annotations

import logging
from typing import Callable

from ftrun.agent.generations import GenerationEnvs
from ftrun.agent.node_snapshots import NodeSnapshots
from ftrun.agent.protocol import NodeProtocol
from ftrun.agent.seat import Seat
from ftrun.agent.spawner import Spawner
from ftrun.agent.supervision import Supervision
from ftrun.agent.workers import WorkerGroup
from ftrun.errors import ExitCode
from ftrun.messages import Command, CommandKind, ReportKind

log = logging.getLogger(__name__)


class CommandExecutor:
    """Carries out each command on the node's ``group``: workers started by ``spawner``, failures
    reported through ``supervision``, acknowledgements through ``protocol`` (the store's now)."""

    def __init__(self, group: WorkerGroup, seat: Seat, spawner: Spawner, supervision: Supervision,
                 protocol: Callable[[], NodeProtocol], stop_timeout: float, snapshots: NodeSnapshots | None = None):
        self.group = group
        self.seat = seat
        self.spawner = spawner
        self.supervision = supervision
        self._protocol = protocol
        self.stop_timeout = stop_timeout
        self.snapshots = snapshots
        self._carry_out = {
            CommandKind.EXIT: self.exit,
            CommandKind.TAKEOVER: self.takeover,
            CommandKind.STOP: self.stop,
            CommandKind.START: self.start,
            CommandKind.REPLACE: self.replace,
        }

    @property
    def envs(self) -> GenerationEnvs:
        return self.spawner.envs

    def carry_out(self, command: Command) -> tuple[int, str] | None:
        return self._carry_out[command.kind](command)

    def exit(self, command: Command) -> tuple[int, str] | None:
        self.spawner.cancel()
        self.group.stop(self.stop_timeout)
        if command.exit_code != ExitCode.OK and self.snapshots is not None:
            self.snapshots.save_if_asked()  # an exit straight from training (a stop asked for, etcd lost for good)
        self._protocol().report(ReportKind.EXITED, command.generation)
        return command.exit_code, command.reason

    def takeover(self, command: Command) -> tuple[int, str] | None:
        if command.node_rank != self.seat.node_rank:
            return None  # another node's place, given to a spare
        # this node was declared lost (silent past --node-timeout) and handed to a spare
        self.group.stop(self.stop_timeout)
        return ExitCode.JOB_FAILED, (f"this node was declared lost and node {self.seat.node_rank} "
                                     f"given to a spare ({command.reason}); leaving")

    def stop(self, command: Command) -> tuple[int, str] | None:
        """Job level: every worker of the generation stopped, the ranks that failed meanwhile reported."""
        group = self.group
        self.spawner.cancel()
        log.warning("stopping generation %d: %s", command.generation, command.reason)
        # ranks that failed on their own before this stop, or as it came
        failed = [w for w in group.poll() if w.returncode != 0]
        # the restart's ranks are forked from the node's warm interpreter (a new one, if it failed, imports
        # torch while this generation stops)
        group.keep_warm()
        failed += group.stop(self.stop_timeout, keep_warm=True)
        if failed and self.supervision.interrupted_at is None:
            self.supervision.report_failed(failed)
        if self.snapshots is not None:
            self.snapshots.after_stop()
        self._protocol().acknowledge_stop(command.generation)
        return None

    def start(self, command: Command) -> tuple[int, str] | None:
        """A generation's start: the layout read, every local rank started."""
        self.supervision.reported_success = False
        self.supervision.failures_told.clear()  # every rank starts anew: what failed before concerns no repair
        if not self.seat.update(self._protocol().layout(command.layout)):
            self.group.stop(self.stop_timeout)
            return ExitCode.JOB_FAILED, f"node {self.seat.node_rank} was declared lost and left out of the job; leaving"
        if command.generation > 0:
            log.warning("restarting workers as generation %d (restart %d of %d)", command.generation,
                        command.restart_count, command.max_restarts)
        self.spawner.start(command)
        return None

    def replace(self, command: Command) -> tuple[int, str] | None:
        """Process level: reap the failed local ranks (env clear), say so, respawn them (repair); a node
        whose ranks all stay repairs in place, in the new generation."""
        self.supervision.reported_success = False
        # a spare may hold a node now (global ranks never move at process level)
        self.seat.update(self._protocol().layout(command.layout))
        if self.snapshots is not None:
            self.snapshots.save_if_asked()  # every node's: the healthy ranks' newest snapshots stay put until they resume
        mine = self.seat.local_ranks(command.ranks)
        waiting = self.spawner.waiting_replacements()
        if waiting:
            mine = sorted(set(mine) | set(waiting))  # still waiting from the repair before
        if not mine:
            if command.ranks:
                log.info("generation %d: rank%s %s replaced on another node; this node's ranks stay and repair in place",
                         command.generation, "s" if len(command.ranks) > 1 else "", ", ".join(map(str, command.ranks)))
            else:
                log.debug("generation %d: an online repair; every rank stays and repairs in place", command.generation)
            self.group.generation = command.generation
            self.envs.rank_tables(command.generation)  # the new generation's table (a spare may hold a node now)
            return None
        log.warning("replacing rank%s %s for generation %d", "s" if len(mine) > 1 else "",
                    ", ".join(str(self.seat.first_rank + i) for i in mine), command.generation)
        for local_rank in mine:
            self.group.clear(local_rank, self.stop_timeout)
        if self.snapshots is not None:
            self.snapshots.publish(verify=True)
        self._protocol().report(ReportKind.CLEARED, command.generation)
        self.spawner.respawn(command, tuple(mine))
        return None
