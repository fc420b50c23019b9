"""Abort and re-form ftrun's process groups N times under a DDP module and an FSDP2 module.

One rank, one process: the repair's group path without a launcher. Each cycle does what a repair
does to a healthy rank's groups (``GroupSet.release``: every real group aborted and dropped through
the backend seam, then ``reconfigure`` to the next generation) and then one training step of both
modules, whose collectives connect the new generation's real groups under the same group objects.
Reports each cycle's time, GPU memory and thread counts (a leak grows them cycle by cycle), and
whether both modules still train as a plain module trained beside them does.

    python scripts/gpu/group_cycles.py --backend nccl --cycles 20 --json cycles.json
    python scripts/gpu/group_cycles.py --backend gloo --cycles 3      # the same on CPU
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from ftrun.elastic.backends import BACKENDS
from ftrun.elastic.groups import GroupSet, init_default_group, install

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/, for benchlib
from benchlib import emit_json, free_port  # noqa: E402

WIDTH = 256


def model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)).to(device)


def step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    module(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--json", default="-")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=60))
    backend = BACKENDS[args.backend](local_rank=0)
    groups = GroupSet(backend, store, lambda generation: f"g{generation}/pg", timeout=60)
    install(groups, backend.devices())
    connected: list[int] = []  # the real groups connected, counted at the backend seam
    connect = backend.connect
    backend.connect = lambda *args, **options: connected.append(1) or connect(*args, **options)  # type: ignore[method-assign]
    groups.reconfigure(0)
    init_default_group(groups, 0, 1, 60)

    plain = model(device)
    ddp = DistributedDataParallel(copy.deepcopy(plain))
    fsdp = copy.deepcopy(plain)
    fully_shard(fsdp, mesh=init_device_mesh(device.type, (1,), mesh_dim_names=("shard",)))
    modules = {"plain": plain, "ddp": ddp, "fsdp2": fsdp}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in modules.items()}

    def train(at: int) -> None:
        batch = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(at)).to(device)
        for name, module in modules.items():
            step(module, optimizers[name], batch)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    train(0)  # generation 0's groups connected, the allocator warm
    synchronize()
    rows = []
    for cycle in range(1, args.cycles + 1):
        connected.clear()
        began = time.perf_counter()
        groups.release()
        groups.reconfigure(cycle)
        released = time.perf_counter()
        train(cycle)
        synchronize()
        done = time.perf_counter()
        rows.append({"cycle": cycle, "release_s": released - began, "reform_and_step_s": done - released,
                     "cycle_s": done - began, "groups_connected": len(connected), "threads": threads(),
                     "python_threads": threading.active_count(),
                     "gpu_allocated": torch.cuda.memory_allocated() if device.type == "cuda" else 0,
                     "gpu_reserved": torch.cuda.memory_reserved() if device.type == "cuda" else 0})
        print(f"cycle {cycle}: {rows[-1]['cycle_s'] * 1000:.1f} ms, {rows[-1]['threads']} threads, "
              f"{rows[-1]['gpu_allocated']} B allocated", file=sys.stderr, flush=True)

    reference = {n: p.detach() for n, p in plain.named_parameters()}
    differences = {
        name: max(float((full(p.detach()) - reference[n.removeprefix("module.")]).abs().max())
                  for n, p in module.named_parameters())
        for name, module in (("ddp", ddp), ("fsdp2", fsdp))
    }
    later = rows[len(rows) // 2:]
    result = {
        "backend": args.backend, "device": str(device), "cycles": args.cycles, "rows": rows,
        "median_cycle_s": statistics.median(r["cycle_s"] for r in rows),
        "median_release_s": statistics.median(r["release_s"] for r in rows),
        "threads_first_last": [rows[0]["threads"], rows[-1]["threads"]],
        "gpu_allocated_first_last": [rows[0]["gpu_allocated"], rows[-1]["gpu_allocated"]],
        # leaks grow with every cycle: compare the second half's ends, past any one-off warm-up
        "leaks_threads": later[-1]["threads"] > later[0]["threads"],
        "leaks_gpu_memory": later[-1]["gpu_allocated"] > later[0]["gpu_allocated"],
        "max_abs_difference_from_plain": differences,
        "modules_train": all(d <= 1e-6 for d in differences.values()),
        "every_cycle_reconnected": all(r["groups_connected"] > 0 for r in rows),
    }
    groups.release()
    dist.destroy_process_group()
    emit_json(result, args.json)
    healthy = result["modules_train"] and result["every_cycle_reconnected"]
    return 0 if healthy and not result["leaks_threads"] and not result["leaks_gpu_memory"] else 1


if __name__ == "__main__":
    sys.exit(main())
