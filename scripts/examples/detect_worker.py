"""The job scripts/bench_detection.py watches: two ranks train until rank 1 meets its fault.

BENCH_FAULT (exit, signal, hang) is injected by rank 1 itself after step BENCH_FAULT_STEP, which
writes the time first to $BENCH_OUT/fault-time; for a device fault the benchmark changes the
stand-in npu-smi's state once $BENCH_OUT/ready exists. Runs under ftrun and under plain torchrun.
"""

import os
import signal
import time

import torch

import ftrun.elastic


def inject(kind: str, out_dir: str) -> None:
    with open(os.path.join(out_dir, "fault-time"), "w") as f:
        f.write(repr(time.time()))
    if kind == "exit":
        os._exit(1)
    if kind == "signal":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    out_dir, kind = os.environ["BENCH_OUT"], os.environ["BENCH_FAULT"]
    fault_step = int(os.environ.get("BENCH_FAULT_STEP", "20"))
    # only the job's first process for rank 1 meets the fault, not its replacement or a restart
    replacement = os.environ.get("FTRUN_REPLACEMENT", "0") == "1"
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    job = ftrun.elastic.init()
    torch.manual_seed(0)
    model = job.ddp(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    job.register(model=model, optimizer=optimizer)
    for step in job.steps(1_000_000):
        with job.guard():
            loss = model(torch.randn(32, 64, generator=torch.Generator().manual_seed(step))).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(0.02)
        if step == fault_step and job.rank == 1 and not (replacement or restarted):
            if kind == "device":
                open(os.path.join(out_dir, "ready"), "w").close()
            else:
                inject(kind, out_dir)


if __name__ == "__main__":
    main()
