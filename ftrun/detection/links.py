"""The data link's state, as the operating system sees it: a health source.

A node's most common network fault is a port or an optical module that goes dark: packets vanish, no side
gets a reset, every process lives, and the collectives wait in silence until their timeout (30 min for
gloo). The kernel knows at once: the interface the collectives use loses its carrier. This source reads
that, so a dark port is seen within a poll (LINK_POLL), long before any stall bound.

* on every node: the interface named by ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME`` or
  ``HCCL_SOCKET_IFNAME`` (:func:`data_interfaces`), read from ``/sys/class/net/<name>/operstate`` and
  ``carrier`` (two small reads, no process);
* on Ascend, each chip's RoCE port from ``hccn_tool -i <physical id> -link -g`` (``link status: UP``),
  a tool run, so the agent polls it in the background (``sources.Background``).

:meth:`LinkWatch.observe` decides (pure: readings and a time in, events out, only for a change); the
readers read. What the agent does about a dark link (tell the controller) is the agent's, and what the job
does about it the controller's (``ftrun.controller.links``).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ftrun.detection.sources import HealthEvent, RankSigns
from ftrun.devices import DeviceToolError
from ftrun.devices.npu_smi import NpuSmi, find_hccn_tool

log = logging.getLogger(__name__)

#: the variables that name the collectives' interface, in the order they are looked at
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME")
#: how often the interfaces' state is read (two small file reads each): a dark port is seen within this
LINK_POLL = 0.2
SYS_CLASS_NET = "/sys/class/net"
HCCN_LINK = "hccn_tool -link -g"


@dataclass(frozen=True)
class LinkReading:
    """One link's state at one read: its name (an interface, or ``npu 3``), whether it carries packets, and
    the evidence in words (``operstate down, no carrier``)."""

    name: str
    up: bool
    evidence: str


def data_interfaces(env: Mapping[str, str]) -> list[str]:
    """The interfaces the collectives use, from the variables that name them (INTERFACE_VARIABLES). A list
    names several (``eth0,eth1``: each is watched); NCCL's ``=eth0`` means exactly eth0, and its
    ``^eth0`` (every interface but) names none to watch."""
    found: list[str] = []
    for variable in INTERFACE_VARIABLES:
        value = env.get(variable, "").strip()
        if not value or value.startswith("^"):
            continue
        for name in value.lstrip("=").split(","):
            name = name.strip()
            if name and name not in found:
                found.append(name)
    return found


def read_interface(name: str, root: str = SYS_CLASS_NET) -> LinkReading:
    """The interface's state from the kernel: up only when its operstate is ``up`` (or ``unknown``, as a
    loopback or a tunnel says, with a carrier) and it has a carrier."""
    try:
        with open(os.path.join(root, name, "operstate")) as f:
            operstate = f.read().strip()
    except OSError:
        return LinkReading(name, False, "no such interface")
    try:
        with open(os.path.join(root, name, "carrier")) as f:
            carrier = f.read().strip() == "1"
    except OSError:  # EINVAL while the interface is administratively down
        carrier = False
    up = operstate in ("up", "unknown") and carrier
    return LinkReading(name, up, f"operstate {operstate}, {'carrier' if carrier else 'no carrier'}")


def parse_hccn_link(text: str) -> bool:
    """Whether ``hccn_tool -i N -link -g`` says the port is up (``link status: UP``). DeviceToolError for
    an output without that line."""
    for line in text.splitlines():
        label, sep, value = line.partition(":")
        if sep and " ".join(label.split()).lower() == "link status":
            return value.strip().upper() == "UP"
    raise DeviceToolError(f"{HCCN_LINK} printed no link status")


class LinkWatch:
    """A health source over the node's data links: an event when a link goes dark or comes back (the first
    reading of a link that is up says nothing). ``readers`` each read one link; ``interval``: how often
    :meth:`poll` reads (a poll in between returns nothing)."""

    name = "link"

    def __init__(self, readers: Sequence[Callable[[], LinkReading]], interval: float = LINK_POLL):
        self.readers = list(readers)
        self.interval = interval
        self._next = 0.0
        #: link -> whether it was up at the last reading
        self._up: dict[str, bool] = {}
        #: a reader's last complaint (said once)
        self._problems: dict[int, str] = {}

    def poll(self, now: float, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        if now < self._next:
            return []
        self._next = now + self.interval
        readings = []
        for index, reader in enumerate(self.readers):
            try:
                readings.append(reader())
            except DeviceToolError as e:
                if self._problems.get(index) != str(e):
                    log.warning("data link state unknown: %s", e)
                self._problems[index] = str(e)
        return self.observe(readings)

    def observe(self, readings: Sequence[LinkReading]) -> list[HealthEvent]:
        """The links among ``readings`` whose state changed: dark (``up`` False) or back."""
        events = []
        for reading in readings:
            before = self._up.get(reading.name)
            self._up[reading.name] = reading.up
            if before is None and reading.up or before == reading.up:
                continue
            state = "back up" if reading.up else "dark"
            events.append(HealthEvent(self.name, f"data link {reading.name} {state} ({reading.evidence})",
                                      link=reading.name, link_up=reading.up))
        return events

    @property
    def dark(self) -> list[str]:
        """The links dark at the last reading."""
        return sorted(name for name, up in self._up.items() if not up)


def hccn_reader(physical_id: int, tool: str, timeout: float) -> Callable[[], LinkReading]:
    """A reader of one Ascend chip's RoCE port through hccn_tool."""
    runner = NpuSmi(tool, timeout)

    def read() -> LinkReading:
        up = parse_hccn_link(runner.run("-i", str(physical_id), "-link", "-g"))
        return LinkReading(f"npu {physical_id}", up, f"hccn_tool link status {'UP' if up else 'DOWN'}")

    return read


def interface_watch(env: Mapping[str, str], root: str = SYS_CLASS_NET) -> LinkWatch | None:
    """The watch over the interfaces the environment names for the collectives (None when it names none,
    or none this node has: said once)."""
    names = data_interfaces(env)
    present = [name for name in names if os.path.exists(os.path.join(root, name))]
    for name in sorted(set(names) - set(present)):
        log.warning("the collectives' interface %s is not on this node; its link state is not watched", name)
    if not present:
        return None
    log.info("watching the data link%s %s", "s" if len(present) > 1 else "", ", ".join(present))
    return LinkWatch([functools.partial(read_interface, name, root) for name in present])


def hccn_watch(physical_ids: Sequence[int], tool: str = "hccn_tool", timeout: float = 10.0) -> LinkWatch | None:
    """Ascend: the watch over each chip's RoCE port (None without hccn_tool or chips)."""
    path = find_hccn_tool(tool)
    if not path or not physical_ids:
        return None
    return LinkWatch([hccn_reader(phy, path, timeout) for phy in physical_ids], interval=0.0)
