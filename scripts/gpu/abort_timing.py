"""How long does taking down an NCCL group take, each way torch offers, under each setting?

One rank, one GPU. For each environment below (a fresh process each, since torch reads them once)
and each way of taking a connected 1-rank NCCL group down, --repeats times: the group is made
as ftrun's nccl backend makes it, one all-reduce connects its communicator, and the way is timed.

    python scripts/gpu/abort_timing.py --json abort.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for benchlib
from benchlib import emit_json, free_port  # noqa: E402

ENVIRONMENTS = {
    "default": {},
    "monitoring off": {"TORCH_NCCL_ENABLE_MONITORING": "0"},
    "watchdog off": {"TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
}
WAYS = ("abort", "shutdown", "backend abort", "drop")


def measure(repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    from ftrun.elastic.backends import NcclBackend

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=60))
    backend = NcclBackend(local_rank=0)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    errors: dict[str, str] = {}
    made = 0
    for _ in range(repeats):
        for way in WAYS:
            made += 1
            group = backend.connect(dist.PrefixStore(f"g{made}", store), 0, 1, 60, (0,), f"g{made}")
            tensor = torch.ones(1024, device="cuda")
            group.allreduce([tensor]).wait()
            torch.cuda.synchronize()
            began = time.perf_counter()
            try:
                if way == "abort":
                    group.abort()
                elif way == "shutdown":
                    group.shutdown()
                elif way == "backend abort":
                    group._get_backend(torch.device("cuda")).abort()
            except Exception as e:  # this torch lacks the way: say so, and the group goes by the next line
                errors[way] = f"{type(e).__name__}: {e}"[:200]
            backend._live.clear()
            del group
            gc.collect()
            times[way].append(time.perf_counter() - began)
    # a mesh's groups: 4 communicators aborted one after another, then all at once as the repair does
    for name, release in (("4 groups in turn", lambda gs: [g.abort() for g in gs]), ("4 groups at once", backend.release)):
        for _ in range(repeats):
            made += 4
            four = [backend.connect(dist.PrefixStore(f"g{made}-{i}", store), 0, 1, 60, (0,), f"g{made}-{i}") for i in range(4)]
            for group in four:
                group.allreduce([torch.ones(1024, device="cuda")]).wait()
            torch.cuda.synchronize()
            began = time.perf_counter()
            release(four)
            backend._live.clear()
            del four
            gc.collect()
            times.setdefault(name, []).append(time.perf_counter() - began)
    return {**{way: statistics.median(values) for way, values in times.items()}, "errors": errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="-")
    parser.add_argument("--quick", action="store_true", help="the default environment only")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(measure(args.repeats)))
        return 0
    results = {}
    for name, env in ENVIRONMENTS.items():
        if args.quick and env:
            continue
        done = subprocess.run([sys.executable, __file__, "--inner", "--repeats", str(args.repeats)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, **env})
        lines = done.stdout.strip().splitlines()
        results[name] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-800:]}
        print(name, results[name], file=sys.stderr, flush=True)
    emit_json(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
