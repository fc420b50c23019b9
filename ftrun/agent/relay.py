"""The agent's relay between its MindSpore ranks, which cannot read the control store, and the store.

A MindSpore rank's python has no torch, so it has no ``TCPStore`` client; its agent reads and writes the
store for it, through the node's :class:`~ftrun.contract.RelayFolder` (``ftrun/mindspore_elastic/repair.py``
says why files). Each tick of the agent's supervision loop:

* a rank's committed step that moved (its ``progress`` file), and its step times (the file's second line),
  go where a torch rank's heartbeat puts them, for the status view, the job's summary and the stragglers;

and at process level (on Ascend) only, where the ranks take part in a repair:

* the newest generation announced (one store read) goes into the folder's ``target`` file when it moved,
  after its ``online-<g>`` file when the repair replaces no process (one more read, per repair);
* every milestone file the ranks left is counted in the store, as a torch rank counts itself, then
  deleted; the relay that counts the last rank to arrive in a generation marks its groups ready, as the
  last torch rank does; a rank's failure file becomes the generation's rollback failure, and its file
  for a failed collective the generation's collective failure (the online level);
* while a generation is not yet ready, its ``group_ready`` key (one read) goes into ``ready-<g>`` once set.

The store sees O(nodes) traffic for a repair, not O(ranks): the tree the design asks for.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ftrun.contract import Milestone, RelayFolder
from ftrun.keys import GROUP_READY, JobKeys
from ftrun.store import ControlStore

log = logging.getLogger(__name__)
#: what a rank's milestone file may be called after
MILESTONES = frozenset(m.value for m in Milestone)


class FolderRelay:
    """Carries one node's MindSpore ranks' progress, and their side of every repair, between ``folder``
    and the control store."""

    def __init__(self, store: Callable[[], ControlStore], keys: JobKeys, folder: RelayFolder,
                 world_size: Callable[[], int], repairs: bool = True):
        #: the agent's control store now: under etcd it is another one once the controller moved
        self._store = store
        self.keys = keys
        self.folder = folder
        #: the job's world size now (the layout may change at a job-level restart)
        self.world_size = world_size
        #: the ranks take part in process-level repairs: without, a job-level job's agents read nothing
        #: of them from the store (a read every tick of every node's agent)
        self.repairs = repairs
        #: each rank's progress file as last relayed (its mtime)
        self._progress_seen: dict[int, int] = {}
        #: the newest generation written to the folder (0: none)
        self.target = 0
        #: the newest generation whose readiness is in the folder
        self.ready = 0
        os.makedirs(folder.path, mode=0o700, exist_ok=True)

    @property
    def store(self) -> ControlStore:
        return self._store()

    def tick(self) -> None:
        names = self.folder.names()  # one listing a tick, for the progress and the reports alike
        self._relay_progress(names)
        if not self.repairs:
            return
        self._relay_target()
        self._count_reports(names)
        self._relay_ready()

    def _relay_progress(self, names: list[str]) -> None:
        for rank in self.folder.ranks_with_progress(names):
            path = self.folder.progress(rank)
            try:
                changed = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                continue
            if self._progress_seen.get(rank) != changed:
                self._progress_seen[rank] = changed
                step, _, times = self.folder.read(path).strip().partition("\n")
                if not step:
                    continue
                keys, texts = [self.keys.rank_progress(rank)], [step]
                if times.strip():  # one round trip for both
                    keys, texts = [*keys, self.keys.rank_step_times(rank)], [step, times.strip()]
                self.store.set_each(keys, texts)

    def _relay_target(self) -> None:
        text = self.store.try_text(self.keys.target_generation)
        target = int(text) if text else 0
        if target > self.target:
            if self.store.try_text(self.keys.online_repair(target)):
                self.folder.write(self.folder.online(target), "")
            self.folder.write(self.folder.target, str(target))
            self.target = target

    def _count_reports(self, names: list[str]) -> None:
        for path, generation, rank, what in self.folder.reports(names):
            if what == RelayFolder.FAILURE:
                self.store.set_text(self.keys.rollback_failure(generation), self.folder.read(path))
            elif what == RelayFolder.COLLECTIVE:  # the first rank's word stays, as a torch rank's does
                self.store.raw.compare_set(self.keys.collective_failure(generation), "", self.folder.read(path))
            elif what in MILESTONES:
                reached = self.store.add(self.keys.milestone(generation, what))
                if what == Milestone.ARRIVED.value and reached >= self.world_size():
                    self.store.set_text(self.keys.group_ready(generation), GROUP_READY)
            else:
                log.warning("rank %d left an unknown repair report %r; ignored", rank, what)
            os.remove(path)

    def _relay_ready(self) -> None:
        if self.target <= self.ready:
            return
        said = self.store.try_text(self.keys.group_ready(self.target))
        if said:
            self.folder.write(self.folder.ready(self.target), RelayFolder.READY if said == GROUP_READY else said)
            self.ready = self.target
