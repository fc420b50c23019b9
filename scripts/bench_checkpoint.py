"""What does a checkpoint cost the training loop, and what does a restart from memory save?

Part 1, blocking time per checkpoint (in this process, no launcher): a model of --sizes MB of float32
parameters trained with Adam (its registered state, model + optimizer, is three times the parameters).
Each of --repeats training steps (forward and backward of a batch of --batch, then the optimizer's
step) is followed by a checkpoint, each way:

  snapshot           ftrun.elastic's snapshot into shared memory (/dev/shm), as ftrun.elastic takes it:
                     the buffers are copied at once, the parameters and the optimizer's state by a thread
                     during the next step's forward and backward; the loop waits for what is left of that
                     copy before the optimizer's step. Blocking = the call plus that wait. The checksum
                     runs behind the loop ("commit").
  snapshot, no overlap  the same with snapshot_overlap=False: every tensor copied before the call returns
  snapshot, own stream / pinned buffers  (--device cuda) the GPU tensors copied on a CUDA stream of
                     their own, and through two pinned host buffers on it, instead of the default plain
                     copy on the training's stream (ftrun/snapshots/staging.py says why that is the default)
  torch.save         torch.save of the same state to a file in --disk-dir, as a training loop does
  torch.save+fsync   the same, flushed to disk (what a checkpoint that survives a power cut costs)

Part 2, a job-level restart (scripts/bench_recovery.py's reference job: 2 nodes x 2 ranks, 16 MB MLP,
rank 3 SIGKILLed after step --kill-at-step, checkpoints on disk every --ckpt-every steps), side by side:

  ftrun --recovery job                        restarts every rank from the newest disk checkpoint
                                              (train_ddp.py; the same with train_ddp_elastic.py, the
                                              script the next rows run, is "--snapshot-every 0")
  ftrun --recovery job --snapshot-every K     restarts every rank from the snapshots in memory, for each
                                              K in --every (default 0,1,5)
  torchrun (shared store disabled)            as the first, for reference

with the time from the fault until every rank passed the pre-fault step, the steps redone, and the
median step before the fault: what snapshots every K steps cost in steady state. Here (CPU only, four
ranks on the cores that also copy and sum the snapshots) that cost is CPU time taken from training; on
an accelerator the copy leaves the device by DMA and the sum runs on host cores that training leaves idle.

    .venv/bin/python scripts/bench_checkpoint.py --json checkpoint.json

Human-readable tables go to stderr, JSON to --json (stdout with "-", the default).
"""

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_recovery import LAUNCHERS, Scenario, console, print_table, raise_keyboard_interrupt, run_scenario
from benchlib import emit_json
from rich.table import Table

from ftrun.elastic.arrays import TorchSnapshotWriter, load_own
from ftrun.snapshots.keeper import memory_root
from ftrun.snapshots.staging import DeviceStaging

WIDTH = 1024  # a layer of WIDTH x WIDTH float32 is 4 MiB


def training_state(megabytes: int, device: torch.device):
    """A model of ``megabytes`` MB of float32 parameters on ``device``, its Adam optimizer after one
    step, and the state a training script registers (model and optimizer)."""
    layers = max(1, megabytes * 2**20 // (WIDTH * WIDTH * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH, device=device)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, model, optimizer


def state_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def blocking_times(megabytes: int, repeats: int, batch: int, disk_dir: Path, device: torch.device) -> dict:
    torch.manual_seed(0)
    state, model, optimizer = training_state(megabytes, device)
    optimized = frozenset(p.data_ptr() for p in model.parameters()) | frozenset(
        v.data_ptr() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    inputs = torch.randn(batch, WIDTH, device=device)
    memory = Path(tempfile.mkdtemp(prefix="bench-snapshots-", dir=memory_root()))
    disk = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=disk_dir))
    ways = [(True, DeviceStaging, "snapshot_s"), (False, DeviceStaging, "snapshot_no_overlap_s")]
    if device.type == "cuda":  # ftrun/snapshots/staging.py's other ways
        ways += [(True, lambda: DeviceStaging(own_stream=True), "snapshot_own_stream_s"),
                 (True, lambda: DeviceStaging(pinned=True), "snapshot_pinned_s")]
    results: dict[str, list[float]] = {k: [] for _, _, key in ways for k in (key, f"{key}_and_step")}
    results.update({"commit_s": [], "torch_save_s": [], "torch_save_fsync_s": [], "step_s": []})
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def train_step(before_optimizer=lambda: None) -> None:
        model(inputs).square().mean().backward()
        before_optimizer()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()

    def save(sync: bool) -> None:
        with open(disk / "checkpoint.pt", "wb") as f:
            torch.save(state, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())

    try:
        for overlap, staging, key in ways:
            writer = TorchSnapshotWriter(str(memory), 0, 1, False, every=1, limit=0, copies=2, staging=staging())
            for step in range(1, repeats + 2):
                began = time.perf_counter()
                writer.write(step, state, optimized if overlap else frozenset())
                train_step(writer.wait_copied)  # the next step: its optimizer waits for the copy
                # the blocking time leaves out a copy's hold on the GPU's kernels; this does not
                results[f"{key}_and_step"].append(time.perf_counter() - began)
                results[key].append(writer.blocked[-1])
                began = time.perf_counter()
                writer.wait()
                if key == "snapshot_s":
                    results["commit_s"].append(time.perf_counter() - began)
            for times in (results[key], results[f"{key}_and_step"]):
                times.pop(0)  # the first write of each file allocates its pages: not the steady state
            check_snapshot(writer, step + 1, state, optimized, key)
            for path in writer.paths:  # room in shared memory for the next way's files
                os.unlink(path)
        for sync, key in ((False, "torch_save_s"), (True, "torch_save_fsync_s")):
            for _ in range(repeats):
                began = time.perf_counter()
                train_step()
                results["step_s"].append(time.perf_counter() - began)
                began = time.perf_counter()
                save(sync)
                results[key].append(time.perf_counter() - began)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return {"model_mb": megabytes, "state_bytes": state_bytes(state), "batch": batch, "device": str(device), **results}


def check_snapshot(writer: TorchSnapshotWriter, step: int, state: dict, optimized: frozenset, way: str) -> None:
    """One more snapshot, of the state as it is now, holds every tensor bit for bit, else the
    benchmark stops: a fast copy of the wrong bytes is no result."""
    writer.write(step, state, optimized)
    writer.wait_copied()
    writer.wait()
    saved = load_own(writer.folder, 0, step)
    wrong = [where for where, now, kept in pairs_of_tensors(state, saved) if not torch.equal(now.detach().cpu(), kept)]
    if wrong:
        raise SystemExit(f"{way}: the snapshot of step {step} differs from the state at {', '.join(wrong[:5])}")


def pairs_of_tensors(state, saved, where=""):
    if isinstance(state, torch.Tensor):
        yield where, state, saved
    elif isinstance(state, dict):
        for key in state:
            yield from pairs_of_tensors(state[key], saved[key], f"{where}/{key}")
    elif isinstance(state, (list, tuple)):
        for i, item in enumerate(state):
            yield from pairs_of_tensors(item, saved[i], f"{where}/{i}")


def print_blocking(rows: list[dict]) -> None:
    others = any("snapshot_pinned_s" in row for row in rows)
    table = Table(title=f"Blocking time per checkpoint (median of the repeats, s): model + Adam state on {rows[0]['device']}")
    headers = ["model", "state", "step", "snapshot", "(commit, behind)", "snapshot, no overlap", "torch.save",
               "torch.save+fsync", "torch.save / snapshot", "torch.save / no overlap"]
    keys = ["step_s", "snapshot_s", "commit_s", "snapshot_no_overlap_s", "torch_save_s", "torch_save_fsync_s"]
    if others:
        headers[6:6] = ["snapshot, own stream", "snapshot, pinned buffers"]
        keys[4:4] = ["snapshot_own_stream_s", "snapshot_pinned_s"]
    for header in headers:
        table.add_column(header, justify="left" if header == "model" else "right")
    for row in rows:
        medians = {k: statistics.median(row[k]) for k in keys}
        row["medians"] = medians
        row["save_over_snapshot"] = medians["torch_save_s"] / medians["snapshot_s"]
        row["save_over_no_overlap"] = medians["torch_save_s"] / medians["snapshot_no_overlap_s"]
        table.add_row(f"{row['model_mb']} MB", f"{row['state_bytes'] / 2**20:.0f} MiB",
                      *(f"{medians[k]:.4f}" for k in keys),
                      f"{row['save_over_snapshot']:.1f}x", f"{row['save_over_no_overlap']:.1f}x")
    console.print(table)
    console.print("goal: the snapshot blocks the loop at least 10x less than a synchronous torch.save")
    ways = [k for k in keys if k.startswith("snapshot")]
    table = Table(title="What a snapshot adds to the step after it (median of snapshot + that step, less the plain step, s)")
    for header in ("model", "plain step", *(k.removesuffix("_s").replace("_", " ") for k in ways)):
        table.add_column(header, justify="left" if header == "model" else "right")
    for row in rows:
        row["added_to_step"] = {k: statistics.median(row[f"{k}_and_step"]) - row["medians"]["step_s"] for k in ways}
        table.add_row(f"{row['model_mb']} MB", f"{row['medians']['step_s']:.4f}",
                      *(f"{row['added_to_step'][k]:.4f}" for k in ways))
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16,256", help="model sizes in MB, comma-separated (default 16,256)")
    parser.add_argument("--repeats", type=int, default=5, help="checkpoints timed per size and way (default 5)")
    parser.add_argument("--batch", type=int, default=64, help="part 1: batch size of a training step (default 64)")
    parser.add_argument("--disk-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where torch.save writes (default: the temporary folder)")
    parser.add_argument("--kill-at-step", type=int, default=25, help="part 2: rank 3 dies after this step")
    parser.add_argument("--ckpt-every", type=int, default=10, help="part 2: disk checkpoint interval (default 10)")
    parser.add_argument("--steps", type=int, default=60, help="part 2: steps of the job (default 60)")
    parser.add_argument("--every", type=lambda text: [int(k) for k in text.split(",")], default=[0, 1, 5],
                        help="part 2: the --snapshot-every values to run, comma-separated; 0 is the same script "
                             "restarting from its own disk checkpoint (default 0,1,5)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="part 1: where the model and its optimizer's state live (default cpu); with cuda two "
                             "more ways are timed: the copy through pinned buffers, and the plain copy on the "
                             "default stream")
    parser.add_argument("--skip-restart", action="store_true", help="only part 1")
    parser.add_argument("--json", default="-", help="where the JSON goes (default: stdout)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    document: dict = {}
    work_root = Path(tempfile.mkdtemp(prefix="bench_checkpoint-"))
    try:
        rows = []
        for megabytes in sizes:
            console.print(f"[bold]{megabytes} MB model[/bold]: {args.repeats} checkpoints each way")
            rows.append(blocking_times(megabytes, args.repeats, args.batch, args.disk_dir, torch.device(args.device)))
        print_blocking(rows)
        document["blocking"] = rows
        if not args.skip_restart:
            scenario = Scenario(nnodes=2, nproc_per_node=2, steps=args.steps, ckpt_every=args.ckpt_every, kill_rank=3,
                                kill_at_step=args.kill_at_step, step_sleep=0.0, deadline=120.0)
            memory = LAUNCHERS["ftrun-memory"]
            launchers = [LAUNCHERS["torchrun-noshare"], LAUNCHERS["ftrun"]] + [
                replace(memory, name=f"ftrun-memory-{k}", description=f"ftrun --recovery job --snapshot-every {k}",
                        extra_args=("--recovery", "job", "--snapshot-every", str(k),
                                    "--replicate-every", str(10 * max(k, 1))))
                for k in args.every]
            LAUNCHERS.update({launcher.name: launcher for launcher in launchers})
            results = run_scenario(scenario, launchers, work_root)
            print_table(results, scenario)
            document["restart"] = {"scenario": scenario.__dict__, "runs": [r.__dict__ for r in results]}
    except KeyboardInterrupt:
        console.print("interrupted: every process started has been killed")
        return 130
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    emit_json(document, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
