"""What each node holds, and the restore the controller chooses from it: pure functions over messages."""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import heapq
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

#: where a copy lives: a rank's own snapshot (its agent's memory), a pinned copy, a peer's replica, or disk
MEMORY, PINNED, REPLICA, DISK = "memory", "pinned", "replica", "disk"
#: which copy a rank prefers when several hold the step: on its own node first, memory before disk
_PREFERENCE = {MEMORY: 0, PINNED: 1, REPLICA: 2, DISK: 3}
#: spare copies a plan names for replicated state, where any rank's copy serves every rank
REPLICATED_SPARES = 16


@dataclass(frozen=True)
class HeldSnapshot:
    """One verified copy of one rank's state at one step, on the node that advertises it."""

    rank: int
    step: int
    world_size: int
    sharded: bool
    where: str
    #: the file on that node (a snapshot in memory, or a torch.save file on disk)
    path: str
    nbytes: int = 0
    #: the snapshot's CRC-32 (memory) or the whole file's (disk)
    crc: int = 0


@dataclass(frozen=True)
class SnapshotInventory:
    """What an agent holds, published in the store for the controller."""

    agent_id: str
    node_rank: int
    #: HOST:PORT of the agent's snapshot server (where peers send replicas and ranks fetch copies)
    address: str
    held: tuple[HeldSnapshot, ...] = ()


@dataclass(frozen=True)
class RestoreSource:
    """Where one rank reads its state: a file on ``node`` (``address`` serves it to other nodes)."""

    rank: int
    node_rank: int
    address: str
    where: str
    path: str
    nbytes: int = 0
    crc: int = 0

    @property
    def identity(self) -> tuple[str, str, int]:
        """Which copy this is: the file, the server it lives behind (none for disk, a folder every node
        may share), and its sum (the same file name holds a newer snapshot later)."""
        return ("" if self.where == DISK else self.address, self.path, self.crc)


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank resumes at, and where the ranks of one node read it; step -1 when nothing
    can be restored. One per node (``JobKeys.restore_plan``): a rank reads its own node's plan, whose
    size does not grow with the job, and not the whole job's (4.6 MB at 1,024 nodes x 16 ranks, read
    by each of 16,384 ranks from the one store)."""

    generation: int
    step: int = -1
    #: the node's ranks' sources, in rank order
    sources: tuple[RestoreSource, ...] = ()
    reason: str = ""
    #: the step's other copies that serve the node's ranks, nearest kinds first (for replicated state
    #: at most REPLICATED_SPARES of any rank's, for sharded state every other copy of each of its
    #: ranks' own): where a rank's source fails its check, it reads the next one that serves it
    spares: tuple[RestoreSource, ...] = ()
    sharded: bool = False

    def source_of(self, rank: int) -> RestoreSource | None:
        return next((s for s in self.sources if s.rank == rank), None)

    def sources_for(self, rank: int) -> list[RestoreSource]:
        """The rank's source, then the spare copies that hold its state (any rank's, for replicated
        state), those on the source's node first."""
        first = self.source_of(rank)
        if first is None:
            return []
        spares = [dataclasses.replace(s, rank=rank) for s in self.spares
                  if (not self.sharded or s.rank == rank) and s.identity != first.identity]
        return [first, *sorted(spares, key=lambda s: s.node_rank != first.node_rank)]

    def counts(self) -> dict[str, int]:
        """How many of the node's ranks read from each kind of place."""
        return dict(collections.Counter(source.where for source in self.sources))


#: one copy of a step: the inventory that advertises it, and the copy
Copy = tuple[SnapshotInventory, HeldSnapshot]


class Restore:
    """The controller's choice for a job-level restart: the step, and each node's ``RestorePlan``,
    made when asked for. The plans of a thousand nodes hold an entry for every copy (32,768 at 1,024
    nodes x 16 ranks with one replica each). Made and written node by node, each node's entries go
    before the next node's are made, in memory the allocator has just handed back, and each node's
    copies are looked at in one short list; made all at once in passes over every copy, each copy
    cost 1.4 times as much at 1,024 nodes as at 64 (the passes left the caches)."""

    def __init__(self, generation: int, homes: dict[int, int], step: int = -1, reason: str = "",
                 sharded: bool = False, copies: dict[int, list[Copy]] | None = None,
                 spares: tuple[RestoreSource, ...] = ()):
        self.generation, self.step, self.reason, self.sharded = generation, step, reason, sharded
        self._homes = homes
        #: sharded: the copies of each node's ranks' state; replicated: the best copy on each node,
        #: and under -1 the best anywhere (for the nodes that hold none)
        self._copies = copies or {}
        #: replicated: the spare copies every node's plan names
        self._spares = spares

    @functools.cached_property
    def _ranks_of(self) -> dict[int, list[int]]:
        """Each node's ranks, in rank order (as ``homes`` lists them): made once a plan is asked for, not
        for the status's restorable step, which needs the step alone."""
        ranks_of: dict[int, list[int]] = {}
        for rank, node in self._homes.items():
            ranks_of.setdefault(node, []).append(rank)
        return ranks_of

    def nodes(self) -> list[int]:
        """The nodes that are home to a rank (-1 for the ranks that have none)."""
        return sorted(self._ranks_of)

    def plan_for(self, node: int) -> RestorePlan:
        """Where the ranks whose home is ``node`` read their state."""
        if self.step < 0:
            return RestorePlan(self.generation, reason=self.reason)
        ranks = self._ranks_of.get(node, [])
        if not self.sharded:
            copy = (self._copies.get(node) or self._copies[-1])[0]
            sources = tuple(_source(rank, *copy) for rank in ranks)
            return RestorePlan(self.generation, self.step, sources, spares=self._spares)
        copies = self._copies.get(node, [])
        best = _best_by(copies, lambda i, h: h.rank, lambda i, h: (i.node_rank != node, _PREFERENCE[h.where], h.rank))
        chosen = {(id(inventory), id(held)) for inventory, held in best.values()}
        others = sorted((c for c in copies if (id(c[0]), id(c[1])) not in chosen), key=_order)
        return RestorePlan(self.generation, self.step, tuple(_source(rank, *best[rank]) for rank in ranks),
                           spares=tuple(dict.fromkeys(_source(h.rank, i, h) for i, h in others)), sharded=True)

    def plans(self) -> Iterator[tuple[int, RestorePlan]]:
        """Each node's plan, node by node."""
        for node in self.nodes():
            yield node, self.plan_for(node)

    def source_of(self, rank: int) -> RestoreSource | None:
        return self.plan_for(self._homes.get(rank, -1)).source_of(rank)

    def sources_for(self, rank: int) -> list[RestoreSource]:
        return self.plan_for(self._homes.get(rank, -1)).sources_for(rank)

    def counts(self) -> dict[str, int]:
        """How many ranks read from each kind of place."""
        return merged_counts(plan.counts() for _, plan in self.plans())


def choose_restore(generation: int, inventories: list[SnapshotInventory], world_size: int,
                   node_of_rank: dict[int, int], damaged: frozenset = frozenset()) -> Restore:
    """The newest step for which every one of ``world_size`` ranks' state is held somewhere.

    Sharded state needs a copy of every rank's own state at that step, taken in the same world
    size; data-parallel replicas hold the same state, so any rank's copy serves every rank (also
    after a resize). Each rank reads the copy nearest to it: on its own node (``node_of_rank``; -1
    for a rank missing there) and in memory first, a peer's memory next, disk last. The other copies
    of the step go with the plans as spares. Copies whose ``RestoreSource.identity`` is in
    ``damaged`` (a rank found them so) are left out.

    The garbage collector waits meanwhile: the copies of a thousand nodes are a few hundred
    thousand objects, and the collections that the tuples made here set off walked them all again
    and again (a tenth of the time at 1,024 nodes, a sixth at 4,096: growing faster than the job).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _choose(generation, inventories, world_size, node_of_rank, damaged)
    finally:
        if enabled:
            gc.enable()


def _choose(generation: int, inventories: list[SnapshotInventory], world_size: int, node_of_rank: dict[int, int],
            damaged: frozenset) -> Restore:
    homes = {rank: node_of_rank.get(rank, -1) for rank in range(world_size)}
    copies: dict[int, list[Copy]] = {}
    for inventory in inventories:
        for held in inventory.held:
            if not damaged or _source(held.rank, inventory, held).identity not in damaged:
                copies.setdefault(held.step, []).append((inventory, held))
    for step in sorted(copies, reverse=True):
        held_at = copies[step]
        if not any(h.sharded for _, h in held_at):
            best = _nearest_any(held_at)
            unique = {(id(i), h): (i, h) for i, h in held_at}.values()  # a copy an inventory lists twice, once
            nearest = heapq.nsmallest(REPLICATED_SPARES, unique, key=_order)  # linear, and as a stable sort's
            return Restore(generation, homes, step, copies={node: [copy] for node, copy in best.items()},
                           spares=tuple(dict.fromkeys(_source(h.rank, i, h) for i, h in nearest)))
        by_home: dict[int, list[Copy]] = {}
        ranks = set()
        for copy in held_at:
            held = copy[1]
            node = homes.get(held.rank)
            if node is not None and held.sharded and held.world_size == world_size:
                by_home.setdefault(node, []).append(copy)
                ranks.add(held.rank)
        if len(ranks) == world_size:
            return Restore(generation, homes, step, sharded=True, copies=by_home)
    if not copies:
        return Restore(generation, homes, reason="no snapshot is held anywhere")
    return Restore(generation, homes, reason=f"no step has a snapshot of every one of the {world_size} ranks")


def _nearest_any(held_at: list[Copy]) -> dict[int, Copy]:
    """Replicated state: each node's best copy of any rank's, and under -1 the best anywhere (the
    nearer kind, then the lower rank, the first listed on a tie): found once per node, not once per
    rank over every copy (W x copies: 81 ms at 1,024 ranks each holding a copy, 2.3 ms now, and some
    20 s at 16,384)."""
    def nearer(i: SnapshotInventory, h: HeldSnapshot) -> tuple:
        return _PREFERENCE[h.where], h.rank

    return {**_best_by(held_at, lambda i, h: i.node_rank, nearer), -1: _best_by(held_at, lambda i, h: -1, nearer)[-1]}


def _best_by(held_at: list[Copy], group: Callable, key: Callable) -> dict:
    """For each ``group(inventory, held)``, the copy with the least ``key``, the first listed on a tie:
    one pass over the copies, with no list of them per group."""
    best: dict[Any, tuple[Any, SnapshotInventory, HeldSnapshot]] = {}
    for inventory, held in held_at:
        mine, order = group(inventory, held), key(inventory, held)
        current = best.get(mine)
        if current is None or order < current[0]:
            best[mine] = (order, inventory, held)
    return {mine: (inventory, held) for mine, (_, inventory, held) in best.items()}


def _order(copy: Copy) -> tuple:
    """Spares' order: the nearest kind first, then by node and rank (a stable sort keeps the
    inventories' order on a tie)."""
    inventory, held = copy
    return _PREFERENCE[held.where], inventory.node_rank, held.rank


def _source(rank: int, inventory: SnapshotInventory, held: HeldSnapshot) -> RestoreSource:
    return RestoreSource(rank, inventory.node_rank, inventory.address, held.where, held.path, held.nbytes, held.crc)


def merged_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sum of ``RestorePlan.counts()``."""
    total: collections.Counter = collections.Counter()
    for each in counts:
        total.update(each)
    return dict(total)
