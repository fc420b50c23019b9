"""--preflight's bandwidth check between nodes on the data network, on the cluster-shaped test bed: what it costs,
and whether it finds a node whose data link is slow.

Each run: NODES nodes (+ --spares) x 1 rank of tests/workers/train.py (CPU, gloo), each node a network namespace
with a management and a data link (tests/cluster.py), GLOO_SOCKET_IFNAME=data, every agent with --preflight.
With --slow-node I, node I's data link is shaped before the start (``tc qdisc add dev data root netem rate
RATE`` inside its namespace, or ``tbf`` where the kernel has no netem: its sending side, as a port that
negotiated a lower speed). Figures: the check's
time as the controller measured it (from the turns written to the last report read), each pair's time, the
lines the preflight said, and each agent's exit status. Needs root, iproute2 and tc.

    .venv/bin/python scripts/bench_preflight.py --nodes 2
    .venv/bin/python scripts/bench_preflight.py --nodes 2 --spares 1 --slow-node 1 --rate 50mbit
    .venv/bin/python scripts/bench_preflight.py --nodes 3 --slow-node 1 --rate 50mbit --probe   # ftrun probe

Human-readable output goes to stderr, JSON to --json (stdout with "-", the default).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import emit_json, free_port, kill_everything
from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.cluster import ClusterBed  # noqa: E402  (the bed the suite uses)

WORKER = REPO / "tests" / "workers" / "train.py"
MARKER_VARIABLE = "FTRUN_BENCH_PREFLIGHT_MARKER"
console = Console(stderr=True, width=130)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--spares", type=int, default=0)
    parser.add_argument("--slow-node", type=int, default=-1, help="the node (bed index) whose data link is shaped")
    parser.add_argument("--rate", default="50mbit", help="netem's rate for the slow node's data link")
    parser.add_argument("--probe", action="store_true",
                        help="run `ftrun probe --nnodes` on every node (nodes + spares) instead of the launch")
    parser.add_argument("--deadline", type=float, default=180.0)
    parser.add_argument("--json", default="-")
    args = parser.parse_args()
    marker = uuid.uuid4().hex
    out = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    env = dict(os.environ, OUT_DIR=str(out), STEPS="5", GLOO_SOCKET_IFNAME="data", PYTHONUNBUFFERED="1",
               **{MARKER_VARIABLE: marker})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    count = args.nodes + args.spares
    processes: list[subprocess.Popen] = []
    with ClusterBed(count) as bed:
        if args.slow_node >= 0:
            shaped = bed.nodes[args.slow_node].command(["tc", "qdisc", "add", "dev", "data", "root"])
            if subprocess.run(shaped + ["netem", "rate", args.rate], capture_output=True, timeout=30).returncode:
                # a kernel without sch_netem: a token bucket shapes the same sending side
                subprocess.run(shaped + ["tbf", "rate", args.rate, "burst", "32kbit", "latency", "400ms"], check=True,
                               timeout=30)
        endpoint = f"{bed.nodes[0].mgmt}:{free_port()}"
        logs = []
        for index, node in enumerate(bed.nodes):
            if args.probe:
                argv = [sys.executable, "-m", "ftrun", "probe", "--device", "cpu", "--nnodes", str(count),
                        "--rdzv-endpoint", endpoint, "--run-id", marker]
            else:
                argv = [sys.executable, "-m", "ftrun", "--nnodes", str(args.nodes), "--nproc-per-node", "1",
                        "--spares", str(args.spares), "--rdzv-endpoint", endpoint, "--run-id", marker, "--preflight",
                        "--local-addr", node.mgmt, "--rdzv-conf", f"is_host={int(index == 0)}", str(WORKER)]
            logs.append(out / f"node{index}.log")
            with open(logs[-1], "wb") as f:
                processes.append(subprocess.Popen(node.command(argv), stdout=f, stderr=subprocess.STDOUT, env=env,
                                                  cwd=out, start_new_session=True))
            time.sleep(0.3)  # node 0 first: it hosts the store
        try:
            deadline = time.monotonic() + args.deadline
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in processes]
        except subprocess.TimeoutExpired:
            codes = [p.poll() for p in processes]
        finally:
            kill_everything(processes, MARKER_VARIABLE, marker)
    texts = [log.read_text(errors="replace") for log in logs]
    check = re.search(r"bandwidth between (\d+) nodes measured in ([\d.]+)s \((\d+) rounds\)", "\n".join(texts))
    pairs = [f"node {i}: {m}" for i, text in enumerate(texts)
             for m in re.findall(r"round \d+, the pair with \S+: [\d.]+ ms", text)]
    said = sorted({line.split("ftrun: ", 1)[-1] for text in texts for line in text.splitlines()
                   if "preflight" in line and ("left out" in line or "failed" in line or "cannot reach" in line
                                               or "slower than" in line or "every node fit" in line)})
    if args.probe:
        console.print(texts[0], markup=False, highlight=False)  # the table, on the store's node
    figures = {"probe": args.probe, "nodes": args.nodes, "spares": args.spares, "slow_node": args.slow_node,
               "rate": args.rate if args.slow_node >= 0 else "", "check_s": float(check.group(2)) if check else None,
               "rounds": int(check.group(3)) if check else None, "pairs": pairs, "said": said, "exit_codes": codes}
    console.print(f"the check: {figures['check_s']} s, {figures['rounds']} rounds; exit statuses {codes}")
    for line in pairs + said:
        console.print(f"  {line}", markup=False)
    emit_json(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
