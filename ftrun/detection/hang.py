"""Hang detection: which of the node's ranks stopped showing signs of life; a health source.

Pure, with the clock passed in: the agent hands it what it read of each running rank at a keepalive
(``RankSigns``). Two kinds of evidence, per rank:

* a rank under ``ftrun.elastic`` beats a counter in the store once a second from a
  thread of its own; no beat for ``heartbeat_timeout`` seconds means the process is
  frozen (SIGSTOP, a stuck interpreter, a stalled machine). Until its first beat
  (torch still importing, the group still forming) it is not judged by heartbeats.
* any other rank, only with ``--hang-timeout``: no output line and no CPU time
  for that long. Every rank of a job stalls when one does (the others wait for it in
  a collective), so a rank that is merely asleep gets WAITER_GRACE more seconds
  than a stopped process (SIGSTOP, a debugger): the rank that froze is the one named,
  and the job-level restart its report starts reaches the others first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ftrun.detection.sources import HealthEvent, RankSigns

#: extra seconds of silence before a rank that is asleep (not stopped) counts as hung (--hang-timeout)
WAITER_GRACE = 1.5


@dataclass
class _Rank:
    #: the rank's heartbeat counter when this process took the rank (a replacement inherits it)
    baseline: int
    beats: int
    beat_at: float
    activity: tuple
    active_at: float


class HangWatch:
    """A health source over the ranks' signs of life: a rank it reports hung is forgotten, and judged
    again once a new process takes it (``restart``)."""

    name = "hang"

    def __init__(self, heartbeat_timeout: float, hang_timeout: float = 0.0):
        self.heartbeat_timeout = heartbeat_timeout
        #: 0: ranks without heartbeats are never judged
        self.hang_timeout = hang_timeout
        self._ranks: dict[int, _Rank] = {}

    def restart(self, rank: int, beats: int, now: float) -> None:
        """A new process took the rank: judge it from now on, against the counter's current value."""
        self._ranks[rank] = _Rank(beats, beats, now, (), now)

    def heartbeat_age(self, rank: int, now: float) -> float | None:
        """Seconds since the rank's heartbeat counter last moved (None: it never beat)."""
        seen = self._ranks.get(rank)
        return round(now - seen.beat_at, 1) if seen is not None and seen.beats else None

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def poll(self, now: float, ranks: Sequence[RankSigns] = ()) -> list[HealthEvent]:
        """The ranks among ``ranks`` that count as hung now, each once."""
        events = []
        for signs in ranks:
            reason = self.observe(signs.rank, signs.beats, signs.activity, now, signs.stopped)
            if reason:
                self.forget(signs.rank)
                events.append(HealthEvent(self.name, reason, rank=signs.rank))
        return events

    def observe(self, rank: int, beats: int, activity: tuple, now: float, stopped: bool = False) -> str:
        """Record what the rank shows now (``stopped``: its process is in the stopped state);
        the reason it counts as hung, or ""."""
        if rank not in self._ranks:
            self.restart(rank, beats, now)
        seen = self._ranks[rank]
        if beats != seen.beats:
            seen.beats, seen.beat_at = beats, now
        if activity != seen.activity:
            seen.activity, seen.active_at = activity, now
        if seen.beats > seen.baseline:  # it runs ftrun.elastic: its heartbeats decide
            quiet = now - seen.beat_at
            if quiet > self.heartbeat_timeout:
                return f"no heartbeat for {quiet:.1f}s (--heartbeat-timeout {self.heartbeat_timeout:g})"
            return ""
        quiet = now - seen.active_at
        if not self.hang_timeout or quiet <= self.hang_timeout + (0 if stopped else WAITER_GRACE):
            return ""
        how = "stopped, with " if stopped else ""
        return f"{how}no output and no CPU progress for {quiet:.1f}s (--hang-timeout {self.hang_timeout:g})"
