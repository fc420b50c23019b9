"""Chaos rounds: a small ftrun job, random faults of every kind ftrun claims to handle, and a verdict.

Each round runs one job of 2 simulated nodes x 2 ranks on loopback (CPU, gloo): two `python -m ftrun`
agents, node 0 hosting the store and the controller (`--rdzv-conf is_host=1`), plus a third agent as a
spare node in the rounds that draw one (`--spares 1`), running tests/workers/elastic_train.py under
`--recovery process --heartbeat-timeout 4 --node-timeout 3`. A random.Random(seed) draws each round's
retry budget (`--max-restarts`: 3, or in some rounds one less than the faults need, so that it runs
out; never for a round with an alarm, which is seen a little after it is raised and may share a repair
with a fault that comes meanwhile) and 1 to 3 faults, each at a random step, from these kinds:

  sigkill, segv, exit1  a rank dies that way at the start of the step (FAULT=rank:step:kind in the
                        worker, FAULT_ONCE=1: once per job, whatever generation reaches the step)
  sigstop               a rank freezes (SIGSTOP) at the start of the step; --heartbeat-timeout finds it
  alarm                 once the rank has passed the step, its device turns Alarm in the stand-in
                        npu-smi (tests/fakes/npu-smi) with 80E01801, a RestartBusiness code: the rank
                        is repaired in place (the round's agents run with --device npu)
  repair                the replacement of a rank that another fault of the round kills dies right
                        after joining the repair (FAULT_REPLACEMENT)
  agent                 once training has passed the step, node 1's agent is SIGKILLed (its workers die
                        through its guardian); a spare takes its place, or without one the job fails
  rendezvous            node 1's agent is SIGKILLed during the rendezvous. With a spare: after it joined,
                        before the spare did (the rendezvous waits for the spare), and the spare is
                        started once it is dead. Without: before it joined, and node 0 waits for it
                        until --rdzv-timeout (10 s in these rounds)
  store-slow            once training has passed the step, node 0's agent (the store and the controller)
                        is SIGSTOPped for 1.5 s, under --node-timeout, then SIGCONTed
  store-lost            once training has passed the step, node 0's agent is SIGKILLed

Some rounds run under --rdzv-backend etcd instead, on a 3-member etcd cluster of their own on loopback
(scripts/etcd_cluster.py): node 0's agent starts first and takes the controller's office, so that it
hosts the control store, then node 1's and the spares' (each agent --local-addr 127.0.0.<2, 3, 4, 5>;
node 0 and node 1 keep their node ranks with --node-rank), each with an in-memory snapshot every
SNAPSHOT_EVERY steps. A round is one of these with a chance of ETCD_SHARE, drawn from a second
random.Random of the seed, so that the other rounds of a seed stay what they were; with --rdzv-backend
etcd every round is (--rdzv-backend c10d: none). Their faults: one or two of these (never both of node
0's), alone or, in two rounds of three, with a rank fault (sigkill, segv, exit1, sigstop; on node 1's
ranks when node 0 is lost) or a node fault (agent: node 1's agent SIGKILLed), a spare standing by for
each node lost. A quorum lost with a rank or node fault starts from 2 steps before it to 1 after it: the
fault strikes just before the outage, as it begins, or inside it.

  controller-lost       once training has passed the step, node 0's agent (the store and the controller)
                        is SIGKILLed: another agent takes the office over from the journal in etcd and a
                        spare takes node 0's place; the job must recover
  controller-stopped    once training has passed the step, node 0's agent alone (its ranks train on) is
                        SIGSTOPped past its lease, for one of CONTROLLER_STOPS seconds, then SIGCONTed.
                        Woken after another agent took the office, it must step down and leave (exit
                        non-zero, saying it steps down) while a spare takes node 0's place; woken before,
                        it takes its own office back and goes on
  etcd-member           once training has passed the step, one etcd member of three is SIGKILLed, and
                        started again ETCD_MEMBER_DOWN seconds later: no effect
  quorum-lost           once training has passed the step, two etcd members of three are SIGKILLed, and
                        started again on their data QUORUM_DOWN seconds later (past --node-timeout):
                        training goes on, decisions wait for etcd

The verdict of a round comes from the faults that were actually injected (a fault whose step never
comes, the job having ended, is not counted). The round must recover when none of them is terminal
(store-lost; more nodes lost, by agent, rendezvous, controller-lost or controller-stopped, than spares)
and the faults that spend the budget (sigkill, segv, exit1, sigstop, alarm; agent, rendezvous,
controller-lost and controller-stopped with a spare; a repair fault is part of the repair it hits;
etcd-member and quorum-lost spend nothing) number no more than --max-restarts. A recovered round has
every agent that the chaos did not kill exit 0 and every rank at the final step with the parameter
checksum of a fault-free run (one is run first); after controller-lost, another agent says it hosts the
control store. A recovered round under etcd also redid no more than SNAPSHOT_EVERY steps (unless it lost both
nodes: their snapshots go with them, each node's replicated on the other only), and none of its repairs
waited until its deadline (a repair_failed "did not finish within" in the event log: training
stood still for a minute). Any other round must fail cleanly: each agent still alive exits with the documented status
(3 for a rendezvous that never completed, else 1) and names the cause: node 0's end-of-job summary has
its "reason:" line and, after a rank's failure, a "root cause" that names the rank and the kind of the
first fault injected (SIGKILL, SIGSEGV, exit code 1, hang, device); or, where node 0 itself was lost
first, every other agent says "lost the controller". A round whose expectation is not met is "unexpected". A round
still running at --deadline is "hung": everything is killed. After the agents have exited, any process
that carries the round's marker (FTRUN_CHAOS_MARK) 10 s later is an orphan, counted and killed.

Work lost: the steps that were redone beyond the step in flight. The driver reads each rank's progress
file (OUT_DIR/progress-rank<r>: the steps it has committed) every 50 ms; each time the count goes down,
from n to m, n - m + 1 committed steps are being redone (a job-level restart from scratch at n = 8
redoes 8). A round's figure is the largest over its ranks; process-level repairs should cost 0. The
table also counts the process-level repairs that fell back to job level (repair_failed in node 0's
event log, <round>/logs/chaos<N>/events.jsonl).

    .venv/bin/python scripts/chaos.py --rounds 50 --seed 1
    .venv/bin/python scripts/chaos.py --rounds 20 --seed 1 --rdzv-backend etcd
    .venv/bin/python scripts/chaos.py --rounds 3 --seed 7 --json chaos.json --keep /tmp/chaos

The table goes to stderr, the JSON (every round and the totals) to --json. The exit status is 0 when
no round hung, none left an orphan and none was unexpected; 1 otherwise; 2 when a round under etcd
could not start its cluster (etcd not installed); 130 when interrupted (every process started has been
killed).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from benchlib import free_port, marked_processes
from etcd_cluster import EtcdCluster, EtcdUnavailable

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "workers" / "elastic_train.py"
FAKES = REPO / "tests" / "fakes"
MARK_VARIABLE = "FTRUN_CHAOS_MARK"

NODES, NPROC = 2, 2
#: the agents a round may start, in this order (a round under etcd that loses two nodes has two spares)
AGENT_NAMES = ("node0", "node1", "spare", "spare2")
WORLD = NODES * NPROC
STEPS = 16
STEP_SLEEP = 0.1
FIRST_FAULT_STEP, LAST_FAULT_STEP = 2, STEPS - 4
#: steps between two faults that each spend the budget, so that each gets a repair of its own
SPACING = 3
BUDGET = 3
HEARTBEAT_TIMEOUT, NODE_TIMEOUT = 4, 3
RENDEZVOUS_TIMEOUT = 10
STORE_PAUSE = 1.5
#: etcd-member: how long the member stays down
ETCD_MEMBER_DOWN = 2.0
#: quorum-lost: how long 2 members of 3 stay down: past --node-timeout (the controller's lease), as in
#: issue 40's outage
QUORUM_DOWN = 5.0
#: controller-stopped: how long node 0's agent stays SIGSTOPped, drawn: past its lease (--node-timeout, 3 s)
#: but before the other agents give its store up (5 s: ftrun/agent/control_plane.py's MIN_CALL_TIMEOUT), so
#: that it wakes to take its own office back; about as they do; or long after another agent took the office
CONTROLLER_STOPS = (4.0, 5.0, 8.0)
ETCD_MEMBERS = 3
#: the share of rounds that run under etcd with its kinds of fault (when --rdzv-backend is not given)
ETCD_SHARE = 0.15
#: rounds under etcd keep an in-memory snapshot every this many steps: a round must redo no more steps
#: than that, whatever level its repairs took
SNAPSHOT_EVERY = 2
#: a round still running after this many seconds is hung (a fault-free one takes 10 to 30 s)
DEADLINE = 240.0
#: after the agents exit, how long their workers and guardians may take to go
ORPHAN_GRACE = 10.0
POLL = 0.05
#: RestartBusiness: the rank is killed and respawned on the same device
ALARM_CODES = ["80E01801", "A4025021"]

RANK_KINDS = ("sigkill", "segv", "exit1", "sigstop")
#: what an agent says once it leads under etcd
TOOK_OFFICE = "hosting the control store"
#: the faults of the rounds under --rdzv-backend etcd
ETCD_KINDS = ("controller-lost", "controller-stopped", "etcd-member", "quorum-lost")
#: the etcd kinds that take node 0, which hosts the controller, away (never two in a round)
CONTROLLER_KINDS = ("controller-lost", "controller-stopped")
#: kinds that take a node away: each needs a spare to take its place, else the job fails
NODE_LOSING = ("agent", "rendezvous", *CONTROLLER_KINDS)
KINDS = (*RANK_KINDS, "alarm", "repair", "agent", "rendezvous", "store-slow", "store-lost", *ETCD_KINDS)
#: kinds that take a rank's process away (a repair fault needs one of them to hit)
RANK_FAILING = (*RANK_KINDS, "alarm")
#: how the summary describes the first failure, by the kind of fault that caused it
CAUSE_WORDS = {"sigkill": "SIGKILL", "segv": "SIGSEGV", "exit1": "exit code 1", "sigstop": "hang", "alarm": "device"}
#: drawn by weight, 1 to 3 distinct kinds a round (rendezvous: a round of its own, 1 in 10)
DRAWN = tuple(k for k in KINDS if k != "rendezvous" and k not in ETCD_KINDS)
WEIGHTS = {"store-lost": 0.7}
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


# --- what a round does: drawn from the seed -------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    kind: str
    #: the step at (FAULT) or after which (driver) it strikes; -1 for the rendezvous
    step: int
    #: the rank it hits (rank kinds, alarm, repair), else None
    rank: int | None = None
    #: etcd-member: the index of the member killed; quorum-lost: the one left running; else None
    member: int | None = None
    #: controller-stopped: the seconds node 0's agent stays stopped, else 0
    pause: float = 0.0

    def __str__(self) -> str:
        where = f" r{self.rank}" if self.rank is not None else f" m{self.member}" if self.member is not None else ""
        when = f" s{self.step}" if self.step >= 0 and self.kind != "repair" else ""
        return f"{self.kind}{where}{when}{f' {self.pause:g}s' if self.pause else ''}"

    def spends_budget(self, spares: int) -> bool:
        if self.kind in RANK_FAILING:
            return True
        return self.kind in NODE_LOSING and spares > 0

    def terminal(self, spares: int) -> bool:
        """Nothing can recover from it: ftrun must fail cleanly."""
        return self.kind == "store-lost" or (self.kind in NODE_LOSING and not spares)


@dataclass(frozen=True)
class Plan:
    number: int
    faults: tuple[Fault, ...]
    #: spare nodes standing by: 0, 1, or 2 in a round under etcd that loses node 0 and node 1
    spares: int
    max_restarts: int

    @property
    def etcd(self) -> bool:
        """The round runs under --rdzv-backend etcd, on a cluster of its own."""
        return any(f.kind in ETCD_KINDS for f in self.faults)

    def describe(self) -> str:
        spares = {0: "", 1: "; spare"}.get(self.spares, f"; {self.spares} spares")
        return f"{', '.join(map(str, self.faults))}; budget {self.max_restarts}{spares}{'; etcd' if self.etcd else ''}"


def draw_plan(rng: random.Random, number: int) -> Plan:
    """One round's faults, spare and budget. Kinds are distinct within a round; faults that spend the
    budget are SPACING steps apart (a rank fault stops training at its step until it is repaired, so the
    next one cannot strike during that repair); rank faults hit distinct ranks (a replacement is never
    hit again), on node 0 when node 1's agent is killed (its ranks' replacements are not originals)."""
    if rng.random() < 0.1:
        return Plan(number, (Fault("rendezvous", -1),), int(rng.random() < 0.5), BUDGET)
    while True:
        kinds = set()
        for _ in range(rng.choice((1, 2, 2, 3, 3))):
            kinds.add(rng.choices(DRAWN, weights=[WEIGHTS.get(k, 1.0) for k in DRAWN])[0])
        if "repair" in kinds and not kinds & set(RANK_FAILING):
            continue
        if "agent" in kinds and len(kinds & set(RANK_FAILING)) > 1:
            continue  # node 1 and both of node 0's ranks at once: no healthy replica could be left
        break
    kinds = sorted(kinds, key=KINDS.index)
    spare = rng.random() < (0.7 if "agent" in kinds else 0.3)
    ranks = [0, 1] if "agent" in kinds else [0, 1, 2, 3]
    rng.shuffle(ranks)
    spending = [k for k in kinds if k in RANK_FAILING or (k == "agent" and spare)]
    steps = spaced_steps(rng, len(spending))
    faults = []
    for kind in kinds:
        if kind in RANK_FAILING:
            faults.append(Fault(kind, steps.pop(), ranks.pop()))
        elif kind == "agent" and spare:
            faults.append(Fault(kind, steps.pop()))
        elif kind != "repair":
            faults.append(Fault(kind, rng.randint(FIRST_FAULT_STEP, LAST_FAULT_STEP)))
    if "repair" in kinds:
        target = rng.choice([f for f in faults if f.kind in RANK_FAILING])
        faults.append(Fault("repair", target.step, target.rank))
    faults.sort(key=lambda f: (f.step, f.kind))
    budget = BUDGET
    # An alarm is seen a poll or a few later, while training goes on: its repair may take in a fault
    # that comes meanwhile, spending one unit for both. A budget meant to run out needs faults that
    # each get a repair of their own.
    if spending and "alarm" not in kinds and rng.random() < 0.25:
        budget = len(spending) - 1  # the last of them finds the budget spent
    return Plan(number, tuple(faults), int(spare), budget)


def draw_etcd_plan(rng: random.Random, number: int) -> Plan:
    """A round under etcd: one of its kinds, or two (never both of node 0's), alone or, in two rounds of three,
    together with a rank fault or a node fault (node 1's agent SIGKILLed). Every node lost has a spare to
    take its place. Faults that spend the budget are SPACING steps apart, in either order; a rank fault in a
    round that loses node 0 hits node 1 (node 0's ranks go with it). A quorum lost with a rank or node
    fault starts within a step or two of it, so that the fault strikes just before the outage or inside it."""
    while True:
        kinds = set(rng.sample(ETCD_KINDS, rng.choice((1, 1, 2))))
        if not kinds >= set(CONTROLLER_KINDS):
            break
    companion = rng.choice((None, "rank", "node"))
    if companion == "rank":
        kinds.add(rng.choice(RANK_KINDS))
    elif companion == "node":
        kinds.add("agent")
    kinds = sorted(kinds, key=KINDS.index)
    lost = bool(set(kinds) & set(CONTROLLER_KINDS))
    spares = sum(k in NODE_LOSING for k in kinds) or int(rng.random() < 0.3)
    spending = [k for k in kinds if k in RANK_KINDS or k in NODE_LOSING]
    steps = spaced_steps(rng, len(spending))
    rng.shuffle(steps)  # the rank or node fault before node 0's loss, or after it
    faults = []
    for kind in kinds:
        if kind in RANK_KINDS:
            faults.append(Fault(kind, steps.pop(), rng.choice([2, 3] if lost else [0, 1, 2, 3])))
        elif kind == "controller-stopped":
            faults.append(Fault(kind, steps.pop(), pause=rng.choice(CONTROLLER_STOPS)))
        elif kind in NODE_LOSING:
            faults.append(Fault(kind, steps.pop()))
    for kind in kinds:
        if kind == "quorum-lost" and companion is not None:
            near = next(f.step for f in faults if f.kind in (*RANK_KINDS, "agent"))
            step = min(max(near - rng.randint(-1, 2), FIRST_FAULT_STEP), LAST_FAULT_STEP)
            faults.append(Fault(kind, step, member=rng.randrange(ETCD_MEMBERS)))
        elif kind in ("etcd-member", "quorum-lost"):
            faults.append(Fault(kind, rng.randint(FIRST_FAULT_STEP, LAST_FAULT_STEP), member=rng.randrange(ETCD_MEMBERS)))
    faults.sort(key=lambda f: (f.step, f.kind))
    return Plan(number, tuple(faults), spares, BUDGET)


def draw_plans(rounds: int, seed: int, backend: str | None = None) -> list[Plan]:
    """The rounds of a seed. Without a ``backend``: draw_plan's, ETCD_SHARE of them replaced by
    draw_etcd_plan's, which come from a random.Random of their own, so that the other rounds are the ones the
    seed always gave. With "c10d": draw_plan's only; with "etcd": draw_etcd_plan's only."""
    rng, etcd_rng = random.Random(seed), random.Random(f"etcd {seed}")
    if backend == "etcd":
        return [draw_etcd_plan(rng, number) for number in range(1, rounds + 1)]
    plans = []
    for number in range(1, rounds + 1):
        plan = draw_plan(rng, number)
        under_etcd = backend is None and etcd_rng.random() < ETCD_SHARE
        plans.append(draw_etcd_plan(etcd_rng, number) if under_etcd else plan)
    return plans


def spaced_steps(rng: random.Random, count: int) -> list[int]:
    while True:
        steps = sorted(rng.randint(FIRST_FAULT_STEP, LAST_FAULT_STEP) for _ in range(count))
        if all(b - a >= SPACING for a, b in itertools.pairwise(steps)):
            return steps


# --- one round's processes ----------------------------------------------------------------------------


def marked(mark: str) -> list[psutil.Process]:
    return marked_processes(MARK_VARIABLE, mark)


def kill_marked(mark: str) -> None:
    procs = marked(mark)
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@dataclass
class Agent:
    name: str  # node0, node1, spare, spare2
    proc: subprocess.Popen
    log: Path
    killed: bool = False  # by the chaos: its exit status means nothing
    #: SIGSTOPped past its lease as it led (controller-stopped)
    stopped: bool = False

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


class NpuState:
    """A node's stand-in npu-smi state file (tests/fakes/npu-smi): 2 healthy devices until told."""

    def __init__(self, path: Path):
        self.path = path
        self.state = {"board": "A2", "mode": "normal", "version": "24.1.0", "npus": [
            {"id": i, "name": "910B2", "chips": [{"id": 0, "logic_id": i, "health": "OK", "codes": [], "info": []}]}
            for i in range(NPROC)
        ]}
        self.write()

    def alarm(self, device: int) -> None:
        self.state["npus"][device]["chips"][0].update(health="Alarm", codes=ALARM_CODES,
                                                       info=["on-chip memory uncorrectable error"])
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


class Progress:
    """Each rank's committed steps, read from its progress file; the steps redone (see the docstring)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.last = [0] * WORLD
        self.redone = [0] * WORLD

    def read(self) -> None:
        for rank in range(WORLD):
            try:
                value = int((self.out_dir / f"progress-rank{rank}").read_text())
            except (OSError, ValueError):
                continue  # not yet written, or being rewritten
            if value < self.last[rank]:
                self.redone[rank] += self.last[rank] - value + 1
            self.last[rank] = value

    def passed(self, step: int, ranks=range(WORLD)) -> bool:
        return max(self.last[r] for r in ranks) > step


@dataclass
class RoundResult:
    number: int
    plan: str
    spares: int
    max_restarts: int
    injected: list[str] = field(default_factory=list)
    expected: str = ""  # recover, fail
    outcome: str = ""  # recovered, failed cleanly, unexpected, hung
    why: str = ""  # what was unexpected
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    orphans: int = 0
    steps_redone: int = 0
    #: process-level repairs that fell back to job level (the event log's repair_failed)
    fallbacks: int = 0
    seconds: float = 0.0
    folder: str = ""


class Round:
    """Starts one round's agents, injects its faults, waits with a deadline, judges, and cleans up."""

    def __init__(self, plan: Plan, folder: Path, checksum: float | None, deadline: float, reference: bool = False):
        self.plan = plan
        #: the fault-free run: no step sleep (the checksum does not depend on it)
        self.reference = reference
        self.folder = folder
        self.checksum = checksum
        self.deadline = deadline
        self.mark = uuid.uuid4().hex
        self.out_dir = folder / "out"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, Agent] = {}
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.kinds = {f.kind for f in plan.faults}
        self.device = "alarm" in self.kinds
        self.npu = {name: NpuState(folder / f"npu-{name}.json") for name in AGENT_NAMES} if self.device else {}
        self.progress = Progress(self.out_dir)
        self.fired: list[Fault] = []
        self.rendezvous_before_join = False
        self.resume_at: float | None = None  # store-slow, controller-stopped: when to SIGCONT node 0's agent
        #: the round's etcd cluster (rounds under etcd), started with the agents
        self.etcd: EtcdCluster | None = None
        #: etcd-member, quorum-lost: the members killed, and when to start each again (the later time where
        #: both kinds kill one)
        self.revive_at: dict[int, float] = {}
        #: under etcd: whether node 0 took the controller's office before the others started
        self.node0_led = True

    # -- starting agents --

    def env(self, name: str) -> dict[str, str]:
        env = dict(os.environ, **{MARK_VARIABLE: self.mark}, OUT_DIR=str(self.out_dir), PYTHONUNBUFFERED="1",
                   STEPS=str(STEPS), STEP_SLEEP="0" if self.reference else str(STEP_SLEEP), FAULT_ONCE="1",
                   OMP_NUM_THREADS="1")
        env.pop("PET_NNODES", None)
        rank_faults = [f"{f.rank}:{f.step}:{f.kind}" for f in self.plan.faults if f.kind in RANK_KINDS]
        if rank_faults:
            env["FAULT"] = ",".join(rank_faults)
        repair = next((f for f in self.plan.faults if f.kind == "repair"), None)
        if repair is not None:
            env["FAULT_REPLACEMENT"] = str(repair.rank)
        if self.device:
            # this interpreter's folder too: the stand-in's `#!/usr/bin/env python3` finds it without a shim
            env["PATH"] = os.pathsep.join([str(FAKES), str(Path(sys.executable).parent), env.get("PATH", "")])
            env["NPU_SMI_STATE"] = str(self.npu[name].path)
        return env

    def start(self, name: str) -> Agent:
        spares = self.plan.spares
        endpoint = self.endpoint if self.etcd is None else self.etcd.endpoints
        args = ["--nnodes", str(NODES), "--nproc-per-node", str(NPROC), "--rdzv-endpoint", endpoint,
                "--run-id", f"chaos{self.plan.number}", "--monitor-interval", "0.05", "--recovery", "process",
                "--max-restarts", str(self.plan.max_restarts), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                "--node-timeout", str(NODE_TIMEOUT), "--spares", str(spares), "--log-dir", str(self.folder / "logs")]
        if "rendezvous" in self.kinds:
            args += ["--rdzv-timeout", str(RENDEZVOUS_TIMEOUT)]
        if self.device:
            args += ["--device", "npu", "--health-interval", "0.2"]
        if self.etcd is not None:  # every agent a candidate for the office; node 0 leads by starting first
            args += ["--rdzv-backend", "etcd", "--local-addr", f"127.0.0.{AGENT_NAMES.index(name) + 2}",
                     "--snapshot-every", str(SNAPSHOT_EVERY), "--snapshot-memory", "64M"]
            if name in ("node0", "node1"):  # node 1 is node 1 (the node fault's), not whichever spare came first
                args += ["--node-rank", name[-1]]
        elif name == "node0":
            args += ["--node-rank", "0", "--rdzv-conf", "is_host=1"]
        elif name == "node1":
            args += ["--node-rank", "1", "--rdzv-conf", "is_host=0"]
        else:
            args += ["--rdzv-conf", "is_host=0"]
        log = self.folder / f"{name}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "ftrun", *args, str(WORKER)], stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT, env=self.env(name), cwd=self.folder,
                                    start_new_session=True)
        self.agents[name] = agent = Agent(name, proc, log)
        return agent

    def wait_for_line(self, agent: Agent, text: str, timeout: float) -> bool:
        until = time.monotonic() + timeout
        while time.monotonic() < until and agent.proc.poll() is None:
            if text in agent.output:
                return True
            time.sleep(POLL)
        return text in agent.output

    def start_all(self) -> None:
        if self.plan.etcd:
            self.etcd = EtcdCluster.start(self.folder / "etcd", ETCD_MEMBERS)
            node0 = self.start("node0")
            self.node0_led = self.wait_for_line(node0, TOOK_OFFICE, 60)
            for name in AGENT_NAMES[1:NODES + self.plan.spares]:
                self.start(name)
            return
        if "rendezvous" not in self.kinds:
            for name in AGENT_NAMES[:NODES + self.plan.spares]:
                self.start(name)
            return
        node0 = self.start("node0")
        self.wait_for_line(node0, "joined the store", 60)
        node1 = self.start("node1")
        if self.plan.spares:
            # the rendezvous waits for the third agent: node 1 dies in it, after it joined
            self.wait_for_line(node1, "joined the store", 60)
            time.sleep(0.3)
            self.kill(node1)
            self.start("spare")
        else:
            time.sleep(0.3)  # still importing: it dies before it joins
            self.kill(node1)
            self.rendezvous_before_join = "joined the store" not in node1.output
        self.fired.append(Fault("rendezvous", -1))

    def kill(self, agent: Agent) -> None:
        agent.killed = True
        try:
            agent.proc.kill()
        except ProcessLookupError:
            pass
        agent.proc.wait()

    # -- the driver's faults --

    def inject_due(self) -> None:
        for fault in self.plan.faults:
            if fault in self.fired or fault.kind in (*RANK_KINDS, "repair", "rendezvous"):
                continue
            if fault.kind in ("etcd-member", "quorum-lost") and self.etcd is not None:
                if self.progress.passed(fault.step):
                    members = [fault.member] if fault.kind == "etcd-member" else \
                        [m for m in range(ETCD_MEMBERS) if m != fault.member]
                    for member in members:
                        self.etcd.kill(member)
                    down = ETCD_MEMBER_DOWN if fault.kind == "etcd-member" else QUORUM_DOWN
                    for member in members:
                        self.revive_at[member] = max(self.revive_at.get(member, 0.0), time.monotonic() + down)
                    self.fired.append(fault)
                continue
            if fault.kind == "alarm":
                if self.progress.passed(fault.step, [fault.rank]):
                    self.npu[f"node{fault.rank // NPROC}"].alarm(fault.rank % NPROC)
                    self.fired.append(fault)
                continue
            if not self.progress.passed(fault.step):
                continue
            node0, node1 = self.agents["node0"], self.agents.get("node1")
            if fault.kind == "agent" and node1 is not None and node1.proc.poll() is None:
                self.kill(node1)
                self.fired.append(fault)
            elif fault.kind in ("store-slow", "controller-stopped") and node0.proc.poll() is None:
                node0.proc.send_signal(signal.SIGSTOP)  # the agent alone: its ranks train on
                node0.stopped = fault.kind == "controller-stopped"
                self.resume_at = time.monotonic() + (fault.pause or STORE_PAUSE)
                self.fired.append(fault)
            elif fault.kind in ("store-lost", "controller-lost") and node0.proc.poll() is None:
                self.kill(node0)
                self.fired.append(fault)
        if self.resume_at is not None and time.monotonic() >= self.resume_at:
            self.resume_at = None
            if self.agents["node0"].proc.poll() is None:
                self.agents["node0"].proc.send_signal(signal.SIGCONT)
        for member, at in list(self.revive_at.items()):
            if time.monotonic() >= at and self.etcd is not None:
                self.etcd.revive(member)
                del self.revive_at[member]

    def injected(self) -> list[Fault]:
        """Every fault that struck: the driver's, and the workers' by their marker files."""
        found = list(self.fired)
        for fault in self.plan.faults:
            if fault.kind in RANK_KINDS and (self.out_dir / f"fault-fired-rank{fault.rank}-step{fault.step}").exists():
                found.append(fault)
            if fault.kind == "repair" and (self.out_dir / f"replacement-fault-{fault.rank}").exists():
                found.append(fault)
        return sorted(found, key=lambda f: (f.step, f.kind))

    # -- the round --

    def run(self) -> RoundResult:
        started = time.monotonic()
        result = RoundResult(self.plan.number, self.plan.describe(), self.plan.spares, self.plan.max_restarts,
                             folder=str(self.folder))
        try:
            self.start_all()
            hung = not self.supervise(started + self.deadline)
            if hung:
                kill_marked(self.mark)
            else:
                result.orphans = self.count_orphans()
        finally:
            self.cleanup()
        injected = self.injected()
        result.injected = [f.kind for f in injected]
        result.exit_codes = {name: (None if a.killed else a.proc.returncode) for name, a in self.agents.items()}
        result.steps_redone = max(self.progress.redone)
        result.fallbacks = sum(1 for e in self.events() if e.get("kind") == "repair_failed")
        result.seconds = round(time.monotonic() - started, 1)
        result.expected = self.expectation(injected)
        if hung:
            result.outcome, result.why = "hung", f"still running after {self.deadline:g}s"
        else:
            result.why = self.judge(result.expected, injected)
            result.outcome = "unexpected" if result.why else (
                "recovered" if result.expected == "recover" else "failed cleanly")
        return result

    def supervise(self, deadline: float) -> bool:
        """Inject the driver's faults until every agent has exited; False at the deadline."""
        while time.monotonic() < deadline:
            self.progress.read()
            self.inject_due()
            if all(a.proc.poll() is not None for a in self.agents.values()):
                self.progress.read()
                return True
            time.sleep(POLL)
        return False

    def count_orphans(self) -> int:
        until = time.monotonic() + ORPHAN_GRACE
        left = marked(self.mark)
        while left and time.monotonic() < until:
            time.sleep(0.2)
            left = marked(self.mark)
        if left:
            (self.folder / "orphans.txt").write_text("".join(f"{p.pid} {cmdline(p)}\n" for p in left))
        kill_marked(self.mark)
        return len(left)

    def cleanup(self) -> None:
        for agent in self.agents.values():
            if agent.proc.poll() is None:
                try:
                    os.killpg(agent.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                agent.proc.wait()
        kill_marked(self.mark)
        if self.etcd is not None:
            self.etcd.stop()

    def events(self) -> list[dict]:
        """The controller's event log, when node 0 lived to write it."""
        path = self.folder / "logs" / f"chaos{self.plan.number}" / "events.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except ValueError:
                continue  # cut short by a kill
        return events

    # -- the verdict --

    def expectation(self, injected: list[Fault]) -> str:
        spares = self.plan.spares
        if any(f.terminal(spares) for f in injected) or sum(f.kind in NODE_LOSING for f in injected) > spares:
            return "fail"
        spent = sum(f.spends_budget(spares) for f in injected)
        return "recover" if spent <= self.plan.max_restarts else "fail"

    def judge(self, expected: str, injected: list[Fault]) -> str:
        """What did not go as expected, or ""."""
        if not self.node0_led:
            return "node 0 did not take the controller's office before the others started"
        node0 = self.agents["node0"]
        moved = any(TOOK_OFFICE in a.output for name, a in self.agents.items() if name != "node0")
        if any(f.kind == "controller-lost" for f in injected) and not moved:
            return "no other agent took the controller's office over"
        if node0.stopped and moved and (node0.proc.returncode == 0 or "steps down" not in node0.output):
            return (f"node 0's agent, woken after another took its office, did not step down and leave "
                    f"(exit {node0.proc.returncode})")
        # a controller woken before another agent took its office keeps it (its exit status counts); one woken
        # after steps down and leaves (its exit status is not the job's)
        alive = {name: a for name, a in self.agents.items() if not a.killed and not (a.stopped and moved)}
        codes = {name: a.proc.returncode for name, a in alive.items()}
        if expected == "recover":
            if any(code != 0 for code in codes.values()):
                return f"should have recovered; exit codes {codes}"
            # both nodes lost take every in-memory snapshot with them (each node's are replicated on the other,
            # none on the spares): their restart may go back further
            both_lost = sum(f.kind in NODE_LOSING for f in injected) >= NODES
            if self.plan.etcd and not both_lost and max(self.progress.redone) > SNAPSHOT_EVERY:
                return f"recovered, but redid {max(self.progress.redone)} steps, beyond the snapshot interval ({SNAPSHOT_EVERY})"
            stuck = next((e["detail"] for e in self.events() if e.get("kind") == "repair_failed"
                          and "did not finish within" in e.get("detail", "")), "")
            if self.plan.etcd and stuck:  # training stood still for the whole repair deadline
                return f"recovered, but a repair waited until its deadline: {stuck}"
            results = {}
            for rank in range(WORLD):
                try:
                    results[rank] = json.loads((self.out_dir / f"rank{rank}.json").read_text())
                except (OSError, ValueError):
                    return f"recovered, but rank {rank} wrote no result"
            steps = {r["step"] for r in results.values()}
            if steps != {STEPS}:
                return f"recovered, but the ranks ended at steps {sorted(steps)}, not {STEPS}"
            sums = {r["checksum"] for r in results.values()}
            if self.checksum is not None and sums != {self.checksum}:
                return f"recovered, but checksums {sorted(sums)} differ from the fault-free {self.checksum}"
            return ""
        # a clean failure: the documented status, and the cause named
        wanted = 3 if self.rendezvous_never_completed(injected) else 1
        if any(code != wanted for code in codes.values()):
            return f"should have failed with exit {wanted}; exit codes {codes}"
        return self.cause_unnamed(injected, alive)

    def rendezvous_never_completed(self, injected: list[Fault]) -> bool:
        return any(f.kind == "rendezvous" for f in injected) and not self.plan.spares and self.rendezvous_before_join

    def cause_unnamed(self, injected: list[Fault], alive: dict[str, Agent]) -> str:
        """Why the failure's cause is not named as documented, or ""."""
        node0 = self.agents["node0"]
        if self.rendezvous_never_completed(injected):
            return "" if "rendezvous timed out" in node0.output else "node 0 does not say the rendezvous timed out"
        if "node0" not in alive and "reason:" not in node0.output:
            # node 0 and the store went before it could sum up: every other agent says so
            silent = [name for name, agent in alive.items() if "lost the controller" not in agent.output]
            return f"{', '.join(silent)} did not say it lost the controller" if silent else ""
        lines = node0.output.splitlines()
        if not any(line.startswith("ftrun: reason: ") for line in lines):
            return "node 0's summary has no reason line"
        first = next((f for f in injected if f.kind in RANK_FAILING), None)
        if first is None:
            return ""
        try:
            cause = lines[lines.index("ftrun: root cause (first failure):") + 1]
        except (ValueError, IndexError):
            return "node 0's summary names no root cause"
        if not cause.startswith(f"ftrun:   rank {first.rank} ") or CAUSE_WORDS[first.kind] not in cause:
            return f"the root cause is not the first fault ({first}): {cause.strip()}"
        return ""


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return "?"


# --- many rounds -------------------------------------------------------------------------------------


def fault_free_checksum(root: Path, deadline: float) -> float:
    """The parameters every recovered round must end with, from a round without faults."""
    result = Round(Plan(0, (), 0, BUDGET), root / "fault-free", None, deadline, reference=True)
    outcome = result.run()
    if outcome.outcome != "recovered":
        raise RuntimeError(f"the fault-free run did not finish: {outcome.why} (logs in {outcome.folder})")
    return json.loads((result.out_dir / "rank0.json").read_text())["checksum"]


def run_rounds(rounds: int, seed: int, root: Path, deadline: float = DEADLINE, report=None,
               fixed: tuple[Plan, ...] = (), backend: str | None = None) -> list[RoundResult]:
    """Draw and run ``rounds`` rounds from ``seed`` (under ``backend``: see draw_plans) in folders under
    ``root``, then the ``fixed`` plans (a test's rounds of its own); ``report(result)`` after each."""
    plans = [*draw_plans(rounds, seed, backend), *fixed]
    checksum = fault_free_checksum(root, deadline)
    results = []
    for plan in plans:
        result = Round(plan, root / f"round{plan.number:03d}", checksum, deadline).run()
        results.append(result)
        if report is not None:
            report(result)
    return results


def totals(results: list[RoundResult]) -> dict:
    outcomes = collections.Counter(r.outcome for r in results)
    by_kind = collections.Counter(kind for r in results for kind in r.injected)
    return {
        "rounds": len(results),
        "faults_injected": sum(by_kind.values()),
        "faults_by_kind": {kind: by_kind.get(kind, 0) for kind in KINDS},
        "recovered": outcomes["recovered"],
        "failed_cleanly": outcomes["failed cleanly"],
        "unexpected": outcomes["unexpected"],
        "hung": outcomes["hung"],
        "orphans": sum(r.orphans for r in results),
        "steps_redone": sum(r.steps_redone for r in results),
        "fallbacks": sum(r.fallbacks for r in results),
        "recoverable": sum(1 for r in results if r.expected == "recover"),
    }


def print_round(result: RoundResult) -> None:
    colour = {"recovered": "green", "failed cleanly": "cyan"}.get(result.outcome, "red")
    codes = " ".join(f"{name}={'killed' if code is None else code}" for name, code in result.exit_codes.items())
    line = (f"round {result.number:3d}  {result.plan}  ->  [{colour}]{result.outcome}[/]  ({codes}; "
            f"injected: {', '.join(result.injected) or 'none'}; redone {result.steps_redone}; "
            f"fallbacks {result.fallbacks}; {result.seconds:.1f}s")
    if result.orphans:
        line += f"; [red]{result.orphans} orphans[/]"
    console.print(line + ")")
    if result.why:
        console.print(f"          {result.why}  (logs: {result.folder})")


def print_table(summary: dict) -> None:
    table = Table(title="ftrun chaos")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("rounds", str(summary["rounds"]))
    table.add_row("faults injected", str(summary["faults_injected"]))
    for kind, count in summary["faults_by_kind"].items():
        table.add_row(f"  {kind}", str(count))
    table.add_row("recovered", f"{summary['recovered']} of {summary['recoverable']} recoverable")
    table.add_row("failed cleanly", str(summary["failed_cleanly"]))
    table.add_row("unexpected", str(summary["unexpected"]))
    table.add_row("hung (must be 0)", str(summary["hung"]))
    table.add_row("orphans (must be 0)", str(summary["orphans"]))
    table.add_row("work lost (steps redone)", str(summary["steps_redone"]))
    table.add_row("process-level repairs fallen back to job level", str(summary["fallbacks"]))
    console.print(table)


def interrupted(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds to run (after one fault-free run)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws: the same seed, the same rounds")
    parser.add_argument("--rdzv-backend", choices=("c10d", "etcd"),
                        help="every round on this control plane, with its faults (default: c10d, about one round "
                             "in seven under etcd)")
    parser.add_argument("--deadline", type=float, default=DEADLINE, help="seconds a round may run before it counts as hung")
    parser.add_argument("--json", type=Path, help="write every round and the totals here")
    parser.add_argument("--keep", type=Path, help="keep the rounds' logs and files in this folder")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    root = args.keep or Path(tempfile.mkdtemp(prefix="ftrun-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    backend = f", --rdzv-backend {args.rdzv_backend}" if args.rdzv_backend else ""
    console.print(f"ftrun chaos: {args.rounds} rounds, seed {args.seed}{backend}, files in {root}")
    try:
        results = run_rounds(args.rounds, args.seed, root, args.deadline, print_round, backend=args.rdzv_backend)
    except KeyboardInterrupt:
        console.print("interrupted: every process started has been killed")
        return 130
    except EtcdUnavailable as e:  # a round under etcd needs one (scripts/test.sh installs it as root)
        console.print(f"ftrun chaos: a round under etcd could not start its cluster: {e}")
        return 2
    summary = totals(results)
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "rdzv_backend": args.rdzv_backend, "totals": summary,
                                         "rounds": [asdict(r) for r in results]}, indent=2))
    ok = summary["hung"] == 0 and summary["orphans"] == 0 and summary["unexpected"] == 0
    if args.keep is None:
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            console.print(f"logs kept in {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
