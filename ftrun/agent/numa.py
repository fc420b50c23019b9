"""--numa-binding: which CPUs each worker may run on, near its device.

Deciding is pure (:func:`bind_ranks`, over the devices' affinities and the host's CPU layout);
reading the layout (:class:`HostCpus`, from /sys) is small and separate; each worker binds itself
(``sched_setaffinity`` before its script runs). The modes are torchrun's (torch/numa/binding.py):

* ``node``: the CPUs the device tool names as the device's affinity (its NUMA node's);
* ``socket``: every CPU of the socket(s) those CPUs are on;
* ``exclusive``: the affinity CPUs shared out, in contiguous slices, among the node's ranks whose
  devices have the same affinity, so that no two of them share a CPU;
* ``core-complex``: one L3 cache group of the affinity CPUs per rank, in turn among those ranks.

Every set is cut down to the CPUs the agent itself may use (taskset, cgroups); a rank left with
none is not bound.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from ftrun.devices.topology import parse_cpu_list


@dataclass(frozen=True)
class HostCpus:
    """The host's CPUs as binding needs them."""

    #: the CPUs this process may run on
    allowed: frozenset[int]
    #: CPU -> its socket (physical package)
    socket_of: dict[int, int] = field(default_factory=dict)
    #: the L3 cache groups (CPUs sharing one), each a set
    l3_groups: tuple[frozenset[int], ...] = ()

    @classmethod
    def read(cls, root: str = "/sys/devices/system/cpu") -> "HostCpus":
        sockets: dict[int, int] = {}
        groups: set[frozenset[int]] = set()
        for folder in glob.glob(os.path.join(root, "cpu[0-9]*")):
            cpu = int(os.path.basename(folder)[3:])
            sockets[cpu] = int(_read(os.path.join(folder, "topology", "physical_package_id")) or 0)
            shared = _read(os.path.join(folder, "cache", "index3", "shared_cpu_list"))
            try:
                groups.add(parse_cpu_list(shared))
            except ValueError:
                pass  # no L3 cache listed: core-complex binds as node does
        return cls(frozenset(os.sched_getaffinity(0)), sockets, tuple(sorted(groups, key=min)))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def bind_ranks(mode: str, assigned: dict[int, int], affinity: dict[int, frozenset[int]],
               host: HostCpus) -> dict[int, tuple[int, ...]]:
    """Local rank -> the CPUs it is bound to (ascending), for ranks whose device has a known affinity.

    ``assigned``: local rank -> device; ``affinity``: device -> the CPUs near it."""
    bound: dict[int, tuple[int, ...]] = {}
    for rank, device in sorted(assigned.items()):
        near = affinity.get(device, frozenset()) & host.allowed
        if not near:
            continue
        # the ranks that share this rank's CPUs, in order: exclusive and core-complex divide among them
        sharing = sorted(r for r, d in assigned.items() if affinity.get(d, frozenset()) & host.allowed == near)
        turn = sharing.index(rank)
        cpus = near
        if mode == "socket":
            wanted = {host.socket_of.get(cpu, 0) for cpu in near}
            cpus = frozenset(c for c in host.allowed if host.socket_of.get(c, 0) in wanted) | near
        elif mode == "exclusive":
            ordered = sorted(near)
            share = max(1, len(ordered) // len(sharing))
            start = min(turn * share, len(ordered) - 1) if len(ordered) >= len(sharing) else turn % len(ordered)
            end = len(ordered) if turn == len(sharing) - 1 and len(ordered) >= len(sharing) else start + share
            cpus = frozenset(ordered[start:end])
        elif mode == "core-complex":
            groups = [g & near for g in host.l3_groups if g & near]
            if groups:
                cpus = groups[turn % len(groups)]
        bound[rank] = tuple(sorted(cpus))
    return bound

