"""Device health, polled off the agent's main loop and turned into events.

:class:`DeviceWatch` decides (pure: statuses and a time in, events out); the
:class:`HealthMonitor` thread polls the device backend every ``--health-interval``
and queues the events for the agent's loop, so a slow or hung ``npu-smi`` never
delays the handling of a worker's exit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from ftrun.devices import DeviceBackend, DeviceStatus, DeviceToolError
from ftrun.faults.levels import Escalation, FaultLevel, FaultTable

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DeviceEvent:
    """A device's health changed."""

    device: int
    #: None: healthy (again)
    level: FaultLevel | None
    reason: str
    status: DeviceStatus

    def describe(self) -> str:
        level = self.level.value if self.level else "healthy"
        return f"device {self.device} ({self.status.device.physical or self.status.device.name}): {self.reason} -> {level}"


class DeviceWatch:
    """Classifies each poll; only a change of a device's health or error codes is news."""

    def __init__(self, table: FaultTable, escalation: Escalation):
        self.table = table
        self.escalation = escalation
        self._last: dict[int, tuple] = {}

    def observe(self, statuses: list[DeviceStatus], now: float) -> list[DeviceEvent]:
        events = []
        for status in statuses:
            index = status.device.index
            key = (status.health, status.codes)
            if self._last.get(index) == key:
                continue
            first = index not in self._last
            self._last[index] = key
            verdict = self.table.classify_device(status)
            if verdict.level is None and first:
                continue  # healthy when first seen: nothing to say
            level, reason = verdict.level, verdict.reason
            if level is not None:
                escalated = self.escalation.record(index, level, now)
                if escalated is not level:
                    reason = f"{reason}; repaired too often, escalated from {level.value}"
                    level = escalated
            events.append(DeviceEvent(index, level, reason, status))
        return events


class HealthMonitor:
    """Polls the devices in a thread of its own and queues the events."""

    def __init__(self, backend: DeviceBackend, watch: DeviceWatch, interval: float):
        self.backend = backend
        self.watch = watch
        self.interval = interval
        self.events: queue.SimpleQueue[DeviceEvent] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # a poll under way ends at the tool's own timeout; the thread is a daemon

    def pending(self) -> list[DeviceEvent]:
        found = []
        while True:
            try:
                found.append(self.events.get_nowait())
            except queue.Empty:
                return found

    def _run(self) -> None:
        problem = ""
        while not self._stop.is_set():
            try:
                statuses = self.backend.poll()
            except DeviceToolError as e:
                if str(e) != problem:
                    log.warning("device health unknown: %s; still watching exit codes and heartbeats", e)
                problem = str(e)
            else:
                if problem:
                    log.info("device health readable again")
                problem = ""
                if not self._stop.is_set():
                    for event in self.watch.observe(statuses, time.time()):
                        self.events.put(event)
            self._stop.wait(self.interval)
