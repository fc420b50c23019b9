"""What does ftrun's control plane cost at 1,000 nodes and 16,000 ranks? Measured by simulation.

The real controller (``ftrun.controller.Controller``) and a real TCPStore run in this process; N
simulated agents run as threads in --agent-processes other processes, each speaking the agents' real
protocol through ``ftrun.agent.protocol.NodeProtocol`` (the object the real Agent sends and reads every
message with): the rendezvous, keepalives with the node's status, its ranks' heartbeat reads (the hang
check), reports, and commands, with the same monitor interval. Workers are only their heartbeats: a
thread per process writes each running rank's heartbeat counter and step once a second, as the worker
library does (one ``multi_set`` per node instead of two writes per rank: the store does the same work).
One more agent stands by as a spare.

Per N, in order:
  rendezvous       from the go signal until every agent holds its place
  fail fan-out     from one rank's failure report until every agent holds the controller's STOP
  restart          from that report until every agent holds the next generation's START
  lost-node fan-out from the controller's finding a node lost (no keepalive for --node-timeout) until
                   every agent (the spare included) holds its decision
  ctl CPU          the controller thread's CPU seconds per wall second over --steady seconds of running
  store CPU        the store server's (this process less the controller thread) over the same
  store ops/s      requests every client sent over the same (a multi_get is one)
  board            bytes of the status snapshot (``ftrun status``'s JSON)
  rank table       one agent's time to build and write its generation's rank table
  restore plan     bytes of the RestorePlan of a sharded job (each rank's snapshot and one replica
                   on the next node) and the time to choose it

    .venv/bin/python scripts/bench_control_plane.py --nodes 8,64,256,1024 --ranks-per-node 16 --json cp.json
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftrun.agent.protocol import NodeProtocol  # noqa: E402
from ftrun.config import Endpoint  # noqa: E402
from ftrun.controller.controller import Controller, RecoveryPolicy  # noqa: E402
from ftrun.controller.policy import Level  # noqa: E402
from ftrun.keys import JobKeys  # noqa: E402
from ftrun.messages import CommandKind, JoinRecord, Layout, NodeStatus, RankState, ReportKind, WorkerFailure  # noqa: E402
from ftrun.ranktable import FTRUN_TABLE, ftrun_table, write_table  # noqa: E402
from ftrun.rendezvous import RendezvousPolicy  # noqa: E402
from ftrun.snapshots.plan import MEMORY, REPLICA, HeldSnapshot, SnapshotInventory, choose_restore  # noqa: E402
from ftrun.store import ControlStore, connect_store, host_store  # noqa: E402

RUN_ID = "bench"
#: the agents' defaults (ftrun/agent/agent.py HEARTBEAT_INTERVAL, --monitor-interval), the library's heartbeat
KEEPALIVE, MONITOR_INTERVAL, RANK_BEAT = 0.5, 0.1, 1.0
READY, GO, FAIL, LOSE, END = "bench/ready", "bench/go", "bench/fail", "bench/lose", "bench/end"


class Count:
    """A request counter that many threads bump (a lost bump under a race is noise at these rates)."""

    def __init__(self):
        self.value = 0

    def bump(self) -> None:
        self.value += 1


class CountingStore:
    """A TCPStore client that counts its requests (a multi_get or multi_set is one)."""

    def __init__(self, raw, counter):
        self._raw, self._counter = raw, counter

    def __getattr__(self, name):
        method = getattr(self._raw, name)
        if not callable(method):
            return method

        def counted(*args, **kwargs):
            self._counter.bump()
            return method(*args, **kwargs)

        return counted


# -- the agents' side (in --agent-processes processes) -----------------------------------------

class SimAgent:
    """One node's agent with workers that are only heartbeats: the real NodeProtocol, driven the way
    Agent._supervise drives it."""

    def __init__(self, index: int, port: int, nproc: int, ops, shared: dict):
        self.index, self.nproc, self.shared = index, nproc, shared
        raw = connect_store(Endpoint("127.0.0.1", port), 60)
        store = ControlStore(CountingStore(raw, ops), Endpoint("127.0.0.1", port), is_host=False)
        self.agent_id = f"sim-{index}"
        self.protocol = NodeProtocol(store, JobKeys(RUN_ID), self.agent_id, node_timeout=30.0)
        self.store = store
        self.joined_at = 0.0
        self.ranks: list[int] = []
        self.running = False
        self.generation = 0
        self.failed_at = 0.0
        self.node = -1
        #: (sequence number, kind, generation, time received) of every command
        self.received: list[tuple[int, str, int, float]] = []

    def run(self) -> None:
        self.store.wait_for(GO, 600)
        record = JoinRecord(self.agent_id, "127.0.0.1", os.getpid(), self.nproc, requested_node_rank=-1)
        result, slot = self.protocol.join(record, 300, threading.Event())
        self.joined_at = time.time()
        self._take(slot.first_rank)
        #: the node rank the rendezvous gave (-1: the spare); the failing and the lost node are named by
        #: it, since which agent ends up the spare depends on the order they joined in
        self.node = slot.node_rank
        next_beat = 0.0
        while not self.shared["end"].is_set():
            now = time.monotonic()
            if now >= next_beat:
                ranks = tuple(RankState(r, r - self.ranks[0], 0, self.running) for r in self.ranks)
                self.protocol.keepalive(NodeStatus(self.agent_id, "127.0.0.1", self.generation, ranks))
                self.protocol.check_controller(now)
                if self.running:
                    self.protocol.rank_beats(self.ranks)  # the hang check's read
                next_beat = now + KEEPALIVE
            if self.shared["fail"] == self.node >= 0 and not self.failed_at and self.running:
                self._fail()
            if self.shared["lose"] == self.node >= 0:
                return  # the node is gone: no keepalive, no goodbye
            seq = self.protocol.next_command
            for offset, command in enumerate(self.protocol.commands()):
                self.received.append((seq + offset, command.kind.value, command.generation, time.time()))
                if command.kind is CommandKind.EXIT:
                    self.protocol.report(ReportKind.EXITED, command.generation)
                    return
                if command.kind is CommandKind.STOP:
                    self.running = False
                    self.protocol.report(ReportKind.STOPPED, command.generation)
                elif command.kind is CommandKind.START:
                    self.generation, self.running = command.generation, True
                elif command.kind is CommandKind.TAKEOVER and command.agent_id == self.agent_id:
                    self.protocol.node_rank = command.node_rank
                    layout = self.store.try_get(Layout, JobKeys(RUN_ID).layout)
                    mine = next(n for n in layout.nodes if n.node_rank == command.node_rank)
                    self._take(mine.first_rank)
                elif command.kind is CommandKind.TAKEOVER and command.node_rank == self.protocol.node_rank:
                    return
            time.sleep(MONITOR_INTERVAL)

    def _take(self, first_rank: int) -> None:
        self.ranks = list(range(first_rank, first_rank + self.nproc)) if first_rank >= 0 else []

    def _fail(self) -> None:
        rank = self.ranks[0]
        failure = WorkerFailure(rank, 0, self.protocol.node_rank, "127.0.0.1", 0, None, signal="SIGKILL",
                                timestamp=time.time(), generation=self.generation, cause="signal")
        self.running = False
        self.failed_at = time.time()
        self.protocol.report(ReportKind.WORKER_FAILED, self.generation, failures=(failure,))


def beat_ranks(port: int, agents: list[SimAgent], ops, end: threading.Event) -> None:
    """The workers: each running rank's heartbeat and step, once a second."""
    store = CountingStore(connect_store(Endpoint("127.0.0.1", port), 60), ops)
    keys = JobKeys(RUN_ID)
    beat = 0
    while not end.wait(RANK_BEAT):
        beat += 1
        for agent in agents:
            if agent.running and agent.ranks:
                names = [keys.rank_heartbeat(r) for r in agent.ranks] + [keys.rank_progress(r) for r in agent.ranks]
                store.multi_set(names, [str(beat)] * len(names))


def run_agents(port: int, indices: list[int], nproc: int, results, ops_value) -> None:
    """A process of simulated agents: one thread each, a worker-heartbeat thread, a director thread."""
    logging.basicConfig(level=logging.ERROR)
    ops = Count()
    shared = {"fail": -1, "lose": -1, "end": threading.Event()}
    agents = [SimAgent(i, port, nproc, ops, shared) for i in indices]
    threads = [threading.Thread(target=a.run, name=f"sim-agent-{a.index}", daemon=True) for a in agents]
    for thread in threads:
        thread.start()
    beats = threading.Thread(target=beat_ranks, args=(port, agents, ops, shared["end"]), name="sim-workers", daemon=True)
    beats.start()
    director = CountingStore(connect_store(Endpoint("127.0.0.1", port), 60), Count())
    director.add(READY, 1)  # every agent of this process is connected
    while True:
        for key, name in ((FAIL, "fail"), (LOSE, "lose")):
            if director.check([key]):
                shared[name] = int(director.get(key))
        ops_value.value = ops.value
        if director.check([END]):
            break
        time.sleep(0.05)
    shared["end"].set()
    for thread in threads:
        thread.join(5)
    results.put([{"node": a.node, "joined_at": a.joined_at, "failed_at": a.failed_at, "received": a.received}
                 for a in agents])


# -- the controller's side, and the measurements -------------------------------------------------

def simulate(nodes: int, nproc: int, agent_processes: int = 2, steady: float = 5.0, node_timeout: float = 10.0) -> dict:
    """One run at ``nodes`` x ``nproc`` (and one spare); the figures, and the counts the smoke test checks."""
    logging.getLogger("ftrun").setLevel(logging.ERROR)
    server = host_store(Endpoint("127.0.0.1", 0), several_nodes=False)
    port = server.port
    ctl_ops = Count()
    store = ControlStore(CountingStore(server, ctl_ops), Endpoint("127.0.0.1", port), is_host=True)
    keys = JobKeys(RUN_ID)
    controller = Controller(store, keys, RendezvousPolicy(nodes, nodes, 0.0, 300.0, spares=1), "sim-0", "127.0.0.1",
                            RecoveryPolicy(max_restarts=10, recovery=Level.JOB, node_timeout=node_timeout,
                                           stop_timeout=10.0, repair_timeout=60.0))
    lost_at: list[float] = []
    lose_node = controller.lose_node

    def timed_lose_node(node: int, detail: str) -> None:
        lost_at.append(time.time())
        lose_node(node, detail)

    controller.lose_node = timed_lose_node  # type: ignore[method-assign]
    controller.start()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    total = nodes + 1  # and one spare
    shares = [list(range(total))[p::max(1, agent_processes)] for p in range(max(1, agent_processes))]
    op_counts = [context.Value("q", 0, lock=False) for _ in shares]
    processes = [context.Process(target=run_agents, args=(port, share, nproc, results, count), daemon=True)
                 for share, count in zip(shares, op_counts)]
    for process in processes:
        process.start()
    figures: dict = {"nodes": nodes, "ranks": nodes * nproc, "agents": total, "agent_processes": len(processes)}
    try:
        wait_until(lambda: store.counter(READY) >= len(processes), 120, "every agent connected")
        go = time.time()
        store.set_text(GO, "1")
        wait_until(lambda: controller.view is not None and _received(store, keys) >= 1, 300, "the rendezvous")
        wait_until(lambda: _all_running(controller, nodes), 120, "every node's first keepalive")

        # steady state: the controller's CPU and every client's requests over `steady` seconds
        time.sleep(max(2.0, 2 * KEEPALIVE + RANK_BEAT))
        me = psutil.Process()
        ctl_thread = controller._thread.native_id
        cpu0, thread0, ops0, wall0 = _cpu(me), _thread_cpu(me, ctl_thread), _ops(ctl_ops, op_counts), time.monotonic()
        time.sleep(steady)
        wall = time.monotonic() - wall0
        ctl_cpu = _thread_cpu(me, ctl_thread) - thread0
        figures["ctl_cpu"] = round(ctl_cpu / wall, 4)
        figures["store_cpu"] = round((_cpu(me) - cpu0 - ctl_cpu) / wall, 4)
        figures["store_ops_s"] = round((_ops(ctl_ops, op_counts) - ops0) / wall)
        figures["board_bytes"] = len(store.try_text(keys.status))
        figures["steady_step"] = controller.status.get("step")

        # one rank fails: its report until every agent holds the STOP, and the next START
        seq = store.counter(keys.command_count)
        store.set_text(FAIL, str(total // 2))
        wait_until(lambda: controller.view.generation >= 1 and controller.view.phase.value == "running", 60,
                   "the job-level restart")
        time.sleep(3 * MONITOR_INTERVAL)
        # a node is lost (its agent goes silent); the spare takes its place
        lose_seq = store.counter(keys.command_count)
        store.set_text(LOSE, str(total // 3))
        wait_until(lambda: lost_at and controller.view.phase.value == "running" and controller.view.generation >= 2,
                   60 + node_timeout, "the spare's takeover")
        time.sleep(3 * MONITOR_INTERVAL + KEEPALIVE)
    finally:
        controller.stop_job(0, "benchmark over")  # every agent reads the EXIT and leaves
        controller.join(15)
        store.set_text(END, "1")
        received = []
        for _ in processes:
            received += results.get(timeout=60)
        for process in processes:
            process.join(10)
    decisions = [e["t"] for e in controller.events.last(("decision",), 10)]
    figures["rendezvous_s"] = round(max(r["joined_at"] for r in received) - go, 3)
    figures.update(_fan_out(received, seq, lose_seq, decisions, total // 2, total // 3))
    figures.update(_rank_table(controller, nodes))
    figures.update(_restore_plan(nodes, nproc))
    figures["events"] = [e["kind"] for e in controller.events.last(("decision", "node_lost", "takeover",
                                                                     "generation_started"), 100)]
    return figures


def _fan_out(received: list[dict], seq: int, lose_seq: int, decisions: list[float], failing: int, lost: int) -> dict:
    """From the failure report, and from each decision (the controller's event), until the last agent
    holds the command."""
    failed_at = next(r["failed_at"] for r in received if r["node"] == failing)
    stop_times, start_times, loss_times = [], [], []
    for agent in received:
        mine = agent["received"]
        stop = [t for s, kind, g, t in mine if s >= seq and kind == "stop"]
        start = [t for s, kind, g, t in mine if s >= seq and kind == "start" and g >= 1]
        after_loss = [t for s, kind, g, t in mine if s >= lose_seq]
        if agent["node"] != lost:
            stop_times.append(min(stop) if stop else float("inf"))
            start_times.append(min(start) if start else float("inf"))
            loss_times.append(min(after_loss) if after_loss else float("inf"))
    return {"joined": sum(1 for r in received if r["joined_at"]),
            "fail_fanout_ms": round((max(stop_times) - failed_at) * 1000, 1),
            "decision_fanout_ms": round((max(stop_times) - decisions[0]) * 1000, 1),
            "restart_ms": round((max(start_times) - failed_at) * 1000, 1),
            "lost_fanout_ms": round((max(loss_times) - decisions[1]) * 1000, 1) if len(decisions) > 1 else None,
            "holders": sum(1 for t in stop_times if t != float("inf"))}


def _rank_table(controller: Controller, nodes: int) -> dict:
    layout = tuple(sorted(controller.nodes.values(), key=lambda n: n.node_rank))
    with tempfile.TemporaryDirectory() as folder:
        began = time.perf_counter()
        write_table(folder, FTRUN_TABLE, ftrun_table(RUN_ID, 1, layout, 0, {}))
        seconds = time.perf_counter() - began
        size = os.path.getsize(os.path.join(folder, FTRUN_TABLE))
    return {"rank_table_ms": round(seconds * 1000, 1), "rank_table_bytes": size}


def _restore_plan(nodes: int, nproc: int) -> dict:
    """A sharded job's plan: each rank's snapshot in its node's memory, a replica on the next node."""
    world = nodes * nproc
    inventories = []
    for node in range(nodes):
        own = [HeldSnapshot(r, 100, world, True, MEMORY, f"/dev/shm/r{r}", 1 << 20, r) for r in
               range(node * nproc, (node + 1) * nproc)]
        before = (node - 1) % nodes
        replicas = [HeldSnapshot(r, 100, world, True, REPLICA, f"/dev/shm/p{r}", 1 << 20, r) for r in
                    range(before * nproc, (before + 1) * nproc)]
        inventories.append(SnapshotInventory(f"sim-{node}", node, f"127.0.0.1:{9000 + node}", tuple(own + replicas)))
    homes = {r: r // nproc for r in range(world)}
    began = time.perf_counter()
    plan = choose_restore(1, inventories, world, homes)
    seconds = time.perf_counter() - began
    from ftrun.messages import to_json

    assert plan.step == 100, plan.reason
    return {"plan_ms": round(seconds * 1000, 1), "plan_bytes": len(to_json(plan))}


def _received(store: ControlStore, keys: JobKeys) -> int:
    return store.counter(keys.command_count)


def _all_running(controller: Controller, nodes: int) -> bool:
    rows = controller.status.get("nodes", [])
    return sum(1 for row in rows if row["role"] == "active" and row["ranks_alive"]) >= nodes


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _thread_cpu(process: psutil.Process, native_id: int | None) -> float:
    thread = next(t for t in process.threads() if t.id == native_id)
    return thread.user_time + thread.system_time


def _ops(controller_ops, agent_counts) -> int:
    return controller_ops.value + sum(v.value for v in agent_counts)


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {seconds:g}s")
        time.sleep(0.02)


COLUMNS = [("nodes", "nodes"), ("ranks", "ranks"), ("agents", "agents"), ("rendezvous_s", "rdzv s"),
           ("fail_fanout_ms", "fail fan-out ms"), ("decision_fanout_ms", "decision fan-out ms"),
           ("restart_ms", "restart ms"), ("lost_fanout_ms", "lost fan-out ms"),
           ("ctl_cpu", "ctl CPU"), ("store_cpu", "store CPU"), ("store_ops_s", "store ops/s"),
           ("board_bytes", "board B"), ("rank_table_ms", "rank table ms"), ("plan_bytes", "plan B"),
           ("plan_ms", "plan ms")]


def table(rows: list[dict]) -> str:
    widths = [max(len(title), *(len(str(row.get(key))) for row in rows)) for key, title in COLUMNS]
    lines = ["  ".join(title.rjust(w) for (_, title), w in zip(COLUMNS, widths))]
    lines += ["  ".join(str(row.get(key)).rjust(w) for (key, _), w in zip(COLUMNS, widths)) for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--ranks-per-node", type=int, default=16)
    parser.add_argument("--agent-processes", type=int, default=2, help="processes the simulated agents share")
    parser.add_argument("--steady", type=float, default=5.0, help="seconds of steady state measured")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        rows.append(simulate(nodes, args.ranks_per_node, args.agent_processes, args.steady))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{os.cpu_count()} cores; each run's agents (N + 1 spare) shared {args.agent_processes} processes "
          f"with the controller and the store in one more\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
