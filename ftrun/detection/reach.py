"""Which nodes can reach each other on the data network: a small probe between agents, and the verdict.

A link can fail with its carrier up (a switch port that drops everything, a route gone): the OS says
nothing, and only the job's stall would tell. So each agent listens on its data address (the address of
the interface the collectives use, ``links.data_interfaces``) and, every PROBE_EVERY seconds, opens a TCP
connection to each peer's listener with a PROBE_TIMEOUT deadline: a peer whose connect is answered (even
refused) is reachable. Each node tells the controller, with its status, which nodes it could not reach;
:func:`localise` (pure) puts the fault on a node (it reaches none of its peers and none reaches it) or on
the links between some pairs, and says which. A job of many nodes probes its nearest PROBE_PEERS by node
rank each way, so the probes cost O(nodes), not O(nodes^2).

The spare nodes' agents take part too, as probers and probed, though they hold no place in the job's ring
of ranks: each takes a probe id below zero (:func:`spare_probe_id`) and sits on the probe's ring beside the
nodes. Two nodes alone that cannot reach each other with both carriers up are one broken link to them; a
spare is the third vantage point that tells which side is cut off (it reaches one and not the other).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Mapping

log = logging.getLogger(__name__)

#: how often an agent probes its peers, and how long a connect may take before the peer counts as unreachable
PROBE_EVERY, PROBE_TIMEOUT = 1.0, 0.5
#: a node probes its nearest this many peers by node rank on each side (all of them in a job of fewer nodes)
PROBE_PEERS = 4
#: SIOCGIFADDR: an interface's IPv4 address
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str:
    """The IPv4 address of interface ``name`` ("" when it has none, or there is no such interface)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return ""


def spare_probe_id(claimed: int) -> int:
    """The probe id of the spare that claimed the ``claimed``-th spare slot of the probe (1, 2, ...: a counter
    of the store's): below zero, so that it is never a node rank."""
    return -claimed


def probe_ring(nodes: list[int], spares_claimed: int) -> list[int]:
    """Every probe id on the ring: the node ranks, and the ids of the ``spares_claimed`` spares that took one."""
    return sorted(nodes) + [spare_probe_id(n) for n in range(1, spares_claimed + 1)]


def peers_to_probe(me: int, nodes: list[int], reach: int = PROBE_PEERS) -> list[int]:
    """The node ranks ``me`` probes among ``nodes``: every other one, or in a large job its ``reach`` nearest on
    each side, the list taken as a ring."""
    others = sorted(n for n in nodes if n != me)
    if len(others) <= 2 * reach:
        return others
    ring = sorted(nodes)
    at = ring.index(me) if me in ring else 0
    chosen = {ring[(at + step) % len(ring)] for step in range(-reach, reach + 1)} - {me}
    return sorted(chosen)


@dataclass(frozen=True)
class Verdict:
    """Where the fault is: ``nodes`` cut off from every peer that probed them, and the pairs that cannot reach
    each other beyond those (``links``), in words (``text``); all empty when every probe was answered."""

    nodes: tuple[int, ...] = ()
    links: tuple[tuple[int, int], ...] = ()
    text: str = ""


def localise(unreachable: Mapping[int, tuple[int, ...]], probed: Mapping[int, tuple[int, ...]],
             names: Mapping[int, str] | None = None) -> Verdict:
    """The fault put on a node or on links, from each node's word: ``unreachable[n]``, the nodes n could not
    reach; ``probed[n]``, the nodes n probed. A node is cut off when it reached none of the nodes it probed
    and none of the nodes that probed it reached it, and at least two others judged it (two nodes alone that
    cannot reach each other are one link: which side is dark, only the OS can say, or a third vantage point,
    a spare). ``names``: how an id other than a node rank is said (a spare's: "spare node HOST")."""
    names = names or {}

    def said(node: int) -> str:
        return names.get(node, f"node {node}")

    pairs = {(min(a, b), max(a, b)) for a, lost in unreachable.items() for b in lost if a != b}
    cut_off = []
    for node in sorted(set(unreachable) | set(probed)):
        mine = set(probed.get(node, ()))
        by_others = {a for a, targets in probed.items() if node in targets and a != node}
        if len(mine | by_others) < 2:
            continue
        out_lost = mine <= set(unreachable.get(node, ()))
        in_lost = all(node in unreachable.get(a, ()) for a in by_others)
        if mine and by_others and out_lost and in_lost:
            cut_off.append(node)
    links = tuple(sorted(p for p in pairs if p[0] not in cut_off and p[1] not in cut_off))
    words = [f"{said(n)} reaches no peer on the data network, and no peer reaches it" for n in cut_off]
    words += [(f"nodes {a} and {b}" if a >= 0 and b >= 0 and a not in names and b not in names
               else f"{said(a)} and {said(b)}") + " cannot reach each other on the data network" for a, b in links]
    return Verdict(tuple(cut_off), links, "; ".join(words))


def data_listener(address: str, backlog: int, timeout: float) -> tuple[socket.socket, str]:
    """A listening socket on ``address`` (the node's data address), a free port, its accept bounded by
    ``timeout``; and the endpoint ``HOST:PORT`` its peers reach it at."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(backlog)
    listener.settimeout(timeout)
    return listener, f"{address}:{listener.getsockname()[1]}"


def wake_and_close(listener: socket.socket, threads: list[threading.Thread], deadline: float) -> None:
    """Wake ``listener``'s accept (its threads see it closed), wait for ``threads`` within ``deadline`` each,
    and close it."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    for thread in threads:
        thread.join(deadline)
    listener.close()


class Prober:
    """This agent's side of the probe: a listener on its data address, and a thread that probes the peers
    the agent names (``aim``) and keeps which of them it could not reach (``unreachable``)."""

    def __init__(self, address: str, every: float = PROBE_EVERY, timeout: float = PROBE_TIMEOUT):
        self.every, self.timeout = every, timeout
        #: where peers reach this node's listener
        self._listener, self.endpoint = data_listener(address, 64, 1.0)
        self._targets: dict[int, tuple[str, int]] = {}
        #: the peers probed, and those not reached, at the last round
        self.probed: tuple[int, ...] = ()
        self.unreachable: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._answer, name="ftrun-probe-listener", daemon=True),
                         threading.Thread(target=self._probe, name="ftrun-probe", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        wake_and_close(self._listener, self._threads, self.timeout * max(1, len(self._targets)) + 2.0)

    def aim(self, targets: Mapping[int, str]) -> None:
        """The peers to probe from now on: node rank -> "HOST:PORT" of its listener."""
        parsed = {}
        for node, endpoint in targets.items():
            host, _, port = endpoint.rpartition(":")
            if host and port.isdigit():
                parsed[node] = (host, int(port))
        self._targets = parsed
        # what the last round found of peers no longer aimed at is stale (a spare that took a node's place
        # probed that node's old holder under the id it holds now): not said again
        self.probed = tuple(n for n in self.probed if n in parsed)
        self.unreachable = tuple(n for n in self.unreachable if n in parsed)

    def _answer(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
                connection.close()
            except OSError:
                continue  # the accept's own timeout, or the listener closed at the stop

    def _probe(self) -> None:
        while not self._stop.wait(self.every):
            targets = dict(self._targets)
            lost = [node for node, address in sorted(targets.items()) if not self._reaches(address)]
            if lost != list(self.unreachable):
                log.warning("data network: cannot reach node%s %s", "s" if len(lost) > 1 else "",
                            ", ".join(map(str, lost))) if lost else log.info("data network: every peer reached")
            self.probed, self.unreachable = tuple(sorted(targets)), tuple(lost)

    def _reaches(self, address: tuple[str, int]) -> bool:
        try:
            socket.create_connection(address, timeout=self.timeout).close()
            return True
        except ConnectionRefusedError:
            return True  # the host answered
        except OSError:
            return False
