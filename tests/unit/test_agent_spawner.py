"""Starting a node's workers on usable devices (ftrun/agent/spawner.py) and the generation's environment
(ftrun/agent/generations.py): real worker processes, a real TCPStore, the stand-in npu-smi for the devices."""

from __future__ import annotations

import time

import pytest

from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.generations import GenerationEnvs
from ftrun.agent.spawner import Spawner
from ftrun.detection.table import FaultLevel, load_fault_table
from ftrun.messages import CommandKind, ReportKind
from tests.unit.node_parts import make_node


def npus(count: int) -> list[dict]:
    return [{"id": n, "name": "910B2", "chips": [{"id": 0, "logic_id": n, "health": "OK", "codes": [], "info": []}]}
            for n in range(count)]


@pytest.fixture
def node(tmp_path, fake_npu):
    """A node of two ranks on two stand-in NPUs, and its spawner."""
    n = make_node(tmp_path, "sleep,sleep")
    devices = NodeDevices(fake_npu("A2", npus(2)), load_fault_table(None), [0, 1], health_interval=60, reset_timeout=10,
                          reset_wait=0)
    envs = GenerationEnvs(n.config.run_id, n.seat, devices, str(n.folder), lambda: n.store.endpoint)
    n.spawner = Spawner(n.group, n.seat, devices, envs, lambda: n.protocol, n.supervision.started)
    n.devices = devices
    yield n
    n.close()


def test_each_rank_starts_on_its_own_device(node):
    node.spawner.start(node.command(CommandKind.START))
    assert [node.env_of(r, 0)["FTRUN_DEVICE"] for r in (0, 1)] == ["0", "1"]
    assert node.env_of(1, 0)["ASCEND_RT_VISIBLE_DEVICES"] == "0,1"


def test_a_replacement_waits_for_its_device_reset_then_starts_on_it(node):
    spawner, devices = node.spawner, node.devices
    spawner.start(node.command(CommandKind.START))
    healthy = node.group.workers[1].pid
    devices.on_worker_error(0, FaultLevel.RESTART_NPU, "HBM MULTI BIT ECC ERROR")
    node.group.clear(0, 2.0)
    replace = node.command(CommandKind.REPLACE, 1, ranks=(0,))
    spawner.respawn(replace, (0,))
    assert spawner.pending is not None and spawner.waiting_replacements() == (0,)
    assert node.group.workers[0].returncode is not None  # not started yet
    deadline = time.monotonic() + 20
    while spawner.pending is not None and time.monotonic() < deadline:
        devices.tick(running=[1])  # the reset starts once no running rank is on the device, and ends
        spawner.tick()
        time.sleep(0.05)
    assert spawner.pending is None
    env = node.env_of(0, 1)
    assert (env["FTRUN_DEVICE"], env["FTRUN_REPLACEMENT"]) == ("0", "1")
    assert node.group.workers[1].pid == healthy
    assert node.reports() == []


def lose_rank_zero(node, level: FaultLevel, reason: str) -> None:
    """Local rank 0 dies of its device's fault; its replacement is asked for."""
    node.spawner.start(node.command(CommandKind.START))
    node.devices.on_worker_error(0, level, reason)
    node.group.clear(0, 2.0)
    node.spawner.respawn(node.command(CommandKind.REPLACE, 1, ranks=(0,)), (0,))


def test_a_replacement_with_no_device_to_wait_for_reports_the_node_unusable(node):
    spawner = node.spawner
    lose_rank_zero(node, FaultLevel.SEPARATE, "chip lost")
    [report] = node.reports()
    assert (report.kind, report.generation) == (ReportKind.NODE_UNUSABLE, 1)
    assert "device" in report.detail
    assert spawner.pending is None


def test_a_cancelled_wait_starts_nothing(node):
    lose_rank_zero(node, FaultLevel.RESTART_NPU, "HBM MULTI BIT ECC ERROR")
    node.spawner.cancel()
    assert node.spawner.waiting_replacements() == () and node.group.workers[0].returncode is not None


def test_the_environment_names_the_control_store_as_it_is_now(tmp_path):
    n = make_node(tmp_path, "sleep,sleep")
    try:
        where = [n.store.endpoint]
        envs = GenerationEnvs(n.config.run_id, n.seat, n.devices, str(n.folder), lambda: where[0], "/run/store-file",
                              relay_dir="/run/relay")
        start = n.command(CommandKind.START, 3, previous_world_size=4)
        gen = envs.for_command(start)
        assert gen.control_store == str(n.store.endpoint)
        assert (gen.control_store_file, gen.relay_dir) == ("/run/store-file", "/run/relay")
        assert (gen.world_size, gen.node_count, gen.previous_world_size, gen.replacement) == (2, 1, 4, False)
        where[0] = "10.0.0.9:4000"  # the controller moved (etcd)
        assert envs.for_command(start, replacement=True).control_store == "10.0.0.9:4000"
        assert gen.ranktable == str(n.folder / "ranktable.json")
    finally:
        n.close()
