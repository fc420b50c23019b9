"""The rank tables on (stand-in) Ascend nodes: 2 nodes x 2 ranks + 1 spare, device IPs from --device-ips.

Every agent says it is on its own loopback address, so the tables tell the nodes apart.
"""

from __future__ import annotations

import pytest

from tests.conftest import WORKERS, free_port, wait_for
from tests.integration.test_detection import NpuState, npu_env
from tests.unit.test_ranktable import assert_hccl_v1

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]  # node 0, node 1, the spare


def test_hccl_rank_table_names_the_spare_after_it_replaced_a_node(launcher, tmp_path):
    state = NpuState(tmp_path / "npu-smi.json", devices=2)
    ips = tmp_path / "device-ips.yaml"
    ips.write_text("".join(f"{h}:\n  0: 192.168.100.{h[-1]}\n  1: 192.168.101.{h[-1]}\n" for h in HOSTS))
    env = npu_env(launcher, state, STEPS="24", STEP_SLEEP="0.1")
    common = ["--nnodes", "2", "--spares", "1", "--nproc-per-node", "2", "--device", "npu", "--device-ips", str(ips),
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-id", launcher.mark, "--node-timeout", "3",
              "--max-restarts", "2", "--monitor-interval", "0.05"]
    nodes = [launcher.start([*common, "--local-addr", host, TRAIN], env=env) for host in HOSTS]
    victim = wait_for(lambda: [n for n in nodes if "node 1 of 2," in n.output], timeout=120, what="node 1")[0]
    first = next(n for n in nodes if "node 0 of 2," in n.output)
    spare = wait_for(lambda: [n for n in nodes if "standing by as a spare" in n.output], timeout=60, what="the spare")[0]
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    victim.proc.kill()
    assert launcher.wait([first, spare]) == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3]
    expected = [host_of(first), host_of(spare)]  # node 1 is the spare's now, with the spare's device IPs
    for result in results.values():
        table = result["hccl_ranktable"]
        assert_hccl_v1(table, world_size=4)
        assert [s["server_id"] for s in table["server_list"]] == expected
        for node, server in enumerate(table["server_list"]):
            last = expected[node].rsplit(".", 1)[1]
            assert [(d["device_id"], d["device_ip"], d["rank_id"]) for d in server["device"]] == [
                ("0", f"192.168.100.{last}", str(2 * node)), ("1", f"192.168.101.{last}", str(2 * node + 1))]
        assert result["ranktable"]["generation"] == 1


def host_of(node) -> str:
    return node.proc.args[node.proc.args.index("--local-addr") + 1]
