"""--worker-port-range: the ports ftrun opens itself (control and worker stores, snapshot servers)
come from one range, so that a firewall that opens only those lets the job run.

Depends on nothing of ftrun's but its errors: the store, the snapshot server and the config all use it.
"""

from __future__ import annotations

import errno
import random
import re
import socket
from dataclasses import dataclass

from ftrun.errors import UsageError


@dataclass(frozen=True)
class PortRange:
    """Ports ``low``..``high``, both included."""

    low: int
    high: int

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"

    def __contains__(self, port: int) -> bool:
        return self.low <= port <= self.high


def parse_port_range(text: object) -> PortRange | None:
    """``LO-HI`` (or one port); None for "" (any free port)."""
    value = "" if text is None or isinstance(text, bool) else str(text).strip()
    if not value:
        return None
    match = re.fullmatch(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?", value)
    if match is None:
        raise UsageError(f"--worker-port-range must be LO-HI (30000-30099), got '{text}'")
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if not 0 < low <= high < 65536:
        raise UsageError(f"--worker-port-range needs 1 <= LO <= HI <= 65535, got '{text}'")
    return PortRange(low, high)


def listen_in_range(address: str, ports: PortRange | None, backlog: int) -> socket.socket:
    """A socket listening on ``address`` at a free port of ``ports`` (any free port when None).
    Raises OSError(EADDRINUSE) when every port of the range is taken."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    candidates = [0] if ports is None else list(range(ports.low, ports.high + 1))
    if ports is not None:  # agents of one machine starting together should not all try the same port first
        start = random.randrange(len(candidates))
        candidates = candidates[start:] + candidates[:start]
    for port in candidates:
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(backlog)
            return listener
        except OSError as e:
            listener.close()
            if e.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"every port of --worker-port-range {ports} is taken")


def free_port(ports: PortRange | None, address: str = "127.0.0.1") -> int:
    """A port free now on ``address`` (in ``ports`` when given), for a store started a moment later."""
    try:
        with listen_in_range(address, ports, 1) as probe:
            return probe.getsockname()[1]
    except OSError as e:
        raise UsageError(f"no free port on {address}: {e.strerror or e}") from None
