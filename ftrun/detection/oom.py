"""Evidence that the kernel's OOM killer ended a worker, from the agent's memory cgroup or dmesg."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from typing import Sequence

from ftrun.detection.exits import shorten

log = logging.getLogger(__name__)


class OomWatch:
    """Evidence that the kernel's OOM killer ended a worker.

    Reads the ``oom_kill`` counter of the agent's memory cgroup (v2
    ``memory.events``, v1 ``memory.oom_control``), which counts the workers
    too, against a baseline taken when the watch is made; each kill it counted
    explains one worker. Where there is no counter it asks ``dmesg`` for the pid
    (often not permitted; then there is no evidence). Never raises.
    """

    def __init__(
        self,
        proc_cgroup: str = "/proc/self/cgroup",
        cgroup_root: str = "/sys/fs/cgroup",
        dmesg: Sequence[str] | None = ("dmesg",),
        dmesg_timeout: float = 2.0,
    ):
        self._dmesg = tuple(dmesg) if dmesg else None
        self._dmesg_timeout = dmesg_timeout
        self._counter_file = None
        self._baseline = None
        self._explained = 0
        try:
            self._counter_file = _find_counter_file(proc_cgroup, cgroup_root)
            self._baseline = _read_oom_kill(self._counter_file) if self._counter_file else None
        except Exception as e:  # never let a strange /proc or /sys stop the agent
            log.debug("no OOM counter: %s", e)
            self._counter_file = None

    @property
    def counter_file(self) -> str | None:
        """The cgroup file read for the counter, or None when there is none."""
        return self._counter_file

    def killed_by_oom(self, pid: int) -> str:
        """Why we believe the OOM killer took ``pid``, or "" when there is no sign of it."""
        try:
            if self._counter_file is not None and self._baseline is not None:
                now = _read_oom_kill(self._counter_file)
                if now is not None and now - self._baseline > self._explained:
                    self._explained += 1
                    name = os.path.basename(self._counter_file)
                    return f"cgroup {name} oom_kill rose from {self._baseline} to {now}"
            return self._from_dmesg(pid)
        except Exception as e:
            log.debug("OOM evidence for pid %d unavailable: %s", pid, e)
            return ""

    def _from_dmesg(self, pid: int) -> str:
        if self._dmesg is None:
            return ""
        try:
            proc = subprocess.run(self._dmesg, capture_output=True, timeout=self._dmesg_timeout,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.debug("dmesg unavailable: %s", e)
            self._dmesg = None  # it will not get better; save the next worker's wait
            return ""
        if proc.returncode != 0:
            self._dmesg = None  # usually "Operation not permitted"
            return ""
        killed = re.compile(rf"Killed process {pid}\b")
        for line in reversed(proc.stdout.decode("utf-8", "replace").splitlines()):
            if killed.search(line):
                return f"dmesg: {shorten(line.strip())}"
        return ""


def _find_counter_file(proc_cgroup: str, cgroup_root: str) -> str | None:
    """The first readable OOM counter of this process's memory cgroup (v2, then v1)."""
    with open(proc_cgroup, encoding="utf-8", errors="replace") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    candidates = []
    for hierarchy, controllers, path in entries:
        path = path.lstrip("/")
        if hierarchy == "0" and controllers == "":
            # inside a cgroup namespace the agent's own cgroup is mounted at the root
            candidates += [os.path.join(cgroup_root, path, "memory.events"), os.path.join(cgroup_root, "memory.events")]
        elif "memory" in controllers.split(","):
            candidates += [os.path.join(cgroup_root, "memory", path, "memory.oom_control"),
                           os.path.join(cgroup_root, "memory", "memory.oom_control")]
    return next((c for c in candidates if _read_oom_kill(c) is not None), None)


def _read_oom_kill(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None
