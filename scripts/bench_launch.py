"""How long from one command on a head node to the first training step, against starting ftrun on each
host by hand?

Runs scripts/examples/train_ddp.py (CPU, gloo, 1 rank per host, 3 steps) on 2 and 4 hosts, two ways:

  head     ftrun --hostfile HOSTS ... on the head node: the store and the controller start there, then
           one ssh session per host starts that host's agent
  by hand  ftrun --nnodes N --node-rank I --rdzv-endpoint HEAD:PORT ... started on every host at the same
           instant (what a person, or pdsh, would type on each machine; the typing itself not counted)

The hosts are 127.0.0.2, 127.0.0.3, ... served by a real sshd that this script starts on a free port with
keys made for the run (tests/sshd.py), so "head" pays every real ssh handshake. The figure is the time
from the launch to the first line any rank writes to the progress file (the first finished step), and
the whole run's wall time. Medians over --repeats runs.

    .venv/bin/python scripts/bench_launch.py --repeats 3 --json launch.json

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default). Every process it
starts carries a marker in its environment and is killed on the way out.
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
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchlib import free_port, kill_everything

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.sshd import HOSTS, SshdUnavailable, start_sshd  # noqa: E402  (the tests' sshd helper)

WORKER = REPO / "scripts" / "examples" / "train_ddp.py"
MARKER_VARIABLE = "FTRUN_BENCH_LAUNCH_MARKER"
DEADLINE = 300
STEPS = 3
console = Console(stderr=True, highlight=False)


def worker_args(progress: Path) -> list[str]:
    return [str(WORKER), "--steps", str(STEPS), "--ckpt-every", "1000", "--progress", str(progress)]


def run_once(way: str, hosts: int, sshd, folder: Path) -> dict:
    folder.mkdir(parents=True)
    progress = folder / "progress.txt"
    marker = uuid.uuid4().hex
    env = dict(os.environ, **{MARKER_VARIABLE: marker})
    common = ["--nproc-per-node", "1", "--run-id", marker[:12]]
    if way == "head":
        hostfile = folder / "hosts"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS[:hosts]))
        commands = [[sys.executable, "-m", "ftrun", "--hostfile", str(hostfile), *sshd.client_flags(),
                     "--env", MARKER_VARIABLE, *common, *worker_args(progress)]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        commands = [[sys.executable, "-m", "ftrun", "--nnodes", str(hosts), "--node-rank", str(i),
                     "--rdzv-endpoint", endpoint, "--local-addr", HOSTS[i], *common, *worker_args(progress)]
                    for i in range(hosts)]
    started = time.time()
    procs = [subprocess.Popen(c, env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True) for c in commands]
    try:
        first_step = None
        deadline = time.monotonic() + DEADLINE
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if first_step is None and progress.exists() and progress.read_text().strip():
                first_step = min(float(line.split()[0]) for line in progress.read_text().splitlines() if line.strip())
            time.sleep(0.01)
        codes = [p.poll() for p in procs]
        if codes != [0] * len(procs):
            errors = b"".join(p.stderr.read() for p in procs if p.poll() is not None).decode(errors="replace")
            raise RuntimeError(f"{way} x{hosts}: exit codes {codes}\n{errors[-3000:]}")
        if first_step is None:
            first_step = min(float(line.split()[0]) for line in progress.read_text().splitlines() if line.strip())
        return {"first_step_s": first_step - started, "total_s": time.time() - started}
    finally:
        kill_everything(procs, MARKER_VARIABLE, marker)


def ssh_round_trip(sshd) -> float:
    """The median time of ``ssh host true`` through the benchmark's sshd."""
    times = []
    for _ in range(5):
        started = time.monotonic()
        subprocess.run(sshd.ssh(HOSTS[0], "true"), check=True, timeout=30)
        times.append(time.monotonic() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hosts", default="2,4", help="host counts to measure (at most %d)" % len(HOSTS))
    parser.add_argument("--json", default="-", help="where the JSON goes ('-' for stdout)")
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    if any(not 1 <= n <= len(HOSTS) for n in counts):
        sys.exit(f"bench_launch: --hosts takes counts from 1 to {len(HOSTS)}")
    with tempfile.TemporaryDirectory(prefix="ftrun-bench-launch-") as tmp:
        try:
            sshd = start_sshd(Path(tmp) / "sshd")
        except SshdUnavailable as e:
            sys.exit(f"bench_launch: {e}")
        try:
            ssh_s = ssh_round_trip(sshd)
            console.print(f"one ssh session (ssh host true), median of 5: {ssh_s:.2f}s")
            rows = []
            for hosts in counts:
                for way in ("head", "by hand"):
                    runs = []
                    for repeat in range(args.repeats):
                        runs.append(run_once(way, hosts, sshd, Path(tmp) / f"{way.replace(' ', '-')}-{hosts}-{repeat}"))
                        console.print(f"{way} x{hosts} run {repeat + 1}: first step after "
                                      f"{runs[-1]['first_step_s']:.2f}s, done after {runs[-1]['total_s']:.2f}s")
                    rows.append({"way": way, "hosts": hosts, "runs": runs,
                                 "first_step_median_s": statistics.median(r["first_step_s"] for r in runs),
                                 "total_median_s": statistics.median(r["total_s"] for r in runs)})
        finally:
            sshd.stop()
    table = Table(title=f"launch to first training step (1 rank per host, CPU/gloo, {args.repeats} runs each)")
    for column in ("hosts", "launch", "first step (median)", "whole run (median)"):
        table.add_column(column)
    for row in rows:
        table.add_row(str(row["hosts"]), "ftrun --hostfile (head node, ssh)" if row["way"] == "head" else
                      "ftrun on each host by hand", f"{row['first_step_median_s']:.2f} s", f"{row['total_median_s']:.2f} s")
    console.print(table)
    console.print(f"one ssh session costs {ssh_s:.2f}s here; on one machine the head's own torch import (it hosts "
                  "the store) also competes with the hosts' agents for the cores")
    text = json.dumps({"repeats": args.repeats, "ssh_session_s": ssh_s, "rows": rows}, indent=2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
