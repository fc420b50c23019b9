"""The worker library's core: a training loop that survives the loss of other ranks."""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ftrun.auth import Signer
from ftrun.config import parse_endpoint
from ftrun.elastic.backends import CommBackend, make_backend
from ftrun.elastic.ddp import ElasticDDP, pin_buckets, torch_ddps, track_torch_ddp
from ftrun.elastic.groups import GroupFailed, GroupSet, install
from ftrun.elastic.layout import Layout
from ftrun.elastic.repair import Repair, first_line
from ftrun.elastic.shards import is_dtensor, load_local, local_tensor, to_local
from ftrun.elastic.snapshots import SnapshotWriter, load_first_good, snapshot_signer
from ftrun.errors import WORKER_SETTING_EXIT
from ftrun.keys import JobKeys
from ftrun.snapshots.format import SnapshotError, SnapshotTooLarge
from ftrun.snapshots.plan import RestorePlan, RestoreSource
from ftrun.store import CONNECT_TIMEOUT, ControlStore, connect_store

log = logging.getLogger("ftrun.elastic")
#: how often a rank writes its heartbeat and its committed step
HEARTBEAT_INTERVAL = 1.0
#: the deadline of each of the repair watcher's waits (it waits again after each)
WATCH_TIMEOUT = 3600.0
#: after a repair is announced, how long the main thread may take to notice before it is interrupted: one
#: tick of the watcher. Every collective of the old generation is lost anyway, and a rank whose neighbours
#: are alive (in a ring all-reduce, all but the dead rank's) would otherwise wait out the whole delay
INTERRUPT_AFTER = 0.01
#: exit status of a rank that could not leave a blocked collective after a repair was announced
EXIT_STUCK = 75
#: how long close(), or the interpreter's end, waits for the heartbeat and the repair watch: one still
#: connecting to the store is waited for as long as a connect may take
LET_GO_DEADLINE = CONNECT_TIMEOUT + 1.0
#: how long the interpreter's end waits for a snapshot still being copied and summed (memory speed)
COMMIT_DEADLINE = 60.0


@dataclass(frozen=True)
class WorkerEnv:
    """What ftrun tells a worker through its environment (``FTRUN_*`` and torchrun's variables)."""

    rank: int
    local_rank: int
    world_size: int
    run_id: str
    generation: int
    control_store: str
    replacement: bool
    heartbeat_timeout: float
    #: the node's place in the generation's layout (torchrun's GROUP_RANK)
    node_rank: int = 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnv | None":
        """None when the script runs outside ftrun (plain torchrun, or a single process)."""
        if not env.get("FTRUN_CONTROL_STORE"):
            return None
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            run_id=env["FTRUN_RUN_ID"],
            generation=int(env["FTRUN_GENERATION"]),
            control_store=env["FTRUN_CONTROL_STORE"],
            replacement=env.get("FTRUN_REPLACEMENT") == "1",
            heartbeat_timeout=float(env.get("FTRUN_HEARTBEAT_TIMEOUT", "30")),
            node_rank=int(env.get("GROUP_RANK", "0")),
        )


class StepGuard:
    """``with job.guard():`` around a step's body: commits the step when the body finishes, and
    catches a fault elsewhere (a collective that failed because a peer died) so that
    ``job.steps()`` can repair and go on from the consistent step."""

    def __init__(self, job: "ElasticJob"):
        self.job = job
        self.entered = False
        #: the generation the repair goes to, when a fault elsewhere interrupted the step
        self.repair_target: int | None = None

    def __enter__(self) -> "StepGuard":
        self.entered = True
        self.job._begin_step()
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        job = self.job
        failure = job._end_step()
        if kind is None and failure is None:
            job._commit()
            return False
        if kind is None:  # a collective failed, yet the body finished: what it changed is unknown
            job._mutated = True
            error = failure
        self.repair_target = job._repair_target(error)
        if self.repair_target is None:
            if kind is None:
                raise failure
            return False
        job._restore_buffers()  # the forward of the lost step moved running statistics
        return True  # swallowed: steps() repairs and goes on from the consistent step


class ElasticJob:
    """One rank's membership in an ftrun job: its process group, its training state, its steps.

    Outside ftrun (plain torchrun) it initialises the process group from the
    environment as usual and its steps simply run, so the same script works under both.
    """

    def __init__(self, backend: str | None = None, collective_timeout: float = 300.0, fault_wait: float = 10.0,
                 sharded: bool = False, snapshot_overlap: bool = True):
        self.env = WorkerEnv.from_environ()
        #: every rank holds its own part of the state: a repair restores each rank's own snapshot
        self.sharded = sharded
        #: copy the parameters and the optimizer's state into a snapshot while the next step's forward
        #: and backward run (the optimizer's step waits for the copy)
        self.snapshot_overlap = snapshot_overlap
        # ftrun names the rank's device among those it sees (it differs from LOCAL_RANK after a move)
        device_index = int(os.environ.get("FTRUN_DEVICE_INDEX") or os.environ.get("LOCAL_RANK", "0"))
        self.backend: CommBackend = make_backend(backend, device_index)
        self.collective_timeout = collective_timeout
        #: after a collective raises, how long to wait for the controller to announce a repair
        self.fault_wait = fault_wait
        self._objects: dict[str, Any] = {}
        self._wrappers: list[ElasticDDP] = []
        self._after_repair: list[Callable[[], None]] = []
        self._step = 0
        self._mutated = False
        self._needs_state = False
        self._repairing = False
        self._guard = StepGuard(self)
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        #: the key, this rank's own, that the repair watch waits on next or now ("": none yet; _let_go rings it)
        self._watch_key = ""
        #: which ranks hold copies of each other's state: job.mesh() declares it; else pure data
        #: parallelism (or every rank alone, with sharded=True), checked at the first steps()
        self._layout: Layout | None = None
        self._started = False
        #: this rank's snapshots into its agent's memory (--snapshot-every), or None
        self.snapshots: SnapshotWriter | None = None
        if self.env is None:
            dist.init_process_group(self.backend.name)
            self.layout = _default_layout(dist.get_world_size(), sharded)
            self.generation = 0
            return
        _dump_stack_on_signal()
        track_torch_ddp()
        self.keys = JobKeys(self.env.run_id)
        self.snapshots = SnapshotWriter.from_environ(self.env.rank, self.env.world_size, sharded)
        self._signer = snapshot_signer(self.snapshots.folder) if self.snapshots else Signer()
        endpoint = parse_endpoint(self.env.control_store, 0, "FTRUN_CONTROL_STORE")
        self.store = ControlStore(connect_store(endpoint, timeout=collective_timeout), endpoint, is_host=False,
                                  signer=self._signer)
        self.layout = _default_layout(self.env.world_size, sharded)
        self.generation = -1
        self._spawned_for = self.env.generation if self.env.replacement else None
        self._needs_state = self.env.replacement
        #: every process group the script makes, the same objects in every generation
        self.groups = GroupSet(self.backend, self.store.raw, self.keys.process_group, collective_timeout)
        install(self.groups, self.backend.devices())
        # a replacement's peers are mid-training: its setup's collectives are answered locally
        self.groups.local = self.env.replacement
        self.repair = Repair(self)
        self.repair.join(self.env.generation)
        self._repairing = self._needs_state  # a replacement is part of the repair until it has the state
        self._heartbeat = threading.Thread(target=self._beat, name="ftrun-heartbeat", args=(endpoint,), daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="ftrun-repair-watch", args=(endpoint,), daemon=True)
        _JOBS.add(self)
        self._heartbeat.start()
        self._watcher.start()

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
    def receives_state(self) -> bool:
        """True in a replacement rank: a healthy peer sends it the registered state at the first
        ``steps()``, so there is no need to load a checkpoint from disk first."""
        return self._needs_state

    @property
    def step(self) -> int:
        """The next step to run: the number of steps committed so far."""
        return self._step

    def on_resize(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(old_world_size, new_world_size)`` now when this generation runs in a world
        of another size than the one before it (after a scale-in or a grow-back, which restart every
        rank): the place to rescale the batch size or the learning rate. Never called otherwise."""
        previous = int(os.environ.get("FTRUN_PREVIOUS_WORLD_SIZE") or self.world_size)
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
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict()")
            self._objects[name] = obj
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._on_optimizer_step)
            if self.env is not None and pin_buckets(obj):
                log.info("%s: torch DDP's bucket layout pinned (a replacement rank lays its buckets out the same)", name)

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
        self._wrappers.append(wrapper)
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

        layout = Layout.declared(dict(dims), replicate)
        if layout.size != self.world_size:
            raise ValueError(f"the mesh {layout.describe()} holds {layout.size} ranks; the job has {self.world_size}")
        self._layout = self.layout = layout
        return init_device_mesh(device_type or self.backend.device_type, layout.shape, mesh_dim_names=layout.names)

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Step numbers ``start..total-1``; after a repair, the loop goes on from the consistent step.

        The step number is the data position: make each step's batch a function of it. Put the
        step's body in ``with job.guard():``. ``start`` is where a fresh job begins (e.g. the step
        after the one in your own checkpoint); a replacement rank resumes where the others are.
        """
        self._start(total)
        if self._needs_state:
            self.repair.recover(self.generation, joined=True)
        elif not self._restore(start) and self._step < start:
            self._step = start
        while self._step < total:
            self._guard = StepGuard(self)
            yield self._step
            if self._guard.repair_target is not None:
                self.repair.recover(self._guard.repair_target)
            elif not self._guard.entered:
                self._commit()  # a loop without guard(): the body finished, so the step did

    def guard(self) -> StepGuard:
        """The context manager for the current step's body (see :meth:`steps`)."""
        return self._guard

    def close(self) -> None:
        """Leave the job: finish the snapshot under way, stop the heartbeat and the repair watch, destroy
        the process group. A script that ends without it, or raises, still has the first two done as the
        interpreter ends."""
        if self.snapshots is not None:
            self.snapshots.wait()
        self._let_go()
        try:
            self.store.set_text(self.keys.rank_progress(self.env.rank), str(self._step))  # the final step
        except Exception:
            pass  # the controller is gone already
        if self.env is not None:
            self.groups.release()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the layout ----------------------------------------------------------------------------------

    def _start(self, total: int) -> None:
        """At the first steps(): the setup is over; settle the layout, or say why a fault will restart the job."""
        if self.env is None or self._started:
            return
        self._started = True
        for made in torch_ddps():  # a torch DDP whose inner module was registered, not the wrapper
            pin_buckets(made)
        if self.env.rank == 0:
            self.store.set_text(self.keys.total_steps, str(total))  # the status view's progress and ETA
        self.groups.local = False
        self.layout, refusal = self._settle_layout()
        if self.snapshots is not None:
            self.snapshots.sharded = len(self.layout.replica_sets()) > 1
        if refusal:
            if self.env.rank == 0 and not self.env.replacement:
                print(f"ftrun.elastic: {refusal}; a fault will restart the job", file=sys.stderr, flush=True)
            self.store.set_text(self.keys.process_level_refused, refusal)

    def _settle_layout(self) -> tuple[Layout, str]:
        """The layout a repair goes by, and why process-level repair cannot work ("" when it can)."""
        world = self.env.world_size
        foreign = self.groups.foreign_groups()
        if foreign:
            return Layout.sharded(world), (f"group {foreign[0]} was made with another backend than ftrun's, and a "
                                           "repair cannot re-form it (leave backend= out of new_group)")
        sharded_over = {name for obj in self._objects.values() for name in _sharded_dims(obj)}
        if self._layout is not None:
            if sharded_over - set(self._layout.names):  # over a mesh of its own: no rank can vouch for a copy
                return self._layout.without(set(self._layout.replicate)), ""
            return self._layout.without(sharded_over), ""
        if self.sharded:
            return _default_layout(world, True), ""
        made = len(self.groups.groups) - 1  # besides the default group
        if made or sharded_over:
            what = f"{made} process group{'s' if made != 1 else ''} of its own" if made else "sharded DTensors"
            return Layout.sharded(world), (f"this script makes {what} without job.mesh(): ftrun cannot tell which "
                                           "ranks hold copies of each other's state (declare the mesh with "
                                           "job.mesh({...}), or pass init(sharded=True) with --snapshot-every)")
        return Layout.data_parallel(world), ""

    # -- commits and faults -----------------------------------------------------------------------

    def _on_optimizer_step(self, *args) -> None:
        if self.env is not None and self.groups.failure is not None:  # its gradients are not averaged
            raise GroupFailed(f"rank {self.env.rank}: step {self._step} lost a collective ({first_line(self.groups.failure)})")
        if self.snapshots is not None:
            self.snapshots.wait_copied()  # the snapshot's copy of what this step changes is done
        self._mutated = True

    def _begin_step(self) -> None:
        self._mutated = False
        # buffers as the step begins (cheap: running statistics are small), put back if it is lost
        modules = {id(m): m for m in (*self._objects.values(), *self._wrappers) if isinstance(m, torch.nn.Module)}
        self._saved_buffers = [(b, b.detach().clone()) for m in modules.values() for b in m.buffers()]
        if self.env is not None:
            self.groups.in_step = True

    def _end_step(self) -> BaseException | None:
        """The step's body is over: the failure of one of its collectives, if one failed."""
        if self.env is None:
            return None
        self.groups.in_step = False
        return self.groups.failure

    def _restore_buffers(self) -> None:
        """Undo what the forward of an interrupted step did to the buffers."""
        for buffer, saved in getattr(self, "_saved_buffers", ()):
            buffer.data.copy_(saved)

    def _commit(self) -> None:
        self._step += 1
        self._mutated = False
        if self.snapshots is not None and self.snapshots.due(self._step):
            behind = self._optimized() if self.snapshot_overlap else frozenset()
            try:
                self.snapshots.write(self._step, self._states(), behind)
            except SnapshotTooLarge as e:  # any restart would fail the same way: say so, and say not to retry
                print(f"ftrun.elastic: {e}", file=sys.stderr, flush=True)
                os._exit(WORKER_SETTING_EXIT)

    def _optimized(self) -> frozenset[int]:
        """The tensors only a registered optimizer's step changes: its parameters and its state."""
        found: set[int] = set()
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                found.update(local_tensor(p).data_ptr() for group in obj.param_groups for p in group["params"])
                found.update(local_tensor(v).data_ptr() for state in obj.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor))
        return frozenset(found)

    def _states(self) -> dict:
        """Every registered object's state, each DTensor as this rank's local shard (shards.py)."""
        return to_local({name: obj.state_dict() for name, obj in self._objects.items()})

    def _load(self, states: dict) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()  # no snapshot may still be reading what this overwrites
        for name, obj in self._objects.items():
            load_local(obj, states[name])

    # -- restores from snapshots ---------------------------------------------------------------------

    def _restore(self, start: int) -> bool:
        """After a job-level restart: load the state the controller's restore plan names for this rank
        (from this node's memory, a peer's replica or the checkpoint folder); True when it did."""
        if self.snapshots is None or self.generation <= 0:
            return False
        plan = self.store.try_get(RestorePlan, self.keys.restore_plan(self.generation, self.env.node_rank))
        if plan is None or plan.step < 0:
            log.warning("rank %d: nothing to restore for generation %d (%s)", self.env.rank, self.generation,
                        plan.reason if plan else "no restore plan")
            return False
        if plan.step < start:
            return False  # the script's own checkpoint is newer
        sources = plan.sources_for(self.env.rank)
        if not sources:
            log.warning("rank %d: the restore plan of generation %d has no source for it", self.env.rank,
                        self.generation)
            return False
        began = time.monotonic()
        source, state = load_first_good(sources, plan.step, self.snapshots.folder, self._signer, self._report_damaged)
        self._load(state)
        for wrapper in self._wrappers:
            wrapper.reset(synced=True)  # every rank loaded the same step
        self._step = plan.step
        self.snapshots.resume_at(plan.step)
        log.warning("rank %d: restored step %d from %s on node %d in %.2fs", self.env.rank, plan.step, source.where,
                    source.node_rank, time.monotonic() - began)
        return True

    def _report_damaged(self, source: RestoreSource) -> None:
        self.store.append(self.keys.damaged_count, self.keys.damaged, source)

    def _repair_target(self, error: BaseException) -> int | None:
        """The generation to repair into if ``error`` comes from a fault elsewhere (a collective
        failed and the controller announces a repair); None when it is this rank's own error,
        which must end the process."""
        if self.env is None or not isinstance(error, RuntimeError):  # torch's DistError is one
            return None
        target = self._await_target(above=self.generation, timeout=self.fault_wait)
        if target is not None:
            log.warning("rank %d: step %d interrupted (%s); repairing into generation %d",
                        self.env.rank, self._step, first_line(error), target)
        return target

    def _target(self) -> int:
        text = self.store.try_text(self.keys.target_generation)
        return int(text) if text else 0

    def _await_target(self, above: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            target = self._target()
            if target > above:
                return target
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    # -- liveness ----------------------------------------------------------------------------------

    def _let_go(self) -> None:
        """Stop the heartbeat and the repair watch and wait for them, up to LET_GO_DEADLINE: a thread that
        comes out of a store call while the interpreter tears down aborts the process ("terminate called
        without an active exception", SIGABRT), whatever the script's exit code. A watch parked in the
        store's wait is let out by ringing the key it waits on, this rank's own; else a repair announced,
        or the store gone, as the process ends would take it out of there then."""
        self._closed.set()
        deadline = time.monotonic() + LET_GO_DEADLINE
        # _closed first, the key second; the watch sets its key, then checks _closed: it sees the close, or
        # its wait is rung (a ring before the wait ends it at once)
        key, self._watch_key = self._watch_key, ""  # rung once (close(), then the interpreter's end)
        if key:
            try:
                self.store.set_text(key, "closed")
            except Exception:
                pass  # the store is gone: the watch's wait has failed or fails at once
        for thread in (self._heartbeat, self._watcher):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _settle_at_exit(self) -> None:
        """The interpreter ends (the script returned or raised, with or without close()): let the snapshot
        under way complete, since a thread still in its Tensor.copy_ then would abort the process, and
        let the threads go."""
        if self.snapshots is not None:
            try:
                if not self.snapshots.wait(COMMIT_DEADLINE):
                    log.warning("rank %d: the snapshot under way was not complete %.0fs after the script ended",
                                self.env.rank, COMMIT_DEADLINE)
            except SnapshotError as e:
                log.error("%s", e)
        self._let_go()

    def _beat(self, endpoint) -> None:
        """Once a second: this rank's heartbeat and committed step, on a connection of its own. A store
        client runs one operation at a time: behind the main thread's wait for a slow replacement to
        form the group, the heartbeat would stop and the agent would take this healthy rank for hung."""
        try:
            store = ControlStore(connect_store(endpoint, timeout=self.collective_timeout), endpoint, is_host=False)
        except Exception:
            return
        while not self._closed.wait(HEARTBEAT_INTERVAL):
            try:
                store.add(self.keys.rank_heartbeat(self.env.rank))
                store.set_text(self.keys.rank_progress(self.env.rank), str(self._step))
            except Exception:
                return  # the controller is gone; the agent stops this process

    def _watch(self, endpoint) -> None:
        """Sleep on the store until the next generation is announced, then make sure this rank joins.

        A blocking wait on a connection of its own: no periodic wake-ups that would take the GIL
        from the training thread. When a repair is announced and the main thread has not joined it
        shortly after, it sits in a collective that waits on a healthy peer: release it. If even that
        does not free it, leave, so that the repair replaces this rank instead of waiting for it.
        """
        try:
            store = connect_store(endpoint, timeout=self.collective_timeout)
        except Exception:
            return
        while True:
            generation = self.generation
            self._watch_key = self.keys.announced(generation + 1, self.env.rank)
            if self._closed.is_set():
                return
            try:
                store.wait([self._watch_key], datetime.timedelta(seconds=WATCH_TIMEOUT))
            except dist.DistNetworkError:
                # the store is gone: nothing more can be announced, and every further wait would fail at once
                return
            except Exception:
                continue  # nothing announced within the wait's deadline: wait again
            if self._closed.is_set():
                return  # rung by _let_go
            self._see_through_repair(generation)

    def _see_through_repair(self, generation: int) -> None:
        self.groups.abandon(generation)  # a group still connecting may wait for a peer that died
        announced_at = time.monotonic()
        interrupted = False
        while not self._closed.is_set() and not self._repairing and self.generation <= generation:
            waited = time.monotonic() - announced_at
            if waited > INTERRUPT_AFTER and not interrupted:
                interrupted = True
                self.groups.interrupt()
            if waited > self.fault_wait:
                log.error("rank %d: blocked in a collective %.0fs after a repair was announced; exiting to be replaced",
                          self.env.rank, self.fault_wait)
                os._exit(EXIT_STUCK)
            time.sleep(0.01)
        while not self._closed.is_set() and self.generation <= generation:
            time.sleep(0.05)  # the repair is under way on the main thread


#: the jobs of this process, for the interpreter's end
_JOBS: "weakref.WeakSet[ElasticJob]" = weakref.WeakSet()


@atexit.register
def _settle_jobs() -> None:
    """Before the interpreter tears down, whether the script called close() or not (one that raised did
    not): every job's snapshot completes and its threads go (ElasticJob._settle_at_exit)."""
    for job in list(_JOBS):
        job._settle_at_exit()


def _dump_stack_on_signal() -> None:
    """Let the agent ask for every thread's stack (on SIGUSR1) before it kills this rank as hung,
    unless the script uses that signal itself."""
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _default_layout(world_size: int, sharded: bool) -> Layout:
    """Until the first steps() settles it: pure data parallelism, or every rank alone with sharded=True."""
    return Layout.sharded(world_size) if sharded else Layout.data_parallel(world_size)


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
