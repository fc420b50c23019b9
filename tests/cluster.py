"""A test bed shaped like a cluster: each node a network namespace with two links, as a real node has.

Every node ``i`` (spares too) is a namespace ``<tag>n<i>`` holding two interfaces, ``mgmt`` and ``data``, each
one end of a veth pair whose other end is a port of a bridge in this namespace: the management switch
(the store, the agents) and the data switch (the collectives; ``GLOO_SOCKET_IFNAME=data``). The interfaces
have the same names on every node, as on a real cluster, and this namespace has an address on each switch,
so that the test reaches the store as an operator's shell would.

Faults are made for real, at the switch's port, as a dark optical module or a dead switch port makes them:

* ``dark(i)``: the port goes down; the node's ``data`` loses its carrier (its operstate turns ``down``), and
  packets vanish both ways: no side gets a reset;
* ``silent(i)``: the port leaves the switch; carrier and operstate stay up, packets vanish (a fault only
  the job's own stall and the probes can see);
* ``light(i)``: the port back as it was;
* ``flap(i, ...)``: dark and light in turn, from a thread of the test's;
* ``management`` variants of each, and ``both``.

Setting it up costs a few ``ip`` calls per node (about 30 ms each); ``close()`` removes every namespace,
bridge and veth it made. Without root or ``ip`` the test skips (fails on CI: ``tests/parts.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field

from tests.parts import unavailable

#: the two networks of a node: the management link, and the data link the collectives use
NETWORKS = ("mgmt", "data")


def ip(*args: str, namespace: str = "") -> None:
    """One ``ip`` command (in ``namespace``); CalledProcessError when it fails."""
    prefix = ["ip", "-n", namespace] if namespace else ["ip"]
    subprocess.run([*prefix, *args], check=True, capture_output=True, timeout=30)


@dataclass
class BedNode:
    """One node of the bed: its namespace and its addresses on each network."""

    index: int
    namespace: str
    mgmt: str
    data: str
    #: the switch's ends of its two links (in the test's namespace)
    ports: dict[str, str] = field(default_factory=dict)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class ClusterBed:
    """``count`` nodes (spares included) on a management and a data switch; see the module's text."""

    def __init__(self, count: int):
        self.tag = uuid.uuid4().hex[:5]
        # a /24 of each network per bed, drawn from the tag: two beds (two test runs) rarely meet
        third = int(self.tag[:2], 16)
        self.subnets = {"mgmt": f"10.{210 + int(self.tag[2], 16) % 20}.{third}",
                        "data": f"10.{230 + int(self.tag[3], 16) % 20}.{third}"}
        self.switches = {network: f"b{network[0]}{self.tag}" for network in NETWORKS}
        self.nodes: list[BedNode] = []
        self._flappers: list[tuple[threading.Thread, threading.Event]] = []
        self._count = count

    # -- set up and take down ---------------------------------------------------------------------------

    def open(self) -> "ClusterBed":
        if os.geteuid() != 0:
            unavailable("network namespaces need root")
        if shutil.which("ip") is None:
            unavailable("ip (iproute2) is not installed")
        try:
            for network, bridge in self.switches.items():
                ip("link", "add", bridge, "type", "bridge")
                ip("addr", "add", f"{self.subnets[network]}.254/24", "dev", bridge)
                ip("link", "set", bridge, "up")
            for index in range(self._count):
                self._add_node(index)
        except (OSError, subprocess.CalledProcessError) as e:
            self.close()
            why = (getattr(e, "stderr", b"") or b"").decode(errors="replace").strip()
            unavailable(f"network namespaces and bridges are not permitted here: {why or e}")
        return self

    def _add_node(self, index: int) -> None:
        namespace = f"{self.tag}n{index}"
        ip("netns", "add", namespace)
        node = BedNode(index, namespace, f"{self.subnets['mgmt']}.{index + 1}", f"{self.subnets['data']}.{index + 1}")
        self.nodes.append(node)  # close() finds it even if a step below fails
        for network in NETWORKS:
            port = node.ports[network] = f"{network[0]}{self.tag}{index}"
            ip("link", "add", port, "type", "veth", "peer", "name", network, "netns", namespace)
            ip("link", "set", port, "master", self.switches[network], "up")
            ip("addr", "add", f"{getattr(node, network)}/24", "dev", network, namespace=namespace)
            ip("link", "set", network, "up", namespace=namespace)
        ip("link", "set", "lo", "up", namespace=namespace)

    def close(self) -> None:
        for thread, stop in self._flappers:
            stop.set()
            thread.join(10)
        for node in self.nodes:
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True, timeout=30)
        for bridge in self.switches.values():
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
        self.nodes.clear()

    def __enter__(self) -> "ClusterBed":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- where things are -------------------------------------------------------------------------------

    @property
    def store_address(self) -> str:
        """This namespace's address on the management switch (where a test may reach the store)."""
        return f"{self.subnets['mgmt']}.254"

    def interface_state(self, index: int, network: str = "data") -> tuple[str, str]:
        """The node's interface as the node's own OS shows it: (operstate, carrier)."""
        read = subprocess.run(self.nodes[index].command(
            ["sh", "-c", f"cat /sys/class/net/{network}/operstate; cat /sys/class/net/{network}/carrier 2>/dev/null "
                         "|| echo 0"]), capture_output=True, text=True, timeout=30)
        operstate, carrier = (read.stdout.split() + ["", ""])[:2]
        return operstate, carrier

    # -- faults ---------------------------------------------------------------------------------------------

    def _networks(self, network: str) -> tuple[str, ...]:
        return NETWORKS if network == "both" else (network,)

    def dark(self, index: int, network: str = "data") -> None:
        """The switch's port of the node's link down: the node loses carrier; packets vanish."""
        for name in self._networks(network):
            ip("link", "set", self.nodes[index].ports[name], "down")

    def silent(self, index: int, network: str = "data") -> None:
        """The port off the switch: carrier stays up on both ends, packets vanish."""
        for name in self._networks(network):
            ip("link", "set", self.nodes[index].ports[name], "nomaster")

    def light(self, index: int, network: str = "data") -> None:
        """The node's link as it was: the port up, on its switch."""
        for name in self._networks(network):
            port = self.nodes[index].ports[name]
            ip("link", "set", port, "master", self.switches[name], "up")

    def flap(self, index: int, dark_for: float, light_for: float, times: int, network: str = "data") -> threading.Thread:
        """Dark for ``dark_for`` s, then lit for ``light_for`` s, ``times`` times, in a thread (joined by
        close(), or by the caller)."""
        stop = threading.Event()

        def run() -> None:
            for _ in range(times):
                if stop.is_set():
                    break
                self.dark(index, network)
                stop.wait(dark_for)
                self.light(index, network)
                stop.wait(light_for)

        thread = threading.Thread(target=run, name=f"bed-flap-{index}", daemon=True)
        self._flappers.append((thread, stop))
        thread.start()
        return thread


def wait_until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held (polled every 20 ms), or -1 after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    return -1.0
