"""``MindSporeJob``: one MindSpore rank's training state under ftrun (the package's text says how a script
uses it): the registered Cells, the step, the snapshots, its progress for its agent and, on Ascend at
process level, its repair."""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from typing import Any, Iterator

from ftrun.contract import Milestone, RelayFolder, WorkerEnv
from ftrun.errors import WORKER_SETTING_EXIT
from ftrun.messages import from_json
from ftrun.mindspore import DEFAULT_CLUSTER_TIMEOUT
from ftrun.mindspore_elastic.arrays import MindSporeArrays
from ftrun.mindspore_elastic.backends import AscendHooks
from ftrun.mindspore_elastic.link import RepairChannel
from ftrun.mindspore_elastic.repair import MindSporeRepair
from ftrun.snapshots.format import SnapshotError, SnapshotTooLarge
from ftrun.snapshots.plan import RestorePlan, RestoreSource
from ftrun.snapshots.rank import SnapshotWriter, load_first_good, load_own, own_steps, snapshot_signer, sources_to_restore
from ftrun.step_times import StepClock
from ftrun.steps import COMMITTED, StepDecision, StepGuard, StepOutcome

log = logging.getLogger("ftrun.mindspore_elastic")
#: how often a rank writes its committed step for its agent to relay (a torch rank's heartbeat interval)
PROGRESS_INTERVAL = 1.0


class MindSporeJob:
    """One MindSpore rank's training state under ftrun: the registered Cells, the step, the snapshots."""

    def __init__(self, sharded: bool = False):
        self.env = WorkerEnv.from_environ()
        #: every rank holds its own part of the state (model parallelism): each restores its own snapshot
        self.sharded = sharded
        self.objects: dict[str, Any] = {}
        self._step = 0
        #: restore() ran: the generation's restore is done once, by it or by the first steps()
        self._restored = False
        self.snapshots: SnapshotWriter | None = None
        if self.env is not None:
            self.snapshots = SnapshotWriter.from_settings(self.env.snapshots, self.env.rank, self.env.world_size,
                                                          sharded, MindSporeArrays())
        #: the node's folder through which the agent relays this rank's progress, and its repairs
        self.relay = RelayFolder(self.env.relay_dir) if self.env is not None and self.env.relay_dir else None
        #: when the progress was last written (at most every PROGRESS_INTERVAL seconds, and at the end)
        self._progress_at = 0.0
        #: process level on Ascend: this rank's part in every repair
        self.repair = _make_repair(self) if self.relay is not None and self.env.recovery == "process" else None
        #: begin_step() came, and its end_step() not yet
        self._open = False
        #: how many steps ended through the protocol (steps() tells a body that used it from one that did not)
        self._ends = 0
        self._guard = StepGuard(self)
        #: each committed step's time, written with the progress for the agent to relay (stragglers, the stall
        #: bound). All of it counts as compute, its wait 0: MindSpore's collectives run inside its compiled
        #: graph (an ``ops.AllReduce`` in a Cell, ``Model.train``'s gradient reduction), where a Python library
        #: sees no call to time, as ``ftrun.elastic``'s wrapped process groups do
        self.clock = StepClock()

    @property
    def rank(self) -> int:
        return self.env.rank if self.env is not None else int(os.environ.get("RANK_ID", "0"))

    @property
    def world_size(self) -> int:
        return self.env.world_size if self.env is not None else int(os.environ.get("RANK_SIZE", "1"))

    @property
    def generation(self) -> int:
        """The job's generation: 0 at the start, one more after each restart (0 outside ftrun)."""
        return self.env.generation if self.env is not None else 0

    @property
    def step(self) -> int:
        """The next step to run: the number of steps committed so far."""
        return self._step

    def register(self, **objects) -> None:
        """Register training state: Cells (the network, the optimizer, a ``TrainOneStepCell``) whose
        ``parameters_dict()`` holds it. A parameter that several of them hold (the optimizer holds the
        network's) is taken once, by its name, as ``mindspore.save_checkpoint`` takes it."""
        for name, obj in objects.items():
            if not hasattr(obj, "parameters_dict"):
                raise TypeError(f"{name}: {type(obj).__name__} has no parameters_dict() (register Cells)")
            self.objects[name] = obj

    def states(self) -> collections.OrderedDict:
        """Every registered parameter as a numpy array, by its name (what a snapshot holds)."""
        found: collections.OrderedDict = collections.OrderedDict()
        for obj in self.objects.values():
            for name, parameter in obj.parameters_dict().items():
                if name not in found:
                    found[name] = parameter.asnumpy()
        return found

    def load(self, states: dict) -> None:
        """Put ``states`` (parameter name -> array) into every registered parameter."""
        import mindspore
        import numpy as np

        if self.snapshots is not None:
            self.snapshots.wait()
        missing = [name for obj in self.objects.values() for name in obj.parameters_dict() if name not in states]
        if missing:
            raise SnapshotError(f"the snapshot holds no parameter {missing[0]!r} ({len(missing)} missing): "
                                "was the same network registered?")
        for obj in self.objects.values():
            for name, parameter in obj.parameters_dict().items():
                parameter.set_data(mindspore.Tensor(np.array(states[name])))  # a copy: the blob goes away

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Step numbers ``start..total-1``; after a restart or a repair, from the restored step.

        The step number is the data position: make each step's batch a function of it. The step is
        committed when the loop asks for the next one, and snapshotted every --snapshot-every steps.
        ``start`` is where a fresh job begins (e.g. the step after the one in your own checkpoint); a
        restored snapshot of a later step wins. With ``--recovery process`` on Ascend, put the step's
        body in ``with job.guard():``: a fault elsewhere then repairs this rank in place, and the loop
        goes on from the step every rank agreed on (a replacement first receives the state).
        """
        repair = self.repair
        if repair is not None and repair.spawned_for is not None:
            self._restored = True
            repair.recover(repair.generation)
        self.restore(start)
        while self._step < total:
            if repair is not None and (announced := repair.announced()) is not None:
                repair.recover(announced)  # announced between two steps: nothing to interrupt
                continue
            self._guard = guard = StepGuard(self)
            ends = self._ends
            self.clock.begin()  # a body without guard() begins here; one with it, again at begin_step()
            yield self._step
            if guard.decision is not None:
                self._go_on(guard.decision)
            elif self._ends == ends:  # a loop without guard(): the body finished, so the step did
                self.end_step()
        self.close()

    def guard(self) -> StepGuard:
        """The context manager for the current step's body (see :meth:`steps`)."""
        return self._guard

    # -- the step protocol: what steps(), guard() and the callback are built on ----------------------------

    def begin_step(self) -> None:
        """The body of step :attr:`step` begins: until :meth:`end_step`, a repair announced meanwhile stops
        the device under it (process level on Ascend), so that a step blocked in a collective ends."""
        self._open = True
        self.clock.begin()
        if self.repair is not None:
            self.repair.in_step = True

    def end_step(self, error: BaseException | None = None) -> StepOutcome:
        """The body of the step ended: ``error`` is what it raised (None when it finished). Returns a
        :class:`~ftrun.steps.StepOutcome`: committed (snapshotted when one is due); repaired (a fault elsewhere
        stopped the step, the repair is done, and the loop goes on from ``outcome.step``, the step every rank
        agreed on); or lost (not ours to repair, or no process-level repair here: raise ``outcome.error``).
        Without :meth:`begin_step` first, no error commits the step (as the callback does after each of
        ``Model.train``'s steps)."""
        return self._go_on(self._end(error))

    def _end(self, error: BaseException | None) -> StepDecision:
        """How the step ended, and the step committed if it did; the repair is left to :meth:`_go_on`."""
        self._ends += 1
        self._open = False
        if self.repair is not None:
            self.repair.in_step = False
        self.clock.end(committed=error is None)
        if error is None:
            self.commit()
            return COMMITTED
        target = self.repair.target_after(error) if self.repair is not None else None
        return StepDecision(target) if target is not None else StepDecision(lost=error)

    def _go_on(self, decision: StepDecision) -> StepOutcome:
        """The repair the step's end calls for, if any."""
        if decision.target is not None:
            self.repair.recover(decision.target)
        return decision.outcome(self._step)

    # -- what the repair needs of the state (ftrun.mindspore_repair.RepairedState) ---------------------

    def parameters(self) -> list:
        """Every registered Parameter, once each, in registration order: what ``send_recv`` carries (both
        ends list them alike, running the same script)."""
        found: dict[str, Any] = {}
        for obj in self.objects.values():
            for name, parameter in obj.parameters_dict().items():
                found.setdefault(name, parameter)
        return list(found.values())

    def held_snapshots(self) -> list[int]:
        """The steps of this rank's snapshots in its agent's memory, newest first."""
        return own_steps(self.snapshots.folder, self.rank) if self.snapshots is not None else []

    def load_snapshot(self, step: int) -> None:
        assert self.snapshots is not None
        self.load(load_own(self.snapshots.folder, self.rank, step, MindSporeArrays()))

    def resume_at(self, step: int) -> None:
        """Training goes on from ``step``, the state of which this rank now holds."""
        self._step = step
        if self.snapshots is not None:
            self.snapshots.resume_at(step)

    def commit(self) -> None:
        """One more step is done (``steps()`` calls it; a loop of one's own, or the callback, calls it
        after each step): snapshot the state when one is due."""
        self._step += 1
        if self.repair is not None:
            self.repair.step_committed()
        if self.relay is not None and time.monotonic() - self._progress_at >= PROGRESS_INTERVAL:
            self._tell_progress()
        if self.snapshots is None or not self.snapshots.due(self._step):
            return
        try:
            self.snapshots.write(self._step, self.states())
        except SnapshotTooLarge as e:  # any restart would fail the same way: say so, and say not to retry
            print(f"ftrun.mindspore_elastic: {e}", file=sys.stderr, flush=True)
            os._exit(WORKER_SETTING_EXIT)

    def close(self) -> None:
        """Let the snapshot under way complete (its sum is made by a thread of this rank); stop the repair watch."""
        if self.snapshots is not None:
            self.snapshots.wait()
        if self.repair is not None:
            self.repair.close()
        if self.relay is not None:
            self._tell_progress()

    def _tell_progress(self) -> None:
        """This rank's committed step and its step times, for its agent to relay (the status view, the job's
        summary, stragglers)."""
        self._progress_at = time.monotonic()
        try:
            self.relay.write(self.relay.progress(self.rank), f"{self._step}\n{self.clock.times().to_text()}")
        except OSError as e:  # the agent's folder is gone: the job is ending; training goes on regardless
            log.debug("rank %d: cannot write its progress: %s", self.rank, e)

    def callback(self):
        """A ``mindspore.train.Callback`` for ``Model.train``: it restores the newest snapshot as training
        begins (unless :meth:`restore` ran already) and commits each step as it ends, snapshotting every
        --snapshot-every steps. ``Model.train`` counts its own steps: call :meth:`restore` before it and
        resume the data where :attr:`step` says (``job.step // steps_per_epoch`` epochs in, say)."""
        from mindspore.train import Callback

        job = self

        class FtrunSnapshots(Callback):
            def on_train_begin(self, run_context) -> None:
                job.restore()

            def on_train_step_begin(self, run_context) -> None:
                job.clock.begin()  # the step's time, to its end below

            def on_train_step_end(self, run_context) -> None:
                job.end_step()  # Model.train's step finished: it commits (no begin_step: nothing guards it)

            def on_train_end(self, run_context) -> None:
                job.close()

        return FtrunSnapshots()

    def restore(self, start: int = 0) -> int:
        """Put back the state of the restore plan's step (a restarted generation's) unless ``start`` (the
        script's own checkpoint's) is later; the step training goes on from. The first ``steps()`` calls
        it, unless the script did."""
        if not self._restored:
            self._restored = True
            if not self._restore(start):
                self._step = max(self._step, start)
        return self._step

    def _restore(self, start: int) -> bool:
        settings = self.env.snapshots if self.env is not None else None
        if settings is None or self.snapshots is None or self.generation <= 0:
            return False
        plan = read_plan(settings.restore_plan)
        sources = sources_to_restore(plan, self.rank, start, self.generation)
        if not sources:
            return False
        began = time.monotonic()
        source, states = load_first_good(sources, plan.step, settings.folder, snapshot_signer(settings.folder),
                                         _skipped, MindSporeArrays())
        self.load(states)
        self._step = plan.step
        self.snapshots.resume_at(plan.step)
        log.warning("rank %d: restored step %d from %s on node %d in %.2fs", self.rank, plan.step, source.where,
                    source.node_rank, time.monotonic() - began)
        return True


def _make_repair(job: MindSporeJob) -> MindSporeRepair:
    """The rank's repair: its hooks on its device, its node's relay folder. A rank that starts with the
    job (not a replacement) says it joined, which tells the controller that process level is possible."""
    env = job.env
    assert env is not None
    repair = MindSporeRepair(job, AscendHooks(int(os.environ.get("DEVICE_ID", env.device_index))),
                             RepairChannel(RelayFolder(env.relay_dir), env.rank), env.generation, env.replacement,
                             timeout=float(os.environ.get("MS_TOPO_TIMEOUT") or DEFAULT_CLUSTER_TIMEOUT),
                             fault_wait=env.heartbeat_timeout)
    if not env.replacement:
        repair.channel.reach(env.generation, Milestone.JOINED)
    repair.start_watch()
    return repair


def _skipped(source: RestoreSource) -> None:
    """A damaged copy: load_first_good logged it and goes on to the next. A MindSpore rank cannot tell the
    controller (it reads no control store), so a later plan may name the copy again (the agents' own check,
    when the ranks stop, leaves out those damaged by then)."""


def read_plan(path: str) -> RestorePlan | None:
    """The restore plan the agent left in ``path`` (None for none)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return from_json(RestorePlan, f.read())
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.error("cannot read the restore plan %s: %s", path, e)
        return None
