"""The worker side of a process-level repair, in the order it runs (DESIGN.md's repair sequence).

1. **stop**: the rank's step raises (a peer died) or the repair watcher interrupts the collective
   it waits in; the step's guard hands the rank to :meth:`Repair.recover`.
2. **env clear**: the rank says ``stopped`` and drops every real group (``GroupSet.release``):
   gloo closes its sockets, NCCL aborts its communicators, Ascend stops and restarts the device.
3. **repair**: once every rank arrived in the new generation, the script's groups (the same
   objects) are pointed at it and reconnect at their next collective (:meth:`Repair.form`).
4. **rollback**: every rank says which step it fully committed and which snapshots it holds;
   :func:`~ftrun.elastic.rollback.choose_rollback` picks the step and, in each replica set, who
   sends the state to whom (point to point); with no healthy replica for some set, every rank goes
   back to the newest step all of them hold a snapshot of.
5. **continue**: the rank says ``resumed`` and its loop goes on from that step.

A fault during the repair (a replacement dies) makes the controller announce a newer generation;
the repair starts over from step 2 into that one.
"""

from __future__ import annotations

import datetime
import io
import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ftrun.elastic.groups import init_default_group
from ftrun.elastic.rollback import NO_STATE, RollbackPlan, choose_rollback
from ftrun.elastic.shards import to_local
from ftrun.elastic.snapshots import load_own, own_steps
from ftrun.snapshots.format import SnapshotError

if TYPE_CHECKING:
    from ftrun.elastic.job import ElasticJob

log = logging.getLogger("ftrun.elastic")
#: what a generation's group_ready key says once every rank arrived (else: superseded)
GROUP_READY = "ready"
#: how many of its snapshots a rank names in the rollback (it keeps two)
HELD = 2


class RepairError(RuntimeError):
    """The repair could not finish on this rank; ftrun falls back to job level."""


class Repair:
    """One rank's part in every repair of its job."""

    def __init__(self, job: "ElasticJob"):
        self.job = job
        self.env = job.env
        self.store = job.store
        self.keys = job.keys

    def recover(self, target: int, joined: bool = False) -> None:
        """From a stopped step to a resumed one in generation ``target`` (or a newer one)."""
        while True:
            if not joined:
                target = self.join(target)
            joined = False
            try:
                self.rollback(target)
                return
            except RepairError:
                raise
            except Exception as e:
                newer = self.job._await_target(above=target, timeout=self.job.fault_wait)
                if newer is None:
                    raise
                log.warning("rank %d: rollback of generation %d interrupted (%s)", self.env.rank, target, first_line(e))
                target = newer

    def join(self, target: int) -> int:
        """Leave the current generation's groups and form ``target``'s (or a newer one's); returns it."""
        while True:
            self.job._repairing = True
            if target != self.job._spawned_for:
                self.store.add(self.keys.milestone(target, "stopped"))
            self.leave()
            if self.form(target):
                return target
            target = self.job._target()

    def leave(self) -> None:
        for wrapper in self.job._wrappers:
            wrapper.reset(synced=True)
        self.job.groups.release()

    def form(self, generation: int) -> bool:
        """Every group of the script now belongs to ``generation``, once every rank arrived; False if
        a newer generation was announced meanwhile.

        No polling: the last rank to arrive marks the generation ready, and the controller marks it
        superseded when it announces a newer one; the others wait on the store for either.
        """
        ready = self.keys.group_ready(generation)
        timeout = self.job.collective_timeout
        if self.store.add(self.keys.milestone(generation, "arrived")) >= self.env.world_size:
            self.store.set_text(ready, GROUP_READY)
        try:
            self.store.raw.wait([ready], datetime.timedelta(seconds=timeout))
        except Exception:
            raise RepairError(f"generation {generation}: not every rank arrived within {timeout:g}s") from None
        if self.store.try_text(ready) != GROUP_READY:
            return False
        groups = self.job.groups
        groups.reconfigure(generation)
        if not dist.is_initialized():
            init_default_group(groups, self.env.rank, self.env.world_size, timeout)
        self.job.generation = generation
        self.store.add(self.keys.milestone(generation, "joined"))
        return True

    def rollback(self, generation: int) -> None:
        """Agree on the consistent step; in each replica set its holder sends the state to the ranks that lack it."""
        job = self.job
        device = job.backend.device()
        held = own_steps(job.snapshots.folder, self.env.rank)[:HELD] if job.snapshots else []
        mine = torch.full((1 + HELD,), NO_STATE, dtype=torch.int64, device=device)
        mine[0] = NO_STATE if (job._needs_state or job._mutated) else job._step
        mine[1:1 + len(held)] = torch.tensor(held, dtype=torch.int64)
        gathered = [torch.zeros(1 + HELD, dtype=torch.int64, device=device) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, mine)
        rows = [t.tolist() for t in gathered]
        plan = choose_rollback([row[0] for row in rows], job.layout.replica_sets())
        if plan is not None:
            if plan.transfers:
                self.send_state(plan, device)
            source = plan.source_for(self.env.rank)
            origin = f"state from rank {source}" if source is not None else "its own state"
        else:
            plan = RollbackPlan(self.from_snapshots(generation, rows))
            origin = "its own snapshot"
        for obj in job._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        for wrapper in job._wrappers:
            wrapper.reset(synced=True)  # every rank now holds its replica set's parameters
        job._step = plan.step
        job._needs_state = False
        job._mutated = False
        if job.snapshots is not None:
            job.snapshots.resume_at(plan.step)
        for callback in job._after_repair:
            callback()
        self.store.add(self.keys.milestone(generation, "resumed"))
        job._repairing = False
        log.info("rank %d: generation %d resumes at step %d (%s)", self.env.rank, generation, plan.step, origin)

    def from_snapshots(self, generation: int, rows: list[list[int]]) -> int:
        """No healthy replica for some rank: every rank goes back to the newest step all of them hold
        in their agents' memory (a replacement finds its predecessor's snapshots there)."""
        job = self.job
        if job.snapshots is None:
            self.fail(generation, "no healthy replica holds the training state")
        common = set.intersection(*({s for s in row[1:] if s != NO_STATE} for row in rows))
        if not common:
            self.fail(generation, "no healthy replica holds the training state, and no step whose snapshot "
                                  "every rank holds in memory")
        step = max(common)
        if job._needs_state or job._mutated or job._step != step:
            try:
                job._load(load_own(job.snapshots.folder, self.env.rank, step))
            except SnapshotError as e:
                self.fail(generation, str(e))
        return step

    def fail(self, generation: int, reason: str):
        self.store.set_text(self.keys.rollback_failure(generation), reason)
        raise RepairError(reason)

    def send_state(self, plan: RollbackPlan, device) -> None:
        """Point to point, each source to its receivers: the cost does not grow with the job's size."""
        rank = self.env.rank
        for transfer in plan.transfers:
            if rank == transfer.source:
                buffer = io.BytesIO()
                torch.save(to_local(self.job._states()), buffer)
                payload = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8).to(device)  # no copy on CPU
                size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
                for receiver in transfer.receivers:
                    dist.send(size, dst=receiver)
                    dist.send(payload, dst=receiver)
            elif rank in transfer.receivers:
                size = torch.zeros(1, dtype=torch.int64, device=device)
                dist.recv(size, src=transfer.source)
                payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
                dist.recv(payload, src=transfer.source)
                self.job._load(torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False))


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]

