"""``--preflight``'s bandwidth check between nodes on the data network: pairs of nodes in rounds, and the verdict.

Before the first step every agent listens on its data address (the collectives' interface, as
``reach.py`` finds it). Once the rendezvous has every node, the controller hands each agent its turns of a
round-robin schedule (:func:`schedule`: each node in at most one pair per round, N-1 rounds for N nodes, at
most MAX_ROUNDS): in each turn one side of the pair sends PAIR_BYTES to the other and takes as many back,
within PAIR_DEADLINE (a slower transfer is measured by what moved). The two sides of a pair meet: the
side that listens answers only once it has finished its previous round, so no node serves two transfers
at once. :func:`judge_pairs` (pure) names a node whose best pair is past twice the median node's, or one
that cannot reach a peer; ``preflight.judge_preflight`` leaves it out for a spare, or refuses the job.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import struct
import threading
import time
from typing import Mapping

from ftrun.detection.reach import data_listener, wake_and_close

log = logging.getLogger(__name__)

#: bytes each pair moves each way, and seconds a pair's transfer may take (a slower one is timed by what moved)
PAIR_BYTES, PAIR_DEADLINE = 4 << 20, 2.0
#: a large job meets at most this many peers per node: the check's time stops growing past 8 nodes
MAX_ROUNDS = 8
#: seconds a connect may take; the longest a round can last (the transfer and the meeting of the two sides);
#: the agents read their turns at different times (the rendezvous's poll), which START_SLACK covers
CONNECT_TIMEOUT, ROUND_BOUND, START_SLACK = 1.0, PAIR_DEADLINE + 1.0, 2.0
#: a node past this many times the median node's best pair time, and at least MIN_EXCESS seconds past it, is
#: slow: at PAIR_BYTES a fast link's pair takes milliseconds, where a loaded host's jitter alone can double it
SLOW_FACTOR, MIN_EXCESS = 2.0, 0.05
_HEADER = struct.Struct("!IQ")  # round, bytes each way
_CHUNK = 1 << 16
_GO, _ACK = b"G", b"A"


def schedule(count: int, rounds: int = MAX_ROUNDS) -> list[list[tuple[int, int]]]:
    """The pairs of ``count`` nodes (by index) round by round, the circle method: node 0 stays, the others
    turn one place a round, so N-1 rounds (N even; N with a bye each round when odd) meet every pair once and
    no node is in two pairs of a round. At most ``rounds`` rounds: each node then meets ``rounds`` peers."""
    if count < 2:
        return []
    size = count + count % 2  # index ``count`` is the bye
    ring = list(range(size))
    out = []
    for _ in range(min(size - 1, rounds)):
        pairs = [(min(a, b), max(a, b)) for a, b in zip(ring[:size // 2], reversed(ring[size // 2:])) if max(a, b) < count]
        out.append(sorted(pairs))
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


@dataclasses.dataclass(frozen=True)
class PairTurn:
    """One round of an agent's part: the peer (agent id, its listener's "HOST:PORT"), and whether this agent
    starts the transfer (``client``) or answers it."""

    round: int
    peer: str
    endpoint: str
    client: bool


@dataclasses.dataclass(frozen=True)
class PairPlan:
    """An agent's turns, round by round (the controller writes one per agent)."""

    turns: tuple[PairTurn, ...] = ()


@dataclasses.dataclass(frozen=True)
class PairTime:
    """A pair's transfer, as one side saw it: seconds for PAIR_BYTES each way; below 0, ``a`` did not reach
    ``b`` (no connect, no answer, or nothing moved)."""

    a: str
    b: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class PairReport:
    """What an agent measured of its turns."""

    times: tuple[PairTime, ...] = ()


def plans(endpoints: Mapping[str, str], rounds: int = MAX_ROUNDS) -> dict[str, PairPlan]:
    """Each agent's turns (by agent id, in the order given), from their listeners' endpoints."""
    agents = list(endpoints)
    turns: dict[str, list[PairTurn]] = {agent: [] for agent in agents}
    for number, pairs in enumerate(schedule(len(agents), rounds)):
        for a, b in pairs:
            first, second = agents[a], agents[b]
            turns[first].append(PairTurn(number, second, endpoints[second], True))
            turns[second].append(PairTurn(number, first, endpoints[first], False))
    return {agent: PairPlan(tuple(mine)) for agent, mine in turns.items()}


def check_bound(rounds: int) -> float:
    """Seconds the whole check may take once every agent has its plan."""
    return rounds * ROUND_BOUND + START_SLACK


def judge_pairs(times: list[PairTime], hosts: Mapping[str, str], nbytes: int = PAIR_BYTES,
                factor: float = SLOW_FACTOR, excess: float = MIN_EXCESS) -> list[tuple[str, str]]:
    """The findings, (agent id, line): the nodes that cannot reach a peer (fewest that cover every pair that
    failed: the node in most of them first; of two, the one named later in ``hosts``, which lists the store's
    host first), then among the rest each node whose best pair takes more than ``factor`` times the median
    node's best, and ``excess`` seconds more (the lower median; a node measured in no pair is not judged).
    Two nodes alone are one pair: which of them is slow, nothing here can say, and neither is named slow."""
    order = {agent: i for i, agent in enumerate(hosts)}
    reached = {frozenset((t.a, t.b)) for t in times if t.seconds > 0}  # by either side: the pair is fine
    failed = {tuple(sorted((t.a, t.b), key=lambda x: order.get(x, len(order)))) for t in times
              if t.seconds < 0 and frozenset((t.a, t.b)) not in reached}
    findings: list[tuple[str, str]] = []
    while failed:
        count: dict[str, int] = {}
        for pair in failed:
            for agent in pair:
                count[agent] = count.get(agent, 0) + 1
        worst = max(count, key=lambda agent: (count[agent], order.get(agent, len(order))))
        peers = sorted({b if a == worst else a for a, b in failed if worst in (a, b)}, key=lambda x: order.get(x, 0))
        findings.append((worst, f"{hosts.get(worst, worst)}: cannot reach {', '.join(hosts.get(p, p) for p in peers)} "
                                f"on the data network"))
        failed = {pair for pair in failed if worst not in pair}
    gone = {agent for agent, _ in findings}
    best: dict[str, float] = {}
    for t in times:
        if t.seconds > 0 and t.a not in gone and t.b not in gone:
            for agent in (t.a, t.b):
                best[agent] = min(best.get(agent, t.seconds), t.seconds)
    if len(best) < 3:
        return findings
    median = statistics.median_low(best.values())
    for agent in sorted(best, key=lambda x: order.get(x, len(order))):
        if best[agent] > factor * median and best[agent] - median >= excess:
            findings.append((agent, f"{hosts.get(agent, agent)}: its best pair on the data network moves "
                                    f"{_rate(nbytes, best[agent])}, {best[agent] / median:.1f}x slower than the median "
                                    f"{_rate(nbytes, median)}"))
    return findings


def _rate(nbytes: int, seconds: float) -> str:
    return f"{2 * nbytes / seconds / 1e6:.1f} MB/s"


class PairCheck:
    """This agent's side: a listener on its data address (started before the join: its endpoint goes in the
    join record), and :meth:`run`, which takes the agent's turns."""

    def __init__(self, address: str, nbytes: int = PAIR_BYTES, deadline: float = PAIR_DEADLINE):
        self.nbytes, self.deadline = nbytes, deadline
        #: where the peers reach this node's listener
        self._listener, self.endpoint = data_listener(address, 16, 0.5)
        self._round = -1  # the round this agent is in (-1: no plan yet); a peer's transfer waits for its own
        self._served: set[int] = set()
        self._changed = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="ftrun-pairs-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        with self._changed:
            self._round = 1 << 30
            self._changed.notify_all()
        wake_and_close(self._listener, [self._thread], 2.0)

    def run(self, me: str, plan: PairPlan) -> PairReport:
        """Take this agent's turns in order; each ends by its round's bound (ROUND_BOUND a round, from now)."""
        began = time.monotonic()
        times = []
        for turn in sorted(plan.turns, key=lambda t: t.round):
            bound = began + (turn.round + 1) * ROUND_BOUND + START_SLACK
            with self._changed:
                self._round = turn.round
                self._changed.notify_all()
            if turn.client:
                seconds = self._transfer(turn, bound)
            else:
                with self._changed:
                    self._changed.wait_for(lambda: turn.round in self._served, max(0.0, bound - time.monotonic()))
                    seconds = 0.0 if turn.round in self._served else -1.0  # the client times it
            if seconds:
                times.append(PairTime(me, turn.peer, seconds))
            log.info("preflight: round %d, the pair with %s: %s", turn.round, turn.peer,
                     f"{seconds * 1000:.1f} ms" if seconds > 0 else "timed there" if seconds == 0 else "not reached")
        with self._changed:
            self._round = 1 << 30  # a late peer is turned away
            self._changed.notify_all()
        return PairReport(tuple(times))

    # -- the listening side ------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue  # the accept's own timeout, or the listener shut at the close
            threading.Thread(target=self._answer, args=(connection,), name="ftrun-pairs-answer", daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.settimeout(self.deadline + ROUND_BOUND)
                number, nbytes = _HEADER.unpack(_receive_exactly(connection, _HEADER.size))
                if nbytes > self.nbytes:
                    return
                with self._changed:
                    self._changed.wait_for(lambda: self._round >= number, MAX_ROUNDS * ROUND_BOUND + START_SLACK)
                    if self._round != number:
                        return  # not this agent's round (a peer late past its bound, or none of its turns)
                connection.sendall(_GO)
                _drain(connection, nbytes)
                connection.sendall(_ACK)
                _pour(connection, nbytes, time.monotonic() + self.deadline)
                with self._changed:
                    self._served.add(number)
                    self._changed.notify_all()
            except (OSError, struct.error):
                return

    # -- the starting side -------------------------------------------------------------------------------

    def _transfer(self, turn: PairTurn, bound: float) -> float:
        """Seconds for ``nbytes`` there and back (extrapolated from what moved when the deadline ends it),
        or -1 when the peer was not reached."""
        host, _, port = turn.endpoint.rpartition(":")
        try:
            connection = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
        except (OSError, ValueError):
            return -1.0
        moved, began = 0, 0.0
        with connection:
            try:
                connection.sendall(_HEADER.pack(turn.round, self.nbytes))
                connection.settimeout(max(0.1, bound - time.monotonic()))
                if _receive_exactly(connection, 1) != _GO:
                    return -1.0
                began = time.monotonic()
                until = began + self.deadline
                moved = _pour(connection, self.nbytes, until)
                if moved == self.nbytes and _receive_exactly(connection, 1, until) == _ACK:
                    moved += _drain(connection, self.nbytes, until)
            except (OSError, ConnectionError):
                pass
        if not began or not moved:
            return -1.0
        return (time.monotonic() - began) * 2 * self.nbytes / moved


def _pour(connection: socket.socket, nbytes: int, until: float = 0.0) -> int:
    """Send ``nbytes`` (fewer when ``until`` passes); what was sent."""
    block = memoryview(bytes(_CHUNK))
    sent = 0
    try:
        while sent < nbytes:
            if until:
                left = until - time.monotonic()
                if left <= 0:
                    break
                connection.settimeout(left)
            sent += connection.send(block[:min(_CHUNK, nbytes - sent)])
    except (TimeoutError, socket.timeout):
        pass
    return sent


def _drain(connection: socket.socket, nbytes: int, until: float = 0.0) -> int:
    """Receive ``nbytes`` (fewer when ``until`` passes or the peer closes); what came."""
    buffer = bytearray(_CHUNK)
    got = 0
    try:
        while got < nbytes:
            if until:
                left = until - time.monotonic()
                if left <= 0:
                    break
                connection.settimeout(left)
            count = connection.recv_into(buffer, min(_CHUNK, nbytes - got))
            if not count:
                break
            got += count
    except (TimeoutError, socket.timeout):
        pass
    return got


def _receive_exactly(connection: socket.socket, size: int, until: float = 0.0) -> bytes:
    if until:
        connection.settimeout(max(0.01, until - time.monotonic()))
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
