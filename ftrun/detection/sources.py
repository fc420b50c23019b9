"""The seam every detector fits: a health source, the events it returns, and the node's sources as one.

A :class:`HealthSource` is anything that can tell the agent that one of its node's devices or ranks is
unhealthy (a device tool, the hang watch, the OS's link state). Each poll returns
frozen :class:`HealthEvent` s, only for what changed; a source never raises for a tool it cannot read
(it logs that once and goes on saying nothing). The agent holds its node's sources as one
:class:`NodeHealth` and polls it; a source that may be slow (it runs a tool) is wrapped in a
:class:`Background`, which polls it in a thread of its own, so a hung ``npu-smi`` never delays the
handling of a worker's exit.

What the agent does about an event (stop the ranks on a device, dump and kill a hung rank) is the
agent's; a source only observes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

from ftrun.detection.table import FaultLevel
from ftrun.devices import DeviceReading

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthEvent:
    """What a source found out about one device or one rank of the node: how bad it is, and why."""

    #: the source's name (HealthSource.name): a device backend's kind, or ``hang``
    source: str
    reason: str
    #: the fault level the table gives it; None: healthy (again), or a rank's finding, which has no level
    level: FaultLevel | None = None
    #: the device's logical id, for a device's event (else None)
    device: int | None = None
    #: the global rank, for a rank's event (else None)
    rank: int | None = None
    #: what the device tool read, for a device's event
    reading: DeviceReading | None = None
    #: a data link's event (``links.py``): the link, and whether it is up again ("" for any other event)
    link: str = ""
    link_up: bool = False

    def describe(self) -> str:
        level = self.level.value if self.level else "healthy"
        if self.link:
            return self.reason
        if self.device is None:
            return f"rank {self.rank}: {self.reason}"
        where = self.reading.device.physical or self.reading.device.name if self.reading else ""
        return f"device {self.device} ({where}): {self.reason} -> {level}"


@dataclass(frozen=True)
class RankSigns:
    """What the agent read of one of its running ranks at a keepalive, for the sources that watch ranks."""

    rank: int
    #: the rank's heartbeat counter (``ftrun.elastic`` beats it once a second)
    beats: int
    #: with --hang-timeout: its output lines and CPU time, which change while it makes progress
    activity: tuple = ()
    #: its process is in the stopped state (SIGSTOP, a debugger)
    stopped: bool = False


class HealthSource(Protocol):
    """Something that can tell that a device or a rank of the node is unhealthy."""

    #: who says it, in events and logs (and, for a device tool, its section of the fault table)
    name: str

    def poll(self, now: float, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        """What changed since the last poll. ``ranks``: what the agent read of its running ranks now, at a
        keepalive where it judges them (else empty); a source that reads its own tool ignores them.
        Never raises."""
        ...


class NodeHealth:
    """The node's health sources, polled as one, in order."""

    def __init__(self, sources: Sequence[HealthSource] = ()):
        self.sources = list(sources)

    def poll(self, now: float, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        return [event for source in self.sources for event in source.poll(now, ranks)]

    def start(self) -> None:
        """Start the sources that poll in threads of their own."""
        for source in self.sources:
            if isinstance(source, Background):
                source.start()

    def stop(self) -> None:
        for source in self.sources:
            if isinstance(source, Background):
                source.stop()


class Background:
    """A slow source polled every ``interval`` seconds in a thread of its own; ``poll`` hands on what
    it found since (it never waits for the source, and the ranks' signs do not reach it)."""

    def __init__(self, source: HealthSource, interval: float):
        self.source = source
        self.name = source.name
        self.interval = interval
        self.events: queue.SimpleQueue[HealthEvent] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ftrun-health-{source.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # a poll under way ends at the tool's own timeout; the thread is a daemon

    def poll(self, now: float = 0.0, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        found = []
        while True:
            try:
                found.append(self.events.get_nowait())
            except queue.Empty:
                return found

    def _run(self) -> None:
        while not self._stop.is_set():
            events = self.source.poll(time.time())
            if not self._stop.is_set():
                for event in events:
                    self.events.put(event)
            self._stop.wait(self.interval)
