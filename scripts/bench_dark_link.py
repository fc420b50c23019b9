"""A data link that goes dark, on the cluster-shaped test bed: how soon ftrun says it, and how soon training
goes on, against torchrun.

Each run: 2 nodes x 2 ranks of tests/workers/elastic_train.py (CPU, gloo), each node a network namespace with
a management and a data link (tests/cluster.py), GLOO_SOCKET_IFNAME on the data one. At step --dark-at node 1's
data port goes dark (the switch's port down: the node loses carrier, packets vanish, no reset).

  no-spare   ftrun --recovery process; the link comes back after --dark-for seconds
  spare      ftrun --recovery process --spares 1 (a third namespace); the link never comes back
  torchrun   torchrun (the script's ftrun.elastic under torchrun is plain DDP); back after --dark-for seconds
  silent     ftrun --recovery process, no spare; the port leaves the switch instead (carrier up, packets
             dropped: only the probe between the agents sees it); back after --dark-for seconds
  never-back ftrun --recovery process --max-restarts 2 --repair-timeout --never-back-wait (8 s), no spare; the
             link never comes back: the job waits, said so, and ends with one line and a non-zero exit
  silent-spare  silent, with a spare, never back: the spare's probe puts the fault on node 1, whose ranks move
             to the spare
  leave-out  never-back with --nnodes 1:2: the job waits, then goes on without node 1 (a job-level restart in a
             world of 2 ranks), to its last step

Figures: said (dark -> the controller's line naming it), resumed (every rank committed a step again) counted
from the link's return (no-spare, torchrun) or from the dark (spare), processes started after the first
step (never-back, leave-out: ended, the dark -> every launcher gone; the exit codes, the reason line, and the
job's processes left behind; leave-out: left out, the dark -> the controller's line), and whether every rank's
parameters, buffers and optimizer state end bit-identical to a fault-free run's. Needs root and iproute2 (network namespaces).

    .venv/bin/python scripts/bench_dark_link.py --repeat 1 --json dark_link.json
    .venv/bin/python scripts/bench_recovery.py --dark-link --json dark_link.json   # the same rows, in bench_recovery

Each row is held to issue 50's goals: said within 5 s; with a spare, training on within 5 s of the dark; without
one, on within 3 s of the link's return with no process started; bit-identical (torchrun: no goal); never back with
no spare: ended within 5 s of --repair-timeout, every launcher's exit non-zero, its reason the dark link, no process
left behind; left out: within 3 s of --repair-timeout, node 0 to the last step and exit 0, node 1's agent gone, no
process left behind.

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from benchlib import emit_json, free_port, kill_everything, marked_processes
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.cluster import ClusterBed  # noqa: E402  (the bed the suite uses)

WORKER = REPO / "tests" / "workers" / "elastic_train.py"
MARKER_VARIABLE = "FTRUN_BENCH_DARK_LINK_MARKER"
SCENARIOS = ("no-spare", "spare", "torchrun", "silent", "never-back", "leave-out", "silent-spare")
#: with a spare node (the bed's third), the link never back
WITH_SPARE = ("spare", "silent-spare")
#: the link never back, no spare: the job waits --repair-timeout, then ends (never-back) or goes on without the node
NEVER_BACK = ("never-back", "leave-out")
#: what the controller says first, by scenario: the OS's word, or (carrier up) the data network's probe
SAID = {"silent": "data network probe: nodes 0 and 1 cannot reach each other",
        "silent-spare": "data network probe: node 1 reaches no peer on the data network"}
SAID_DARK = "node 1: data link data dark"
#: issue 50's goals (s): said after the dark; with a spare, training on after the dark; without, after the return
SAID_GOAL_S, SPARE_GOAL_S, BACK_GOAL_S = 5.0, 5.0, 3.0
#: never back with no spare: the job ends within this many seconds of --repair-timeout (its exit: stopping ranks
#: stuck in a collective, SIGKILL after --stop-timeout at worst)
END_GOAL_S = 5.0
#: what the controller's last lines give as the job's reason when it ends for a dark link
ENDED_FOR = "reason: node 1: data link data dark"
#: the controller's line when it leaves node 1 out, and how soon after --repair-timeout it is due
LEFT_OUT, LEFT_OUT_GOAL_S = "with no spare node to move its ranks to; going on with 1 nodes", 3.0
console = Console(stderr=True, width=130)


@dataclass(frozen=True)
class DarkLinkCase:
    """What each run does (the command line's options; bench_recovery.py --dark-link makes one too)."""

    scenarios: tuple[str, ...] = SCENARIOS
    repeat: int = 1
    steps: int = 40
    step_sleep: float = 0.1
    dark_at: int = 10
    dark_for: float = 20.0
    deadline: float = 300.0
    #: never-back: the launch's --repair-timeout (how long it waits for the link)
    never_back_wait: float = 8.0


def min_step(out: Path, ranks: int) -> int:
    steps = []
    for rank in range(ranks):
        try:
            steps.append(int((out / f"progress-rank{rank}").read_text()))
        except (OSError, ValueError):
            steps.append(0)
    return min(steps)


def starts(out: Path) -> int:
    return len(list(out.glob("pid-start-rank*")))


def command(scenario: str, bed: ClusterBed, index: int, endpoint: str, run_id: str, case: DarkLinkCase) -> list[str]:
    node = bed.nodes[index]
    if scenario == "torchrun":
        host, port = endpoint.rsplit(":", 1)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", str(index), "--master-addr", host, "--master-port", port, str(WORKER)]
    else:
        argv = [sys.executable, "-m", "ftrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint,
                "--run-id", run_id, "--recovery", "process", "--max-restarts", "3", "--monitor-interval", "0.05",
                "--local-addr", node.mgmt, "--rdzv-conf", f"is_host={int(index == 0)}"]
        argv += ["--spares", "1"] if scenario in WITH_SPARE else []
        if scenario in NEVER_BACK:
            argv[argv.index("--max-restarts") + 1] = "2"
            argv[argv.index("--nnodes") + 1] = "1:2" if scenario == "leave-out" else "2"
            argv += ["--repair-timeout", f"{case.never_back_wait:g}"]
        argv += ["--node-rank", str(index)] if index < 2 else []
        argv.append(str(WORKER))
    return node.command(argv)


def run(scenario: str, args: DarkLinkCase, reference: dict | None, workdir: Path) -> dict:
    """One run of ``scenario`` (None as the scenario's fault: the fault-free reference); its figures."""
    marker = uuid.uuid4().hex
    out = workdir / f"{scenario}-{marker[:6]}"
    out.mkdir()
    env = dict(os.environ, OUT_DIR=str(out), STEPS=str(args.steps), STEP_SLEEP=str(args.step_sleep),
               GLOO_SOCKET_IFNAME="data", PYTHONUNBUFFERED="1", **{MARKER_VARIABLE: marker})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    processes: list[subprocess.Popen] = []
    with ClusterBed(3 if scenario in WITH_SPARE else 2) as bed:
        endpoint = f"{bed.nodes[0].mgmt}:{free_port()}"
        logs = []
        for index in range(len(bed.nodes)):
            log = out / f"node{index}.log"
            logs.append(log)
            with open(log, "wb") as f:
                processes.append(subprocess.Popen(command(scenario, bed, index, endpoint, marker, args),
                                                  stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out,
                                                  start_new_session=True))
        figures: dict = {"scenario": scenario if reference is not None else "fault-free"}
        try:
            deadline = time.monotonic() + args.deadline
            while min_step(out, 4) < args.dark_at and time.monotonic() < deadline:
                time.sleep(0.02)
            if reference is not None:
                figures.update(fault(scenario, args, bed, out, logs[0], deadline))
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if scenario in NEVER_BACK and reference is not None:
                figures.update(ended(processes, logs[0], MARKER_VARIABLE, marker, figures.pop("dark_at")),
                               processes_started=starts(out) - figures.pop("started_before"))
        except subprocess.TimeoutExpired:
            figures["outcome"] = "did not finish"
        finally:
            kill_everything(processes, MARKER_VARIABLE, marker)
    results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    digests = {rank: r.get("digest") for rank, r in results.items()}
    figures["final_step"] = min((r["step"] for r in results.values()), default=None)
    if reference is not None and scenario not in NEVER_BACK:
        figures["bit_identical"] = digests == reference if len(digests) == 4 else False
    figures["digests"] = digests
    return figures


def fault(scenario: str, args: DarkLinkCase, bed: ClusterBed, out: Path, controller_log: Path, deadline: float) -> dict:
    started = starts(out)
    stood = min_step(out, 4)
    if scenario in ("silent", "silent-spare"):
        bed.silent(1)
    else:
        bed.dark(1)
    dark_at = time.monotonic()
    said = None
    if scenario in NEVER_BACK:
        said_s = said_within(controller_log, SAID_DARK, dark_at, deadline)
        left_out = said_within(controller_log, LEFT_OUT, dark_at, deadline) if scenario == "leave-out" else None
        return {"said_s": said_s, "dark_at": dark_at, "resumed_from": "never back", "left_out_s": left_out,
                "started_before": started}
    comes_back = dark_at + args.dark_for if scenario not in WITH_SPARE else float("inf")
    back_at = None
    resumed = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if said is None and scenario != "torchrun" and SAID.get(scenario, SAID_DARK) in controller_log.read_text(
                errors="replace"):
            said = now - dark_at
        if back_at is None and now >= comes_back:
            bed.light(1)
            back_at = now
        if min_step(out, 4) > stood + 1 and (back_at is not None or scenario in WITH_SPARE):
            resumed = now - (back_at if back_at is not None else dark_at)
            break
        time.sleep(0.02)
    if back_at is None and scenario not in WITH_SPARE:
        bed.light(1)
    return {"said_s": None if said is None else round(said, 2), "resumed_s": None if resumed is None else round(resumed, 2),
            "resumed_from": "the dark" if scenario in WITH_SPARE else "the link's return",
            "dark_for_s": None if scenario in WITH_SPARE else args.dark_for,
            "processes_started": starts(out) - started}


def said_within(controller_log: Path, line: str, since: float, deadline: float) -> float | None:
    """Seconds from ``since`` until the controller's log holds ``line`` (None: not by ``deadline``)."""
    while time.monotonic() < deadline:
        if line in controller_log.read_text(errors="replace"):
            return round(time.monotonic() - since, 2)
        time.sleep(0.02)
    return None


def ended(processes: list[subprocess.Popen], controller_log: Path, marker_variable: str, marker: str,
          dark_at: float) -> dict:
    """Never back: how soon after the dark every launcher was gone (the launchers were waited for just before),
    their exit codes, the reason the controller gave, and the job's processes still there (none expected)."""
    reason = next((line.split("ftrun: ", 1)[-1] for line in controller_log.read_text(errors="replace").splitlines()
                   if "ftrun: reason: " in line), "")
    return {"ended_s": round(time.monotonic() - dark_at, 2), "exit_codes": [p.returncode for p in processes],
            "reason": reason, "left_behind": len(marked_processes(marker_variable, marker))}


def goal_met(row: dict, case: DarkLinkCase | None = None) -> bool | None:
    """Whether a row meets issue 50's goals (None: torchrun's, which has none)."""
    if row["scenario"] == "torchrun":
        return None
    wait = (case or DarkLinkCase()).never_back_wait
    if row["scenario"] == "leave-out":
        return (row.get("said_s") is not None and row["said_s"] <= SAID_GOAL_S and row.get("left_out_s") is not None
                and row["left_out_s"] <= wait + LEFT_OUT_GOAL_S and row.get("exit_codes", [None])[0] == 0
                and row["final_step"] == (case or DarkLinkCase()).steps and row["left_behind"] == 0)
    if row["scenario"] == "never-back":
        return (row.get("said_s") is not None and row["said_s"] <= SAID_GOAL_S and row.get("ended_s") is not None
                and row["ended_s"] <= wait + END_GOAL_S and all(code not in (0, None) for code in row["exit_codes"])
                and row["reason"].startswith(ENDED_FOR) and row["left_behind"] == 0)
    said, resumed = row.get("said_s"), row.get("resumed_s")
    if said is None or resumed is None or said > SAID_GOAL_S or not row.get("bit_identical"):
        return False
    if row["scenario"] in WITH_SPARE:
        return resumed <= SPARE_GOAL_S
    return resumed <= BACK_GOAL_S and row.get("processes_started") == 0


def run_rows(case: DarkLinkCase, workdir: Path) -> list[dict]:
    """The fault-free reference, then each scenario ``case.repeat`` times: one row each, digests dropped."""
    reference = run("no-spare", case, None, workdir)["digests"]
    rows = [run(scenario, case, reference, workdir) for scenario in case.scenarios for _ in range(case.repeat)]
    for row in rows:
        row.pop("digests", None)
        row["goal_met"] = goal_met(row, case)
    return rows


def print_rows(rows: list[dict], case: DarkLinkCase, out: Console) -> None:
    table = Table(title=f"a dark data link: 2 nodes x 2 ranks, dark at step {case.dark_at}")
    for column in ("scenario", "said (s)", "resumed (s)", "from", "processes started", "bit-identical", "final step",
                   "goal met"):
        table.add_column(column)
    for row in rows:
        resumed = str(row.get("resumed_s")) if "ended_s" not in row else (
            ("" if row.get("left_out_s") is None else f"left out {row['left_out_s']}, ")
            + f"ended {row['ended_s']} (exit {', '.join(map(str, row['exit_codes']))}, {row['left_behind']} left)")
        table.add_row(row["scenario"], str(row.get("said_s")), resumed, row.get("resumed_from", ""),
                      str(row.get("processes_started")), str(row.get("bit_identical")), str(row.get("final_step")),
                      {None: "-", True: "yes", False: "no"}[row["goal_met"]])
    out.print(table)
    for row in rows:
        if row.get("reason"):
            out.print(f"{row['scenario']}: {row['reason']}")
    for scenario in case.scenarios:
        times = [r["resumed_s"] for r in rows if r["scenario"] == scenario and r.get("resumed_s") is not None]
        if times:
            out.print(f"{scenario}: median resumed {statistics.median(times):.2f}s")


def rows_json(rows: list[dict], case: DarkLinkCase) -> dict:
    return {"args": asdict(case), "rows": rows}


def unknown_scenarios(chosen: list[str]) -> str:
    """One line naming the scenarios that are not ours ("" when every one is)."""
    unknown = sorted(set(chosen) - set(SCENARIOS))
    return f"unknown scenario {', '.join(unknown)} (choose from {', '.join(SCENARIOS)})" if unknown else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--dark-at", type=int, default=10)
    parser.add_argument("--dark-for", type=float, default=20.0)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--never-back-wait", type=float, default=8.0,
                        help="never-back: the launch's --repair-timeout (default 8)")
    parser.add_argument("--json", default="-")
    args = parser.parse_args()
    if os.geteuid() != 0:
        console.print("bench_dark_link: network namespaces need root")
        return 2
    chosen = [s for s in args.scenarios.split(",") if s]
    if unknown_scenarios(chosen):
        console.print(f"bench_dark_link: {unknown_scenarios(chosen)}")
        return 2
    case = DarkLinkCase(tuple(chosen), args.repeat, args.steps, args.step_sleep, args.dark_at, args.dark_for,
                        args.deadline, args.never_back_wait)
    with tempfile.TemporaryDirectory(prefix="bench-dark-link-") as folder:
        rows = run_rows(case, Path(folder))
    print_rows(rows, case, console)
    emit_json(rows_json(rows, case), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
