"""One node's side of the control protocol: every message an agent sends to the controller or reads
from it, and nothing else (no processes, devices or files).

The real agent (``agent.py``) drives it around its workers; ``scripts/bench_control_plane.py`` drives
a thousand of them in one process to measure the control plane at scale, so that what it measures is
this code and not a copy. Each method costs the store a constant number of round trips, whatever
the job's size (``ftrun/keys.py`` states each message path's cost).

What an agent waits for (the rendezvous result, then each command in turn) it does not poll: its
``Watch`` blocks in the store's own ``wait`` on the agent's doorbell, which the controller rings for
every agent in one round trip, so that a decision reaches every node the moment it is published and
a node between commands asks the store nothing.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import Any, Callable, Iterator

from ftrun.keys import RENDEZVOUS_RING, JobKeys
from ftrun.messages import Command, JoinRecord, NodeSlot, NodeStatus, RendezvousResult, Report, ReportKind
from ftrun.rendezvous import join
from ftrun.store import ControlStore, StoreUnavailable

#: one blocking wait of a Watch: long, since a wait that times out logs a line (the store counts its
#: milliseconds in 32 bits: at most 24 days); the watch then waits again
WATCH_SLICE = datetime.timedelta(days=7)
#: how long an agent that leaves waits for its watch to let go
WATCH_CLOSE = 2.0


class Watch:
    """Waits on the store, in a thread and a connection of its own, for the agent's doorbell: the
    controller rings it once the rendezvous result is written, then once per command (``keys.doorbell``).
    ``wake`` is called after each ring (and once if the watch fails: its reader then reads at each
    keepalive, and meets the store's error itself). ``connect`` makes the connection (a raw TCPStore
    client), in the thread.

    The bell is the agent's own so that it can let its watch go: a thread still blocked in the store's
    wait when the interpreter ends aborts the process once that store goes. ``close`` rings the next
    bells itself and waits for the thread."""

    def __init__(self, connect: Callable[[], Any], keys: JobKeys, agent_id: str, wake: Callable[[], None] = lambda: None):
        self.keys = keys
        self.agent_id = agent_id
        self._connect = connect
        self._wake = wake
        #: set once the watch has its connection (or failed); the rendezvous result is written (or failed)
        self.connected = threading.Event()
        self.rendezvous = threading.Event()
        #: commands known to be written: the count when the watch began, plus one per ring
        self.published = 0
        #: why the watch stopped; "" while it runs
        self.failed = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftrun-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keys = self.keys
        ring: int | str = RENDEZVOUS_RING
        try:
            store = self._connect()
            self.connected.set()
            while not self._closed:
                self._await(store, keys.doorbell(self.agent_id, ring))
                if ring == RENDEZVOUS_RING:
                    self.published = int(store.add(keys.command_count, 0))  # rung for the commands after these
                    self.rendezvous.set()
                else:
                    self.published += 1
                ring = self.published
                self._wake()
        except Exception as e:  # the store went (the job ended), or it never answered
            self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.connected.set()
            self.rendezvous.set()
            self._wake()

    @staticmethod
    def _await(store, key: str) -> None:
        from torch.distributed import DistNetworkError, DistStoreError

        while True:
            try:
                store.wait([key], WATCH_SLICE)
                return
            except DistNetworkError:
                raise
            except DistStoreError:  # the slice ran out: wait again
                continue

    def close(self, store: ControlStore) -> None:
        """Let the watch go, through ``store`` (the agent's own connection), before the agent leaves."""
        self._closed = True
        if not self._thread.is_alive():
            return
        ring = self.published
        rings = [RENDEZVOUS_RING] if not self.rendezvous.is_set() else []
        try:
            for key in [self.keys.doorbell(self.agent_id, r) for r in rings + [ring, ring + 1]]:
                store.set_text(key, "")
        except StoreUnavailable:
            return  # the store went: so did the watch's wait
        self._thread.join(WATCH_CLOSE)


class Wakeup:
    """A pipe a thread writes a byte to, so that the agent's ``select`` between checks wakes at once
    (``fileno``); ``drain`` empties it. Never closed: the watch may write to it until the process
    ends, and a closed descriptor's number may be reused."""

    def __init__(self):
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def __call__(self) -> None:
        try:
            os.write(self._write, b"!")
        except BlockingIOError:
            pass  # full: the reader wakes anyway

    def fileno(self) -> int:
        return self._read

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass


class NodeProtocol:
    """An agent's messages: rendezvous, keepalives, status, reports, commands, its ranks' heartbeats.
    With a ``watch``, the rendezvous result and the commands are read only once it has seen them
    written."""

    def __init__(self, store: ControlStore, keys: JobKeys, agent_id: str, node_timeout: float,
                 watch: Watch | None = None):
        self.store = store
        self.watch = watch
        self.keys = keys
        self.agent_id = agent_id
        self.node_timeout = node_timeout
        #: this agent's node rank (-1: a spare)
        self.node_rank = -1
        #: the next command of the sequence to read; how many the last keepalive saw published (the
        #: watch's rings are quicker; this is the net under them)
        self.next_command = 0
        self._published = 0
        #: the controller's keepalive counter as last seen, and when it last moved (this host's clock)
        self._controller_beat = (-1, time.monotonic())

    def join(self, record: JoinRecord, timeout: float, stop) -> tuple[RendezvousResult, NodeSlot]:
        """The rendezvous: announce this agent, wait for the controller's result, find its place."""
        result, slot = join(self.store, self.keys, record, timeout, stop,
                            self.watch.rendezvous if self.watch is not None else None)
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

    def observe(self, ranks: list[int], now: float) -> tuple[list[int], list[int | None]]:
        """What a keepalive reads, in one round trip: the controller's keepalive (StoreUnavailable
        once it has not moved for ``node_timeout``), the number of commands published, and this node's
        ``ranks``' heartbeat counters and committed steps (None before the first)."""
        keys = self.keys
        counts, steps = self.store.readings(
            [keys.controller_heartbeat, keys.command_count] + [keys.rank_heartbeat(r) for r in ranks],
            [keys.rank_progress(r) for r in ranks])
        self._published = counts[1]
        self._controller_seen(counts[0], now)
        return counts[2:], [_step(text) for text in steps]

    def prepare_ranks(self, ranks: list[int]) -> None:
        """Before ``ranks`` start on this node: their heartbeat counters and step keys, made in one
        round trip where this agent has not seen them yet (the keepalive reads them in one
        ``multi_get``, which would wait for a missing key). None of these ranks runs yet, so nothing
        they wrote is lost."""
        keys = self.keys
        self.store.create([keys.rank_heartbeat(r) for r in ranks], [keys.rank_progress(r) for r in ranks])

    def _controller_seen(self, count: int, now: float) -> None:
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
        node) finds the rest, the new generation's START among them, at its next call. With a
        watch, only once it or the last keepalive saw one published: otherwise no round trip."""
        watch = self.watch
        keys, start = self.keys, self.next_command
        if watch is None or watch.failed:
            found = self.store.read_from(keys.command_count, keys.command, Command, start)
        elif watch.published > start:  # rung, so written: one round trip
            found = self.store.read_range(keys.command, Command, start, watch.published)
        elif self._published > start:  # seen at a keepalive: maybe reserved but not yet written
            found = self.store.read_from(keys.command_count, keys.command, Command, start)
        else:
            return
        for command in found:
            self.next_command += 1
            if command is not None:
                yield command


def _step(text: str) -> int | None:
    """A rank's committed step as the worker library writes it (None: none yet, or not a number)."""
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isascii() and digits.isdigit() else None
