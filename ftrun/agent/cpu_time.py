"""The CPU time each local rank uses, read from outside: the outside view of a rank that does not use the worker
library (``ftrun.detection.stragglers.assess_cpu`` scores it).

A rank runs in a process group of its own (the agent starts it in a new session; a forked rank calls setsid),
so its DataLoader workers and other children share its group: :func:`group_cpu_seconds` reads every process's
``/proc/PID/stat`` once and sums, per rank, the user and system time (its threads included) of the processes in
its group, with the time of children they have reaped (a DataLoader worker that ended is counted by its parent).
One scan of ``/proc`` for the whole node every CPU_SAMPLE_EVERY seconds, which reads only the processes numbered
from the oldest rank's pid on (a rank's children are younger than it; the system's daemons, older, are skipped),
until the kernel's pids wrap round: once the newest pid the kernel gave (``/proc/loadavg``'s last field) is below
the oldest rank's, a child may be numbered below its rank, and every process is read from then on.

:class:`CpuShare` keeps each rank's samples over CPU_WINDOW seconds and says its CPU seconds per wall second
(``1.0``: one core busy all the time; a rank with threads can pass it). It says nothing of a rank's accelerator:
a rank slow on its chip may use the same CPU as the others (the docs say so).
"""

from __future__ import annotations

import collections
import os

#: the seconds of samples a rank's share is taken over, and the least of them it is said over
CPU_WINDOW, CPU_WINDOW_MIN = 10.0, 4.0
#: the least seconds between two samples (the keepalive comes every half second)
CPU_SAMPLE_EVERY = 2.0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_fields(text: str) -> tuple[int, float] | None:
    """(process group, CPU seconds: user, system and reaped children's) from a ``/proc/PID/stat`` line, or None.
    The command name (field 2) is in parentheses and may hold spaces and parentheses: the fields follow its last
    ``)``."""
    _, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 15:
        return None
    try:
        # after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
        pgrp = int(fields[2])
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    except ValueError:
        return None
    return pgrp, ticks / _TICKS


def newest_pid(proc: str = "/proc") -> int | None:
    """The pid the kernel gave last (the last field of ``/proc/loadavg``), or None where it cannot be read."""
    try:
        with open(f"{proc}/loadavg") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def group_cpu_seconds(groups: set[int], everything: bool = False, proc: str = "/proc") -> dict[int, float]:
    """For each process group in ``groups`` (a rank's pid), the CPU seconds its live processes have used, with
    their reaped children's; a group none of whose processes is left is absent. Only the processes numbered from
    the oldest group's on are read, unless ``everything`` (the pids wrapped round since)."""
    totals: dict[int, float] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return totals
    oldest = 0 if everything else min(groups, default=0)
    for name in names:
        if not name.isdigit() or int(name) < oldest:
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                read = stat_fields(f.read())
        except OSError:  # it ended meanwhile, or is not ours to read
            continue
        if read is not None and read[0] in groups:
            totals[read[0]] = totals.get(read[0], 0.0) + read[1]
    return totals


class CpuShare:
    """Each rank's CPU seconds per wall second over its last CPU_WINDOW seconds of samples (fed by the agent
    at its keepalive, with its clock): None until its samples span CPU_WINDOW_MIN seconds. A rank's samples
    start afresh when its process changes (a replacement)."""

    def __init__(self, read=group_cpu_seconds, every: float = CPU_SAMPLE_EVERY, newest=newest_pid):
        self._read, self._newest = read, newest
        self._every = every
        self._next = 0.0
        #: the kernel's pids wrapped round since the oldest rank started: every process is read from then on
        self._wrapped = False
        #: rank -> (pid, its samples: (time, CPU seconds))
        self._samples: dict[int, tuple[int, collections.deque[tuple[float, float]]]] = {}

    def sample(self, pids: dict[int, int], now: float) -> None:
        """``pids``: each running rank's process; sampled at most every ``every`` seconds."""
        if now < self._next:
            return
        self._next = now + self._every
        if pids and not self._wrapped:
            newest = self._newest()
            self._wrapped = newest is None or newest < min(pids.values())
        used = self._read(set(pids.values()), self._wrapped) if pids else {}
        for rank in list(self._samples):
            if rank not in pids:
                del self._samples[rank]
        for rank, pid in pids.items():
            if pid not in used:
                self._samples.pop(rank, None)
                continue
            held = self._samples.get(rank)
            if held is None or held[0] != pid:
                held = self._samples[rank] = (pid, collections.deque())
            samples = held[1]
            samples.append((now, used[pid]))
            while len(samples) > 2 and now - samples[1][0] >= CPU_WINDOW:
                samples.popleft()

    def share(self, rank: int) -> float | None:
        """The rank's CPU seconds per second over its window (None: not yet a window's worth of samples)."""
        held = self._samples.get(rank)
        if held is None:
            return None
        (t0, c0), (t1, c1) = held[1][0], held[1][-1]
        if t1 - t0 < CPU_WINDOW_MIN:
            return None
        return round(max(0.0, c1 - c0) / (t1 - t0), 3)
