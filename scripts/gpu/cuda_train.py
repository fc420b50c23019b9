"""The GPU check's training script: a small MLP whose parameters and Adam state live on a GPU.

    GPU_MODE=placement   (under ftrun) the device variables ftrun set, job.device, one all-reduce on it
    GPU_MODE=elastic     (under ftrun) job.ddp() over gloo, the model on cuda:0; KILL_RANK/KILL_STEP:
                         that rank SIGKILLs itself during that step (generation 0, never a replacement)
    GPU_MODE=online      (under ftrun) job.ddp() over the backend ftrun picks (NCCL on a GPU); at FAULT_STEP
                         of generation 0 the rank aborts its communicators itself, as NCCL does when a
                         link fails, and the step's collectives fail with the process alive
                         (FAULT_HOW=error: the step's collectives are told of an NCCL error instead, for a
                         torch whose aborted communicator is made again at the next collective)
    GPU_MODE=torch       (under torchrun) torch's DistributedDataParallel over gloo, the same model

Each rank writes OUT_DIR/<mode>-rank<r>.json at the end: the final step, a digest of the parameters
and the optimizer's state bit for bit, its pid, and every step it finished with its generation,
its time (time.time()) and its duration (the GPU synchronised). STEPS (default 40), WIDTH (default
1024), LAYERS (default 4), BATCH (default 256), TRAIN_DEVICE (default cuda:0).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "workers"))  # the test workers' digest
from digests import digest  # noqa: E402

MODE = os.environ.get("GPU_MODE", "elastic")
OUT_DIR = os.environ["OUT_DIR"]
STEPS = int(os.environ.get("STEPS", "40"))
WIDTH = int(os.environ.get("WIDTH", "1024"))
LAYERS = int(os.environ.get("LAYERS", "4"))
BATCH = int(os.environ.get("BATCH", "256"))
#: where the model lives in the elastic and torch modes (cpu: the check's own dry run on a machine without a GPU)
DEVICE = torch.device(os.environ.get("TRAIN_DEVICE", "cuda:0"))


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def write(name: str, result: dict) -> None:
    with open(os.path.join(OUT_DIR, f"{name}.json"), "w") as f:
        json.dump(result, f)


def mlp(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def batch_for(step: int, rank: int, device: torch.device) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)


def placement() -> None:
    import ftrun.elastic

    job = ftrun.elastic.init()
    tensor = torch.ones(4, device=job.device)
    dist.all_reduce(tensor)
    write(f"placement-rank{job.rank}", {
        "rank": job.rank, "job_device": str(job.device), "backend": job.backend.name,
        "all_reduce": tensor.tolist(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "FTRUN_DEVICE": os.environ.get("FTRUN_DEVICE"), "FTRUN_DEVICE_INDEX": os.environ.get("FTRUN_DEVICE_INDEX"),
        "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
    })
    job.close()


def elastic(backend: str | None = "gloo") -> None:
    import ftrun.elastic

    job = ftrun.elastic.init(backend=backend)
    open(os.path.join(OUT_DIR, f"pid-start-rank{job.rank}-{os.getpid()}"), "w").close()
    device = DEVICE
    model = job.ddp(mlp(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    job.register(model=model, optimizer=optimizer)
    kill_rank, kill_step = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_STEP", "-1"))
    fault_step = int(os.environ.get("FAULT_STEP", "-1"))
    replacement = os.environ.get("FTRUN_REPLACEMENT") == "1"
    finished = []
    for step in job.steps(STEPS):
        began = time.perf_counter()
        with job.guard():
            if job.rank == kill_rank and step == kill_step and job.generation == 0 and not replacement:
                write(f"killed-rank{job.rank}", {"time": time.time(), "step": step})
                os.kill(os.getpid(), signal.SIGKILL)
            if step == fault_step and job.generation == 0:
                break_communicators(job, os.environ.get("FAULT_HOW", "abort"))
            model(batch_for(step, job.rank, device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            synchronize()
        if job.step == step + 1:  # committed (a step a repair cut short is not: it runs again)
            finished.append((step, job.generation, time.time(), time.perf_counter() - began))
    write(f"elastic-rank{job.rank}", {"rank": job.rank, "step": job.step, "pid": os.getpid(), "replacement": replacement,
                                      "generation": job.generation,
                                      "digest": digest(model.state_dict(), optimizer.state_dict()), "steps": finished})
    job.close()


def break_communicators(job, how: str) -> None:
    """Abort every communicator this rank holds, as NCCL's own error handling does when a link fails:
    the step's collectives then fail while the process lives (the online level's case)."""
    write(f"fault-rank{job.rank}", {"time": time.time(), "generation": job.generation, "how": how})
    for group in job.groups.groups:
        if group._real is not None:
            group._real.abort()
    if how == "error":
        job.groups.fail(dist.DistBackendError("NCCL error: remote process exited or there was a network error"))


def plain_torch() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = DEVICE
    model = torch.nn.parallel.DistributedDataParallel(mlp(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    finished = []
    for step in range(1, STEPS + 1):
        began = time.perf_counter()
        model(batch_for(step, rank, device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        finished.append((step, 0, time.time(), time.perf_counter() - began))
    write(f"torch-rank{rank}", {"rank": rank, "step": STEPS, "pid": os.getpid(),
                                "digest": digest(model.module.state_dict(), optimizer.state_dict()), "steps": finished})
    dist.destroy_process_group()


if __name__ == "__main__":
    {"placement": placement, "elastic": elastic, "online": lambda: elastic(None), "torch": plain_torch}[MODE]()
