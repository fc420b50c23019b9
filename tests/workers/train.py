"""A tiny deterministic DDP job for the integration tests (no ftrun imports: any torchrun script).

Resumes from its own checkpoint, so a job-level restart continues where it left off.
Faults are injected from the environment, only in the generations listed:
  FAULT=rank:step:kind   kind: sigkill, exit1, segv, raise
  FAULT_RESTARTS=0,1     restart counts in which to inject (default: 0)
Each step ends with a sleep of STEP_SLEEP seconds (default 0.05); SLOW_GENERATIONS=0,1 keeps that sleep
in the generations listed only (FTRUN_GENERATION), the others sleeping the default: a job that must last
until the test has done its part, and may then finish quickly.
Writes OUT_DIR/rank<r>.json at the end: final step, restart count, parameter checksum, environment.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import faults
import teardown

CONTRACT = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "FTRUN_GENERATION", "FTRUN_RUN_ID", "FTRUN_CONTROL_STORE", "FTRUN_PREVIOUS_WORLD_SIZE",
)


def inject_fault(rank: int, step: int) -> None:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] not in os.environ.get("FAULT_RESTARTS", "0").split(","):
        return
    if faults.due(rank, step + 1):
        faults.ignore_stops()  # before this step's collectives: no peer can have failed at the next one yet
    kind = faults.due(rank, step)
    if kind:
        faults.fire_together(rank, step, kind)


def read_json(path):
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def step_sleep() -> float:
    """Seconds to sleep after each step: STEP_SLEEP, or the default in a generation SLOW_GENERATIONS leaves out."""
    slow = os.environ.get("SLOW_GENERATIONS")
    if slow and os.environ.get("FTRUN_GENERATION") not in slow.split(","):
        return 0.05
    return float(os.environ.get("STEP_SLEEP", "0.05"))


@record
def main() -> None:
    steps = int(os.environ.get("STEPS", "12"))
    out_dir = os.environ["OUT_DIR"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out_dir, f"start-r{os.environ['TORCHELASTIC_RESTART_COUNT']}-rank{rank}.json"), "w") as f:
        json.dump({name: os.environ.get(name) for name in CONTRACT}, f)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = os.path.join(out_dir, "ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, steps):
        inject_fault(rank, step)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()
        time.sleep(step_sleep())
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    result = {
        "step": steps, "rank": rank, "world": world, "allreduce": total.item(), "checksum": checksum,
        "env": {name: os.environ.get(name) for name in CONTRACT}, "argv": sys.argv[1:], "cwd": os.getcwd(),
        "hostile": os.environ.get("HOSTILE"), "ranktable": read_json(os.environ.get("FTRUN_RANKTABLE")),
        "hccl_ranktable": read_json(os.environ.get("RANK_TABLE_FILE")),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {rank} finished step {steps}", flush=True)
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    teardown.leave()
