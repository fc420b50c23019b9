"""Choosing the consistent step after a fault: pure, over what each rank says it holds. It imports nothing
but the standard library, so that the repair of torch ranks (ftrun/elastic/repair.py) and of MindSpore
ranks (ftrun/mindspore_elastic/repair.py, whose python has no torch) decide alike.

Each rank belongs to one replica set: the ranks whose training state is the same as its own
(``ftrun/elastic/layout.py`` finds them from the script's mesh). In pure data parallelism every
rank is in one set; with FSDP2's full sharding every rank is a set of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

#: what a rank reports when it holds no usable state (a replacement, or a step half applied)
NO_STATE = -1


@dataclass(frozen=True)
class Transfer:
    #: the rank that sends its state
    source: int
    #: ranks of the source's replica set whose state differs from the source's and must load it
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class RollbackPlan:
    #: the step every rank resumes at (the number of steps fully committed)
    step: int
    #: one per replica set that has ranks to bring up to the step
    transfers: tuple[Transfer, ...] = ()

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(sorted(rank for transfer in self.transfers for rank in transfer.receivers))

    def source_for(self, rank: int) -> int | None:
        """The rank that sends ``rank`` its state; None when it keeps its own."""
        return next((t.source for t in self.transfers if rank in t.receivers), None)


def choose_rollback(committed: list[int], replica_sets: list[tuple[int, ...]] | None = None) -> RollbackPlan | None:
    """The highest step any rank fully committed, and in each replica set who sends it to whom;
    None if some replica set has no rank holding that step (the state must come from snapshots).

    ``committed[r]`` is rank r's number of committed steps, or NO_STATE. Replicas that committed
    the same step hold the same state, so the lowest such rank of each set sends it to the others.
    ``replica_sets`` defaults to one set of every rank (pure data parallelism).
    """
    best = max(committed, default=NO_STATE)
    if best == NO_STATE:
        return None
    transfers = []
    for members in replica_sets if replica_sets is not None else [tuple(range(len(committed)))]:
        holders = [rank for rank in members if committed[rank] == best]
        if not holders:
            return None
        receivers = tuple(rank for rank in members if committed[rank] != best)
        if receivers:
            transfers.append(Transfer(min(holders), receivers))
    return RollbackPlan(best, tuple(transfers))
