"""The Ascend recovery paths of ftrun's torch workers on a real node, in one table (scripts/npu_check.sh runs this).

Parts (--parts, default all):
  device   an idle chip (logical device 0): torch_npu.npu.stop_device returns 0, check_uce_in_memory answers 0
           (no UCE), restart_device returns, and a tensor is computed on the chip after; each call timed
  hccl     2 processes on chips 0 and 1: a group made by ftrun's HCCL backend, an all-reduce on it, then the
           repair's release (the group's watchdog paused, the device stopped, the UCE check, the restart, the
           watchdog's work cleared and resumed) and the next generation's group, --cycles times; no all-reduce may
           fail (a "FORCE STOP." left over from a release) and every sum must be right
  process  ftrun --standalone --device npu --nproc-per-node 2 --recovery process: rank 1 SIGKILLed during
           --kill-step of --steps, against a fault-free run of the same job: both exit 0, a replacement
           joined, every rank finished, the model and Adam state equal bit for bit

Exits non-zero when any check fails. Every figure and log goes to --out (JSON: results.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))  # device_checks.py
SCRIPT = ROOT / "scripts" / "npu" / "npu_train.py"
PY = sys.executable

from device_checks import Checks, print_table, run, tail  # noqa: E402

PARTS = ("device", "hccl", "process")


def timed(call: Callable[[], object]) -> tuple[object, float]:
    began = time.perf_counter()
    result = call()
    return result, time.perf_counter() - began


def check_device(checks: Checks, npu, device: int, computes: Callable[[], bool]) -> None:
    """Stop, check and restart ``device`` through ``npu`` (torch_npu.npu), then ``computes`` on it."""
    stopped, stop_s = timed(lambda: npu.stop_device(device))
    checks.add("device", f"stop_device({device}) returns 0", stopped == 0, f"{stopped!r} in {stop_s * 1e3:.1f} ms")
    try:
        uce, uce_s = timed(lambda: npu.check_uce_in_memory(device))
        checks.add("device", f"check_uce_in_memory({device}) answers 0 on an idle chip", uce == 0,
                   f"{uce!r} in {uce_s * 1e3:.1f} ms")
    except RuntimeError as e:  # PYTORCH_NO_NPU_MEMORY_CACHING=1 turns it off
        checks.add("device", f"check_uce_in_memory({device}) answers", False, str(e)[:200])
    _, restart_s = timed(lambda: npu.restart_device(device, rebuild_all_resources=False))
    checks.add("device", f"restart_device({device})", None, f"{restart_s * 1e3:.1f} ms")
    try:
        ok = computes()
        checks.add("device", "a tensor is computed on the chip after the restart", ok, "right" if ok else "wrong")
    except RuntimeError as e:
        checks.add("device", "a tensor is computed on the chip after the restart", False, str(e)[:200])


def hccl_cycles(backend, store, rank: int, world: int, cycles: int, all_reduce: Callable[[object], bool]) -> list[dict]:
    """``cycles`` generations of a group of ``world`` ranks made by ``backend`` (ftrun's HcclBackend), each
    with one checked all-reduce and then the repair's release; one row per generation."""
    import torch.distributed as dist

    rows = []
    for generation in range(cycles):
        row: dict = {"generation": generation}
        try:
            prefixed = dist.PrefixStore(f"g{generation}", store)
            group, row["connect_s"] = timed(lambda: backend.connect(prefixed, rank, world, 120.0, tuple(range(world)),
                                                                    f"{generation}_world"))
            row["sum_right"], row["all_reduce_s"] = timed(lambda: all_reduce(group))
            _arrive(store, f"reduced/{generation}", world)  # no chip is stopped while a peer still reduces
            _, row["release_s"] = timed(lambda: backend.release([group]))
            row["memory"] = backend.memory.value
            _arrive(store, f"released/{generation}", world)  # nor a next group made before every rank released
        except Exception as e:  # a FORCE STOP left over, a failed connect: the cycle's row says so
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            break
        rows.append(row)
    return rows


def _arrive(store, key: str, count: int, deadline_s: float = 120.0) -> None:
    """This rank arrived at ``key``; returns once ``count`` ranks did."""
    store.add(key, 1)
    deadline = time.monotonic() + deadline_s
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key}: fewer than {count} ranks after {deadline_s:.0f} s")
        time.sleep(0.01)


def judge_hccl(checks: Checks, reports: dict[int, list[dict]], world: int, cycles: int) -> None:
    """The hccl part's rows from every rank's cycles."""
    checks.add("hccl", f"{world} ranks reported", sorted(reports) == list(range(world)), f"ranks {sorted(reports)}")
    for rank, rows in sorted(reports.items()):
        errors = [row["error"] for row in rows if "error" in row]
        done = [row for row in rows if "error" not in row]
        ok = not errors and len(done) == cycles and all(row["sum_right"] for row in done)
        checks.add("hccl", f"rank {rank}: {cycles} groups released and re-formed, every all-reduce right", ok,
                   errors[0] if errors else f"{len(done)} of {cycles}")
        if done:
            for field in ("release_s", "connect_s"):
                checks.add("hccl", f"rank {rank}: median {field.removesuffix('_s')}", None,
                           f"{statistics.median(row[field] for row in done):.3f} s")


def hccl_worker(rank: int, world: int, port: int, cycles: int, out: Path) -> None:
    """One rank of the hccl part, on chip ``rank`` (a process of its own, as a worker is)."""
    import torch
    import torch.distributed as dist
    import torch_npu  # noqa: F401  # registers the npu device

    from ftrun.elastic.backends import HcclBackend

    torch.npu.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    backend = HcclBackend(local_rank=rank)

    def all_reduce(group) -> bool:
        tensor = torch.full((1024,), float(rank + 1), device=f"npu:{rank}")
        group.allreduce([tensor]).wait()
        torch.npu.synchronize()
        return bool(torch.all(tensor.cpu() == world * (world + 1) / 2))

    rows = hccl_cycles(backend, store, rank, world, cycles, all_reduce)
    (out / f"hccl-rank{rank}.json").write_text(json.dumps(rows))


def device(checks: Checks) -> None:
    import torch
    import torch_npu

    torch.npu.set_device(0)
    torch.ones(1, device="npu:0").add_(1)
    torch.npu.synchronize()  # the chip is initialised and idle

    def computes() -> bool:
        result = (torch.arange(4, device="npu:0", dtype=torch.float32) * 2).cpu()
        return result.tolist() == [0.0, 2.0, 4.0, 6.0]

    check_device(checks, torch_npu.npu, 0, computes)


def hccl(checks: Checks, out: Path, cycles: int) -> None:
    work = out / "hccl"
    work.mkdir()
    port = _free_port()
    workers = []
    for rank in range(2):
        log = open(work / f"rank{rank}.log", "w")
        command = [PY, __file__, "--hccl-worker", str(rank), "--port", str(port), "--cycles", str(cycles), "--out", str(work)]
        workers.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    for process, log in workers:
        try:
            process.wait(timeout=120 + 30 * cycles)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    reports = {rank: json.loads((work / f"hccl-rank{rank}.json").read_text())
               for rank in range(2) if (work / f"hccl-rank{rank}.json").exists()}
    judge_hccl(checks, reports, 2, cycles)
    if len(reports) < 2:
        checks.add("hccl", "the ranks' output", None, tail(work / "rank0.log") + " || " + tail(work / "rank1.log"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ftrun_job(work: Path, name: str, steps: int, kill_step: int | None) -> dict:
    """One ftrun job of npu_train.py on two chips under --recovery process: its exit code and every rank's report."""
    folder = work / name
    folder.mkdir()
    env = {"OUT_DIR": str(folder), "STEPS": str(steps)}
    if kill_step is not None:
        env.update(KILL_RANK="1", KILL_STEP=str(kill_step))
    began = time.time()
    result = run([PY, "-m", "ftrun", "--standalone", "--nproc-per-node", "2", "--device", "npu", "--recovery",
                  "process", "--max-restarts", "3", str(SCRIPT)], folder / "ftrun.log", 600, env)
    reports = {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in folder.glob("rank*.json")}
    return {"code": result.returncode, "wall_s": time.time() - began, "reports": reports, "log": folder / "ftrun.log",
            "killed": (folder / "killed-rank1.json").exists()}


def judge_process(checks: Checks, reference: dict, faulted: dict, steps: int) -> None:
    """The process part's rows from a fault-free and a faulted run of the same job."""
    for name, job in (("fault-free", reference), ("faulted", faulted)):
        ok = job["code"] == 0 and sorted(job["reports"]) == [0, 1] and all(r["step"] == steps for r in job["reports"].values())
        checks.add("process", f"{name} run: exit 0, both ranks at step {steps}", ok,
                   f"exit {job['code']} in {job['wall_s']:.0f} s" + ("" if ok else f": {tail(job['log'])}"))
    checks.add("process", "rank 1 was killed in the faulted run", faulted["killed"])
    replaced = faulted["reports"].get(1, {}).get("replacement") is True
    checks.add("process", "rank 1 finished as a replacement, rank 0 kept its process", replaced
               and faulted["reports"].get(0, {}).get("replacement") is False)
    settings = {r.get("async_error_handling") for r in faulted["reports"].values()}
    checks.add("process", "the workers ran with TORCH_HCCL_ASYNC_ERROR_HANDLING=0", settings == {"0"}, f"{settings}")
    if 0 in reference["reports"] and 0 in faulted["reports"]:
        same = reference["reports"][0]["digest"] == faulted["reports"][0]["digest"]
        checks.add("process", "model and Adam state equal the fault-free run's bit for bit", same,
                   "identical" if same else "differ")


def process(checks: Checks, out: Path, steps: int, kill_step: int) -> None:
    work = out / "process"
    work.mkdir()
    judge_process(checks, ftrun_job(work, "reference", steps, None), ftrun_job(work, "faulted", steps, kill_step), steps)


def versions() -> dict:
    import torch
    import torch_npu

    return {"torch": torch.__version__, "torch_npu": torch_npu.__version__, "python": sys.version.split()[0],
            "chip": torch.npu.get_device_name(0)}


def title(found: dict) -> str:
    return (f"ftrun on Ascend: {found.get('chip', '?')}, torch {found.get('torch', '?')}, "
            f"torch_npu {found.get('torch_npu', '?')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", type=Path, required=True, help="folder for logs and results.json (emptied)")
    parser.add_argument("--steps", type=int, default=30, help="process: steps of the job (default 30)")
    parser.add_argument("--kill-step", type=int, default=15, help="process: rank 1 dies during this step (default 15)")
    parser.add_argument("--cycles", type=int, default=5, help="hccl: release and re-form cycles (default 5)")
    parser.add_argument("--hccl-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hccl_worker is not None:
        hccl_worker(args.hccl_worker, 2, args.port, args.cycles, args.out)
        return 0
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    checks = Checks()
    found = versions()
    steps = {"device": lambda: device(checks), "hccl": lambda: hccl(checks, args.out, args.cycles),
             "process": lambda: process(checks, args.out, args.steps, args.kill_step)}
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
