"""The integration tests' job written with ftrun.elastic (compare tests/workers/train.py).

Faults come from the environment and hit only original ranks (never a replacement):
  FAULT=rank:step:kind[,rank:step:kind...]   kind: sigkill, exit1, segv
  FAULT_GENERATIONS=0                        generations in which to inject (default 0)
  FAULT_ONCE=1                               instead: each fault once per job, in whichever generation
                                             its step comes (OUT_DIR/fault-fired-rank<r>-step<s>)
  FAULT_REPLACEMENT=rank                     that rank's first replacement dies during the repair
  HANG_REPLACEMENT=rank                      that rank's replacements hang before joining the repair
  HOLD_REPLACEMENT=rank                      that rank's replacements wait before joining the repair while
                                             OUT_DIR/hold exists (a test holds a repair under way so)
Each step ends with a sleep of STEP_SLEEP seconds (default 0.05); SLOW_STEPS=3[,5...] keeps that sleep
for the steps listed only (a long one just before a fault, say), the others sleeping the default.
SLOW_RANK=rank:step:seconds: from that step on, that rank's process spends that many seconds more in each step
(a slow chip on its node: alive, beating, every step a little late); its replacement on another node is not slow.
SLOW_SAVE=rank:steps:seconds: once that many steps are committed, that rank saves a checkpoint with torch.save
to a disk that takes that many seconds (then OUT_DIR/checkpoint-rank<r>.pt), while the others wait in the next
step's collective (not in a replacement).
PRINT_STEPS=1 prints a line after each step (ftrun top's output pane reads them).
HOLD_AFTER=step: once that step is committed, every rank waits while OUT_DIR/hold-steps exists (a test keeps
the job training until what it opened beside it shows the job).
STOP_FILE=path: once that file holds a step count, the loop ends when that many steps are committed
(STEPS then only bounds it; every rank reads the same count, so all stop at the same step).
BATCHNORM=1 puts a BatchNorm1d (running statistics: buffers that ElasticDDP broadcasts) in the model.
Writes OUT_DIR/pid-start-rank<r>-<pid> at start, OUT_DIR/progress-rank<r> after each step (the
step count), OUT_DIR/rank<r>.json at the end (final step, parameter checksum, a digest of the
parameters, buffers and optimizer state bit for bit, pid, generation, the device variables ftrun set).
"""

import io
import json
import os
import signal
import sys
import time

import faults
import teardown
import torch
from digests import digest

import ftrun.elastic


def inject_fault(rank: int, step: int, generation: int) -> None:
    if os.environ.get("FTRUN_REPLACEMENT") == "1":
        return
    kind = faults.due(rank, step)
    if not kind:
        return
    if os.environ.get("FAULT_ONCE") == "1":
        if faults.claim(rank, step, kind):
            faults.trigger(kind, step)
    elif str(generation) in os.environ.get("FAULT_GENERATIONS", "0").split(","):
        faults.trigger(kind, step)


def fail_replacement(rank: int, out_dir: str) -> None:
    """FAULT_REPLACEMENT=rank: that rank's first replacement dies right after joining the repair."""
    if os.environ.get("FTRUN_REPLACEMENT") != "1" or os.environ.get("FAULT_REPLACEMENT") != str(rank):
        return
    marker = os.path.join(out_dir, f"replacement-fault-{rank}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("injecting sigkill into a replacement during the repair", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def hang_replacement(rank: int) -> None:
    """HANG_REPLACEMENT=rank: that rank's replacements never get as far as joining the repair (HOLD_REPLACEMENT:
    not while OUT_DIR/hold exists)."""
    if os.environ.get("FTRUN_REPLACEMENT") == "1" and os.environ.get("HANG_REPLACEMENT") == str(rank):
        print("replacement hangs before joining the repair", file=sys.stderr, flush=True)
        time.sleep(3600)
    hold = os.path.join(os.environ.get("OUT_DIR", "."), "hold")
    if os.environ.get("FTRUN_REPLACEMENT") == "1" and os.environ.get("HOLD_REPLACEMENT") == str(rank):
        while os.path.exists(hold):
            time.sleep(0.05)


def step_sleep(step: int) -> float:
    """Seconds to sleep at the end of this step: STEP_SLEEP, or the default where SLOW_STEPS leaves it out."""
    slow = os.environ.get("SLOW_STEPS")
    if slow and str(step) not in slow.split(","):
        return 0.05
    return float(os.environ.get("STEP_SLEEP", "0.05"))


def slowdown(rank: int, step: int) -> float:
    """SLOW_RANK=rank:step:seconds: the extra seconds this rank's step takes (0 in a replacement)."""
    spec = os.environ.get("SLOW_RANK", "")
    if not spec or os.environ.get("FTRUN_REPLACEMENT") == "1":
        return 0.0
    slow_rank, from_step, seconds = spec.split(":")
    return float(seconds) if rank == int(slow_rank) and step >= int(from_step) else 0.0


class SlowDisk(io.BytesIO):
    """A disk that takes ``seconds`` to take a file's first write."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def write(self, data) -> int:
        time.sleep(self.seconds)
        self.seconds = 0.0
        return super().write(data)


def slow_save(rank: int, committed: int, model: torch.nn.Module, out_dir: str) -> None:
    """SLOW_SAVE=rank:steps:seconds: once ``committed`` is that many steps, that rank's torch.save of the model
    takes that long."""
    spec = os.environ.get("SLOW_SAVE", "")
    if not spec or os.environ.get("FTRUN_REPLACEMENT") == "1":
        return
    save_rank, at_step, seconds = spec.split(":")
    if rank == int(save_rank) and committed == int(at_step):
        disk = SlowDisk(float(seconds))
        torch.save(model.state_dict(), disk)
        with open(os.path.join(out_dir, f"checkpoint-rank{rank}.pt"), "wb") as f:
            f.write(disk.getvalue())


def hold_after(committed: int, out_dir: str) -> None:
    """HOLD_AFTER=step: once ``committed`` is that step, wait while OUT_DIR/hold-steps exists."""
    if os.environ.get("HOLD_AFTER") == str(committed):
        while os.path.exists(os.path.join(out_dir, "hold-steps")):
            time.sleep(0.05)


def stop_requested(committed: int) -> bool:
    """STOP_FILE holds a step count that ``committed`` has reached."""
    path = os.environ.get("STOP_FILE")
    try:
        return bool(path) and committed >= int(open(path).read())
    except (OSError, ValueError):
        return False


def model_layers() -> list[torch.nn.Module]:
    if os.environ.get("BATCHNORM") == "1":
        return [torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
    return [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]


def main() -> None:
    steps = int(os.environ.get("STEPS", "12"))
    out_dir = os.environ["OUT_DIR"]
    hang_replacement(int(os.environ["RANK"]))
    job = ftrun.elastic.init()
    with open(os.path.join(out_dir, f"pid-start-rank{job.rank}-{os.getpid()}"), "w"):
        pass
    fail_replacement(job.rank, out_dir)
    torch.manual_seed(0)
    model = job.ddp(torch.nn.Sequential(*model_layers()))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    job.register(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in job.steps(steps):
        with job.guard():
            inject_fault(job.rank, step, job.generation)
            batch = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + job.rank))
            loss = model(batch).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(step_sleep(step) + slowdown(job.rank, step))
        # whole or not at all: a test reads it while training goes on
        progress = os.path.join(out_dir, f"progress-rank{job.rank}")
        with open(progress + ".tmp", "w") as f:
            f.write(str(job.step))
        os.replace(progress + ".tmp", progress)
        if os.environ.get("PRINT_STEPS") == "1":
            print(f"rank {job.rank} step {step} loss {float(loss):.4f}", flush=True)
        slow_save(job.rank, job.step, model, out_dir)
        hold_after(job.step, out_dir)
        if stop_requested(job.step):
            break
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    result = {"step": job.step, "rank": job.rank, "checksum": checksum,
              "digest": digest(model.state_dict(), optimizer.state_dict()), "pid": os.getpid(),
              "generation": job.generation, "replacement": os.environ.get("FTRUN_REPLACEMENT"),
              "device": os.environ.get("FTRUN_DEVICE"), "device_index": os.environ.get("FTRUN_DEVICE_INDEX"),
              "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), "job_device": str(job.device)}
    with open(os.path.join(out_dir, f"rank{job.rank}.json"), "w") as f:
        json.dump(result, f)
    print(f"rank {job.rank} finished step {job.step}", flush=True)
    job.close()


if __name__ == "__main__":
    main()
    teardown.leave()
