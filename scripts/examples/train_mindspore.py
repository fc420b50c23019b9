"""An msrun-style MindSpore data-parallel training script (CPU) that resumes from a checkpoint, and under
ftrun from ftrun's snapshots (``ftrun.mindspore_elastic``: three lines).

The same file runs under either launcher (its python needs ftrun importable: ``pip install ftrun``, which
brings no torch along for this, or PYTHONPATH):

    msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True \\
        scripts/examples/train_mindspore.py --ckpt-dir /tmp/ms-ckpt
    ftrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True --max-restarts 2 \\
        --snapshot-every 5 --checkpoint-dir /tmp/ms-snapshots \\
        scripts/examples/train_mindspore.py --kill-rank 1 --kill-at-step 25

What it does: a small MLP learns, with momentum SGD, to tell 8 noisy clusters apart in synthetic data;
the gradients are averaged over the workers (DATA_PARALLEL, gradients_mean). The batch of step s is a
function of s and the rank alone, so a resumed run sees the batches it would have seen. Rank 0 saves the
parameters, the optimizer's state and the step every --ckpt-every steps with ``mindspore.save_checkpoint``
(to a temporary file, then renamed); every rank loads the newest on start. Under ftrun a worker's (or the
scheduler's) death restarts every worker; with --snapshot-every K they go on from the newest step every
rank holds a snapshot of (at most K steps redone), else from that checkpoint. ftrun's --checkpoint-dir
holds the snapshots as .ckpt files (``step-00000010/rank-00000.ckpt``) that ``mindspore.load_checkpoint``
reads.

  --kill-rank R --kill-at-step S   rank R SIGKILLs itself after step S, in the first attempt only
                                   (TORCHELASTIC_RESTART_COUNT=0; under msrun, which never restarts: always)
  --step-sleep SECONDS             sleep after every step, to slow the job down
  --progress FILE                  every rank appends "<unix time> <rank> <step> <pid> <restart count>"
                                   for every finished step (scripts/bench_recovery.py --mindspore reads it)
"""

import argparse
import os
import signal
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_group_size, get_rank, init

import ftrun.mindspore_elastic

WIDTH = 64
CLASSES = 8
BATCH_SIZE = 32
CHECKPOINT_NAME = "checkpoint.ckpt"
CENTERS = np.random.default_rng(1).standard_normal((CLASSES, WIDTH)).astype(np.float32)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="train until this step (default 50)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ckpt-dir", type=Path, help="folder for the checkpoint (none saved if not given)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="save every K steps (default 10)")
    parser.add_argument("--kill-rank", type=int, help="rank that SIGKILLs itself (with --kill-at-step)")
    parser.add_argument("--kill-at-step", type=int, help="step after which --kill-rank SIGKILLs itself")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every step")
    parser.add_argument("--progress", type=Path, help="append one line per finished step to this file")
    return parser.parse_args()


def synthetic_batch(step: int, rank: int) -> tuple[ms.Tensor, ms.Tensor]:
    rng = np.random.default_rng(step * 100_003 + rank)
    labels = rng.integers(0, CLASSES, BATCH_SIZE)
    inputs = CENTERS[labels] + 2.0 * rng.standard_normal((BATCH_SIZE, WIDTH)).astype(np.float32)
    return ms.Tensor(inputs, ms.float32), ms.Tensor(labels.astype(np.int32))


def main() -> None:
    args = parse_args()
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ms.set_context(device_target="CPU")
    init()  # MS_ROLE, MS_SCHED_HOST, MS_SCHED_PORT, MS_WORKER_NUM, MS_NODE_ID come from the launcher
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    rank, size = get_rank(), get_group_size()

    ms.set_seed(0)  # the same initial weights on every rank
    net = nn.SequentialCell(nn.Dense(WIDTH, WIDTH), nn.ReLU(), nn.Dense(WIDTH, CLASSES))
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=args.lr, momentum=0.9)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer)  # averages gradients over ranks

    start_step = 0
    checkpoint = args.ckpt_dir / CHECKPOINT_NAME if args.ckpt_dir else None
    if checkpoint is not None and checkpoint.exists():
        state = ms.load_checkpoint(str(checkpoint))
        start_step = int(state.pop("step").asnumpy())
        ms.load_param_into_net(train_step, state)
    job = ftrun.mindspore_elastic.init()
    job.register(train_step=train_step)  # the network's parameters and the optimizer's (momentum) state
    start_step = job.restore(start=start_step)  # after a restart under ftrun: the newest snapshot, if newer
    if rank == 0:
        print(f"rank 0 of {size}: starting after step {start_step} (restart {restart_count})", flush=True)

    progress = open(args.progress or os.devnull, "a")
    for done in job.steps(args.steps, start=start_step):  # snapshots every --snapshot-every steps
        step = done + 1
        loss = train_step(*synthetic_batch(step, rank))
        progress.write(f"{time.time():.6f} {rank} {step} {os.getpid()} {restart_count}\n")
        progress.flush()  # the line is out before a kill below, and readable while the job runs
        if rank == 0 and checkpoint is not None and step % args.ckpt_every == 0:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            tmp = checkpoint.with_suffix(".tmp.ckpt")
            ms.save_checkpoint(train_step, str(tmp), append_dict={"step": ms.Tensor(step, ms.int32)})
            os.replace(tmp, checkpoint)  # atomic: readers see the old file or the new one
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {float(loss.asnumpy()):.4f}", flush=True)
        if rank == args.kill_rank and step == args.kill_at_step and restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if rank == 0:
        print(f"done: {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
