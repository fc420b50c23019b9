"""The worker side of a process-level repair (ftrun/elastic/repair.py), in one process: a one-rank gloo
job behind ftrun's groups, the real training state, and a fake link in place of the control store."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from ftrun.contract import Fallback, Milestone, RollbackFailure
from ftrun.elastic.arrays import TorchSnapshotWriter
from ftrun.elastic.backends import CommBackend
from ftrun.elastic.groups import GroupSet, install
from ftrun.elastic.layout import ReplicaLayout
from ftrun.elastic.repair import Repair, RepairError
from ftrun.elastic.state import TrainingState


class Stopped(BaseException):
    """The agent's SIGTERM, which ends a rank that waits for the job-level restart."""


class FakeLink:
    """The control plane as a repair sees it: announced generations, milestones, and the group_ready key."""

    def __init__(self, spawned_for: int | None = None, superseded: tuple[int, ...] = (), announced: int = 0):
        self.rank, self.world_size, self.fault_wait = 0, 1, 0.0
        self.generation = -1
        self.spawned_for = spawned_for
        self.repairing = False
        #: generations the controller supersedes before every rank arrived
        self.superseded = set(superseded)
        #: the newest generation announced
        self.announced = announced
        self.reached: list[tuple[int, Milestone]] = []
        self.ready: list[int] = []
        self.failures: dict[int, RollbackFailure] = {}
        self.timed_out = False
        self.collective_errors: list[BaseException] = []
        #: generations that started this rank again elsewhere
        self.replaced: set[int] = set()

    def replaced_since_start(self, target: int) -> bool:
        return any(generation <= target for generation in self.replaced)

    def reach(self, generation: int, milestone: Milestone) -> int:
        self.reached.append((generation, milestone))
        return sum(1 for reached in self.reached if reached == (generation, milestone))

    def mark_group_ready(self, generation: int) -> None:
        self.ready.append(generation)

    def group_ready(self, generation: int, timeout: float) -> bool:
        if self.timed_out:
            raise TimeoutError(f"generation {generation}: not every rank arrived within {timeout:g}s")
        return generation not in self.superseded

    def target(self) -> int:
        return self.announced

    def await_target(self, above: int, timeout: float) -> int | None:
        return self.announced if self.announced > above else None

    def collective_failed(self, error: BaseException) -> None:
        self.collective_errors.append(error)

    def rollback_failed(self, generation: int, failure: RollbackFailure) -> None:
        self.failures[generation] = failure

    def await_stop(self, generation: int, failure: RollbackFailure):
        raise Stopped(generation, failure)


@pytest.fixture
def groups():
    """ftrun's groups of a one-rank job, before its first generation formed."""
    owned = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}/pg", timeout=30)
    install(owned, ("cpu",))
    yield owned
    owned.release()
    if dist.is_initialized():
        dist.destroy_process_group()


def training(snapshots: TorchSnapshotWriter | None = None, needs_state: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(ReplicaLayout.data_parallel(1), snapshots, needs_state=needs_state)
    state.register("model", model)
    state.register("optimizer", optimizer)
    return state, model, optimizer


def train_step(state: TrainingState, model, optimizer) -> None:
    state.begin_step()
    optimizer.zero_grad()
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()


def started(groups: GroupSet, state: TrainingState, link: FakeLink, generation: int = 0) -> Repair:
    """As ElasticJob starts: its first generation's groups formed."""
    repair = Repair(state, groups, link)
    repair.join(generation)
    link.repairing = state.needs_state
    return repair


def test_a_healthy_rank_joins_the_announced_generation_and_resumes_at_its_committed_step(groups):
    state, model, optimizer = training()
    link = FakeLink()
    resumed = []
    repair = started(groups, state, link)
    repair.after_repair.append(lambda: resumed.append(state.step))
    assert dist.is_initialized() and link.generation == 0 and groups.generation == 0
    for _ in range(3):
        train_step(state, model, optimizer)
        state.commit()
    link.reached.clear()
    repair.recover(1)
    assert link.reached == [(1, Milestone.STOPPED), (1, Milestone.ARRIVED), (1, Milestone.JOINED),
                            (1, Milestone.RESUMED)]
    assert link.ready == [0, 1]  # the last (only) rank to arrive marks each generation ready
    assert (link.generation, groups.generation, state.step, state.committed) == (1, 1, 3, 3)
    assert resumed == [3] and not link.repairing
    assert all(p.grad is None for p in model.parameters())  # the lost step's gradients are gone


def test_a_replacement_joins_its_generation_without_saying_it_stopped(groups):
    state, _, _ = training(needs_state=True)
    link = FakeLink(spawned_for=2)
    started(groups, state, link, generation=2)
    assert link.reached == [(2, Milestone.ARRIVED), (2, Milestone.JOINED)]
    assert link.repairing  # part of the repair until a peer sent it the state


def test_a_rank_its_generation_starts_again_elsewhere_leaves_instead_of_joining(groups, monkeypatch):
    # a frozen node's rank, woken after a spare took its place: joining, it took its replacement's seat in the
    # generation's groups, and the job ended with another state than a fault-free run's
    link = FakeLink(announced=2)
    link.replaced = {2}
    repair = Repair(TrainingState(ReplicaLayout.data_parallel(1)), groups, link)  # type: ignore[arg-type]

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", leave)
    with pytest.raises(SystemExit):
        repair.join(2)
    assert link.reached == []  # it never arrived in generation 2


def test_a_generation_superseded_before_every_rank_arrived_is_left_for_the_newer_one(groups):
    state, _, _ = training()
    link = FakeLink(superseded=(1,), announced=2)
    repair = started(groups, state, link)
    link.reached.clear()
    assert repair.join(1) == 2
    assert link.reached == [(1, Milestone.STOPPED), (1, Milestone.ARRIVED), (2, Milestone.STOPPED),
                            (2, Milestone.ARRIVED), (2, Milestone.JOINED)]
    assert link.generation == groups.generation == 2


def test_a_generation_not_every_rank_reaches_fails_the_repair(groups):
    state, _, _ = training()
    link = FakeLink()
    repair = started(groups, state, link)
    link.timed_out = True
    with pytest.raises(RepairError, match="generation 1: not every rank arrived within 30s"):
        repair.join(1)


def test_a_half_applied_step_goes_back_to_the_rank_s_own_snapshot(groups, tmp_path):
    snapshots = TorchSnapshotWriter(str(tmp_path), rank=0, world_size=1, sharded=False, every=1, limit=0, copies=1)
    state, model, optimizer = training(snapshots)
    link = FakeLink()
    repair = started(groups, state, link)
    train_step(state, model, optimizer)
    state.commit()  # step 1, snapshotted
    snapshots.wait()
    at_step_1 = [p.detach().clone() for p in model.parameters()]
    train_step(state, model, optimizer)  # the optimizer's step ran: a fault now leaves it half applied
    assert state.committed is None
    repair.recover(1)
    assert (state.step, state.committed) == (1, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), at_step_1))
    assert link.reached[-1] == (1, Milestone.RESUMED)


def test_with_no_healthy_replica_and_no_snapshot_the_rank_tells_the_controller_and_waits_to_be_stopped(groups):
    # an expected fallback, not a bug: no RepairError (a traceback on every rank), the controller says why
    state, _, _ = training(needs_state=True)
    link = FakeLink(spawned_for=1)
    repair = started(groups, state, link, generation=1)
    with pytest.raises(Stopped):
        repair.recover(1, joined=True)
    assert link.failures == {1: RollbackFailure(Fallback.NO_SNAPSHOTS, replicas=False)}
    assert link.failures[1].reason == "no healthy replica holds the training state, and the ranks take no snapshots"
    assert link.repairing and (1, Milestone.RESUMED) not in link.reached


def test_with_no_healthy_replica_and_no_snapshot_held_yet_the_rank_falls_back_the_same_way(groups, tmp_path):
    snapshots = TorchSnapshotWriter(str(tmp_path), rank=0, world_size=1, sharded=False, every=5, limit=0, copies=1)
    state, _, _ = training(snapshots, needs_state=True)  # a replacement before the first snapshot
    link = FakeLink(spawned_for=1)
    repair = started(groups, state, link, generation=1)
    with pytest.raises(Stopped):
        repair.recover(1, joined=True)
    assert link.failures == {1: RollbackFailure(Fallback.NO_COMMON_SNAPSHOT, replicas=False)}


def test_a_rollback_interrupted_by_a_newer_generation_starts_over_in_it(groups):
    state, model, optimizer = training()
    link = FakeLink()
    repair = started(groups, state, link)
    train_step(state, model, optimizer)
    state.commit()
    calls = []

    def fails_once() -> None:  # e.g. a peer died during the rollback's transfers
        calls.append(link.generation)
        if len(calls) == 1:
            link.announced = 2
            raise RuntimeError("Connection closed by peer")

    repair.after_repair.append(fails_once)
    link.reached.clear()
    repair.recover(1)
    assert calls == [1, 2] and link.generation == 2 and state.step == 1
    assert link.reached[-1] == (2, Milestone.RESUMED) and (2, Milestone.STOPPED) in link.reached
