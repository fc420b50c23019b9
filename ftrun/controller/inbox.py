"""What the controller hears, as events, and the one inbox they all come through.

A fault reaches the controller several ways: an agent's report (the report stream), a rank's failed
collective or rollback (per-generation keys, written by a torch rank or a MindSpore rank's folder relay),
a node's silence, a person's request from ``ftrun top``, the hosting process (a head node's Ctrl-C, an
ssh session that ended). The observers (``observers.py``) turn each into an event; every event goes
through one :class:`Inbox`, in the order it came, and the policy (``policy.decide``) decides on each.

Each event carries what the decision needs (the spare that could take a node, the keepalive counts
when a collective failed), looked up where it was observed, so that deciding reads no store or roster.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Union

from ftrun.contract import CollectiveFailure, Milestone, RollbackFailure
from ftrun.controller.states import Heard
from ftrun.detection.stragglers import Finding
from ftrun.messages import NodeSlot, OperatorRequest, Report


@dataclass(frozen=True)
class Reported:
    """An agent's report (a worker's end, a stop, a node without devices), from the agent that holds its node."""

    report: Report


@dataclass(frozen=True)
class StopsAcknowledged:
    """During a job-level STOP: the nodes whose agents acknowledged it (signed) for ``generation``."""

    generation: int
    nodes: frozenset[int]


@dataclass(frozen=True)
class CollectiveFailed:
    """A rank said its collective failed in ``failure.generation``; seen at ``seen`` (the controller's
    monotonic clock), when every node's agent had sent ``heard`` keepalives."""

    failure: CollectiveFailure
    node_rank: int
    host: str
    seen: float
    heard: tuple[Heard, ...]


@dataclass(frozen=True)
class MilestoneReached:
    """Every rank a process-level phase waits for reached ``milestone`` (counted in the store)."""

    milestone: Milestone


@dataclass(frozen=True)
class RepairFailed:
    """The repair under way cannot finish: its deadline passed, or the ranks found no state to go back to
    (``fallback``)."""

    detail: str
    fallback: RollbackFailure | None = None


@dataclass(frozen=True)
class NodeLost:
    """A node's agent is gone (silent past --node-timeout, its ssh session ended, its devices unusable, or
    drained by a person); ``spare``: the idle spare agent that could take its place, or ""."""

    slot: NodeSlot
    detail: str
    spare: str = ""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(range(self.slot.first_rank, self.slot.first_rank + self.slot.nproc))


@dataclass(frozen=True)
class HostGone:
    """The hosting process knows the agent on ``host`` is gone (SSH mode: its session ended)."""

    host: str
    detail: str


@dataclass(frozen=True)
class LibraryRanks:
    """How many ranks of the running generation joined their group under ftrun.elastic."""

    count: int


@dataclass(frozen=True)
class ProcessLevelRefused:
    """The script's ranks say its layout rules process-level repair out, and why."""

    reason: str


@dataclass(frozen=True)
class OperatorAsked:
    """A person's request from ``ftrun top``: the node it concerns, the spare a drain would take, the rank's
    pid (a drill), when it came (wall clock), and why it is refused ("" when it is not)."""

    request: OperatorRequest
    slot: NodeSlot | None
    spare: str
    pid: int
    at: float
    refusal: str


@dataclass(frozen=True)
class StopAsked:
    """The job is to end: the user stopped it where the controller runs, or etcd was lost for too long."""

    exit_code: int
    reason: str


@dataclass(frozen=True)
class SpareIdle:
    """An idle spare and room for a node (a scale-in left one vacant, or the rendezvous had fewer than MAX)."""

    node_rank: int
    spare: NodeSlot


@dataclass(frozen=True)
class LinkBack:
    """A node's data link is back after it went dark while every process lived (``ftrun.controller.links``):
    the collectives that waited across it are to be given up and the groups re-formed (the online level).
    ``rank``: the node's first rank, whom the repair's record names."""

    node_rank: int
    host: str
    rank: int
    detail: str
    #: when the controller heard it was back (wall clock): the repair is timed from it
    at: float = 0.0


@dataclass(frozen=True)
class LinkLost:
    """A data link stayed dark past --repair-timeout with no spare for its node: the job ends."""

    detail: str


@dataclass(frozen=True)
class ReplacementsStarted:
    """The repair's REPLACE commands went out: its replacements start from now."""


@dataclass(frozen=True)
class ControllerMoved:
    """This controller took office from its predecessor's journal, with a repair under way."""


@dataclass(frozen=True)
class StragglerSeen:
    """The straggler watch named a rank (or cleared it). ``replace``: --stragglers replace; ``moved_before``: its
    ranks were moved to a spare for straggling once already; the node that holds it, the idle spare that could
    take its ranks, and why they stay ("" when they move) are the roster's, added as it is decided."""

    finding: Finding
    replace: bool
    moved_before: bool = False
    slot: NodeSlot | None = None
    spare: str = ""
    refusal: str = ""
    #: named from outside (a script without the worker library: its CPU share), which is only ever reported
    outside: bool = False


@dataclass(frozen=True)
class StragglerGain:
    """What moving a straggler's ranks gained: the job's median step time (seconds) before the slowdown
    (0: unknown), with the straggler, and after the move, once every rank timed a full window there."""

    node: int
    before: float
    slowed: float
    after: float


Event = Union[Reported, StopsAcknowledged, CollectiveFailed, MilestoneReached, RepairFailed, NodeLost, HostGone,
              LibraryRanks, ProcessLevelRefused, OperatorAsked, StopAsked, SpareIdle, ReplacementsStarted,
              ControllerMoved, LinkBack, LinkLost, StragglerSeen, StragglerGain]


class Inbox:
    """Every event, in the order it came: from the controller's own observers (its thread) and from the
    process that hosts it (any thread)."""

    def __init__(self) -> None:
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._events.put(event)

    def extend(self, events: list[Event]) -> None:
        for event in events:
            self._events.put(event)

    def take(self) -> Event | None:
        """The oldest event, or None when there is none."""
        try:
            return self._events.get_nowait()
        except queue.Empty:
            return None
