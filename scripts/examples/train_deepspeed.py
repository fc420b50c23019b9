"""A DeepSpeed job (ZeRO stage 2 by default, CPU and gloo) with ftrun's DeepSpeed integration, and the same script
under torchrun.

    torchrun --standalone --nproc-per-node 4 scripts/examples/train_deepspeed.py --ckpt-dir /tmp/ds
    ftrun --standalone --nproc-per-node 4 --recovery process --snapshot-every 1 \\
          scripts/examples/train_deepspeed.py --ckpt-dir /tmp/ds

What it does: an MLP (4 layers of 512, dropout) learns to tell 16 noisy clusters apart in data made here, each
optimizer step two micro-batches of 32 per rank. Every --ckpt-every steps the engine saves its own checkpoint
(``engine.save_checkpoint``) in --ckpt-dir, and on start the script resumes from it (``engine.load_checkpoint``):
under torchrun a restarted job redoes the steps since it. Under ``ftrun --recovery process --snapshot-every 1`` a
lost rank is replaced alone: ZeRO keeps one copy of each rank's part of the optimizer, so the replacement takes
its part from its own snapshot, every rank goes back to the step both hold, and at most one step is redone
(docs/integrations.md). The integration's two lines: its import, and its ``steps()`` for the loop's range.

For demos and benchmarks: the options of step_log.py (--kill-rank, --kill-at-step, --step-sleep, --progress), and
--stage (0 to 3).
"""

import argparse
import os
from pathlib import Path

import step_log
import torch

import ftrun.elastic.integrations.deepspeed as ftrun_deepspeed  # before init_distributed(): joins under ftrun
import deepspeed  # noqa: E402  (after the join)
import deepspeed.ops  # noqa: E402

# DeepSpeed's shared-memory all-reduce serves inference alone, yet on CPU init_distributed() compiles it (minutes,
# once a machine, under a lock a killed rank leaves behind): off under torchrun too, as ftrun's integration has it
deepspeed.ops.__compatible_ops__[ftrun_deepspeed.SHM_OP] = False

WIDTH, CLASSES, MICRO, BATCH = 512, 16, 2, 32


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="folder for the engine's checkpoints")
    parser.add_argument("--stage", type=int, default=2, choices=range(4), help="ZeRO stage (default 2)")
    step_log.add_options(parser)
    return parser.parse_args()


def batch(step: int, micro: int, rank: int, centers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step, a micro-batch and a rank: the step number is the data position."""
    generator = torch.Generator().manual_seed((step * MICRO + micro) * 1000 + rank)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return centers[labels] + torch.randn(BATCH, WIDTH, generator=generator), labels


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    layers = [layer for _ in range(4) for layer in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                                      torch.nn.Dropout(0.1))]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO,
              "steps_per_print": 10**6, "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    job = ftrun_deepspeed.job
    first = 0
    if (args.ckpt_dir / "latest").exists() and not (job is not None and job.receives_state):
        _, client = engine.load_checkpoint(str(args.ckpt_dir))
        first = client["step"]
    centers = torch.randn(CLASSES, WIDTH, generator=torch.Generator().manual_seed(1))
    progress = step_log.StepLog(args)
    for step in ftrun_deepspeed.steps(args.steps, start=first):
        for micro in range(MICRO):
            inputs, labels = batch(step, micro, rank, centers)
            engine.backward(torch.nn.functional.cross_entropy(engine(inputs), labels))
            engine.step()
        if (step + 1) % args.ckpt_every == 0:
            engine.save_checkpoint(str(args.ckpt_dir), client_state={"step": step + 1})
        progress.finished(step + 1)


if __name__ == "__main__":
    main()
