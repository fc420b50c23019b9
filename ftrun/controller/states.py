"""The job as the controller's policy sees it: its phases, recovery levels and the frozen view that every
decision starts from.

It depends on the worker contract and the messages only, so that the policy (``policy.py``), the
parts that apply its decisions and the views that show them share one vocabulary without a circle.
Every legal move between phases is in ``TRANSITIONS``; ``JobView.move`` raises on any other.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from ftrun.contract import Milestone, RollbackFailure
from ftrun.messages import Command, WorkerFailure


class Phase(enum.Enum):
    """Where the job stands, from the controller's point of view."""

    #: the generation's workers are running (or some nodes have finished theirs)
    RUNNING = "running"
    #: a fault was seen. Job level: agents stop every worker. Process level: healthy ranks leave
    #: their process group at a safe point while the failed ranks' agents clear them
    STOPPING = "stopping"
    #: process level: healthy ranks have stopped; the failed ranks' processes are being reaped
    ENV_CLEAR = "env_clear"
    #: process level: replacements are up; every rank forms the next generation's process group
    REPAIR = "repair"
    #: process level: the group is formed; the consistent step's state goes to the ranks lacking it
    ROLLBACK = "rollback"
    #: the job is over (success, budget spent or interrupted); agents are stopping and leaving
    EXITING = "exiting"
    #: every agent has acknowledged the exit (or is gone); the controller can stop
    DONE = "done"


REPAIR_PHASES = (Phase.STOPPING, Phase.ENV_CLEAR, Phase.REPAIR, Phase.ROLLBACK)

#: every legal edge; anything else is a bug and raises
TRANSITIONS = {
    Phase.RUNNING: {Phase.STOPPING, Phase.EXITING},
    # job level: all stopped -> the next generation runs; process level: healthy ranks out -> clear
    # process level -> STOPPING at job level (here and from the next two): the repair failed, or every
    # rank has failed and no healthy replica is left
    Phase.STOPPING: {Phase.RUNNING, Phase.ENV_CLEAR, Phase.STOPPING, Phase.EXITING},
    Phase.ENV_CLEAR: {Phase.REPAIR, Phase.STOPPING, Phase.EXITING},
    Phase.REPAIR: {Phase.ROLLBACK, Phase.STOPPING, Phase.EXITING},
    # rolled back -> running; a fault during rollback -> a new repair (STOPPING)
    Phase.ROLLBACK: {Phase.RUNNING, Phase.STOPPING, Phase.EXITING},
    Phase.EXITING: {Phase.DONE},
    Phase.DONE: set(),
}


class Level(enum.Enum):
    """How much of the job a recovery starts again, finest first (docs/recovery.md). ``--recovery`` names the
    finest one the user allows (``process`` includes ``online``); a repair that fails goes to the next."""

    #: no process is replaced: a collective failed while every process lived; the ranks re-form their groups
    #: in the next generation and roll back to the consistent step in place
    ONLINE = "online"
    #: the failed ranks' processes are replaced (on their node, or a spare's); the healthy ranks live on
    PROCESS = "process"
    #: every worker of every node is stopped and started again in the next generation
    JOB = "job"


#: the levels whose repair keeps the healthy ranks' processes: they follow the ranks' milestones
IN_PLACE = frozenset({Level.ONLINE, Level.PROCESS})


#: the milestone that ends a process-level phase, and the phase after it
MILESTONE_OF = {
    Phase.STOPPING: (Milestone.STOPPED, Phase.ENV_CLEAR),
    Phase.REPAIR: (Milestone.JOINED, Phase.ROLLBACK),
    Phase.ROLLBACK: (Milestone.RESUMED, Phase.RUNNING),
}


class IllegalTransition(Exception):
    pass


@dataclass(frozen=True)
class Heard:
    """How many keepalives a node's agent had sent when a failed collective was first seen."""

    node_rank: int
    keepalives: int


@dataclass(frozen=True)
class HeldCollective:
    """A rank's failed collective the policy holds (``policy.on_collective_seen``): the generation it
    failed in, since when (the controller's monotonic clock: a successor does not go on from it), and
    every node's keepalive count then."""

    generation: int
    since: float
    heard: tuple[Heard, ...]


@dataclass(frozen=True)
class JobView:
    node_count: int
    max_restarts: int
    world_size: int = 0
    #: the finest level the user allows (--recovery)
    recovery: Level = Level.JOB
    #: ranks of the current generation that run under ftrun.elastic (process level needs all)
    library_ranks: int = 0
    #: why the script's layout rules process level out (its ranks said so), or ""
    refusal: str = ""
    phase: Phase = Phase.RUNNING
    #: the level of the repair under way (meaningful outside RUNNING). An online repair goes down to process
    #: level when a process dies or hangs meanwhile
    level: Level = Level.JOB
    generation: int = 0
    #: the generation the last START began: its healthy ranks live on through process-level repairs
    start_generation: int = 0
    restarts_used: int = 0
    #: process level: ranks being replaced in this generation, and the nodes that must reap them
    replacing: frozenset[int] = frozenset()
    clearing: frozenset[int] = frozenset()
    succeeded: frozenset[int] = frozenset()
    acknowledged: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()
    #: every worker failure of the job, oldest first: the first is the root cause
    failures: tuple[WorkerFailure, ...] = ()
    #: nodes lost and replaced by a spare, each as one line
    replaced_nodes: tuple[str, ...] = ()
    #: --nnodes MIN: with fewer nodes than the rendezvous gave, the job may go on down to MIN
    #: (0: no scale-in)
    min_nodes: int = 0
    #: node ranks left empty by a scale-in (no agent holds them; a node that joins later may)
    vacant: frozenset[int] = frozenset()
    #: nodes lost and left out (scale-in), and nodes that joined later (grow back), each as one line
    resized: tuple[str, ...] = ()
    #: the restart under way changes the job's size by choice (a node joined): it spends no budget
    free_restart: bool = False
    #: the ranks take snapshots (--snapshot-every): a rollback with no healthy replica goes back to them
    snapshots: bool = False
    #: process level: the agents were told to start this repair's replacements
    replacements_started: bool = False
    #: ranks replaced in earlier generations of the repair under way: their replacements hold no training
    #: state yet, so they are no replica (with ``replacing``, whether a healthy replica is left)
    stateless: frozenset[int] = frozenset()
    #: the job-level restart under way was decided because every rank of the generation failed (no
    #: healthy replica left), not because a process-level repair failed
    no_replica: bool = False
    #: the job-level restart under way was decided because the ranks' rollback found no state to go
    #: back to (they said why; the narrator tells it, with what would have avoided it)
    fallback: RollbackFailure | None = None
    exit_code: int = 0
    reason: str = ""
    #: under etcd, a successor's: the generation its predecessor may have told the ranks of without its journal
    #: holding it (the healthy ranks hear of a repair before the journal is written, and a controller may die
    #: while its journal waits for etcd). The next generation comes after it: reused, it found the ranks
    #: already past its first milestones in the old store, and the repair waited for them until its deadline
    unjournaled: int = 0
    #: a rank's failed collective, held before it counts as a fault of its own (policy.ONLINE_GRACE)
    held: HeldCollective | None = None

    def move(self, phase: Phase, **changes) -> "JobView":
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.phase.name} -> {phase.name}")
        return dataclasses.replace(self, phase=phase, **changes)

    @property
    def next_generation(self) -> int:
        """The generation a new repair or restart takes."""
        return max(self.generation, self.unjournaled) + 1

    @property
    def present(self) -> frozenset[int]:
        return frozenset(range(self.node_count)) - self.lost - self.vacant

    @property
    def budget_left(self) -> int:
        return self.max_restarts - self.restarts_used

    @property
    def every_rank(self) -> frozenset[int]:
        return frozenset(range(self.world_size))

    @property
    def watches_collectives(self) -> bool:
        """Whether a rank's failed collective can start or end a repair now: while process level is ready (else
        a rank's own wait for an announcement ends it), and during an online repair."""
        return (self.phase is Phase.RUNNING and self.process_level_ready) or (
            self.level is Level.ONLINE and self.phase in REPAIR_PHASES)

    @property
    def process_level_ready(self) -> bool:
        return (self.recovery is Level.PROCESS and self.world_size > 0 and self.library_ranks >= self.world_size
                and not self.refusal)


Decision = tuple[JobView, list[Command]]
