"""Stragglers: a rank, or a node, that every synchronous step waits for, scored and judged as pure functions.

Each rank reports the medians of its last steps (``ftrun.step_times``): its compute time (the step less its
waits inside collectives) and its wait. A slow rank computes longer and waits less; the others wait for it,
so their step times match its and only the compute time tells it. :func:`assess` scores every rank's compute
time against the job's median (the lower median: with half the ranks slow, the fast half is the reference)
and each node by its worst rank. :func:`judge` names a rank only once it has stayed past the rule for
``persist`` seconds, and clears it only once it has stayed below a lower mark as long (hysteresis), so that
noise on a loaded machine (a descheduled process, a garbage collection, a snapshot) names no one: a median
over a window of steps, a ratio and a minimum excess in seconds, and time.

A script that does not use the worker library sends no step times: for it there is only the outside view
(:func:`assess_cpu`), each rank's CPU seconds per wall second as its agent reads them from ``/proc``
(``ftrun.agent.cpu_time``), judged by the same :func:`judge` under a rule of its own (``OUTSIDE_RULE``), more
conservative, since CPU time is a weaker sign than step times: a plain script's ranks differ by themselves
(rank 0 logs, evaluates and saves more), and a rank slow on its accelerator may use no more CPU than the others.
The outside view only ever reports.

No clock, store or process here: the controller's straggler watch feeds it (``controller/straggler_watch.py``).
"""

from __future__ import annotations

import dataclasses
import statistics

from ftrun.step_times import WINDOW_STEPS, StepTimes

#: --stragglers: only name them, move a straggling node's ranks to a spare, or watch nothing
STRAGGLER_ACTIONS = ("report", "replace", "off")
#: the job's median compute time is never taken as less than this (seconds): a job of empty steps has no straggler
MEDIAN_FLOOR = 0.001


@dataclasses.dataclass(frozen=True)
class StragglerRule:
    """When a rank counts as a straggler."""

    #: its compute time per step is at least this many times the job's median
    threshold: float = 1.5
    #: and at least this many seconds per step more (a 1 ms step twice as long as 0.5 ms is noise)
    min_excess: float = 0.05
    #: seconds it must stay past both before it is named (and below ``clear`` before it is cleared)
    persist: float = 5.0
    #: a named rank is cleared once its score stays below this
    clear: float = 1.25
    #: a rank is scored once it has timed this many steps (a full window: a replacement's first steps are not)
    min_steps: int = WINDOW_STEPS


#: the outside view's rule: a rank at least twice the job's median CPU share and 0.3 CPU-seconds per second past
#: it, for 20 s (a rank that logs, evaluates or saves more than the others does not pass all three for long)
OUTSIDE_RULE = StragglerRule(threshold=2.0, min_excess=0.3, persist=20.0, clear=1.5, min_steps=0)
#: below this median CPU share (CPU-seconds per second) the outside view scores no one: ranks that all wait (rank 0
#: alone loading data or saving while the others sit in a barrier) tell nothing from outside
CPU_MEDIAN_FLOOR = 0.1


@dataclasses.dataclass(frozen=True)
class RankTimes:
    """A rank's step times as its node reported them."""

    rank: int
    node: int
    times: StepTimes


@dataclasses.dataclass(frozen=True)
class RankScore:
    """A rank's compute time against the job's median: ``score`` is the ratio, ``excess`` the seconds per step
    more; ``past``: both beyond the rule."""

    rank: int
    node: int
    step: float
    compute: float
    wait: float
    score: float
    excess: float
    past: bool


@dataclasses.dataclass(frozen=True)
class NodeScore:
    """A node's score: its worst rank's (a slow chip slows one rank, a throttled host all of them)."""

    node: int
    score: float
    rank: int


@dataclasses.dataclass(frozen=True)
class Assessment:
    """Every scored rank and node, with the job's median compute and step times (seconds)."""

    median_compute: float = 0.0
    median_step: float = 0.0
    ranks: tuple[RankScore, ...] = ()
    nodes: tuple[NodeScore, ...] = ()
    #: the outside view's (:func:`assess_cpu`): the ranks' ``compute`` is their CPU seconds per wall second
    outside: bool = False

    def of(self, rank: int) -> RankScore | None:
        return next((r for r in self.ranks if r.rank == rank), None)


def assess(reported: list[RankTimes] | tuple[RankTimes, ...], rule: StragglerRule) -> Assessment:
    """Score the ranks that have timed a full window; fewer than two such ranks have no median to stand out of."""
    timed = [r for r in reported if r.times.steps >= rule.min_steps]
    if len(timed) < 2:
        return Assessment()
    median = statistics.median_low(r.times.compute for r in timed)
    reference = max(median, MEDIAN_FLOOR)
    ranks = []
    for r in sorted(timed, key=lambda r: r.rank):
        score = r.times.compute / reference
        excess = r.times.compute - median
        ranks.append(RankScore(r.rank, r.node, r.times.step, r.times.compute, r.times.wait, round(score, 3),
                               round(excess, 4), score >= rule.threshold and excess >= rule.min_excess))
    return Assessment(median, statistics.median(r.times.step for r in timed), tuple(ranks), _nodes(ranks))


@dataclasses.dataclass(frozen=True)
class RankCpu:
    """A rank of a script without the worker library, as its node reported it: its CPU seconds per wall second."""

    rank: int
    node: int
    cpu: float


def assess_cpu(reported: list[RankCpu] | tuple[RankCpu, ...], rule: StragglerRule = OUTSIDE_RULE) -> Assessment:
    """The outside view: each rank's CPU share against the job's (lower) median; none scored with fewer than two
    ranks, or while the median is under CPU_MEDIAN_FLOOR."""
    if len(reported) < 2:
        return Assessment(outside=True)
    median = statistics.median_low(r.cpu for r in reported)
    if median < CPU_MEDIAN_FLOOR:
        return Assessment(median, outside=True)
    ranks = []
    for r in sorted(reported, key=lambda r: r.rank):
        score, excess = r.cpu / median, r.cpu - median
        ranks.append(RankScore(r.rank, r.node, 0.0, r.cpu, 0.0, round(score, 3), round(excess, 4),
                               score >= rule.threshold and excess >= rule.min_excess))
    return Assessment(median, 0.0, tuple(ranks), _nodes(ranks), outside=True)


def _nodes(ranks: list[RankScore]) -> tuple[NodeScore, ...]:
    """Each node's score: its worst rank's."""
    nodes = []
    for node in sorted({r.node for r in ranks}):
        worst = max((r for r in ranks if r.node == node), key=lambda r: r.score)
        nodes.append(NodeScore(node, worst.score, worst.rank))
    return tuple(nodes)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A rank named a straggler (``named``) or no longer one, and the line that says so."""

    rank: int
    node: int
    named: bool
    score: float
    line: str


@dataclasses.dataclass(frozen=True)
class WatchState:
    """What :func:`judge` carries from one assessment to the next: since when each rank has been past the
    rule (not yet named), since when each named rank has been below its clearing mark, the named ranks."""

    past_since: tuple[tuple[int, float], ...] = ()
    below_since: tuple[tuple[int, float], ...] = ()
    named: frozenset[int] = frozenset()


def judge(state: WatchState, assessment: Assessment, rule: StragglerRule, now: float) -> tuple[WatchState, list[Finding]]:
    """The next state and what changed: a rank past the rule for ``rule.persist`` seconds is named; a named rank
    below ``rule.clear`` as long is cleared. A named rank that is no longer scored (replaced, or its job
    restarted) leaves the named set without a word: what replaced it said so."""
    past_since, below_since = dict(state.past_since), dict(state.below_since)
    named = set(state.named)
    findings: list[Finding] = []
    scored = {r.rank: r for r in assessment.ranks}
    for rank in list(named):
        if rank not in scored:
            named.discard(rank)
            below_since.pop(rank, None)
    for rank in list(past_since):
        if rank not in scored or not scored[rank].past:
            del past_since[rank]
    for r in assessment.ranks:
        if r.rank in named:
            if r.score >= rule.clear:
                below_since.pop(r.rank, None)
            elif now - below_since.setdefault(r.rank, now) >= rule.persist:
                named.discard(r.rank)
                del below_since[r.rank]
                findings.append(Finding(r.rank, r.node, False, r.score, cleared_line(r, assessment)))
        elif r.past and now - past_since.setdefault(r.rank, now) >= rule.persist:
            named.add(r.rank)
            del past_since[r.rank]
            findings.append(Finding(r.rank, r.node, True, r.score, straggler_line(r, assessment)))
    return WatchState(tuple(sorted(past_since.items())), tuple(sorted(below_since.items())), frozenset(named)), findings


#: what the outside view's lines say of it
OUTSIDE_VIEW = ("outside view: the script does not use ftrun's worker library; a rank slow on its accelerator may "
                "not show here")


def straggler_line(r: RankScore, assessment: Assessment) -> str:
    """The one line that names a straggler."""
    if assessment.outside:
        return (f"straggler: rank {r.rank} on node {r.node} uses {r.score:.1f}x the job's median CPU time "
                f"({r.compute:.2f} CPU-seconds per second against {assessment.median_compute:.2f}; {OUTSIDE_VIEW})")
    return (f"straggler: rank {r.rank} on node {r.node} computes {r.compute:.3f}s per step, {r.score:.1f}x the job's "
            f"median {assessment.median_compute:.3f}s (waits {r.wait:.3f}s); the job's step takes "
            f"{assessment.median_step:.3f}s")


def cleared_line(r: RankScore, assessment: Assessment) -> str:
    if assessment.outside:
        return (f"rank {r.rank} on node {r.node} is no straggler any more (outside view): {r.score:.1f}x the job's "
                f"median CPU time ({r.compute:.2f} CPU-seconds per second against {assessment.median_compute:.2f})")
    return (f"rank {r.rank} on node {r.node} is no straggler any more: {r.compute:.3f}s per step, {r.score:.1f}x the "
            f"job's median {assessment.median_compute:.3f}s")
