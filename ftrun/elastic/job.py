"""The worker library's core: a training loop that survives the loss of other ranks."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import io
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from ftrun.auth import Signer
from ftrun.config import parse_endpoint
from ftrun.elastic.backends import CommBackend, make_backend
from ftrun.elastic.rollback import NO_STATE, RollbackPlan, choose_rollback
from ftrun.elastic.snapshots import SnapshotWriter, load_first_good, load_own, own_steps, snapshot_signer
from ftrun.errors import WORKER_SETTING_EXIT
from ftrun.keys import JobKeys
from ftrun.snapshots.format import SnapshotError, SnapshotTooLarge
from ftrun.snapshots.plan import RestorePlan, RestoreSource
from ftrun.store import ControlStore, connect_store

log = logging.getLogger("ftrun.elastic")
#: what a generation's group_ready key says once every rank arrived (else: superseded)
GROUP_READY = "ready"
#: how often a rank writes its heartbeat and its committed step
HEARTBEAT_INTERVAL = 1.0
#: the deadline of each of the repair watcher's waits (it waits again after each)
WATCH_TIMEOUT = 3600.0
#: after a repair is announced, how long the main thread may take to notice before it is interrupted
INTERRUPT_AFTER = 0.05
#: exit status of a rank that could not leave a blocked collective after a repair was announced
EXIT_STUCK = 75


class RepairError(RuntimeError):
    """The repair could not finish on this rank; ftrun falls back to job level."""


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
        )


class StepGuard:
    """``with job.guard():`` around a step's body: commits the step when the body finishes, and
    catches a fault elsewhere (a collective that raises because a peer died) so that
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
        if kind is None:
            self.job._commit()
            return False
        self.repair_target = self.job._repair_target(error)
        if self.repair_target is None:
            return False
        for wrapper in self.job._wrappers:
            wrapper.restore_buffers()  # the forward of the lost step moved running statistics
        return True  # swallowed: steps() repairs and goes on from the consistent step


class ElasticDDP(torch.nn.Module):
    """Data parallelism that survives a repair: gradients averaged over the current process group.

    Like DistributedDataParallel, the parameters are broadcast from rank 0 before the first
    forward and every gradient is averaged over the ranks before backward returns. Unlike it:

    * it holds no process group between steps, so the next generation's group takes over after
      a repair (gloo only closes a dead group's sockets, which releases peers blocked on this
      rank, once nothing refers to it any more: queued asynchronous work does);
    * the gradients go in one flat buffer, always in parameter order, and one synchronous
      all-reduce, so the summation order never changes and a repaired run stays bit-identical
      to a fault-free one (DDP lays its buckets out anew with each wrapper).

    Buffers (BatchNorm's running statistics) are broadcast from rank 0 before every forward, as
    DDP does by default, and put back as they were when a step is interrupted by a fault.
    Every parameter that requires a gradient must get one in every step.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self._synced = False
        self._queued = False
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._flat: torch.Tensor | None = None
        for param in self._params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if not self._synced:
            for param in self.module.parameters():
                dist.broadcast(param.data, src=0)
            self._synced = True
        for buffer in self.module.buffers():  # as DDP's broadcast_buffers: rank 0's running statistics
            dist.broadcast(buffer.data, src=0)
        return self.module(*args, **kwargs)

    def save_buffers(self) -> None:
        """Keep the buffers as the step begins (cheap: running statistics are small)."""
        self._saved_buffers = [b.detach().clone() for b in self.module.buffers()]

    def restore_buffers(self) -> None:
        """Undo what the forward of an interrupted step did to the buffers."""
        for buffer, saved in zip(self.module.buffers(), getattr(self, "_saved_buffers", ())):
            buffer.data.copy_(saved)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    def _average_gradients(self) -> None:
        self._queued = False
        grads = [p.grad for p in self._params]
        if self._flat is None:  # allocated once: a fresh buffer per step costs page faults
            self._flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        flat = self._flat
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def reset(self, synced: bool) -> None:
        """After a repair; ``synced``: every rank already holds the same parameters."""
        self._queued = False
        self._synced = synced


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
        self._objects: dict[str, object] = {}
        self._wrappers: list[ElasticDDP] = []
        self._step = 0
        self._mutated = False
        self._needs_state = False
        self._repairing = False
        self._guard = StepGuard(self)
        self._closed = threading.Event()
        #: this rank's snapshots into its agent's memory (--snapshot-every), or None
        self.snapshots: SnapshotWriter | None = None
        if self.env is None:
            dist.init_process_group(self.backend.name)
            self.generation = 0
            return
        _dump_stack_on_signal()
        self.keys = JobKeys(self.env.run_id)
        self.snapshots = SnapshotWriter.from_environ(self.env.rank, self.env.world_size, sharded)
        self._signer = snapshot_signer(self.snapshots.folder) if self.snapshots else Signer()
        endpoint = parse_endpoint(self.env.control_store, 0, "FTRUN_CONTROL_STORE")
        self.store = ControlStore(connect_store(endpoint, timeout=collective_timeout), endpoint, is_host=False,
                                  signer=self._signer)
        self.generation = -1
        self._spawned_for = self.env.generation if self.env.replacement else None
        self._needs_state = self.env.replacement
        self._join(self.env.generation)
        self._repairing = self._needs_state  # a replacement is part of the repair until it has the state
        for target, name, args in ((self._beat, "ftrun-heartbeat", (endpoint,)),
                                   (self._watch, "ftrun-repair-watch", (endpoint,))):
            threading.Thread(target=target, name=name, args=args, daemon=True).start()

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

    def ddp(self, module: torch.nn.Module) -> ElasticDDP:
        """Wrap ``module`` for data parallelism, as DistributedDataParallel does, repair-proof."""
        wrapper = ElasticDDP(module)
        self._wrappers.append(wrapper)
        return wrapper

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Step numbers ``start..total-1``; after a repair, the loop goes on from the consistent step.

        The step number is the data position: make each step's batch a function of it. Put the
        step's body in ``with job.guard():``. ``start`` is where a fresh job begins (e.g. the step
        after the one in your own checkpoint); a replacement rank resumes where the others are.
        """
        if self._needs_state:
            self._recover(self.generation, joined=True)
        elif not self._restore(start) and self._step < start:
            self._step = start
        while self._step < total:
            self._guard = StepGuard(self)
            yield self._step
            if self._guard.repair_target is not None:
                self._recover(self._guard.repair_target)
            elif not self._guard.entered:
                self._commit()  # a loop without guard(): the body finished, so the step did

    def guard(self) -> StepGuard:
        """The context manager for the current step's body (see :meth:`steps`)."""
        return self._guard

    def close(self) -> None:
        """Leave the job: finish the snapshot under way, stop the heartbeat, destroy the process group."""
        if self.snapshots is not None:
            self.snapshots.wait()
        self._closed.set()
        try:
            self.store.set_text(self.keys.rank_progress(self.env.rank), str(self._step))  # the final step
        except Exception:
            pass  # the controller is gone already
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- commits and faults -----------------------------------------------------------------------

    def _on_optimizer_step(self, *args) -> None:
        if self.snapshots is not None:
            self.snapshots.wait_copied()  # the snapshot's copy of what this step changes is done
        self._mutated = True

    def _begin_step(self) -> None:
        self._mutated = False
        for wrapper in self._wrappers:
            wrapper.save_buffers()

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
        found = set()
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                found.update(p.data_ptr() for group in obj.param_groups for p in group["params"])
                found.update(v.data_ptr() for state in obj.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor))
        return frozenset(found)

    def _states(self) -> dict:
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def _load(self, states: dict) -> None:
        if self.snapshots is not None:
            self.snapshots.wait()  # no snapshot may still be reading what this overwrites
        for name, obj in self._objects.items():
            obj.load_state_dict(states[name])

    # -- restores from snapshots ---------------------------------------------------------------------

    def _restore(self, start: int) -> bool:
        """After a job-level restart: load the state the controller's restore plan names for this rank
        (from this node's memory, a peer's replica or the checkpoint folder); True when it did."""
        if self.snapshots is None or self.generation <= 0:
            return False
        plan = self.store.try_get(RestorePlan, self.keys.restore_plan(self.generation))
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

    def _rollback_sharded(self, device) -> int:
        """Process level, sharded state: every rank goes back to the newest step all of them hold in
        their agents' memory (a replacement finds its predecessor's snapshots there)."""
        held = own_steps(self.snapshots.folder, self.env.rank) if self.snapshots else []
        mine = torch.full((2,), NO_STATE, dtype=torch.int64, device=device)
        mine[:len(held[:2])] = torch.tensor(held[:2], dtype=torch.int64)
        gathered = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        common = set.intersection(*({int(s) for s in t.tolist() if s != NO_STATE} for t in gathered))
        if not common:
            raise RepairError("sharded state: no step whose snapshot every rank holds in memory")
        step = max(common)
        if self._needs_state or self._mutated or self._step != step:
            try:
                self._load(load_own(self.snapshots.folder, self.env.rank, step))
            except SnapshotError as e:
                raise RepairError(str(e)) from None
        return step

    def _repair_target(self, error: BaseException) -> int | None:
        """The generation to repair into if ``error`` comes from a fault elsewhere (a collective
        failed and the controller announces a repair); None when it is this rank's own error,
        which must end the process."""
        if self.env is None or not isinstance(error, RuntimeError):  # torch's DistError is one
            return None
        target = self._await_target(above=self.generation, timeout=self.fault_wait)
        if target is not None:
            log.warning("rank %d: step %d interrupted (%s); repairing into generation %d",
                        self.env.rank, self._step, _first_line(error), target)
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

    # -- the repair: join the next generation's group, roll back ------------------------------------

    def _recover(self, target: int, joined: bool = False) -> None:
        while True:
            if not joined:
                target = self._join(target)
            joined = False
            try:
                self._rollback(target)
                return
            except RepairError:
                raise
            except Exception as e:
                newer = self._await_target(above=target, timeout=self.fault_wait)
                if newer is None:
                    raise
                log.warning("rank %d: rollback of generation %d interrupted (%s)", self.env.rank, target, _first_line(e))
                target = newer

    def _join(self, target: int) -> int:
        """Leave the current group and form generation ``target``'s (or a newer one's); returns it."""
        while True:
            self._repairing = True
            if target != self._spawned_for:
                self.store.add(self.keys.milestone(target, "stopped"))
            self._leave_group()
            if self._form_group(target):
                return target
            target = self._target()

    def _leave_group(self) -> None:
        # gloo closes this rank's sockets (releasing peers blocked on it) only when the last
        # reference to the group goes
        for wrapper in self._wrappers:
            wrapper.reset(synced=True)
        self.backend.release()
        gc.collect()

    def _form_group(self, generation: int) -> bool:
        """Form the group once every rank arrived; False if a newer generation was announced meanwhile.

        No polling: the last rank to arrive marks the group ready, and the controller marks it
        superseded when it announces a newer generation; the others wait on the store for either.
        """
        ready = self.keys.group_ready(generation)
        if self.store.add(self.keys.milestone(generation, "arrived")) >= self.env.world_size:
            self.store.set_text(ready, GROUP_READY)
        try:
            self.store.raw.wait([ready], datetime.timedelta(seconds=self.collective_timeout))
        except Exception:
            raise RepairError(f"generation {generation}: not every rank arrived within {self.collective_timeout:g}s") from None
        if self.store.try_text(ready) != GROUP_READY:
            return False
        from torch.distributed import PrefixStore

        store = PrefixStore(self.keys.process_group(generation), self.store.raw)
        self.backend.form_group(store, self.env.rank, self.env.world_size, self.collective_timeout)
        self.generation = generation
        self.store.add(self.keys.milestone(generation, "joined"))
        return True

    def _rollback(self, generation: int) -> None:
        """Agree on the consistent step; its holder sends the state to the ranks that lack it."""
        device = self.backend.device()
        if self.sharded:
            try:
                plan = RollbackPlan(self._rollback_sharded(device), self.env.rank, ())
            except RepairError as e:
                self.store.set_text(self.keys.rollback_failure(generation), str(e))
                raise
        else:
            mine = NO_STATE if (self._needs_state or self._mutated) else self._step
            gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.env.world_size)]
            dist.all_gather(gathered, torch.tensor([mine], dtype=torch.int64, device=device))
            plan = choose_rollback([int(t.item()) for t in gathered])
        if plan is None:
            reason = "no healthy replica holds the training state"
            self.store.set_text(self.keys.rollback_failure(generation), reason)
            raise RepairError(reason)
        if plan.receivers:
            self._send_state(plan.source, plan.receivers, device)
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        for wrapper in self._wrappers:
            wrapper.reset(synced=True)  # every rank now holds the same parameters
        self._step = plan.step
        self._needs_state = False
        self._mutated = False
        if self.snapshots is not None:
            self.snapshots.resume_at(plan.step)
        self.store.add(self.keys.milestone(generation, "resumed"))
        self._repairing = False
        log.info("rank %d: generation %d resumes at step %d (state from rank %d)", self.env.rank, generation,
                 plan.step, plan.source)

    def _send_state(self, source: int, receivers: tuple[int, ...], device) -> None:
        """Point to point, source to each receiver: the cost does not grow with the job's size."""
        if self.env.rank == source:
            buffer = io.BytesIO()
            torch.save(self._states(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
            for receiver in receivers:
                dist.send(size, dst=receiver)
                dist.send(payload, dst=receiver)
        elif self.env.rank in receivers:
            size = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(size, src=source)
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            dist.recv(payload, src=source)
            self._load(torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False))

    # -- liveness ----------------------------------------------------------------------------------

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
        while not self._closed.is_set():
            generation = self.generation
            try:
                store.wait([self.keys.announced(generation + 1)], datetime.timedelta(seconds=WATCH_TIMEOUT))
            except Exception:
                continue  # nothing announced within the wait's deadline: wait again
            self._see_through_repair(generation)

    def _see_through_repair(self, generation: int) -> None:
        announced_at = time.monotonic()
        interrupted = False
        while not self._closed.is_set() and not self._repairing and self.generation <= generation:
            waited = time.monotonic() - announced_at
            if waited > INTERRUPT_AFTER and not interrupted:
                interrupted = True
                self.backend.interrupt()
            if waited > self.fault_wait:
                log.error("rank %d: blocked in a collective %.0fs after a repair was announced; exiting to be replaced",
                          self.env.rank, self.fault_wait)
                os._exit(EXIT_STUCK)
            time.sleep(0.01)
        while not self._closed.is_set() and self.generation <= generation:
            time.sleep(0.05)  # the repair is under way on the main thread


def _dump_stack_on_signal() -> None:
    """Let the agent ask for every thread's stack (on SIGUSR1) before it kills this rank as hung,
    unless the script uses that signal itself."""
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
