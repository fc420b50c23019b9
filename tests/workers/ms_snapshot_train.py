"""A tiny MindSpore data-parallel job that snapshots through ``ftrun.mindspore_elastic``.

A Dense layer trained by Adam: each rank's batch is a function of its rank and the step; the gradients
are all-reduced (``ops.AllReduce``) and averaged, so every rank holds the same parameters. Under
``--snapshot-every K`` a job-level restart resumes from the newest snapshot every rank holds.

Environment (all optional but OUT_DIR):
  STEPS=12         steps to run
  STEP_SLEEP=0.05  seconds each step sleeps, so that a test can act while the job runs
  FAULT=rank:step:kind  that rank's fault before the step (tests/workers/faults.py), in the generations
                   FAULT_RESTARTS lists
  FAULT_RESTARTS=0 (TORCHELASTIC_RESTART_COUNT values; default 0)
  DUMP=1           also write every rank's parameters after every step (OUT_DIR/state<r>-<step>.npz)
Writes OUT_DIR/begin<r>-<restart> (the step the generation began at), OUT_DIR/progress<r>-<restart> after
every step (the steps done) and OUT_DIR/final<r>.npz (every registered parameter at the end).
"""

import os
import time

import faults
import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init

import ftrun.mindspore_elastic


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def batch(step: int, rank: int) -> tuple[ms.Tensor, ms.Tensor]:
    rng = np.random.default_rng(1000 * step + rank)
    return ms.Tensor(rng.standard_normal((4, 8)).astype(np.float32)), ms.Tensor(rng.standard_normal((4, 2)).astype(np.float32))


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    init()  # the scheduler serves the cluster here and leaves when the workers are done
    rank, size = get_rank(), get_group_size()
    steps = int(os.environ.get("STEPS", "12"))
    pause = float(os.environ.get("STEP_SLEEP", "0.05"))
    faulty_now = restart in os.environ.get("FAULT_RESTARTS", "0").split(",")

    net = nn.Dense(8, 2, weight_init="normal", bias_init="zeros")
    net.weight.set_data(ms.Tensor(np.random.default_rng(7).standard_normal((2, 8)).astype(np.float32)))
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.01)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, optimizer.parameters)
    all_reduce = ops.AllReduce()

    job = ftrun.mindspore_elastic.init()
    job.register(network=net, optimizer=optimizer)
    begun = False
    for step in job.steps(steps):
        if not begun:
            write_atomically(os.path.join(out_dir, f"begin{rank}-{restart}"), str(step))
            begun = True
        kind = faults.due(rank, step) if faulty_now else ""
        if kind:
            faults.trigger(kind, step)
        _, grads = grad_fn(*batch(step, rank))
        optimizer(tuple(all_reduce(g) / size for g in grads))
        if os.environ.get("DUMP") == "1":
            np.savez(os.path.join(out_dir, f"state{rank}-{step + 1}.npz"), **job.states())
        write_atomically(os.path.join(out_dir, f"progress{rank}-{restart}"), str(step + 1))
        time.sleep(pause)
    np.savez(os.path.join(out_dir, f"final{rank}.npz"), **job.states())


if __name__ == "__main__":
    main()
