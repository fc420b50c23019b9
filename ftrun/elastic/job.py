"""The worker library's face: ``ElasticJob``, a training loop that survives the loss of other ranks.

It puts three parts together and holds no state of its own beyond the script's settings: the training
state (state.py), the link to the control plane (link.py: a null one under plain torchrun) and the
repair (repair.py), which moves the process groups (groups.py) to a new generation and puts the
state back to the consistent step.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import weakref
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch
import torch.distributed as dist

from ftrun.auth import Signer
from ftrun.contract import COLLECTIVE_TIMEOUT, WorkerEnv
from ftrun.elastic.arrays import TorchSnapshotWriter, snapshot_signer
from ftrun.elastic.backends import CommBackend, make_comm_backend
from ftrun.elastic.ddp import BucketLayout, ElasticDDP, torch_ddps, track_torch_ddp
from ftrun.elastic.groups import GroupSet, install
from ftrun.elastic.layout import ReplicaLayout
from ftrun.elastic.link import ControlLink, NullLink
from ftrun.elastic.meshes import PartMesh, read_part_mesh
from ftrun.elastic.repair import Repair
from ftrun.elastic.saves import saving, track_checkpoint, track_saves
from ftrun.elastic.shards import is_dtensor
from ftrun.elastic.state import TrainingState
from ftrun.snapshots.format import SnapshotError
from ftrun.steps import COMMITTED, StepDecision, StepGuard, StepOutcome

log = logging.getLogger("ftrun.elastic")
#: init()'s fault_wait: after a collective raises, seconds to wait for the controller to announce a repair
FAULT_WAIT = 10.0
#: how long the interpreter's end waits for a snapshot still being copied and summed (memory speed)
COMMIT_DEADLINE = 60.0


class ElasticJob:
    """One rank's membership in an ftrun job: its process group, its training state, its steps.

    Outside ftrun (plain torchrun) it initialises the process group from the
    environment as usual and its steps simply run, so the same script works under both.
    """

    def __init__(self, backend: str | None = None, collective_timeout: float = COLLECTIVE_TIMEOUT, fault_wait: float = FAULT_WAIT,
                 sharded: bool = False, snapshot_overlap: bool = True):
        self.env = WorkerEnv.from_environ()
        #: every rank holds its own part of the state: a repair restores each rank's own snapshot, where
        #: nothing the script did shows replicas (settle_layout)
        self.sharded = sharded
        #: copy the parameters and the optimizer's state into a snapshot while the next step's forward
        #: and backward run (the optimizer's step waits for the copy)
        self.snapshot_overlap = snapshot_overlap
        # ftrun names the rank's device among those it sees (it differs from LOCAL_RANK after a move)
        device_index = self.env.device_index if self.env is not None else int(os.environ.get("LOCAL_RANK", "0"))
        self.backend: CommBackend = make_comm_backend(backend, device_index)
        self.collective_timeout = collective_timeout
        #: after a collective raises, how long to wait for the controller to announce a repair
        self.fault_wait = fault_wait
        self._after_repair: list[Callable[[], None]] = []
        #: the mesh job.mesh() declared; else pure data parallelism (or every rank alone, with
        #: sharded=True), checked at the first steps()
        self._declared: ReplicaLayout | None = None
        #: a mesh of torch's whose replica dimensions the first step shows (meshes.py); None once settled
        self._part_mesh: PartMesh | None = None
        self._started = False
        #: the bucket layouts of torch's DDPs (registered state), from the first steps() on
        self._layouts: list[BucketLayout] = []
        #: the step the steps began at (start_steps()); None before
        self._began: int | None = None
        #: the first step past _began was told to the link
        self._told = False
        #: begin_step() came, and its end_step() not yet
        self._open = False
        #: how many steps ended through the protocol (steps() tells a body that used it from one that did not)
        self._ends = 0
        self.link: ControlLink | NullLink
        if self.env is None:
            self.link = NullLink()
            dist.init_process_group(self.backend.name)
            self.state = TrainingState(_default_layout(dist.get_world_size(), sharded), overlap=snapshot_overlap)
            self._guard = StepGuard(self)
            return
        _dump_stack_on_signal()
        track_torch_ddp()
        snapshots = TorchSnapshotWriter.for_rank(self.env.snapshots, self.env.rank, self.env.world_size, sharded)
        self._signer = snapshot_signer(snapshots.folder) if snapshots else Signer()
        self.link = link = ControlLink(self.env, self._signer, collective_timeout, fault_wait)
        self.state = TrainingState(_default_layout(self.env.world_size, sharded), snapshots, snapshot_overlap,
                                   rank=self.env.rank, needs_state=self.env.replacement,
                                   lost_collective=link.lost_collective)
        self._guard = StepGuard(self)
        #: every process group the script makes, the same objects in every generation
        self.groups = GroupSet(self.backend, link.store.raw, link.keys.process_group, collective_timeout)
        install(self.groups, self.backend.devices())
        # a replacement's peers are mid-training: its setup's collectives are answered locally
        self.groups.local = self.env.replacement
        self.repair = Repair(self.state, self.groups, link, self._after_repair)
        self.repair.join(self.env.generation)
        link.repairing = self.state.needs_state  # a replacement is part of the repair until it has the state
        _JOBS.add(self)
        track_saves(link.saves)
        link.start(self.groups, progress=lambda: self.state.step)

    # -- the user's side ------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def device(self) -> torch.device:
        """This rank's device (``cuda:N``, ``npu:N`` or ``cpu``): use it instead of LOCAL_RANK, which
        stops naming the device when ftrun moves a rank off an isolated one."""
        return self.backend.device()

    @property
    def generation(self) -> int:
        """The generation this rank's process groups belong to (0 under plain torchrun)."""
        return self.link.generation

    @property
    def layout(self) -> ReplicaLayout:
        """Which ranks hold copies of each other's state, as a repair goes by it."""
        return self.state.layout

    @property
    def snapshots(self) -> TorchSnapshotWriter | None:
        """This rank's snapshots into its agent's memory (--snapshot-every), or None."""
        return self.state.snapshots

    @property
    def receives_state(self) -> bool:
        """True in a replacement rank: a healthy peer sends it the registered state at the first
        ``steps()``, so there is no need to load a checkpoint from disk first."""
        return self.state.needs_state

    @property
    def step(self) -> int:
        """The next step to run: the number of steps committed so far."""
        return self.state.step

    def on_resize(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(old_world_size, new_world_size)`` now when this generation runs in a world
        of another size than the one before it (after a scale-in or a grow-back, which restart every
        rank): the place to rescale the batch size or the learning rate. Never called otherwise."""
        previous = (self.env.previous_world_size if self.env is not None else 0) or self.world_size
        if previous != self.world_size:
            callback(previous, self.world_size)

    def register(self, **objects) -> None:
        """Register training state: anything with ``state_dict()`` / ``load_state_dict()``.

        Models, optimizers, LR schedulers, samplers, your own objects. After a repair, ranks that
        lost their state receive every registered object's state from a healthy replica.
        Optimizers are watched so that a step interrupted after ``optimizer.step()`` is known to
        be half applied (that rank then receives the state too).
        """
        for name, obj in objects.items():
            self.state.register(name, obj)

    def saving(self) -> ContextManager[None]:
        """A context manager around a checkpoint save the library does not see itself (``torch.save`` and
        ``torch.distributed.checkpoint``'s saves it does): while it runs the rank's heartbeat says it saves,
        so that the other ranks waiting for it meanwhile are no stall, and its time is measured (the longest
        save sets how long a save may take). Outside ftrun it does nothing."""
        return saving()

    def after_repair(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on every rank at the end of each process-level repair, once the state is
        back and before the loop goes on: the place to remake what a library set up once with its
        peers at its first use (a pipeline schedule's warm-up, say), since the replacement rank sets
        it up anew and the healthy ranks must do so with it."""
        self._after_repair.append(callback)

    def ddp(self, module: torch.nn.Module, group=None) -> ElasticDDP:
        """Wrap ``module`` for data parallelism, as DistributedDataParallel does, repair-proof.

        ``group``: the data-parallel group (a ProcessGroup or a 1-D DeviceMesh, e.g. ``mesh["dp"]``);
        the default group if None.
        """
        wrapper = ElasticDDP(module, group)
        self.state.add_wrapper(wrapper)
        return wrapper

    def mesh(self, dims: Mapping[str, int], replicate: tuple[str, ...] | None = None, device_type: str | None = None):
        """A torch ``DeviceMesh`` over every rank, e.g. ``job.mesh({"dp": 2, "tp": 2})``, that tells ftrun
        which ranks hold copies of each other's state.

        Along a replica dimension (by default those named dp, ddp, data, replicate or dp_replicate;
        ``replicate=`` names them otherwise) ranks hold the same state, and a replacement receives
        its state from a healthy peer there. Along the others (tp, pp, FSDP's shard) each rank holds
        its own part; with no healthy replica left a repair restores the snapshots. A dimension that
        the model's DTensors are sharded over is no replica dimension, whatever its name.
        """
        from torch.distributed.device_mesh import init_device_mesh

        layout = ReplicaLayout.declared(dict(dims), replicate)
        if layout.size != self.world_size:
            raise ValueError(f"the mesh {layout.describe()} holds {layout.size} ranks; the job has {self.world_size}")
        self._declared = self.state.layout = layout
        return init_device_mesh(device_type or self.backend.device_type, layout.shape, mesh_dim_names=layout.names)

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Step numbers ``start..total-1``; after a repair, the loop goes on from the consistent step.

        The step number is the data position: make each step's batch a function of it. Put the
        step's body in ``with job.guard():``. ``start`` is where a fresh job begins (e.g. the step
        after the one in your own checkpoint); a replacement rank resumes where the others are.
        A loop built on the step protocol itself (:meth:`start_steps`, :meth:`begin_step`,
        :meth:`end_step`), as a framework's callbacks are, gives the same steps.
        """
        self.start_steps(total, start)
        while self.state.step < total:
            self._guard = guard = StepGuard(self)
            ends = self._ends
            yield self.state.step
            if guard.decision is not None:
                self._go_on(guard.decision)
            elif self._ends == ends:  # a loop without guard(): the body finished, so the step did
                self.end_step()

    def guard(self) -> StepGuard:
        """The context manager for the current step's body (see :meth:`steps`)."""
        return self._guard

    # -- the step protocol: what steps(), guard() and the frameworks' integrations are built on -----------------

    def start_steps(self, total: int, start: int = 0) -> int:
        """Before the first :meth:`begin_step`: the setup is over. Returns the step to run first.

        ``total`` is the number of steps the job runs (the controller's status shows it); ``start`` is where
        a fresh job begins (e.g. the step after the one in your own checkpoint). A replacement rank receives
        the registered state from a healthy replica here and starts where its peers are; after a job-level
        restart with ``--snapshot-every``, the snapshot the controller names is restored here.
        :meth:`steps` calls it; a framework's integration calls it where the framework sets its step.
        """
        self._start(total)
        if self.state.needs_state:
            self.repair.recover(self.generation, joined=True)
        elif not self._restore(start):
            self.state.start_at(start)
        self._began, self._told = self.state.step, False
        return self.state.step

    def begin_step(self) -> None:
        """The body of step :attr:`step` begins: from here to :meth:`end_step`, a collective that fails because
        a peer died is recorded rather than left to hang, and the buffers are kept to put back if the step is
        lost. Call :meth:`start_steps` once before the first."""
        if self._began is None and self.link.repairs:  # a replacement would train on without the state
            raise RuntimeError("ftrun.elastic: begin_step() before start_steps() (or a loop over job.steps())")
        self._open = True
        self.state.begin_step()
        self.link.step_begins()

    def end_step(self, error: BaseException | None = None) -> StepOutcome:
        """The body of the step ended: ``error`` is what it raised (None when it finished). Returns a
        :class:`~ftrun.steps.StepOutcome`:

        * committed: the body finished and its collectives held; ``outcome.step`` is the next step;
        * repaired: a fault elsewhere interrupted the step (a collective failed and the controller announced
          a repair); the repair is done, the registered state is the consistent step's, and the loop goes on
          from ``outcome.step`` (it may run this step again: put back what the framework counts);
        * lost: the error is not ours to repair (this rank's own, or no repair was announced within
          ``fault_wait``): raise ``outcome.error`` (the body's error, or the failed collective's when the
          body finished).

        Without :meth:`begin_step` first: no error commits the step (a body run outside the protocol
        finished), and an error is one between two steps (logging, saving): the last step stays committed,
        and the answer is repaired or lost as above.
        """
        return self._go_on(self._end(error))

    def _end(self, error: BaseException | None) -> StepDecision:
        """How the step ended, and its state set accordingly (committed, or its buffers put back); the repair
        is left to :meth:`_go_on`."""
        self._ends += 1
        if not self._open:
            if error is None:
                self.state.commit()
                return COMMITTED
            target = self.link.repair_target(error, self.state.step)
            return StepDecision(target) if target is not None else StepDecision(lost=error)
        self._open = False
        failure = self.link.step_ends()
        if error is None and failure is None:
            self.state.commit()
            return COMMITTED
        if error is None:  # a collective failed, yet the body finished: what it changed is unknown
            self.state.mark_mutated()
            error = failure
        target = self.link.repair_target(error, self.state.step)
        if target is None:
            return StepDecision(lost=error)
        self.state.restore_buffers()  # the forward of the lost step moved running statistics
        return StepDecision(target)

    def _settle_layouts_after_repair(self) -> None:
        for buckets in self._layouts:
            buckets.settle_after_repair()

    def _go_on(self, decision: StepDecision) -> StepOutcome:
        """Do what the step's end calls for: the repair, the first commit's news, the mesh the first step shows."""
        if decision.lost is not None:
            return decision.outcome(self.state.step)
        if decision.target is not None:
            self.repair.recover(decision.target)
        if not self._told and self._began is not None and self.state.step > self._began:
            self._told = True
            self.link.first_step_committed()
        if self._part_mesh is not None:
            self._settle_part_mesh(self._part_mesh, finished=decision.target is None)
        return decision.outcome(self.state.step)

    def close(self) -> None:
        """Leave the job: finish the snapshot under way, stop the heartbeat and the repair watch, destroy
        the process group. A script that ends without it, or raises, still has the first two done as the
        interpreter ends."""
        if self.state.snapshots is not None:
            self.state.snapshots.wait()
        self.link.close(self.state.step)
        if self.link.repairs:
            self.groups.release()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the layout ----------------------------------------------------------------------------------

    def _start(self, total: int) -> None:
        """At the first steps(): the setup is over; settle the layout, or say why a fault will restart the job."""
        if not self.link.repairs or self._started:
            return
        self._started = True
        track_checkpoint()  # a script that imported torch.distributed.checkpoint after init()
        # every torch DDP's bucket layout (one whose inner module was registered, not the wrapper, too)
        self._layouts = [BucketLayout(made) for made in torch_ddps()]
        for index, buckets in enumerate(self._layouts):
            self.state.register(f"torch_ddp{index}_buckets", buckets)
        self._after_repair.insert(0, self._settle_layouts_after_repair)
        if self.env.rank == 0:
            self.link.tell_total_steps(total)
        self.groups.local = False
        self.groups.count_reductions()  # the first step's, for a mesh whose replicas it shows
        layout, refusal, self._part_mesh = settle_layout(self.env.world_size, self.state.objects, self._declared,
                                                         self.sharded, self.groups, self.env.rank)
        self.state.adopt(layout)
        if refusal:
            self.refuse_process_level(refusal)

    def _settle_part_mesh(self, part: PartMesh, finished: bool) -> None:
        """After the first step that finished: the groups it all-reduced the gradients over hold copies."""
        if self.state.layout.known:  # a repair's rollback took it from the ranks that ran the first step
            self._part_mesh = None
            return
        if not finished:  # the step did not finish: the next one shows it
            return
        layout, refusal = part.settle()
        self._part_mesh = None
        self.state.adopt(layout)
        log.info("the registered state lies on the mesh %s", layout.describe())
        if refusal:
            self.refuse_process_level(refusal)

    def refuse_process_level(self, refusal: str) -> None:
        """Process-level repair cannot work (``refusal`` says why: the layout, or what a framework's integration
        does not cover): rank 0 tells the controller, which goes to job level at the next fault, and says why
        in one line unless a generation before this one did (after a job-level restart). Outside ftrun it
        does nothing."""
        if self.env is not None and self.env.rank == 0 and self.link.refuse_process_level(refusal):
            print(f"ftrun.elastic: {refusal}; a fault will restart the job", file=sys.stderr, flush=True)

    # -- restores from snapshots ---------------------------------------------------------------------

    def _restore(self, start: int) -> bool:
        """After a job-level restart: load the state the controller's restore plan names for this rank;
        True when it did."""
        if self.state.snapshots is None or self.generation <= 0:
            return False
        return self.state.restore(self.link.restore_plan(self.generation), start, self.generation, self._signer,
                                  self.link.report_damaged)

    # -- the interpreter's end -----------------------------------------------------------------------

    def _settle_at_exit(self) -> None:
        """The interpreter ends (the script returned or raised, with or without close()): let the snapshot
        under way complete, since a thread still in its Tensor.copy_ then would abort the process, and
        let the threads go."""
        if self.state.snapshots is not None:
            try:
                if not self.state.snapshots.wait(COMMIT_DEADLINE):
                    log.warning("rank %d: the snapshot under way was not complete %.0fs after the script ended",
                                self.env.rank, COMMIT_DEADLINE)
            except SnapshotError as e:
                log.error("%s", e)
        self.link.let_go()


#: the jobs of this process, for the interpreter's end
_JOBS: "weakref.WeakSet[ElasticJob]" = weakref.WeakSet()


@atexit.register
def _settle_jobs() -> None:
    """Before the interpreter tears down, whether the script called close() or not (one that raised did
    not): every job's snapshot completes and its threads go (ElasticJob._settle_at_exit)."""
    for job in list(_JOBS):
        job._settle_at_exit()


def settle_layout(world: int, objects: Mapping[str, Any], declared: ReplicaLayout | None, sharded: bool,
                  groups: GroupSet, rank: int = 0) -> tuple[ReplicaLayout, str, PartMesh | None]:
    """The layout a repair goes by, why process-level repair cannot work ("" when it can), and a mesh whose
    replica dimensions the first step shows (or None), from the registered ``objects``, the mesh the
    script ``declared`` (if it did) and the ``groups`` it made."""
    foreign = groups.foreign_groups()
    if foreign:
        return ReplicaLayout.sharded(world), (f"group {foreign[0]} was made with another backend than ftrun's, and "
                                              "a repair cannot re-form it (leave backend= out of new_group)"), None
    sharded_over = {name for obj in objects.values() for name in _sharded_dims(obj)}
    if declared is not None:
        if sharded_over - set(declared.names):  # over a mesh of its own: no rank can vouch for a copy
            return declared.without(set(declared.replicate)), "", None
        return declared.without(sharded_over), "", None
    # what the state and the groups show comes before init(sharded=True), which says only that each rank
    # holds its own part: HSDP's shards do, and have copies along its replica dimension all the same
    shown = _layout_from_placements(objects, world)
    if shown is not None:  # a mesh made with torch's own API (init_device_mesh), read from the state on it
        log.info("the registered state lies on the mesh %s", shown.describe())
        return shown, "", None
    part = read_part_mesh(dict(objects), world, rank, groups.groups, sharded)
    if isinstance(part, PartMesh):  # tensor parallelism's sub-mesh, or a pipeline's: the first step shows
        return part.layout, "", part
    if sharded:
        return _default_layout(world, True), "", None
    if part is not None:
        return ReplicaLayout.sharded(world), part, None
    made = len(groups.groups) - 1  # besides the default group
    if made or sharded_over:
        what = f"{made} process group{'s' if made != 1 else ''} of its own" if made else "sharded DTensors"
        return ReplicaLayout.sharded(world), (f"this script makes {what} without job.mesh(): ftrun cannot tell "
                                              "which ranks hold copies of each other's state (declare the mesh "
                                              "with job.mesh({...}), or pass init(sharded=True) with "
                                              "--snapshot-every)"), None
    return ReplicaLayout.data_parallel(world), "", None


def _dump_stack_on_signal() -> None:
    """Let the agent ask for every thread's stack (on SIGUSR1) before it kills this rank as hung,
    unless the script uses that signal itself."""
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _default_layout(world_size: int, sharded: bool) -> ReplicaLayout:
    """Until the first steps() settles it: pure data parallelism, or every rank alone with sharded=True."""
    return ReplicaLayout.sharded(world_size) if sharded else ReplicaLayout.data_parallel(world_size)


def _layout_from_placements(objects: Mapping[str, Any], world: int) -> ReplicaLayout | None:
    """The layout that the registered modules' parameters show when every one of them is a DTensor on
    one mesh of the whole job in rank order (as ``init_device_mesh`` makes it): its replica dimensions
    are those every parameter is ``Replicate`` over (HSDP's, whatever their names). None where they
    show nothing of the kind: no DTensors, plain parameters beside them, several meshes, or a mesh of
    part of the job (tensor parallelism's sub-mesh: its data-parallel peers are not on it)."""
    params: list[Any] = [p for obj in objects.values() if isinstance(obj, torch.nn.Module) for p in obj.parameters()]
    if not params or not all(is_dtensor(p) for p in params):  # DTensors from here on
        return None
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh for p in params) or mesh.mesh.flatten().tolist() != list(range(world)):
        return None
    names = mesh.mesh_dim_names or tuple(f"#{i}" for i in range(mesh.ndim))
    replicate = tuple(name for i, name in enumerate(names) if all(p.placements[i].is_replicate() for p in params))
    return ReplicaLayout(tuple(mesh.mesh.shape), tuple(names), replicate)


def _sharded_dims(obj) -> set[str]:
    """The mesh dimensions a registered module's DTensor parameters are sharded over (``#i`` for a
    mesh without names, as FSDP2 makes when it is given none)."""
    if not isinstance(obj, torch.nn.Module):
        return set()
    found: set[str] = set()
    for param in obj.parameters():
        if is_dtensor(param):
            spec: Any = param  # a DTensor
            names = spec.device_mesh.mesh_dim_names or tuple(f"#{i}" for i in range(spec.device_mesh.ndim))
            found.update(name for name, placement in zip(names, spec.placements) if placement.is_shard())
    return found
