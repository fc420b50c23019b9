"""What ``ftrun probe`` and ``--preflight`` find: each device, its health, its level, ftrun's action."""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.detection.table import ACTIONS, FaultLevel, FaultTable
from ftrun.devices import DeviceBackend, DeviceReading, DeviceToolError

#: levels at which a device is not fit for new work
UNUSABLE = frozenset({FaultLevel.SEPARATE, FaultLevel.RESTART_NPU, FaultLevel.FREE_RESTART, FaultLevel.PRE_SEPARATE})


@dataclass(frozen=True)
class ProbeRow:
    reading: DeviceReading
    level: FaultLevel | None
    reason: str
    #: what gave the level: the table file that lists the code, a vendor's list, or the health fallback
    rule: str = ""

    @property
    def usable(self) -> bool:
        return self.level not in UNUSABLE

    @property
    def action(self) -> str:
        return ACTIONS[self.level]

    def as_dict(self) -> dict:
        device = self.reading.device
        return {
            "index": device.index, "name": device.name, "physical": device.physical,
            "health": self.reading.health.value, "codes": list(self.reading.codes), "info": self.reading.info,
            "level": self.level.value if self.level else None, "reason": self.reason, "rule": self.rule,
            "action": self.action,
            "usable": self.usable,
        }


@dataclass(frozen=True)
class ProbeReport:
    kind: str
    rows: tuple[ProbeRow, ...] = ()
    #: the device tool could not be read (missing, hung, garbage)
    error: str = ""

    @property
    def problem(self) -> str:
        """Why this node is not fit to train, or ""."""
        if self.error:
            return f"cannot read {self.kind} device health: {self.error}"
        bad = [r for r in self.rows if not r.usable]
        return "; ".join(f"device {r.reading.device.index} {r.reading.health.value}: {r.reason} ({r.level.value})" for r in bad)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "error": self.error, "usable": not self.problem, "problem": self.problem,
                "devices": [r.as_dict() for r in self.rows]}


def probe(backend: DeviceBackend, table: FaultTable) -> ProbeReport:
    """Poll every device once and classify it."""
    try:
        readings = backend.poll()
    except DeviceToolError as e:
        return ProbeReport(backend.kind, error=str(e))
    rows = []
    for reading in readings:
        verdict = table.classify_device(reading)
        rows.append(ProbeRow(reading, verdict.level, verdict.reason or "healthy", verdict.rule))
    return ProbeReport(backend.kind, tuple(rows))
