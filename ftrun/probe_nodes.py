"""``ftrun probe --nnodes N --rdzv-endpoint HOST:PORT``: the preflight across the job's nodes, and nothing started.

Each node runs the command as it would run the launch: the first to bind the endpoint's port on HOST hosts the
store, every node joins the same rendezvous as a job's (``ftrun.rendezvous``: the join records, the data
network's pairs in rounds, the verdict with no spare), and leaves once it is decided. The host's node
learns every node's matmul times and the pairs' times (``gather``'s ``measured``), and keeps the store up
until each node has read the outcome.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass, field

from ftrun.contract import Endpoint
from ftrun.detection.links import data_interfaces
from ftrun.detection.pairs import PairCheck, PairTime
from ftrun.detection.reach import interface_address
from ftrun.errors import FtrunError
from ftrun.keys import JobKeys
from ftrun.messages import JoinRecord
from ftrun.rendezvous import RendezvousPolicy, gather, join, linger_for_readers
from ftrun.store import open_control_store

log = logging.getLogger(__name__)
#: how long the store's host waits for every node to read the outcome
LINGER = 10.0


@dataclass
class NodesProbe:
    """What the probe across nodes found: every node's join record and the pairs (on the store's host only;
    elsewhere empty), the findings, one line each ("" none), and whether this node hosted the store."""

    nodes: list[JoinRecord] = field(default_factory=list)
    pairs: tuple[PairTime, ...] = ()
    findings: list[str] = field(default_factory=list)
    hosted: bool = False
    #: the exit status that goes with the findings (ExitCode.DEVICE for the preflight's, RENDEZVOUS for a
    #: rendezvous that failed)
    exit_code: int = 0


def probe_nodes(endpoint: Endpoint, count: int, run_id: str, problem: str, matmul: list[float],
                timeout: float, is_host: bool | None = None) -> NodesProbe:
    """This node's part: join the probe's rendezvous at ``endpoint`` with its device ``problem`` ("" none)
    and its devices' ``matmul`` times, take its turns in the pairs, and return what it learnt. ``is_host``:
    whether this node hosts the store (None: the first to bind the endpoint's port here does)."""
    host = socket.gethostname()
    store = open_control_store(endpoint, is_host, timeout)
    keys = JobKeys(run_id)
    agent_id = f"{host}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    found = NodesProbe(hosted=store.is_host)
    stop = threading.Event()
    controller = None
    if store.is_host:
        def measured(joins: list[JoinRecord], pairs: tuple[PairTime, ...]) -> None:
            found.nodes, found.pairs = list(joins), pairs

        policy = RendezvousPolicy(count, count, timeout, timeout)
        controller = threading.Thread(target=gather, args=(store, keys, policy, agent_id, stop, measured),
                                      name="ftrun-probe-rendezvous", daemon=True)
        controller.start()
    address = next(filter(None, (interface_address(name) for name in data_interfaces(os.environ))), "")
    address = address or _address(host)
    check = PairCheck(address) if address else None
    name = f"{host} ({address})" if address else host  # hosts may share a name (containers, namespaces)
    record = JoinRecord(agent_id, name, os.getpid(), 1, -1, f"{name}: {problem}" if problem else "", "", (),
                        max(matmul, default=0.0), check.endpoint if check is not None else "", tuple(matmul))
    try:
        join(store, keys, record, timeout, stop, pair_check=check)
    except FtrunError as e:
        found.findings = [line.strip() for line in e.message.removeprefix("preflight failed:").split("; ")]
        found.exit_code = int(e.exit_code)
    finally:
        if check is not None:
            check.close()
        stop.set()
        if controller is not None:
            controller.join(timeout)
            linger_for_readers(store, keys, LINGER)
    return found


def _address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""
