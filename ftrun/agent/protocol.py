"""One node's side of the control protocol: every message an agent sends to the controller or reads
from it, and nothing else (no processes, devices or files).

The real agent (``agent.py``) drives it around its workers; ``scripts/bench_control_plane.py`` drives
a thousand of them in one process to measure the control plane at scale, so that what it measures is
this code and not a copy. Each method costs the store a constant number of round trips, whatever
the job's size (``ftrun/keys.py`` states each message path's cost).

What an agent waits for (its place from the rendezvous, then each command in turn) it does not poll: its
``Watch`` blocks in a ``get`` of the agent's doorbell, which the controller sets for every agent in
one round trip (to its place's or the command's text), so that a decision reaches every node the moment it is
published, already read, and a node between commands asks the store nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

from ftrun.keys import BELL_SEPARATOR, RENDEZVOUS_RING, JobKeys, board_interval
from ftrun.messages import Command, JoinRecord, NodeLayout, NodeLayoutChange, NodeSlot, NodeStatus, Placement, Report, ReportKind
from ftrun.rendezvous import join
from ftrun.store import CONNECT_TIMEOUT, ControlStore, StoreUnavailable

log = logging.getLogger(__name__)

#: one blocking read of a Watch (the timeout of its connection): long, since a read that times out logs
#: a line (the store counts its milliseconds in 32 bits: at most 24 days); the watch then reads again
WATCH_SLICE = datetime.timedelta(days=7)
#: between the commands a ring carries, as the watch reads them
SEPARATOR = BELL_SEPARATOR.encode()
#: how long an agent that leaves waits for its watch to let go
WATCH_CLOSE = 2.0
#: an agent further behind the layout than this many versions reads it whole instead of its changes
LAYOUT_CHANGES = 16


class Watch:
    """Waits on the store, in a thread and a connection of its own, for the agent's doorbell: the
    controller rings it with the agent's place once the rendezvous is decided, then once per decision
    (``keys.doorbell``), with its commands' texts, so the watch holds each command as it wakes and the
    agent reads none back. ``wake`` is called after each ring (and once if the watch fails: its reader
    then reads at each keepalive, and meets the store's error itself). ``connect`` makes the connection
    (a raw TCPStore client), in the thread.

    The bell is the agent's own so that it can let its watch go: a thread still blocked in the store
    when the interpreter ends aborts the process once that store goes. ``close`` rings the next
    bells itself and waits for the thread."""

    def __init__(self, connect: Callable[[], Any], keys: JobKeys, agent_id: str, wake: Callable[[], None] = lambda: None):
        self.keys = keys
        self.agent_id = agent_id
        self._connect = connect
        self._wake = wake
        #: set once the watch has its connection (or failed); the agent's place is written (or failed)
        self.connected = threading.Event()
        self.rendezvous_decided = threading.Event()
        #: the agent's place as its rendezvous bell carried it (sealed; empty when it rang without)
        self.placed = b""
        #: commands known to be written: the count when the watch began, plus those each ring carried
        self.published = 0
        #: what the bells rang with, by command index, until taken (``take``)
        self._texts: dict[int, bytes] = {}
        #: why the watch stopped; "" while it runs
        self.failed = ""
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ftrun-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        keys = self.keys
        try:
            store = self._connect()
            store.set_timeout(WATCH_SLICE)  # a get on a bell blocks until it rings (or the slice ends)
            self.connected.set()
            self.placed = self._await(store, keys.doorbell(self.agent_id, RENDEZVOUS_RING))
            self.published = int(store.add(keys.command_count, 0))  # rung for the commands after these
            self.rendezvous_decided.set()
            self._wake()
            while not self._closed:
                index = self.published
                text = self._await(store, keys.doorbell(self.agent_id, index))
                # a decision's commands from this index on (close() rings with nothing)
                texts = text.split(SEPARATOR) if text else []
                for offset, command in enumerate(texts):
                    self._texts[index + offset] = command
                self.published = index + max(1, len(texts))
                self._wake()
        except Exception as e:  # the store went (the job ended), or it never answered
            self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.connected.set()
            self.rendezvous_decided.set()
            self._wake()

    @staticmethod
    def _await(store, key: str) -> bytes:
        """What ``key`` is set to, once it is: one request, which the store answers when it is set."""
        from torch.distributed import DistNetworkError, DistStoreError

        while True:
            try:
                return store.get(key)
            except DistNetworkError:
                raise
            except DistStoreError:  # the slice ran out: wait again
                continue

    def take(self, start: int, stop: int) -> list[bytes] | None:
        """The texts commands ``start..stop-1`` rang with, each handed out once; None unless the watch
        held all of them (not those published before it began, say: they are to be read)."""
        texts = [self._texts.pop(index, None) for index in range(start, stop)]
        return None if None in texts else texts  # type: ignore[return-value]

    def close(self, store: ControlStore) -> None:
        """Let the watch go, through ``store`` (the agent's own connection), before the agent leaves."""
        self._closed = True
        if not self._thread.is_alive():
            return
        ring = self.published
        rings = [RENDEZVOUS_RING] if not self.rendezvous_decided.is_set() else []
        try:
            for key in [self.keys.doorbell(self.agent_id, r) for r in rings + [ring, ring + 1]]:
                store.set_text(key, "")
        except StoreUnavailable:
            pass  # the store went: the watch's read fails with it, as its connection closes
        # one still connecting carries on into the store once it has: the wait covers the connect
        self._thread.join(WATCH_CLOSE + (0.0 if self.connected.is_set() else CONNECT_TIMEOUT))


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
    With a ``watch``, the agent's place and the commands are read only once it has seen them
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
        #: keepalives sent; the status is written again at this pace (the board's), or once it changed
        self._beats = 0
        self.status_interval = 0.0
        self._status_due = 0.0
        self._status_shape: tuple = ()
        #: the layout as last read (``layout``)
        self._layout = NodeLayout()
        #: --rdzv-backend etcd: why etcd does not answer the controller, as last read ("" while it does)
        self.etcd_unreachable = ""
        #: each rank's step times as the last ``observe`` read them (``ftrun.step_times`` text, "" before any)
        self.step_times: dict[int, str] = {}
        #: the collective each rank waits in now, as the last ``observe`` read it (``ftrun.step_times`` text)
        self.collectives: dict[int, str] = {}

    def join(self, record: JoinRecord, timeout: float, stop, pair_check=None) -> tuple[Placement, NodeSlot]:
        """The rendezvous: announce this agent, wait for its place (its watch's bell carries it); with
        ``pair_check`` (--preflight), take its turns in the data network's check on the way."""
        watch = self.watch
        placement, slot = join(self.store, self.keys, record, timeout, stop,
                               watch.rendezvous_decided if watch is not None else None, lambda: watch.placed, pair_check)
        self.node_rank = slot.node_rank
        self.status_interval = board_interval(placement.world_size, 0.0)
        return placement, slot

    def layout(self, published: int = -1) -> NodeLayout:
        """The nodes as the controller placed them last: the whole layout the first time, then only
        the changes since the layout held (a takeover's: one node). ``published``: the version a
        command said (``Command.layout``); held, it costs no round trip; else one (the version) while
        the layout has not changed. The layout held is kept when none is published yet."""
        keys, held = self.keys, self._layout
        if 0 <= published <= held.version:
            return held
        if held.version:
            version = self.store.counter(keys.layout_version)  # written as text: add(0) reads it
            if version == held.version:
                return held
            if held.version < version <= held.version + LAYOUT_CHANGES:
                changes = self.store.messages(NodeLayoutChange, [keys.layout_change(v)
                                                             for v in range(held.version + 1, version + 1)])
                if None not in changes:
                    for change in changes:
                        self._layout = self._layout.changed(change)
                    return self._layout
        # none held yet, too far behind, or a change ignored as forged: the whole
        self._layout = self.store.try_get(NodeLayout, keys.layout) or held
        return self._layout

    def keepalive(self, status: NodeStatus | None = None, now: float | None = None) -> None:
        """One keepalive (a node's, or an idle spare's) in one round trip: its heartbeat key set to this
        agent's own count (the controller looks for a change), and with it the node's status for the
        status view when the board is next rebuilt (``keys.board_interval``) or the node changed."""
        now = time.monotonic() if now is None else now
        self._beats += 1
        beat = self.keys.node_heartbeat(self.node_rank) if self.node_rank >= 0 else self.keys.spare_heartbeat(self.agent_id)
        keys, texts = [beat], [str(self._beats)]
        if status is not None:
            shape = _shape(status)
            if now >= self._status_due or shape != self._status_shape:
                self._status_due, self._status_shape = now + self.status_interval, shape
                keys.append(self.keys.agent_status(self.agent_id))
                texts.append(self.store.sealed(keys[-1], status))
        self.store.set_each(keys, texts)

    def observe(self, ranks: list[int], now: float) -> tuple[list[int], list[int | None]]:
        """What a keepalive reads, in one round trip: the controller's keepalive (StoreUnavailable
        once it has not moved for ``node_timeout``), the number of commands published, and this node's
        ``ranks``' heartbeat counters and committed steps (None before the first); their step times (as the
        ranks wrote them) are kept in ``step_times``, the collectives they wait in now in ``collectives``."""
        keys = self.keys
        counts, texts = self.store.readings(
            [keys.controller_heartbeat, keys.command_count] + [keys.rank_heartbeat(r) for r in ranks],
            [keys.rank_progress(r) for r in ranks] + [keys.rank_step_times(r) for r in ranks] +
            [keys.rank_collective(r) for r in ranks] + [keys.etcd_unreachable])
        *texts, etcd = texts
        count = len(ranks)
        steps, self.step_times = texts[:count], dict(zip(ranks, texts[count:2 * count]))
        self.collectives = dict(zip(ranks, texts[2 * count:]))
        if bool(etcd) != bool(self.etcd_unreachable):  # said once each way
            if etcd:
                log.error("the control store (etcd) is unreachable from the controller: %s; training goes on", etcd)
            else:
                log.warning("the control store (etcd) answers again")
        self.etcd_unreachable = etcd
        self._published = counts[1]
        self._controller_seen(counts[0], now)
        return counts[2:], [committed_step(text) for text in steps]

    def prepare_ranks(self, ranks: list[int]) -> None:
        """Before ``ranks`` start on this node: their heartbeat counters and step keys, made in one
        round trip where this agent has not seen them yet (the keepalive reads them in one
        ``multi_get``, which would wait for a missing key). None of these ranks runs yet, so nothing
        they wrote is lost."""
        keys = self.keys
        self.store.create([keys.rank_heartbeat(r) for r in ranks], [keys.rank_progress(r) for r in ranks] +
                          [keys.rank_step_times(r) for r in ranks] + [keys.rank_collective(r) for r in ranks])

    def _carried(self, index: int, text: bytes) -> Command | None:
        """Command ``index`` as its doorbell carried it; read from its key when the bell's text does not
        open (anyone who reaches the store can set a bell: then only the command's own key counts)."""
        command = self.store.opened(Command, self.keys.command(index), text)
        return command if command is not None else self.store.read_range(self.keys.command, Command, index, index + 1)[0]

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

    def acknowledge_stop(self, generation: int) -> None:
        """No worker of ``generation`` is left on this node: the STOP's acknowledgement, in one write
        of this agent's own key (the controller checks every node's at once)."""
        report = Report(ReportKind.STOPPED, self.node_rank, generation, agent_id=self.agent_id)
        self.store.set(self.keys.stopped(generation, self.agent_id), report)

    def commands(self) -> Iterator[Command]:
        """The controller's commands published since the last one taken, in order (forged ones left
        out). Each counts as read once it is taken: a caller that stops at one (a spare taking over a
        node) finds the rest, the new generation's START among them, at its next call. With a
        watch, only once it or the last keepalive saw one published, and with no round trip for those
        its doorbell carried."""
        watch = self.watch
        keys, start = self.keys, self.next_command
        if watch is None or watch.failed:
            found = self.store.read_from(keys.command_count, keys.command, Command, start)
        elif watch.published > start:  # rung, so written: the bells carried them, or one round trip
            stop = watch.published
            texts = watch.take(start, stop)
            found = (self.store.read_range(keys.command, Command, start, stop) if texts is None else
                     [self._carried(index, text) for index, text in zip(range(start, stop), texts)])
        elif self._published > start:  # seen at a keepalive: maybe reserved but not yet written
            found = self.store.read_from(keys.command_count, keys.command, Command, start)
        else:
            return
        for command in found:
            self.next_command += 1
            if command is not None:
                yield command


def _shape(status: NodeStatus) -> tuple:
    """The status less what moves by itself (steps, heartbeat ages): a change there is not news."""
    return (status.generation, status.standbys, status.devices, status.probed, status.unreachable,
            tuple((r.rank, r.local_rank, r.pid, r.alive, r.restarts) for r in status.ranks))


def committed_step(text: str) -> int | None:
    """A rank's committed step as the worker library writes it (None: none yet, or not a number)."""
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isascii() and digits.isdigit() else None
