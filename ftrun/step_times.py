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
that stands still is said as which ranks wait in which collective (``ftrun.controller.links``); and the
checkpoint save it makes right now (:class:`SaveClock`: since when), with the longest save it has measured
(in :class:`StepTimes`). A rank that writes a checkpoint for 30 s between two steps holds every other rank in
the next collective that long: the job stands still, yet nothing is wrong, and the controller gives a save
its own bound, from the job's measured saves.

It depends on nothing but the standard library, so that the worker libraries (``ftrun.elastic``,
``ftrun.mindspore_elastic``) and the launcher share it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import statistics
import threading
import time
from typing import Callable, Iterator, NamedTuple

#: the steps each rank's medians are taken over
WINDOW_STEPS = 16


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One rank's recent steps: ``steps`` timed since it started (a replacement starts from 0), and the medians
    over its last WINDOW_STEPS of its step time, its compute time (the step less its waits) and its wait
    inside collectives, in seconds; ``pid``: the process that timed them (the rank's key outlives it: a
    replaced process's last heartbeat may land after its replacement's first); ``save``: the longest
    checkpoint save this process measured (:class:`SaveClock`), 0 before its first."""

    steps: int = 0
    step: float = 0.0
    compute: float = 0.0
    wait: float = 0.0
    pid: int = 0
    save: float = 0.0

    def to_text(self) -> str:
        return f"{self.steps} {self.step:.4f} {self.compute:.4f} {self.wait:.4f} {self.pid} {self.save:.4f}"

    @classmethod
    def from_text(cls, text: str) -> "StepTimes | None":
        """The times a heartbeat wrote, or None (nothing written yet, or not ours). Five figures, without the
        save, are what a worker library older than the saves' wrote."""
        parts = text.split()
        if len(parts) not in (5, 6):
            return None
        try:
            steps, pid = int(parts[0]), int(parts[4])
            step, compute, wait = float(parts[1]), float(parts[2]), float(parts[3])
            save = float(parts[5]) if len(parts) == 6 else 0.0
        except ValueError:
            return None
        if steps < 0 or pid < 0 or min(step, compute, wait, save) < 0:
            return None
        return cls(steps, step, compute, wait, pid, save)


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


class SaveClock:
    """The rank's side of its checkpoint saves: since when the save under way began (the heartbeat writes it),
    and the longest one measured. Only the training thread's saves count (the thread that made the clock: the
    script's, which joins the job): a save written in the background (``torch.distributed.checkpoint``'s
    ``async_save`` writes on a thread of its own while the rank trains on) holds no other rank. A save inside
    another (``torch.save`` called by a framework's checkpointing, or by ``torch.distributed.checkpoint``)
    is part of it: measured once, as the outermost."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time):
        self._clock, self._wall = clock, wall
        self._thread = threading.get_ident()
        self._depth = 0
        self._began = 0.0
        #: when the save under way began (``time.time()``, as a collective's wait says it); None while none
        self.since: float | None = None
        #: the longest save measured, in seconds (0: none yet)
        self.longest = 0.0

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: counted while it runs, measured as it ends (raised or not)."""
        if threading.get_ident() != self._thread:
            yield
            return
        self._depth += 1
        if self._depth == 1:
            self._began, self.since = self._clock(), self._wall()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.longest = max(self.longest, self._clock() - self._began)
                self.since = None


@dataclasses.dataclass(frozen=True)
class CollectiveWait:
    """The collective a rank waits in now: its name as torch.distributed calls it (``all_reduce``), the name of
    its group (torch's) and how many ranks that group has, since when (``time.time()`` on the rank's host)."""

    op: str
    group: str
    group_size: int
    since: float


class Standing(NamedTuple):
    """Where a rank stands, as its heartbeat wrote it: the process that wrote it, the collective it waits in
    (None: none), and since when it saves a checkpoint (``time.time()`` on its host; None: it saves none)."""

    pid: int
    wait: CollectiveWait | None
    saving: float | None = None


#: the word that opens a save in a heartbeat's text (a wait's first figure is a time, never this)
SAVE_WORD = "save"


def collective_text(wait: CollectiveWait | None, pid: int, saving: float | None = None) -> str:
    """What the heartbeat writes: the process that writes it (as in StepTimes: a replaced process's last
    heartbeat may land after its replacement's first), ``save SINCE`` while it saves a checkpoint, then its
    wait, or ``-`` while it waits in none (a save may wait in collectives: torch.distributed.checkpoint's)."""
    save = f" {SAVE_WORD} {saving:.3f}" if saving is not None else ""
    if wait is None:
        return f"{pid}{save} -"
    return f"{pid}{save} {wait.since:.3f} {wait.group_size} {wait.op} {wait.group}"


def read_collective(text: str) -> Standing | None:
    """Where the rank stands as a heartbeat wrote it; None where nothing readable was written (no heartbeat
    yet, or a script without the worker library)."""
    pid_text, _, rest = text.strip().partition(" ")
    saving = None
    try:
        pid = int(pid_text)
        if rest.startswith(f"{SAVE_WORD} "):
            since_text, _, rest = rest[len(SAVE_WORD):].strip().partition(" ")
            saving = float(since_text)
        words = rest.split(maxsplit=3)
        if pid < 0 or (saving is not None and saving < 0):
            return None
        if words == ["-"]:
            return Standing(pid, None, saving)
        if len(words) != 4:
            return None
        since, size = float(words[0]), int(words[1])
    except ValueError:
        return None
    if size < 1 or since < 0:
        return None
    return Standing(pid, CollectiveWait(words[2], words[3], size, since), saving)
