"""The node's devices as its agent sees them: found at start, handed to ranks, watched.

Ties the device backend (``ftrun.devices``), the fault table (``ftrun.faults``), the
allocator and the health monitor together. With no device tool, or none that
answers, the node runs without device assignment and device health: exit codes
and heartbeats still catch faults.
"""

from __future__ import annotations

import logging
import os

from ftrun.agent.health import ACTIONS, REPAIR_LEVELS, DeviceEvent, DeviceWatch, HealthMonitor
from ftrun.agent.placement import DeviceAllocator, DeviceSlot
from ftrun.config import LaunchConfig
from ftrun.devices import DeviceBackend, DeviceOptions, DeviceToolError, make_backend
from ftrun.faults.levels import Escalation, FaultLevel, FaultTable

log = logging.getLogger(__name__)


class NodeDevices:
    def __init__(self, backend: DeviceBackend, table: FaultTable, devices: list[int], health_interval: float):
        self.backend = backend
        self.table = table
        self.allocator = DeviceAllocator(devices) if devices and backend.visibility_var else None
        self.monitor = None
        if self.allocator is not None:
            watch = DeviceWatch(table, Escalation.from_table(table))
            self.monitor = HealthMonitor(backend, watch, health_interval)

    @classmethod
    def open(cls, config: LaunchConfig, table: FaultTable) -> "NodeDevices":
        backend = make_backend(config.device, DeviceOptions(npu_smi=config.npu_smi, timeout=config.device_timeout))
        devices: list[int] = []
        try:
            devices = [d.index for d in backend.discover()]
        except DeviceToolError as e:
            log.warning("no %s devices found: %s; running without device assignment or health checks", backend.kind, e)
        visible = os.environ.get(backend.visibility_var or "", "").strip()
        if visible and devices:
            allowed = {int(part) for part in visible.split(",") if part.strip().isdigit()}
            devices = [d for d in devices if d in allowed]  # the user restricted the agent to these
        if devices:
            log.info("%s devices %s; health polled every %gs", backend.kind, ",".join(map(str, devices)),
                     config.health_interval)
        return cls(backend, table, devices, config.health_interval)

    def start(self) -> None:
        if self.monitor is not None:
            self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def events(self) -> list[DeviceEvent]:
        return self.monitor.pending() if self.monitor is not None else []

    def slots(self, nproc: int) -> dict[int, DeviceSlot]:
        """Devices for a fresh start of every local rank (NoDevice when too few are usable)."""
        return self.allocator.assign_all(nproc) if self.allocator is not None else {}

    def slot_for_respawn(self, local_rank: int) -> DeviceSlot | None:
        if self.allocator is None:
            return None
        before = self.allocator.assigned.get(local_rank)
        slot = self.allocator.reassign(local_rank)
        if before is not None and slot.device != before:
            log.warning("local rank %d moves from device %d to device %d", local_rank, before, slot.device)
        return slot

    def env(self, slot: DeviceSlot | None) -> tuple[tuple[str, str], ...]:
        """The worker's device variables: what it sees, and which of those is its own."""
        if slot is None:
            return ()
        return (
            (self.backend.visibility_var, ",".join(map(str, slot.visible))),
            ("FTRUN_DEVICE", str(slot.device)),
            ("FTRUN_DEVICE_INDEX", str(slot.index)),
        )

    def apply(self, event: DeviceEvent) -> list[int]:
        """Take a health change into account; the local ranks that must be stopped and replaced."""
        if self.allocator is None:
            return []
        if event.level is FaultLevel.SEPARATE:
            self.allocator.isolate(event.device, event.reason)
        elif event.level is FaultLevel.PRE_SEPARATE:
            self.allocator.preseparate(event.device, event.reason)
        log_at = logging.INFO if event.level in (None, FaultLevel.NOT_HANDLE, FaultLevel.SUB_HEALTH) else logging.WARNING
        log.log(log_at, "%s: %s", event.describe(), ACTIONS[event.level])
        if event.level not in REPAIR_LEVELS:
            return []
        return self.allocator.ranks_on(event.device)
