"""The controller's straggler watch: an observer over the status board's ranks (their step times came with the
nodes' statuses: no store read of its own) that returns what it saw as events (``inbox.StragglerSeen``,
``inbox.StragglerGain``); the policy decides what a straggler costs its node (``policy.on_straggler``).

The scoring and the judging are pure (``ftrun.detection.stragglers``); this part holds their state between
two looks, the job's step time before a slowdown, and the node whose ranks moved, to say what the move gained
once every rank has timed a full window after it. Ranks without the worker library's step times are scored
apart, from outside (their CPU share: ``assess_cpu``), under their own rule and state, and only ever reported.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

from ftrun.controller.board import StatusBoard
from ftrun.controller.inbox import Event, StragglerGain, StragglerSeen
from ftrun.controller.states import JobView, Phase
from ftrun.detection.stragglers import (
    OUTSIDE_RULE,
    Assessment,
    RankCpu,
    RankTimes,
    StragglerRule,
    WatchState,
    assess,
    assess_cpu,
    judge,
)
from ftrun.step_times import StepTimes

#: the seconds of looks the step time before a slowdown is the median of
BASELINE_S = 60.0


@dataclasses.dataclass(frozen=True)
class PendingMove:
    """A straggler's node whose ranks are to move: the line that named it (the policy's decision quotes it),
    the job's step time before the slowdown and with it, and whether the move was made."""

    node: int
    ranks: frozenset[int]
    line: str
    before: float
    slowed: float
    moved: bool = False


class StragglerWatch:
    """Scores the ranks at each board refresh and returns the stragglers named or cleared, then what a move
    gained."""

    def __init__(self, board: StatusBoard, action: str = "report", rule: StragglerRule | None = None):
        self.board, self.action = board, action
        self.rule = rule or StragglerRule()
        self.state = WatchState()
        self.assessment = Assessment()
        #: the outside view (ranks without the worker library's step times): its rule, state and last assessment
        self.outside_rule = OUTSIDE_RULE
        self.outside_state = WatchState()
        self.outside = Assessment(outside=True)
        #: the job's median step time at each look while no rank was past the rule, over the last BASELINE_S
        #: seconds: their median is the step time before a slowdown (the last looks before a rank is past may
        #: show some ranks' windows slowed already)
        self._clean: collections.deque[tuple[float, float]] = collections.deque()
        self._pending: PendingMove | None = None
        #: the ranks moved to a spare for straggling: slow again there, they are not moved again
        self.moved: frozenset[int] = frozenset()
        self._looked_at = -1.0

    def observe(self, view: JobView, now: float) -> list[Event]:
        snapshot = self.board.snapshot
        if (self.action == "off" or not snapshot or snapshot.get("generation") != view.generation
                or view.phase is not Phase.RUNNING or snapshot.get("time") == self._looked_at):
            return []
        self._looked_at = snapshot.get("time", now)
        reported = [RankTimes(r["rank"], r["node"], StepTimes(r["timed_steps"], r["step_s"], r["compute_s"], r["wait_s"]))
                    for r in snapshot.get("ranks", ()) if r.get("timed_steps") and r.get("alive", True)]
        self.assessment = assessment = assess(reported, self.rule)
        self.state, findings = judge(self.state, assessment, self.rule, now)
        seen_outside = self._outside(snapshot, now)
        if assessment.ranks and not any(r.past for r in assessment.ranks) and not self.state.named:
            self._clean.append((now, assessment.median_step))
            while self._clean and now - self._clean[0][0] > BASELINE_S:
                self._clean.popleft()
        events: list[Event] = self._gain(view, assessment)  # of a move decided at an earlier look
        for finding in findings:
            node_ranks = frozenset(r["rank"] for r in snapshot["ranks"] if r.get("node") == finding.node)
            moved_before = finding.rank in self.moved
            replace = self.action == "replace"
            events.append(StragglerSeen(finding, replace, moved_before))
            if finding.named and replace and not moved_before and self._pending is None:
                self._pending = PendingMove(finding.node, node_ranks, finding.line, self.baseline,
                                            assessment.median_step)
        events += [StragglerSeen(finding, self.action == "replace", outside=True) for finding in seen_outside]
        self.board.stragglers = self.summary()
        return events

    def _outside(self, snapshot: dict, now: float) -> list:
        """The outside view's findings: the ranks of a script without the worker library, by their CPU share. A job
        any of whose ranks is seen using the library is left to its step times: its other ranks have not yet beaten
        (starting, or loading while the others wait), not a script of their own."""
        ranks = snapshot.get("ranks", ())
        library = any(r.get("library") for r in ranks)
        plain = [RankCpu(r["rank"], r["node"], r["cpu_s_per_s"]) for r in ranks
                 if not library and r.get("alive", True) and r.get("cpu_s_per_s") is not None]
        self.outside = assess_cpu(plain, self.outside_rule)
        self.outside_state, findings = judge(self.outside_state, self.outside, self.outside_rule, now)
        return findings

    @property
    def baseline(self) -> float:
        """The job's median step time before a slowdown (seconds; 0 before the first look)."""
        return statistics.median(step for _, step in self._clean) if self._clean else 0.0

    def _gain(self, view: JobView, assessment: Assessment) -> list[Event]:
        """Once the move happened and every rank has timed a full window since: what it gained. A move the
        policy did not make (no spare, a repair under way, --stragglers report) is forgotten at once."""
        pending = self._pending
        if pending is None:
            return []
        if not pending.moved:
            if not any(pending.line in detail for detail in view.replaced_nodes):
                self._pending = None
                return []
            self.moved |= pending.ranks
            self._pending = pending = dataclasses.replace(pending, moved=True)
        replacements = [r for r in self.board.snapshot.get("ranks", ()) if r["rank"] in pending.ranks]
        if len(assessment.ranks) < view.world_size or any(r.get("timed_steps", 0) < self.rule.min_steps
                                                          for r in replacements):
            return []
        self._pending = None
        return [StragglerGain(pending.node, pending.before, pending.slowed, assessment.median_step)]

    def summary(self) -> dict:
        """What the status board shows: the named stragglers' lines, each rank's and each node's score."""
        named = [f"rank {r.rank} on node {r.node}: {r.score:.1f}x the job's median compute time "
                 f"({r.compute:.3f}s per step against {self.assessment.median_compute:.3f}s)"
                 for r in self.assessment.ranks if r.rank in self.state.named]
        named += [f"rank {r.rank} on node {r.node}: {r.score:.1f}x the job's median CPU time ({r.compute:.2f} "
                  f"CPU-seconds per second against {self.outside.median_compute:.2f}; outside view)"
                  for r in self.outside.ranks if r.rank in self.outside_state.named]
        both = (*self.assessment.ranks, *self.outside.ranks)
        named_ranks = self.state.named | self.outside_state.named
        # a node's score stays the step times' (the metrics' node score, which alerts read): the outside view's
        # ranks carry theirs, marked ``outside``
        return {"named": named, "scores": {r.rank: r.score for r in both},
                "nodes": {n.node: n.score for n in self.assessment.nodes},
                "outside": sorted(r.rank for r in self.outside.ranks), "named_ranks": sorted(named_ranks),
                "named_nodes": sorted({r.node for r in both if r.rank in named_ranks})}
