"""The process-level repair of MindSpore ranks on Ascend (ftrun/mindspore_elastic/repair.py), through a stand-in
for MindSpore 2.10's Ascend parts (tests/unit/mindspore_ascend.py) that behaves as the released code does and
records the calls, as the hccl path is tested through a fake torch_npu. Every test runs with the variables the
agent gives a process-level worker. The channel (files, threads) and the agent's relay (a real TCPStore on
loopback) are real."""

from __future__ import annotations

import datetime
import os
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
from ftrun.mindspore import recovery_variables
from ftrun.mindspore_elastic.backends import AscendHooks
from ftrun.mindspore_elastic.job import MindSporeJob
from ftrun.mindspore_elastic.link import RepairChannel
from ftrun.mindspore_elastic.repair import MindSporeRepair
from ftrun.repair_loop import RepairError
from ftrun.rollback import NO_STATE
from ftrun.step_times import StepClock, StepTimes
from ftrun.store import ControlStore
from tests.conftest import FakeClock
from tests.unit.mindspore_ascend import FLAG_NAME, AscendMindSpore, KilledByWatchdog, Parameter


class State:
    """A rank's training state as the repair sees it (MindSporeJob's part of it)."""

    def __init__(self, rank, world_size=2, step=5, held=(), sharded=False, flag=1):
        self.rank, self.world_size, self.step, self.sharded = rank, world_size, step, sharded
        #: the network's and the fault-tolerant optimizer's parameters (flag None: a plain optimizer, no flag)
        self.params = [Parameter("w", [1.0]), Parameter("b", [0.0]), Parameter("moment", [0.0])]
        if flag is not None:
            self.params.append(Parameter(f"optimizer.{FLAG_NAME}", np.array([flag], dtype=np.int32)))
        self.held = list(held)
        self.loaded: list[int] = []

    def parameters(self):
        return self.params

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


@pytest.fixture(autouse=True)
def process_level_worker(monkeypatch):
    """The environment the agent gives a worker at process level on Ascend (agent/workers.py's
    generation_env), which the stand-in reads as MindSpore does."""
    monkeypatch.delenv("MS_ENABLE_TFT", raising=False)
    for name, value in recovery_variables().items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def folder(tmp_path):
    return RelayFolder(str(tmp_path))


def make_repair(folder, state, generation=0, replacement=False, timeout=5.0, fault_wait=5.0):
    return MindSporeRepair(state, AscendHooks(device_id=3), RepairChannel(folder, state.rank), generation,
                           replacement, timeout, fault_wait)


def test_a_healthy_rank_stops_cleans_rebuilds_and_sends_the_state_in_order(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    agent.announce(1)
    agent.ready(1)
    state = State(rank=0)
    make_repair(folder, state).recover(1)
    assert fake.calls == [
        ("_stop_device", 3), ("clean_tdt_channel",), ("_reset_snapshot_state",),
        ("_finalize_comm",), ("_rebuild_group",), ("set_is_arf", True), ("_pre_launch_send_recv", 3),
        ("_reset_error_state",), ("all_gather", (5, NO_STATE, NO_STATE)), ("send_recv", 4, 0, 1),
    ]
    assert agent.reached() == [(1, 0, m.value) for m in sorted(Milestone, key=lambda m: m.value)]
    assert state.step == 5


def test_the_replacement_rejoins_without_stopping_and_receives_the_state(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    agent.announce(1)
    agent.ready(1)
    state = State(rank=1, step=0)
    make_repair(folder, state, generation=1, replacement=True).recover(1)
    assert fake.calls == [("_pre_launch_send_recv", 3), ("all_gather", (NO_STATE, NO_STATE, NO_STATE)),
                          ("send_recv", 4, 0, 1)]
    assert [what for _, _, what in agent.reached()] == ["arrived", "joined", "resumed"]  # never "stopped"
    assert state.step == 5


def test_no_replica_holds_the_state_so_every_rank_goes_back_to_the_common_snapshot(monkeypatch, folder):
    # sharded: each rank is its own replica set, and rank 1's was lost; both hold step 4's snapshot
    fake = AscendMindSpore(monkeypatch, rows=[[5, 4, 2], [NO_STATE, 4, NO_STATE]])
    Agent(folder).ready(1)
    state = State(rank=0, held=[4, 2], sharded=True)
    make_repair(folder, state).rollback(1)
    assert "send_recv" not in fake.names()
    assert state.loaded == [4] and state.step == 4


def test_no_snapshot_either_falls_back_to_job_level_through_the_agent(monkeypatch, folder):
    AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
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
    fake = AscendMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)  # never ready
    with pytest.raises(RepairError, match="not every rank arrived within 0.1s"):
        make_repair(folder, State(rank=0), timeout=0.1).recover(1)
    assert "_rebuild_group" not in fake.names()


def test_a_superseded_generation_is_left_for_the_newer_one(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
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
    """Pins mismatch 3 of ASCEND.md: only with MS_ENABLE_TFT's ARF (or UCE) does MindSpore turn the stop into a
    failed step; without it, its HCCL watchdog ends the worker's process group instead."""
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    agent = Agent(folder)
    state = State(rank=0)
    repair = make_repair(folder, state)
    repair.start_watch()
    job = job_with(repair)
    guard = job.guard()
    try:
        with guard:
            agent.announce(1)
            fake.blocked_collective()  # the step blocked until the device stops: with ARF on, the step then fails
        assert guard.decision.target == 1
        assert job.step == 0  # an interrupted step is not committed
        agent.ready(1)
        assert job._go_on(guard.decision).repaired
    finally:
        repair.close()
    assert fake.names()[:2] == ["_stop_device", "_stop_device"]  # the watch's, then the repair's own
    assert repair.generation == 1 and not repair.repairing
    assert fake.killpg == []


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


def job_level_rank(store, folder, monkeypatch) -> tuple[JobKeys, FolderRelay]:
    """Rank 1 of 2 at job level, as its agent starts it: the job's keys, and its agent's relay to ``store``."""
    env = WorkerEnv(rank=1, local_rank=1, world_size=2, run_id="run", generation=0, control_store="127.0.0.1:1",
                    replacement=False, heartbeat_timeout=30.0, recovery="job", relay_dir=folder.path)
    for name, value in env.to_environ().items():
        monkeypatch.setenv(name, value)
    keys = JobKeys("run")
    return keys, FolderRelay(lambda: store, keys, folder, world_size=lambda: 2, repairs=False)


def test_a_mindspore_rank_s_progress_reaches_the_store_through_its_agent(store, folder, monkeypatch):
    """Its first step at once, then at most once a PROGRESS_INTERVAL, and the last one as it closes."""
    keys, relay = job_level_rank(store, folder, monkeypatch)
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


def test_a_mindspore_rank_s_step_times_reach_the_store_through_its_agent_all_of_them_compute(store, folder,
                                                                                            monkeypatch):
    """Each committed step is timed from its beginning (begin_step's, or the loop's for a body without guard())
    to its end, as a torch rank's is, and its agent relays the medians with the progress. Its wait is 0: MindSpore's
    collectives run inside its graph. A step that failed is not timed."""
    keys, relay = job_level_rank(store, folder, monkeypatch)
    clock = FakeClock()
    job = ftrun.mindspore_elastic.init()
    job.clock = StepClock(now=clock)
    for seconds in (0.2, 0.4, 0.3):
        job.begin_step()
        clock.advance(seconds)
        job.end_step()
    job.begin_step()
    clock.advance(9.0)
    assert job.end_step(RuntimeError("not ours")).lost is not None  # lost: no step committed, none timed
    job.end_step()  # an end with no beginning (a callback's first step): committed, not timed
    for _ in job.steps(6):  # a body without guard(): from the loop's yield to the next step's
        clock.advance(0.5)
    relay.tick()
    times = StepTimes.from_text(store.try_text(keys.rank_step_times(1)))
    assert times == StepTimes(steps=5, step=0.4, compute=0.4, wait=0.0, pid=os.getpid())
    assert store.try_text(keys.rank_progress(1)) == "6"


# -- the online level: a collective failed while every process lived, no process replaced ---------------


def announce_online(folder: RelayFolder, generation: int) -> None:
    """What the relay writes for a repair that replaces nobody: the flag, then the target, then readiness."""
    folder.write(folder.online(generation), "")
    Agent(folder).announce(generation)
    Agent(folder).ready(generation)


def test_a_step_that_fails_with_no_repair_announced_tells_its_agent_at_once(monkeypatch, folder):
    AscendMindSpore(monkeypatch, rows=[])
    repair = make_repair(folder, State(rank=1), fault_wait=0.05)
    assert repair.target_after(RuntimeError("HCCL function error: link down\ncontext")) is None  # none came
    [(_, generation, rank, what)] = folder.reports()
    assert (generation, rank, what) == (0, 1, RelayFolder.COLLECTIVE)
    failure = CollectiveFailure.from_text(folder.read(folder.reached(0, 1, RelayFolder.COLLECTIVE)))
    assert (failure.rank, failure.generation, failure.error) == (1, 0, "HCCL function error: link down")


def test_a_step_stopped_by_an_announced_repair_reports_nothing(monkeypatch, folder):
    AscendMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)
    assert make_repair(folder, State(rank=0)).target_after(RuntimeError("device stopped")) == 1
    assert folder.reports() == []


def test_an_online_repair_resumes_the_communicators_and_rebuilds_nothing(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    announce_online(folder, 1)
    state = State(rank=0)
    make_repair(folder, state).recover(1)
    assert fake.calls == [("_stop_device", 3), ("clean_tdt_channel",), ("resume_hccl_comm",), ("_reset_error_state",),
                          ("all_gather", (5, NO_STATE, NO_STATE))]
    assert state.step == 5


def test_a_uce_in_the_training_state_repairs_the_device_and_takes_a_replica_s_state(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[NO_STATE, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    announce_online(folder, 1)
    repair = make_repair(folder, State(rank=0))
    assert repair.target_after(fake.memory_error()) == 1
    repair.recover(1)
    assert fake.calls == [
        ("_stop_device", 3), ("_get_uce_mem_info", 3), ("_get_uce_process_strategy",), ("clean_tdt_channel",),
        ("resume_hccl_comm",), ("_repair_device", 3), ("_reset_error_state",),
        ("all_gather", (NO_STATE, NO_STATE, NO_STATE)),
        ("send_recv", 4, 1, 0)]


def test_a_uce_in_memory_of_a_step_keeps_the_rank_s_own_state(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]],
                           uce_strategy="RS_UCE_LOWLEVEL")
    announce_online(folder, 1)
    repair = make_repair(folder, State(rank=0))
    repair.target_after(fake.memory_error())
    repair.recover(1)
    assert ("all_gather", (5, NO_STATE, NO_STATE)) in fake.calls and "send_recv" not in fake.names()


def test_a_uce_mindspore_cannot_repair_ends_the_process_to_be_replaced(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[], uce_strategy="RS_NORMAL")
    announce_online(folder, 1)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr("ftrun.mindspore_elastic.repair.os._exit", exit_)
    repair = make_repair(folder, State(rank=0))
    repair.target_after(fake.memory_error())
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


# -- MindSpore's own fault tolerance switched on, and its resume sequence (ASCEND.md, mismatches 3 and 4) ----


def test_process_level_switches_on_mindspore_s_uce_and_arf_and_turns_its_hccl_watchdog_off(monkeypatch):
    """What MindSpore makes of the variables a process-level worker gets: UCE tagging, the ARF path (a
    stopped step fails), and no HCCL watchdog to end the process group under a repair."""
    fake = AscendMindSpore(monkeypatch, rows=[])
    assert fake.enabled("UCE") and fake.enabled("ARF") and fake.enabled("HCCE")
    assert not fake.watchdog


@pytest.mark.parametrize("hbm_ecc", [False, True])
def test_mindspore_s_own_uce_texts_mark_the_step_s_error_as_a_uce(monkeypatch, folder, hbm_ecc):
    fake = AscendMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)
    repair = make_repair(folder, State(rank=0))
    assert repair.target_after(fake.memory_error(hbm_ecc)) == 1
    assert repair.uce


@pytest.mark.parametrize("text", ["UCEError occurs when execute.",
                                  "UCEError error occurs when execute, error_code=507054",
                                  "ACL stream synchronize failed, error code is 507054"])
def test_every_uce_text_of_mindspore_and_acl_is_a_uce(monkeypatch, folder, text):
    AscendMindSpore(monkeypatch, rows=[])
    Agent(folder).announce(1)
    repair = make_repair(folder, State(rank=0))
    repair.target_after(RuntimeError(text))
    assert repair.uce


def test_the_error_state_is_reset_before_the_rank_resumes(monkeypatch, folder):
    """Pins mismatch 4: MindSpore clears the stop's error state before training goes on (model.py:326)."""
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    Agent(folder).announce(1)
    Agent(folder).ready(1)
    make_repair(folder, State(rank=0)).recover(1)
    assert not fake.force_stop
    names = fake.names()
    assert names.index("_pre_launch_send_recv") < names.index("_reset_error_state") < names.index("all_gather")


def test_the_arf_flag_comes_down_at_the_end_of_the_first_step_after_a_rebuild(monkeypatch, folder):
    """Pins mismatch 4: TrainFaultTolerance lowers it with set_is_arf(False) as the next step ends
    (_train_fault_tolerance.py:974-979), once."""
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    Agent(folder).announce(1)
    Agent(folder).ready(1)
    repair = make_repair(folder, State(rank=0))
    job = job_with(repair)
    repair.recover(1)
    assert fake.is_arf
    with job.guard():
        pass
    assert not fake.is_arf
    with job.guard():
        pass
    assert fake.names().count("set_is_arf") == 2


def test_the_optimizer_s_flag_goes_back_to_one_as_each_step_ends(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[])
    state = State(rank=0)
    job = job_with(make_repair(folder, state))
    with job.guard():
        fake.optimizer_update_begins(state.params[-1], world_size=2)
    assert int(state.params[-1].value[0]) == 1 and job.step == 1


def interrupt_mid_step(fake, folder, state, update_began: bool) -> MindSporeRepair:
    """A healthy rank whose step is stopped by a repair, in its optimizer's update or before it."""
    agent = Agent(folder)
    repair = make_repair(folder, state)
    if update_began:
        fake.optimizer_update_begins(state.params[-1], state.world_size)
    agent.announce(1)
    agent.ready(1)
    assert repair.target_after(RuntimeError("ForceStopError error occurs when execute")) == 1
    repair.recover(1)
    return repair


def test_a_rank_stopped_in_its_optimizer_s_update_takes_a_replica_s_state(monkeypatch, folder):
    """Pins mismatch 4: MindSpore refuses to stop a rank whose parameters are mid-update
    (_is_params_consistent, _train_fault_tolerance.py:176-180). ftrun stops it all the same (its step may be
    blocked) and has it give up its claim, so that it takes a healthy replica's state rather than serve its own."""
    fake = AscendMindSpore(monkeypatch, rows=[[NO_STATE, NO_STATE, NO_STATE], [5, NO_STATE, NO_STATE]])
    state = State(rank=0)
    interrupt_mid_step(fake, folder, state, update_began=True)
    assert ("all_gather", (NO_STATE, NO_STATE, NO_STATE)) in fake.calls
    assert ("send_recv", 4, 1, 0) in fake.calls and state.step == 5


def test_a_rank_stopped_before_its_optimizer_s_update_serves_its_committed_step(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    interrupt_mid_step(fake, folder, State(rank=0), update_began=False)
    assert ("all_gather", (5, NO_STATE, NO_STATE)) in fake.calls and ("send_recv", 4, 0, 1) in fake.calls


def test_a_rank_with_no_fault_tolerant_optimizer_cannot_vouch_for_an_interrupted_step(monkeypatch, folder):
    """With no flag, MindSpore's check answers "not consistent" (_train_fault_tolerance.py:791-796)."""
    fake = AscendMindSpore(monkeypatch, rows=[[NO_STATE, 4, NO_STATE], [NO_STATE, 4, NO_STATE]])
    state = State(rank=0, held=[4], flag=None)
    interrupt_mid_step(fake, folder, state, update_began=False)
    assert ("all_gather", (NO_STATE, 4, NO_STATE)) in fake.calls
    assert state.loaded == [4] and state.step == 4


def test_a_rank_repaired_between_steps_holds_its_committed_step_with_or_without_the_flag(monkeypatch, folder):
    fake = AscendMindSpore(monkeypatch, rows=[[5, NO_STATE, NO_STATE], [NO_STATE, NO_STATE, NO_STATE]])
    Agent(folder).announce(1)
    Agent(folder).ready(1)
    make_repair(folder, State(rank=0, flag=None)).recover(1)  # announced between two steps: nothing interrupted
    assert ("all_gather", (5, NO_STATE, NO_STATE)) in fake.calls
