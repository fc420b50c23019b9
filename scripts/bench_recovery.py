"""How fast does a launcher get a DDP job going again after one rank dies?

Runs the reference job (scripts/examples/train_ddp.py: CPU, gloo, a 16 MB MLP, a checkpoint every
--ckpt-every steps) as --nnodes simulated nodes of --nproc-per-node ranks on loopback, one launcher
process per "node", and has one rank SIGKILL itself after step --kill-at-step. It does this under each
launcher in turn, on the same machine:

  torchrun           torchrun --rdzv-backend c10d, defaults (workers share the agent's store)
  torchrun-noshare   the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  ftrun              ftrun --recovery job

Every rank appends "<time> <rank> <step> <pid> <restart count>" to a progress file after each step.
From it, per launcher:

  regain progress    seconds from the fault (the killed rank's line for the kill step, written just
                     before it kills itself) until every rank has finished a step past the kill step
  steps redone       the kill step minus the step the restarted ranks resumed after
  median step        median time between rank 0's steps before the fault (steady state)
  launch to step 1   seconds from starting the launchers to the first finished step
  outcome            ok, failed (exit codes), or hung (still running at --deadline, then killed)

    .venv/bin/python scripts/bench_recovery.py --launchers torchrun-noshare,ftrun --json results.json

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default); the exit status is
0 once every launcher has been measured, whatever its outcome (130 if interrupted). Every process it
starts carries a marker in its environment; on the way out (also on Ctrl-C) it kills the launchers'
process groups and every marked process left, since launchers put their workers in sessions of their own.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO / "scripts" / "examples" / "train_ddp.py"
MARKER_VARIABLE = "FTRUN_BENCH_RECOVERY_MARKER"
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)  # a log gets the table unwrapped


@dataclass(frozen=True)
class Launcher:
    name: str
    description: str
    program: str  # an executable next to this Python's, or on PATH
    extra_args: tuple[str, ...]
    extra_env: tuple[tuple[str, str], ...] = ()


LAUNCHERS = {
    launcher.name: launcher
    for launcher in (
        Launcher("torchrun", "torchrun, defaults", "torchrun", ("--rdzv-backend", "c10d")),
        Launcher(
            "torchrun-noshare", "torchrun, shared store disabled", "torchrun", ("--rdzv-backend", "c10d"),
            (("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
        ),
        Launcher("ftrun", "ftrun --recovery job", "ftrun", ("--recovery", "job")),
    )
}


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


@dataclass(frozen=True)
class ProgressLine:
    time: float
    rank: int
    step: int
    pid: int
    restart_count: int


@dataclass
class RunResult:
    launcher: str
    description: str
    outcome: str  # "ok", "failed", or "hung"
    exit_codes: list[int | None]  # one per launcher process; None: still running at the deadline
    last_step: int | None  # the highest step any rank finished
    resumed_after_step: int | None
    steps_redone: int | None
    regain_progress_s: float | None
    median_step_s: float | None
    launch_to_first_step_s: float | None
    wall_s: float

    def outcome_text(self) -> str:
        if self.outcome == "ok":
            return "ok"
        details = [f"last step {self.last_step}"]
        if any(code is not None for code in self.exit_codes):
            details.insert(0, "exit " + ", ".join("-" if code is None else str(code) for code in self.exit_codes))
        return f"{self.outcome}: {'; '.join(details)}"


# --- running a launcher ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_program(name: str) -> str:
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if not found:
        sys.exit(f"bench_recovery: cannot find {name} next to {sys.executable} or on PATH")
    return found


def launcher_command(launcher: Launcher, scenario: Scenario, port: int, run_id: str, workdir: Path) -> list[str]:
    return [
        find_program(launcher.program),
        "--nnodes", str(scenario.nnodes),
        "--nproc-per-node", str(scenario.nproc_per_node),
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", run_id,
        "--max-restarts", str(scenario.max_restarts),
        *launcher.extra_args,
        str(TRAIN_SCRIPT),
        "--steps", str(scenario.steps),
        "--ckpt-dir", str(workdir / "checkpoints"),
        "--ckpt-every", str(scenario.ckpt_every),
        "--progress", str(workdir / "progress.txt"),
        "--kill-rank", str(scenario.kill_rank),
        "--kill-at-step", str(scenario.kill_at_step),
        "--step-sleep", str(scenario.step_sleep),
    ]


def kill_everything(processes: list[subprocess.Popen], marker: str) -> None:
    """SIGKILL the launchers' process groups and every process that carries `marker`, then reap."""
    interrupts = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, interrupts)  # a second Ctrl-C waits until this is done
    try:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # each launcher leads its own group (start_new_session)
            except ProcessLookupError:
                pass
        marked = []
        for candidate in psutil.process_iter():
            try:
                if candidate.environ().get(MARKER_VARIABLE) == marker:
                    candidate.kill()
                    marked.append(candidate)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        psutil.wait_procs(marked, timeout=10)
        for process in processes:
            process.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, interrupts)


def run_launcher(launcher: Launcher, scenario: Scenario, workdir: Path) -> tuple[float, list[int | None]]:
    """Start one launcher process per node, wait for all to exit or the deadline, kill what is left.

    Returns the launch time (Unix seconds) and the exit codes, None for a process still running at the
    deadline.
    """
    port, run_id, marker = free_port(), f"bench-{launcher.name}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    env = {**os.environ, **dict(launcher.extra_env), MARKER_VARIABLE: marker}
    command = launcher_command(launcher, scenario, port, run_id, workdir)
    processes: list[subprocess.Popen] = []
    launch_time = time.time()
    try:
        for node in range(scenario.nnodes):
            with open(workdir / f"node{node}.log", "wb") as log:
                processes.append(subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                ))
        deadline = time.monotonic() + scenario.deadline
        while time.monotonic() < deadline and any(process.poll() is None for process in processes):
            time.sleep(0.2)
        return launch_time, [process.poll() for process in processes]
    finally:
        kill_everything(processes, marker)


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


def analyse(
    launcher: Launcher, scenario: Scenario, launch_time: float, exit_codes: list[int | None],
    lines: list[ProgressLine], wall_s: float,
) -> RunResult:
    fault = next(
        (line for line in lines if line.rank == scenario.kill_rank and line.step == scenario.kill_at_step), None
    )
    before_fault = [line for line in lines if fault is None or line.time <= fault.time]
    # Restarted ranks are new processes. (Their restart count is no guide: torchrun counts restarts per
    # agent, so the ranks of the node that did not fail come back with count 0.)
    first_attempt_pids = {line.pid for line in before_fault}
    restarted = [line for line in lines if line.pid not in first_attempt_pids]

    resumed_after = min(line.step for line in restarted) - 1 if restarted else None
    steps_redone = scenario.kill_at_step - resumed_after if resumed_after is not None else None

    regain_s = None
    if fault is not None:
        world_size = scenario.nnodes * scenario.nproc_per_node
        passed = {}  # rank -> when it first finished a step past the kill step
        for line in lines:
            if line.step > scenario.kill_at_step and line.time > fault.time:
                passed.setdefault(line.rank, line.time)
        if len(passed) == world_size:
            regain_s = max(passed.values()) - fault.time

    rank0_times = {line.step: line.time for line in before_fault if line.rank == 0}
    step_gaps = [rank0_times[step] - rank0_times[step - 1] for step in rank0_times if step - 1 in rank0_times]

    last_step = max((line.step for line in lines), default=None)
    if any(code is None for code in exit_codes):
        outcome = "hung"
    elif any(code != 0 for code in exit_codes) or last_step != scenario.steps:
        outcome = "failed"
    else:
        outcome = "ok"
    return RunResult(
        launcher=launcher.name,
        description=launcher.description,
        outcome=outcome,
        exit_codes=exit_codes,
        last_step=last_step,
        resumed_after_step=resumed_after,
        steps_redone=steps_redone,
        regain_progress_s=regain_s,
        median_step_s=statistics.median(step_gaps) if step_gaps else None,
        launch_to_first_step_s=lines[0].time - launch_time if lines else None,
        wall_s=wall_s,
    )


def benchmark(launcher: Launcher, scenario: Scenario, workdir: Path) -> RunResult:
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    launch_time, exit_codes = run_launcher(launcher, scenario, workdir)
    wall_s = time.monotonic() - started
    return analyse(launcher, scenario, launch_time, exit_codes, read_progress(workdir / "progress.txt"), wall_s)


# --- reporting ------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(results: list[RunResult], scenario: Scenario) -> None:
    table = Table(title=(
        f"Recovery after SIGKILL of rank {scenario.kill_rank} at step {scenario.kill_at_step}: "
        f"{scenario.nnodes} nodes x {scenario.nproc_per_node} ranks, checkpoint every {scenario.ckpt_every} steps"
    ))
    for header in ("launcher", "regain progress (s)", "steps redone", "median step (s)",
                   "launch to step 1 (s)", "wall (s)", "outcome"):
        table.add_column(header, justify="left" if header in ("launcher", "outcome") else "right")
    for result in results:
        table.add_row(
            result.description,
            "never" if result.regain_progress_s is None else seconds(result.regain_progress_s),
            "-" if result.steps_redone is None else str(result.steps_redone),
            seconds(result.median_step_s),
            seconds(result.launch_to_first_step_s),
            seconds(result.wall_s),
            result.outcome_text(),
        )
    console.print(table)


def write_json(results: list[RunResult], scenario: Scenario, destination: str) -> None:
    text = json.dumps({"scenario": asdict(scenario), "results": [asdict(result) for result in results]}, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")
        console.print(f"JSON written to {destination}")


# --- command line ---------------------------------------------------------------------------------


def parse_args() -> tuple[argparse.Namespace, Scenario, list[Launcher]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), metavar="A,B",
                        help="comma-separated, from: %(default)s (default: all)")
    parser.add_argument("--nnodes", type=int, default=2, metavar="N", help="simulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=2, metavar="N", help="ranks per node (default 2)")
    parser.add_argument("--steps", type=int, default=60, metavar="N", help="steps of training (default 60)")
    parser.add_argument("--ckpt-every", type=int, default=10, metavar="K", help="checkpoint every K steps (default 10)")
    parser.add_argument("--kill-at-step", type=int, default=25, metavar="S",
                        help="the fault comes after this step (default 25)")
    parser.add_argument("--kill-rank", type=int, metavar="R",
                        help="the rank to kill (default: the last, on the last node)")
    parser.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                        help="sleep after each step (default 0)")
    parser.add_argument("--deadline", type=float, default=90.0, metavar="SECONDS",
                        help="a run still going after this long counts as hung (default 90)")
    parser.add_argument("--json", default="-", metavar="FILE", help="where the JSON results go; - for stdout (default)")
    parser.add_argument("--work-dir", type=Path, metavar="DIR",
                        help="a new folder to keep logs, progress files and checkpoints in (default: a temporary one)")
    args = parser.parse_args()

    names = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = [name for name in names if name not in LAUNCHERS]
    if unknown or not names:
        parser.error(f"unknown launcher {', '.join(unknown)}; choose from {', '.join(LAUNCHERS)}")
    world_size = args.nnodes * args.nproc_per_node
    kill_rank = world_size - 1 if args.kill_rank is None else args.kill_rank
    if not 0 <= kill_rank < world_size:
        parser.error(f"--kill-rank must be below the world size, {world_size}")
    if not 0 < args.kill_at_step < args.steps:
        parser.error("--kill-at-step must be between 1 and --steps - 1")
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: old progress files would spoil the measurements")
    scenario = Scenario(
        nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, steps=args.steps, ckpt_every=args.ckpt_every,
        kill_rank=kill_rank, kill_at_step=args.kill_at_step, step_sleep=args.step_sleep, deadline=args.deadline,
    )
    return args, scenario, [LAUNCHERS[name] for name in names]


def raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so a SIGTERM cleans up the way Ctrl-C does


def main() -> int:
    args, scenario, launchers = parse_args()
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_recovery-"))
    results = []
    try:
        for launcher in launchers:
            console.print(f"[bold]{launcher.description}[/bold]: running, deadline {scenario.deadline:g} s")
            result = benchmark(launcher, scenario, work_root / launcher.name)
            console.print(f"  {result.outcome_text()} in {result.wall_s:.1f} s")
            results.append(result)
    except KeyboardInterrupt:
        console.print("interrupted: every process started has been killed")
        return 130
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
        else:
            console.print(f"logs, progress files and checkpoints kept in {work_root}")
    print_table(results, scenario)
    write_json(results, scenario, args.json)
    return 0  # the measurements are the result: a launcher that hangs is a finding, not an error


if __name__ == "__main__":
    sys.exit(main())
