"""scripts/npu_check.sh's Python parts against the torch_npu stand-in (tests/npu_stand_in.py), and the script on a
machine without an NPU: one line and its own exit code."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import torch.distributed as dist

from ftrun.elastic.backends import HcclBackend
from tests.conftest import ROOT
from tests.npu_stand_in import ProcessGroup, TorchNpu

spec = importlib.util.spec_from_file_location("npu_check", ROOT / "scripts" / "npu" / "check.py")
assert spec is not None and spec.loader is not None
npu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(npu_check)


def rows(checks) -> list[tuple[str, bool | None]]:
    return [(row["check"], row["ok"]) for row in checks.rows]


def test_an_idle_chip_stopped_checked_and_restarted_passes(monkeypatch):
    npu = TorchNpu()
    npu.install(monkeypatch)
    checks = npu_check.Checks()
    npu_check.check_device(checks, npu.npu, 0, lambda: not npu.device_stopped)
    assert not checks.failed
    assert [name for name, _ in npu.calls] == ["stop_device", "check_uce_in_memory", "restart_device"]


def test_a_chip_that_cannot_be_stopped_or_holds_a_uce_fails_the_device_part(monkeypatch):
    npu = TorchNpu()
    npu.install(monkeypatch)
    npu.abort_fails, npu.uce = True, 3
    checks = npu_check.Checks()
    npu_check.check_device(checks, npu.npu, 0, lambda: True)
    assert rows(checks)[:2] == [("stop_device(0) returns 0", False), ("check_uce_in_memory(0) answers 0 on an idle chip", False)]
    assert checks.failed


def test_hccl_groups_released_and_re_formed_meet_no_force_stop(monkeypatch):
    # the stand-in's watchdogs take a look while the device is stopped, as the real thread would
    npu = TorchNpu()
    npu.install(monkeypatch)
    monkeypatch.setattr("ftrun.elastic.backends._socket_fds", lambda: set())
    stop = npu.stop_device

    def stop_while_watchdogs_look(device):
        result = stop(device)
        for group in npu.groups:
            group.watchdog_tick()
        return result

    npu.npu.stop_device = stop_while_watchdogs_look
    backend = HcclBackend(dist=types.SimpleNamespace(ProcessGroup=ProcessGroup), local_rank=0)
    cycles = npu_check.hccl_cycles(backend, dist.HashStore(), 0, 1, 3, lambda group: group.barrier() is not None)
    assert [sorted(row) for row in cycles] == [["all_reduce_s", "connect_s", "generation", "memory", "release_s",
                                                "sum_right"]] * 3
    checks = npu_check.Checks()
    npu_check.judge_hccl(checks, {0: cycles}, 1, 3)
    assert not checks.failed


def test_a_force_stop_left_over_fails_the_hccl_part():
    left_over = [{"generation": 0, "connect_s": 0.1, "all_reduce_s": 0.1, "release_s": 0.2, "sum_right": True},
                 {"generation": 1, "error": "RuntimeError: FORCE STOP."}]
    checks = npu_check.Checks()
    npu_check.judge_hccl(checks, {0: left_over, 1: left_over}, 2, 5)
    assert checks.failed and ("rank 0: 5 groups released and re-formed, every all-reduce right", False) in rows(checks)


def test_the_process_part_wants_a_replacement_the_workers_setting_and_equal_state(tmp_path):
    log = tmp_path / "ftrun.log"
    log.write_text("done\n")

    def job(code, replaced, setting="0", digest="d"):
        reports = {0: {"step": 30, "replacement": False, "async_error_handling": setting, "digest": digest},
                   1: {"step": 30, "replacement": replaced, "async_error_handling": setting, "digest": digest}}
        return {"code": code, "wall_s": 9.0, "reports": reports, "log": log, "killed": replaced}

    good = npu_check.Checks()
    npu_check.judge_process(good, job(0, False), job(0, True), 30)
    assert not good.failed
    bad = npu_check.Checks()
    npu_check.judge_process(bad, job(0, False), job(0, True, setting=None, digest="e"), 30)
    assert [name for name, ok in rows(bad) if ok is False] == [
        "the workers ran with TORCH_HCCL_ASYNC_ERROR_HANDLING=0", "model and Adam state equal the fault-free run's bit for bit"]


def test_without_an_npu_the_check_says_so_in_one_line_and_exits_2():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "npu_check.sh")], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["npu_check: no NPU visible to /bin/false's torch_npu: nothing to check"]


def test_an_unknown_part_is_named():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "npu" / "check.py"), "--out", "/nonexistent",
                           "--parts", "device,warp"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown part warp" in done.stderr
