"""The worker side of a process-level repair, in the order it runs (docs/design.md, "The repair, step by step").

1. **stop**: the rank's step raises (a peer died) or the repair watcher interrupts the collective
   it waits in; the step's guard hands the rank to :meth:`Repair.recover`.
2. **env clear**: the rank says ``stopped`` and drops every real group (``GroupSet.release``):
   gloo closes its sockets, NCCL aborts its communicators, Ascend stops and restarts the device.
3. **repair**: once every rank arrived in the new generation, the script's groups (the same
   objects) are pointed at it and reconnect at their next collective (:meth:`Repair.form`).
4. **rollback**: every rank says which step it fully committed and which snapshots it holds;
   :func:`~ftrun.rollback.choose_rollback` picks the step and, in each replica set, who
   sends the state to whom (point to point); with no healthy replica for some set, every rank goes
   back to the newest step all of them hold a snapshot of. With none (no snapshots, or none every rank
   holds), the repair falls back to job level: each rank tells the controller why and waits for its
   agent to stop it, with no traceback; the controller says it once (:meth:`Repair.fall_back`).
5. **continue**: the rank says ``resumed`` and its loop goes on from that step.

A fault during the repair (a replacement dies) makes the controller announce a newer generation;
the repair starts over from step 2 into that one.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from ftrun.contract import Fallback, Milestone, RollbackFailure
from ftrun.elastic.arrays import load_own, own_steps
from ftrun.elastic.backends import DeviceNotStopped, Memory
from ftrun.elastic.groups import GroupSet, first_line, init_default_group
from ftrun.elastic.link import ControlLink
from ftrun.elastic.shards import to_local
from ftrun.elastic.state import TrainingState
from ftrun.errors import EXIT_STUCK
from ftrun.repair_loop import RepairError, repair_until_resumed
from ftrun.rollback import NO_STATE, RollbackPlan, choose_rollback
from ftrun.snapshots.format import SnapshotError

log = logging.getLogger("ftrun.elastic")
#: how many of its snapshots a rank names in the rollback (it keeps two)
HELD = 2


class Repair:
    """One rank's part in every repair of its job: it moves ``groups`` to the new generation and puts
    ``state`` back to the consistent step, told by the controller through ``link``."""

    def __init__(self, state: TrainingState, groups: GroupSet, link: ControlLink,
                 after_repair: list[Callable[[], None]] | None = None):
        self.state = state
        self.groups = groups
        self.link = link
        #: the script's callbacks at the end of each repair (job.after_repair)
        self.after_repair = after_repair if after_repair is not None else []

    def recover(self, target: int, joined: bool = False) -> None:
        """From a stopped step to a resumed one in generation ``target`` (or a newer one)."""
        repair_until_resumed(target, self.join, self.rollback, self._interrupted, joined)

    def _interrupted(self, target: int, error: Exception) -> int | None:
        """A rollback that raised: the newer generation announced within fault_wait, or None."""
        self.link.collective_failed(error)  # an online repair whose groups fail again: the controller decides
        newer = self.link.await_target(above=target, timeout=self.link.fault_wait)
        if newer is not None:
            log.warning("rank %d: rollback of generation %d interrupted (%s)", self.link.rank, target,
                        first_line(error))
        return newer

    def join(self, target: int) -> int:
        """Leave the current generation's groups and form ``target``'s (or a newer one's); returns it."""
        while True:
            self.link.repairing = True
            if self.link.replaced_since_start(target):
                log.error("rank %d: generation %d starts this rank again elsewhere (its node was taken for lost); "
                          "exiting", self.link.rank, target)
                os._exit(EXIT_STUCK)
            if target != self.link.spawned_for:
                self.link.reach(target, Milestone.STOPPED)
            self.leave()
            if self.form(target):
                return target
            target = self.link.target()

    def leave(self) -> None:
        self.state.reset_wrappers()
        try:
            self.groups.release()
        except DeviceNotStopped as e:
            log.error("rank %d: %s; exiting to be replaced", self.link.rank, e)
            os._exit(EXIT_STUCK)
        if self.groups.backend.memory is Memory.UNKNOWN:
            # an on-chip memory fault outside what torch manages: nothing here can vouch for the process
            log.error("rank %d: a memory fault (UCE) outside torch's memory; exiting to be replaced", self.link.rank)
            os._exit(EXIT_STUCK)

    def form(self, generation: int) -> bool:
        """Every group of the script now belongs to ``generation``, once every rank arrived; False if
        a newer generation was announced meanwhile.

        No polling: the last rank to arrive marks the generation ready, and the controller marks it
        superseded when it announces a newer one; the others wait on the store for either.
        """
        link, timeout = self.link, self.groups.timeout
        if link.reach(generation, Milestone.ARRIVED) >= link.world_size:
            link.mark_group_ready(generation)
        try:
            if not link.group_ready(generation, timeout):
                return False
        except TimeoutError as e:
            raise RepairError(str(e)) from None
        self.groups.reconfigure(generation)
        if not dist.is_initialized():
            init_default_group(self.groups, link.rank, link.world_size, timeout)
        link.generation = generation
        link.reach(generation, Milestone.JOINED)
        return True

    def rollback(self, generation: int) -> None:
        """Agree on the consistent step; in each replica set its holder sends the state to the ranks that lack it."""
        state, rank = self.state, self.link.rank
        device = self.groups.backend.device()
        held = own_steps(state.snapshots.folder, rank)[:HELD] if state.snapshots else []
        # a row: the committed step, the layout's replica dimensions (a replacement has yet to learn those
        # of a mesh that the first step shows), the snapshots held
        mine = torch.full((2 + HELD,), NO_STATE, dtype=torch.int64, device=device)
        lost = state.committed is None or self.groups.backend.memory is Memory.STATE_LOST  # a UCE in the state
        mine[0] = NO_STATE if lost else state.committed
        mine[1] = state.layout.replica_mask()
        mine[2:2 + len(held)] = torch.tensor(held, dtype=torch.int64)
        gathered = [torch.zeros(2 + HELD, dtype=torch.int64, device=device) for _ in range(self.link.world_size)]
        dist.all_gather(gathered, mine)
        rows = [t.tolist() for t in gathered]
        state.adopt(state.layout.agreed([row[1] for row in rows]))
        plan = choose_rollback([row[0] for row in rows], state.layout.replica_sets())
        if plan is not None:
            if plan.transfers:
                self.send_state(plan, device)
            source = plan.source_for(rank)
            origin = f"state from rank {source}" if source is not None else "its own state"
        else:
            plan = RollbackPlan(self.from_snapshots(generation, [row[2:] for row in rows]))
            origin = "its own snapshot"
        state.resume_at(plan.step)  # every rank now holds its replica set's state
        for callback in self.after_repair:
            callback()
        self.link.reach(generation, Milestone.RESUMED)
        self.link.repairing = False
        log.info("rank %d: generation %d resumes at step %d (%s)", rank, generation, plan.step, origin)

    def from_snapshots(self, generation: int, held: list[list[int]]) -> int:
        """No healthy replica for some rank: every rank goes back to the newest step all of them hold
        in their agents' memory (a replacement finds its predecessor's snapshots there); ``held``: each
        rank's snapshot steps."""
        state = self.state
        if state.snapshots is None:
            self.fall_back(generation, Fallback.NO_SNAPSHOTS)
        common = set.intersection(*({s for s in steps if s != NO_STATE} for steps in held))
        if not common:
            self.fall_back(generation, Fallback.NO_COMMON_SNAPSHOT)
        step = max(common)
        if state.committed != step:
            try:
                state.load(load_own(state.snapshots.folder, self.link.rank, step))
            except SnapshotError as e:
                self.fall_back(generation, Fallback.SNAPSHOT_UNREADABLE, str(e))
        return step

    def fall_back(self, generation: int, cause: Fallback, detail: str = "") -> NoReturn:
        """The state cannot be put back at process level: an expected outcome of the layout and the
        flags, not a bug. Every rank finds it alike (they decide on the same gathered rows), tells the
        controller, which says it once with what would avoid it, and waits for the job-level restart
        to stop it: no rank prints a traceback."""
        replicas = any(len(members) > 1 for members in self.state.layout.replica_sets())
        failure = RollbackFailure(cause, replicas, detail)
        self.link.rollback_failed(generation, failure)
        log.debug("rank %d: %s; waiting for the job-level restart", self.link.rank, failure.reason)
        self.link.await_stop(generation, failure)

    def send_state(self, plan: RollbackPlan, device) -> None:
        """Point to point, each source to its receivers: the cost does not grow with the job's size."""
        rank = self.link.rank
        for transfer in plan.transfers:
            if rank == transfer.source:
                buffer = io.BytesIO()
                torch.save(to_local(self.state.states()), buffer)
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
                self.state.load(torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False))
