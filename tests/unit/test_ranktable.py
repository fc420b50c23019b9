"""Rank tables: ftrun's own and HCCL's v1.0, built from the controller's layout (no store, no devices)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ftrun.messages import RankTableDevice, NodeSlot
from ftrun.ranktable import ftrun_table, hccl_table, load_device_ips, write_table
from ftrun.errors import UsageError


def assert_hccl_v1(table: dict, world_size: int) -> None:
    """The HCCL rank table v1.0 format: every value a string, ranks 0..n-1 once each, status completed."""
    assert set(table) == {"version", "server_count", "status", "server_list"}
    assert table["version"] == "1.0" and table["status"] == "completed"
    assert table["server_count"] == str(len(table["server_list"]))
    ranks = []
    for server in table["server_list"]:
        assert set(server) == {"server_id", "host_ip", "device"}
        assert all(isinstance(server[k], str) and server[k] for k in ("server_id", "host_ip"))
        for device in server["device"]:
            assert set(device) == {"device_id", "device_ip", "rank_id"}
            assert all(isinstance(v, str) for v in device.values())
            ranks.append(int(device["rank_id"]))
    assert ranks == list(range(world_size))  # contiguous from 0, in server order


def devices(*ips: str, physical_base: int = 0) -> tuple[RankTableDevice, ...]:
    return tuple(RankTableDevice(i, physical_base + i, ip) for i, ip in enumerate(ips))


NODES = (
    NodeSlot(0, "a:1", "n0", 2, 0, "10.0.0.1", devices("192.168.100.1", "192.168.101.1")),
    NodeSlot(1, "b:1", "n1", 2, 2, "10.0.0.2", devices("192.168.100.2", "192.168.101.2", "192.168.102.2")),
)


def test_ftrun_table_lists_every_rank_with_node_host_and_device():
    table = ftrun_table("job", 3, NODES, own_node=0, own_devices={0: 0, 1: 1})
    assert (table["generation"], table["world_size"], table["node_count"]) == (3, 4, 2)
    assert [(r["rank"], r["node_rank"], r["host"], r["local_rank"], r["device"]) for r in table["ranks"]] == [
        (0, 0, "n0", 0, 0), (1, 0, "n0", 1, 1), (2, 1, "n1", 0, 0), (3, 1, "n1", 1, 1)]


def test_own_node_shows_the_devices_its_agent_gave_a_moved_rank():
    table = ftrun_table("job", 1, NODES, own_node=1, own_devices={0: 0, 1: 2})  # local rank 1 moved off device 1
    moved = table["ranks"][3]
    assert (moved["device"], moved["physical_device"], moved["device_ip"]) == (2, 2, "192.168.102.2")


def test_hccl_table_has_the_v1_shape_and_physical_ids():
    table = hccl_table(ftrun_table("job", 0, NODES, own_node=0, own_devices={0: 0, 1: 1}))
    assert_hccl_v1(table, world_size=4)
    assert table["server_list"][1] == {"server_id": "10.0.0.2", "host_ip": "10.0.0.2", "device": [
        {"device_id": "0", "device_ip": "192.168.100.2", "rank_id": "2"},
        {"device_id": "1", "device_ip": "192.168.101.2", "rank_id": "3"}]}
    assert json.loads(json.dumps(table)) == table


def test_hccl_table_after_a_takeover_names_the_spare_and_its_devices():
    spare = NodeSlot(1, "s:1", "spare", 2, 2, "10.0.0.9", devices("192.168.100.9", "192.168.101.9", physical_base=4))
    table = hccl_table(ftrun_table("job", 1, (NODES[0], spare), own_node=0, own_devices={0: 0, 1: 1}))
    assert_hccl_v1(table, world_size=4)
    assert table["server_list"][1]["server_id"] == "10.0.0.9"
    assert [d["device_id"] for d in table["server_list"][1]["device"]] == ["4", "5"]


def test_hccl_table_needs_a_device_for_every_rank():
    cpu_node = NodeSlot(0, "a:1", "n0", 1, 0, "10.0.0.1", ())
    with pytest.raises(ValueError, match="rank 0 on n0 has no NPU"):
        hccl_table(ftrun_table("job", 0, (cpu_node,), own_node=0, own_devices={}))


def test_hccl_table_is_not_made_with_an_empty_device_ip():
    # torch_npu has no fallback from a rank table it cannot use: better none, and HCCL's store negotiation
    node = NodeSlot(0, "a:1", "n0", 2, 0, "10.0.0.1", devices("192.168.100.1", ""))
    with pytest.raises(ValueError, match="rank 1 on n0 has no device IP"):
        hccl_table(ftrun_table("job", 0, (node,), own_node=0, own_devices={0: 0, 1: 1}))


def superpod_devices(node: int, pod: int) -> tuple[RankTableDevice, ...]:
    return tuple(RankTableDevice(i, i, f"192.168.10{i}.{node}", super_device_id=100 * node + i, super_pod_id=pod)
                 for i in range(2))


def test_hccl_table_of_a_superpod_is_version_1_2_with_super_ids():
    nodes = (NodeSlot(0, "a:1", "n0", 2, 0, "10.0.0.1", superpod_devices(0, 7)),
             NodeSlot(1, "b:1", "n1", 2, 2, "10.0.0.2", superpod_devices(1, 7)))
    table = hccl_table(ftrun_table("job", 0, nodes, own_node=0, own_devices={0: 0, 1: 1}))
    assert table["version"] == "1.2"
    assert table["server_list"][1]["device"][0] == {
        "device_id": "0", "super_device_id": "100", "device_ip": "192.168.100.1", "rank_id": "2"}
    assert table["super_pod_list"] == [
        {"super_pod_id": "7", "server_list": [{"server_id": "10.0.0.1"}, {"server_id": "10.0.0.2"}]}]


def test_tables_are_written_atomically_and_owner_only(tmp_path):
    path = write_table(str(tmp_path), "ranktable.json", {"a": 1})
    write_table(str(tmp_path), "ranktable.json", {"a": 2})  # a new generation replaces it whole
    assert json.loads(open(path).read()) == {"a": 2}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["ranktable.json"]  # no temporary file left


def test_device_ips_file(tmp_path):
    path = tmp_path / "ips.yaml"
    path.write_text("n0:\n  0: 192.168.100.1\n  1: 192.168.101.1\n")
    assert load_device_ips(str(path)) == {"n0": {0: "192.168.100.1", 1: "192.168.101.1"}}
    path.write_text("n0: [192.168.100.1]\n")
    with pytest.raises(UsageError, match="host 'n0' must map device ids to IP addresses"):
        load_device_ips(str(path))
