"""How fast does a launcher notice a fault, and what does watching the devices cost?

Detection latency. Runs scripts/examples/detect_worker.py (CPU, gloo, 1 node x 2 ranks) under each
launcher in turn and gives rank 1 one fault after step 20:

  exit     the rank exits 1
  signal   the rank SIGKILLs itself
  hang     the rank SIGSTOPs itself (a frozen process: no exit, no output)
  device   the rank's device turns Alarm with a RestartBusiness code (80E01801) in the stand-in npu-smi
           (tests/fakes/npu-smi, or the real one with --npu-smi)

  ftrun      ftrun --recovery process --device npu --heartbeat-timeout H --health-interval I (the defaults
             of the health interval and of everything else)
  torchrun   torchrun --standalone, defaults

The latency is the time from the fault (the rank writes the time just before it; for a device fault, the
benchmark writes the stand-in's state) to the launcher's first line that shows it noticed: ftrun's
"rank 1 failed" / "is hung" / "device 1 ... ->", torchrun's "closing signal" / "failed (exitcode". Each
line is stamped as it arrives on the launcher's output pipe. A fault not noticed within the kind's
deadline (hang: H + 20 s, else 30 s) counts as "not detected". Medians and maxima over --repeats runs.

Health-poll cost. Runs ftrun for --cpu-seconds with one worker that only sleeps (--no-python sleep), once
with --device cpu (no polling) and once with --device npu at the default --health-interval, and reads the
agent's CPU time (its own, and with the npu-smi processes it ran) over that window: the cost of polling
is the difference, in percent of one core. The stand-in npu-smi is a Python script, slower to start than
the real tool: its share is shown apart.

    .venv/bin/python scripts/bench_detection.py --repeats 5 --json detection.json

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default). Every process it
starts carries a marker in its environment and is killed on the way out.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from benchlib import find_program, kill_everything

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "scripts" / "examples" / "detect_worker.py"
STAND_IN = REPO / "tests" / "fakes"
#: the stand-in first, then this Python's folder: its `#!/usr/bin/env python3` then skips any version-manager shim
TOOL_PATH = os.pathsep.join([str(STAND_IN), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
MARKER_VARIABLE = "FTRUN_BENCH_DETECTION_MARKER"
KINDS = ("exit", "signal", "hang", "device")
LAUNCHERS = ("ftrun", "torchrun")
#: what each launcher prints once it noticed the fault
NOTICED = {
    ("ftrun", "exit"): r"rank 1 failed:",
    ("ftrun", "signal"): r"rank 1 failed:",
    ("ftrun", "hang"): r"rank 1 \(pid \d+\) is hung",
    ("ftrun", "device"): r"device 1 \(.*\): .* -> ",
    ("torchrun", "any"): r"closing signal|failed \(exitcode",
}
#: how long a run may take to reach the fault step (torch imports, the group forms)
START_DEADLINE = 90.0
console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


@dataclass(frozen=True)
class Detection:
    launcher: str
    kind: str
    repeat: int
    #: seconds from the fault to the launcher noticing it; None: not detected
    latency: float | None
    note: str = ""


class StampedOutput:
    """The launcher's output, each line with the time it arrived, read in a thread."""

    def __init__(self, pipe):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), name="bench-output", daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for raw in iter(pipe.readline, b""):
            self.lines.append((time.time(), raw.decode("utf-8", "replace").rstrip("\n")))

    def first(self, pattern: str, after: float) -> float | None:
        regex = re.compile(pattern)
        return next((t for t, line in list(self.lines) if t >= after and regex.search(line)), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def npu_state(path: Path, alarm_on: int | None = None) -> None:
    chips = [{"id": 0, "logic_id": n, "health": "OK", "codes": [], "info": []} for n in range(2)]
    if alarm_on is not None:
        chips[alarm_on].update(health="Alarm", codes=["80E01801"], info=["on-chip memory uncorrectable error"])
    state = {"board": "A2", "mode": "normal", "version": "24.1.0",
             "npus": [{"id": n, "name": "910B2", "chips": [chip]} for n, chip in enumerate(chips)]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def launch_command(launcher: str, args: argparse.Namespace) -> list[str]:
    if launcher == "torchrun":
        return [find_program("torchrun", "bench_detection"), "--standalone", "--nproc-per-node", "2", str(WORKER)]
    return [
        find_program("ftrun", "bench_detection"), "--standalone", "--nproc-per-node", "2", "--recovery", "process",
        "--max-restarts", "1", "--device", "npu", "--npu-smi", args.npu_smi,
        "--heartbeat-timeout", f"{args.heartbeat_timeout:g}", "--health-interval", f"{args.health_interval:g}",
        str(WORKER),
    ]


def run_once(launcher: str, kind: str, repeat: int, args: argparse.Namespace, workdir: Path) -> Detection:
    out_dir = workdir / f"{launcher}-{kind}-{repeat}"
    out_dir.mkdir()
    state = out_dir / "npu.json"
    npu_state(state)
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VARIABLE: marker, "BENCH_OUT": str(out_dir), "BENCH_FAULT": kind,
           "NPU_SMI_STATE": str(state), "PATH": TOOL_PATH}
    process = subprocess.Popen(launch_command(launcher, args), env=env, cwd=out_dir, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    output = StampedOutput(process.stdout)
    try:
        fault_at = wait_for_fault(kind, out_dir, state, process)
        if fault_at is None:
            (out_dir / "launcher.log").write_text(output.text())
            return Detection(launcher, kind, repeat, None, "the fault step was never reached")
        pattern = NOTICED.get((launcher, kind)) or NOTICED[(launcher, "any")]
        deadline = fault_at + (args.heartbeat_timeout + 20 if kind == "hang" else 30)
        while time.time() < deadline:
            seen = output.first(pattern, after=fault_at)
            if seen is not None:
                return Detection(launcher, kind, repeat, seen - fault_at)
            time.sleep(0.02)
        (out_dir / "launcher.log").write_text(output.text())
        return Detection(launcher, kind, repeat, None, "not detected")
    finally:
        kill_everything([process], MARKER_VARIABLE, marker)


def wait_for_fault(kind: str, out_dir: Path, state: Path, process: subprocess.Popen) -> float | None:
    """When the fault happened (Unix time), or None if the job never got there."""
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline and process.poll() is None:
        if kind == "device" and (out_dir / "ready").exists():
            fault_at = time.time()
            npu_state(state, alarm_on=1)
            return fault_at
        try:
            return float((out_dir / "fault-time").read_text())
        except (OSError, ValueError):
            time.sleep(0.02)
    return None


def agent_cpu(device: str, args: argparse.Namespace, workdir: Path) -> dict:
    """CPU seconds the ftrun agent used over --cpu-seconds: its own, and its children's (npu-smi)."""
    state = workdir / f"cpu-{device}.json"
    npu_state(state)
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VARIABLE: marker, "NPU_SMI_STATE": str(state), "PATH": TOOL_PATH}
    command = [find_program("ftrun", "bench_detection"), "--standalone", "--device", device, "--npu-smi", args.npu_smi,
               "--no-python", "sleep", "100000"]
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        agent = psutil.Process(process.pid)
        time.sleep(args.settle)  # past the start: torch's import, the rendezvous, the first polls
        before, started = agent.cpu_times(), time.monotonic()
        time.sleep(args.cpu_seconds)
        after, window = agent.cpu_times(), time.monotonic() - started
    finally:
        kill_everything([process], MARKER_VARIABLE, marker)
    own = (after.user + after.system) - (before.user + before.system)
    children = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return {"device": device, "window_s": window, "own_cpu_s": own, "children_cpu_s": children,
            "own_percent": 100 * own / window, "total_percent": 100 * (own + children) / window}


def seconds(value: float | None) -> str:
    return "not detected" if value is None else f"{value:.2f} s"


def summarise(detections: list[Detection]) -> list[dict]:
    rows = []
    for launcher in LAUNCHERS:
        for kind in KINDS:
            runs = [d for d in detections if d.launcher == launcher and d.kind == kind]
            if not runs:
                continue
            found = [d.latency for d in runs if d.latency is not None]
            rows.append({
                "launcher": launcher, "kind": kind, "runs": len(runs), "detected": len(found),
                "median_s": statistics.median(found) if found else None,
                "max_s": max(found) if found else None,
                "notes": sorted({d.note for d in runs if d.note}),
            })
    return rows


def print_tables(rows: list[dict], cpu: list[dict], args: argparse.Namespace) -> None:
    table = Table(title="time from fault to detection (1 node x 2 ranks, CPU/gloo)", title_justify="left")
    for column in ("fault", "ftrun setting", *(f"{launcher} {stat}" for launcher in LAUNCHERS for stat in ("median", "max"))):
        table.add_column(column)
    settings = {"exit": "exit code", "signal": "exit code", "hang": f"--heartbeat-timeout {args.heartbeat_timeout:g}",
                "device": f"--health-interval {args.health_interval:g}"}
    for kind in KINDS:
        cells = []
        for launcher in LAUNCHERS:
            row = next((r for r in rows if r["launcher"] == launcher and r["kind"] == kind), None)
            if row is None:
                cells += ["-", "-"]
            elif row["detected"] < row["runs"]:
                missed = f"{row['runs'] - row['detected']} of {row['runs']} not detected"
                cells += [missed if row["median_s"] is None else seconds(row["median_s"]), missed]
            else:
                cells += [seconds(row["median_s"]), seconds(row["max_s"])]
        table.add_row(kind, settings[kind], *cells)
    console.print(table)
    if cpu:
        cost = Table(title=f"ftrun agent CPU over {args.cpu_seconds:g} s (percent of one core)", title_justify="left")
        for column in ("devices", "agent alone", "agent + npu-smi runs"):
            cost.add_column(column)
        for entry in cpu:
            label = "cpu (no polling)" if entry["device"] == "cpu" else f"npu, polled every {args.health_interval:g} s"
            cost.add_row(label, f"{entry['own_percent']:.2f} %", f"{entry['total_percent']:.2f} %")
        console.print(cost)
        off, on = cpu
        console.print(f"health polling costs the agent {on['own_percent'] - off['own_percent']:.2f} % of a core "
                      f"({on['total_percent'] - off['total_percent']:.2f} % with the npu-smi processes it runs)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per fault kind and launcher (default 3)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="ftrun,torchrun (default both)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="ftrun's, for the hang (default 5)")
    parser.add_argument("--health-interval", type=float, default=5.0, help="ftrun's (default 5, its default)")
    parser.add_argument("--npu-smi", default="npu-smi", help="npu-smi to run (default: the stand-in, first on PATH)")
    parser.add_argument("--cpu-seconds", type=float, default=60.0, help="window of the CPU measurement; 0 skips it")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after start before the CPU window")
    parser.add_argument("--json", default="-", metavar="FILE", help="where the JSON results go; - for stdout")
    args = parser.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.launchers = [name for name in args.launchers.split(",") if name]
    unknown = sorted(set(args.kinds) - set(KINDS)) + sorted(set(args.launchers) - set(LAUNCHERS))
    if unknown or args.repeats < 1:
        parser.error(f"unknown kind or launcher: {', '.join(unknown)}" if unknown else "--repeats must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    detections: list[Detection] = []
    cpu: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-detection-") as tmp:
        workdir = Path(tmp)
        try:
            for repeat in range(args.repeats):
                for kind in args.kinds:
                    for launcher in args.launchers:
                        detection = run_once(launcher, kind, repeat, args, workdir)
                        console.print(f"{launcher:9} {kind:7} run {repeat + 1}: {seconds(detection.latency)} {detection.note}")
                        detections.append(detection)
            if args.cpu_seconds > 0:
                cpu = [agent_cpu(device, args, workdir) for device in ("cpu", "npu")]
        except KeyboardInterrupt:
            console.print("interrupted")
            return 130
    rows = summarise(detections)
    print_tables(rows, cpu, args)
    document = json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json"}, "summary": rows,
                           "runs": [asdict(d) for d in detections], "cpu": cpu}, indent=2)
    if args.json == "-":
        print(document)
    else:
        Path(args.json).write_text(document + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
