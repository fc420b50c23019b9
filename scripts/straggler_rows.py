"""bench_recovery.py --stragglers: a slow rank, and what each launcher makes of it (issue 51's goal figures).

The reference job with ftrun.elastic (scripts/examples/train_ddp_elastic.py) on 2 simulated nodes of 2 ranks and,
for ftrun, a spare; from step --slow-from on, the last rank's first process spends --slow-by seconds more in each
step (a slow chip: alive, beating). Rows:

  torchrun-noshare   torchrun with the slow rank: nothing names it, every step waits for it to the end
  ftrun-fault-free   ftrun --recovery process, no slow rank: the reference parameters, and no straggler may be named
  ftrun-report       ftrun --stragglers report: the slow rank named
  ftrun-replace      ftrun --stragglers replace: named, its node's ranks moved to the spare

From each rank's progress lines (``<time> <rank> <step> <pid> <restart count>``) and ftrun's event log:

  before / slowed / after   the job's median step (rank 0's intervals) before the slowdown, with it (until a move),
                            and from 10 steps after a move to the end
  named after               seconds from the slow rank's first slow step to the straggler event (goal: 30)
  back after                replace: seconds from the first slow step until the job's step is back within 10% of its
                            median before the slowdown, over 10 steps (goal: 60)
  bit-identical             the final checkpoint's digest equals the fault-free run's
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from benchlib import find_program, free_port, kill_everything

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "examples" / "train_ddp_elastic.py"
MARKER_VARIABLE = "FTRUN_BENCH_STRAGGLER_MARKER"
NAMED_GOAL_S, BACK_GOAL_S, BACK_WITHIN = 30.0, 60.0, 1.10
#: the steps whose median says the step time is back
BACK_WINDOW = 10
ROWS = ("torchrun-noshare", "ftrun-fault-free", "ftrun-report", "ftrun-replace")


@dataclass(frozen=True)
class StragglerCase:
    steps: int = 160
    slow_rank: int = 3
    slow_from: int = 30
    slow_by: float = 0.15
    deadline: float = 600.0


@dataclass
class StragglerRow:
    name: str
    exit_codes: list
    wall_s: float
    before_s: float | None
    slowed_s: float | None
    after_s: float | None
    named_after_s: float | None
    back_after_s: float | None
    stragglers_named: int
    moved: bool
    gain: dict | None
    digest: str | None
    bit_identical: bool | None = None


def command(name: str, case: StragglerCase, work: Path, endpoint: str, run_id: str) -> list[str]:
    script = [str(SCRIPT), "--steps", str(case.steps), "--ckpt-dir", str(work / "ckpt"), "--ckpt-every",
              str(case.steps), "--progress", str(work / "progress")]
    if name != "ftrun-fault-free":
        script += ["--slow-rank", str(case.slow_rank), "--slow-from", str(case.slow_from), "--slow-by", str(case.slow_by)]
    if name.startswith("torchrun"):
        return [find_program("torchrun", "the torchrun row"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
                "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *script]
    action = "replace" if name == "ftrun-replace" else "report"
    return [find_program("ftrun", "the ftrun rows"), "--nnodes", "2", "--nproc-per-node", "2", "--spares", "1",
            "--rdzv-endpoint", endpoint, "--run-id", run_id, "--recovery", "process", "--max-restarts", "2",
            "--stragglers", action, "--status", "off", "--log-dir", str(work / "logs"), *script]


def run_row(name: str, case: StragglerCase, work_root: Path, digest: Callable[[Path], str | None]) -> StragglerRow:
    work = work_root / name
    work.mkdir(parents=True)
    run_id, marker = f"straggler-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, **{MARKER_VARIABLE: marker}, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    agents = 2 if name.startswith("torchrun") else 3
    processes: list[subprocess.Popen] = []
    began = time.time()
    try:
        for index in range(agents):
            log = open(work / f"launcher{index}.log", "wb")
            processes.append(subprocess.Popen(command(name, case, work, endpoint, run_id), stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True))
        deadline = began + case.deadline
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.time())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        kill_everything(processes, MARKER_VARIABLE, marker)
    return analyse(name, case, work, codes, time.time() - began, digest)


def read_progress(path: Path) -> list[tuple[float, int, int]]:
    lines = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 5:
            lines.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return lines


def read_events(work: Path) -> list[dict]:
    found = list(work.glob("logs/*/events.jsonl"))
    return [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()] if found else []


def step_times(progress: list[tuple[float, int, int]]) -> dict[int, float]:
    """Rank 0's time for each step it finished (its last, where a repair ran one again): rank 0 never moves."""
    return {step: t for t, rank, step in progress if rank == 0}


def intervals(times: dict[int, float], first: int, last: int) -> list[float]:
    return [times[s] - times[s - 1] for s in range(first, last) if s in times and s - 1 in times]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyse(name: str, case: StragglerCase, work: Path, codes: list, wall: float,
            digest: Callable[[Path], str | None]) -> StragglerRow:
    progress = read_progress(work / "progress")
    times = step_times(progress)
    events = read_events(work)
    slow_start = next((t for t, rank, step in progress if rank == case.slow_rank and step == case.slow_from), None)
    named = [e for e in events if e["kind"] == "straggler" and e.get("named")]
    moves = [e for e in events if e["kind"] == "takeover"]
    gain = next((e for e in events if e["kind"] == "straggler_gain"), None)
    last = max(times) if times else 0
    before = median(intervals(times, 6, case.slow_from))
    moved_at = moves[0]["t"] if moves else None
    moved_step = next((s for s in sorted(times) if moved_at is not None and times[s] > moved_at), None)
    slowed = median(intervals(times, case.slow_from + 5, moved_step or last + 1))
    after = median(intervals(times, moved_step + BACK_WINDOW, last + 1)) if moved_step else None
    back = None
    if name != "ftrun-fault-free" and slow_start is not None and before and moved_step:
        for step in range(moved_step, last - BACK_WINDOW + 1):
            window = intervals(times, step + 1, step + 1 + BACK_WINDOW)
            if len(window) == BACK_WINDOW and statistics.median(window) <= BACK_WITHIN * before:
                back = times[step] - slow_start
                break
    named_after = named[0]["t"] - slow_start if named and slow_start is not None else None
    return StragglerRow(name, codes, round(wall, 1), before, slowed, after, named_after, back, len(named), bool(moves),
                        {k: gain[k] for k in ("before", "slowed", "after")} if gain else None,
                        digest(work / "ckpt" / "checkpoint.pt"))


def run_straggler_rows(case: StragglerCase, work_root: Path, digest: Callable[[Path], str | None],
                       names: tuple[str, ...] = ROWS, say: Callable[[str], None] = print) -> list[StragglerRow]:
    """Each row's run in turn; ``digest``: a checkpoint's digest bit for bit (bench_recovery's)."""
    rows = []
    for name in names:
        say(f"{name}: a slow rank ({case.slow_by:g} s more a step from step {case.slow_from}), {case.steps} steps")
        rows.append(run_row(name, case, work_root, digest))
        say(f"  exit {rows[-1].exit_codes} in {rows[-1].wall_s:.1f} s")
    reference = next((r.digest for r in rows if r.name == "ftrun-fault-free"), None)
    for row in rows:
        row.bit_identical = None if reference is None or row.name.startswith("torchrun") else row.digest == reference
    return rows


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_straggler_rows(rows: list[StragglerRow], case: StragglerCase, console) -> None:
    from rich.table import Table

    table = Table(title=f"a slow rank: 2 x 2 (+1 spare for ftrun), rank {case.slow_rank} {case.slow_by:g} s slower "
                        f"a step from step {case.slow_from} of {case.steps}")
    for column in ("row", "exit", "wall s", "step before", "slowed", "after move", "named after s", "back within 10% s",
                   "named", "bit-identical"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.name, ",".join(str(c) for c in row.exit_codes), f"{row.wall_s:.1f}", _s(row.before_s),
                      _s(row.slowed_s), _s(row.after_s), _s(row.named_after_s), _s(row.back_after_s),
                      str(row.stragglers_named), "-" if row.bit_identical is None else "yes" if row.bit_identical else "NO")
    console.print(table)
    console.print(f"goals: named within {NAMED_GOAL_S:g} s, none in the fault-free run; with replace, the step back "
                  f"within 10% of its median before the slowdown within {BACK_GOAL_S:g} s, bit-identical")


def rows_json(rows: list[StragglerRow], case: StragglerCase) -> dict:
    return {"case": asdict(case), "rows": [asdict(row) for row in rows]}


if __name__ == "__main__":
    sys.exit("run it through scripts/bench_recovery.py --stragglers")
