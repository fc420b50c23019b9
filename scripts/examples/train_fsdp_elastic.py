"""The reference job sharded with FSDP2 (``fully_shard``) under ftrun.elastic: full shard, or HSDP.

The model, the data and the options are train_ddp_elastic.py's; what differs is how the model is
laid out over the ranks and how the checkpoint is written:

  --layout fsdp   full shard over every rank (a 1-D mesh ``{"shard": N}``). No rank holds a copy of
                  another's shard, so under ``ftrun --recovery process`` a replacement rank restores
                  its shard from the in-memory snapshots: run ftrun with ``--snapshot-every K``; every
                  rank then rolls back to the newest snapshot and at most K steps are redone.
  --layout hsdp   HSDP: replicate 2 x shard N/2 (``{"replicate": 2, "shard": N/2}``). A lost rank gets
                  its shard from its peer on the replicate dimension; nothing is redone but the step in
                  flight.

    ftrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo --max-restarts 3 \\
        --recovery process --snapshot-every 5 scripts/examples/train_fsdp_elastic.py --layout fsdp \\
        --ckpt-dir /tmp/ckpt --kill-rank 3 --kill-at-step 25

Under torchrun the same file runs as an ordinary FSDP2 script and resumes from its disk checkpoint.
That checkpoint is sharded: every rank saves its own local shards (``ftrun.elastic.shards.to_local``:
plain tensors with their placements, readable by ``torch.load(weights_only=True)``) to
``checkpoint-rank<r>.pt`` every --ckpt-every steps, and loads them back with ``load_local``, which
makes DTensors again on this rank's mesh. A restart must therefore keep the world size and the mesh.
Every rank saves after the same step; a crash mid-save leaves the previous file (written to a
temporary file, then renamed).
"""

import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from train_ddp_elastic import after_step, build_model, finish, make_parser, synthetic_batch

import ftrun.elastic
from ftrun.elastic.shards import load_local, to_local

#: one step's forward and backward; returns the loss where this rank computes it, else None
ForwardBackward = Callable[[int], torch.Tensor | None]


def checkpoint_path(ckpt_dir: Path, rank: int) -> Path:
    return ckpt_dir / f"checkpoint-rank{rank}.pt"


def load_shards(ckpt_dir: Path | None, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load this rank's newest shards, if any, into model and optimizer; return the last step they cover."""
    if ckpt_dir is None or not checkpoint_path(ckpt_dir, rank).exists():
        return 0
    state = torch.load(checkpoint_path(ckpt_dir, rank), weights_only=True)
    load_local(model, state["model"])
    load_local(optimizer, state["optimizer"])
    return state["step"]


def save_shards(ckpt_dir: Path, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_path(ckpt_dir, rank).with_suffix(".tmp")
    torch.save(to_local({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}), tmp)
    os.replace(tmp, checkpoint_path(ckpt_dir, rank))  # atomic: readers see the old file or the new one


def train(job, args, model: torch.nn.Module, forward_backward: ForwardBackward) -> None:
    """The sharded examples' loop: the optimizer, the per-rank checkpoint, the steps, the end.

    ``model`` holds every parameter this rank trains (sharded or not); ``forward_backward(step)``
    runs the step's forward and backward on it, gradients averaged where they must be.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_step = 0 if job.receives_state else load_shards(args.ckpt_dir, rank, model, optimizer)
    job.register(model=model, optimizer=optimizer)  # a replacement receives it, or restores it from a snapshot
    if rank == 0:
        restart_count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"rank 0 of {world_size}: starting after step {start_step} (restart {restart_count})", flush=True)

    with open(args.progress or os.devnull, "a") as progress:
        for done in job.steps(args.steps, start=start_step):  # the steps done before this one
            step = done + 1  # counted from 1, as the checkpoint and --kill-at-step count them
            with job.guard():
                optimizer.zero_grad()
                loss = forward_backward(step)
                optimizer.step()

                if args.ckpt_dir and step % args.ckpt_every == 0:
                    save_shards(args.ckpt_dir, rank, model, optimizer, step)
                if loss is not None and rank == 0 and step % 10 == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                after_step(progress, args, rank, step)

    finish(job, args)


def build(job, layout: str) -> tuple[torch.nn.Module, ForwardBackward]:
    from torch.distributed.fsdp import fully_shard

    world_size = dist.get_world_size()
    if layout == "fsdp":
        mesh = job.mesh({"shard": world_size})
    else:
        if world_size % 2:
            raise SystemExit(f"--layout hsdp needs an even number of ranks, not {world_size}")
        mesh = job.mesh({"replicate": 2, "shard": world_size // 2})
    model = build_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # each layer's parameters gathered only while it runs
    fully_shard(model, mesh=mesh)
    rank = dist.get_rank()

    def forward_backward(step: int) -> torch.Tensor:
        inputs, labels = synthetic_batch(step, rank)  # every rank is a data-parallel rank
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()  # FSDP reduce-scatters (HSDP: and all-reduces over replicate) the gradients here
        return loss

    return model, forward_backward


@record  # on a crash, torchrun and ftrun report this rank's traceback as the root cause
def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--layout", choices=("fsdp", "hsdp"), default="fsdp", help="full shard, or HSDP (default fsdp)")
    args = parser.parse_args()
    # full shard: each rank's state is its own; a repair restores every rank's snapshot
    job = ftrun.elastic.init("gloo", sharded=args.layout == "fsdp")
    model, forward_backward = build(job, args.layout)
    train(job, args, model, forward_backward)


if __name__ == "__main__":
    main()
