"""Choosing the consistent step after a fault: pure, over what each rank says it holds."""

from __future__ import annotations

from dataclasses import dataclass

#: what a rank reports when it holds no usable state (a replacement, or a step half applied)
NO_STATE = -1


@dataclass(frozen=True)
class RollbackPlan:
    #: the step every rank resumes at (the number of steps fully committed)
    step: int
    #: the rank that sends its state
    source: int
    #: ranks whose state differs from the source's and must load it
    receivers: tuple[int, ...]


def choose_rollback(committed: list[int]) -> RollbackPlan | None:
    """The highest step a healthy replica fully committed, and who sends it; None if nobody holds state.

    ``committed[r]`` is rank r's number of committed steps, or NO_STATE. Data-parallel
    replicas that committed the same step hold the same state, so the lowest such
    rank sends it to everyone else.
    """
    best = max(committed, default=NO_STATE)
    if best == NO_STATE:
        return None
    source = committed.index(best)
    receivers = tuple(rank for rank, step in enumerate(committed) if step != best)
    return RollbackPlan(best, source, receivers)
