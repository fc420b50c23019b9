"""A network partition: node 1 runs in a network namespace joined to this one by a veth pair, and the
test cuts the link. The controller declares node 1 lost, a spare takes its place and the job finishes;
when the link comes back, node 1's agent reads that it was replaced and leaves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import WORKERS, Node, free_port, wait_for
from tests.parts import unavailable

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")


def ip(*args: str, namespace: str = "") -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def netns():
    """A namespace with one veth link to this one: (namespace, host side, far side, host address, far address)."""
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    namespace, near, far = f"ftrun{tag}", f"vh{tag}", f"vn{tag}"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    try:
        try:
            ip("netns", "add", namespace)
            ip("link", "add", near, "type", "veth", "peer", "name", far)
            ip("link", "set", far, "netns", namespace)
            ip("addr", "add", f"{subnet}.1/24", "dev", near)
            ip("link", "set", near, "up")
            ip("addr", "add", f"{subnet}.2/24", "dev", far, namespace=namespace)
            ip("link", "set", far, "up", namespace=namespace)
            ip("link", "set", "lo", "up", namespace=namespace)
        except (OSError, subprocess.CalledProcessError) as e:
            why = getattr(e, "stderr", b"") or b""
            unavailable(f"network namespaces are not permitted here: {why.decode(errors='replace').strip() or e}")
        yield namespace, near, far, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", near], capture_output=True, timeout=30)


def test_partitioned_node_is_replaced_and_refused_when_it_comes_back(launcher, netns):
    namespace, near, far, near_address, far_address = netns
    endpoint = f"{near_address}:{free_port()}"
    common = ["--nnodes", "2", "--spares", "1", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
              "--run-id", launcher.mark, "--node-timeout", "3", "--max-restarts", "2", "--monitor-interval", "0.05"]
    here = launcher.env(STEPS="40", STEP_SLEEP="0.1", GLOO_SOCKET_IFNAME=near)
    # node 0 hosts the store; node 1 lives behind the link; the spare waits on this side
    first = launcher.start([*common, "--node-rank", "0", "--local-addr", near_address, "--rdzv-conf", "is_host=1",
                            TRAIN], env=here)
    log = launcher.tmp / "partitioned.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-m", "ftrun", *common, "--node-rank", "1",
             "--local-addr", far_address, "--rdzv-conf", "is_host=0", TRAIN],
            stdout=out, stderr=subprocess.STDOUT, env={**here, "GLOO_SOCKET_IFNAME": far}, cwd=launcher.tmp,
            start_new_session=True)
    partitioned = Node(proc, log)
    launcher.nodes.append(partitioned)
    spare = launcher.start([*common, "--local-addr", near_address, "--rdzv-conf", "is_host=0", TRAIN], env=here)
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    ip("link", "set", far, "down", namespace=namespace)  # the cut
    wait_for(lambda: "takes the place of node 1" in first.output, timeout=60, what="the takeover")
    ip("link", "set", far, "up", namespace=namespace)  # healed: node 1's agent hears what happened
    assert launcher.wait([first, spare]) == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1] and {r["step"] for r in results.values()} == {40}
    assert results[1]["env"]["FTRUN_GENERATION"] == "1"  # rank 1's result is the spare's, not the cut node's
    assert launcher.wait([partitioned]) == [1], partitioned.output
    assert ("this node was declared lost" in partitioned.output) or ("lost the controller" in partitioned.output)
