"""The online level: a collective that fails while every process lives is repaired in place. Its edges in
the policy, the narration, the rank's report, and Ascend's UCE check (no store, no processes)."""

from __future__ import annotations

import datetime
import sys
import threading
import types

import pytest
import torch
import torch.distributed as dist

from ftrun.contract import CollectiveFailure, Milestone
from ftrun.controller.narrator import Narrator
from ftrun.controller.policy import on_collective_failed, on_milestone, on_report
from ftrun.controller.states import JobView, Level, Phase
from ftrun.elastic.backends import CommBackend, HcclBackend, Memory, NcclBackend
from ftrun.elastic.groups import GroupError, GroupSet, _Guarded, first_line
from ftrun.events import EventLog, read_events
from ftrun.messages import CommandKind, Report, ReportKind, WorkerFailure
from tests.npu_stand_in import TorchNpu


def ready(**fields) -> JobView:
    """A running job of 2 nodes x 2 ranks, every rank under ftrun.elastic, --recovery process."""
    return JobView(node_count=2, max_restarts=fields.pop("max_restarts", 3), world_size=4, recovery=Level.PROCESS,
                   library_ranks=4, **fields)


def cut(rank=1, generation=0) -> CollectiveFailure:
    return CollectiveFailure(rank, generation, "Read error [127.0.0.1]:906: Connection reset by peer", at=100.0)


def died(rank=1, node=0, generation=0) -> Report:
    failure = WorkerFailure(rank=rank, local_rank=rank % 2, node_rank=node, host=f"h{node}", pid=100 + rank,
                            exit_code=None, signal="SIGKILL", generation=generation)
    return Report(ReportKind.WORKER_FAILED, node, generation, (failure,))


def test_transition_running_to_stopping_online_replaces_nobody_and_spends_one_unit():
    v, commands = on_collective_failed(ready(), cut(), node_rank=0, host="h0")
    assert (v.phase, v.level, v.generation, v.restarts_used) == (Phase.STOPPING, Level.ONLINE, 1, 1)
    assert v.replacing == frozenset() and v.clearing == frozenset()
    assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 1, ())]
    assert v.level.value == "online"
    assert v.failures[-1].cause == "collective" and v.failures[-1].timestamp == 100.0
    assert "rank 1 on node 0 (h0): a collective failed (Read error" in v.failures[-1].describe()


def test_transition_online_repair_through_its_phases_back_to_running():
    v, _ = on_collective_failed(ready(), cut())
    v, _ = on_milestone(v, Milestone.STOPPED)
    assert v.phase is Phase.REPAIR  # no rank to reap: env clear passes at once
    v, _ = on_milestone(v, Milestone.JOINED)
    v, _ = on_milestone(v, Milestone.RESUMED)
    assert (v.phase, v.generation) == (Phase.RUNNING, 1)
    v, _ = on_report(v, died(rank=1, generation=1))  # the next fault is a repair of its own, not online
    assert (v.phase, v.level, v.generation, v.replacing) == (Phase.STOPPING, Level.PROCESS, 2, {1})


def test_a_failed_collective_of_a_generation_already_left_is_ignored():
    v, _ = on_collective_failed(ready(), cut())
    assert on_collective_failed(v, cut(generation=0)) == (v, [])


def test_without_process_level_a_failed_collective_decides_nothing():
    # the rank's own wait for an announcement ends it, and the job restarts at job level as before
    job_level = JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.JOB, library_ranks=4)
    assert on_collective_failed(job_level, cut()) == (job_level, [])


def test_transition_running_to_exiting_when_the_budget_is_spent():
    v, commands = on_collective_failed(ready(max_restarts=0), cut())
    assert v.phase is Phase.EXITING and "retry budget spent" in v.reason
    assert [c.kind for c in commands] == [CommandKind.EXIT]


def test_transition_online_to_process_level_when_a_rank_dies_during_it():
    # the peers of a dying rank see its death first, as a failed collective: the death's report takes the
    # same repair down to process level, in a generation of its own, with no second unit of budget
    v, _ = on_collective_failed(ready(), cut(rank=0))
    v, commands = on_report(v, died(rank=1))
    assert (v.phase, v.level, v.generation, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, 2, 1)
    assert v.replacing == {1} and [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, (1,))]


def test_transition_online_to_job_level_when_its_regrouped_collectives_fail_again():
    v, _ = on_collective_failed(ready(), cut())
    v, _ = on_milestone(v, Milestone.STOPPED)
    v, commands = on_collective_failed(v, cut(rank=2, generation=1))
    assert (v.phase, v.level) == (Phase.STOPPING, Level.JOB)
    assert "during the online repair" in v.reason
    assert [c.kind for c in commands] == [CommandKind.STOP]


def test_the_narrator_says_the_level_once_and_its_step_down(tmp_path):
    events = EventLog(str(tmp_path / "events.jsonl"))
    narrator = Narrator(events, lambda generation: 4)
    before = ready()
    online, _ = on_collective_failed(before, cut(), node_rank=0, host="h0")
    assert narrator.decided(before, online, 100.0)
    down, _ = on_report(online, died(rank=1))
    assert narrator.decided(online, down, 100.1)
    events.close()
    decisions = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["kind"] == "decision"]
    assert [e["level"] for e in decisions] == ["online", "process"]
    assert decisions[0]["detail"].startswith("online repair into generation 1: a collective of rank 1 failed")
    assert decisions[1]["detail"].startswith(
        "process-level repair into generation 2: rank 1 (local rank 1) on node 0 (h0), pid 101: killed by SIGKILL")
    assert decisions[1]["action"] == "step_down"


@pytest.mark.parametrize("answer, memory", [(0, Memory.INTACT), (1, Memory.UNKNOWN), (2, Memory.INTACT),
                                            (3, Memory.STATE_LOST), (7, Memory.UNKNOWN)])
def test_hccl_release_checks_the_memory_for_a_uce_between_stop_and_restart(monkeypatch, answer, memory):
    npu = TorchNpu()
    npu.install(monkeypatch)
    npu.uce = answer
    backend = HcclBackend(dist=types.SimpleNamespace(), local_rank=3)
    backend.release([])
    assert npu.calls == [("stop_device", 3), ("check_uce_in_memory", 3), ("restart_device", 3)]
    assert backend.memory is memory


def test_a_torch_npu_without_the_uce_check_leaves_the_memory_intact(monkeypatch):
    npu = TorchNpu()
    npu.install(monkeypatch)
    del npu.npu.check_uce_in_memory
    backend = HcclBackend(dist=types.SimpleNamespace(), local_rank=0)
    backend.release([])
    assert backend.memory is Memory.INTACT


def test_without_the_memory_cache_the_uce_check_refuses_and_the_state_comes_from_a_replica(monkeypatch):
    npu = TorchNpu()
    npu.install(monkeypatch)
    monkeypatch.setenv("PYTORCH_NO_NPU_MEMORY_CACHING", "1")
    backend = HcclBackend(dist=types.SimpleNamespace(), local_rank=0)
    backend.release([])
    assert backend.memory is Memory.STATE_LOST


def test_a_collective_failure_reads_back_and_a_stranger_text_is_none():
    failure = cut()
    assert CollectiveFailure.from_text(failure.to_text()) == failure
    assert CollectiveFailure.from_text("not json") is None
    assert CollectiveFailure.from_text('{"rank": "x"}') is None


def test_a_step_s_first_failed_collective_is_told_once_and_in_one_line():
    told = []
    groups = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.on_failure = told.append
    first = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:906: Connection reset by peer\nC++ context")
    groups.fail(first)
    groups.fail(RuntimeError("a later one, an echo of the first"))
    assert told == [first]
    assert first_line(first) == "Read error [127.0.0.1]:906: Connection reset by peer"


class NeverEnds:
    """A real collective's work whose sockets a cut link aborted under it: it never completes."""

    def __init__(self):
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False

    def get_future(self):
        return torch.futures.Future()  # never set


@pytest.mark.parametrize("timeout", [None, datetime.timedelta(0)], ids=["python-wait", "cpp-wait-no-timeout"])
def test_a_collective_that_never_ends_is_given_up_once_its_generation_is(timeout):
    # C++ waits with torch's kNoTimeout, timedelta(0): DDP's reducer so waits on its unused-parameter map's
    # allreduce (find_unused_parameters=True, the Trainer's DDP), which held a healthy rank past fault_wait
    groups = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.generation = 0
    work = NeverEnds()
    guarded = _Guarded(work, groups, "allreduce", 0, 2, ([torch.ones(2)],))
    future = guarded.get_future()
    watch = threading.Timer(0.2, groups.abandon, args=(0,))  # the repair watch, as the repair is announced
    watch.start()
    assert guarded.wait(timeout) is True  # the step goes on to its end, the failure recorded
    assert work.waits >= 2 and isinstance(groups.failure, GroupError)
    watch.join(5)  # the wait ends as soon as the generation is marked given up, before the futures are settled
    assert future.done()  # settled locally: nothing waits for it
    assert groups.stuck  # its real group is let go of in a thread of its own


def test_a_collective_that_failed_by_itself_is_not_given_up():
    groups = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.generation = 0

    class Failed(NeverEnds):
        def is_completed(self):
            return True

    assert _Guarded(Failed(), groups, "barrier", 0, 2, ()).wait() is True
    assert str(groups.failure) == "Operation timed out!" and not groups.stuck


def test_a_collective_that_ends_just_after_a_slice_of_its_wait_is_no_failure():
    groups = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.generation = 0

    class EndsAtTheSlice(NeverEnds):
        """Its first wait's slice ends as it completes: the slice's timeout, then a completed work."""

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise RuntimeError("Operation timed out!")
            return True

        def is_completed(self):
            return self.waits >= 1

    work = EndsAtTheSlice()
    assert _Guarded(work, groups, "allreduce", 0, 2, ([torch.ones(2)],)).wait() is True
    assert groups.failure is None and work.waits == 2


@pytest.mark.parametrize("op", ["recv", "send"])
def test_a_pipeline_stage_s_recv_is_waited_whole_since_gloo_closes_the_pair_when_a_timed_wait_runs_out(op):
    # a stage's recv waits for the stage before it, often longer than a slice: gloo's p2p work, timed out
    # once, closes its pair and fails every wait after it (as gloo does, seen with torch 2.13)
    groups = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.generation = 0

    class PairClosesOnATimedWait(NeverEnds):
        closed = False

        def wait(self, timeout=None):
            self.waits += 1
            if timeout is not None:
                self.closed = True
                raise RuntimeError(f"Timed out waiting 50ms for {op} operation to complete")
            if self.closed:
                raise RuntimeError("Application timeout caused pair closure")
            return True

    work = PairClosesOnATimedWait()
    assert _Guarded(work, groups, op, 0, 2, ([torch.ones(2)], 1, 0)).wait() is True
    assert groups.failure is None and work.waits == 1 and not work.closed


def test_when_hccl_s_own_operator_retry_fails_the_online_level_takes_over_on_the_device(monkeypatch):
    # HCCL retries a failed operator itself (HCCL_OP_RETRY_ENABLE); when that fails too, the rank's collective
    # raises, its process alive: the failure is told at once, and the release stops, checks and restarts the
    # device in place (the stand-in torch_npu records it)
    npu = TorchNpu()
    npu.install(monkeypatch)
    groups = GroupSet(HcclBackend(dist=types.SimpleNamespace(), local_rank=0), dist.HashStore(),
                      lambda generation: f"g{generation}", timeout=5)
    groups.generation, groups.in_step = 0, True
    told = []
    groups.on_failure = told.append

    class RetryFailed(NeverEnds):
        def wait(self, timeout=None):
            raise RuntimeError("HCCL OP RETRY FAILED, error code is 507904\n[ERROR] context")

        def is_completed(self):
            return True

    assert _Guarded(RetryFailed(), groups, "allreduce", 0, 2, ([torch.ones(2)],)).wait() is True
    assert [first_line(error) for error in told] == ["HCCL OP RETRY FAILED, error code is 507904"]
    groups.release()
    assert [name for name, _ in npu.calls] == ["stop_device", "check_uce_in_memory", "restart_device"]
    assert groups.backend.memory is Memory.INTACT  # its own state stays: the step is redone from the rollback


def test_nccl_and_hccl_waits_are_not_sliced():
    # their wait with a timeout holds the CPU until the kernel ends; an abort frees a stuck one instead
    class Plain(NeverEnds):
        def wait(self, timeout=None):
            self.waits += 1
            assert timeout is None
            return True

    for backend in (NcclBackend(dist=types.SimpleNamespace()), HcclBackend(dist=types.SimpleNamespace())):
        groups = GroupSet(backend, dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
        work = Plain()
        assert _Guarded(work, groups, "allreduce", 0, 2, ([torch.ones(2)],)).wait() is True and work.waits == 1
