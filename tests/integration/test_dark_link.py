"""A data link that goes dark, on the cluster-shaped test bed (``tests/cluster.py``): 2 nodes x 2 ranks, each
node a namespace with a management and a data link, the collectives on the data one. Node 1's data port
goes dark mid-training (no reset: packets vanish), stays dark past the online window with no spare, and
comes back: the job says so, waits, and is repaired online the moment the link is back, with no process
started, and ends bit-identical to a fault-free run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.cluster import ClusterBed
from tests.conftest import (
    ELASTIC_NODES,
    ELASTIC_NPROC,
    ELASTIC_STEPS,
    WORKERS,
    Node,
    free_port,
    ftrun_status,
    step_reached,
    wait_for,
)

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
#: how long the test keeps node 1's data link dark: past the online window (2 s), well under --repair-timeout
DARK_FOR = 4.0


@pytest.fixture
def bed():
    with ClusterBed(ELASTIC_NODES) as made:
        yield made


def start_node(launcher, bed: ClusterBed, index: int, common: list[str], env: dict, node_rank: bool = True) -> Node:
    """Node ``index`` of the bed's agent (its node rank the same, unless a spare: ``node_rank`` False)."""
    node = bed.nodes[index]
    log = launcher.tmp / f"node{index}.log"
    rank = ["--node-rank", str(index)] if node_rank else []
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            node.command([sys.executable, "-m", "ftrun", *common, *rank, "--local-addr", node.mgmt,
                          "--rdzv-conf", f"is_host={int(index == 0)}", ELASTIC]),
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=launcher.tmp, start_new_session=True)
    started = Node(proc, log)
    launcher.nodes.append(started)
    return started


def test_a_dark_data_link_is_said_waited_for_and_repaired_online_when_it_is_back(launcher, bed, fault_free):
    endpoint = f"{bed.nodes[0].mgmt}:{free_port()}"
    common = ["--nnodes", str(ELASTIC_NODES), "--nproc-per-node", str(ELASTIC_NPROC), "--rdzv-endpoint", endpoint,
              "--run-id", launcher.mark, "--recovery", "process", "--max-restarts", "2", "--monitor-interval", "0.05",
              "--warm-standby", "0"]
    env = launcher.env(STEPS=str(ELASTIC_STEPS), STEP_SLEEP="0.1", GLOO_SOCKET_IFNAME="data")
    first = start_node(launcher, bed, 0, common, env)
    start_node(launcher, bed, 1, common, env)
    # ftrun status --json --watch, as an operator's terminal would show it all along (from this namespace,
    # which is on the management switch)
    wait_for(lambda: "joined the store" in first.output, timeout=120, what="the store")
    watcher = ftrun_status(endpoint, "--run-id", launcher.mark, "--json", "--watch", "--interval", "0.5",
                           into=launcher.tmp / "status", env=env)
    shown = launcher.tmp / "status.out"
    wait_for(lambda: step_reached(launcher.out_dir, 3) >= 10 and shown.stat().st_size > 0, timeout=180,
             what="rank 3 at step 10, and ftrun status showing the job")
    started = len(list(launcher.out_dir.glob("pid-start-rank*")))

    bed.dark(1)
    assert bed.interface_state(1) == ("down", "0")
    dark_at = time.monotonic()
    wait_for(lambda: "node 1: data link data dark (operstate down, no carrier)" in first.output, timeout=30,
             what="the controller to say the dark link")
    said_after = time.monotonic() - dark_at
    wait_for(lambda: "no spare node to move node 1's ranks to: waiting for its data link" in first.output, timeout=30,
             what="the controller to say that it waits")
    time.sleep(max(0.0, DARK_FOR - (time.monotonic() - dark_at)))
    stood = step_reached(launcher.out_dir, 0)

    bed.light(1)
    assert launcher.wait() == [0, 0], launcher.output()
    watcher.wait(timeout=60)
    output = launcher.output()
    lines = [json.loads(line) for line in shown.read_text().splitlines() if line.strip()]
    status = next((s for s in lines if s.get("stall") and s["stall"].get("dark")), {})
    # seen from the OS's link state within about a second (the goal is 5 s; the machine is shared and slow)
    assert said_after < 10, f"the dark link was said {said_after:.1f}s after it went dark"
    assert status.get("stall") and status["stall"]["dark"] == {"1": "data link data dark (operstate down, no carrier)"}
    assert [n["state"] for n in status["nodes"] if n["role"] == "active"] == ["running", "link dark"]
    assert stood <= 12  # the collectives stood still while it was dark
    assert re.search(r"online repair into generation 1: node 1: data link data back up \(operstate up, carrier\) "
                     r"after [0-9.]+s dark; no process is replaced", output), output
    assert re.search(r"generation 1 resumed training [0-9.]+s after the fault .*, repaired online", output)
    assert "process-level repair" not in output and "falls back to job level" not in output
    assert "training stands still" not in output  # the link's word came first, and the job's first step is no stall
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {ELASTIC_STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free  # bit-identical
    assert len(list(launcher.out_dir.glob("pid-start-rank*"))) == started == 4  # no process started


def test_a_flapping_data_link_is_repaired_online_then_its_node_moves_to_the_spare(launcher, fault_free):
    # 2 nodes x 2 ranks and a spare (node index 2 on the bed). Node 1's data link goes dark three times, each
    # for a moment: the first two are repaired online, no process started; at the third (FLAPS) its ranks move
    # to the spare at process level while node 0's ranks keep their processes, and node 1's agent leaves
    bed = ClusterBed(ELASTIC_NODES + 1).open()
    try:
        run_flapping(launcher, bed, fault_free)
    finally:
        bed.close()


def run_flapping(launcher, bed: ClusterBed, fault_free: dict) -> None:
    endpoint = f"{bed.nodes[0].mgmt}:{free_port()}"
    common = ["--nnodes", str(ELASTIC_NODES), "--nproc-per-node", str(ELASTIC_NPROC), "--rdzv-endpoint", endpoint,
              "--run-id", launcher.mark, "--recovery", "process", "--max-restarts", "4", "--monitor-interval", "0.05",
              "--warm-standby", "0", "--spares", "1", "--online-window", "8"]
    env = launcher.env(STEPS=str(ELASTIC_STEPS), STEP_SLEEP="0.3", GLOO_SOCKET_IFNAME="data")
    first = start_node(launcher, bed, 0, common, env)
    flapping = start_node(launcher, bed, 1, common, env)
    spare = start_node(launcher, bed, 2, common, env, node_rank=False)
    wait_for(lambda: step_reached(launcher.out_dir, 3) >= 5, timeout=180, what="rank 3 at step 5")
    node0_pids = {p.name for p in launcher.out_dir.glob("pid-start-rank[01]-*")}
    for flap in range(1, 4):
        bed.dark(1)
        wait_for(lambda: first.output.count("node 1: data link data dark") >= flap, timeout=30,
                 what=f"dark link {flap} said")
        time.sleep(1.0)
        bed.light(1)
        if flap < 3:
            wait_for(lambda: re.search(rf"generation {flap} resumed training .*repaired online", first.output),
                     timeout=60, what=f"online repair {flap}")
    wait_for(lambda: "takes the place of node 1" in first.output, timeout=60, what="the spare to take node 1")
    assert launcher.wait([first, spare]) == [0, 0], launcher.output()
    assert launcher.wait([flapping]) == [1], flapping.output
    output = first.output
    assert output.count("no process is replaced") == 2, output
    assert re.search(r"node 1: data link data dark \(operstate down, no carrier\), 3 times in 300s "
                     r"\(a flapping link\)", output), output
    assert re.search(r"generation 3 resumed training [0-9.]+s after the fault", output), output
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {ELASTIC_STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free  # bit-identical
    # node 0's ranks kept their processes through all three; node 1's two moved to the spare
    assert {p.name for p in launcher.out_dir.glob("pid-start-rank[01]-*")} == node0_pids
    assert len(list(launcher.out_dir.glob("pid-start-rank[23]-*"))) == 4
    assert "this node was declared lost" in flapping.output
