"""One node's side of the control protocol: every message an agent sends to the controller or reads
from it, and nothing else (no processes, devices or files).

The real agent (``agent.py``) drives it around its workers; ``scripts/bench_control_plane.py`` drives
a thousand of them in one process to measure the control plane at scale, so that what it measures is
this code and not a copy. Each method costs the store a constant number of round trips, whatever
the job's size (``ftrun/keys.py`` states each message path's cost).
"""

from __future__ import annotations

import time
from typing import Iterator

from ftrun.keys import JobKeys
from ftrun.messages import Command, JoinRecord, NodeSlot, NodeStatus, RendezvousResult, Report, ReportKind
from ftrun.rendezvous import join
from ftrun.store import ControlStore, StoreUnavailable


class NodeProtocol:
    """An agent's messages: rendezvous, keepalives, status, reports, commands, its ranks' heartbeats."""

    def __init__(self, store: ControlStore, keys: JobKeys, agent_id: str, node_timeout: float):
        self.store = store
        self.keys = keys
        self.agent_id = agent_id
        self.node_timeout = node_timeout
        #: this agent's node rank (-1: a spare)
        self.node_rank = -1
        #: the next command of the sequence to read
        self.next_command = 0
        #: the controller's keepalive counter as last seen, and when it last moved (this host's clock)
        self._controller_beat = (-1, time.monotonic())

    def join(self, record: JoinRecord, timeout: float, stop) -> tuple[RendezvousResult, NodeSlot]:
        """The rendezvous: announce this agent, wait for the controller's result, find its place."""
        result, slot = join(self.store, self.keys, record, timeout, stop)
        self.node_rank = slot.node_rank
        return result, slot

    def keepalive(self, status: NodeStatus | None = None) -> None:
        """One keepalive (a node's, or an idle spare's), and the node's status for the status view."""
        if self.node_rank >= 0:
            self.store.add(self.keys.node_heartbeat(self.node_rank))
        else:
            self.store.add(self.keys.spare_heartbeat(self.agent_id))
        if status is not None:
            self.store.set(self.keys.agent_status(self.agent_id), status)

    def check_controller(self, now: float) -> None:
        """Raise StoreUnavailable once the controller's keepalive has not moved for ``node_timeout``."""
        count = self.store.counter(self.keys.controller_heartbeat)
        if count != self._controller_beat[0]:
            self._controller_beat = (count, now)
        elif now - self._controller_beat[1] > self.node_timeout:
            raise StoreUnavailable(f"no keepalive from the controller at {self.store.endpoint} "
                                   f"for {self.node_timeout:g}s")

    def report(self, kind: ReportKind, generation: int, **fields) -> None:
        """Append a report for the controller (a failure, an acknowledgement)."""
        report = Report(kind, self.node_rank, generation, agent_id=self.agent_id, **fields)
        self.store.append(self.keys.report_count, self.keys.report, report)

    def commands(self) -> Iterator[Command]:
        """The controller's commands published since the last one taken, in order (forged ones left
        out). Each counts as read once it is taken: a caller that stops at one (a spare taking over a
        node) finds the rest, the new generation's START among them, at its next call."""
        for command in self.store.read_from(self.keys.command_count, self.keys.command, Command, self.next_command):
            self.next_command += 1
            if command is not None:
                yield command

    def rank_beats(self, ranks: list[int]) -> list[int]:
        """The heartbeat counters of this node's ranks, in one round trip."""
        return self.store.counters([self.keys.rank_heartbeat(rank) for rank in ranks])

