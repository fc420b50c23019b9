"""A MindSpore rank's line to its agent: its side of the node's :class:`~ftrun.contract.RelayFolder`
(``ftrun/elastic/link.py`` is a torch rank's, which reads the control store itself; a MindSpore python
has no torch, so no store client: ``ftrun/mindspore_elastic/repair.py`` says why files)."""

from __future__ import annotations

import os
import time
from typing import NoReturn

from ftrun.contract import CollectiveFailure, Milestone, RelayFolder, RollbackFailure

#: how often a rank's watch, and its waits, look at the relay folder (one os.stat)
WATCH_POLL = 0.02
#: how long a rank whose rollback fell back waits for its agent to stop it (the job-level restart)
FALLBACK_WAIT = 60.0


class RepairChannel:
    """The rank's side of its node's :class:`RelayFolder`: the generations announced, the milestones."""

    def __init__(self, folder: RelayFolder, rank: int):
        self.folder = folder
        self.rank = rank
        self._seen: tuple[int, int] = (0, 0)  # the target file's (mtime_ns, size) when last read
        self._target = 0

    def target(self) -> int:
        """The newest generation announced (0: none); the file is read only when it changed."""
        try:
            info = os.stat(self.folder.target)
        except FileNotFoundError:
            return self._target
        if (info.st_mtime_ns, info.st_size) != self._seen:
            self._seen = (info.st_mtime_ns, info.st_size)
            text = self.folder.read(self.folder.target).strip()
            self._target = max(self._target, int(text)) if text else self._target
        return self._target

    def await_target(self, above: int, timeout: float) -> int | None:
        """The first generation announced above ``above`` within ``timeout`` seconds, or None."""
        deadline = time.monotonic() + timeout
        while (target := self.target()) <= above:
            if time.monotonic() >= deadline:
                return None
            time.sleep(WATCH_POLL)
        return target

    def reach(self, generation: int, milestone: Milestone) -> None:
        self.folder.write(self.folder.reached(generation, self.rank, milestone.value), "")

    def group_ready(self, generation: int, timeout: float) -> bool:
        """Wait until every rank arrived in ``generation`` (True) or a newer one was announced (False);
        TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            said = self.folder.read(self.folder.ready(generation)).strip()
            if said or self.target() > generation:
                return said == RelayFolder.READY and self.target() <= generation
            if time.monotonic() >= deadline:
                raise TimeoutError(f"generation {generation}: not every rank arrived within {timeout:g}s")
            time.sleep(WATCH_POLL)

    def rollback_failed(self, generation: int, failure: RollbackFailure) -> None:
        self.folder.write(self.folder.reached(generation, self.rank, RelayFolder.FAILURE), failure.to_text())

    def collective_failed(self, failure: CollectiveFailure) -> None:
        """A collective of this rank failed while it lived: the agent puts it where the controller reads it."""
        self.folder.write(self.folder.reached(failure.generation, self.rank, RelayFolder.COLLECTIVE), failure.to_text())

    def online(self, generation: int) -> bool:
        """Whether the repair into ``generation`` replaces no process (its agent says so before the target)."""
        return os.path.exists(self.folder.online(generation))

    def await_stop(self, generation: int, failure: RollbackFailure, wait: float = FALLBACK_WAIT) -> NoReturn:
        """After :meth:`rollback_failed`: wait for the agent to stop this rank for the job-level restart
        (its SIGTERM ends the process); a newer repair meanwhile cannot put the state back either, so it is
        told the same. Without a stop within ``wait`` seconds (the controller is gone), leave with one line."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(WATCH_POLL)
            if self.target() > generation:
                generation = self.target()
                self.rollback_failed(generation, failure)
        raise SystemExit(f"ftrun.mindspore_elastic: rank {self.rank}: {failure.reason}; no job-level restart came "
                         f"within {wait:g}s")
