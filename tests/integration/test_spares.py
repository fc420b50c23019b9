"""Spare nodes: 3 simulated nodes + 1 spare on loopback (CPU, gloo, 1 rank per node).

A lost node (its agent SIGKILLed, or frozen past --node-timeout) is fenced and a spare takes its
node rank; the job ends at its final step with the parameters of a run without the fault.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.conftest import WORKERS, Launcher, free_port, step_reached, unique_mark, wait_for
from tests.integration.test_detection import NpuState, npu_env
from tests.unit.test_ranktable import assert_hccl_v1

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")
ELASTIC = str(WORKERS / "elastic_train.py")
STEPS = 24
NODES = 3


def start(launcher, script: str, spares: int = 1, flags=(), environment=None, **env) -> None:
    """Agent i says it is on host 127.0.0.<i+2>: every address is this machine, and the rank tables show who is who."""
    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", str(NODES), "--spares", str(spares), "--nproc-per-node", "1", "--rdzv-endpoint",
              endpoint, "--run-id", launcher.mark, "--monitor-interval", "0.05", "--node-timeout", "3", *flags]
    environment = environment or launcher.env(**{"STEPS": str(STEPS), "STEP_SLEEP": "0.1", **env})
    for i in range(NODES + spares):
        launcher.start([*common, "--local-addr", f"127.0.0.{i + 2}", script], env=environment)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    runner = Launcher(tmp_path_factory.mktemp("spares-fault-free"), unique_mark("spares-fault-free"))
    start(runner, TRAIN, spares=1, STEP_SLEEP="0")
    # the spare stays idle: it leaves with the job's status (the store's host waits for it to read the exit)
    assert runner.wait() == [0] * (NODES + 1), runner.output()
    return {r["checksum"] for r in runner.results().values()}


def node_agent(launcher, node_rank: int):
    """The launcher's agent that got ``node_rank`` at the rendezvous."""
    found = wait_for(lambda: [n for n in launcher.nodes if f"node {node_rank} of {NODES}," in n.output], timeout=120,
                     what=f"node {node_rank} to be assigned")
    return found[0]


def host_of(launcher, node) -> str:
    """The --local-addr the test gave this agent."""
    args = node.proc.args
    return args[args.index("--local-addr") + 1]


def wait_for_step(launcher, step: int) -> None:
    checkpoint = launcher.out_dir / "ckpt.pt"
    wait_for(lambda: checkpoint.exists() and time.sleep(0.2) is None and _step(checkpoint) >= step, timeout=120,
             what=f"training to pass step {step}")


def _step(checkpoint) -> int:
    import torch

    try:
        return torch.load(checkpoint)["step"]
    except Exception:  # being replaced at this instant
        return 0


def test_spare_takes_the_place_of_a_killed_agent(launcher, fault_free, tmp_path):
    # (stand-in) Ascend nodes, so that the HCCL rank table is written too; device IPs from --device-ips
    state = NpuState(tmp_path / "npu-smi.json", devices=1)
    ips = tmp_path / "device-ips.yaml"
    ips.write_text("".join(f"127.0.0.{i + 2}:\n  0: 192.168.100.{i + 2}\n" for i in range(NODES + 1)))
    start(launcher, TRAIN, flags=["--max-restarts", "2", "--device", "npu", "--device-ips", str(ips)],
          # slow until the loss, so that the job cannot finish before the kill however late the spare stands by
          environment=npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="1", SLOW_GENERATIONS="0"))
    victim = node_agent(launcher, 1)
    spare = wait_for(lambda: [n for n in launcher.nodes if "standing by as a spare node" in n.output], timeout=60,
                     what="the spare to stand by")[0]
    wait_for_step(launcher, 3)
    victim.proc.kill()
    others = [n for n in launcher.nodes if n is not victim]
    assert launcher.wait(others) == [0, 0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2] and {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == fault_free
    assert "taking the place of node 1" in spare.output
    assert "now holds ranks" not in spare.output  # it held none before: nothing was renumbered
    assert results[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    # the rank table of the new generation names the spare's host for node 1, on every node
    spare_host = host_of(launcher, spare)
    hosts = [host_of(launcher, node_agent(launcher, 0)), spare_host, host_of(launcher, node_agent(launcher, 2))]
    for result in results.values():
        table = result["ranktable"]
        assert table["generation"] == 1 and table["world_size"] == 3
        assert [(r["rank"], r["node_rank"]) for r in table["ranks"]] == [(0, 0), (1, 1), (2, 2)]
        assert table["ranks"][1]["host"] == spare_host != host_of(launcher, victim)
        hccl = result["hccl_ranktable"]
        assert_hccl_v1(hccl, world_size=3)
        assert [server["server_id"] for server in hccl["server_list"]] == hosts
        spare_ip = f"192.168.100.{spare_host.rsplit('.', 1)[1]}"
        assert hccl["server_list"][1]["device"] == [{"device_id": "0", "device_ip": spare_ip, "rank_id": "1"}]
    controller = node_agent(launcher, 0).output
    assert "takes the place of node 1" in controller
    assert "job succeeded" in controller and "nodes replaced by a spare (1)" in controller


def test_frozen_node_that_comes_back_after_being_fenced_is_refused(launcher, fault_free):
    start(launcher, TRAIN, flags=["--max-restarts", "2"])
    victim = node_agent(launcher, 1)
    wait_for_step(launcher, 3)
    frozen = [psutil.Process(victim.proc.pid), *psutil.Process(victim.proc.pid).children(recursive=True)]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    controller = node_agent(launcher, 0)
    wait_for(lambda: "takes the place of node 1" in controller.output, timeout=60, what="the takeover")
    wait_for_step(launcher, 8)  # the new generation trains without the frozen node
    for proc in frozen:
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass
    # it learns it was fenced and leaves, stopping its workers; nothing it says counts any more
    assert launcher.wait([victim]) == [1], victim.output
    assert "this node was declared lost and node 1 given to a spare" in victim.output
    others = [n for n in launcher.nodes if n is not victim]
    assert launcher.wait(others) == [0, 0, 0], launcher.output()
    results = launcher.results()
    assert {r["checksum"] for r in results.values()} == fault_free
    assert results[1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"  # written by the spare's rank, not the fenced one


def test_losing_the_node_that_hosts_the_store_ends_the_job_everywhere(launcher):
    start(launcher, TRAIN, spares=0, STEP_SLEEP="0.2", STEPS="1000")
    host = node_agent(launcher, 0)
    wait_for_step(launcher, 2)
    host.proc.kill()
    others = [n for n in launcher.nodes if n is not host]
    started = time.monotonic()
    codes = launcher.wait(others, timeout=60)  # --node-timeout 3: each notices within seconds
    assert codes == [1, 1], launcher.output()
    for node in others:
        assert "lost the controller" in node.output
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def elastic_fault_free(tmp_path_factory):
    runner = Launcher(tmp_path_factory.mktemp("spares-elastic-fault-free"), unique_mark("spares-elastic-fault-free"))
    # the 3 ranks on one agent, forked from its warm interpreter, no step sleep: the reference checksum depends
    # on neither, and the run starts faster
    runner.start_job(1, NODES, [ELASTIC], flags=["--recovery", "process"],
                     env=runner.env(STEPS=str(STEPS), STEP_SLEEP="0"))
    assert runner.wait() == [0], runner.output()
    return {r["checksum"] for r in runner.results().values()}


def test_spare_takes_a_lost_nodes_ranks_while_the_others_live_on(launcher, elastic_fault_free):
    start(launcher, ELASTIC, flags=["--recovery", "process", "--max-restarts", "2"])
    victim = node_agent(launcher, 1)
    wait_for(lambda: step_reached(launcher.out_dir, 1) >= 3,
             timeout=120, what="rank 1 to make progress")
    victim.proc.kill()  # the agent, and with it (its guardian) rank 1
    others = [n for n in launcher.nodes if n is not victim]
    assert launcher.wait(others) == [0, 0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2] and {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == elastic_fault_free
    starts = {rank: len(list(launcher.out_dir.glob(f"pid-start-rank{rank}-*"))) for rank in results}
    assert starts == {0: 1, 1: 2, 2: 1}  # only the lost node's rank started again, on the spare
    assert results[1]["replacement"] == "1" and results[0]["replacement"] == "0"
    controller = node_agent(launcher, 0).output
    assert "process-level repair into generation 1" in controller and "1 of 2 restarts used" in controller


def results_of_last_generation(launcher) -> dict[int, dict]:
    return {rank: r for rank, r in launcher.results().items() if r["env"]["FTRUN_GENERATION"] == max(
        x["env"]["FTRUN_GENERATION"] for x in launcher.results().values())}


def test_two_nodes_lost_with_one_spare_scale_in_and_finish(launcher):
    start(launcher, TRAIN, flags=["--max-restarts", "3", "--nnodes", "2:3"])  # the last --nnodes wins
    first, second = node_agent(launcher, 1), node_agent(launcher, 2)
    wait_for_step(launcher, 3)
    first.proc.kill()
    controller = node_agent(launcher, 0)
    wait_for(lambda: "takes the place of node 1" in controller.output, timeout=60, what="the spare to take over")
    second.proc.kill()  # no spare left: 2 nodes are enough for --nnodes 2:3
    others = [n for n in launcher.nodes if n not in (first, second)]
    assert launcher.wait(others) == [0, 0], launcher.output()
    final = results_of_last_generation(launcher)
    assert sorted(final) == [0, 1] and {r["world"] for r in final.values()} == {2}
    assert {r["env"]["FTRUN_PREVIOUS_WORLD_SIZE"] for r in final.values()} == {"3"}  # what on_resize reads
    assert {r["step"] for r in final.values()} == {STEPS}
    assert "going on with 2 nodes" in controller.output
    assert "nodes replaced by a spare (1)" in controller.output and "job succeeded" in controller.output


def test_scaled_in_job_grows_back_when_a_node_joins(launcher):
    # generations 0 and 1 step slowly, so that the job lasts until the late node has joined; generation 2,
    # grown back, may finish quickly (SLOW_GENERATIONS)
    start(launcher, TRAIN, spares=0, flags=["--max-restarts", "3", "--nnodes", "2:3"], STEPS="100",
          SLOW_GENERATIONS="0,1")
    lost = node_agent(launcher, 2)
    wait_for_step(launcher, 3)
    lost.proc.kill()
    controller = node_agent(launcher, 0)
    wait_for(lambda: "going on with 2 nodes" in controller.output, timeout=60, what="the scale-in")
    wait_for(lambda: "generation 1 starting" in controller.output, timeout=60, what="the smaller job to start")
    args = list(lost.proc.args[3:])  # the same flags, as a node restarted by its operator would give
    late = launcher.start(args, env=launcher.env(STEPS="100", STEP_SLEEP="0.1", SLOW_GENERATIONS="0,1"))
    others = [n for n in launcher.nodes if n is not lost]
    assert launcher.wait(others) == [0, 0, 0], launcher.output()
    final = results_of_last_generation(launcher)
    assert sorted(final) == [0, 1, 2] and {r["world"] for r in final.values()} == {3}
    assert "joins the job as node 2" in controller.output or "takes the place of node 2" in controller.output
    assert "going on with 3 nodes" in controller.output
    assert "taking the place of node 2" in late.output
    assert "1 of 3 restarts used" in controller.output  # the loss (and scale-in) spent one, growing back none
    assert "generation 2 starting with 3 nodes" in controller.output
