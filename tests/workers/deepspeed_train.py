"""A DeepSpeed job (ZeRO on CPU/gloo) with ftrun's DeepSpeed integration: its import and its loop of steps.

An MLP with dropout (the RNG state matters), a torch AdamW and a StepLR given to ``deepspeed.initialize``,
ZeRO stage STAGE (default 2), STEPS optimizer steps of 2 micro-batches each, each batch a function of the step,
the micro-batch and the rank. Faults as in elastic_train.py: FAULT=rank:step:kind, fired as the step begins in
original ranks only. STEP_SLEEP (default 0.05) seconds at the end of each step.

Writes OUT_DIR/pid-start-rank<r>-<pid> at start, appends each step it begins to OUT_DIR/starts-rank<r>, and
writes OUT_DIR/rank<r>.json at the end: the final step, the pid, whether it is a replacement, and a digest of the
model's parameters, this rank's optimizer partitions and moments, and the LR scheduler's state.
"""

import json
import os
import time

import faults
import teardown
import torch
from digests import digest

import ftrun.elastic.integrations.deepspeed as ftrun_deepspeed  # before init_distributed: under ftrun, joins here
import deepspeed  # noqa: E402  (after the join)

MICRO = 2


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 1000 + micro * 10 + rank))


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"pid-start-rank{rank}-{os.getpid()}"), "w"):
        pass
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": MICRO, "steps_per_print": 10**6,
              "zero_optimization": {"stage": int(os.environ.get("STAGE", "2"))}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    total = int(os.environ.get("STEPS", "10"))
    for step in ftrun_deepspeed.steps(total):
        with open(os.path.join(out_dir, f"starts-rank{rank}"), "a") as f:
            f.write(f"{step}\n")
        kind = faults.due(rank, step)
        if kind and os.environ.get("FTRUN_REPLACEMENT") != "1":
            faults.trigger(kind, step)
        for micro in range(MICRO):
            loss = engine(batch(step, micro, rank)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
    state = ftrun_deepspeed.EngineState(engine).state_dict()
    del state["rng"]
    result = {"step": engine.global_steps, "rank": rank, "pid": os.getpid(),
              "replacement": os.environ.get("FTRUN_REPLACEMENT"), "digest": digest(state)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    teardown.leave()
