"""The snapshot tests' job: every rank trains a model of its own (or, SHARDED=0, the same model).

Each rank's model and data depend only on its rank (SHARDED=1) or on nothing (SHARDED=0), so the
parameters a fault-free run ends with are known without running one (``reference``), and a rank that
restored another rank's state, or another step's, ends with other parameters. Every step also
all-reduces the loss, so that ranks notice a peer's death as in any data-parallel job.

Environment:
  STEPS (default 20), STEP_SLEEP (default 0.05 s), SHARDED (default 1), OUT_DIR
  FAULT=rank:step:kind[,...] (tests/workers/faults.py), in generation 0 only, once the rank's last
                      snapshot is complete
  CORRUPT=rank:step   once that rank committed that step (and its snapshot), flip a byte of it
  CORRUPT_ALL=rank:step:held   once that rank committed that step, flip a byte of both its own snapshots
                      and of every pinned copy and replica of its state at step ``held`` on this machine
                      (waiting until the agents hold them), as if all had been hit after they were checked
Writes OUT_DIR/ran-rank<r> (one line per step run: generation step), OUT_DIR/params-rank<r>.pt at
the end, OUT_DIR/pid-rank<r>-<pid> at start.
"""

import glob
import os
import sys
import time

import torch

import faults
import teardown
import ftrun.elastic
from ftrun.snapshots.format import HEADER_SIZE, read_header

SIZE = 32


def build(rank: int, sharded: bool):
    torch.manual_seed(rank if sharded else 0)
    model = torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE), torch.nn.Tanh(), torch.nn.Linear(SIZE, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    return model, optimizer, scheduler


def batch(rank: int, step: int, sharded: bool) -> torch.Tensor:
    return torch.randn(8, SIZE, generator=torch.Generator().manual_seed(1000 * step + (rank if sharded else 0)))


def train_step(model, optimizer, scheduler, data) -> torch.Tensor:
    loss = model(data).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


def reference(rank: int, steps: int, sharded: bool = True) -> dict:
    """The parameters rank ``rank`` holds after ``steps`` fault-free steps (computed in this process)."""
    torch.set_num_threads(1)
    model, optimizer, scheduler = build(rank, sharded)
    for step in range(steps):
        train_step(model, optimizer, scheduler, batch(rank, step, sharded))
    return {k: v.clone() for k, v in model.state_dict().items()}


def corrupt_newest(job) -> None:
    """Flip one byte in the middle of this rank's newest snapshot (as a memory error would)."""
    job.snapshots.wait()
    newest = max(job.snapshots.paths, key=lambda p: getattr(read_header(p), "step", -1))
    step = flip(newest)
    print(f"corrupted {os.path.basename(newest)} (step {step}) past its header of {HEADER_SIZE}",
          file=sys.stderr, flush=True)


def flip(path: str) -> int:
    """Flip one byte in the middle of a snapshot's data, leaving its times as they were (a memory error
    changes no file's times); the step it held."""
    header = read_header(path)
    times = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(header.data_offset + header.data_len // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    return header.step


def corrupt_everywhere(job, held: int) -> None:
    """Damage this rank's own snapshots, and its pinned copies and replicas of step ``held`` in every agent
    of the job on this machine (the folders beside this rank's agent's)."""
    job.snapshots.wait()
    folder = job.snapshots.folder
    prefix = os.path.basename(folder).rsplit("-", 1)[0]  # ftrun-<run id>-<agent pid>
    pattern = os.path.join(os.path.dirname(folder), f"{prefix}-*", f"*-{job.rank:05d}.[01]")
    deadline = time.monotonic() + 60
    while True:  # the pin, then the replica, are made in the background after the step
        copies = [p for p in glob.glob(pattern) if not os.path.basename(p).startswith("rank-")
                  and getattr(read_header(p), "step", -1) == held]
        if {os.path.basename(p).split("-")[0] for p in copies} >= {"pin", "replica"} or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for path in [*job.snapshots.paths, *copies]:
        step = flip(path)
        print(f"corrupted {os.path.basename(path)} (step {step})", file=sys.stderr, flush=True)


def main() -> None:
    steps = int(os.environ.get("STEPS", "20"))
    out_dir = os.environ["OUT_DIR"]
    sharded = os.environ.get("SHARDED", "1") == "1"
    corrupt = tuple(int(x) for x in os.environ["CORRUPT"].split(":")) if os.environ.get("CORRUPT") else None
    corrupt_all = tuple(int(x) for x in os.environ["CORRUPT_ALL"].split(":")) if os.environ.get("CORRUPT_ALL") else None
    job = ftrun.elastic.init(sharded=sharded)
    rank = job.rank
    open(os.path.join(out_dir, f"pid-rank{rank}-{os.getpid()}"), "w").close()
    torch.set_num_threads(1)
    model, optimizer, scheduler = build(rank, sharded)
    job.register(model=model, optimizer=optimizer, scheduler=scheduler)
    ran = open(os.path.join(out_dir, f"ran-rank{rank}"), "a", buffering=1)
    for step in job.steps(steps):
        with job.guard():
            if job.generation == 0 and os.environ.get("FTRUN_REPLACEMENT") != "1" and faults.due(rank, step):
                # the fault comes once this rank's last snapshot is complete, so the step every rank holds
                # is known: a rank that dies while its snapshot is still being written loses that
                # snapshot, and the restore goes a step further back than the tests expect
                if job.snapshots is not None:
                    job.snapshots.wait()
                faults.trigger(faults.due(rank, step), step)
            loss = train_step(model, optimizer, scheduler, batch(rank, step, sharded))
            torch.distributed.all_reduce(loss)
            ran.write(f"{job.generation} {step}\n")
            time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))
        if corrupt == (rank, job.step) and job.generation == 0:
            corrupt_newest(job)
        if corrupt_all and corrupt_all[:2] == (rank, job.step) and job.generation == 0:
            corrupt_everywhere(job, corrupt_all[2])
    torch.save(model.state_dict(), os.path.join(out_dir, f"params-rank{rank}.pt"))
    print(f"rank {rank} finished step {job.step}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
    teardown.leave()
