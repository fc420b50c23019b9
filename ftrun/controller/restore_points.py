"""The steps the job can go back to, as the controller follows them (``--snapshot-every``): the step
a job-level restart would restore now, the checkpoints complete on disk, the copies the ranks found
damaged; and, before a restart, the restore it takes.

It reads what the agents publish (each node's ``SnapshotInventory``, the ranks' damage reports); the
controller's publisher writes the plans, its narrator tells them.
"""

from __future__ import annotations

import time

from ftrun.controller.narrator import Narrator
from ftrun.controller.states import JobView
from ftrun.keys import JobKeys
from ftrun.messages import NodeSlot
from ftrun.snapshots.keeper import SnapshotOptions
from ftrun.snapshots.persist import step_folder
from ftrun.snapshots.plan import DISK, HeldSnapshot, Restore, RestoreSource, SnapshotInventory, choose_restore
from ftrun.store import ControlStore

#: with snapshots, how often (seconds) the controller reads what the nodes hold: for the status's restorable
#: step and for the checkpoint events (a plan over every node's copies is not for every keepalive of a big job)
SAVED_EVERY = 2.0


class RestorePoints:
    """What the nodes' snapshots hold, job-wide."""

    def __init__(self, store: ControlStore, keys: JobKeys, options: SnapshotOptions, narrator: Narrator):
        self.store, self.keys = store, keys
        self.options = options
        #: tells each checkpoint as it is complete
        self.narrator = narrator
        #: the newest step whose checkpoint is on disk for every rank
        self._checkpointed = -1
        #: the copies ranks found damaged while restoring (RestoreSource.identity; None for a forged report)
        self._damaged: list[tuple | None] = []
        #: the status's restorable and checkpoint steps, and when to look at the nodes' copies again
        self.saved: dict = {}
        self._next_saved = 0.0

    def refresh(self, view: JobView, nodes: list[NodeSlot], final: bool = False) -> dict:
        """The status's ``restorable_step`` and ``checkpoint_step`` (None where there is none), read
        again every SAVED_EVERY seconds and at the end (``final``) from the ``nodes`` in the job."""
        if self.options.every and (final or time.monotonic() >= self._next_saved):
            self._next_saved = time.monotonic() + SAVED_EVERY
            inventories = self._inventories(nodes)
            if self.options.checkpoint_dir:
                self._note_checkpoints(view, inventories)
            restore = choose_restore(view.generation, inventories, view.world_size, {}, frozenset(self._damaged))
            self.saved = {"restorable_step": restore.step if restore.step >= 0 else None,
                          "checkpoint_step": self._checkpointed if self._checkpointed >= 0 else None}
        return self.saved

    def choose(self, generation: int, view: JobView, nodes: list[NodeSlot]) -> Restore:
        """Before a job-level restart: the newest step every rank's state is held at, and where each rank
        reads it (the agents published what they hold when they stopped their ranks)."""
        homes = {rank: n.node_rank for n in nodes for rank in range(n.first_rank, n.first_rank + n.nproc)}
        reports = self.store.read_from(self.keys.damaged_count, self.keys.damaged, RestoreSource, len(self._damaged))
        for source in reports:
            self._damaged.append(source.identity if source is not None else None)  # None: forged, ignored
        return choose_restore(generation, self._inventories(nodes), view.world_size, homes, frozenset(self._damaged))

    def _inventories(self, nodes: list[NodeSlot]) -> list[SnapshotInventory]:
        """What the nodes in the job hold now (a lost node's agent, and its memory, are gone)."""
        found = []
        for node in nodes:
            inventory = self.store.try_get(SnapshotInventory, self.keys.snapshot_inventory(node.agent_id))
            if inventory is not None:
                found.append(inventory)
        return found

    def _note_checkpoints(self, view: JobView, inventories: list[SnapshotInventory]) -> None:
        """An event for each checkpoint step whose every rank's file the agents have written."""
        world = view.world_size
        files: dict[int, dict[int, HeldSnapshot]] = {}
        for inventory in inventories:
            for held in inventory.held:
                if held.where == DISK:
                    files.setdefault(held.step, {})[held.rank] = held
        for step in sorted(files):
            if step > self._checkpointed and set(files[step]) >= set(range(world)):
                self._checkpointed = step
                nbytes = sum(files[step][rank].nbytes for rank in range(world))
                self.narrator.checkpoint(view.generation, step, world, nbytes,
                                         step_folder(self.options.checkpoint_dir, step))
