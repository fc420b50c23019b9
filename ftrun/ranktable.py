"""The rank tables each agent writes for its workers at every generation.

* ftrun's own (``FTRUN_RANKTABLE``), for any backend: every rank's node, host, local rank and device.
* On Ascend, the HCCL rank table (``RANK_TABLE_FILE``): one server per node, one device per rank,
  every value a string, ``status`` "completed". Version 1.0, or 1.2 on an A3 SuperPoD (every device
  with a super device id, and a ``super_pod_list``). None when a rank has no device IP: torch_npu does
  not fall back from a table it cannot use, while without one HCCL negotiates through the store.

Both come from the controller's layout (which agent holds which node, after any takeover). A node's
own ranks carry the devices its agent gave them; the other nodes' ranks carry the devices those
nodes offered at the rendezvous, in order: what they take at a fresh start. Files are written
atomically (a temporary file, fsync, rename), owner-only.
"""

from __future__ import annotations

import json
import os
import tempfile

from ftrun.messages import NodeSlot, RankTableDevice

FTRUN_TABLE = "ranktable.json"
HCCL_TABLE = "hccl_ranktable.json"


def ftrun_table(run_id: str, generation: int, nodes: tuple[NodeSlot, ...], own_node: int,
                own_devices: dict[int, int]) -> dict:
    """``nodes``: the layout (node ranks in order; after a scale-in some are missing and the workers'
    node_rank is the position). ``own_devices``: node ``own_node``'s local rank -> logical device."""
    ranks = []
    for group_rank, node in enumerate(sorted(nodes, key=lambda n: n.node_rank)):
        for local_rank in range(node.nproc):
            device = _device_of(node, local_rank, own_devices if node.node_rank == own_node else None)
            ranks.append({
                "rank": node.first_rank + local_rank, "node_rank": group_rank, "host": node.host,
                "host_ip": node.host_ip, "local_rank": local_rank,
                "device": device.index if device else None,
                "physical_device": device.physical if device and device.physical >= 0 else None,
                "device_ip": device.ip if device else "",
                "super_device_id": device.super_device_id if device and device.super_device_id >= 0 else None,
                "super_pod_id": device.super_pod_id if device and device.super_pod_id >= 0 else None,
            })
    return {"version": "1", "run_id": run_id, "generation": generation, "world_size": len(ranks),
            "node_count": len(nodes), "ranks": ranks}


def hccl_table(table: dict) -> dict:
    """The HCCL rank table for ftrun's own table: v1.2 when every rank's chip has SuperPoD ids, else v1.0.
    Raises ValueError when a rank has no physical device or no device IP."""
    ranks = table["ranks"]
    superpod = bool(ranks) and all(r["super_device_id"] is not None and r["super_pod_id"] is not None for r in ranks)
    servers: dict[int, dict] = {}
    pods: dict[int, list[str]] = {}
    for rank in ranks:
        if rank["physical_device"] is None:
            raise ValueError(f"rank {rank['rank']} on {rank['host']} has no NPU")
        if not rank["device_ip"]:
            raise ValueError(f"rank {rank['rank']} on {rank['host']} has no device IP (hccn_tool found neither on "
                             "PATH nor in the driver's tools folder, and no --device-ips entry)")
        server_id = rank["host_ip"] or rank["host"]
        server = servers.setdefault(rank["node_rank"], {"server_id": server_id, "host_ip": server_id, "device": []})
        device = {"device_id": str(rank["physical_device"])}
        if superpod:
            device["super_device_id"] = str(rank["super_device_id"])
            if server_id not in pods.setdefault(rank["super_pod_id"], []):
                pods[rank["super_pod_id"]].append(server_id)
        server["device"].append({**device, "device_ip": rank["device_ip"], "rank_id": str(rank["rank"])})
    hccl = {"version": "1.2" if superpod else "1.0", "server_count": str(len(servers)), "status": "completed",
            "server_list": [servers[node] for node in sorted(servers)]}
    if superpod:
        hccl["super_pod_list"] = [{"super_pod_id": str(pod), "server_list": [{"server_id": s} for s in pods[pod]]}
                                  for pod in sorted(pods)]
    return hccl


def load_device_ips(path: str) -> dict[str, dict[int, str]]:
    """``--device-ips FILE``: host -> {physical device id: RoCE address}, for nodes without hccn_tool."""
    from ftrun.config import _ConfigLoader, read_yaml_mapping
    from ftrun.errors import UsageError

    data = read_yaml_mapping(path, _ConfigLoader, "device IP file", "a mapping of host names to {device id: IP}")
    table: dict[str, dict[int, str]] = {}
    for host, devices in data.items():
        if not isinstance(devices, dict) or not all(isinstance(k, int) and k >= 0 and isinstance(v, str)
                                                    for k, v in devices.items()):
            raise UsageError(f"device IP file {path}: host '{host}' must map device ids to IP addresses "
                             "(0: 192.168.100.11)")
        table[str(host)] = dict(devices)
    return table


def _device_of(node: NodeSlot, local_rank: int, assigned: dict[int, int] | None) -> RankTableDevice | None:
    by_index = {d.index: d for d in node.devices}
    if assigned is not None:
        index = assigned.get(local_rank)
        return by_index.get(index, RankTableDevice(index)) if index is not None else None
    return node.devices[local_rank] if local_rank < len(node.devices) else None


def write_table(folder: str, name: str, table: dict) -> str:
    """Write ``table`` as ``folder/name`` atomically, readable by its owner only; returns the path."""
    path = os.path.join(folder, name)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{name}.", dir=folder)
    try:
        with os.fdopen(descriptor, "w") as f:
            json.dump(table, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return path
