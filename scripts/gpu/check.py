"""The CUDA paths on a real GPU, end to end, in one table (scripts/gpu_check.sh runs this).

Parts (--parts, default all):
  probe      ftrun probe --device cuda --json; NVML's and nvidia-smi's readings of the same fields
  placement  ftrun --standalone --device cuda: 2 ranks on one GPU (refused, said why), then 1 rank
  repair     2 ranks on the one GPU over gloo, model and Adam state on the GPU, rank 1 SIGKILLed at
             --kill-step of --steps under --recovery process, against a fault-free run of the same job
  nccl       scripts/gpu/group_cycles.py: NCCL groups aborted and re-formed --cycles times under a DDP
             and an FSDP2 module
  snapshot   scripts/bench_checkpoint.py --device cuda (part 1): what a snapshot blocks, against torch.save
  overhead   job.ddp() under ftrun against torch DDP under torchrun, 2 ranks over gloo, median step time
  online     the online level on NCCL: 1 rank, job.ddp() over NCCL, its communicators aborted at
             --kill-step of --steps with the process alive; repaired in place (abort, re-form), against
             a fault-free run of the same job

Exits non-zero when any check fails. Every figure and log goes to --out (JSON: results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # device_checks.py
SCRIPT = ROOT / "scripts" / "gpu" / "cuda_train.py"
PY = sys.executable

from device_checks import Checks, print_table, run, tail  # noqa: E402

#: the snapshot part's device: cuda, or cpu for the check's own dry run (TRAIN_DEVICE=cpu)
DEVICE_TYPE = os.environ.get("TRAIN_DEVICE", "cuda").split(":")[0]
PARTS = ("probe", "placement", "repair", "nccl", "snapshot", "overhead", "online")


def ftrun(*args: str) -> list[str]:
    return [PY, "-m", "ftrun", *args]


def probe(checks: Checks, out: Path) -> None:
    log = out / "probe.log"
    result = subprocess.run(ftrun("probe", "--device", "cuda", "--json"), capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    log.write_text(result.stdout + result.stderr)
    checks.add("probe", "ftrun probe --device cuda --json exits 0", result.returncode == 0, f"exit {result.returncode}")
    try:
        report = json.loads(result.stdout)
    except ValueError:
        checks.add("probe", "its output is JSON", False, tail(log))
        return
    devices = report.get("devices", [])
    checks.add("probe", "GPUs found, each healthy and usable",
               bool(devices) and all(d["health"] == "OK" and d["usable"] for d in devices),
               "; ".join(f"{d['index']}: {d['name']} {d['health']}" for d in devices))
    from ftrun.devices.cuda import GPU_FIELDS, REMAP_FIELDS, _known, _NvmlReader, _xid_event_set, parse_nvidia_smi_csv

    try:
        import pynvml

        pynvml.nvmlInit()
        nvml_rows = _NvmlReader(pynvml).rows()
        events = _xid_event_set(pynvml) is not None
    except Exception as e:  # no NVML bindings or library: the nvidia-smi path is what ftrun uses then
        checks.add("probe", "NVML read", None, f"not available: {e}")
        nvml_rows, events = [], False
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    remap = subprocess.run(["nvidia-smi", f"--query-remapped-rows={','.join(REMAP_FIELDS)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    smi_rows = parse_nvidia_smi_csv(smi.stdout)
    (out / "probe-fields.json").write_text(json.dumps({"nvml": nvml_rows, "nvidia_smi": smi_rows,
                                                         "remapped_rows": remap.stdout, "xid_events": events}, indent=2))
    checks.add("probe", "nvidia-smi's fields parsed", bool(smi_rows), json.dumps(smi_rows[0]) if smi_rows else smi.stderr[:200])
    if nvml_rows and smi_rows:
        fields = ("index", "pci.bus_id", "uuid", "ecc.errors.uncorrected.volatile.total", "retired_pages.pending")
        # as ftrun reads them: "[N/A]" from one and "[Not Supported]" from the other both say "unknown"
        differ = [f for f in fields if (_known(nvml_rows[0].get(f)) or "").lower() != (_known(smi_rows[0].get(f)) or "").lower()]
        checks.add("probe", "NVML and nvidia-smi give the same index, bus id, uuid, ECC and retired-page fields",
                   not differ,
                   "differ: " + ", ".join(f"{f} {nvml_rows[0].get(f)!r} vs {smi_rows[0].get(f)!r}" for f in differ)
                   if differ else ", ".join(f"{f}={nvml_rows[0].get(f)}" for f in fields[3:]))
    checks.add("probe", "NVML critical-Xid events registered", None, "yes" if events else "no (polled fields only)")


def placement(checks: Checks, out: Path) -> None:
    work = out / "placement"
    work.mkdir()
    env = {"OUT_DIR": str(work), "GPU_MODE": "placement"}
    two = run(ftrun("--standalone", "--nproc-per-node", "2", "--device", "cuda", "--max-restarts", "0", str(SCRIPT)),
              work / "two.log", 120, env)
    refused = two.returncode != 0
    checks.add("placement", "2 ranks, 1 GPU, --device cuda", None,
               f"refused (exit {two.returncode}): {tail(work / 'two.log', 2)}" if refused else "accepted")
    ranks = 1 if refused else 2
    if refused:
        for stale in work.glob("placement-rank*.json"):
            stale.unlink()
        one = run(ftrun("--standalone", "--nproc-per-node", "1", "--device", "cuda", str(SCRIPT)),
                  work / "one.log", 120, env)
        checks.add("placement", "1 rank, --device cuda, job exits 0", one.returncode == 0,
                   f"exit {one.returncode}" + ("" if one.returncode == 0 else f": {tail(work / 'one.log')}"))
    for rank in range(ranks):
        path = work / f"placement-rank{rank}.json"
        if not path.exists():
            checks.add("placement", f"rank {rank} reported", False, tail(work / ("one.log" if refused else "two.log")))
            continue
        seen = json.loads(path.read_text())
        ok = (seen["CUDA_VISIBLE_DEVICES"] is not None and seen["FTRUN_DEVICE"] is not None
              and seen["job_device"].startswith("cuda") and seen["all_reduce"] == [float(ranks)] * 4)
        checks.add("placement", f"rank {rank}: visibility, FTRUN_DEVICE, job.device, an all-reduce on it", ok,
                   f"CUDA_VISIBLE_DEVICES={seen['CUDA_VISIBLE_DEVICES']} FTRUN_DEVICE={seen['FTRUN_DEVICE']} "
                   f"FTRUN_DEVICE_INDEX={seen['FTRUN_DEVICE_INDEX']} job.device={seen['job_device']} "
                   f"backend={seen['backend']}")


def elastic_run(work: Path, name: str, steps: int, kill: tuple[int, int] | None, extra: tuple[str, ...] = (),
                mode: str = "elastic", ranks: int = 2, env_extra: dict | None = None) -> dict:
    """One ftrun job of cuda_train.py's elastic (or online) mode in ``work/name``: its exit code and every
    rank's report."""
    folder = work / name
    folder.mkdir()
    env = {"OUT_DIR": str(folder), "GPU_MODE": mode, "STEPS": str(steps), **(env_extra or {})}
    if kill:
        env.update(KILL_RANK=str(kill[0]), KILL_STEP=str(kill[1]))
    began = time.time()
    result = run(ftrun("--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "3", *extra, str(SCRIPT)),
                 folder / "ftrun.log", 300, env)
    reports = {int(p.stem.removeprefix("elastic-rank")): json.loads(p.read_text()) for p in folder.glob("elastic-rank*.json")}
    killed = folder / "killed-rank1.json"
    return {"code": result.returncode, "wall_s": time.time() - began, "reports": reports,
            "killed": json.loads(killed.read_text()) if killed.exists() else None, "log": folder / "ftrun.log"}


def repair(checks: Checks, out: Path, steps: int, kill_step: int) -> None:
    work = out / "repair"
    work.mkdir()
    flags = ("--recovery", "process")
    reference = elastic_run(work, "reference", steps, None, flags)
    faulted = elastic_run(work, "faulted", steps, (1, kill_step), flags)
    for name, job in (("fault-free", reference), ("faulted", faulted)):
        ok = job["code"] == 0 and sorted(job["reports"]) == [0, 1] and all(r["step"] == steps for r in job["reports"].values())
        checks.add("repair", f"{name} run ends at step {steps}, exit 0", ok,
                   f"exit {job['code']}, {job['wall_s']:.1f} s" + ("" if ok else f": {tail(job['log'])}"))
    if faulted["killed"] is None or sorted(faulted["reports"]) != [0, 1] or sorted(reference["reports"]) != [0, 1]:
        checks.add("repair", "rank 1 was killed and both runs reported", False, tail(faulted["log"]))
        return
    killed_at = faulted["killed"]["time"]
    # every rank finished the killed step again: the job regained its progress
    regained = max(min(t for step, _, t, _ in report["steps"] if t > killed_at and step >= kill_step)
                   for report in faulted["reports"].values())
    redone = max(len(report["steps"]) - len({s for s, *_ in report["steps"]}) for report in faulted["reports"].values())
    started = {rank: sorted(int(p.name.split("-")[-1]) for p in (work / "faulted").glob(f"pid-start-rank{rank}-*"))
               for rank in (0, 1)}
    kept = started[0] == [faulted["reports"][0]["pid"]] and len(started[1]) == 2
    checks.add("repair", "only rank 1 restarted: rank 0 kept its process", kept,
               f"rank 0 pids {started[0]}, rank 1 pids {started[1]}")
    checks.add("repair", "time to regain progress (kill -> every rank past the killed step)", None,
               f"{regained - killed_at:.2f} s")
    checks.add("repair", "steps redone", redone == 0, str(redone))
    same = all(faulted["reports"][r]["digest"] == reference["reports"][r]["digest"] for r in (0, 1))
    checks.add("repair", "every rank's model and Adam state equal the fault-free run's bit for bit", same,
               "identical" if same else "differ")


def nccl(checks: Checks, out: Path, cycles: int) -> None:
    log, target = out / "nccl.log", out / "nccl.json"
    result = run([PY, "scripts/gpu/group_cycles.py", "--backend", "nccl", "--cycles", str(cycles), "--json", str(target)],
                 log, 300)
    if not target.exists():
        checks.add("nccl", f"{cycles} abort/re-form cycles", False, f"exit {result.returncode}: {tail(log)}")
        return
    found = json.loads(target.read_text())
    cycle_ms = [f"{r['cycle_s'] * 1000:.0f}" for r in found["rows"]]
    checks.add("nccl", f"{cycles} cycles, every one re-formed the groups", found["every_cycle_reconnected"],
               f"median cycle {found['median_cycle_s'] * 1000:.0f} ms (abort {found['median_release_s'] * 1000:.1f} ms); "
               f"each, ms: {' '.join(cycle_ms)}")
    checks.add("nccl", "DDP and FSDP2 modules still train as a plain module does", found["modules_train"],
               json.dumps(found["max_abs_difference_from_plain"]))
    checks.add("nccl", "no thread leak", not found["leaks_threads"], f"threads {found['threads_first_last']}")
    checks.add("nccl", "no GPU memory leak", not found["leaks_gpu_memory"],
               f"allocated bytes {found['gpu_allocated_first_last']}")


def snapshot(checks: Checks, out: Path, sizes: str) -> None:
    log, target = out / "snapshot.log", out / "snapshot.json"
    result = run([PY, "scripts/bench_checkpoint.py", "--device", DEVICE_TYPE, "--sizes", sizes, "--repeats", "3",
                  "--batch", "1024", "--skip-restart", "--disk-dir", str(out), "--json", str(target)], log, 420)
    if result.returncode != 0 or not target.exists():
        checks.add("snapshot", "bench_checkpoint.py --device cuda", False, f"exit {result.returncode}: {tail(log)}")
        return
    checks.add("snapshot", "every way's snapshot equals the GPU state bit for bit", True)
    for row in json.loads(target.read_text())["blocking"]:
        m = {k: statistics.median(row[k]) for k in ("step_s", "snapshot_s", "snapshot_own_stream_s", "snapshot_pinned_s",
                                                     "snapshot_no_overlap_s", "torch_save_s") if row.get(k)}
        others = "".join(f"{name} {m[key] * 1000:.0f} ms, " for name, key in (
            ("own stream", "snapshot_own_stream_s"), ("pinned buffers", "snapshot_pinned_s")) if key in m)
        added = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v * 1000:.0f} ms" for k, v in row["added_to_step"].items())
        checks.add("snapshot", f"{row['state_bytes'] / 2**30:.2f} GiB of state: added to the step after it", None, added)
        checks.add("snapshot", f"{row['state_bytes'] / 2**30:.2f} GiB of state: blocked per snapshot", None,
                   f"the default (training's stream) {m['snapshot_s'] * 1000:.0f} ms, {others}"
                   f"no overlap {m['snapshot_no_overlap_s'] * 1000:.0f} ms, torch.save {m['torch_save_s'] * 1000:.0f} ms "
                   f"({m['torch_save_s'] / m['snapshot_s']:.1f}x); step {m['step_s'] * 1000:.0f} ms")


def overhead(checks: Checks, out: Path, runs: int, steps: int) -> None:
    work = out / "overhead"
    work.mkdir()
    medians: dict[str, list[float]] = {"ftrun job.ddp()": [], "torchrun torch DDP": []}
    for attempt in range(runs):  # alternating, so that drift hits both alike
        ours = elastic_run(work, f"ftrun-{attempt}", steps, None)
        if ours["code"] == 0 and 0 in ours["reports"]:
            medians["ftrun job.ddp()"].append(statistics.median(d for s, _, _, d in ours["reports"][0]["steps"] if s > 5))
        folder = work / f"torch-{attempt}"
        folder.mkdir()
        theirs = run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)],
                     folder / "torchrun.log", 300, {"OUT_DIR": str(folder), "GPU_MODE": "torch", "STEPS": str(steps)})
        report = folder / "torch-rank0.json"
        if theirs.returncode == 0 and report.exists():
            medians["torchrun torch DDP"].append(
                statistics.median(d for s, _, _, d in json.loads(report.read_text())["steps"] if s > 5))
    ours_ms, theirs_ms = medians["ftrun job.ddp()"], medians["torchrun torch DDP"]
    if len(ours_ms) != runs or len(theirs_ms) != runs:
        checks.add("overhead", "every run finished", False, f"ftrun {len(ours_ms)}/{runs}, torchrun {len(theirs_ms)}/{runs}")
        return
    ratio = statistics.median(ours_ms) / statistics.median(theirs_ms)
    checks.add("overhead", f"median step, {runs} runs each", None,
               f"job.ddp() {statistics.median(ours_ms) * 1000:.2f} ms, torch DDP {statistics.median(theirs_ms) * 1000:.2f} ms "
               f"({ratio:.2f}x); per run: {[round(x * 1000, 2) for x in ours_ms]} vs {[round(x * 1000, 2) for x in theirs_ms]}")


def online(checks: Checks, out: Path, steps: int, fault_step: int) -> None:
    """The online level's CUDA path. NCCL refuses two ranks on one GPU, so the job is one rank whose
    communicators break under it: the rank reports its failed collective, the controller repairs in
    place, and the rank aborts and re-forms its NCCL groups and redoes the step, no process started."""
    work = out / "online"
    work.mkdir()
    flags = ("--recovery", "process", "--device", DEVICE_TYPE)
    reference = elastic_run(work, "reference", steps, None, flags, mode="online", ranks=1)
    faulted = elastic_run(work, "faulted", steps, None, flags, mode="online", ranks=1,
                          env_extra={"FAULT_STEP": str(fault_step)})
    if faulted["code"] == 0 and faulted["reports"].get(0, {}).get("generation") == 0:
        # the aborted communicator was made again at the next collective and nothing failed: tell the
        # step's collectives of an NCCL error as well (the abort and re-form that follow are real)
        checks.add("online", "an aborted NCCL communicator fails the next collective", None,
                   "no: torch made it again; the next run tells the step of an NCCL error after the abort")
        faulted = elastic_run(work, "faulted-error", steps, None, flags, mode="online", ranks=1,
                              env_extra={"FAULT_STEP": str(fault_step), "FAULT_HOW": "error"})
    for name, job in (("fault-free", reference), ("faulted", faulted)):
        ok = job["code"] == 0 and sorted(job["reports"]) == [0] and job["reports"][0]["step"] == steps
        checks.add("online", f"{name} run ends at step {steps}, exit 0", ok,
                   f"exit {job['code']}, {job['wall_s']:.1f} s" + ("" if ok else f": {tail(job['log'])}"))
    quiet = reference["reports"].get(0, {}).get("generation") == 0 and "repair" not in reference["log"].read_text()
    checks.add("online", "the fault-free run had no repair (generation 0 at the end)", quiet,
               "" if quiet else tail(reference["log"]))
    folder = faulted["log"].parent
    fault = folder / "fault-rank0.json"
    if not fault.exists() or 0 not in faulted["reports"] or 0 not in reference["reports"]:
        checks.add("online", "the communicators were aborted and both runs reported", False, tail(faulted["log"]))
        return
    report, broke = faulted["reports"][0], json.loads(fault.read_text())
    log = faulted["log"].read_text()
    checks.add("online", f"repaired online ({broke['how']}): said so in the log, generation 0 -> 1",
               "repaired online" in log and report["generation"] == 1, f"generation {report['generation']}; "
               + " | ".join(line.strip() for line in log.splitlines() if "online" in line)[:300])
    started = sorted(int(p.name.split("-")[-1]) for p in folder.glob("pid-start-rank0-*"))
    checks.add("online", "no process started: the rank kept its pid", started == [report["pid"]], f"pids {started}")
    regained = min(t for step, _, t, _ in report["steps"] if t > broke["time"] and step >= fault_step)
    checks.add("online", "time to regain progress (abort -> the broken step done again)", None,
               f"{regained - broke['time']:.2f} s")
    same = report["digest"] == reference["reports"][0]["digest"]
    checks.add("online", "model and Adam state equal the fault-free run's bit for bit", same, "identical" if same else "differ")


def title(versions: dict) -> str:
    return (f"ftrun on a GPU: {versions.get('gpu', '?')}, driver {versions.get('driver', '?')}, "
            f"torch {versions.get('torch', '?')} (CUDA {versions.get('cuda', '?')})")


def versions() -> dict:
    import torch

    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return found
    if smi.returncode == 0 and smi.stdout.strip():
        found["gpu"], found["driver"] = (part.strip() for part in smi.stdout.splitlines()[0].split(",", 1))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", type=Path, required=True, help="folder for logs and results.json (emptied)")
    parser.add_argument("--steps", type=int, default=40, help="repair: steps of the job (default 40)")
    parser.add_argument("--kill-step", type=int, default=20, help="repair: rank 1 dies during this step; online: the communicators break in it (default 20)")
    parser.add_argument("--cycles", type=int, default=20, help="nccl: abort/re-form cycles (default 20)")
    parser.add_argument("--sizes", default="64,512,2048", help="snapshot: model sizes in MB (default 64,512,2048)")
    parser.add_argument("--runs", type=int, default=3, help="overhead: runs of each launcher (default 3)")
    parser.add_argument("--overhead-steps", type=int, default=60, help="overhead: steps per run (default 60)")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    checks = Checks()
    found = versions()
    steps = {"probe": lambda: probe(checks, args.out), "placement": lambda: placement(checks, args.out),
             "repair": lambda: repair(checks, args.out, args.steps, args.kill_step),
             "nccl": lambda: nccl(checks, args.out, args.cycles), "snapshot": lambda: snapshot(checks, args.out, args.sizes),
             "overhead": lambda: overhead(checks, args.out, args.runs, args.overhead_steps),
             "online": lambda: online(checks, args.out, args.steps, args.kill_step)}
    for part in parts:
        began = time.time()
        try:
            steps[part]()
        except Exception as e:  # one part's surprise is a failed row, and the other parts still run
            checks.add(part, "ran to the end", False, f"{type(e).__name__}: {e}")
        print(f"[{part}] {time.time() - began:.0f} s", file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps({"versions": found, "rows": checks.rows}, indent=2))
    print_table(checks, title(found))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
