"""Which device each of the node's ranks runs on, and which devices take no more ranks.

Pure bookkeeping, no tools and no processes: the agent tells it what the health
monitor found and asks it where a (re)spawned rank goes.

Visibility: a worker sees the devices in use on its node, in ascending order
(ASCEND_RT_VISIBLE_DEVICES accepts nothing else), and finds its own among them at
``FTRUN_DEVICE_INDEX``. At a fresh start that index equals LOCAL_RANK, so scripts
written for torchrun pick the right device; a rank moved off an isolated device
finds its new one through ``FTRUN_DEVICE_INDEX`` (``ftrun.elastic`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass


class NoDevice(Exception):
    """No usable device is left on this node for a rank: a node-level fault."""


@dataclass(frozen=True)
class RankDevice:
    """Where one rank runs, and what it is told about it."""

    #: the device's logical id on the node
    device: int
    #: the devices the worker sees, ascending (the visibility variable's value)
    visible: tuple[int, ...]

    @property
    def index(self) -> int:
        """The rank's device as the worker's runtime counts it (its place among the visible ones)."""
        return self.visible.index(self.device)


class DeviceAllocator:
    """The node's devices: assigned to local ranks, isolated, or kept from new work."""

    def __init__(self, devices: list[int]):
        self.devices = sorted(set(devices))
        #: local rank -> device
        self.assigned: dict[int, int] = {}
        #: device -> why it may not run anything (SeparateNPU, device lost)
        self.isolated: dict[int, str] = {}
        #: device -> why it gets no new ranks (PreSeparateNPU); ranks already on it stay
        self.preseparated: dict[int, str] = {}
        #: device -> why it is being reset (RestartNPU, FreeRestartNPU): usable again once done
        self.resetting: dict[int, str] = {}

    def usable(self, device: int) -> bool:
        return device in self.devices and not any(
            device in unfit for unfit in (self.isolated, self.preseparated, self.resetting)
        )

    def assign_all(self, local_ranks: int) -> dict[int, RankDevice]:
        """A fresh start: the lowest usable devices, in order, to local ranks 0..n-1."""
        free = [d for d in self.devices if self.usable(d)]
        if len(free) < local_ranks:
            raise NoDevice(self._shortage(local_ranks, free))
        self.assigned = dict(enumerate(free[:local_ranks]))
        return {rank: self.device_of(rank) for rank in self.assigned}

    def reassign(self, local_rank: int) -> RankDevice:
        """A respawned rank: its own device if that is still fit for new work, else a free usable one."""
        current = self.assigned.get(local_rank)
        if current is None or not self.usable(current):
            taken = {d for r, d in self.assigned.items() if r != local_rank}
            free = [d for d in self.devices if self.usable(d) and d not in taken]
            if not free:
                raise NoDevice(self._shortage(1, free, local_rank))
            self.assigned[local_rank] = free[0]
        return self.device_of(local_rank)

    def device_of(self, local_rank: int) -> RankDevice:
        return RankDevice(self.assigned[local_rank], tuple(sorted(set(self.assigned.values()))))

    def ranks_on(self, device: int) -> list[int]:
        return sorted(r for r, d in self.assigned.items() if d == device)

    def isolate(self, device: int, reason: str) -> None:
        self.isolated.setdefault(device, reason)

    def preseparate(self, device: int, reason: str) -> None:
        self.preseparated.setdefault(device, reason)

    def begin_reset(self, device: int, reason: str) -> None:
        self.resetting.setdefault(device, reason)

    def end_reset(self, device: int) -> None:
        self.resetting.pop(device, None)

    def _shortage(self, wanted: int, free: list[int], local_rank: int | None = None) -> str:
        who = f"local rank {local_rank}" if local_rank is not None else f"{wanted} rank{'s' if wanted != 1 else ''}"
        unusable = [f"device {d} isolated ({why})" for d, why in sorted(self.isolated.items())]
        unusable += [f"device {d} pre-separated ({why})" for d, why in sorted(self.preseparated.items())]
        unusable += [f"device {d} being reset ({why})" for d, why in sorted(self.resetting.items())]
        detail = f": {'; '.join(unusable)}" if unusable else ""
        return f"no usable device left for {who} ({len(free)} free of {len(self.devices)}){detail}"
