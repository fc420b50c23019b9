"""A rank's step times as its heartbeat carries them: how long its steps take, split into compute (outside the
collectives) and wait (blocked inside them).

In a synchronous job every rank's step takes as long as the slowest rank's: the step time alone names no
one. What tells the straggler is where the time goes: the slow rank computes longer and waits less, since
every other rank waits for it inside the collectives. The worker library times each committed step
(``StepClock``) and its heartbeat writes the medians of the last ``WINDOW_STEPS`` steps as one short text
(:class:`StepTimes`); the agent forwards it with the node's status, and the controller scores the ranks
against each other (``ftrun.detection.stragglers``). A median over a window of steps, not one step: a
garbage collection, a snapshot or a descheduled process makes one step slow, and that is not a straggler.

The heartbeat also carries the collective the rank waits in right now (:class:`CollectiveWait`: its name, its
group and since when), set by the worker library when a wait begins and cleared when it ends, so that a job
that stands still is said as which ranks wait in which collective (``ftrun.controller.links``).

It depends on nothing but the standard library, so that the worker libraries (``ftrun.elastic``,
``ftrun.mindspore_elastic``) and the launcher share it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
import threading
import time
from typing import Callable

#: the steps each rank's medians are taken over
WINDOW_STEPS = 16


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One rank's recent steps: ``steps`` timed since it started (a replacement starts from 0), and the medians
    over its last WINDOW_STEPS of its step time, its compute time (the step less its waits) and its wait
    inside collectives, in seconds; ``pid``: the process that timed them (the rank's key outlives it: a
    replaced process's last heartbeat may land after its replacement's first)."""

    steps: int = 0
    step: float = 0.0
    compute: float = 0.0
    wait: float = 0.0
    pid: int = 0

    def to_text(self) -> str:
        return f"{self.steps} {self.step:.4f} {self.compute:.4f} {self.wait:.4f} {self.pid}"

    @classmethod
    def from_text(cls, text: str) -> "StepTimes | None":
        """The times a heartbeat wrote, or None (nothing written yet, or not ours)."""
        parts = text.split()
        if len(parts) != 5:
            return None
        try:
            steps, pid = int(parts[0]), int(parts[4])
            step, compute, wait = float(parts[1]), float(parts[2]), float(parts[3])
        except ValueError:
            return None
        if steps < 0 or pid < 0 or min(step, compute, wait) < 0:
            return None
        return cls(steps, step, compute, wait, pid)


class StepClock:
    """The rank's side: each committed step's time and its waits go in (from the training thread), the
    window's medians come out (from the heartbeat's). ``begin``/``end`` time a step's body on ``now`` (a
    monotonic clock in seconds; tests give their own); ``record`` takes a step timed elsewhere."""

    def __init__(self, window: int = WINDOW_STEPS, now: Callable[[], float] = time.perf_counter):
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._steps = 0
        self._lock = threading.Lock()
        self._now = now
        #: when the step under way began; None between steps (a step that ends without a beginning is not timed)
        self._began: float | None = None

    def begin(self) -> None:
        """A step's body begins (again: the latest beginning counts)."""
        self._began = self._now()

    def end(self, wait_seconds: float = 0.0, committed: bool = True) -> None:
        """The step's body ended, ``wait_seconds`` of it inside collectives: timed when it was ``committed``
        (a step whose collective failed is repaired, not timed) and had begun."""
        began, self._began = self._began, None
        if committed and began is not None:
            self.record(self._now() - began, wait_seconds)

    def record(self, step_seconds: float, wait_seconds: float) -> None:
        """A committed step took ``step_seconds``, ``wait_seconds`` of it blocked inside collectives."""
        wait = min(max(wait_seconds, 0.0), max(step_seconds, 0.0))
        with self._lock:
            self._recent.append((max(step_seconds, 0.0), wait))
            self._steps += 1

    def times(self) -> StepTimes:
        with self._lock:
            recent, steps = list(self._recent), self._steps
        if not recent:
            return StepTimes(pid=os.getpid())
        return StepTimes(steps, statistics.median(s for s, _ in recent), statistics.median(s - w for s, w in recent),
                         statistics.median(w for _, w in recent), os.getpid())



@dataclasses.dataclass(frozen=True)
class CollectiveWait:
    """The collective a rank waits in now: its name as torch.distributed calls it (``all_reduce``), the name of
    its group (torch's) and how many ranks that group has, since when (``time.time()`` on the rank's host)."""

    op: str
    group: str
    group_size: int
    since: float


def collective_text(wait: CollectiveWait | None, pid: int) -> str:
    """What the heartbeat writes: the process that writes it (as in StepTimes: a replaced process's last
    heartbeat may land after its replacement's first), then its wait, or ``-`` while it waits in none."""
    if wait is None:
        return f"{pid} -"
    return f"{pid} {wait.since:.3f} {wait.group_size} {wait.op} {wait.group}"


def read_collective(text: str) -> tuple[int, CollectiveWait | None] | None:
    """(pid, the wait or None while it waits in none) as a heartbeat wrote it; None where nothing readable
    was written (no heartbeat yet, or a script without the worker library)."""
    parts = text.split(maxsplit=4)
    try:
        pid = int(parts[0]) if parts else -1
        if pid < 0:
            return None
        if parts[1:] == ["-"]:
            return pid, None
        if len(parts) != 5:
            return None
        since, size = float(parts[1]), int(parts[2])
    except ValueError:
        return None
    if size < 1 or since < 0:
        return None
    return pid, CollectiveWait(parts[3], parts[4], size, since)
