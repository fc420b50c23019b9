"""How fast does a launcher get a DDP job going again after one rank dies?

Runs the reference job (scripts/examples/train_ddp.py: CPU, gloo, a 16 MB MLP, a checkpoint every
--ckpt-every steps) as --nnodes simulated nodes of --nproc-per-node ranks on loopback, one launcher
process per "node", and has one rank SIGKILL itself after step --kill-at-step. It does this under each
launcher in turn, on the same machine:

  torchrun           torchrun --rdzv-backend c10d, defaults (workers share the agent's store)
  torchrun-noshare   the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  ftrun              ftrun --recovery job
  ftrun-process      ftrun --recovery process, running scripts/examples/train_ddp_elastic.py (the same
                     job written with ftrun.elastic): only the killed rank is replaced

Every rank appends "<time> <rank> <step> <pid> <restart count>" to a progress file after each step.
From it, per launcher:

  regain progress    seconds from the fault (the killed rank's line for the kill step, written just
                     before it kills itself) until every rank has finished a step past the kill step
  steps redone       the kill step minus the step the job went on after: one before the first step that
                     a rank finished a second time or that a new process (a restart, a replacement)
                     finished; 0 when a replacement picks up at the step after the kill step
  healthy pids kept  yes when every rank but the killed one ran in one process from start to end
  median step        median time between rank 0's steps before the fault (steady state); below the
                     table, each ftrun row's as a ratio to torchrun-noshare's
  launch to step 1   seconds from starting the launchers to the first finished step
  outcome            ok, failed (exit codes), or hung (still running at --deadline, then killed)

    .venv/bin/python scripts/bench_recovery.py --launchers torchrun-noshare,ftrun,ftrun-process --json results.json

With --scaling 2,4,8 it runs, for each N in the list, N nodes of 1 rank each and kills the last rank,
then adds a table of regain-progress seconds by N for each launcher, with the spread (max / min) across
N: repairing one rank should not take longer on a bigger job. A second table divides each time by the
run's own median step: where the machine has fewer cores than N ranks need, the contention that slows
every step as N grows divides out (the flat-scaling goal itself is on seconds, on enough cores). This
mode has its own defaults (fewer steps, a step sleep so that many workers on few cores are not starved,
a longer deadline):

    .venv/bin/python scripts/bench_recovery.py --scaling 2,4,8

With --node-loss 2,4,8 it loses a whole node instead: for each N, N nodes of 1 rank each train, and once
every rank has finished --kill-at-step the benchmark SIGKILLs the last node's launcher with everything under
it (the agent and its rank, as when a host dies). ftrun runs with one spare node (--spares 1, one more
launcher process standing by) and --node-timeout --node-timeout seconds; torchrun has no spare, so its
other nodes wait for the lost one to come back, which no one does: after --regain-deadline seconds without
training past the pre-fault step the run stops and counts as "fails (restart by hand)". The fault's time is
the kill; the pre-fault step is the highest step any rank had finished by then.

    .venv/bin/python scripts/bench_recovery.py --node-loss 2,4,8

With --layouts ddp,torch-ddp,fsdp,hsdp,tp,pp,hf,lightning,deepspeed,hf-deepspeed,all-lost (or all; link-cut and
start: below) it
gives a row per way of laying a model out, each at --nnodes x --nproc-per-node (2 x 2): the layout's example script
(train_ddp_elastic.py, --torch-ddp; train_fsdp_elastic.py --layout fsdp|hsdp; train_tp_elastic.py --layout tp|pp;
hf: a Hugging Face Trainer, train_hf_trainer.py, lightning: train_lightning.py, deepspeed: ZeRO-2,
train_deepspeed.py, and hf-deepspeed: the Trainer through DeepSpeed ZeRO-2, train_hf_trainer.py --zero 2, these two
with --snapshot-every 1, which need transformers and accelerate, lightning, or deepspeed, on
PYTHONPATH, else the row is skipped) runs under
torchrun-noshare, which restarts it from its disk checkpoint, and under ftrun --recovery process (FSDP's full
shard with --snapshot-every K, --snapshot-every; no replica holds its shard), one rank SIGKILLed after
--kill-at-step. Per row: regain progress of each and ftrun's over torchrun's (goal <= 0.1x), steps redone
(goal 0; <= K from snapshots), and the median step of each before the fault, leaving out the first --warmup
seconds (5: the ranks' own first steps), and ftrun's over torchrun's (goal
<= 1.03x); the fault comes after step 135 here, for a window of steady steps; for pure DP also job.ddp()
under ftrun over torch DDP (train_ddp.py) under torchrun. The
all-lost row has every rank SIGKILL itself at once (goal: regain <= 0.7x torchrun's, steps redone <= K);
all-lost-staggered has the last rank die first and the others one by one over the next --kill-stagger
seconds (rank 0 last), while ftrun's process-level repair of the first deaths is under way (same goals).
ftrun's phase breakdown of each repair (its "... s after the fault (detect .., stop .., ...)" line) follows
the table. --repeat N alternates N runs of each (every other repeat the other launcher first) and reports
medians: the step-time goal is finer than the noise of one run on a busy machine.

    .venv/bin/python scripts/bench_recovery.py --layouts all --repeat 2 --json layouts.json

The link-cut row is the online level's: pure DP (train_ddp_elastic.py, job.ddp()) at 1 node x 4 ranks, and
once every rank has finished --kill-at-step the benchmark resets every TCP connection between rank 1's
process and the other ranks' (ss -K, one connection at a time; a connection to anything else stays, such
as ftrun's control store; torchrun-noshare's workers' store lives in rank 0's process, so rank 1's
connection to it goes too), while every process lives. ftrun --recovery process re-forms the groups in
place; under torchrun-noshare the ranks fail and it restarts every worker from the disk checkpoint. Per
launcher: the stand-still (the longest time from the first reset on in which the highest step finished by
every rank did not move: the step in flight at the cut may still finish, so regain progress's measure
would stop at once), the processes started after the cut (any process carrying the run's marker, standbys
included), steps redone, and whether the final checkpoint (rank 0's model and optimizer at the last step)
is bit-identical to that of a fault-free run of the same launcher, run once before the repeats; then
ftrun's over torchrun's. Goal: ftrun stands still at most 1.0 s, starts no process, ends bit-identical. It
needs root and ss (iproute2); without them the row says so and is skipped.

    .venv/bin/python scripts/bench_recovery.py --layouts link-cut --repeat 3

The start row measures what a job pays before it trains: train_ddp_elastic.py (job.ddp()) at 1 node x 4
ranks, no fault, a short run, under torchrun-noshare and under ftrun --recovery process with its defaults
(its ranks forked from each node's warm interpreter), alternating; per launcher the seconds from starting it to the first finished
step, and ftrun's over torchrun's in each repeat (the two runs side by side) and of the medians. Goal:
ftrun's at most 1.1x torchrun's (a standby's torch import beside the ranks' own start once made it 1.9x).

    .venv/bin/python scripts/bench_recovery.py --layouts start --repeat 3

With --controller-loss it loses the node that hosts the control store and the controller (node 0's
launcher with everything under it, SIGKILLed once every rank has finished --kill-at-step) in a job of
--nnodes x --nproc-per-node (2 x 2) with one spare node, running train_ddp_elastic.py under ftrun
--recovery process and --node-timeout, twice in the same run: under c10d, ftrun's default, where the
store goes with its node and the job ends (its outcome and exit codes, and the agents' "lost the
controller" lines, are the row's finding), and under --rdzv-backend etcd, on a 3-member etcd cluster on
loopback (scripts/etcd_cluster.py) that the benchmark starts for the run: node 0's launcher starts first
and takes the controller's office, then the others; when node 0 goes, another agent takes the office
over and the spare takes node 0's place. Its regain progress is the row's figure (goal: <= --node-timeout
+ 1 s).

    .venv/bin/python scripts/bench_recovery.py --controller-loss --node-timeout 3

With --mindspore it gives the MindSpore row: scripts/examples/train_mindspore.py (the same script, the same
run) on 1 node x --nproc-per-node workers, one rank SIGKILLed after --kill-at-step (28), under ftrun
--framework mindspore --snapshot-every K (job level, resumed from the in-memory snapshots: ftrun.mindspore_elastic)
and under msrun, which has no restart: msrun runs until it exits (or --deadline), then the benchmark runs it
again, and the script resumes from its own checkpoint (every --ckpt-every steps). Per launcher: regain
progress (from the fault until every rank finished a step past it, msrun's exit and re-run included) and
steps redone; then ftrun's regain over msrun's (goal <= 0.5x). MindSpore comes from --ms-python (default
.msvenv/bin/python), msrun from beside it:

    .venv/bin/python scripts/bench_recovery.py --mindspore

With --status-overhead N it measures what the status view and the event log cost the training loop:
N runs each, alternating, of ftrun --recovery process with --status off (no view, no event log) and with
--status live (the view drawn twice a second into the log, as on a terminal) and --log-dir (events.jsonl),
and compares their median steps before the fault (goal: under 1% apart):

    .venv/bin/python scripts/bench_recovery.py --status-overhead 3

With --dark-link it gives the dark data link's rows (issue 50), measured by scripts/bench_dark_link.py on the
cluster-shaped test bed (tests/cluster.py; needs root): 2 nodes x 2 ranks, node 1's data port dark at step
10; ftrun with no spare (the link back after --dark-for seconds, 20 by default), with a spare (never back), a
silent link (carrier up, packets dropped), torchrun (back after --dark-for), ftrun with no spare, never
back (--repair-timeout 8: the job waits, then ends; with --nnodes 1:2 it leaves node 1 out), and a silent link
with a spare (never back); each ftrun row held to the issue's goals (said within 5 s; with a spare on within
5 s of the dark; without, on within 3 s of the return, no process started; bit-identical; never back: ended
within 5 s of --repair-timeout, non-zero, or left out within 3 s of it and on to the last step; no process left
behind):

    .venv/bin/python scripts/bench_recovery.py --dark-link --json dark_link.json

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default); the exit status is
0 once every launcher has been measured, whatever its outcome (130 if interrupted). Every process it
starts carries a marker in its environment; on the way out (also on Ctrl-C) it kills the launchers'
process groups and every marked process left, since launchers put their workers in sessions of their own.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import psutil
from rich.console import Console
from rich.table import Table

from benchlib import find_program, free_port, kill_everything, marked_processes
from etcd_cluster import EtcdCluster

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "scripts" / "examples"
MARKER_VARIABLE = "FTRUN_BENCH_RECOVERY_MARKER"
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)  # a log gets the table unwrapped


@dataclass(frozen=True)
class Launcher:
    name: str
    description: str
    program: str  # an executable next to this Python's, or on PATH
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...] = ()
    script: Path = EXAMPLES / "train_ddp.py"
    #: the script's own options before the benchmark's (--layout fsdp, say)
    script_args: tuple[str, ...] = ()
    #: ftrun: write the event log (--log-dir in the run's folder)
    event_log: bool = False
    #: "etcd": the run gets an etcd cluster of its own and node 0's launcher starts first, to lead
    rdzv_backend: str = "c10d"


LAUNCHERS = {
    launcher.name: launcher
    for launcher in (
        Launcher("torchrun", "torchrun, defaults", "torchrun", ("--rdzv-backend", "c10d")),
        Launcher(
            "torchrun-noshare", "torchrun, shared store disabled", "torchrun", ("--rdzv-backend", "c10d"),
            (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
        ),
        Launcher("ftrun", "ftrun --recovery job", "ftrun", ("--recovery", "job")),
        Launcher(
            "ftrun-process", "ftrun --recovery process", "ftrun", ("--recovery", "process"),
            script=EXAMPLES / "train_ddp_elastic.py",
        ),
        # --status-overhead: the status view and the event log on, and both off
        Launcher("ftrun-status-off", "ftrun --recovery process --status off", "ftrun",
                 ("--recovery", "process", "--status", "off"), script=EXAMPLES / "train_ddp_elastic.py"),
        Launcher("ftrun-status-live", "ftrun --recovery process --status live --log-dir", "ftrun",
                 ("--recovery", "process", "--status", "live"), script=EXAMPLES / "train_ddp_elastic.py",
                 event_log=True),
        # scripts/bench_checkpoint.py: a job-level restart that resumes from the in-memory snapshots
        Launcher("ftrun-memory", "ftrun --recovery job --snapshot-every 1", "ftrun",
                 ("--recovery", "job", "--snapshot-every", "1"), script=EXAMPLES / "train_ddp_elastic.py"),
        # --controller-loss: the controller's node lost under either backend
        Launcher("ftrun-c10d", "ftrun --recovery process (c10d, the default)", "ftrun", ("--recovery", "process"),
                 script=EXAMPLES / "train_ddp_elastic.py"),
        Launcher("ftrun-etcd", "ftrun --recovery process --rdzv-backend etcd", "ftrun",
                 ("--recovery", "process", "--rdzv-backend", "etcd"), script=EXAMPLES / "train_ddp_elastic.py",
                 rdzv_backend="etcd"),
    )
}
STATUS_PAIR = ("ftrun-status-off", "ftrun-status-live")
CONTROLLER_PAIR = ("ftrun-c10d", "ftrun-etcd")
#: launchers only the other benchmarks run
NOT_BY_DEFAULT = (*STATUS_PAIR, *CONTROLLER_PAIR, "ftrun-memory")
BASELINE = "torchrun-noshare"  # the launcher whose median step the ftrun rows are compared with
#: what ftrun's controller logs once training goes on after a fault, with the repair's phases
REPAIR_LINE = "s after the fault ("
#: what an ftrun agent says when the control store went with its node and the job ends
LOST_CONTROLLER_LINE = "lost the controller"
#: what an ftrun agent says once it leads under etcd
TOOK_OFFICE_LINE = "hosting the control store"
#: what ftrun's controller says when it decides how to recover: online, at process level, at job level
DECISION_LINES = ("repair into generation", "falls back to job level", "job-level restart into generation")
#: the examples' checkpoint file (train_ddp.py's CHECKPOINT_NAME)
CHECKPOINT_NAME = "checkpoint.pt"


@dataclass(frozen=True)
class ModeDefaults:
    """Defaults that differ between one run per launcher, the --scaling sweep and --layouts."""

    launchers: tuple[str, ...]
    steps: int
    step_sleep: float
    deadline: float
    kill_at_step: int = 25
    warmup_s: float = 0.0


SINGLE_DEFAULTS = ModeDefaults(launchers=tuple(name for name in LAUNCHERS if name not in NOT_BY_DEFAULT), steps=60,
                               step_sleep=0.0, deadline=90.0)
# Up to 8 workers and 8 agents share the machine's cores: short runs, and a sleep so steps are not starved.
SCALING_DEFAULTS = ModeDefaults(
    launchers=(BASELINE, "ftrun", "ftrun-process"), steps=40, step_sleep=0.05, deadline=180.0,
)
NODE_LOSS_DEFAULTS = SCALING_DEFAULTS
# The step-time goal is a few percent: the median step leaves out the first seconds (the ranks' own first
# steps; ftrun's warm standbys used to import torch beside the workers then), and the fault comes late
# enough for a window of 60-110 steps after them (about 25 when it came after step 55: one slow spell of
# the machine then moved a run's median); 5 steps after a checkpoint, as in the single run.
LAYOUTS_DEFAULTS = ModeDefaults(launchers=(BASELINE, "ftrun-process"), steps=160, step_sleep=0.0, deadline=240.0,
                                kill_at_step=135, warmup_s=5.0)
# --controller-loss: 2 x 2 ranks, 3 agents and 3 etcd members share the machine; a step sleep as for --node-loss
CONTROLLER_LOSS_DEFAULTS = ModeDefaults(launchers=CONTROLLER_PAIR, steps=60, step_sleep=0.05, deadline=180.0)
#: --controller-loss: the goal for regaining progress under etcd is --node-timeout plus this
CONTROLLER_LOSS_MARGIN_S = 1.0
# --mindspore: the kill 3 steps after a snapshot (--snapshot-every 5) and 8 after the script's checkpoint (every 10)
MINDSPORE_DEFAULTS = ModeDefaults(launchers=(), steps=60, step_sleep=0.0, deadline=180.0, kill_at_step=28)
#: --mindspore: the goal for ftrun's regain progress over msrun's
MINDSPORE_GOAL = 0.5
#: --node-loss: launchers that can take a spare node
SPARE_CAPABLE = ("ftrun",)


@dataclass(frozen=True)
class Scenario:
    nnodes: int
    nproc_per_node: int
    steps: int
    ckpt_every: int
    kill_rank: int
    kill_at_step: int
    step_sleep: float
    deadline: float
    max_restarts: int = 3
    #: lose the last node (its launcher and everything under it) instead of one rank
    node_loss: bool = False
    #: every rank SIGKILLs itself after kill_at_step (kill_rank, the last, is the one whose line times the fault)
    kill_all: bool = False
    #: with kill_all: the other ranks die one by one over this many seconds after kill_rank (0: all at once)
    kill_stagger: float = 0.0
    #: the median step leaves out rank 0's steps in the first warmup_s seconds after its first step
    warmup_s: float = 0.0
    #: --node-loss: ftrun's --node-timeout, and how long after the loss a run may take to train on
    node_timeout: float = 3.0
    regain_deadline: float = 45.0
    #: --controller-loss: the node lost is node 0, which hosts the store and the controller (with node_loss)
    controller_loss: bool = False
    #: instead of a kill: once every rank finished kill_at_step, the benchmark resets every connection between
    #: rank kill_rank's process and the other ranks' (every process lives)
    link_cut: bool = False
    #: no fault at all: the run whose final checkpoint a link cut's runs are compared with
    fault_free: bool = False

    @property
    def script_kills(self) -> bool:
        """Whether the training script is told to kill a rank (else the benchmark makes the fault, or none)."""
        return not (self.node_loss or self.link_cut or self.fault_free)

    @property
    def lost_node(self) -> int:
        return 0 if self.controller_loss else self.nnodes - 1

    def spares(self, launcher: "Launcher") -> int:
        return 1 if self.node_loss and launcher.program in SPARE_CAPABLE else 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def shape(self) -> str:
        return (f"{self.nnodes} node{'s' if self.nnodes > 1 else ''} x {self.nproc_per_node} "
                f"rank{'s' if self.nproc_per_node > 1 else ''}")


@dataclass(frozen=True)
class ProgressLine:
    time: float
    rank: int
    step: int
    pid: int
    restart_count: int


@dataclass(frozen=True)
class RunResult:
    launcher: str
    description: str
    nnodes: int
    nproc_per_node: int
    kill_rank: int
    outcome: str  # "ok", "failed", "hung", or (--node-loss) "fails": never trained on after the loss
    exit_codes: list[int | None]  # one per launcher process; None: still running at the deadline
    last_step: int | None  # the highest step any rank finished
    resumed_after_step: int | None
    steps_redone: int | None
    healthy_pids_kept: bool | None  # None: some rank never finished a step
    regain_progress_s: float | None
    median_step_s: float | None
    launch_to_first_step_s: float | None
    wall_s: float
    median_step_vs_baseline: float | None = None  # median_step_s over BASELINE's in the same scenario
    #: ftrun's lines that end a repair, with its phases ("resumed training 0.61s after the fault (detect ...)")
    repair_lines: tuple[str, ...] = ()
    #: --controller-loss: the agents' lines saying they lost the controller (the job ends under c10d)
    lost_controller_lines: tuple[str, ...] = ()
    #: link cut: when the first connection was reset (Unix seconds), how many were, and the processes started
    #: after it or taking a rank's place after it ("<pid> <command>")
    cut_time: float | None = None
    links_cut: int | None = None
    started_after_fault: tuple[str, ...] = ()
    #: link cut, fault-free: a digest of the final checkpoint (model, optimizer, step) bit for bit
    final_digest: str | None = None
    #: ftrun's decisions on a fault ("online repair into generation 1: ...", "... falls back to job level")
    decision_lines: tuple[str, ...] = ()

    def outcome_text(self) -> str:
        if self.outcome == "ok":
            return "ok"
        if self.outcome == "fails":
            return "fails: no spare; the others wait for the lost node (restart by hand)"
        if self.outcome == "ended":
            codes = ", ".join("-" if code is None else str(code) for code in self.exit_codes)
            return f"job ended: lost the controller (exit {codes}; last step {self.last_step})"
        details = [f"last step {self.last_step}"]
        if any(code is not None for code in self.exit_codes):
            details.insert(0, "exit " + ", ".join("-" if code is None else str(code) for code in self.exit_codes))
        return f"{self.outcome}: {'; '.join(details)}"


# --- a link cut: every connection between one rank's process and the others' reset -----------------

Endpoint = tuple[str, int]
Connection = tuple[Endpoint, Endpoint]  # (this end, the other end)


@dataclass(frozen=True)
class LinkCut:
    """A link cut: when the first connection was reset, whose, how many, and what started after it."""

    time: float
    rank: int
    connections: int
    #: "<pid> <command>" of each process of the run that started after the cut (a restart's workers, a standby)
    started: tuple[str, ...] = ()


def why_links_cannot_be_cut() -> str:
    """Why the benchmark cannot reset other processes' connections here ("" when it can)."""
    if os.geteuid() != 0:
        return "resetting another process's connections (ss -K) needs root"
    if shutil.which("ss") is None:
        return "ss (iproute2) is not installed"
    return ""


def tcp_connections(pid: int) -> list[Connection]:
    """A process's established TCP connections (none once it is gone)."""
    try:
        found = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    return [((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port)) for c in found
            if c.status == psutil.CONN_ESTABLISHED and c.raddr]


def connections_to_peers(own: list[Connection], peers: list[list[Connection]]) -> list[Connection]:
    """Those of a process's connections whose other end is one of the peers' own ends: a connection to
    anything else (the control store, its agent) is left out."""
    peer_ends = {local for connections in peers for local, _ in connections}
    return [(local, remote) for local, remote in own if remote in peer_ends]


def ss_address(endpoint: Endpoint) -> str:
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # ss reads an IPv6 host in brackets


def ss_kill_command(connection: Connection) -> list[str]:
    """The ss command that destroys this one connection (the kernel resets it, so the other end fails too)."""
    local, remote = connection
    return ["ss", "-K", "-tn", "src", ss_address(local), "dst", ss_address(remote)]


def rank_pids(lines: list[ProgressLine]) -> dict[int, int]:
    """Each rank's process: the pid of its latest progress line."""
    return {line.rank: line.pid for line in lines}  # the lines are in time order


def cut_rank_links(pids: dict[int, int], rank: int) -> LinkCut:
    """Reset every connection between rank ``rank``'s process and the other ranks' processes, one at a time."""
    peers = [tcp_connections(pid) for other, pid in pids.items() if other != rank]
    doomed = connections_to_peers(tcp_connections(pids[rank]), peers)
    if not doomed:  # the run would go on as if fault-free, and its row would say nothing
        raise RuntimeError(f"found no connection between rank {rank}'s process ({pids[rank]}) and its peers'")
    started = time.time()
    for connection in doomed:
        done = subprocess.run(ss_kill_command(connection), capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(ss_kill_command(connection))} failed: {done.stderr.strip()}")
    left = set(doomed) & set(tcp_connections(pids[rank]))
    if left:  # ss -K says nothing where the kernel cannot destroy sockets (no CONFIG_INET_DIAG_DESTROY)
        raise RuntimeError(f"ss -K left {len(left)} of rank {rank}'s {len(doomed)} connections to its peers open")
    return LinkCut(started, rank, len(doomed))


class LinkCutter:
    """A run's link cut: once every rank has finished the kill step, the kill rank's links are cut; from
    then on, every process of the run (by its marker) that was not there before counts as started."""

    def __init__(self, scenario: Scenario, marker: str) -> None:
        self.scenario, self.marker = scenario, marker
        self.cut: LinkCut | None = None
        self.before: set[int] = set()
        self.started: dict[int, str] = {}

    def tick(self, workdir: Path) -> None:
        if self.cut is None:
            if every_rank_reached(workdir, self.scenario):
                self.before = {process.pid for process in marked_processes(MARKER_VARIABLE, self.marker)}
                pids = rank_pids(read_progress(workdir / "progress.txt"))
                self.cut = cut_rank_links(pids, self.scenario.kill_rank)
            return
        for process in marked_processes(MARKER_VARIABLE, self.marker):
            if process.pid not in self.before and process.pid not in self.started:
                self.started[process.pid] = describe_process(process)

    def result(self) -> LinkCut | None:
        return None if self.cut is None else replace(self.cut, started=tuple(self.started.values()))


def describe_process(process: psutil.Process) -> str:
    try:
        command = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        command = "(gone)"
    return f"{process.pid} {command[:160]}"


# --- running a launcher ---------------------------------------------------------------------------


def launcher_command(launcher: Launcher, scenario: Scenario, port: int, run_id: str, workdir: Path,
                     node: int, endpoint: str | None = None) -> list[str]:
    """The command of launcher process ``node`` (``scenario.nnodes`` and beyond: a spare); ``endpoint``:
    the etcd cluster's, for a launcher under etcd."""
    placement = []
    etcd = launcher.rdzv_backend == "etcd"
    if etcd:  # every agent a candidate for the controller's office: node 0 leads by starting first
        placement = ["--local-addr", f"127.0.0.{node + 2}"]
    elif scenario.node_loss:  # node 0 hosts the store (--node-loss: the lost node must not take it along)
        placement = ["--rdzv-conf", f"is_host={int(node == 0)}"]
    if scenario.node_loss and launcher.program in SPARE_CAPABLE:
        placement += ["--spares", "1", "--node-timeout", f"{scenario.node_timeout:g}"]
        placement += ["--node-rank", str(node)] if node < scenario.nnodes and not etcd else []
    fault = [] if not scenario.script_kills else ["--kill-rank", "all" if scenario.kill_all else str(scenario.kill_rank),
                                                  "--kill-at-step", str(scenario.kill_at_step)]
    if scenario.kill_all and scenario.kill_stagger:
        fault += ["--kill-stagger", f"{scenario.kill_stagger:g}"]
    return [
        find_program(launcher.program, "bench_recovery"),
        "--nnodes", str(scenario.nnodes),
        "--nproc-per-node", str(scenario.nproc_per_node),
        "--rdzv-endpoint", endpoint or f"127.0.0.1:{port}",
        "--rdzv-id", run_id,
        "--max-restarts", str(scenario.max_restarts),
        *placement,
        *launcher.extra_args,
        *(["--log-dir", str(workdir / "logs")] if launcher.event_log else []),
        str(launcher.script),
        *launcher.script_args,
        "--steps", str(scenario.steps),
        "--ckpt-dir", str(workdir / "checkpoints"),
        "--ckpt-every", str(scenario.ckpt_every),
        "--progress", str(workdir / "progress.txt"),
        *fault,
        "--step-sleep", str(scenario.step_sleep),
    ]


@dataclass(frozen=True)
class NodeLoss:
    """--node-loss: when the last node was killed, and the processes that died with it."""

    time: float
    pids: frozenset[int]


def run_launcher(launcher: Launcher, scenario: Scenario, workdir: Path, endpoint: str | None = None
                 ) -> tuple[float, list[int | None], NodeLoss | None, LinkCut | None]:
    """Start one launcher process per node (and a spare's), wait for all to exit or the deadline, kill
    what is left. With --node-loss, kill the last node (--controller-loss: node 0) once every rank passed
    the kill step; with a link cut, cut the kill rank's links then. Under etcd (``endpoint``: the
    cluster's), node 0's launcher starts first and the others once it leads.

    Returns the launch time (Unix seconds), the exit codes (None for a process still running at the
    deadline; the lost node's left out), the node loss and the link cut.
    """
    port, run_id, marker = free_port(), f"bench-{launcher.name}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # Launchers set OMP_NUM_THREADS=1 only for several ranks per node; the simulated nodes share one
    # machine's cores, so a one-rank node gets it too.
    env = {"OMP_NUM_THREADS": "1", **os.environ, **dict(launcher.extra_env), MARKER_VARIABLE: marker}
    processes: list[subprocess.Popen] = []
    launch_time = time.time()
    loss = None
    cutter = LinkCutter(scenario, marker) if scenario.link_cut else None
    try:
        deadline = time.monotonic() + scenario.deadline
        for node in range(scenario.nnodes + scenario.spares(launcher)):
            with open(workdir / f"node{node}.log", "wb") as log:
                processes.append(subprocess.Popen(
                    launcher_command(launcher, scenario, port, run_id, workdir, node, endpoint), env=env,
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))
            if node == 0 and launcher.rdzv_backend == "etcd":
                wait_for_line(workdir / "node0.log", TOOK_OFFICE_LINE, processes[0], deadline)
        victim = processes[scenario.lost_node]
        while time.monotonic() < deadline and any(p.poll() is None for p in processes if p is not victim or not loss):
            if scenario.node_loss and loss is None and every_rank_reached(workdir, scenario):
                loss = kill_node(victim)
            if loss and time.time() - loss.time > scenario.regain_deadline and not trained_on(workdir, scenario, loss):
                break  # no one trains past the fault: the job waits for the lost node, for good
            if cutter is not None:
                cutter.tick(workdir)
            time.sleep(0.2)
        codes = [process.poll() for process in processes]
        return (launch_time, [code for p, code in zip(processes, codes) if not (loss and p is victim)], loss,
                None if cutter is None else cutter.result())
    finally:
        kill_everything(processes, MARKER_VARIABLE, marker)


def wait_for_line(log: Path, text: str, process: subprocess.Popen, deadline: float) -> bool:
    """Wait until ``text`` is in the log, the process has exited or the deadline (monotonic) has passed."""
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def every_rank_reached(workdir: Path, scenario: Scenario) -> bool:
    lines = read_progress(workdir / "progress.txt")
    return len({line.rank for line in lines if line.step >= scenario.kill_at_step}) == scenario.world_size


def trained_on(workdir: Path, scenario: Scenario, loss: NodeLoss) -> bool:
    lines = read_progress(workdir / "progress.txt")
    pre_fault = max(line.step for line in lines if line.time <= loss.time)
    return any(line.step > pre_fault and line.time > loss.time for line in lines)


def kill_node(launcher_process: subprocess.Popen) -> NodeLoss:
    """SIGKILL a node's launcher and every process under it at once, as a host that dies."""
    root = psutil.Process(launcher_process.pid)
    victims = [root, *root.children(recursive=True)]
    for process in victims:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return NodeLoss(time.time(), frozenset(p.pid for p in victims))


# --- reading the progress file --------------------------------------------------------------------


def read_progress(path: Path) -> list[ProgressLine]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        fields = text.split()
        if len(fields) != 5:
            continue  # a line cut short by the kill
        when, rank, step, pid, restart_count = fields
        lines.append(ProgressLine(float(when), int(rank), int(step), int(pid), int(restart_count)))
    return sorted(lines, key=lambda line: line.time)


def resumed_after_step(lines: list[ProgressLine], first_attempt_pids: set[int]) -> int | None:
    """The step the job went on after the fault: one before the lowest step that a rank finished a second
    time (a restart, or a rollback in place) or that a new process (a restart, a replacement) finished.

    Restarted ranks are new processes. (Their restart count is no guide: torchrun counts restarts per
    agent, so the ranks of the node that did not fail come back with count 0.) Ranks that were never
    restarted and never rolled back count for nothing, so a replacement that picks up at the step after
    the kill step gives the kill step itself.
    """
    finished: set[tuple[int, int]] = set()
    resumed_steps = []
    for line in lines:
        if (line.rank, line.step) in finished or line.pid not in first_attempt_pids:
            resumed_steps.append(line.step)
        finished.add((line.rank, line.step))
    return min(resumed_steps) - 1 if resumed_steps else None


def healthy_pids_kept(lines: list[ProgressLine], scenario: Scenario, lost: frozenset[int] | None = None
                      ) -> bool | None:
    """Whether every rank but the killed one (``lost``: the ranks of the node lost) finished all its steps
    in the process it started in (None when every rank was killed)."""
    if scenario.kill_all:
        return None
    pids_by_rank: dict[int, set[int]] = {}
    for line in lines:
        pids_by_rank.setdefault(line.rank, set()).add(line.pid)
    lost = frozenset({scenario.kill_rank}) if lost is None else lost
    healthy = [rank for rank in range(scenario.world_size) if rank not in lost]
    if any(rank not in pids_by_rank for rank in healthy):
        return None
    return all(len(pids_by_rank[rank]) == 1 for rank in healthy)


def regain_progress_s(lines: list[ProgressLine], scenario: Scenario, fault: ProgressLine) -> float | None:
    """Seconds from the fault until every rank has finished a step past the kill step; None if never."""
    passed: dict[int, float] = {}  # rank -> when it first finished a step past the kill step
    for line in lines:
        if line.step > scenario.kill_at_step and line.time > fault.time:
            passed.setdefault(line.rank, line.time)
    return max(passed.values()) - fault.time if len(passed) == scenario.world_size else None


def stand_still(lines: list[ProgressLine], world_size: int, since: float) -> tuple[float, float] | None:
    """The longest time from ``since`` on that training stood still, and when that began; None if training
    never went two steps past where it stood at ``since``.

    Training's progress is the highest step that every rank has finished, in any of its processes (a step
    redone after a restart is no progress); the stretch looked at ends once that is two steps past where it
    was at ``since``. For a fault that leaves the processes alive (a link cut) regain_progress_s's measure
    does not hold: the step in flight may still finish after the fault, the next one failing, so that
    every rank passes the step finished at the fault at once. The longest pause also covers that case: it
    runs from that step's end until training moves again.
    """
    highest: dict[int, int] = {}  # rank -> the highest step it has finished
    for line in lines:
        if line.time > since:
            break
        highest[line.rank] = max(highest.get(line.rank, 0), line.step)
    start = min(highest.values()) if len(highest) == world_size else 0
    progress, moved, longest = start, since, None
    for line in (line for line in lines if line.time > since):
        highest[line.rank] = max(highest.get(line.rank, 0), line.step)
        now = min(highest.values()) if len(highest) == world_size else 0
        if now > progress:
            if longest is None or line.time - moved > longest[1]:
                longest = (moved, line.time - moved)
            progress, moved = now, line.time
            if progress >= start + 2:
                return longest
    return None


def median_step_s(before_fault: list[ProgressLine], warmup_s: float = 0.0) -> float | None:
    """The median gap between rank 0's steps, leaving out the first ``warmup_s`` seconds, but never more
    than the first half of its steps (a fast job may reach the fault within the warm-up)."""
    rank0 = [line for line in before_fault if line.rank == 0]
    if not rank0:
        return None
    start = min(rank0[0].time + warmup_s, rank0[len(rank0) // 2].time)
    rank0_times = {line.step: line.time for line in rank0 if line.time >= start}
    step_gaps = [rank0_times[step] - rank0_times[step - 1] for step in rank0_times if step - 1 in rank0_times]
    return statistics.median(step_gaps) if step_gaps else None


def outcome_of(exit_codes: list[int | None], last_step: int | None, scenario: Scenario) -> str:
    if any(code is None for code in exit_codes):
        return "hung"
    if any(code != 0 for code in exit_codes) or last_step != scenario.steps:
        return "failed"
    return "ok"


def analyse(
    launcher: Launcher, scenario: Scenario, launch_time: float, exit_codes: list[int | None],
    lines: list[ProgressLine], wall_s: float, loss: NodeLoss | None = None, cut: LinkCut | None = None,
) -> RunResult:
    lost_ranks = None
    pause = None  # a link cut: when training stood still longest after it, and for how long
    if loss is not None:  # the fault is the kill; training must pass the highest step finished before it
        lost = [line for line in lines if line.pid in loss.pids]
        lost_ranks = frozenset(line.rank for line in lost) or None
        pre_fault = max(line.step for line in lines if line.time <= loss.time)
        scenario = replace(scenario, kill_at_step=pre_fault, kill_rank=lost[-1].rank if lost else scenario.kill_rank)
        fault = ProgressLine(loss.time, scenario.kill_rank, pre_fault, -1, 0)
    elif cut is not None:  # no rank is lost: every one should keep its process
        lost_ranks = frozenset()
        pause = stand_still(lines, scenario.world_size, cut.time)
        # the steps redone count from the highest step finished when training stood still (a step in flight at
        # the cut may still have finished)
        pre_fault = max(line.step for line in lines if line.time <= (cut.time if pause is None else pause[0]))
        scenario = replace(scenario, kill_at_step=pre_fault)
        fault = ProgressLine(cut.time, cut.rank, pre_fault, -1, 0)
    else:
        fault = next(
            (line for line in lines if line.rank == scenario.kill_rank and line.step == scenario.kill_at_step), None
        )
    before_fault = [line for line in lines if fault is None or line.time <= fault.time]
    resumed_after = resumed_after_step(lines, {line.pid for line in before_fault})
    last_step = max((line.step for line in lines), default=None)
    if cut is not None:
        regain = None if pause is None else pause[1]
    else:
        regain = None if fault is None else regain_progress_s(lines, scenario, fault)
    outcome = outcome_of(exit_codes, last_step, scenario)
    redone = None if resumed_after is None else scenario.kill_at_step - resumed_after
    if cut is not None and redone is None and regain is not None:
        redone = 0  # repaired in place: the same processes went on, and none finished a step a second time
    if loss is not None and regain is None:
        # stopped by the benchmark: nothing would have brought the lost node back; or, the controller's
        # node lost, the others ended the job themselves
        outcome = "ended" if scenario.controller_loss and None not in exit_codes else "fails"
    return RunResult(
        launcher=launcher.name,
        description=launcher.description,
        nnodes=scenario.nnodes,
        nproc_per_node=scenario.nproc_per_node,
        kill_rank=scenario.kill_rank,
        outcome=outcome,
        exit_codes=exit_codes,
        last_step=last_step,
        resumed_after_step=resumed_after,
        steps_redone=redone,
        healthy_pids_kept=healthy_pids_kept(lines, scenario, lost_ranks),
        regain_progress_s=regain,
        median_step_s=median_step_s(before_fault, scenario.warmup_s),
        launch_to_first_step_s=lines[0].time - launch_time if lines else None,
        wall_s=wall_s,
        cut_time=None if cut is None else cut.time,
        links_cut=None if cut is None else cut.connections,
        started_after_fault=() if cut is None else started_after(cut, lines),
    )


def started_after(cut: LinkCut, lines: list[ProgressLine]) -> tuple[str, ...]:
    """The processes started after the cut, and those that took a rank's place after it: a warm standby,
    started long before, that replaces a rank is a process started for it all the same."""
    started = {int(entry.split()[0]): entry for entry in cut.started}
    ranks_before = {line.pid for line in lines if line.time <= cut.time}
    for line in lines:
        if line.time > cut.time and line.pid not in ranks_before:
            started.setdefault(line.pid, f"{line.pid} (in rank {line.rank}'s place)")
    return tuple(started.values())


def compare_with_baseline(results: list[RunResult]) -> list[RunResult]:
    """The results of one scenario, each ftrun row given its median step as a ratio to BASELINE's."""
    baseline = next((result.median_step_s for result in results if result.launcher == BASELINE), None)
    if not baseline:
        return results
    return [
        replace(result, median_step_vs_baseline=result.median_step_s / baseline)
        if LAUNCHERS[result.launcher].program == "ftrun" and result.median_step_s is not None else result
        for result in results
    ]


def regain_in_steps(result: RunResult) -> float | None:
    """Regain progress in units of the run's own median step: on a machine with fewer cores than ranks,
    every step and every repair slow down alike as N grows, and this ratio leaves that out."""
    if result.regain_progress_s is None or not result.median_step_s:
        return None
    return result.regain_progress_s / result.median_step_s


def regain_spread(results: list[RunResult], in_steps: bool = False) -> float | None:
    """Max over min of regain progress (seconds, or steps) across a launcher's runs; None unless every run regained."""
    times = [regain_in_steps(result) if in_steps else result.regain_progress_s for result in results]
    if len(times) < 2 or any(time is None or time <= 0 for time in times):
        return None
    return max(times) / min(times)


def benchmark(launcher: Launcher, scenario: Scenario, workdir: Path) -> RunResult:
    """One run of a launcher; under etcd, on a 3-member cluster of the run's own (stopped after it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = EtcdCluster.start(workdir / "etcd") if launcher.rdzv_backend == "etcd" else None
    started = time.monotonic()
    try:
        launch_time, exit_codes, loss, cut = run_launcher(launcher, scenario, workdir,
                                                          None if cluster is None else cluster.endpoints)
    finally:
        if cluster is not None:
            cluster.stop()
    wall_s = time.monotonic() - started
    result = analyse(launcher, scenario, launch_time, exit_codes, read_progress(workdir / "progress.txt"), wall_s,
                     loss, cut)
    logs = sorted(workdir.glob("node*.log"))
    result = replace(result, repair_lines=repair_lines(logs), lost_controller_lines=lines_saying(logs, LOST_CONTROLLER_LINE),
                     decision_lines=lines_saying(logs, *DECISION_LINES))
    if scenario.link_cut or scenario.fault_free:
        result = replace(result, final_digest=checkpoint_digest(workdir / "checkpoints" / CHECKPOINT_NAME))
    return result


def checkpoint_digest(path: Path) -> str | None:
    """A digest of a checkpoint's contents bit for bit (every tensor's dtype, shape and bytes, every other
    value's repr, under its key); None when there is none."""
    if not path.exists():
        return None
    import torch  # only the link-cut row reads checkpoints; the rest of the benchmark runs without torch

    digest = hashlib.sha256()

    def feed(key: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}:".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for name in sorted(value, key=str):
                feed(f"{key}/{name}", value[name])
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                feed(f"{key}/{index}", item)
        else:
            digest.update(f"{key}={value!r};".encode())

    feed("", torch.load(path, map_location="cpu", weights_only=True))
    return digest.hexdigest()


def lines_saying(logs: list[Path], *texts: str) -> tuple[str, ...]:
    """Each log's lines that contain one of ``texts``, stripped, in the logs' order."""
    return tuple(line.strip() for log in logs for line in log.read_text(errors="replace").splitlines()
                 if any(text in line for text in texts))


def recovery_level(decision_lines: tuple[str, ...]) -> str:
    """The lowest level ftrun's decisions went down to: online, process, job; "-" without a decision."""
    if any("job-level repair" in line or "falls back to job level" in line for line in decision_lines):
        return "job"
    if any("process-level repair" in line for line in decision_lines):
        return "process"
    return "online" if any("online repair" in line for line in decision_lines) else "-"


def repair_lines(logs: list[Path]) -> tuple[str, ...]:
    """The lines in which ftrun's controller says training goes on after a fault, and in how long each phase."""
    found = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if REPAIR_LINE in line:
                found.append(line[line.index("generation"):] if "generation" in line else line.strip())
    return tuple(found)


# --- reporting ------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def regain_text(result: RunResult) -> str:
    return "never" if result.regain_progress_s is None else seconds(result.regain_progress_s)


def yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def print_table(results: list[RunResult], scenario: Scenario) -> None:
    fault = (f"losing node 0, the controller's (its launcher and ranks SIGKILLed), once every rank passed step "
             f"{scenario.kill_at_step}" if scenario.controller_loss
             else f"losing the last node (its launcher and rank SIGKILLed) once every rank passed step "
             f"{scenario.kill_at_step}" if scenario.node_loss
             else f"SIGKILL of rank {scenario.kill_rank} at step {scenario.kill_at_step}")
    table = Table(title=(
        f"Recovery after {fault}: "
        f"{scenario.shape}, checkpoint every {scenario.ckpt_every} steps, step sleep {scenario.step_sleep:g} s"
    ))
    for header in ("launcher", "regain progress (s)", "steps redone", "healthy pids kept", "median step (s)",
                   "launch to step 1 (s)", "wall (s)", "outcome"):
        table.add_column(header, justify="left" if header in ("launcher", "outcome") else "right")
    for result in results:
        table.add_row(
            result.description,
            regain_text(result),
            "-" if result.steps_redone is None else str(result.steps_redone),
            yes_no(result.healthy_pids_kept),
            seconds(result.median_step_s),
            seconds(result.launch_to_first_step_s),
            seconds(result.wall_s),
            result.outcome_text(),
        )
    console.print(table)
    print_step_time_ratios(results)


def print_step_time_ratios(results: list[RunResult]) -> None:
    ratios = [
        f"{result.launcher} {result.median_step_vs_baseline:.3f} ({result.median_step_vs_baseline - 1:+.1%})"
        for result in results if result.median_step_vs_baseline is not None
    ]
    if ratios:
        console.print(f"median step / {BASELINE}'s: {', '.join(ratios)} (goal for process level: within 3%)")
    elif any(LAUNCHERS[result.launcher].program == "ftrun" for result in results):
        console.print(f"median step ratios: no {BASELINE} run with a median step to compare with")


def print_scaling_table(results: list[RunResult], scenarios: list[Scenario], launchers: list[Launcher]) -> None:
    first = scenarios[0]
    if first.node_loss:
        title = (f"Regain progress (s) after losing the last node (its launcher and rank SIGKILLed after step "
                 f"{first.kill_at_step}), N nodes x 1 rank")
        caption = f"ftrun: one spare node, --node-timeout {first.node_timeout:g}; torchrun has no spares"
    else:
        title = f"Regain progress (s), N nodes x 1 rank, last rank killed at step {first.kill_at_step}"
        caption = "goal: process-level repair stays flat as N grows (max / min <= 1.3)"

    def seconds_cell(run: RunResult) -> str:
        return (("fails" if run.outcome == "fails" else regain_text(run))
                + ("" if run.outcome in ("ok", "fails") else f" ({run.outcome})"))

    def steps_cell(run: RunResult) -> str:
        steps = regain_in_steps(run)
        return "-" if steps is None else f"{steps:.1f}"

    print_by_n(title, caption, results, scenarios, launchers, seconds_cell)
    if not first.node_loss:
        print_by_n("The same in median steps of each run (regain progress / median step)",
                   "dividing by the step time leaves out the contention for cores", results, scenarios, launchers,
                   steps_cell, in_steps=True)


def print_by_n(title: str, caption: str, results: list[RunResult], scenarios: list[Scenario],
               launchers: list[Launcher], cell: Callable[[RunResult], str], in_steps: bool = False) -> None:
    """A row per launcher, a column per node count, and the spread across them."""
    table = Table(title=title, caption=caption)
    table.add_column("launcher")
    for scenario in scenarios:
        table.add_column(f"N = {scenario.nnodes}", justify="right")
    table.add_column("max / min", justify="right")
    for launcher in launchers:
        runs = [result for result in results if result.launcher == launcher.name]
        spread = regain_spread(runs, in_steps)
        table.add_row(launcher.description, *map(cell, runs), "-" if spread is None else f"{spread:.2f}")
    console.print(table)


def write_json(
    results: list[RunResult], scenarios: list[Scenario], launchers: list[Launcher], destination: str,
    extra: dict | None = None,
) -> None:
    document = {"scenarios": [asdict(scenario) for scenario in scenarios],
                "runs": [asdict(result) for result in results], **(extra or {})}
    if len(scenarios) > 1 and launchers:
        document["regain_progress_max_over_min"] = {
            launcher.name: regain_spread([result for result in results if result.launcher == launcher.name])
            for launcher in launchers
        }
        document["regain_steps_max_over_min"] = {
            launcher.name: regain_spread([result for result in results if result.launcher == launcher.name], in_steps=True)
            for launcher in launchers
        }
    text = json.dumps(document, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")
        console.print(f"JSON written to {destination}")


# --- --layouts: a row per parallel layout ----------------------------------------------------------


@dataclass(frozen=True)
class LayoutCase:
    """One row of --layouts: a script (with its options) under ftrun --recovery process, and under
    torchrun with the shared store disabled, which restarts it from its disk checkpoint."""

    name: str
    description: str
    script: Path
    script_args: tuple[str, ...] = ()
    #: ftrun's options besides --recovery process (FSDP's full shard: --snapshot-every)
    ftrun_args: tuple[str, ...] = ()
    #: every rank SIGKILLed at once (issue 17), not the last one alone
    kill_all: bool = False
    #: with kill_all: the others die over this many seconds after the last rank (a repair under way)
    kill_stagger: float = 0.0
    #: the step the fault comes after, where the case sets its own
    kill_at_step: int | None = None
    #: the sleep after each step, where the case sets its own
    step_sleep: float | None = None
    #: the goal for ftrun's regain progress over torchrun's, and for the steps ftrun redoes
    regain_goal: float = 0.1
    redone_goal: int = 0
    #: pure DP: also torch DDP (train_ddp.py) under torchrun, to hold job.ddp()'s step time against
    torch_ddp_reference: bool = False
    #: the online level's row: the benchmark cuts fault_rank's links, no rank is killed; its goal is
    #: LINK_CUT_GOAL_S, not a ratio, and each launcher's final checkpoint is held against a fault-free run's
    link_cut: bool = False
    #: nodes x ranks per node, and the rank whose fault it is, where the case sets its own
    shape: tuple[int, int] | None = None
    fault_rank: int | None = None
    #: a module the script imports that ftrun does not install (the row is skipped, saying so, without it)
    needs: str = ""
    #: the start's row: no fault, START_STEPS steps; each launcher's launch to first step (goal: START_GOAL)
    start: bool = False


STEP_TIME_GOAL = 1.03
#: link-cut: the goal for ftrun's stand-still (with no process started and the final state bit-identical)
LINK_CUT_GOAL_S = 1.0
#: start: the goal for ftrun's launch to first step over torchrun's, and the steps of each run
START_GOAL = 1.1
START_STEPS = 20


def layout_cases(snapshot_every: int, kill_stagger: float = 0.5) -> dict[str, LayoutCase]:
    snapshots = ("--snapshot-every", str(snapshot_every))
    elastic_ddp, fsdp, tp = (EXAMPLES / f"train_{name}_elastic.py" for name in ("ddp", "fsdp", "tp"))
    cases = (
        LayoutCase("ddp", "pure DP, job.ddp()", elastic_ddp, torch_ddp_reference=True),
        LayoutCase("torch-ddp", "pure DP, torch DDP", elastic_ddp, ("--torch-ddp",)),
        LayoutCase("fsdp", f"FSDP2 full shard, --snapshot-every {snapshot_every}", fsdp, ("--layout", "fsdp"),
                   snapshots, redone_goal=snapshot_every),
        LayoutCase("hsdp", "HSDP, replicate 2 x shard 2", fsdp, ("--layout", "hsdp")),
        LayoutCase("tp", "TP 2 x DP 2", tp, ("--layout", "tp")),
        LayoutCase("pp", "2 pipeline stages x DP 2", tp, ("--layout", "pp")),
        LayoutCase("all-lost", f"every rank lost at step 25, job.ddp(), --snapshot-every {snapshot_every}", elastic_ddp,
                   (), snapshots, kill_all=True, kill_at_step=25, regain_goal=0.7, redone_goal=snapshot_every),
        LayoutCase("all-lost-staggered", f"every rank lost at step 25 over {kill_stagger:g} s, job.ddp(), "
                   f"--snapshot-every {snapshot_every}", elastic_ddp, (), snapshots, kill_all=True,
                   kill_stagger=kill_stagger, kill_at_step=25, regain_goal=0.7, redone_goal=snapshot_every),
        LayoutCase("hf", "Hugging Face Trainer, DDP, as written for torchrun", EXAMPLES / "train_hf_trainer.py",
                   needs="transformers"),
        # an MLP's steps take milliseconds: without a sleep the fault came before the warm standbys (before the
        # warm interpreter) had imported torch and Lightning (0.30x, against 0.021x once warm); kept as measured
        LayoutCase("lightning", "PyTorch Lightning, DDP, as written for torchrun, step sleep 0.1 s",
                   EXAMPLES / "train_lightning.py", needs="lightning", step_sleep=0.1),
        # ZeRO keeps one copy of each rank's optimizer partition: the replacement's comes from its snapshot, and
        # every rank goes back to the newest step all of them hold (the fault's step, or the one before it)
        LayoutCase("deepspeed", "DeepSpeed ZeRO-2, --snapshot-every 1", EXAMPLES / "train_deepspeed.py",
                   ftrun_args=("--snapshot-every", "1"), needs="deepspeed", redone_goal=1),
        LayoutCase("hf-deepspeed", "Hugging Face Trainer, deepspeed= ZeRO-2, as written for torchrun, --snapshot-every 1",
                   EXAMPLES / "train_hf_trainer.py", ("--zero", "2"), ftrun_args=("--snapshot-every", "1"),
                   needs="deepspeed", redone_goal=1),
        LayoutCase("link-cut", "rank 1's links to the other ranks cut, 1 x 4, job.ddp()", elastic_ddp, link_cut=True,
                   shape=(1, 4), fault_rank=1),
        LayoutCase("start", "launch to the first step, 1 x 4, job.ddp(), no fault", elastic_ddp, start=True,
                   shape=(1, 4)),
    )
    return {case.name: case for case in cases}


LAYOUT_NAMES = tuple(layout_cases(5))


@dataclass(frozen=True)
class LayoutRow:
    """A layout's runs (one each per repeat) and how ftrun's compare with torchrun's."""

    case: LayoutCase
    ftrun: list[RunResult]
    torchrun: list[RunResult]
    torch_ddp: list[RunResult]  # pure DP only: torch DDP under torchrun
    #: link-cut: each launcher's fault-free run, whose final checkpoint the other runs' are held against
    ftrun_fault_free: RunResult | None = None
    torchrun_fault_free: RunResult | None = None
    #: why the row was not run ("" when it was)
    skipped: str = ""

    @property
    def regain_ratio(self) -> float | None:
        return ratio(median_of(self.ftrun, "regain_progress_s"), median_of(self.torchrun, "regain_progress_s"))

    @property
    def step_ratio(self) -> float | None:
        return ratio(median_of(self.ftrun, "median_step_s"), median_of(self.torchrun, "median_step_s"))

    @property
    def start_ratio(self) -> float | None:
        """ftrun's median launch to first step over torchrun's."""
        return ratio(median_of(self.ftrun, "launch_to_first_step_s"), median_of(self.torchrun, "launch_to_first_step_s"))

    def start_ratios(self) -> list[float | None]:
        """ftrun's launch to first step over torchrun's in each repeat: the two runs side by side, under one load."""
        return [ratio(f.launch_to_first_step_s, t.launch_to_first_step_s) for f, t in zip(self.ftrun, self.torchrun)]

    @property
    def step_ratio_vs_torch_ddp(self) -> float | None:
        return ratio(median_of(self.ftrun, "median_step_s"), median_of(self.torch_ddp, "median_step_s"))

    def most_redone(self, runs: list[RunResult]) -> int | None:
        redone = [run.steps_redone for run in runs if run.steps_redone is not None]
        return max(redone) if len(redone) == len(runs) else None

    def bit_identical(self, runs: list[RunResult], fault_free: RunResult | None) -> list[bool | None]:
        """Per run: whether its final checkpoint equals the fault-free run's bit for bit (None: one is missing)."""
        reference = None if fault_free is None else fault_free.final_digest
        return [None if reference is None or run.final_digest is None else run.final_digest == reference
                for run in runs]

    def link_cut_goals(self) -> dict[str, bool | None]:
        """ftrun's three goals on a link cut: met, missed, or None where not measured."""
        stand_still = median_of(self.ftrun, "regain_progress_s")
        identical = self.bit_identical(self.ftrun, self.ftrun_fault_free)
        return {"stand_still": None if stand_still is None else stand_still <= LINK_CUT_GOAL_S,
                "no_process_started": all(not run.started_after_fault for run in self.ftrun) if self.ftrun else None,
                "bit_identical": None if not identical or None in identical else all(identical)}

    def to_json(self) -> dict:
        if self.skipped:
            return {"layout": self.case.name, "description": self.case.description, "skipped": self.skipped}
        if self.case.link_cut:
            return self.link_cut_json()
        if self.case.start:
            return self.start_json()
        return {"layout": self.case.name, "description": self.case.description,
                "goals": {"regain_ratio": self.case.regain_goal, "steps_redone": self.case.redone_goal,
                          "step_ratio": STEP_TIME_GOAL},
                "regain_ratio": self.regain_ratio, "step_ratio": self.step_ratio,
                "step_ratio_vs_torch_ddp": self.step_ratio_vs_torch_ddp,
                "steps_redone": {"ftrun": self.most_redone(self.ftrun), "torchrun": self.most_redone(self.torchrun)},
                "runs": {role: [asdict(run) for run in runs] for role, runs in
                         (("ftrun", self.ftrun), ("torchrun", self.torchrun), ("torch_ddp", self.torch_ddp)) if runs}}

    def link_cut_json(self) -> dict:
        roles = (("ftrun", self.ftrun, self.ftrun_fault_free), ("torchrun", self.torchrun, self.torchrun_fault_free))
        return {"layout": self.case.name, "description": self.case.description,
                "goals": {"stand_still_s": LINK_CUT_GOAL_S, "processes_started": 0, "bit_identical": True},
                "goals_met": self.link_cut_goals(),
                "stand_still_s": {role: median_of(runs, "regain_progress_s") for role, runs, _ in roles},
                "stand_still_ratio": self.regain_ratio,
                "processes_started": {role: [len(run.started_after_fault) for run in runs] for role, runs, _ in roles},
                "steps_redone": {role: self.most_redone(runs) for role, runs, _ in roles},
                "bit_identical": {role: self.bit_identical(runs, fault_free) for role, runs, fault_free in roles},
                "fault_free_runs_agree": fault_free_runs_agree(self),
                "ftrun_levels": [recovery_level(run.decision_lines) for run in self.ftrun],
                "runs": {role: [asdict(run) for run in runs] for role, runs, _ in roles},
                "fault_free_runs": {role: asdict(fault_free) for role, _, fault_free in roles if fault_free}}


    def start_json(self) -> dict:
        roles = (("ftrun", self.ftrun), ("torchrun", self.torchrun))
        return {"layout": self.case.name, "description": self.case.description, "goal": START_GOAL,
                "goal_met": None if self.start_ratio is None else self.start_ratio <= START_GOAL,
                "ratio": self.start_ratio, "ratio_per_repeat": self.start_ratios(),
                "launch_to_first_step_s": {role: median_of(runs, "launch_to_first_step_s") for role, runs in roles},
                "each_run_s": {role: [run.launch_to_first_step_s for run in runs] for role, runs in roles},
                "runs": {role: [asdict(run) for run in runs] for role, runs in roles}}


def fault_free_runs_agree(row: LayoutRow) -> bool | None:
    """Whether ftrun's and torchrun's fault-free runs end with the same checkpoint (None: one is missing)."""
    digests = [None if run is None else run.final_digest for run in (row.ftrun_fault_free, row.torchrun_fault_free)]
    return None if None in digests else digests[0] == digests[1]


def median_of(runs: list[RunResult], field: str) -> float | None:
    """The median of a field over a layout's repeats; None unless every run has it."""
    values = [getattr(run, field) for run in runs]
    return statistics.median(values) if values and None not in values else None


def ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value is not None and baseline else None


def layout_launchers(case: LayoutCase) -> tuple[Launcher, Launcher, Launcher | None]:
    """torchrun-noshare and ftrun --recovery process running the case's script; torch DDP's reference."""
    torchrun = replace(LAUNCHERS[BASELINE], name=f"{case.name}-{BASELINE}", script=case.script,
                       script_args=case.script_args)
    process = LAUNCHERS["ftrun-process"]
    ftrun = replace(process, name=f"{case.name}-ftrun-process", script=case.script, script_args=case.script_args,
                    description=" ".join((process.description, *case.ftrun_args)),
                    extra_args=(*process.extra_args, *case.ftrun_args))
    reference = replace(LAUNCHERS[BASELINE], name=f"{case.name}-torch-ddp-{BASELINE}",
                        description="torchrun, shared store disabled, torch DDP (train_ddp.py)")
    return torchrun, ftrun, reference if case.torch_ddp_reference else None


def run_layouts(cases: list[LayoutCase], scenario: Scenario, work_root: Path, repeats: int) -> list[LayoutRow]:
    """Each case's runs, torchrun's and ftrun's alternating, ``repeats`` times each; every other repeat
    in the opposite order, so that neither launcher always runs first and what one run leaves behind (a
    checkpoint still being written out, memory being freed) falls on each alike."""
    rows = []
    for case in cases:
        torchrun, ftrun, reference = layout_launchers(case)
        launchers = [torchrun, ftrun, *([reference] if reference else [])]
        case_scenario = layout_scenario(case, scenario)
        why_not = why_links_cannot_be_cut() if case.link_cut else ""
        if case.needs and importlib.util.find_spec(case.needs) is None:
            why_not = (f"{case.needs} is not installed here (scripts/test.sh installs it into .frameworks: put that "
                       "folder on PYTHONPATH)")
        if why_not:
            console.print(f"layout {case.name}: skipped: {why_not}")
            rows.append(LayoutRow(case, ftrun=[], torchrun=[], torch_ddp=[], skipped=why_not))
            continue
        console.print(f"[bold]layout {case.name}[/bold]: {case.description}")
        if case.start:  # no fault: only the start is measured
            case_scenario = replace(case_scenario, fault_free=True, steps=START_STEPS)
        fault_free: list[RunResult | None] = [None, None]
        if case.link_cut:  # the final checkpoint each launcher's runs must end with
            fault_free = run_scenario(replace(case_scenario, link_cut=False, fault_free=True),
                                      [fault_free_launcher(launcher) for launcher in launchers[:2]], work_root)
        runs = [run_scenario(case_scenario, launchers, work_root, repeat, reverse=repeat % 2 == 1)
                for repeat in range(repeats)]
        by_launcher = [[repeat[i] for repeat in runs] for i in range(len(launchers))]
        rows.append(LayoutRow(case, ftrun=by_launcher[1], torchrun=by_launcher[0],
                              torch_ddp=by_launcher[2] if reference else [], ftrun_fault_free=fault_free[1],
                              torchrun_fault_free=fault_free[0]))
    return rows


def layout_scenario(case: LayoutCase, scenario: Scenario) -> Scenario:
    """The command line's scenario with what the case sets itself: its fault, its step, its shape."""
    nnodes, nproc_per_node = case.shape or (scenario.nnodes, scenario.nproc_per_node)
    kill_rank = (case.fault_rank if case.fault_rank is not None
                 else nnodes * nproc_per_node - 1 if case.shape else scenario.kill_rank)
    return replace(scenario, nnodes=nnodes, nproc_per_node=nproc_per_node, kill_rank=kill_rank,
                   kill_all=case.kill_all, kill_stagger=case.kill_stagger, link_cut=case.link_cut,
                   kill_at_step=case.kill_at_step or scenario.kill_at_step,
                   step_sleep=scenario.step_sleep if case.step_sleep is None else case.step_sleep)


def fault_free_launcher(launcher: Launcher) -> Launcher:
    return replace(launcher, name=f"{launcher.name}-fault-free", description=f"{launcher.description}, no fault")


def goal_text(value: float | None, goal: float, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}x ({'met' if value <= goal else 'missed'})"


def print_layouts_table(rows: list[LayoutRow], scenario: Scenario, repeats: int) -> None:
    for row in rows:
        if row.case.link_cut:
            print_link_cut(row, layout_scenario(row.case, scenario), repeats)
        if row.case.start:
            print_start(row, layout_scenario(row.case, scenario), repeats)
    rows = [row for row in rows if not (row.case.link_cut or row.case.start)]
    if not rows:
        return
    title = (f"Process-level recovery by layout: {scenario.shape}, rank {scenario.kill_rank} SIGKILLed after step "
             f"{scenario.kill_at_step} (all-lost: every rank after step 25), disk checkpoint every {scenario.ckpt_every} "
             f"steps, median step after the first {scenario.warmup_s:g} s"
             + (f", medians of {repeats} runs each" if repeats > 1 else ""))
    table = Table(title=title, caption=f"goals: regain <= 0.1x torchrun's (all-lost 0.7x); steps redone 0 "
                                        f"(snapshots: <= K); median step <= {STEP_TIME_GOAL}x")
    for header in ("layout", "regain ftrun / torchrun (s)", "regain ratio", "steps redone ftrun / torchrun",
                   "healthy pids kept", "median step ftrun / torchrun (ms)", "step ratio", "outcome"):
        table.add_column(header, justify="left" if header in ("layout", "outcome") else "right")
    for row in rows:
        redone = row.most_redone(row.ftrun)
        redone_cell = "-" if redone is None else f"{redone}{'' if redone <= row.case.redone_goal else ' (missed)'}"
        torchrun_redone = row.most_redone(row.torchrun)
        ftrun_step, torchrun_step = (median_of(runs, "median_step_s") for runs in (row.ftrun, row.torchrun))
        outcomes = sorted({run.outcome_text() for run in (*row.ftrun, *row.torchrun, *row.torch_ddp)})
        table.add_row(
            f"{row.case.name}: {row.case.description}",
            f"{seconds(median_of(row.ftrun, 'regain_progress_s'))} / {seconds(median_of(row.torchrun, 'regain_progress_s'))}",
            goal_text(row.regain_ratio, row.case.regain_goal, 3),
            f"{redone_cell} / {'-' if torchrun_redone is None else torchrun_redone}",
            ", ".join(yes_no(run.healthy_pids_kept) for run in row.ftrun),
            f"{milliseconds(ftrun_step)} / {milliseconds(torchrun_step)}",
            goal_text(row.step_ratio, STEP_TIME_GOAL, 3),
            ", ".join(outcomes),
        )
    console.print(table)
    for row in rows:
        if row.torch_ddp:
            console.print(f"{row.case.name}: job.ddp() under ftrun against torch DDP (train_ddp.py) under torchrun: "
                          f"median step {milliseconds(median_of(row.ftrun, 'median_step_s'))} / "
                          f"{milliseconds(median_of(row.torch_ddp, 'median_step_s'))} ms = "
                          f"{goal_text(row.step_ratio_vs_torch_ddp, STEP_TIME_GOAL, 3)}")
    for row in rows:
        for run in row.ftrun:
            for line in run.repair_lines:
                console.print(f"{row.case.name}: {line}")


def milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def met(value: bool | None) -> str:
    return "-" if value is None else "met" if value else "missed"


def print_start(row: LayoutRow, scenario: Scenario, repeats: int) -> None:
    """The start's row: each launcher's launch to first step, run by run, and ftrun's over torchrun's."""
    table = Table(title=f"Launch to the first step: {scenario.shape}, job.ddp(), no fault, {START_STEPS} steps"
                        + (f", medians of {repeats} runs each, alternating" if repeats > 1 else ""),
                  caption=f"goal: ftrun's at most {START_GOAL:g}x torchrun's in the same run")
    for header in ("launcher", "launch to first step (s)", "each run (s)", "outcome"):
        table.add_column(header, justify="left" if header in ("launcher", "outcome") else "right")
    for runs in (row.ftrun, row.torchrun):
        if runs:
            table.add_row(runs[0].description, seconds(median_of(runs, "launch_to_first_step_s")),
                          ", ".join(seconds(run.launch_to_first_step_s) for run in runs),
                          ", ".join(sorted({run.outcome_text() for run in runs})))
    console.print(table)
    each = ", ".join("-" if value is None else f"{value:.2f}x" for value in row.start_ratios())
    console.print(f"{row.case.name}: ftrun / torchrun, launch to first step: {goal_text(row.start_ratio, START_GOAL)} "
                  f"(medians); each repeat: {each}")


def print_link_cut(row: LayoutRow, scenario: Scenario, repeats: int) -> None:
    """The online level's row: a table of each launcher's runs, ftrun over torchrun, the goals, what ftrun decided."""
    if row.skipped:
        console.print(f"{row.case.name}: skipped: {row.skipped}")
        return
    table = Table(
        title=f"Online level: rank {scenario.kill_rank}'s connections to the other ranks reset (ss -K) once every rank "
              f"finished step {scenario.kill_at_step}, {scenario.shape}, job.ddp(), checkpoint every {scenario.ckpt_every} "
              f"steps" + (f", medians of {repeats} runs" if repeats > 1 else ""),
        caption=f"goal: ftrun stands still <= {LINK_CUT_GOAL_S:g} s, starts no process, ends bit-identical to a "
                f"fault-free run")
    for header in ("launcher", "stand-still (s)", "each run (s)", "processes started", "steps redone", "pids kept",
                   "bit-identical", "level", "median step (ms)", "outcome"):
        table.add_column(header, justify="left" if header in ("launcher", "level", "outcome") else "right")
    for runs, fault_free in ((row.ftrun, row.ftrun_fault_free), (row.torchrun, row.torchrun_fault_free)):
        if not runs:
            continue
        redone = row.most_redone(runs)
        table.add_row(
            runs[0].description, seconds(median_of(runs, "regain_progress_s")),
            ", ".join(regain_text(run) for run in runs),
            ", ".join(str(len(run.started_after_fault)) for run in runs),
            "-" if redone is None else str(redone),
            ", ".join(yes_no(run.healthy_pids_kept) for run in runs),
            ", ".join(yes_no(same) for same in row.bit_identical(runs, fault_free)),
            ", ".join(recovery_level(run.decision_lines) for run in runs) if runs is row.ftrun else "-",
            milliseconds(median_of(runs, "median_step_s")),
            ", ".join(sorted({run.outcome_text() for run in runs})),
        )
    console.print(table)
    goals = row.link_cut_goals()
    console.print(f"{row.case.name}: stand-still ftrun / torchrun: {seconds(median_of(row.ftrun, 'regain_progress_s'))} / "
                  f"{seconds(median_of(row.torchrun, 'regain_progress_s'))} s = "
                  f"{'-' if row.regain_ratio is None else f'{row.regain_ratio:.3f}x'}; ftrun's goals: stand-still <= "
                  f"{LINK_CUT_GOAL_S:g} s {met(goals['stand_still'])}, no process started {met(goals['no_process_started'])}, "
                  f"bit-identical {met(goals['bit_identical'])}")
    console.print(f"{row.case.name}: connections reset per run: ftrun "
                  f"{', '.join(str(run.links_cut) for run in row.ftrun)}; torchrun "
                  f"{', '.join(str(run.links_cut) for run in row.torchrun)}; the fault-free runs of both launchers end "
                  f"with the same checkpoint: {yes_no(fault_free_runs_agree(row))}")
    for index, run in enumerate(row.ftrun, start=1):
        for line in (*run.decision_lines, *run.repair_lines):
            console.print(f"{row.case.name}: ftrun run {index}: {line}")
        for process in run.started_after_fault:
            console.print(f"{row.case.name}: ftrun run {index}: started after the cut: {process}")


# --- --controller-loss: the controller's node lost, under c10d and under etcd ----------------------


@dataclass(frozen=True)
class ControllerLossRow:
    """The row "controller's node lost, spare": the job under c10d, where the store goes with node 0 and
    the job ends, against the same job under etcd, where another agent takes the controller's office over
    and the spare takes node 0's place."""

    c10d: RunResult
    etcd: RunResult
    node_timeout: float

    NAME = "controller's node lost, spare"

    @property
    def goal_s(self) -> float:
        return self.node_timeout + CONTROLLER_LOSS_MARGIN_S

    @property
    def goal_met(self) -> bool | None:
        regain = self.etcd.regain_progress_s
        return None if regain is None else regain <= self.goal_s

    def to_json(self) -> dict:
        return {"row": self.NAME, "goal_regain_s": self.goal_s, "goal_met": self.goal_met,
                "c10d": asdict(self.c10d), "etcd": asdict(self.etcd)}


def print_controller_loss(row: ControllerLossRow, scenario: Scenario) -> None:
    table = Table(title=f"The controller's node lost: {scenario.shape}, 1 spare, --node-timeout {row.node_timeout:g}, "
                        f"--recovery process, once every rank passed step {scenario.kill_at_step}",
                  caption=f"goal: under etcd, training regained within {row.goal_s:g} s (--node-timeout + "
                          f"{CONTROLLER_LOSS_MARGIN_S:g} s)")
    for header in ("fault", "c10d (the default)", "etcd: regain (s)", "goal", "steps redone", "healthy pids kept",
                   "etcd outcome"):
        table.add_column(header, justify="right" if header in ("etcd: regain (s)", "steps redone") else "left")
    table.add_row(row.NAME, row.c10d.outcome_text(), regain_text(row.etcd),
                  "-" if row.goal_met is None else "met" if row.goal_met else "missed",
                  "-" if row.etcd.steps_redone is None else str(row.etcd.steps_redone),
                  yes_no(row.etcd.healthy_pids_kept), row.etcd.outcome_text())
    console.print(table)
    for line in row.c10d.lost_controller_lines:
        console.print(f"c10d: {line}")
    for line in row.etcd.repair_lines:
        console.print(f"etcd: {line}")


# --- command line ---------------------------------------------------------------------------------


# --- MindSpore: ftrun from snapshots against msrun re-run from the script's checkpoint ----------------------


def mindspore_command(scenario: Scenario, workdir: Path, fault: bool) -> list[str]:
    """train_mindspore.py's own arguments (``fault``: with the kill)."""
    kill = ["--kill-rank", str(scenario.kill_rank), "--kill-at-step", str(scenario.kill_at_step)] if fault else []
    return [str(EXAMPLES / "train_mindspore.py"), "--steps", str(scenario.steps), "--ckpt-dir", str(workdir / "checkpoints"),
            "--ckpt-every", str(scenario.ckpt_every), "--progress", str(workdir / "progress.txt"),
            "--step-sleep", str(scenario.step_sleep), *kill]


def run_mindspore_once(name: str, commands: list[list[str]], env: dict, workdir: Path, deadline: float
                       ) -> tuple[float, list[int | None]]:
    """Run ``commands`` one after the other (each once the one before exited), within ``deadline`` seconds
    in all; the launch time and each one's exit code (None: killed at the deadline, and the rest not run)."""
    workdir.mkdir(parents=True, exist_ok=True)
    marker = uuid.uuid4().hex
    env = {**env, MARKER_VARIABLE: marker}
    launch_time, codes, processes = time.time(), [], []
    end = time.monotonic() + deadline
    try:
        for attempt, command in enumerate(commands):
            with open(workdir / f"{name}{attempt}.log", "wb") as log:
                process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
            processes.append(process)
            while process.poll() is None and time.monotonic() < end:
                time.sleep(0.1)
            codes.append(process.poll())
            if codes[-1] is None:
                break
            kill_everything([process], MARKER_VARIABLE, marker)  # what msrun left behind, before its re-run
        return launch_time, codes
    finally:
        kill_everything(processes, MARKER_VARIABLE, marker)


def run_mindspore(scenario: Scenario, python: Path, snapshot_every: int, work_root: Path) -> dict:
    """--mindspore: the same script under ftrun (job level, from snapshots) and under msrun (re-run from the
    script's checkpoint once it exits)."""
    python = python.absolute()
    msrun = python.parent / "msrun"
    if not python.exists() or not msrun.exists():
        sys.exit(f"bench_recovery --mindspore: no MindSpore python at {python} (scripts/test.sh makes .msvenv), "
                 "or no msrun beside it")
    workers = scenario.nproc_per_node
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # msrun runs `python`
    results = {}
    for name in ("ftrun", "msrun"):
        workdir = work_root / f"mindspore-{name}"
        started = time.monotonic()
        if name == "ftrun":
            flags = [find_program("ftrun", "bench_recovery"), f"--worker_num={workers}",
                     f"--local_worker_num={workers}", f"--master_port={free_port()}", "--join=True",
                     "--python", str(python), "--max-restarts", str(scenario.max_restarts),
                     "--snapshot-every", str(snapshot_every), "--status", "plain"]
            commands = [[*flags, *mindspore_command(scenario, workdir, fault=True)]]
        else:
            def msrun_command(fault: bool) -> list[str]:
                return [str(msrun), f"--worker_num={workers}", f"--local_worker_num={workers}",
                        f"--master_port={free_port()}", "--join=True", f"--log_dir={workdir / 'msrun_logs'}",
                        *mindspore_command(scenario, workdir, fault)]
            commands = [msrun_command(True), msrun_command(False)]
        console.print(f"[bold]{name}[/bold] (MindSpore), 1 node x {workers} workers: running, deadline "
                      f"{scenario.deadline:g} s")
        launch_time, codes = run_mindspore_once(name, commands, env, workdir, scenario.deadline)
        # msrun's first run fails by design (a rank was killed); only its re-run must succeed
        exit_codes = codes[-1:] if name == "msrun" and len(codes) == 2 else codes
        result = analyse(Launcher(name, name, name, ()), scenario, launch_time, exit_codes,
                         read_progress(workdir / "progress.txt"), time.monotonic() - started, None)
        console.print(f"  {result.outcome_text()} in {result.wall_s:.1f} s (exit codes {codes})")
        results[name] = result
    mine, theirs = results["ftrun"].regain_progress_s, results["msrun"].regain_progress_s
    results["ratio"] = ratio(mine, theirs)
    return results


def print_mindspore(row: dict, scenario: Scenario, snapshot_every: int) -> None:
    table = Table(title=f"MindSpore, 1 node x {scenario.nproc_per_node} workers, rank {scenario.kill_rank} SIGKILLed "
                        f"after step {scenario.kill_at_step}")
    for column in ("launcher", "outcome", "regain progress (s)", "steps redone", "median step (s)"):
        table.add_column(column)
    labels = {"ftrun": f"ftrun --framework mindspore --snapshot-every {snapshot_every} (job level, from snapshots)",
              "msrun": f"msrun, re-run from the script's checkpoint (every {scenario.ckpt_every} steps)"}
    for name in ("ftrun", "msrun"):
        result = row[name]
        table.add_row(labels[name], result.outcome_text(), seconds(result.regain_progress_s),
                      "-" if result.steps_redone is None else str(result.steps_redone),
                      "-" if result.median_step_s is None else f"{result.median_step_s:.4f}")
    console.print(table)
    console.print(f"ftrun's regain progress over msrun's: {goal_text(row['ratio'], MINDSPORE_GOAL)}")


def node_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("expected node counts like 2,4,8")
    return counts


def layout_names(text: str) -> list[str]:
    names = list(LAYOUT_NAMES) if text == "all" else [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in LAYOUT_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from all, {', '.join(LAYOUT_NAMES)}")
    return names


def parse_args() -> tuple[argparse.Namespace, list[Scenario], list[Launcher]]:
    single, scaling = SINGLE_DEFAULTS, SCALING_DEFAULTS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", metavar="A,B",
                        help=f"comma-separated, from: {','.join(LAUNCHERS)} (default: all; with --scaling: "
                             f"{','.join(scaling.launchers)})")
    parser.add_argument("--nnodes", type=int, metavar="N", help="simulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, metavar="N", help="ranks per node (default 2)")
    parser.add_argument("--scaling", type=node_counts, metavar="N,N",
                        help="instead of one run per launcher, one for each of these node counts, 1 rank per node")
    parser.add_argument("--node-loss", type=node_counts, metavar="N,N",
                        help="lose the last of N nodes (1 rank each) for each N in the list; ftrun gets a spare")
    parser.add_argument("--node-timeout", type=float, default=3.0, metavar="SECONDS",
                        help="--node-loss, --controller-loss: ftrun's --node-timeout (default 3)")
    parser.add_argument("--regain-deadline", type=float, default=45.0, metavar="SECONDS",
                        help="--node-loss: a run not training past the fault this long after it fails (default 45)")
    parser.add_argument("--steps", type=int, metavar="N",
                        help=f"steps of training (default {single.steps}; with --scaling {scaling.steps})")
    parser.add_argument("--ckpt-every", type=int, default=10, metavar="K", help="checkpoint every K steps (default 10)")
    parser.add_argument("--kill-at-step", type=int, metavar="S",
                        help=f"the fault comes after this step (default 25; with --layouts {LAYOUTS_DEFAULTS.kill_at_step}, "
                             "all-lost 25)")
    parser.add_argument("--warmup", type=float, metavar="SECONDS",
                        help="the median step leaves out the steps of the first SECONDS after the first step "
                             f"(default 0; with --layouts {LAYOUTS_DEFAULTS.warmup_s:g})")
    parser.add_argument("--kill-rank", type=int, metavar="R",
                        help="the rank to kill (default: the last, on the last node)")
    parser.add_argument("--step-sleep", type=float, metavar="SECONDS",
                        help=f"sleep after each step (default {single.step_sleep:g}; with --scaling {scaling.step_sleep:g})")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help=f"a run still going after this long counts as hung (default {single.deadline:g}; "
                             f"with --scaling {scaling.deadline:g})")
    parser.add_argument("--controller-loss", action="store_true",
                        help="instead: lose node 0, which hosts the store and the controller, with a spare standing "
                             "by, under ftrun's c10d (the job ends) and under --rdzv-backend etcd (a 3-member "
                             "cluster on loopback; training goes on)")
    parser.add_argument("--status-overhead", type=int, default=0, metavar="N",
                        help="instead: N runs each of ftrun --recovery process with --status off and with --status "
                             "live and the event log, alternating; compares their median step")
    parser.add_argument("--layouts", type=layout_names, metavar="A,B",
                        help=f"instead: a row per layout ({','.join(LAYOUT_NAMES)}, or all), each script under "
                             "ftrun --recovery process and torchrun-noshare")
    parser.add_argument("--snapshot-every", type=int, default=5, metavar="K",
                        help="--layouts: ftrun's --snapshot-every for FSDP's full shard and all-lost (default 5)")
    parser.add_argument("--kill-stagger", type=float, default=0.5, metavar="SECONDS",
                        help="--layouts all-lost-staggered: the other ranks die over this many seconds after the "
                             "last (default 0.5)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="--layouts: N runs of each launcher per layout, alternating; medians reported (default 1)")
    parser.add_argument("--stragglers", action="store_true",
                        help="instead: a slow rank (scripts/straggler_rows.py): torchrun, and ftrun fault-free, with "
                             "--stragglers report and with --stragglers replace and a spare")
    parser.add_argument("--slow-by", type=float, default=0.15, metavar="SECONDS",
                        help="--stragglers: the slow rank's extra seconds a step (default 0.15)")
    parser.add_argument("--slow-from", type=int, default=30, metavar="S",
                        help="--stragglers: the step its slowdown begins at (default 30)")
    parser.add_argument("--dark-link", action="store_true",
                        help="instead: a data link that goes dark on the cluster-shaped test bed "
                             "(scripts/bench_dark_link.py; needs root): ftrun with no spare, with a spare, a silent "
                             "link, torchrun, the link never back with no spare (ended, or left out), a silent link "
                             "with a spare")
    parser.add_argument("--dark-for", type=float, default=20.0, metavar="SECONDS",
                        help="--dark-link: how long the link stays dark where it comes back (default 20)")
    parser.add_argument("--mindspore", action="store_true",
                        help="instead: the MindSpore row, ftrun (job level from snapshots) against msrun re-run from "
                             "the script's checkpoint")
    parser.add_argument("--ms-python", type=Path, default=REPO / ".msvenv" / "bin" / "python", metavar="PYTHON",
                        help="--mindspore: the python that has mindspore (default .msvenv/bin/python; msrun beside it)")
    parser.add_argument("--json", default="-", metavar="FILE", help="where the JSON results go; - for stdout (default)")
    parser.add_argument("--work-dir", type=Path, metavar="DIR",
                        help="a new folder to keep logs, progress files and checkpoints in (default: a temporary one)")
    args = parser.parse_args()

    if args.status_overhead and (args.scaling or args.node_loss or args.launchers):
        parser.error("--status-overhead runs its own pair of launchers, on one job shape: drop --scaling, "
                     "--node-loss and --launchers")
    if args.layouts and (args.scaling or args.node_loss or args.launchers or args.status_overhead):
        parser.error("--layouts runs its own launchers per layout: drop --scaling, --node-loss, --launchers and "
                     "--status-overhead")
    if args.controller_loss and (args.scaling or args.node_loss or args.launchers or args.status_overhead
                                 or args.layouts):
        parser.error("--controller-loss runs its own pair of launchers: drop --scaling, --node-loss, --launchers, "
                     "--status-overhead and --layouts")
    if args.mindspore and (args.scaling or args.node_loss or args.launchers or args.status_overhead
                           or args.layouts or args.controller_loss or (args.nnodes or 1) != 1):
        parser.error("--mindspore runs its own pair of launchers on one node: drop --scaling, --node-loss, "
                     "--launchers, --status-overhead, --layouts, --controller-loss and --nnodes")
    if args.dark_link and (args.scaling or args.node_loss or args.launchers or args.status_overhead or args.layouts
                           or args.controller_loss or args.mindspore or args.stragglers or args.nnodes
                           or args.nproc_per_node):
        parser.error("--dark-link runs its own launchers at 2 x 2 on the test bed: drop --scaling, --node-loss, "
                     "--launchers, --status-overhead, --layouts, --controller-loss, --mindspore, --stragglers, "
                     "--nnodes and --nproc-per-node")
    if args.dark_link and not args.dark_for > 0:
        parser.error(f"--dark-for {args.dark_for:g}: give a number of seconds above 0")
    if args.scaling and args.node_loss:
        parser.error("--scaling and --node-loss are two sweeps: give one")
    sweep = args.scaling or args.node_loss
    defaults = (scaling if sweep else LAYOUTS_DEFAULTS if args.layouts else MINDSPORE_DEFAULTS if args.mindspore
                else CONTROLLER_LOSS_DEFAULTS if args.controller_loss else single)
    names = [name.strip() for name in args.launchers.split(",") if name.strip()] if args.launchers else defaults.launchers
    unknown = [name for name in names if name not in LAUNCHERS]
    if unknown or not (names or args.mindspore):  # --mindspore: its own pair (run_mindspore)
        parser.error(f"unknown launcher {', '.join(unknown)}; choose from {', '.join(LAUNCHERS)}")
    if len(set(names)) < len(names):
        parser.error("--launchers names a launcher twice: each has one work folder and one row")
    if sweep and (args.nnodes or args.nproc_per_node or args.kill_rank is not None):
        parser.error("--scaling and --node-loss set the nodes (1 rank each) and kill the last: drop --nnodes, "
                     "--nproc-per-node and --kill-rank")
    shapes = [(nnodes, 1) for nnodes in sweep] if sweep else [(args.nnodes or (1 if args.mindspore else 2),
                                                                args.nproc_per_node or 2)]
    steps = args.steps or defaults.steps
    args.kill_at_step = args.kill_at_step or defaults.kill_at_step
    if not 0 < args.kill_at_step < steps:
        parser.error("--kill-at-step must be between 1 and --steps - 1")
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: old progress files would spoil the measurements")
    scenarios = []
    for nnodes, nproc_per_node in shapes:
        world_size = nnodes * nproc_per_node
        kill_rank = world_size - 1 if args.kill_rank is None else args.kill_rank
        if not 0 <= kill_rank < world_size:
            parser.error(f"--kill-rank must be below the world size, {world_size}")
        scenarios.append(Scenario(
            nnodes=nnodes, nproc_per_node=nproc_per_node, steps=steps, ckpt_every=args.ckpt_every,
            kill_rank=kill_rank, kill_at_step=args.kill_at_step,
            step_sleep=defaults.step_sleep if args.step_sleep is None else args.step_sleep,
            deadline=args.deadline or defaults.deadline,
            node_loss=bool(args.node_loss or args.controller_loss), controller_loss=args.controller_loss,
            node_timeout=args.node_timeout, regain_deadline=args.regain_deadline,
            warmup_s=defaults.warmup_s if args.warmup is None else args.warmup,
        ))
    return args, scenarios, [LAUNCHERS[name] for name in names]


def raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so a SIGTERM cleans up the way Ctrl-C does


def run_scenario(scenario: Scenario, launchers: list[Launcher], work_root: Path, repeat: int = 0,
                 reverse: bool = False) -> list[RunResult]:
    """One run of each launcher, in turn (``reverse``: from the last), the results in ``launchers``' order."""
    results: list[RunResult] = []
    for launcher in reversed(launchers) if reverse else launchers:
        console.print(f"[bold]{launcher.description}[/bold], {scenario.shape}: running, "
                      f"deadline {scenario.deadline:g} s")
        workdir = work_root / f"{launcher.name}-{scenario.nnodes}x{scenario.nproc_per_node}-{repeat}"
        if scenario.spares(launcher):
            console.print("  with one spare node")
        result = benchmark(launcher, scenario, workdir)
        # each run's figures as it ends: a benchmark stopped early (a device's lease ran out) keeps them
        step = f", median step {result.median_step_s * 1000:.1f} ms" if result.median_step_s else ""
        regain = f", progress regained in {result.regain_progress_s:.2f} s" if result.regain_progress_s else ""
        console.print(f"  {result.outcome_text()} in {result.wall_s:.1f} s{step}{regain}")
        results.append(result)
    return compare_with_baseline(results[::-1] if reverse else results)


def status_overhead(results: list[RunResult]) -> dict:
    """--status-overhead: the median of each launcher's median steps, and live over off."""
    medians = {name: [r.median_step_s for r in results if r.launcher == name and r.median_step_s] for name in STATUS_PAIR}
    summary = {name: statistics.median(values) if values else None for name, values in medians.items()}
    off, live = (summary[name] for name in STATUS_PAIR)
    return {"median_step_s": summary, "runs": medians, "overhead": live / off - 1 if off and live else None}


def print_status_overhead(overhead: dict) -> None:
    table = Table(title="status view and event log: median step time (s), runs alternating")
    table.add_column("launcher")
    table.add_column("median step of each run")
    table.add_column("median", justify="right")
    for name in STATUS_PAIR:
        median = overhead["median_step_s"][name]
        table.add_row(LAUNCHERS[name].description, ", ".join(f"{v:.4f}" for v in overhead["runs"][name]),
                      "-" if median is None else f"{median:.4f}")
    console.print(table)
    if overhead["overhead"] is not None:
        console.print(f"overhead of --status live with the event log: {overhead['overhead']:+.2%} (goal: under 1%)")


def main() -> int:
    args, scenarios, launchers = parse_args()
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_recovery-"))
    results_by_scenario = []
    try:
        if args.status_overhead:
            runs = [run_scenario(scenarios[0], [LAUNCHERS[n] for n in STATUS_PAIR], work_root, repeat)
                    for repeat in range(args.status_overhead)]
            results = [result for pair in runs for result in pair]
            overhead = status_overhead(results)
            print_status_overhead(overhead)
            write_json(results, scenarios, [], args.json, {"status_overhead": overhead})
            return 0
        if args.controller_loss:
            c10d, etcd = run_scenario(scenarios[0], [LAUNCHERS[name] for name in CONTROLLER_PAIR], work_root)
            row = ControllerLossRow(c10d, etcd, scenarios[0].node_timeout)
            print_table([c10d, etcd], scenarios[0])
            print_controller_loss(row, scenarios[0])
            write_json([c10d, etcd], scenarios, [], args.json, {"controller_loss": row.to_json()})
            return 0
        if args.mindspore:
            row = run_mindspore(scenarios[0], args.ms_python, args.snapshot_every, work_root)
            print_mindspore(row, scenarios[0], args.snapshot_every)
            write_json([row["ftrun"], row["msrun"]], scenarios, [], args.json,
                       {"mindspore": {"regain_ratio": row["ratio"]}})
            return 0
        if args.stragglers:
            import straggler_rows

            case = straggler_rows.StragglerCase(steps=args.steps or 160, slow_from=args.slow_from, slow_by=args.slow_by)
            rows = straggler_rows.run_straggler_rows(case, work_root, checkpoint_digest, say=console.print)
            straggler_rows.print_straggler_rows(rows, case, console)
            write_json([], scenarios, [], args.json, {"stragglers": straggler_rows.rows_json(rows, case)})
            return 0
        if args.dark_link:
            import bench_dark_link

            if os.geteuid() != 0:
                console.print("--dark-link: the test bed's network namespaces need root")
                return 2
            case = bench_dark_link.DarkLinkCase(repeat=args.repeat, steps=args.steps or 40, dark_for=args.dark_for,
                                                step_sleep=0.1 if args.step_sleep is None else args.step_sleep)
            rows = bench_dark_link.run_rows(case, work_root)
            bench_dark_link.print_rows(rows, case, console)
            write_json([], scenarios, [], args.json, {"dark_link": bench_dark_link.rows_json(rows, case)})
            return 0
        if args.layouts:
            cases = layout_cases(args.snapshot_every, args.kill_stagger)
            rows = run_layouts([cases[name] for name in args.layouts], scenarios[0], work_root, args.repeat)
            print_layouts_table(rows, scenarios[0], args.repeat)
            write_json([], scenarios, [], args.json, {"layouts": [row.to_json() for row in rows]})
            return 0
        for scenario in scenarios:
            results_by_scenario.append(run_scenario(scenario, launchers, work_root))
    except KeyboardInterrupt:
        console.print("interrupted: every process started has been killed")
        return 130
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
        else:
            console.print(f"logs, progress files and checkpoints kept in {work_root}")
    for scenario, results in zip(scenarios, results_by_scenario):
        print_table(results, scenario)
    all_results = [result for results in results_by_scenario for result in results]
    if args.scaling or args.node_loss:
        print_scaling_table(all_results, scenarios, launchers)
    write_json(all_results, scenarios, launchers, args.json)
    return 0  # the measurements are the result: a launcher that hangs is a finding, not an error


if __name__ == "__main__":
    sys.exit(main())
