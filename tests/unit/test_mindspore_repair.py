"""The process-level repair of MindSpore ranks on Ascend (ftrun/mindspore_elastic/repair.py), through a fake of
MindSpore's Ascend internals (``mindspore._c_expression``, ``mindspore.communication``) that records the
calls, as the hccl path is tested through a fake torch_npu. The channel (files, threads) and the agent's
relay (a real TCPStore on loopback) are real."""

from __future__ import annotations

import datetime
import sys
import threading
import types

import numpy as np
import pytest
from torch.distributed import TCPStore

import ftrun.mindspore_elastic
from ftrun.agent.relay import FolderRelay
from ftrun.contract import CollectiveFailure, Endpoint, Fallback, Milestone, RelayFolder, RollbackFailure, WorkerEnv
from ftrun.errors import EXIT_STUCK
from ftrun.keys import GROUP_READY, JobKeys
from ftrun.mindspore_elastic.backends import AscendHooks
from ftrun.mindspore_elastic.job import MindSporeJob
from ftrun.mindspore_elastic.link import RepairChannel
from ftrun.mindspore_elastic.repair import MindSporeRepair
from ftrun.repair_loop import RepairError
from ftrun.rollback import NO_STATE
from ftrun.store import ControlStore


class FakeMindSpore:
    """``mindspore._c_expression`` and ``mindspore.communication`` as far as the repair calls them: each
    call is recorded; the all-gather answers with the rows the test gives."""

    def __init__(self, monkeypatch, rows, uce_strategy="RS_UCE_HIGHLEVEL"):
        self.calls: list[tuple] = []
        self.rows = rows
        self.stopped = threading.Event()
        record = self._record
        c_expression = types.SimpleNamespace(
            _stop_device=lambda device: (record("_stop_device", device), self.stopped.set()),
            clean_tdt_channel=lambda: record("clean_tdt_channel"),
            _reset_snapshot_state=lambda: record("_reset_snapshot_state"),
            _finalize_comm=lambda: record("_finalize_comm"),
            _rebuild_group=lambda: record("_rebuild_group"),
            set_is_arf=lambda on: record("set_is_arf", on),
            _pre_launch_send_recv=lambda device: record("_pre_launch_send_recv", device),
            send_recv=lambda params, src, dst: record("send_recv", len(params), src, dst) or 0,
            CollectiveManager=types.SimpleNamespace(get_instance=lambda: types.SimpleNamespace(
                resume_hccl_comm=lambda: record("resume_hccl_comm"))),
            _get_uce_mem_info=lambda device: record("_get_uce_mem_info", device),
            _get_uce_process_strategy=lambda: record("_get_uce_process_strategy") or uce_strategy,
            _repair_device=lambda device: record("_repair_device", device),
        )
        comm_func = types.SimpleNamespace(all_gather_into_tensor=self._all_gather)
        mindspore = types.SimpleNamespace(Tensor=np.asarray, _c_expression=c_expression,
                                          communication=types.SimpleNamespace(comm_func=comm_func))
        monkeypatch.setitem(sys.modules, "mindspore", mindspore)
        monkeypatch.setitem(sys.modules, "mindspore._c_expression", c_expression)
        monkeypatch.setitem(sys.modules, "mindspore.communication", mindspore.communication)

    def _record(self, *call):
        self.calls.append(call)

    def _all_gather(self, tensor):
        self.calls.append(("all_gather", tuple(int(x) for x in tensor[0])))
        return types.SimpleNamespace(asnumpy=lambda: np.array(self.rows)), None

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


class State:
    """A rank's training state as the repair sees it (MindSporeJob's part of it)."""

    def __init__(self, rank, world_size=2, step=5, held=(), sharded=False):
        self.rank, self.world_size, self.step, self.sharded = rank, world_size, step, sharded
        self.held = list(held)
        self.loaded: list[int] = []

    def parameters(self):
        return ["w", "b", "moment"]

    def held_snapshots(self):
        return self.held

    def load_snapshot(self, step):
        self.loaded.append(step)

    def resume_at(self, step):
        self.step = step


class Agent:
    """What the rank's agent writes into the repair folder (the relay's part, done by the test)."""

    def __init__(self, folder: RelayFolder):
        self.folder = folder

    def announce(self, generation):
        self.folder.write(self.folder.target, str(generation))

    def ready(self, generation, said=RelayFolder.READY):
        self.folder.write(self.folder.ready(generation), said)

    def reached(self):
        return sorted((g, rank, what) for _, g, rank, what in self.folder.reports())


@pytest.fixture
def folder(tmp_path):
    return RelayFolder(str(tmp_path))


def make_repair(folder, state, generation=0, replacement=False, timeout=5.0, fault_wait=5.0):
    return MindSporeRepair(state, AscendHooks(device_id=3), RepairChannel(folder, state.rank), generation,
                           replacement, timeout, fault_wait)


def test_a_healthy_rank_stops_cleans_rebuilds_and_sends_the_state_in_order(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    agent.announce(1)
    agent.ready(1)
    state = State(rank=0)
    make_repair(folder, state).recover(1)
    assert fake.calls == [
        ("_stop_device", 3), ("clean_tdt_channel",), ("_reset_snapshot_state",),
        ("_finalize_comm",), ("_rebuild_group",), ("set_is_arf", True), ("_pre_launch_send_recv", 3),
        ("all_gather", (5, NO_STATE, NO_STATE)), ("send_recv", 3, 0, 1),
    ]
    assert agent.reached() == [(1, 0, m.value) for m in sorted(Milestone, key=lambda m: m.value)]
    assert state.step == 5


def test_the_replacement_rejoins_without_stopping_and_receives_the_state(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    agent.announce(1)
    agent.ready(1)
    state = State(rank=1, step=0)
    make_repair(folder, state, generation=1, replacement=True).recover(1)
    assert fake.calls == [("_pre_launch_send_recv", 3), ("all_gather", (NO_STATE, NO_STATE, NO_STATE)),
                          ("send_recv", 3, 0, 1)]
    assert [what for _, _, what in agent.reached()] == ["arrived", "joined", "resumed"]  # never "stopped"
    assert state.step == 5


def test_no_replica_holds_the_state_so_every_rank_goes_back_to_the_common_snapshot(monkeypatch, folder):
    # sharded: each rank is its own replica set, and rank 1's was lost; both hold step 4's snapshot
    fake = FakeMindSpore(monkeypatch, rows=[[5, 4, 2], [NO_STATE, 4, NO_STATE]])
    Agent(folder).ready(1)
    state = State(rank=0, held=[4, 2], sharded=True)
    make_repair(folder, state).rollback(1)
    assert "send_recv" not in fake.names()
    assert state.loaded == [4] and state.step == 4


def test_no_snapshot_either_falls_back_to_job_level_through_the_agent(monkeypatch, folder):
    FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    channel_waits = []
    monkeypatch.setattr(RepairChannel, "await_stop",
                        lambda self, generation, failure: channel_waits.append(failure) or sys.exit(0))
    repair = make_repair(folder, State(rank=0, sharded=True))
    with pytest.raises(SystemExit):
        repair.rollback(1)
    said = RollbackFailure.from_text(folder.read(folder.reached(1, 0, RelayFolder.FAILURE)))
    assert said is not None and said.cause is Fallback.NO_SNAPSHOTS
    assert channel_waits == [said]


def test_a_repair_whose_ranks_never_all_arrive_ends_at_its_deadline(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)  # never ready
    with pytest.raises(RepairError, match="not every rank arrived within 0.1s"):
        make_repair(folder, State(rank=0), timeout=0.1).recover(1)
    assert "_rebuild_group" not in fake.names()


def test_a_superseded_generation_is_left_for_the_newer_one(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    agent.announce(2)  # generation 1 was superseded before every rank arrived in it
    agent.ready(2)
    make_repair(folder, State(rank=0)).recover(1)
    assert fake.names().count("_stop_device") == 2  # once for each generation it went into
    assert (2, 0, "resumed") in agent.reached() and (1, 0, "joined") not in agent.reached()


def job_with(repair: MindSporeRepair) -> MindSporeJob:
    """A MindSpore job (made outside ftrun: no snapshots, no relay) whose steps ``repair`` repairs."""
    job = MindSporeJob()
    job.repair = repair
    return job


def test_the_watch_stops_the_device_under_a_blocked_step_and_the_guard_repairs(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    state = State(rank=0)
    repair = make_repair(folder, state)
    repair.start_watch()
    job = job_with(repair)
    guard = job.guard()
    try:
        with guard:
            agent.announce(1)
            if not fake.stopped.wait(5.0):  # the step blocked in a collective until the device stops
                pytest.fail("the watch did not stop the device")
            raise RuntimeError("the device was stopped")
        assert guard.decision.target == 1
        assert job.step == 0  # an interrupted step is not committed
        agent.ready(1)
        assert job._go_on(guard.decision).repaired
    finally:
        repair.close()
    assert fake.names()[:2] == ["_stop_device", "_stop_device"]  # the watch's, then the repair's own
    assert repair.generation == 1 and not repair.repairing


def test_the_guard_lets_the_ranks_own_error_through(monkeypatch, folder):
    job = job_with(make_repair(folder, State(rank=0), fault_wait=0.05))
    with pytest.raises(RuntimeError, match="its own"):
        with job.guard():
            raise RuntimeError("its own")  # no repair announced within fault_wait
    with pytest.raises(ValueError):
        with job.guard():
            raise ValueError("a bug")
    assert job.step == 0


def test_a_rank_stuck_in_its_step_exits_to_be_replaced(folder):
    repair = make_repair(folder, State(rank=0), fault_wait=0.05)
    repair.hooks = types.SimpleNamespace(stop=lambda: None)  # a device stop that frees nothing
    repair.in_step = True
    Agent(folder).announce(1)
    exits = []
    repair._see_through(0, exits.append)
    assert exits == [75]


def test_the_channel_reads_the_target_only_when_it_changed(folder):
    channel, agent = RepairChannel(folder, rank=2), Agent(folder)
    assert channel.target() == 0
    agent.announce(3)
    assert channel.target() == 3
    assert channel.await_target(above=3, timeout=0.05) is None
    threading.Timer(0.05, agent.announce, (4,)).start()
    assert channel.await_target(above=3, timeout=5.0) == 4


def test_the_channel_between_threads_a_rank_waits_for_its_group(folder):
    channel, agent = RepairChannel(folder, rank=0), Agent(folder)
    agent.announce(1)
    threading.Timer(0.05, agent.ready, (1,)).start()
    assert channel.group_ready(1, timeout=5.0) is True
    with pytest.raises(TimeoutError):
        channel.group_ready(2, timeout=0.05)  # announced, but not every rank arrived
    agent.announce(3)
    assert channel.group_ready(2, timeout=5.0) is False  # superseded


def control_store() -> ControlStore:
    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return ControlStore(raw, Endpoint("127.0.0.1", raw.port), is_host=True)


@pytest.fixture
def store():
    return control_store()


def test_the_relay_carries_announcements_and_counts_milestones_in_the_store(store, folder):
    keys = JobKeys("run")
    relay = FolderRelay(lambda: store, keys, folder, world_size=lambda: 2)
    store.set_text(keys.target_generation, "1")
    relay.tick()
    channel = RepairChannel(folder, rank=0)
    assert channel.target() == 1
    channel.reach(1, Milestone.STOPPED)
    channel.reach(1, Milestone.ARRIVED)
    store.add(keys.milestone(1, Milestone.ARRIVED.value))  # the other node's rank arrived first
    relay.tick()
    assert store.counter(keys.milestone(1, Milestone.STOPPED.value)) == 1
    assert store.try_text(keys.group_ready(1)) == GROUP_READY  # this node's rank was the last
    assert channel.group_ready(1, timeout=1.0) is True
    assert folder.reports() == []  # each counted once


def test_the_relay_hands_a_ranks_rollback_failure_to_the_controller(store, folder):
    keys = JobKeys("run")
    relay = FolderRelay(lambda: store, keys, folder, world_size=lambda: 2)
    failure = RollbackFailure(Fallback.NO_COMMON_SNAPSHOT, replicas=True)
    RepairChannel(folder, rank=1).rollback_failed(3, failure)
    relay.tick()
    assert RollbackFailure.from_text(store.try_text(keys.rollback_failure(3))) == failure


def test_the_relay_follows_the_agents_store_when_the_controller_moved(store, folder):
    """Under etcd the agent reconnects to the successor's store: the relay reads and counts there."""
    keys = JobKeys("run")
    current = [store]
    relay = FolderRelay(lambda: current[0], keys, folder, world_size=lambda: 1)
    store.set_text(keys.target_generation, "1")
    relay.tick()
    current[0] = successor = control_store()
    successor.set_text(keys.target_generation, "2")
    RepairChannel(folder, rank=0).reach(2, Milestone.ARRIVED)
    relay.tick()
    assert RepairChannel(folder, rank=0).target() == 2
    assert successor.try_text(keys.group_ready(2)) == GROUP_READY
    assert not store.try_text(keys.group_ready(2))


def test_a_mindspore_rank_s_progress_reaches_the_store_through_its_agent(store, folder, monkeypatch):
    """Its first step at once, then at most once a PROGRESS_INTERVAL, and the last one as it closes."""
    env = WorkerEnv(rank=1, local_rank=1, world_size=2, run_id="run", generation=0, control_store="127.0.0.1:1",
                    replacement=False, heartbeat_timeout=30.0, recovery="job", relay_dir=folder.path)
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    keys = JobKeys("run")
    relay = FolderRelay(lambda: store, keys, folder, world_size=lambda: 2, repairs=False)
    store.set_text(keys.target_generation, "1")  # a job-level job's relay reads no announcement
    job = ftrun.mindspore_elastic.init()
    assert job.repair is None  # job level: no repair watch
    job.commit()
    relay.tick()
    assert store.try_text(keys.rank_progress(1)) == "1"
    job.commit()
    job.commit()  # within the interval: not written yet
    relay.tick()
    assert store.try_text(keys.rank_progress(1)) == "1"
    job.close()
    relay.tick()
    assert store.try_text(keys.rank_progress(1)) == "3"
    assert folder.reports() == []  # progress is no milestone
    assert RepairChannel(folder, rank=1).target() == 0


# -- the online level: a collective failed while every process lived, no process replaced ---------------


def announce_online(folder: RelayFolder, generation: int) -> None:
    """What the relay writes for a repair that replaces nobody: the flag, then the target, then readiness."""
    folder.write(folder.online(generation), "")
    Agent(folder).announce(generation)
    Agent(folder).ready(generation)


def test_a_step_that_fails_with_no_repair_announced_tells_its_agent_at_once(monkeypatch, folder):
    FakeMindSpore(monkeypatch, rows=[])
    repair = make_repair(folder, State(rank=1), fault_wait=0.05)
    assert repair.target_after(RuntimeError("HCCL function error: link down\ncontext")) is None  # none came
    [(_, generation, rank, what)] = folder.reports()
    assert (generation, rank, what) == (0, 1, RelayFolder.COLLECTIVE)
    failure = CollectiveFailure.from_text(folder.read(folder.reached(0, 1, RelayFolder.COLLECTIVE)))
    assert (failure.rank, failure.generation, failure.error) == (1, 0, "HCCL function error: link down")


def test_a_step_stopped_by_an_announced_repair_reports_nothing(monkeypatch, folder):
    FakeMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)
    assert make_repair(folder, State(rank=0)).target_after(RuntimeError("device stopped")) == 1
    assert folder.reports() == []


def test_an_online_repair_resumes_the_communicators_and_rebuilds_nothing(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    announce_online(folder, 1)
    state = State(rank=0)
    make_repair(folder, state).recover(1)
    assert fake.calls == [("_stop_device", 3), ("clean_tdt_channel",), ("resume_hccl_comm",),
                          ("all_gather", (5, NO_STATE, NO_STATE))]
    assert state.step == 5


def test_a_uce_in_the_training_state_repairs_the_device_and_takes_a_replica_s_state(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[NO_STATE, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    announce_online(folder, 1)
    repair = make_repair(folder, State(rank=0))
    assert repair.target_after(RuntimeError("ACL stream synchronize failed, error code is 507053")) == 1
    repair.recover(1)
    assert fake.calls == [
        ("_stop_device", 3), ("_get_uce_mem_info", 3), ("_get_uce_process_strategy",), ("clean_tdt_channel",),
        ("resume_hccl_comm",), ("_repair_device", 3), ("all_gather", (NO_STATE, NO_STATE, NO_STATE)),
        ("send_recv", 3, 1, 0)]


def test_a_uce_in_memory_of_a_step_keeps_the_rank_s_own_state(monkeypatch, folder):
    fake = FakeMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]],
                         uce_strategy="RS_UCE_LOWLEVEL")
    announce_online(folder, 1)
    repair = make_repair(folder, State(rank=0))
    repair.target_after(RuntimeError("UCE ERROR happened on device"))
    repair.recover(1)
    assert ("all_gather", (5, NO_STATE, NO_STATE)) in fake.calls and "send_recv" not in fake.names()


def test_a_uce_mindspore_cannot_repair_ends_the_process_to_be_replaced(monkeypatch, folder):
    FakeMindSpore(monkeypatch, rows=[], uce_strategy="RS_NORMAL")
    announce_online(folder, 1)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr("ftrun.mindspore_elastic.repair.os._exit", exit_)
    repair = make_repair(folder, State(rank=0))
    repair.target_after(RuntimeError("UCE ERROR happened on device"))
    with pytest.raises(SystemExit) as ended:
        repair.recover(1)
    assert ended.value.code == EXIT_STUCK


def test_the_relay_hands_a_failed_collective_and_the_online_flag_on(store, folder):
    keys = JobKeys("run")
    relay = FolderRelay(lambda: store, keys, folder, world_size=lambda: 2)
    first = CollectiveFailure(1, 0, "link down", at=5.0)
    RepairChannel(folder, rank=1).collective_failed(first)
    relay.tick()
    RepairChannel(folder, rank=0).collective_failed(CollectiveFailure(0, 0, "an echo", at=6.0))
    relay.tick()
    assert CollectiveFailure.from_text(store.try_text(keys.collective_failure(0))) == first  # the first stays
    store.set_text(keys.online_repair(1), "1")
    store.set_text(keys.target_generation, "1")
    relay.tick()
    assert RepairChannel(folder, rank=0).online(1) and RepairChannel(folder, rank=0).target() == 1
    store.set_text(keys.target_generation, "2")  # a repair that replaces a process
    relay.tick()
    assert not RepairChannel(folder, rank=0).online(2)
