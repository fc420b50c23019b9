"""The node's devices as its agent sees them: found at start, handed to ranks, watched, reset.

Ties the device backend (``ftrun.devices``), the fault table and the device tool's health source
(``ftrun.detection``) and the allocator together. With no device tool, or none that answers, the
node runs without device assignment and device health: exit codes and heartbeats still catch faults.

Everything here runs on the agent's main thread except the device tool's polls (the agent's
``NodeHealth`` runs them in the background) and the device resets, which report back through a queue.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from ftrun.agent.numa import HostCpus, bind_ranks
from ftrun.agent.placement import DeviceAllocator, RankDevice
from ftrun.config import LaunchConfig
from ftrun.contract import DeviceAssignment
from ftrun.detection.device_tool import DeviceToolSource
from ftrun.detection.links import hccn_watch
from ftrun.detection.sources import Background, HealthEvent, HealthSource
from ftrun.detection.table import ACTIONS, REPAIR_LEVELS, Escalation, FaultLevel, FaultTable
from ftrun.devices import DeviceBackend, DeviceOptions, DeviceToolError, Health, make_device_backend
from ftrun.messages import DeviceState, RankTableDevice

log = logging.getLogger(__name__)
#: levels after which the chip is reset before it takes a rank again
RESET_LEVELS = frozenset({FaultLevel.RESTART_NPU, FaultLevel.FREE_RESTART})
#: after a reset, how often to ask whether the device reads healthy again
RESET_CHECK_INTERVAL = 1.0


@dataclass(frozen=True)
class ResetDone:
    device: int
    #: "" when the device reset and reads healthy again; else why not
    problem: str


@dataclass(frozen=True)
class DueReset:
    """A reset waiting for its devices to be free of ranks."""

    #: the faulty device
    device: int
    #: every device reset with it (itself included): the other die of an A3 NPU
    together: tuple[int, ...]


class NodeDevices:
    def __init__(self, backend: DeviceBackend, table: FaultTable, devices: list[int], health_interval: float,
                 reset_timeout: float = DeviceOptions.reset_timeout,
                 reset_wait: float = DeviceOptions.reset_wait):
        self.backend = backend
        self.table = table
        self.escalation = Escalation.from_table(table)
        self.reset_timeout = reset_timeout
        self.reset_wait = reset_wait
        self.allocator = DeviceAllocator(devices) if devices and backend.visibility_var else None
        self.health_interval = health_interval
        self._resets: queue.SimpleQueue[ResetDone] = queue.SimpleQueue()
        #: resets to start as soon as none of the node's running ranks is on their devices
        self._due: list[DueReset] = []
        #: --numa-binding's mode ("" = off), the devices' CPU affinities and the host's CPUs
        self.numa_mode = ""
        self._affinity: dict[int, frozenset[int]] = {}
        self._host: HostCpus | None = None

    @classmethod
    def open(cls, config: LaunchConfig, table: FaultTable) -> "NodeDevices":
        options = DeviceOptions(npu_smi=config.npu_smi, timeout=config.device_timeout, reset_wait=config.reset_wait)
        backend = make_device_backend(config.device, options)
        devices: list[int] = []
        try:
            devices = [d.index for d in backend.discover()]
        except DeviceToolError as e:
            log.warning("no %s devices found: %s; running without device assignment or health checks", backend.kind, e)
        visible = os.environ.get(backend.visibility_var or "", "").strip()
        if config.devices is not None and devices:
            missing = sorted(set(config.devices) - set(devices))
            if missing:
                log.warning("--devices: this node has no %s device %s", backend.kind, ",".join(map(str, missing)))
            devices = [d for d in devices if d in config.devices]
        elif visible and devices:
            allowed = {int(part) for part in visible.split(",") if part.strip().isascii() and part.strip().isdigit()}
            devices = [d for d in devices if d in allowed]  # the user restricted the agent to these
        if config.device == "auto" and 0 < len(devices) < config.nproc_per_node:
            # more ranks than devices: a CPU job on an accelerator node, as torchrun would run it
            log.warning("%d ranks per node but %d %s devices: not assigning or watching devices (--device %s to insist)",
                        config.nproc_per_node, len(devices), backend.kind, backend.kind)
            devices = []
        if devices:
            log.info("%s devices %s; health polled every %gs", backend.kind, ",".join(map(str, devices)),
                     config.health_interval)
        node = cls(backend, table, devices, config.health_interval, options.reset_timeout, options.reset_wait)
        if config.numa_binding:
            node.read_affinity(config.numa_binding)
        return node

    def read_affinity(self, mode: str) -> None:
        """Learn the CPUs near each device for --numa-binding ``mode``; without devices or a
        topology, say once that the workers are not bound."""
        cpu_affinity = getattr(self.backend, "cpu_affinity", None)
        if self.allocator is None or cpu_affinity is None:
            log.info("--numa-binding %s: no %s devices to bind near; workers are not bound", mode, self.backend.kind)
            return
        try:
            self._affinity = cpu_affinity()
        except DeviceToolError as e:
            log.warning("--numa-binding %s: no CPU affinity for the devices (%s); workers are not bound", mode, e)
            return
        self.numa_mode, self._host = mode, HostCpus.read()

    def binding(self) -> dict[int, tuple[int, ...]]:
        """Local rank -> the CPUs it is bound to (--numa-binding), for the ranks on devices now."""
        if not self.numa_mode or self._host is None:
            return {}
        return bind_ranks(self.numa_mode, self.assigned, self._affinity, self._host)

    def sources(self) -> list[HealthSource]:
        """The node's health sources for its devices: the device tool, polled in the background every
        --health-interval, when the node has devices to watch."""
        if self.allocator is None:
            return []
        sources: list[HealthSource] = [
            Background(DeviceToolSource(self.backend, self.table, self.escalation), self.health_interval)]
        physical_id = getattr(self.backend, "physical_id", None)  # Ascend: each chip's RoCE port, by hccn_tool
        options = getattr(self.backend, "options", None)
        if physical_id is not None and options is not None:
            try:
                ports = hccn_watch([physical_id(d) for d in self.allocator.devices], options.hccn_tool, options.timeout)
            except DeviceToolError as e:
                log.warning("the chips' RoCE ports are not watched: %s", e)
                ports = None
            if ports is not None:
                sources.append(Background(ports, self.health_interval))
        return sources

    def tick(self, running: Iterable[int]) -> None:
        """Finished resets are taken into account, and due resets start on devices that no running local
        rank (of ``running``) uses any more."""
        while True:
            try:
                done = self._resets.get_nowait()
            except queue.Empty:
                break
            self._end_reset(done)
        if self._due:
            busy = {self.allocator.assigned.get(rank) for rank in running}
            for due in [due for due in self._due if busy.isdisjoint(due.together)]:
                self._due.remove(due)
                threading.Thread(target=self._reset, args=(due,), name=f"ftrun-reset-{due.device}", daemon=True).start()

    # -- placing ranks -------------------------------------------------------------------------------

    def assign(self, nproc: int) -> dict[int, RankDevice]:
        """Devices for a fresh start of every local rank (NoDevice when too few are usable)."""
        return self.allocator.assign_all(nproc) if self.allocator is not None else {}

    def device_for_respawn(self, local_rank: int) -> RankDevice | None:
        """The device a respawned rank goes to (NoDevice when none is usable now)."""
        if self.allocator is None:
            return None
        before = self.allocator.assigned.get(local_rank)
        placed = self.allocator.reassign(local_rank)
        if before is not None and placed.device != before:
            log.warning("local rank %d moves from device %d to device %d", local_rank, before, placed.device)
        return placed

    @property
    def resetting(self) -> bool:
        """A device is being reset: a rank that finds no usable device now may find one soon."""
        return bool(self.allocator and self.allocator.resetting)

    def records(self, ips: dict[int, str]) -> tuple[RankTableDevice, ...]:
        """The usable devices as the rank tables name them: physical ids and RoCE addresses where
        the backend knows them (hccn_tool), else from ``ips`` (physical id -> address, --device-ips),
        and on an A3 SuperPoD their super device and super pod ids."""
        if self.allocator is None:
            return ()
        records = []
        for index in self.allocator.devices:
            physical, ip = -1, ""
            try:
                physical = self.backend.physical_id(index) if hasattr(self.backend, "physical_id") else -1
                ip = self.backend.device_ip(index) if hasattr(self.backend, "device_ip") else ""
            except DeviceToolError as e:
                log.warning("device %d: %s", index, e)
            super_device_id, super_pod_id = self._super_pod_ids(index)
            records.append(RankTableDevice(index, physical, ip or ips.get(physical, ""), super_device_id, super_pod_id))
        return tuple(records)

    def _super_pod_ids(self, index: int) -> tuple[int, int]:
        """The device's SDID and super pod id; (-1, -1) off a SuperPoD, where the query is refused."""
        super_pod_ids = getattr(self.backend, "super_pod_ids", None)
        if super_pod_ids is None:
            return -1, -1
        try:
            return super_pod_ids(index)
        except DeviceToolError as e:
            log.debug("device %d: no SuperPoD ids: %s", index, e)
            return -1, -1

    def states(self) -> tuple[DeviceState, ...]:
        """Each device's health as the status view shows it."""
        allocator = self.allocator
        if allocator is None:
            return ()
        states = []
        for device in allocator.devices:
            state = DeviceState(device)
            for health, unfit in (("isolated", allocator.isolated), ("resetting", allocator.resetting),
                                  ("preseparated", allocator.preseparated)):
                if device in unfit:
                    state = DeviceState(device, health, unfit[device])
                    break
            states.append(state)
        return tuple(states)

    @property
    def assigned(self) -> dict[int, int]:
        """Local rank -> the logical device it runs on now."""
        return dict(self.allocator.assigned) if self.allocator is not None else {}

    def placed(self, rank_device: RankDevice | None) -> tuple[DeviceAssignment | None, tuple[str, str] | None]:
        """The worker's device, and the runtime's variable of the devices it sees (name, value); none on CPU."""
        if rank_device is None:
            return None, None
        return (DeviceAssignment(rank_device.device, rank_device.index),
                (self.backend.visibility_var, ",".join(map(str, rank_device.visible))))

    # -- faults --------------------------------------------------------------------------------------

    def apply(self, event: HealthEvent) -> list[int]:
        """Take a health change into account; the local ranks that must be stopped and replaced (those on
        the devices a reset takes with it too)."""
        if self.allocator is None:
            return []
        log_at = logging.INFO if event.level in (None, FaultLevel.NOT_HANDLE, FaultLevel.SUB_HEALTH) else logging.WARNING
        log.log(log_at, "%s: %s", event.describe(), ACTIONS[event.level])
        stopped = self._mark(event.device, event.level, event.reason)
        if event.level not in REPAIR_LEVELS:
            return []
        return sorted({rank for device in stopped for rank in self.allocator.ranks_on(device)})

    def on_worker_error(self, local_rank: int, level: FaultLevel, reason: str) -> list[int]:
        """A rank died of a device error in its own output (UCE ERROR, an ECC error): its device
        counts as faulty at that level, as if the health poll had said so. Returns the other local
        ranks that must be stopped: those on the devices a reset of this one takes with it."""
        device = self.allocator.assigned.get(local_rank) if self.allocator is not None else None
        if device is None:
            return []
        escalated = self.escalation.record(device, level, time.time())
        if escalated is not level:
            reason = f"{reason}; repaired too often, escalated from {level.value}"
        log.warning("device %d (local rank %d's): %s: %s", device, local_rank, reason, ACTIONS[escalated])
        stopped = self._mark(device, escalated, reason)
        return sorted({rank for other in stopped for rank in self.allocator.ranks_on(other)} - {local_rank})

    def _mark(self, device: int, level: FaultLevel | None, reason: str) -> tuple[int, ...]:
        """Record ``device``'s fault; the devices whose ranks must stop for it (itself, and for a reset
        every device reset with it)."""
        if level is FaultLevel.SEPARATE:
            self.allocator.isolate(device, reason)
        elif level is FaultLevel.PRE_SEPARATE:
            self.allocator.preseparate(device, reason)
        elif level in RESET_LEVELS and device not in self.allocator.resetting and device not in self.allocator.isolated:
            together = self._reset_together(device)
            for other in together:
                self.allocator.begin_reset(other, reason if other == device else f"reset with device {device}: {reason}")
            self._due.append(DueReset(device, together))  # reset once their ranks are gone
            return together
        return (device,)

    def _reset_together(self, device: int) -> tuple[int, ...]:
        """``device`` and the node's other usable devices that a reset of it takes along (the backend's
        ``reset_group``: the other die of an A3 NPU); a device already being reset has its own reset."""
        reset_group = getattr(self.backend, "reset_group", None)
        try:
            group = reset_group(device) if reset_group is not None else [device]
        except DeviceToolError as e:
            log.warning("device %d: %s; resetting it alone", device, e)
            group = [device]
        busy = set(self.allocator.isolated) | set(self.allocator.resetting)
        return tuple(sorted({device} | {d for d in group if d in self.allocator.devices and d not in busy}))

    def _reset(self, due: DueReset) -> None:
        """In its own thread: reset the chips, wait --reset-wait, then until they read healthy (or give up
        and isolate them); each device's outcome goes back through the queue."""
        deadline = time.monotonic() + self.reset_timeout
        names = ",".join(map(str, due.together))
        log.warning("resetting device%s %s", "s" if len(due.together) > 1 else "", names)
        problems = self._reset_chips(due)
        reset = [device for device in due.together if device not in problems]
        if due.device not in problems:
            time.sleep(max(0.0, min(self.reset_wait, deadline - time.monotonic())))
            problems.update(self._await_health(reset, deadline))
        for device in due.together:
            self._resets.put(ResetDone(device, problems.get(device, "")))

    def _reset_chips(self, due: DueReset) -> dict[int, str]:
        """Reset the faulty chip, then those taken along; the resets that failed, by device. When the
        faulty chip's fails, the others are left untouched (and go back to work as they were)."""
        try:
            self.backend.reset(due.device)
        except DeviceToolError as e:
            return {due.device: f"the reset failed: {e}"}
        failed = {}
        for device in due.together:
            if device != due.device:
                try:
                    self.backend.reset(device)
                except DeviceToolError as e:
                    failed[device] = f"the reset failed: {e}"
        return failed

    def _await_health(self, devices: list[int], deadline: float) -> dict[int, str]:
        """Poll until every one of ``devices`` reads healthy or ``deadline`` passes; those that do not, each with why."""
        problems = {device: f"not healthy {self.reset_timeout:g}s after the reset" for device in devices}
        while problems and time.monotonic() < deadline:
            try:
                healthy = {r.device.index for r in self.backend.poll() if r.health is Health.OK}
            except DeviceToolError as e:
                healthy, problems = set(), dict.fromkeys(problems, f"health unreadable after the reset: {e}")
            for device in healthy & set(problems):
                del problems[device]
            if problems:
                time.sleep(RESET_CHECK_INTERVAL)
        return problems

    def _end_reset(self, done: ResetDone) -> None:
        self.allocator.end_reset(done.device)
        if done.problem:
            log.error("device %d: %s; isolating it", done.device, done.problem)
            self.allocator.isolate(done.device, done.problem)
        else:
            log.warning("device %d reset and healthy again", done.device)
