"""A tiny MindSpore data-parallel job for the integration tests: any msrun script, no ftrun imports.

Each rank's gradient is a function of its rank and the step; every step all-reduces it (MindSpore's
``ops.AllReduce`` over the dynamic cluster that msrun, or ftrun --framework mindspore, builds) and applies
the mean to one parameter vector, so every rank ends with the same parameters, whatever restarts
happened (the job restarts from step 0).

Environment (all optional but OUT_DIR):
  STEPS=12         steps to run
  STEP_SLEEP=0.05  seconds each step sleeps, so that a test can act while the job runs
  FAULT=rank:step:kind  that rank's fault before the step (tests/workers/faults.py), in the generations
                   FAULT_RESTARTS lists
  FAULT_RESTARTS=0 (TORCHELASTIC_RESTART_COUNT values; default 0)
Writes OUT_DIR/rank<r>.json at the end (step, checksum, restart count, the MindSpore contract's variables),
OUT_DIR/progress<r> after every step (pid, steps done, restart count), and the scheduler writes
OUT_DIR/scheduler<restart>.json (its pid and the same variables).
"""

import json
import os
import time

import faults
import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.communication import get_group_size, get_rank, init

CONTRACT = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "MS_TOPO_TIMEOUT",
            "RANK_ID", "RANK_SIZE", "DEVICE_ID", "RANK_TABLE_FILE", "TORCHELASTIC_RESTART_COUNT", "FTRUN_GENERATION")


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        seen = {"pid": os.getpid(), "env": {name: os.environ.get(name) for name in CONTRACT}}
        write_atomically(os.path.join(out_dir, f"scheduler{restart}.json"), json.dumps(seen))
    ms.set_context(device_target="CPU")
    init()  # the scheduler serves the cluster here and leaves when the workers are done
    rank, size = get_rank(), get_group_size()
    steps = int(os.environ.get("STEPS", "12"))
    pause = float(os.environ.get("STEP_SLEEP", "0.05"))
    faulty_now = restart in os.environ.get("FAULT_RESTARTS", "0").split(",")

    all_reduce = ops.AllReduce()
    weights = np.zeros(8, dtype=np.float32)
    for step in range(steps):
        kind = faults.due(rank, step) if faulty_now else ""
        if kind:
            faults.trigger(kind, step)
        grad = np.arange(8, dtype=np.float32) * (rank + 1) + step
        total = all_reduce(ms.Tensor(grad)).asnumpy()
        weights -= 0.01 * total / size
        write_atomically(os.path.join(out_dir, f"progress{rank}"), f"{os.getpid()} {step + 1} {restart}")
        time.sleep(pause)

    result = {"step": steps, "checksum": float(np.round(weights.sum(), 4)), "size": size, "restart": restart,
              "env": {name: os.environ.get(name) for name in CONTRACT}}
    write_atomically(os.path.join(out_dir, f"rank{rank}.json"), json.dumps(result))


if __name__ == "__main__":
    main()
