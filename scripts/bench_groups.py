#!/usr/bin/env python3
"""What a collective costs through ftrun's process groups, measured: the same gloo group called
directly and through ``ftrun.elastic``'s ElasticGroup (every group a script makes under ftrun), outside
a step and inside one (``job.guard()``: the work is wrapped so that a failure is recorded, not raised).
One process, a world of one, a small tensor: what is timed is the call's own cost, not the network.

    PYTHONPATH=. .venv/bin/python scripts/bench_groups.py [-n 20000] [--json groups.json]

Prints the median of --repeat rounds of N calls each, in microseconds per call, for all_reduce and
broadcast. Every operation (a pipeline stage's send and recv too, which gloo does not make to itself)
goes through the same wrapper, so the difference is what each call of a step adds under ftrun.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchlib import emit_json  # noqa: E402

from ftrun.elastic.backends import make_comm_backend  # noqa: E402
from ftrun.elastic.groups import GroupSet, init_default_group, install  # noqa: E402


def per_call(call: Callable[[], object], n: int, repeat: int) -> float:
    """The median over ``repeat`` rounds of the time of one call, in microseconds."""
    for _ in range(min(n, 200)):
        call()
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(n):
            call()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=20000, help="calls per round (default 20000)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the median is reported (default 5)")
    parser.add_argument("--json", default="", metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    args = parser.parse_args()

    backend = make_comm_backend("gloo", 0)
    groups = GroupSet(backend, dist.HashStore(), lambda generation: f"pg{generation}", 30)
    install(groups, backend.devices())
    groups.reconfigure(0)
    init_default_group(groups, 0, 1, 30)
    tensor = torch.ones(16)
    ways = {"gloo": dist.new_group([0], backend="gloo"), "ftrun": dist.new_group([0])}

    def all_reduce(group) -> Callable[[], object]:
        return lambda: dist.all_reduce(tensor, group=group)

    def broadcast(group) -> Callable[[], object]:
        return lambda: dist.broadcast(tensor, group_src=0, group=group)

    rows = []
    for op, make in (("all_reduce", all_reduce), ("broadcast", broadcast)):
        row = {"op": op, "gloo_us": per_call(make(ways["gloo"]), args.n, args.repeat)}
        for in_step in (False, True):
            groups.in_step = in_step
            row["ftrun_in_step_us" if in_step else "ftrun_us"] = per_call(make(ways["ftrun"]), args.n, args.repeat)
        groups.in_step = False
        rows.append(row)
    print(f"{'op':<12} {'gloo':>9} {'ftrun':>9} {'in a step':>10}   (us per call, medians of {args.repeat} x {args.n})")
    for row in rows:
        print(f"{row['op']:<12} {row['gloo_us']:9.1f} {row['ftrun_us']:9.1f} {row['ftrun_in_step_us']:10.1f}")
    if args.json:
        emit_json({"n": args.n, "repeat": args.repeat, "torch": torch.__version__, "rows": rows}, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
