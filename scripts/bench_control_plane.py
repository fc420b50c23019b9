"""What does ftrun's control plane cost at 1,000 nodes and 16,000 ranks? Measured by simulation.

The real controller (``ftrun.controller.Controller``) and a real TCPStore run in this process; N
simulated agents share --agent-processes other processes, each speaking the agents' real protocol
through ``ftrun.agent.protocol.NodeProtocol`` (the object the real Agent sends and reads every message
with) and its Watch (a thread blocked in the store on the agent's doorbell): the rendezvous,
keepalives with the node's status, its ranks' heartbeat and step reads (the hang check), reports and
commands. An agent reads its commands in its watch's thread as the bell rings; one thread per process
takes the rest of its agents' turns on time (SimAgent, Driver). Workers are only their heartbeats: a
thread per process writes each running rank's heartbeat counter and step once a second, as the worker
library does (one ``multi_set`` per node instead of two writes per rank: the store does the same
work). One more agent stands by as a spare.

--backend etcd (or c10d,etcd: both, size by size, side by side in one more table) runs the same with the
controller's office in a 3-member etcd cluster of each run's own on loopback (scripts/etcd_cluster.py):
the controller holds the leader key on a lease of --lease-ttl seconds and writes its journal to etcd at
each decision, before the decision's commands (in the decision's fan-out); a second spare stands by.
The run then ends with a failover: the controller's node "lost" (its lease renewed no more, nothing
given up), another candidate leads once the lease lapses, reads the journal and runs a controller
resumed from it, in a store of its own.

--real-agents 32 then runs 32 real ftrun agents (a process each, one rank each) twice, and kills a rank
each time: at job level (the rank a stdlib script), then at process level (the rank the worker library
around a one-weight model), and prints their figures beside the simulator's at the same size.

Per N, in order:
  rendezvous       from the go signal until every node's agent holds its place
  first start      from the go signal until every node's agent has read generation 0's START and the
                   whole layout (what the agent builds its rank tables from)
  fail fan-out     from one rank's failure report until every agent holds the controller's STOP
  decision         from the controller's decision until every agent holds it (and until half do)
  restart          from that report until every agent holds the next generation's START
  publish          the controller's own part of the failure's decision: the STOP written and every
                   agent's doorbell rung
  lost-node fan-out from the controller's finding a node lost (no keepalive for --node-timeout) until
                   every agent (the spare included) holds its decision
  replace fan-out  once the ranks say they run the worker library (its "joined" milestone), one more
                   rank fails: from its report until every agent holds the process-level REPLACE
  replace decision the same from the controller's decision (the REPLACE goes out the policy's
                   gather_timeout, 30 ms, after it: reports of more ranks lost meanwhile join it)
  ctl CPU          the controller thread's CPU seconds per wall second over --steady seconds of running
  store CPU        the store server's (this process less the controller thread) over the same
  agents CPU       the simulated agents' processes' over the same: what the machine had left
  store ops/s      requests every client sent over the same (each message of a multi_get or multi_set is one)
  board            bytes of the status snapshot (``ftrun status``'s JSON)
  rank table       one agent's time to build and write its generation's rank table
  layout           bytes of the layout an agent reads whole at its first start (its rank tables name
                   every rank), and of the largest change it reads at a later generation instead
  restore plan     bytes of the RestorePlans of a sharded job (each rank's snapshot and one replica
                   on the next node): all nodes', and the largest node's (what each rank reads), and
                   the time to choose the step and make and encode every node's plan
  etcd only:
  journal          bytes of the whole journal (what a successor reads); the time of its first write
                   (every part, at the start), and the bytes and time of the failure's decision's write
  etcd writes/s    raft proposals committed and lease renewals over --steady seconds, as etcd's
                   /metrics counts them, and per node
  etcd CPU         the 3 members' CPU seconds per wall second over the same
  failover         from the controller's loss until its successor's first command is published: the
                   lease's lapse (until the successor leads), then its takeover (journal read, store
                   hosted, layout published, the lost node's decision journaled and published)

    .venv/bin/python scripts/bench_control_plane.py --nodes 8,64,256,1024 --ranks-per-node 16 --runs 3 --json cp.json
    .venv/bin/python scripts/bench_control_plane.py --backend c10d,etcd --real-agents 0 --json cp-etcd.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import heapq
import json
import logging
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
import zlib
from pathlib import Path
from typing import Callable

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import free_port, kill_everything  # noqa: E402
from etcd_cluster import EtcdCluster  # noqa: E402

from ftrun.agent.control_plane import LOOK_AGAIN  # noqa: E402
from ftrun.agent.protocol import NodeProtocol, Watch  # noqa: E402
from ftrun.agent.workers import STOP_POLL  # noqa: E402
from ftrun.contract import Endpoint, Milestone, parse_endpoint  # noqa: E402
from ftrun.controller.controller import Controller, RecoveryPolicy  # noqa: E402
from ftrun.controller.inbox import NodeLost  # noqa: E402
from ftrun.controller.journal import JournalWriter, read_journal  # noqa: E402
from ftrun.controller.leadership import Leadership  # noqa: E402
from ftrun.controller.states import Level  # noqa: E402
from ftrun.etcd import EtcdClient, EtcdOptions  # noqa: E402
from ftrun.keys import EtcdKeys, JobKeys  # noqa: E402
from ftrun.messages import CommandKind, JoinRecord, NodeStatus, RankState, ReportKind, WorkerFailure, to_json  # noqa: E402
from ftrun.ranktable import FTRUN_TABLE, ftrun_table, write_table  # noqa: E402
from ftrun.rendezvous import RendezvousPolicy  # noqa: E402
from ftrun.snapshots.plan import MEMORY, REPLICA, HeldSnapshot, SnapshotInventory, choose_restore  # noqa: E402
from ftrun.store import ControlStore, connect_store, host_store  # noqa: E402

RUN_ID = "bench"
#: the agents' defaults (ftrun/keys.py AGENT_HEARTBEAT_INTERVAL, --monitor-interval), the library's heartbeat
KEEPALIVE, MONITOR_INTERVAL, RANK_BEAT = 0.5, 0.1, 1.0
READY, GO, FAIL, LOSE, END = "bench/ready", "bench/go", "bench/fail", "bench/lose", "bench/end"
#: the workers say they run the worker library (its "joined" milestone); then one more rank fails
LIBRARY, REPAIR = "bench/library", "bench/repair"
#: how often a process of simulated agents looks for the failure or the loss to simulate; how many of
#: its agents connect at once
DIRECTOR_TICK, CONNECTING = 0.05, 16
#: how many times the restore plan is chosen and the rank table written (the quickest counts)
TIMED_REPEATS = 3
#: --backend: the control planes measured (c10d: a TCPStore alone; etcd: the same store, the controller's
#: office and journal in a 3-member etcd)
BACKENDS = ("c10d", "etcd")
#: --backend etcd: the controller's lease, as the agents' --node-timeout sets it (the tests': renewed
#: every second)
LEASE_TTL = 3.0


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
    """One node's agent with workers that are only heartbeats: the real NodeProtocol and its Watch.
    ``turn`` is one turn of Agent._supervise_turns's loop (its keepalive when due, then the failure to
    simulate and the controller's commands): taken in its watch's thread as the bell rings, as a
    real agent's loop wakes the moment its watch does, and otherwise by the process's Driver."""

    def __init__(self, index: int, port: int, nproc: int, ops, shared: dict, wake: Callable[["SimAgent"], None]):
        self.index, self.port, self.nproc, self.ops, self.shared, self.wake = index, port, nproc, ops, shared, wake
        self.lock = threading.Lock()  # one turn at a time
        self.agent_id = f"sim-{index}"
        self.joined_at = self.started_at = 0.0
        self.ranks: list[int] = []
        self.running = False
        self.generation = 0
        self.failed_at = self.repair_failed_at = 0.0
        self.node = -1
        self.next_beat = 0.0
        #: a STOP to acknowledge, and when its workers would be gone; whether the agent left
        self.stopping: tuple[int, float] | None = None
        self.gone = False
        #: when the Driver is to take its next turn by the clock (None: not scheduled)
        self.scheduled: float | None = None
        #: (sequence number, kind, generation, time received) of every command
        self.received: list[tuple[int, str, int, float]] = []

    def connect(self) -> None:
        endpoint = Endpoint("127.0.0.1", self.port)
        self.store = ControlStore(CountingStore(connect_store(endpoint, 120), self.ops), endpoint, is_host=False)
        watch = Watch(lambda: CountingStore(connect_store(endpoint, 120), self.ops), JobKeys(RUN_ID), self.agent_id,
                      self._rang)
        self.protocol = NodeProtocol(self.store, JobKeys(RUN_ID), self.agent_id, node_timeout=30.0, watch=watch)

    def join(self) -> None:
        """The rendezvous, in a thread of its own (each agent waits for the result); then the Driver's."""
        self.store.wait_for(GO, 600)
        record = JoinRecord(self.agent_id, "127.0.0.1", os.getpid(), self.nproc, requested_node_rank=-1)
        result, slot = self.protocol.join(record, 300, threading.Event())
        self._take(slot.first_rank)
        #: the node rank the rendezvous gave (-1: the spare); the failing and the lost node are named by
        #: it, since which agent ends up the spare depends on the order they joined in
        self.node = slot.node_rank
        self.joined_at = time.time()
        self.wake(self)

    def _rang(self) -> None:
        """Its bell rang (in the watch's thread): its turn now; the Driver's next when that moved it."""
        self.take_turn(rung=True)
        if self.due() != self.scheduled:
            self.wake(self)

    def take_turn(self, rung: bool = False) -> None:
        with self.lock:
            if self.joined_at and not self.gone:
                self.turn(time.monotonic(), rung)

    def due(self) -> float:
        """When its next turn is due by the clock: its keepalive, or the acknowledgement of a STOP."""
        return self.next_beat if self.stopping is None else min(self.next_beat, self.stopping[1])

    def turn(self, now: float, rung: bool = False) -> None:
        """One turn of the agent's loop: its keepalive when due, then the failure to simulate and the
        commands. ``rung`` (in its watch's thread, as the bell rang): the commands alone, its keepalive
        left to the Driver, since a round trip costs the simulator's shared cores tens of
        milliseconds where it costs an agent on a host of its own a fraction of one."""
        if not rung:
            self._beat(now)
        self._read()

    def _beat(self, now: float) -> None:
        if now >= self.next_beat:
            ranks = self.ranks if self.running else []
            _, steps = self.protocol.observe(ranks, now)  # the controller's keepalive, commands, the hang check's read
            states = tuple(RankState(r, r - self.ranks[0], 0, self.running, 0, step, 0.0) for r, step in zip(ranks, steps))
            self.protocol.keepalive(NodeStatus(self.agent_id, "127.0.0.1", self.generation, states), now)
            self.next_beat = now + KEEPALIVE
        if self.stopping is not None and now >= self.stopping[1]:
            self.protocol.acknowledge_stop(self.stopping[0])
            self.stopping = None

    def _read(self) -> None:
        """The failure or the loss the director asks for, then the controller's commands."""
        shared = self.shared
        if shared["fail"] == self.node >= 0 and not self.failed_at and self.running:
            self.failed_at = self._fail()
        if shared["repair"] == self.node >= 0 and not self.repair_failed_at and self.running:
            self.repair_failed_at = self._fail()
        if shared["lose"] == self.node >= 0:
            self.gone = True  # the node is gone: no keepalive, no goodbye
            return
        seq = self.protocol.next_command
        for offset, command in enumerate(self.protocol.commands()):
            self.received.append((seq + offset, command.kind.value, command.generation, time.time()))
            if command.kind is CommandKind.EXIT:
                self.protocol.report(ReportKind.EXITED, command.generation)
                self.gone = True
                return
            if command.kind is CommandKind.STOP:
                # acknowledged once its workers would be gone: a real agent's stop signals them, and
                # looks again STOP_POLL later (WorkerGroup.stop)
                self.running = False
                self.stopping = (command.generation, time.monotonic() + STOP_POLL)
            elif command.kind is CommandKind.START:
                self.protocol.layout(command.layout)  # as the agent does for its rank tables (whole the first time)
                self.protocol.prepare_ranks(self.ranks)  # as the agent does before it starts its workers
                self.generation, self.running = command.generation, True
                self.started_at = self.started_at or time.time()
            elif command.kind is CommandKind.REPLACE:
                self.protocol.layout(command.layout)  # every agent, as the agent does before it looks for its ranks
                if set(command.ranks) & set(self.ranks):
                    self.protocol.report(ReportKind.CLEARED, command.generation)  # its replacement "runs"
                    self.running = True
            elif command.kind is CommandKind.TAKEOVER and command.agent_id == self.agent_id:
                self.protocol.node_rank = command.node_rank
                mine = next(n for n in self.protocol.layout(command.layout).nodes if n.node_rank == command.node_rank)
                self._take(mine.first_rank)
            elif command.kind is CommandKind.TAKEOVER and command.node_rank == self.protocol.node_rank:
                self.gone = True
                return

    def _take(self, first_rank: int) -> None:
        self.ranks = list(range(first_rank, first_rank + self.nproc)) if first_rank >= 0 else []

    def _fail(self) -> float:
        """Its first rank failed: the report, as the agent sends it; when."""
        rank = self.ranks[0]
        failure = WorkerFailure(rank, 0, self.protocol.node_rank, "127.0.0.1", 0, None, signal="SIGKILL",
                                timestamp=time.time(), generation=self.generation, cause="signal")
        self.running = False
        failed_at = time.time()
        self.protocol.report(ReportKind.WORKER_FAILED, self.generation, failures=(failure,))
        return failed_at


class Driver:
    """One thread that takes the turns of a process's simulated agents that no bell asks for: those due
    by the clock (a keepalive, a STOP's acknowledgement), and those the director or the rendezvous
    wakes. Not a thread per agent, so that the cores the simulator shares go to the control plane's
    work and not to hundreds of threads handing the interpreter to each other (a thread per agent
    cost 60 us of a core per agent and command, the decision's fan-out to 1,025 agents 150 ms); and
    not the rung agents' turns too, which would wait for the interpreter behind the watches of their
    process waking with them (30-50 ms after their bell), where a real agent's loop has its own."""

    def __init__(self):
        self.woken: queue.SimpleQueue[SimAgent] = queue.SimpleQueue()
        self._due: list[tuple[float, int, SimAgent]] = []  # a heap; an entry the agent moved since is stale

    def run(self, end: threading.Event) -> None:
        while not end.is_set():
            agent = self._next()
            if agent is not None:
                agent.take_turn()
                self._schedule(agent)

    def _next(self) -> SimAgent | None:
        """The next agent to take its turn: a woken one first, else the first one due; None after a
        wait that ended with neither."""
        try:
            return self.woken.get_nowait()
        except queue.Empty:
            pass
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            when, _, agent = heapq.heappop(self._due)
            if when == agent.scheduled:
                agent.scheduled = None
                return agent
        wait = self._due[0][0] - now if self._due else DIRECTOR_TICK
        try:
            return self.woken.get(timeout=min(max(wait, 0.0), DIRECTOR_TICK))
        except queue.Empty:
            return None

    def _schedule(self, agent: SimAgent) -> None:
        when = agent.due()
        if agent.joined_at and not agent.gone and when != agent.scheduled:
            agent.scheduled = when
            heapq.heappush(self._due, (when, agent.index, agent))


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
    """A process of simulated agents: each agent's watch (a thread each), a thread each for the
    rendezvous, then a Driver's thread for them all; a worker-heartbeat thread, a director thread."""
    logging.basicConfig(level=logging.ERROR)
    ops = Count()
    shared = {"fail": -1, "lose": -1, "repair": -1, "end": threading.Event()}
    driver = Driver()
    agents = [SimAgent(i, port, nproc, ops, shared, driver.woken.put) for i in indices]
    with concurrent.futures.ThreadPoolExecutor(CONNECTING) as pool:
        list(pool.map(SimAgent.connect, agents))
    for agent in agents:  # and every watch, as a real agent's is long before the rendezvous ends
        agent.protocol.watch.connected.wait(300)
    gc.freeze()  # as each real agent does once it runs (Agent._run)
    threads = [threading.Thread(target=a.join, name=f"sim-agent-{a.index}", daemon=True) for a in agents]
    threads.append(threading.Thread(target=driver.run, args=(shared["end"],), name="sim-agents", daemon=True))
    threads.append(threading.Thread(target=beat_ranks, args=(port, agents, ops, shared["end"]), name="sim-workers",
                                    daemon=True))
    for thread in threads:
        thread.start()
    director = CountingStore(connect_store(Endpoint("127.0.0.1", port), 60), Count())
    director.add(READY, 1)  # every agent of this process is connected
    keys, library = JobKeys(RUN_ID), False
    while True:
        for key, name in ((FAIL, "fail"), (LOSE, "lose"), (REPAIR, "repair")):
            if shared[name] < 0 and director.check([key]):
                shared[name] = int(director.get(key))
                for agent in agents:  # the failure or the loss to simulate, now (only its node's agent:
                    if agent.node == shared[name]:  # the others' turns would hold back their watches)
                        driver.woken.put(agent)
        if not library and director.check([LIBRARY]):  # each running rank formed its group, as the library says
            library = True
            for agent in agents:
                if agent.running:
                    director.add(keys.milestone(agent.generation, Milestone.JOINED.value), len(agent.ranks))
        ops_value.value = ops.value
        if director.check([END]):
            break
        time.sleep(DIRECTOR_TICK)
    shared["end"].set()
    for thread in threads:
        thread.join(5)
    for agent in agents:
        agent.protocol.watch.close(agent.store)
    results.put([{"node": a.node, "joined_at": a.joined_at, "started_at": a.started_at, "failed_at": a.failed_at,
                  "repair_failed_at": a.repair_failed_at, "received": a.received}
                 for a in agents])


# -- the controller's side, and the measurements -------------------------------------------------

class EtcdOffice:
    """--backend etcd: a 3-member etcd cluster of the run's own on loopback (scripts/etcd_cluster.py), and
    the controller's office in it (its Leadership: the lease, each decision's journal), as the agent
    that hosts the controller holds it. Each journal write (a transaction) is timed and sized."""

    def __init__(self, ttl: float = LEASE_TTL):
        self.ttl = ttl
        self._folder = tempfile.TemporaryDirectory(prefix="ftrun-bench-etcd-")
        self.cluster = EtcdCluster.start(Path(self._folder.name), 3)
        self.options = EtcdOptions(tuple(parse_endpoint(e, 2379) for e in self.cluster.endpoints.split(",")))
        self.keys = EtcdKeys(RUN_ID)
        #: (wall time it began, ms, bytes written) of each journal write
        self.writes: list[tuple[float, float, int]] = []
        self.leadership = self.candidate("sim-0")
        if not self.leadership.try_lead():
            raise RuntimeError("a fresh etcd cluster has a leader already")
        write = self.leadership.write

        def timed_write(ops: list[dict]) -> None:
            began, clock = time.time(), time.perf_counter()
            write(ops)
            # base64's length, not its decoding: this runs in the controller's thread, before the commands
            size = sum(len(op["request_put"]["value"]) * 3 // 4 for op in ops if "request_put" in op)
            self.writes.append((began, (time.perf_counter() - clock) * 1000, size))

        self.leadership.write = timed_write  # type: ignore[method-assign]

    def candidate(self, agent_id: str) -> Leadership:
        return Leadership(EtcdClient(self.options), self.keys, agent_id, self.ttl)

    def counters(self) -> dict[str, float]:
        """etcd's own counts: raft proposals committed (every write: puts, transactions, leases granted
        and revoked) and puts, as one member applied them (each applies all); lease renewals, which the
        raft leader answers alone without a proposal, summed over the members."""
        counts = {"proposals": 0.0, "puts": 0.0, "renewals": 0.0}
        names = {"etcd_server_proposals_committed_total": "proposals", "etcd_mvcc_put_total": "puts",
                 "etcd_debugging_lease_renewed_total": "renewals"}
        for index, member in enumerate(self.cluster.members):
            with urllib.request.urlopen(f"http://{member.endpoint}/metrics", timeout=5) as answer:
                for line in answer.read().decode().splitlines():
                    name, _, value = line.partition(" ")
                    if name in names and (index == 0 or names[name] == "renewals"):
                        counts[names[name]] += float(value)
        return counts

    def cpu(self) -> float:
        return sum(_cpu(psutil.Process(m.proc.pid)) for m in self.cluster.members if m.proc is not None)

    def journal_bytes(self) -> int:
        """The whole journal as etcd holds it now (what a successor reads)."""
        return sum(len(kv.value) for kv in self.leadership.client.get_prefix(self.keys.journal_part("")))

    def close(self) -> None:
        self.cluster.stop()
        self._folder.cleanup()


def _failover(office: EtcdOffice, journal, rendezvous: RendezvousPolicy, policy: RecoveryPolicy) -> dict:
    """Once the simulated agents have left: the journal as the running job's last decision left it
    (``journal``) written again by the controller's office, then the controller's node lost: its lease
    renewed no more, nothing given up (as tests/unit/test_etcd.py stops a leader). Another agent's
    candidacy, as EtcdControlPlane.find's: it tries to lead, else watches the run's keys in etcd;
    leading, it reads the journal, hosts a store of its own and runs a Controller resumed from it. Timed
    from the loss until the successor's first command is published (its takeover of the lost
    controller's node: the decision's TAKEOVER, or a STOP). The agents are gone first, so that they end
    as in a c10d run (they follow no successor: the simulator's agents know one store)."""
    if journal.held_by(journal.leader) is None:
        # the controller's agent ended up a spare (the rendezvous places the agents in the order they
        # joined): its loss would leave nothing to take over. Node 0's agent hosts it instead, as the
        # measure needs a node lost with the controller
        node = journal.nodes[0]
        journal = dataclasses.replace(journal, leader=node.agent_id, host=node.host)
    JournalWriter().write(office.leadership, journal)  # the job's EXIT overwrote it
    killed = time.monotonic()
    office.leadership._stop.set()  # no renewal any more, and no resignation
    office.leadership.lost.set()
    successor = office.candidate("sim-1")
    client = successor.client
    while True:
        revision = client.revision()
        if successor.try_lead():
            break
        if time.monotonic() - killed > 10 * office.ttl:
            raise TimeoutError("no successor took the controller's office")
        client.wait_change(office.keys.root, revision, LOOK_AGAIN, prefix=True)
    led = time.monotonic()
    journal = read_journal(client, office.keys)
    assert journal is not None, "the controller wrote no journal"
    server = host_store(Endpoint("127.0.0.1", 0), several_nodes=False)
    store = ControlStore(server, Endpoint("127.0.0.1", server.port), is_host=True)
    resumed = Controller(store, JobKeys(RUN_ID), rendezvous, "sim-1", "127.0.0.1", policy, leadership=successor,
                         resume=journal)
    first: list[tuple[float, str]] = []
    publish = resumed.publisher.commands

    def noted(commands) -> None:
        publish(commands)
        if commands and not first:
            first.append((time.monotonic(), "+".join(command.kind.value for command in commands)))

    resumed.publisher.commands = noted  # type: ignore[method-assign]
    resumed.start()
    try:
        wait_until(lambda: bool(first), 30, "the successor's first command")
    finally:
        successor.lost.set()  # it steps down (its agents are the simulated ones, on the first store)
        resumed.join(5)
        successor.resign()
    published, kinds = first[0]
    return {"failover_ms": round((published - killed) * 1000), "lease_lapse_ms": round((led - killed) * 1000),
            "takeover_ms": round((published - led) * 1000, 1), "failover_commands": kinds}


def simulate(nodes: int, nproc: int, agent_processes: int = 4, steady: float = 5.0, node_timeout: float = 30.0,
             backend: str = "c10d", lease_ttl: float = LEASE_TTL) -> dict:
    """One run at ``nodes`` x ``nproc`` (and one spare); the figures, and the counts the smoke test checks.
    ``backend`` "etcd": the controller leads from an etcd cluster of the run's own (EtcdOffice), writing
    its journal at each decision; the run ends with its failover (_failover), for which a second spare
    stands by (the first takes the lost node's place before): the successor's first command is the
    takeover of the lost controller's node, as on a job with a spare left."""
    logging.getLogger("ftrun").setLevel(logging.ERROR)
    office = EtcdOffice(lease_ttl) if backend == "etcd" else None
    try:  # the cluster goes with a failure before the run (the run's own finally closes it after)
        server = host_store(Endpoint("127.0.0.1", 0), several_nodes=False)
        port = server.port
        ctl_ops = Count()
        store = ControlStore(CountingStore(server, ctl_ops), Endpoint("127.0.0.1", port), is_host=True)
        keys = JobKeys(RUN_ID)
        spares = 2 if office else 1
        rendezvous = RendezvousPolicy(nodes, nodes, 0.0, 300.0, spares=spares)
        policy = RecoveryPolicy(max_restarts=10, recovery=Level.PROCESS, node_timeout=node_timeout, stop_timeout=10.0,
                                repair_timeout=60.0)
        controller = Controller(store, keys, rendezvous, "sim-0", "127.0.0.1", policy,
                                leadership=office.leadership if office else None)
        lost_at: list[float] = []
        tell = controller.executor.tell

        def timed_tell(event) -> None:  # a node lost is told as its decision is taken
            if isinstance(event, NodeLost):
                lost_at.append(time.time())
            tell(event)

        controller.executor.tell = timed_tell  # type: ignore[method-assign]
        published: list[tuple[str, float]] = []
        #: the journal writes made before each kind of command was first published
        journaled: dict[str, int] = {}
        publish = controller.publisher.commands

        def timed_publish(commands) -> None:
            began = time.perf_counter()
            publish(commands)
            published.extend((command.kind.value, time.perf_counter() - began) for command in commands)
            if office is not None and commands:
                journaled.setdefault(commands[0].kind.value, len(office.writes))

        controller.publisher.commands = timed_publish  # type: ignore[method-assign]
        controller.start()
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        total = nodes + spares
        #: the nodes that fail, are lost and fail at process level (node ranks)
        failing, lost, repairing = (nodes + 1) // 2, (nodes + 1) // 3, (nodes + 1) // 4
        shares = [list(range(total))[p::max(1, agent_processes)] for p in range(max(1, agent_processes))]
        op_counts = [context.Value("q", 0, lock=False) for _ in shares]
        processes = [context.Process(target=run_agents, args=(port, share, nproc, results, count), daemon=True)
                     for share, count in zip(shares, op_counts)]
        for process in processes:
            process.start()
    except BaseException:
        if office is not None:
            office.close()
        raise
    figures: dict = {"nodes": nodes, "backend": backend, "ranks": nodes * nproc, "agents": total,
                     "agent_processes": len(processes)}
    try:
        wait_until(lambda: store.counter(READY) >= len(processes), 300, "every agent connected")
        go = time.time()
        _progress(f"{nodes} nodes: {total} agents connected; the rendezvous starts")
        store.set_text(GO, "1")
        wait_until(lambda: controller.view is not None and _received(store, keys) >= 1, 300, "the rendezvous")
        _progress(f"{nodes} nodes: rendezvous done in {time.time() - go:.1f}s")
        gc.freeze()  # as the host's agent, the controller's process, does once it runs
        wait_until(lambda: _all_running(controller, nodes), 120, "every node's first keepalive")
        _progress(f"{nodes} nodes: every node runs; steady state")

        # steady state: the controller's CPU and every client's requests over `steady` seconds
        time.sleep(max(2.0, 2 * KEEPALIVE + RANK_BEAT))
        me = psutil.Process()
        ctl_thread = controller._thread.native_id
        agents = [psutil.Process(p.pid) for p in processes]
        cpu0, thread0, ops0, wall0 = _cpu(me), _thread_cpu(me, ctl_thread), _ops(ctl_ops, op_counts), time.monotonic()
        agents0 = sum(_cpu(a) for a in agents)
        etcd0, etcd_cpu0 = (office.counters(), office.cpu()) if office else ({}, 0.0)
        time.sleep(steady)
        wall = time.monotonic() - wall0
        if office is not None:
            counts = {name: value - etcd0[name] for name, value in office.counters().items()}
            writes = counts["proposals"] + counts["renewals"]
            figures["etcd_writes_s"] = round(writes / wall, 2)
            figures["etcd_writes_node_s"] = round(writes / wall / nodes, 4)
            figures["etcd_puts_s"] = round(counts["puts"] / wall, 2)
            figures["etcd_renewals_s"] = round(counts["renewals"] / wall, 2)
            figures["etcd_cpu"] = round((office.cpu() - etcd_cpu0) / wall, 3)
        figures["agents_cpu"] = round((sum(_cpu(a) for a in agents) - agents0) / wall, 3)
        ctl_cpu = _thread_cpu(me, ctl_thread) - thread0
        figures["ctl_cpu"] = round(ctl_cpu / wall, 4)
        figures["store_cpu"] = round((_cpu(me) - cpu0 - ctl_cpu) / wall, 4)
        figures["store_ops_s"] = round((_ops(ctl_ops, op_counts) - ops0) / wall)
        figures["board_bytes"] = len(store.try_text(keys.status))
        figures["steady_step"] = controller.status.get("step")

        # one rank fails: its report until every agent holds the STOP, and the next START
        seq = store.counter(keys.command_count)
        store.set_text(FAIL, str(failing))
        wait_until(lambda: controller.view.generation >= 1 and controller.view.phase.value == "running", 60,
                   "the job-level restart")
        time.sleep(3 * MONITOR_INTERVAL)
        # a node is lost (its agent goes silent); the spare takes its place
        lose_seq = store.counter(keys.command_count)
        store.set_text(LOSE, str(lost))
        wait_until(lambda: lost_at and controller.view.phase.value == "running" and controller.view.generation >= 2,
                   60 + node_timeout, "the spare's takeover")
        time.sleep(3 * MONITOR_INTERVAL + KEEPALIVE)
        # the ranks run the worker library (so far the controller repaired at job level, as for any
        # script): one more rank fails, and it is replaced alone
        store.set_text(LIBRARY, "1")
        wait_until(lambda: controller.view.process_level_ready, 30, "every rank's library milestone")
        repair_seq = store.counter(keys.command_count)
        store.set_text(REPAIR, str(repairing))
        wait_until(lambda: any(kind == "replace" for kind, _ in published), 30, "the process-level repair")
        time.sleep(3 * MONITOR_INTERVAL + KEEPALIVE)
        figures.update(_layouts(store, keys))
        if office is not None:
            figures["journal_bytes"] = office.journal_bytes()
            journal = read_journal(office.leadership.client, office.keys)  # as the last decision left it
    finally:
        gc.unfreeze()  # the next size's run collects this one's
        controller.stop_job(0, "benchmark over")  # every agent reads the EXIT and leaves
        controller.join(15)
        store.set_text(END, "1")
        received = []
        for _ in processes:
            received += results.get(timeout=60)
        for process in processes:
            process.join(10)
        if office is not None and figures.get("journal_bytes") is None:
            office.close()  # the run failed before its failover
    decisions = [e["t"] for e in controller.events.last(("decision",), 10)]
    # the N nodes' agents (a spare that came after the decision is admitted later, as any late arrival is)
    joined = sorted(r["joined_at"] - go for r in received if r["node"] >= 0)
    figures["rendezvous_s"], figures["rendezvous_p50_s"] = round(joined[-1], 3), round(joined[len(joined) // 2], 3)
    figures["first_start_s"] = round(max(r["started_at"] for r in received if r["node"] >= 0) - go, 3)
    figures.update(_fan_out(received, seq, lose_seq, decisions, failing, lost))
    figures.update(_replace_fan_out(received, repair_seq, decisions[2], repairing, lost))
    figures["publish_ms"] = round(next(t for kind, t in published if kind == "stop") * 1000, 1)
    figures["replace_publish_ms"] = round(next(t for kind, t in published if kind == "replace") * 1000, 1)
    if office is not None:
        figures.update(_journal_writes(office.writes, journaled))
        try:
            figures.update(_failover(office, journal, rendezvous, policy))
        finally:
            office.close()
    figures.update(_rank_table(controller, nodes))
    figures.update(_restore_plan(nodes, nproc))
    figures["events"] = [e["kind"] for e in controller.events.last(("decision", "node_lost", "takeover",
                                                                     "generation_started"), 100)]
    return figures


def _journal_writes(writes: list[tuple[float, float, int]], journaled: dict[str, int]) -> dict:
    """The first journal write (every part, at the job's start), and the failure's decision's (the one
    made before the first STOP was published: in the decision's fan-out)."""
    decision = writes[journaled["stop"] - 1]
    return {"journal_first_ms": round(writes[0][1], 1), "journal_first_bytes": writes[0][2],
            "journal_ms": round(decision[1], 1), "journal_write_bytes": decision[2],
            "journal_writes": len(writes)}


def _held(received: list[dict], lost: int, wanted) -> list[float]:
    """When each agent (but the lost node's) first held a command that ``wanted(seq, kind, generation)``
    accepts; inf for one that never did."""
    held = []
    for agent in received:
        if agent["node"] != lost:
            times = [t for s, kind, g, t in agent["received"] if wanted(s, kind, g)]
            held.append(min(times, default=float("inf")))
    return held


def _fan_out(received: list[dict], seq: int, lose_seq: int, decisions: list[float], failing: int, lost: int) -> dict:
    """From the failure report, and from each decision (the controller's event), until the last agent
    holds the command."""
    failed_at = next(r["failed_at"] for r in received if r["node"] == failing)
    stop_times = _held(received, lost, lambda s, kind, g: s >= seq and kind == "stop")
    start_times = _held(received, lost, lambda s, kind, g: s >= seq and kind == "start" and g >= 1)
    loss_times = _held(received, lost, lambda s, kind, g: s >= lose_seq)
    return {"joined": sum(1 for r in received if r["joined_at"]),
            "fail_fanout_ms": round((max(stop_times) - failed_at) * 1000, 1),
            "decision_fanout_ms": round((max(stop_times) - decisions[0]) * 1000, 1),
            "decision_fanout_p50_ms": round((sorted(stop_times)[len(stop_times) // 2] - decisions[0]) * 1000, 1),
            "restart_ms": round((max(start_times) - failed_at) * 1000, 1),
            "lost_fanout_ms": round((max(loss_times) - decisions[1]) * 1000, 1) if len(decisions) > 1 else None,
            "holders": sum(1 for t in stop_times if t != float("inf"))}


def _replace_fan_out(received: list[dict], seq: int, decided_at: float, failing: int, lost: int) -> dict:
    """From the process-level failure's report, and from the controller's decision (the REPLACE goes
    out RecoveryPolicy.gather_timeout after it), until the last agent holds the REPLACE."""
    failed_at = next(r["repair_failed_at"] for r in received if r["node"] == failing)
    held = _held(received, lost, lambda s, kind, g: s >= seq and kind == "replace")
    return {"replace_fanout_ms": round((max(held) - failed_at) * 1000, 1),
            "replace_decision_fanout_ms": round((max(held) - decided_at) * 1000, 1),
            "replace_holders": sum(1 for t in held if t != float("inf"))}


def _quickest(make: Callable[[], object]) -> tuple[float, object]:
    """``make()`` TIMED_REPEATS times: the quickest's milliseconds, and what the last one made."""
    times = []
    for _ in range(TIMED_REPEATS):
        began = time.perf_counter()
        made = make()
        times.append(time.perf_counter() - began)
    return round(min(times) * 1000, 1), made


def _rank_table(controller: Controller, nodes: int) -> dict:
    """The quickest write: each ends in an fsync, which a busy disk alone can hold up for 100 ms,
    whatever the table's size."""
    layout = tuple(sorted(controller.roster.nodes.values(), key=lambda n: n.node_rank))
    with tempfile.TemporaryDirectory() as folder:
        milliseconds, path = _quickest(lambda: write_table(folder, FTRUN_TABLE, ftrun_table(RUN_ID, 1, layout, 0, {})))
        size = os.path.getsize(path)
    return {"rank_table_ms": milliseconds, "rank_table_bytes": size}


def _layouts(store: ControlStore, keys: JobKeys) -> dict:
    """Bytes of what an agent reads of the layout: the whole at its first start, then one change per
    version (the largest: the takeover's is one node)."""
    version = int(store.try_text(keys.layout_version))
    changes = [len(store.try_text(keys.layout_change(v))) for v in range(2, version + 1)]
    return {"layout_bytes": len(store.try_text(keys.layout)), "layout_versions": version,
            "layout_change_bytes": max(changes, default=0)}


def _restore_plan(nodes: int, nproc: int) -> dict:
    """A sharded job's plan: each rank's snapshot in its node's memory, a replica on the next node,
    named as the agents name them (``rank-00003.0``, ``replica-00003.1``, a 32-bit sum). Timed as the
    controller makes it: the choice, then each node's plan made and encoded (the quickest of
    TIMED_REPEATS: one alone moved by 10-20% between runs)."""
    world = nodes * nproc
    inventories = []
    for node in range(nodes):
        folder = f"/dev/shm/ftrun-{RUN_ID}-{node}"
        before = (node - 1) % nodes
        own = [HeldSnapshot(r, 100, world, True, MEMORY, f"{folder}/rank-{r:05d}.0", 1 << 20, _crc(r))
               for r in range(node * nproc, (node + 1) * nproc)]
        replicas = [HeldSnapshot(r, 100, world, True, REPLICA, f"{folder}/replica-{r:05d}.1", 1 << 20, _crc(r))
                    for r in range(before * nproc, (before + 1) * nproc)]
        inventories.append(SnapshotInventory(f"sim-{node}", node, f"10.0.{node >> 8}.{node & 255}:29400",
                                             tuple(own + replicas)))
    homes = {r: r // nproc for r in range(world)}

    def plans() -> list[str]:
        restore = choose_restore(1, inventories, world, homes)
        assert restore.step == 100, restore.reason
        return [to_json(plan) for _, plan in restore.plans()]

    milliseconds, texts = _quickest(plans)
    return {"plan_ms": milliseconds, "plan_bytes": sum(map(len, texts)), "plan_node_bytes": max(map(len, texts))}


def _crc(rank: int) -> int:
    """A snapshot's CRC-32 as it comes: ten digits, most of the time."""
    return zlib.crc32(rank.to_bytes(4, "little"))


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


def _progress(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, file=sys.stderr, flush=True)


def wait_until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {seconds:g}s")
        time.sleep(0.02)


# -- the real thing: real agents, one process each -----------------------------------------------

#: the environment variable that marks the real run's processes (the harness kills what carries it)
MARKER_VARIABLE = "FTRUN_BENCH_CONTROL_PLANE_MARKER"
#: the real run's worker at job level: no torch, writes its pid once running, ends when the harness says so
TICKER = """import os, sys, time
out = os.environ["REAL_OUT"]
with open(os.path.join(out, f"rank{os.environ['RANK']}.g{os.environ['FTRUN_GENERATION']}"), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 600
while not os.path.exists(os.path.join(out, "finish")) and time.monotonic() < deadline:
    time.sleep(0.1)
"""
#: at process level: the worker library (which the process-level repair needs) around a one-weight
#: model, a step each 0.1 s; its pid written after its first step (a replacement's: training resumed)
LIBRARY_TICKER = """import os, time
import torch
import ftrun.elastic
out = os.environ["REAL_OUT"]
job = ftrun.elastic.init("gloo")
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
wrapped = job.ddp(model)
job.register(model=model, optimizer=optimizer)
first = True
for step in job.steps(int(os.environ["REAL_STEPS"]) + 1, start=1):
    with job.guard():
        optimizer.zero_grad()
        wrapped(torch.ones(1, 1)).sum().backward()
        optimizer.step()
    if first:
        first = False
        with open(os.path.join(out, f"rank{os.environ['RANK']}.g{os.environ['FTRUN_GENERATION']}"), "w") as f:
            f.write(str(os.getpid()))
    time.sleep(0.1)
job.close()
"""
#: the process-level run's steps: enough to outlast the replacement's start (torch imported cold)
LIBRARY_STEPS = 150


def real_run(nodes: int, level: str = "job", deadline: float = 300.0, env: dict | None = None) -> dict:
    """``nodes`` real ftrun agents on one c10d endpoint (one process each, as on hosts of their own),
    one rank each; once every rank runs, the middle rank is SIGKILLed, and the repair it starts is
    timed from the agents' own log lines, as they print them.

    ``level`` "job": the rank runs a stdlib script, and the job is restarted:
      rendezvous   from the last agent's joining the store until the last holds its place
      fail fan-out from the SIGKILL until every other agent has read the STOP
      restart      from the SIGKILL until every agent has read the next generation's START
    "process" (--recovery process): the rank runs the worker library (torch, gloo), and the killed
    rank is replaced alone (--warm-standby 0: the replacement starts cold, as a standby per agent
    would not fit this machine's memory beside 2 x ``nodes`` torch processes):
      replace fan-out  from the SIGKILL until every other agent has read the REPLACE
      resumed          from the SIGKILL until the controller says training resumed

    The job then ends; the exit codes, and what each agent read, are the figures' counts. ``env``:
    more of the agents' environment."""
    process = level == "process"
    with tempfile.TemporaryDirectory(prefix="ftrun-real-") as folder:
        out = Path(folder)
        (out / "tick.py").write_text(LIBRARY_TICKER if process else TICKER)
        port, marker = free_port(), uuid.uuid4().hex
        command = [sys.executable, "-m", "ftrun", "--nnodes", str(nodes), "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "real",
                   "--max-restarts", "1", "--status", "plain", "--monitor-interval", str(MONITOR_INTERVAL),
                   *(("--recovery", "process", "--warm-standby", "0") if process else ()), str(out / "tick.py")]
        env = dict(os.environ, REAL_OUT=str(out), REAL_STEPS=str(LIBRARY_STEPS), PYTHONUNBUFFERED="1",
                   **{MARKER_VARIABLE: marker}, **(env or {}))
        env.pop("PET_NNODES", None)
        lines: list[tuple[int, float, str]] = []  # (agent, time read, line)
        agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                   start_new_session=True, text=True) for _ in range(nodes)]
        readers = [threading.Thread(target=_read_lines, args=(i, a.stdout, lines), daemon=True) for i, a in enumerate(agents)]
        for reader in readers:
            reader.start()
        try:
            wait_until(lambda: len(list(out.glob("rank*.g0"))) >= nodes, deadline, "every rank of generation 0 running")
            victim = int((out / f"rank{nodes // 2}.g0").read_text())
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: len(list(out.glob("rank*.g1"))) >= (1 if process else nodes), deadline,
                       "the replacement's first step" if process else "every rank of generation 1 running")
            (out / "finish").touch()
            codes = [a.wait(deadline) for a in agents]
        finally:
            kill_everything(agents, MARKER_VARIABLE, marker)  # what a failed run left, if anything
        for reader in readers:
            reader.join(5)

    def last(pattern: str, exclude: int = -1) -> tuple[int, float]:
        times = {}
        for agent, t, line in lines:
            if pattern in line and agent != exclude:
                times.setdefault(agent, t)
        return len(times), max(times.values(), default=float("nan"))

    joined, joined_at = last("joined the store")
    placed, placed_at = last(f" of {nodes}, ranks ")
    victim_agent = next(a for a, _, line in lines if f"rank {nodes // 2} failed" in line)
    figures = {"nodes": nodes, "ranks": nodes, "agents": nodes, "level": level, "exit_codes": sorted(set(codes)),
               "joined": placed, "rendezvous_s": round(placed_at - joined_at, 3)}
    if process:
        holders, held_at = last("replaced on another node", exclude=victim_agent)
        replaced, _ = last(f"replacing rank {nodes // 2} ")
        _, resumed_at = last("generation 1 resumed training")
        return dict(figures, replace_holders=holders, replaced=replaced,
                    replace_fanout_ms=round((held_at - killed_at) * 1000, 1),
                    resumed_ms=round((resumed_at - killed_at) * 1000, 1))
    stopped, stopped_at = last("stopping generation 0", exclude=victim_agent)
    restarted, restarted_at = last("restarting workers as generation 1")
    return dict(figures, holders=stopped, restarted=restarted,
                fail_fanout_ms=round((stopped_at - killed_at) * 1000, 1),
                restart_ms=round((restarted_at - killed_at) * 1000, 1))


def _read_lines(agent: int, stream, lines: list) -> None:
    for line in stream:
        lines.append((agent, time.time(), line.rstrip()))


REAL_COLUMNS = [("run", "32 nodes x 1 rank"), ("rendezvous_s", "rdzv s"), ("fail_fanout_ms", "fail fan-out ms"),
                ("restart_ms", "restart ms"), ("replace_fanout_ms", "replace fan-out ms"), ("resumed_ms", "resumed ms")]


COLUMNS = [("nodes", "nodes"), ("backend", "backend"), ("ranks", "ranks"), ("agents", "agents"), ("rendezvous_s", "rdzv s"),
           ("first_start_s", "first start s"),
           ("fail_fanout_ms", "fail fan-out ms"), ("decision_fanout_p50_ms", "decision p50 ms"),
           ("decision_fanout_ms", "decision fan-out ms"), ("publish_ms", "publish ms"), ("restart_ms", "restart ms"),
           ("lost_fanout_ms", "lost fan-out ms"), ("replace_fanout_ms", "replace fan-out ms"),
           ("replace_decision_fanout_ms", "replace decision ms"), ("ctl_cpu", "ctl CPU"), ("store_cpu", "store CPU"),
           ("agents_cpu", "agents CPU"), ("store_ops_s", "store ops/s"),
           ("board_bytes", "board B"), ("rank_table_ms", "rank table ms"), ("layout_bytes", "layout B"),
           ("layout_change_bytes", "change B"), ("plan_bytes", "plan B"),
           ("plan_node_bytes", "node plan B"), ("plan_ms", "plan ms"), ("journal_bytes", "journal B"),
           ("journal_first_ms", "journal first ms"), ("journal_write_bytes", "decision's journal B"),
           ("journal_ms", "journal ms"), ("etcd_writes_s", "etcd writes/s"), ("etcd_cpu", "etcd CPU"),
           ("failover_ms", "failover ms")]
#: --backend c10d,etcd: the two side by side, size by size
COMPARED_COLUMNS = [("nodes", "nodes"), ("backend", "backend"), ("fail_fanout_ms", "fail → all hold STOP ms"),
                    ("decision_fanout_p50_ms", "decision → half ms"), ("decision_fanout_ms", "decision → all ms"),
                    ("publish_ms", "publish ms"), ("restart_ms", "restart ms"), ("lost_fanout_ms", "lost node → all ms"),
                    ("journal_bytes", "journal B"), ("journal_first_ms", "whole journal written ms"),
                    ("journal_write_bytes", "decision's journal B"), ("journal_ms", "decision's journal ms"),
                    ("etcd_writes_s", "etcd writes/s"), ("etcd_writes_node_s", "per node"),
                    ("lease_lapse_ms", "lease lapsed ms"), ("takeover_ms", "takeover ms"),
                    ("failover_ms", "failover ms"), ("ctl_cpu", "ctl CPU"), ("etcd_cpu", "etcd CPU")]


def table(rows: list[dict], columns: list[tuple[str, str]] = COLUMNS) -> str:
    def cell(row: dict, key: str) -> str:
        return "-" if row.get(key) is None else str(row[key])

    widths = [max(len(title), *(len(cell(row, key)) for row in rows)) for key, title in columns]
    lines = ["  ".join(title.rjust(w) for (_, title), w in zip(columns, widths))]
    lines += ["  ".join(cell(row, key).rjust(w) for (key, _), w in zip(columns, widths)) for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--ranks-per-node", type=int, default=16)
    parser.add_argument("--agent-processes", type=int, default=4, help="processes the simulated agents share")
    parser.add_argument("--steady", type=float, default=5.0, help="seconds of steady state measured")
    parser.add_argument("--real-agents", type=int, default=32,
                        help="also run this many real agents (1 rank each) and the simulator at the same size (0: not)")
    parser.add_argument("--runs", type=int, default=1,
                        help="simulate each size this many times; the table shows each figure's median")
    parser.add_argument("--backend", default="c10d",
                        help="c10d, etcd, or both (c10d,etcd): each size is run with each, side by side in the "
                             "table. etcd starts a 3-member cluster of each run's own (scripts/etcd_cluster.py)")
    parser.add_argument("--lease-ttl", type=float, default=LEASE_TTL, help="etcd: the controller's lease (s)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be 1 or more, not {args.runs}")
    backends = [b for b in args.backend.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        parser.error(f"--backend takes {', '.join(BACKENDS)} or a list of them, not {args.backend!r}")
    rows, runs = [], []
    for nodes in (int(n) for n in args.nodes.split(",") if n):
        for backend in backends:
            runs.append([])
            for _ in range(args.runs):
                try:
                    runs[-1].append(simulate(nodes, args.ranks_per_node, args.agent_processes, args.steady,
                                             backend=backend, lease_ttl=args.lease_ttl))
                except Exception as e:  # the other sizes and backends still run; the table says which failed
                    _progress(f"{nodes} nodes on {backend}: the run failed: {e!r}")
                    continue
                print(json.dumps(runs[-1][-1]), flush=True)
            rows.append(medians(runs[-1]) if runs[-1] else {"nodes": nodes, "backend": f"{backend} (failed)"})
    compared = []
    if args.real_agents:
        compared = [dict(simulate(args.real_agents, 1, args.agent_processes, args.steady), run="simulated"),
                    dict(real_run(args.real_agents), run="real agents, job level"),
                    dict(real_run(args.real_agents, "process"), run="real agents, process level")]
        for row in compared:
            print(json.dumps(row), flush=True)
    print(f"\n{os.cpu_count()} cores; each run's agents (N + 1 spare) shared {args.agent_processes} processes "
          f"with the controller and the store in one more" + (f"; each figure the median of {args.runs} runs"
                                                               if args.runs > 1 else "") + "\n")
    if rows:
        print(table(rows))
    if "etcd" in backends:
        print(f"\nthe control plane on {' and '.join(backends)} (etcd: 3 members on this machine, a lease of "
              f"{args.lease_ttl:g}s; failover: from the controller's loss until its successor's first command)\n")
        print(table(rows, COMPARED_COLUMNS))
    if compared:
        print(f"\nthe simulator against {args.real_agents} real agents (one process each) on the same cores:\n")
        print(table(compared, [(k, t.replace("32", str(args.real_agents))) for k, t in REAL_COLUMNS]))
    if args.json:
        Path(args.json).write_text(json.dumps({"simulated": rows, "runs": runs, "real": compared}, indent=1))


def medians(runs: list[dict]) -> dict:
    """One row for the runs of one size: each number's median (the lower of the middle two for an even
    count: a figure some run measured), anything else as the first run had it."""
    row = dict(runs[0])
    for key, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = sorted(run[key] for run in runs)[(len(runs) - 1) // 2]
    return row


if __name__ == "__main__":
    main()
