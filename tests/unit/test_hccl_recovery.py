"""Ascend torch workers' recovery against a stand-in torch_npu that behaves as 2.14.0 does (tests/npu_stand_in.py):
the HCCL watchdogs around a repair, the groups' global ranks and names, a device that cannot be stopped, and
the worker environment that keeps a healthy rank alive. Each test is named after the mismatch of ASCEND.md it
pins (a real cluster's failure that the old code would meet)."""

from __future__ import annotations

import logging
import os
import types

import pytest
import torch.distributed as dist

from ftrun.agent.workers import GenerationEnv, generation_env
from ftrun.config import build_launch_config
from ftrun.elastic.backends import DeviceNotStopped, HcclBackend
from ftrun.elastic.groups import GroupSet, init_default_group, install
from ftrun.elastic.link import ControlLink
from ftrun.elastic.repair import Repair
from ftrun.errors import EXIT_STUCK
from tests.npu_stand_in import WATCHDOG_RUN, WATCHDOG_STOP, Device, ProcessGroup, ProcessTornDown, TorchNpu, torch_pg_map

NPU = Device("npu")


@pytest.fixture
def torch_npu(monkeypatch):
    monkeypatch.delenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("HCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("RANK_TABLE_FILE", raising=False)
    monkeypatch.setattr("ftrun.elastic.backends._socket_fds", lambda: set())
    npu = TorchNpu()
    npu.install(monkeypatch)
    return npu


def hccl_groups(local_rank: int = 0) -> GroupSet:
    backend = HcclBackend(dist=types.SimpleNamespace(ProcessGroup=ProcessGroup), local_rank=local_rank)
    groups = GroupSet(backend, dist.HashStore(), lambda generation: f"g{generation}", timeout=5)
    groups.reconfigure(0)
    return groups


def script_group(groups: GroupSet, name: str, rank: int, ranks: list[int], size: int | None = None):
    """A group the script made (torch's options for the ftrun backend: global ranks empty for the world)."""
    options = types.SimpleNamespace(global_ranks_in_group=ranks, group_size=size or len(ranks), group_id=name,
                                    group_rank=rank)
    return groups.create(options)


def hccl_of(group):
    return group.real()._get_backend(NPU)


def test_mismatch_1_a_repair_leaves_no_force_stop_for_the_next_generation_s_first_collective(torch_npu):
    groups = hccl_groups()
    world = script_group(groups, "0", 1, [], size=2)
    world.barrier()  # in flight when the repair is announced
    old = hccl_of(world)
    groups.interrupt()  # the repair watcher stops the device
    old.watchdog_tick()  # the old group's watchdog takes its next look
    groups.release()
    groups.reconfigure(1)
    world.barrier()  # the next generation's first collective: it raised "FORCE STOP." with the old code
    assert hccl_of(world) is not old


def test_mismatch_1_the_watchdogs_of_ftrun_s_groups_are_paused_for_the_repair_and_resumed_after(torch_npu):
    groups = hccl_groups(local_rank=3)
    world, dp = script_group(groups, "0", 0, [], size=4), script_group(groups, "1", 0, [0, 2])
    for group in (world, dp):
        group.barrier()
    olds = [hccl_of(world), hccl_of(dp)]
    paused = []
    torch_npu.npu.check_uce_in_memory = lambda device: paused.append([o.watchdog_status for o in olds]) or 0
    groups.release()
    assert paused == [[WATCHDOG_STOP, WATCHDOG_STOP]]  # between stop_device and restart_device
    assert [(o.watchdog_status, o.work_meta_list) for o in olds] == [(WATCHDOG_RUN, []), (WATCHDOG_RUN, [])]
    assert torch_npu.calls == [("stop_device", 3), ("restart_device", 3)]
    assert not torch_npu.python_force_stop  # else torch_npu's excepthook reports any later error as FORCE STOP


def test_mismatch_1_torch_npu_alone_pauses_no_watchdog_of_ftrun_s_groups(torch_npu):
    # the reason ftrun pauses them itself: torch_npu walks torch's _pg_map, where ftrun's real groups are not,
    # and the ElasticGroup that is there has no device types
    groups = hccl_groups()
    install(groups, ("cpu",))
    init_default_group(groups, rank=0, world_size=1, timeout=5)
    try:
        world = dist.group.WORLD
        assert world in torch_pg_map() and world._device_types == []
        world.barrier()
        torch_npu.stop_device(0)
        assert hccl_of(world).watchdog_status != WATCHDOG_STOP
    finally:
        dist.destroy_process_group()


def process_level_env(tmp_path, recovery: str) -> dict[str, str]:
    script = tmp_path / "train.py"
    script.write_text("")
    config = build_launch_config({"script": str(script), "nproc_per_node": "2", "rdzv_endpoint": "head:29400",
                                  "device": "cpu", "recovery": recovery})
    generation = GenerationEnv(generation=1, restart_count=1, world_size=4, node_count=2, master_addr="head",
                               master_port=29501, control_store="head:29400", max_restarts=3)
    return generation_env(config, generation, str(tmp_path / "error.json"))


def test_mismatch_1_a_peer_s_death_seen_by_a_healthy_rank_s_watchdog_before_the_repair_does_not_end_it(
        torch_npu, tmp_path, monkeypatch):
    # the peer's death shows on the survivor's communicator (an error CQE) before any repair is announced: only
    # the watchdog's error handling decides whether the survivor lives to be repaired
    monkeypatch.setattr("os.environ", process_level_env(tmp_path, "process"))
    groups = hccl_groups()
    world = script_group(groups, "0", 0, [], size=2)
    world.barrier()
    hccl_of(world).comm_async_error = "error CQE: the peer's link went down"
    hccl_of(world).watchdog_tick()  # alive: no ProcessTornDown


def test_mismatch_1_at_job_level_torch_npu_s_own_error_handling_stays(torch_npu, tmp_path, monkeypatch):
    monkeypatch.setattr("os.environ", process_level_env(tmp_path, "job"))
    assert "TORCH_HCCL_ASYNC_ERROR_HANDLING" not in os.environ
    groups = hccl_groups()
    world = script_group(groups, "0", 0, [], size=2)
    world.barrier()
    hccl_of(world).comm_async_error = "error CQE"
    with pytest.raises(ProcessTornDown):
        hccl_of(world).watchdog_tick()


def test_a_user_s_own_async_error_handling_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HCCL_ASYNC_ERROR_HANDLING", "1")
    assert process_level_env(tmp_path, "process")["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_mismatch_2_a_sub_group_is_not_built_as_the_rank_table_s_world_at_its_group_rank(torch_npu, tmp_path,
                                                                                          monkeypatch):
    table = tmp_path / "hccl_ranktable.json"
    table.write_text("{}")
    monkeypatch.setenv("RANK_TABLE_FILE", str(table))
    groups = hccl_groups()
    world = script_group(groups, "0", 3, [], size=4)
    dp = script_group(groups, "1", 1, [1, 3])
    for group in (world, dp):
        group.barrier()
    assert hccl_of(dp).options.global_ranks_in_group == [1, 3]
    assert hccl_of(world).options.global_ranks_in_group == [0, 1, 2, 3]
    # both negotiated over the generation's store, at their own rank; no world communicator from the table
    assert [hccl_of(world).comm, hccl_of(dp).comm] == [("root info", 3), ("root info", 1)]
    assert torch_npu.global_group is None


def test_mismatch_2_every_real_group_has_its_own_name_in_each_generation(torch_npu):
    groups = hccl_groups()
    world, dp = script_group(groups, "0", 0, [], size=4), script_group(groups, "1", 0, [0, 2])
    names = [hccl_of(world).group_name, hccl_of(dp).group_name]
    groups.release()
    groups.reconfigure(1)
    names += [hccl_of(world).group_name, hccl_of(dp).group_name]
    assert len(set(names)) == 4 and all(name != "group_name_" for name in names)


def test_mismatch_8_a_device_that_cannot_be_stopped_is_not_restarted_and_says_so(torch_npu):
    torch_npu.abort_fails = True
    groups = hccl_groups(local_rank=2)
    with pytest.raises(DeviceNotStopped, match=r"stop_device\(2\) returned 1"):
        groups.release()
    assert torch_npu.calls == [("stop_device", 2)]


def test_mismatch_8_a_rank_whose_device_cannot_be_stopped_exits_to_be_replaced(torch_npu, monkeypatch, caplog):
    torch_npu.abort_fails = True
    monkeypatch.setattr("ftrun.elastic.repair.os._exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    repair = Repair(types.SimpleNamespace(reset_wrappers=lambda: None), hccl_groups(), types.SimpleNamespace(rank=5))
    with caplog.at_level(logging.ERROR, logger="ftrun.elastic"), pytest.raises(SystemExit) as exited:
        repair.leave()
    assert exited.value.code == EXIT_STUCK
    assert [r.getMessage() for r in caplog.records] == [
        "rank 5: the device's tasks could not be stopped (torch_npu.npu.stop_device(0) returned 1); "
        "exiting to be replaced"]


def test_mismatch_8_a_rank_whose_device_cannot_be_stopped_to_release_a_collective_exits_at_once(
        torch_npu, monkeypatch, caplog):
    # the repair watcher's interrupt: the main thread waits in a collective that nothing else can end
    torch_npu.abort_fails = True
    monkeypatch.setattr("ftrun.elastic.link.os._exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    link = types.SimpleNamespace(_groups=hccl_groups(local_rank=1), rank=4)
    with caplog.at_level(logging.ERROR, logger="ftrun.elastic"), pytest.raises(SystemExit) as exited:
        ControlLink._interrupt(link)
    assert exited.value.code == EXIT_STUCK
    assert [r.getMessage() for r in caplog.records] == [
        "rank 4: the device's tasks could not be stopped (torch_npu.npu.stop_device(1) returned 1); "
        "exiting to be replaced"]


@pytest.mark.parametrize("answer", [0, 1, 2, 3])
def test_the_uce_check_answers_as_torch_npu_does_and_refuses_without_the_memory_cache(torch_npu, monkeypatch, answer):
    torch_npu.uce = answer
    assert torch_npu.check_uce_in_memory(0) == answer
    monkeypatch.setenv("PYTORCH_NO_NPU_MEMORY_CACHING", "1")
    with pytest.raises(RuntimeError):
        torch_npu.check_uce_in_memory(0)
