"""Faults that do not end a process: sick devices (a stand-in npu-smi), hangs, broken device tools."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, WORKERS, Launcher, free_port, step_reached, unique_mark, wait_for

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
TRAIN = str(WORKERS / "train.py")
FAKES = ROOT / "tests" / "fakes"
STEPS = 30


class NpuState:
    """The stand-in npu-smi's state file: what the "hardware" reports, changed by the test mid-run."""

    def __init__(self, path: Path, devices: int):
        self.path = path
        self.state = {"board": "A2", "mode": "normal", "version": "24.1.0", "npus": [
            {"id": i, "name": "910B2", "chips": [{"id": 0, "logic_id": i, "health": "OK", "codes": [], "info": []}]}
            for i in range(devices)
        ]}
        self.write()

    def set_chip(self, npu: int, health: str, codes: list[str], info: list[str] = ()) -> None:
        self.state["npus"][npu]["chips"][0].update(health=health, codes=codes, info=list(info))
        self.write()

    def set_mode(self, mode: str) -> None:
        self.state["mode"] = mode
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)  # the stand-in never reads half a file


def npu_env(launcher: Launcher, state: NpuState, **extra: str) -> dict[str, str]:
    env = launcher.env(NPU_SMI_STATE=str(state.path), **extra)
    env["PATH"] = f"{FAKES}{os.pathsep}{env['PATH']}"
    return env


def wait_for_step(launcher: Launcher, rank: int, step: int) -> None:
    def reached():
        return step_reached(launcher.out_dir, rank) >= step

    wait_for(reached, timeout=120, what=f"rank {rank} to reach step {step}")


def run_elastic(launcher: Launcher, env: dict, nnodes: int = 1, flags: tuple[str, ...] = ()) -> list:
    # each repair here replaces one rank of the node: one warm standby serves it; the stand-in npu-smi's
    # reset is done at once, so the 20 s a real chip asks for after one would only slow the tests
    common = ["--recovery", "process", "--max-restarts", "3", "--health-interval", "0.2", "--reset-wait", "0.2",
              *flags]
    return launcher.start_job(nnodes, 2, [ELASTIC], flags=common, env=env)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """One node, 2 ranks, STEPS steps, no fault: the parameters every repaired run must end with."""
    runner = Launcher(tmp_path_factory.mktemp("detection-fault-free"), unique_mark("detection-fault-free"))
    runner.start_job(1, 2, [ELASTIC], flags=["--recovery", "process"],
                     env=runner.env(STEPS=str(STEPS), STEP_SLEEP="0"))
    assert runner.wait() == [0], runner.output()
    return runner.results()[0]["checksum"]


def assert_finished_identically(launcher: Launcher, checksum: float) -> dict[int, dict]:
    results = launcher.results()
    assert sorted(results) == [0, 1], launcher.output()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {r["checksum"] for r in results.values()} == {checksum}
    return results


def test_device_turning_alarm_with_a_separate_code_moves_its_rank_to_a_free_device(launcher, tmp_path, fault_free):
    state = NpuState(tmp_path / "npu.json", devices=3)
    levels = tmp_path / "levels.yaml"
    levels.write_text("codes:\n  '80E38003': SeparateNPU\n")
    env = npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="0.1")
    run_elastic(launcher, env, flags=("--device", "npu", "--fault-levels", str(levels)))
    wait_for_step(launcher, 1, 5)
    state.set_chip(1, "Alarm", ["80E38003"], ["hbm link down"])
    assert launcher.wait() == [0], launcher.output()
    results = assert_finished_identically(launcher, fault_free)
    # rank 0 kept its device and its process; rank 1 left device 1 for the free device 2
    assert (results[0]["device"], results[0]["visible"], results[0]["replacement"]) == ("0", "0,1", "0")
    assert (results[1]["device"], results[1]["visible"], results[1]["device_index"]) == ("2", "0,2", "1")
    assert results[1]["replacement"] == "1"
    output = launcher.output()
    assert re.search(r"device 1 \(npu 1 chip 0\): .*80E38003.* -> SeparateNPU", output), output
    assert "local rank 1 moves from device 1 to device 2" in output
    assert "1 of 3 restarts used" in output
    assert "(device:" in output  # the recovered fault is named by its cause in the summary


def test_restart_business_code_repairs_the_rank_in_place(launcher, tmp_path, fault_free):
    state = NpuState(tmp_path / "npu.json", devices=2)
    env = npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="0.1")
    run_elastic(launcher, env, flags=("--device", "auto"))  # auto: npu-smi is on PATH
    wait_for_step(launcher, 0, 5)
    state.set_chip(0, "Alarm", ["80E01801", "A4025021"], ["on-chip memory uncorrectable error"])
    assert launcher.wait() == [0], launcher.output()
    results = assert_finished_identically(launcher, fault_free)
    assert (results[0]["device"], results[0]["replacement"]) == ("0", "1")  # same device, new process
    assert results[1]["replacement"] == "0"
    output = launcher.output()
    assert re.search(r"device 0 .*80E01801.* -> RestartBusiness: process-level repair of its ranks", output), output
    assert "process-level repair into generation 1" in output


def test_restart_npu_code_resets_the_chip_before_its_rank_returns_to_it(launcher, tmp_path, fault_free):
    state = NpuState(tmp_path / "npu.json", devices=2)
    env = npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="0.1")
    run_elastic(launcher, env, flags=("--device", "npu"))
    wait_for_step(launcher, 0, 5)
    state.set_chip(0, "Alarm", ["8C03A000"], ["chip needs a reset"])
    assert launcher.wait() == [0], launcher.output()
    results = assert_finished_identically(launcher, fault_free)
    assert (results[0]["device"], results[0]["replacement"]) == ("0", "1")  # back on its chip, after the reset
    chip = json.loads(state.path.read_text())["npus"][0]["chips"][0]
    assert (chip["health"], chip["codes"], chip["resets"]) == ("OK", [], 1)
    output = launcher.output()
    assert re.search(r"device 0 .*8C03A000.* -> RestartNPU: stop its ranks, reset the chip, respawn them", output)
    assert "local rank 0 waits for a device reset" in output
    assert "resetting device 0" in output and "device 0 reset and healthy again" in output


def test_device_error_in_a_dead_ranks_output_resets_its_device(launcher, tmp_path, fault_free):
    state = NpuState(tmp_path / "npu.json", devices=2)
    env = npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="0.05", FAULT="1:5:ecc")
    run_elastic(launcher, env, flags=("--device", "npu"))
    assert launcher.wait() == [0], launcher.output()
    results = assert_finished_identically(launcher, fault_free)
    assert (results[1]["device"], results[1]["replacement"]) == ("1", "1")
    assert json.loads(state.path.read_text())["npus"][1]["chips"][0]["resets"] == 1
    output = launcher.output()
    assert "rank 1 failed: exit code 1 (device:" in output and "HBM MULTI BIT ECC ERROR" in output
    assert "device 1 reset and healthy again" in output


@pytest.mark.parametrize("trouble", ["missing", "hang", "garbage"])
def test_job_finishes_when_npu_smi_is_missing_hangs_or_prints_garbage(launcher, tmp_path, fault_free, trouble):
    state = NpuState(tmp_path / "npu.json", devices=2)
    env = npu_env(launcher, state, STEPS=str(STEPS), STEP_SLEEP="0.05")
    flags = ["--device", "npu", "--device-timeout", "1"]
    if trouble == "missing":
        flags += ["--npu-smi", str(tmp_path / "no-such-npu-smi")]
    run_elastic(launcher, env, flags=tuple(flags))
    if trouble != "missing":  # the tool works at start and breaks mid-run
        wait_for_step(launcher, 0, 3)
        state.set_mode(trouble)
    assert launcher.wait() == [0], launcher.output()
    assert_finished_identically(launcher, fault_free)
    output = launcher.output()
    if trouble == "missing":
        assert "no npu devices found" in output and "no-such-npu-smi" in output
    else:
        assert "device health unknown" in output
    assert "Traceback" not in output


def test_auto_with_fewer_devices_than_ranks_runs_without_assigning_devices(launcher, tmp_path):
    state = NpuState(tmp_path / "npu.json", devices=1)
    launcher.start_job(1, 2, [ELASTIC], flags=["--device", "auto"], env=npu_env(launcher, state, STEPS="3"))
    assert launcher.wait() == [0], launcher.output()
    assert {r["device"] for r in launcher.results().values()} == {None}
    assert "2 ranks per node but 1 npu devices: not assigning or watching devices" in launcher.output()


def test_explicit_device_kind_with_too_few_devices_stops_the_job_with_exit_4(launcher, tmp_path):
    state = NpuState(tmp_path / "npu.json", devices=1)
    launcher.start_job(1, 2, [ELASTIC], flags=["--device", "npu"], env=npu_env(launcher, state, STEPS="3"))
    assert launcher.wait() == [4], launcher.output()
    assert "no usable device left for 2 ranks (1 free of 1); no spare node" in launcher.output()


def test_sigstopped_rank_is_detected_dumped_killed_and_recovered(launcher):
    env = launcher.env(STEPS="12", STEP_SLEEP="0.05")
    flags = ["--recovery", "process", "--max-restarts", "3", "--heartbeat-timeout", "3"]
    launcher.start_job(2, 2, [ELASTIC], flags=flags, env=dict(env, FAULT="3:4:sigstop"))
    assert launcher.wait() == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {12}
    assert len({r["checksum"] for r in results.values()}) == 1
    assert results[3]["replacement"] == "1" and results[2]["replacement"] == "0"
    output = launcher.output()
    assert re.search(r"rank 3 \(pid \d+\) is hung: no heartbeat for [0-9.]+s \(--heartbeat-timeout 3\)", output), output
    assert "most recent call first" in output  # faulthandler's dump of the stopped rank, before the kill
    assert "(hang: no heartbeat" in output
    stopped = list(launcher.out_dir.glob("stopped-*"))
    assert len(stopped) == 1


def path_with_py_spy(with_it: bool) -> str:
    """PATH with the venv's py-spy (a test dependency) first, or with no folder that holds one."""
    folders = [d for d in os.environ["PATH"].split(os.pathsep) if d and not shutil.which("py-spy", path=d)]
    if with_it:
        folders.insert(0, str(Path(sys.executable).parent))
    return os.pathsep.join(folders)


def test_hang_timeout_catches_a_silent_rank_of_a_plain_script(launcher):
    # (without py-spy a plain script's rank gets no stack dump: tests/unit/test_hang.py)
    env = launcher.env(STEPS="10", FAULT="1:3:sigstop", PATH=path_with_py_spy(True))
    launcher.start_job(2, 2, [TRAIN], flags=["--max-restarts", "1", "--hang-timeout", "2"], env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    output = launcher.output()
    assert re.search(r"rank 1 \(pid \d+\) is hung: stopped, with no output and no CPU progress", output), output
    assert len(re.findall(r"is hung", output)) == 1  # the ranks waiting for it are not taken for hung
    assert "rank 1 stack (py-spy):" in output and "inject_fault" in output  # where it stopped
    assert "1 of 1 restart used" in output


def test_probe_shows_each_device_and_exits_4_on_an_unusable_one(ftrun_cli, tmp_path):
    state = NpuState(tmp_path / "npu.json", devices=2)
    env = {"NPU_SMI_STATE": str(state.path), "PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}"}
    code, out, err = ftrun_cli("probe", "--device", "npu", env=env)
    assert code == 0, err
    assert "910B2" in out and "npu 1 chip 0" in out
    assert "set in the workers under --recovery process" in out and "TORCH_HCCL_ASYNC_ERROR_HANDLING" in out
    state.set_chip(1, "Critical", ["8C03A000"], ["chip reset required"])
    code, out, err = ftrun_cli("doctor", "--json", env=env)
    assert code == 4, err
    report = json.loads(out)
    assert [d["usable"] for d in report["devices"]] == [True, False]
    assert report["devices"][1]["codes"] == ["8C03A000"] and report["devices"][1]["level"] == "RestartNPU"
    assert report["devices"][1]["rule"] == "ftrun/detection/fault_levels.yaml"
    state.set_chip(1, "Alarm", ["80C98008"], ["aicore error"])  # a code only MindCluster's list names
    code, out, err = ftrun_cli("probe", "--device", "npu", "--json", env=env)
    assert code == 0, err
    device = json.loads(out)["devices"][1]
    assert (device["level"], device["rule"]) == ("RestartRequest", "MindCluster faultCode.json v26.1.0")
    code, out, err = ftrun_cli("probe", "--device", "npu", "--json", env={**env, "MS_ENABLE_TFT": "{UCE:1}"})
    settings = {s["name"]: (s["value"], s["set_by"]) for s in json.loads(out)["recovery_env"]}
    assert settings["TORCH_HCCL_ASYNC_ERROR_HANDLING"] == ("0", "ftrun")
    assert settings["MS_ENABLE_TFT"] == ("{UCE:1}", "yours")  # the user's own value is kept
    code, out, err = ftrun_cli("probe", "--device", "npu", "--npu-smi", str(tmp_path / "absent"), env=env)
    assert code == 4 and "absent" in out and "Traceback" not in out + err


def test_preflight_stops_every_node_before_training_when_one_has_a_sick_device(launcher, tmp_path):
    healthy, sick = NpuState(tmp_path / "a.json", devices=2), NpuState(tmp_path / "b.json", devices=2)
    sick.set_chip(0, "Critical", [], [])
    endpoint = f"127.0.0.1:{free_port()}"
    # the healthy node hosts the store: two agents on one machine must not both try to bind its port
    # (a fresh-clone run once saw both succeed, and each waited on its own store)
    for host, state in ((1, healthy), (0, sick)):
        args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--run-id", launcher.mark,
                "--rdzv-conf", f"is_host={host}", "--device", "npu", "--preflight", ELASTIC]
        launcher.start(args, env=npu_env(launcher, state))
    assert launcher.wait() == [4, 4], launcher.output()
    output = launcher.output()
    assert "preflight failed" in output and "device 0 Critical" in output
    assert not list(launcher.out_dir.glob("pid-start-*"))  # no training started anywhere
