"""The reference job written with ftrun.elastic: train_ddp.py plus a few lines (diff the two files).

Under `ftrun --recovery process` a failed rank is replaced while the others keep running; the new rank
receives model and optimizer from a healthy one and the loop goes on from the last step every healthy
rank finished, so nothing is redone but the step in flight. Under torchrun it runs as train_ddp.py does.

    ftrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo --max-restarts 3 \\
        --recovery process scripts/examples/train_ddp_elastic.py --ckpt-dir /tmp/ckpt --kill-rank 3 --kill-at-step 25

What it does: an MLP of about 4.2M float32 parameters (16.9 MB) learns, with SGD, to tell 16 noisy
clusters apart in synthetic data. The batch of step s is a function of s and the rank alone, so a
resumed run sees exactly the batches it would have seen. Steps are numbered from 1; rank 0 saves
model, optimizer and step every --ckpt-every steps (written to a temporary file, then renamed, so a
crash never leaves half a checkpoint), and every rank loads the newest checkpoint on start. A
restarted job therefore redoes the steps since the last checkpoint: killed after step 25 with
checkpoints every 10, it resumes after step 20 and redoes 5.

With --torch-ddp the model is wrapped in torch's own DistributedDataParallel instead of job.ddp()
(job.register pins DDP's bucket layout, so a replacement rank's buckets are the healthy ranks').
The sharded examples (train_fsdp_elastic.py, train_tp_elastic.py) reuse this file's model, data,
options and per-step bookkeeping.

For demos and benchmarks:
  --kill-rank R --kill-at-step S   rank R (every rank with --kill-rank all) SIGKILLs itself after
                                   finishing step S, only in the first attempt
                                   (TORCHELASTIC_RESTART_COUNT=0, and not in a replacement rank), so
                                   the restarted job runs on
  --kill-stagger SECONDS           with --kill-rank all: only the last rank dies at once; the others
                                   die one by one over the next SECONDS (rank 0 last), while the
                                   job repairs the first deaths
  --step-sleep SECONDS             sleep after every step, to slow the job down
  --slow-rank R --slow-from S --slow-by SECONDS
                                   a straggler: from step S on, rank R's first process spends SECONDS
                                   more in each step (a slow chip on its node); a replacement elsewhere
                                   is not slow
  --progress FILE                  every rank appends "<unix time> <rank> <step> <pid> <restart count>"
                                   for every finished step
"""

import argparse
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import ftrun.elastic

WIDTH = 1024
HIDDEN_LAYERS = 4  # four 1024 x 1024 layers and a 1024 x 16 one: 4.2M parameters, 16.9 MB
CLASSES = 16
BATCH_SIZE = 32
CHECKPOINT_NAME = "checkpoint.pt"
#: --kill-stagger: the timer that will kill this rank, once armed
KILL_TIMERS: list[threading.Timer] = []
CLUSTER_CENTERS = torch.randn(CLASSES, WIDTH, generator=torch.Generator().manual_seed(1))  # one per class


def rank_or_all(text: str) -> int | str:
    return "all" if text == "all" else int(text)


def make_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The options every example of this job takes (the sharded ones add --layout)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--ckpt-dir", type=Path, help="folder for the checkpoint (none saved if not given)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="save every K steps (default 10)")
    parser.add_argument("--progress", type=Path, help="append one line per finished step to this file")
    parser.add_argument("--kill-rank", type=rank_or_all,
                        help="rank that SIGKILLs itself, or all (with --kill-at-step)")
    parser.add_argument("--kill-at-step", type=int, help="step after which --kill-rank SIGKILLs itself")
    parser.add_argument("--kill-stagger", type=float, default=0.0,
                        help="with --kill-rank all: the other ranks die over this many seconds after the last")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every step")
    parser.add_argument("--slow-rank", type=int, help="a straggler: this rank's first process is slow (--slow-by)")
    parser.add_argument("--slow-from", type=int, default=1, help="with --slow-rank: from this step on (default 1)")
    parser.add_argument("--slow-by", type=float, default=0.0, help="with --slow-rank: seconds more in each step")
    return parser


def parse_args() -> argparse.Namespace:
    parser = make_parser()
    parser.add_argument("--torch-ddp", action="store_true", help="torch's DistributedDataParallel, not job.ddp()")
    return parser.parse_args()


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP would broadcast rank 0's anyway)
    layers: list[torch.nn.Module] = []
    for _ in range(HIDDEN_LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, CLASSES))
    return torch.nn.Sequential(*layers)


def synthetic_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step` on `rank`: the same on every run, whatever happened before."""
    generator = torch.Generator().manual_seed(step * 100_003 + rank)
    labels = torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator)
    inputs = CLUSTER_CENTERS[labels] + 2.0 * torch.randn(BATCH_SIZE, WIDTH, generator=generator)
    return inputs, labels


def load_checkpoint(ckpt_dir: Path | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest checkpoint, if any, into model and optimizer; return the last step it covers."""
    if ckpt_dir is None or not (ckpt_dir / CHECKPOINT_NAME).exists():
        return 0
    state = torch.load(ckpt_dir / CHECKPOINT_NAME)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def save_checkpoint(ckpt_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f"{CHECKPOINT_NAME}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, ckpt_dir / CHECKPOINT_NAME)  # atomic: readers see the old file or the new one


def after_step(progress, args: argparse.Namespace, rank: int, step: int) -> None:
    """Append the step's progress line; then the fault, if this is its rank and step; then the sleep."""
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    progress.write(f"{time.time():.6f} {rank} {step} {os.getpid()} {restart_count}\n")
    progress.flush()  # the line is out before a kill below, and readable while the job runs
    first_attempt = restart_count == 0 and os.environ.get("FTRUN_REPLACEMENT") != "1"
    if args.kill_rank in (rank, "all") and step == args.kill_at_step and first_attempt:
        delay = kill_delay(args, rank)
        if not delay:
            os.kill(os.getpid(), signal.SIGKILL)
        elif not KILL_TIMERS:  # armed once: a rollback may bring this rank back to the kill step
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
            timer.name, timer.daemon = "kill-stagger", True
            timer.start()
            KILL_TIMERS.append(timer)
    if args.step_sleep:
        time.sleep(args.step_sleep)
    if args.slow_rank == rank and step >= args.slow_from and first_attempt:
        time.sleep(args.slow_by)


def kill_delay(args: argparse.Namespace, rank: int) -> float:
    """Seconds after the kill step that this rank dies: 0 but with --kill-rank all --kill-stagger S, where
    the last rank dies at once and rank r of the others S * (last - r) / last later."""
    last = int(os.environ.get("WORLD_SIZE", "1")) - 1
    if args.kill_rank != "all" or not args.kill_stagger or rank == last:
        return 0.0
    return args.kill_stagger * (last - rank) / last


def finish(job: ftrun.elastic.ElasticJob, args: argparse.Namespace) -> None:
    """Leave the job once every rank is done."""
    rank = dist.get_rank()
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    job.close()
    if rank == 0:
        print(f"done: {args.steps} steps", flush=True)


@record  # on a crash, torchrun and ftrun report this rank's traceback as the root cause
def main() -> None:
    args = parse_args()
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    job = ftrun.elastic.init("gloo")  # joins this generation's process group; a heartbeat starts
    rank, world_size = dist.get_rank(), dist.get_world_size()

    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Every rank loads before wrapping in DDP; rank 0 only overwrites the checkpoint after a step, which
    # needs every rank, so no rank can read a checkpoint newer than the others'.
    start_step = 0 if job.receives_state else load_checkpoint(args.ckpt_dir, model, optimizer)
    if args.torch_ddp:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model)
        job.register(model=ddp_model, optimizer=optimizer)  # registering the DDP pins its buckets
    else:
        ddp_model = job.ddp(model)
        job.register(model=model, optimizer=optimizer)  # what a replacement rank receives
    if rank == 0:
        print(f"rank 0 of {world_size}: starting after step {start_step} (restart {restart_count})", flush=True)

    with open(args.progress or os.devnull, "a") as progress:
        for done in job.steps(args.steps, start=start_step):  # the steps done before this one
            step = done + 1  # counted from 1, as the checkpoint and --kill-at-step count them
            with job.guard():  # a fault elsewhere lands here; the loop then goes on from the consistent step
                inputs, labels = synthetic_batch(step, rank)
                loss = torch.nn.functional.cross_entropy(ddp_model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()  # DDP averages the gradients over all ranks here
                optimizer.step()

                if rank == 0 and args.ckpt_dir and step % args.ckpt_every == 0:
                    save_checkpoint(args.ckpt_dir, model, optimizer, step)
                if rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                after_step(progress, args, rank, step)

    finish(job, args)


if __name__ == "__main__":
    main()
