"""A device tool as a health source: each poll's readings classified by the fault table.

:meth:`DeviceToolSource.observe` decides (pure: readings and a time in, events out); :meth:`poll`
asks the backend (``npu-smi``, NVML or ``nvidia-smi``, through ``ftrun.devices``) and decides. A
tool's poll may be slow, so the agent polls this source in the background (``sources.Background``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from ftrun.detection.sources import HealthEvent, RankSigns
from ftrun.detection.table import Escalation, FaultTable
from ftrun.devices import DeviceBackend, DeviceReading, DeviceToolError

log = logging.getLogger(__name__)


class DeviceToolSource:
    """Classifies each poll of a device backend; only a change of a device's health or error codes is news."""

    def __init__(self, backend: DeviceBackend, table: FaultTable, escalation: Escalation):
        self.backend = backend
        self.name = backend.kind
        self.table = table
        self.escalation = escalation
        self._last: dict[int, tuple] = {}
        #: why the tool could not be read at the last poll ("" when it could)
        self._problem = ""

    def poll(self, now: float, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        try:
            readings = self.backend.poll()
        except DeviceToolError as e:
            if str(e) != self._problem:
                log.warning("device health unknown: %s; still watching exit codes and heartbeats", e)
            self._problem = str(e)
            return []
        if self._problem:
            log.info("device health readable again")
        self._problem = ""
        return self.observe(readings, now)

    def observe(self, readings: list[DeviceReading], now: float) -> list[HealthEvent]:
        events = []
        for reading in readings:
            index = reading.device.index
            key = (reading.health, reading.codes)
            if self._last.get(index) == key:
                continue
            first = index not in self._last
            self._last[index] = key
            verdict = self.table.classify_device(reading)
            if verdict.level is None and first:
                continue  # healthy when first seen: nothing to say
            level, reason = verdict.level, verdict.reason
            if level is not None:
                escalated = self.escalation.record(index, level, now)
                if escalated is not level:
                    reason = f"{reason}; repaired too often, escalated from {level.value}"
                    level = escalated
            events.append(HealthEvent(self.name, reason, level, device=index, reading=reading))
        return events
