"""The step protocol's answer: how a step ended (``end_step()`` of both worker libraries).

A training loop, a framework's callback or ``with job.guard():`` drives each step through the same two
calls: ``job.begin_step()`` as the step's body begins, ``job.end_step(error)`` as it ends (``error``: what
the body raised, or None). The answer is a :class:`StepOutcome`. It depends on nothing but the standard
library, so that ``ftrun.elastic`` (torch) and ``ftrun.mindspore_elastic`` (no torch) share it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol


class Ending(enum.Enum):
    """How a step ended."""

    #: the body finished and its collectives held: the step counts, the loop goes on with the next
    COMMITTED = "committed"
    #: a fault elsewhere interrupted the step and the repair is done: the loop goes on from
    #: ``StepOutcome.step``, the consistent step every rank agreed on (it may run this step again)
    REPAIRED = "repaired"
    #: the error is not ours to repair (the rank's own, or no repair was announced in time): the caller
    #: raises ``StepOutcome.error`` and the process ends as it would without ftrun
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What ``end_step()`` answers: how the step ended, the step to run next, and, for a lost step, the error
    to raise (the body's, or the failure of one of its collectives when the body itself finished)."""

    ending: Ending
    #: the next step to run: one past the committed one, the consistent step after a repair, or (lost) the
    #: step that was running
    step: int
    error: BaseException | None = None

    @property
    def committed(self) -> bool:
        """The step counts: go on with ``step``, the next one."""
        return self.ending is Ending.COMMITTED

    @property
    def repaired(self) -> bool:
        """A fault elsewhere stopped the step and the repair is done: go on from ``step``, the consistent one."""
        return self.ending is Ending.REPAIRED

    @property
    def lost(self) -> bool:
        """Not ours to repair: raise ``error``."""
        return self.ending is Ending.LOST


@dataclasses.dataclass(frozen=True)
class StepDecision:
    """How a step ended, before anything is done about it (``with job.guard():`` leaves the repair to the loop,
    so that the code after the block still sees the step as it ended): ``target``, the generation to repair
    into; ``lost``, the error to raise; neither: committed."""

    target: int | None = None
    lost: BaseException | None = None

    def outcome(self, step: int) -> StepOutcome:
        """The outcome, once the repair it calls for is done and ``step`` is the next step to run."""
        if self.lost is not None:
            return StepOutcome(Ending.LOST, step, self.lost)
        return StepOutcome(Ending.COMMITTED if self.target is None else Ending.REPAIRED, step)


#: a step that committed
COMMITTED = StepDecision()


class SteppedJob(Protocol):
    """What a guard drives: either worker library's job."""

    def begin_step(self) -> None: ...

    def _end(self, error: BaseException | None) -> StepDecision: ...


class StepGuard:
    """``with job.guard():`` around a step's body: ``job.begin_step()`` as the block begins and the decision of
    ``job.end_step()`` as it ends. A finished body commits the step; a fault elsewhere (a collective that failed
    because a peer died, a device stopped) is swallowed, and ``job.steps()`` repairs and goes on from the
    consistent step when the loop asks for the next step, so that the code after the block still sees the step
    as it ended (``job.step == step + 1`` tells a committed one); an error that is not ours goes on up."""

    def __init__(self, job: SteppedJob):
        self.job = job
        #: how the step ended, once the block is left (None before, or when it was never entered)
        self.decision: StepDecision | None = None

    def __enter__(self) -> "StepGuard":
        self.job.begin_step()
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self.decision = decision = self.job._end(error)
        if decision.lost is not None:
            if error is None:  # the body finished, but one of its collectives failed and no repair comes
                raise decision.lost
            return False
        return decision.target is not None  # swallowed: steps() repairs and goes on from the consistent step
