"""Device health as the agent sees it: change detection, escalation, isolation, resets, the probe."""

from __future__ import annotations

import json
import time

import pytest

from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.placement import NoDevice
from ftrun.contract import DeviceAssignment
from ftrun.detection.device_tool import DeviceToolSource
from ftrun.detection.probe import probe
from ftrun.detection.table import Escalation, FaultLevel, load_fault_table
from ftrun.devices import CpuBackend, Device, DeviceReading, Health

TABLE = load_fault_table()
HOUR = 3600.0


def status(index: int, health: Health = Health.OK, *codes: str) -> DeviceReading:
    return DeviceReading(Device(index, "910B2", f"npu {index} chip 0"), health, codes)


def watch() -> DeviceToolSource:
    return DeviceToolSource(CpuBackend(), TABLE, Escalation.from_table(TABLE))


def test_devices_healthy_when_first_seen_are_no_news():
    assert watch().observe([status(0), status(1)], now=0) == []


def test_transition_ok_to_alarm_with_a_known_code_is_one_event():
    w = watch()
    w.observe([status(0)], now=0)
    events = w.observe([status(0, Health.ALARM, "80E01801")], now=1)
    assert [(e.device, e.level, e.reason) for e in events] == [(0, FaultLevel.RESTART_BUSINESS, "code 80E01801")]
    assert w.observe([status(0, Health.ALARM, "80E01801")], now=2) == []  # unchanged: already handled


def test_transition_alarm_back_to_ok_says_healthy():
    w = watch()
    w.observe([status(0, Health.ALARM, "80E01801")], now=0)
    assert [(e.device, e.level) for e in w.observe([status(0)], now=1)] == [(0, None)]


def test_unknown_code_falls_back_to_the_health_word():
    w = watch()
    w.observe([status(2)], now=0)
    [event] = w.observe([status(2, Health.CRITICAL, "DEADBEEF")], now=1)
    assert event.level is FaultLevel.RESTART_NPU  # a reset first: the reset isolates it if it does not help


def test_same_device_needing_restart_npu_twice_in_a_day_is_isolated():
    w = watch()
    w.observe([status(0)], now=0)
    [first] = w.observe([status(0, Health.ALARM, "8C03A000")], now=1)
    w.observe([status(0)], now=2)
    [second] = w.observe([status(0, Health.ALARM, "8C03A000")], now=20 * HOUR)
    assert (first.level, second.level) == (FaultLevel.RESTART_NPU, FaultLevel.SEPARATE)
    assert "escalated from RestartNPU" in second.reason


def test_restart_npu_a_day_apart_is_not_escalated():
    w = watch()
    w.observe([status(0, Health.ALARM, "8C03A000")], now=0)
    w.observe([status(0)], now=1)
    [event] = w.observe([status(0, Health.ALARM, "8C03A000")], now=25 * HOUR)
    assert event.level is FaultLevel.RESTART_NPU


def npu_state(devices: int, **chip0) -> dict:
    npus = [{"id": n, "name": "910B2", "chips": [{"id": 0, "logic_id": n, "health": "OK", "codes": [], "info": []}]}
            for n in range(devices)]
    npus[0]["chips"][0].update(chip0)
    return npus


def node_devices(backend, devices: list[int], reset_timeout: float = 10, reset_wait: float = 0) -> NodeDevices:
    return NodeDevices(backend, TABLE, devices, health_interval=60, reset_timeout=reset_timeout,
                       reset_wait=reset_wait)


def chips_of(state_file) -> list[dict]:
    return [chip for npu in json.loads(state_file.read_text())["npus"] for chip in npu["chips"]]


def wait_for_resets(node: NodeDevices, running: list[int], within: float = 15) -> None:
    deadline = time.monotonic() + within
    while node.resetting and time.monotonic() < deadline:
        node.tick(running=running)
        time.sleep(0.05)


def test_separate_npu_isolates_the_device_and_names_its_ranks(fake_npu):
    node = node_devices(fake_npu("A2", npu_state(3)), [0, 1, 2])
    node.assign(2)
    w = watch()
    w.observe(node.backend.poll(), now=0)
    [event] = w.observe([status(1, Health.UNKNOWN)], now=1)
    assert node.apply(event) == [1]
    assert node.placed(node.device_for_respawn(1)) == (DeviceAssignment(2, 1), ("ASCEND_RT_VISIBLE_DEVICES", "0,2"))


def test_reset_waits_until_the_device_is_idle_then_makes_it_usable_again(fake_npu):
    backend = fake_npu("A2", npu_state(2, health="Alarm", codes=["8C03A000"]))
    node = node_devices(backend, [0, 1])
    node.assign(2)
    node.on_worker_error(0, FaultLevel.RESTART_NPU, "HBM MULTI BIT ECC ERROR")
    assert node.resetting
    with pytest.raises(NoDevice, match="device 0 being reset"):
        node.device_for_respawn(0)
    node.tick(running=[0, 1])  # local rank 0 still runs on it: no reset yet
    time.sleep(0.3)
    assert json.loads(fake_npu.state_file.read_text())["npus"][0]["chips"][0].get("resets") is None
    deadline = time.monotonic() + 15
    while node.resetting and time.monotonic() < deadline:
        node.tick(running=[1])
        time.sleep(0.05)
    assert not node.resetting
    assert node.device_for_respawn(0).device == 0
    assert json.loads(fake_npu.state_file.read_text())["npus"][0]["chips"][0]["resets"] == 1


def test_reset_waits_the_settle_time_before_reading_health_again(fake_npu):
    # npusmi_074: wait at least 20 s after a reset before querying the chip; a read at once may be stale
    node = node_devices(fake_npu("A2", npu_state(1, health="Alarm", codes=["8C03A000"])), [0], reset_wait=0.6)
    node.assign(1)
    node.on_worker_error(0, FaultLevel.RESTART_NPU, "chip needs a reset")
    started = time.monotonic()
    wait_for_resets(node, running=[])
    assert not node.resetting and time.monotonic() - started >= 0.6
    assert node.device_for_respawn(0).device == 0


def test_reset_refused_with_exit_0_isolates_the_device(fake_npu):
    # "This device does not support setting reset." is a failure whatever the exit code
    node = node_devices(fake_npu("A2", npu_state(2, health="Alarm", codes=["8C03A000"], reset="unsupported")), [0, 1])
    node.assign(2)
    node.on_worker_error(0, FaultLevel.RESTART_NPU, "chip needs a reset")
    wait_for_resets(node, running=[1])
    [state, _] = node.states()
    assert state.health == "isolated" and "does not support setting reset" in state.reason


def test_code_in_no_table_resets_the_chip_and_isolates_it_when_the_reset_does_not_help(fake_npu):
    backend = fake_npu("A2", npu_state(2, health="Alarm", codes=["DEADBEEF"], reset="no effect"))
    node = node_devices(backend, [0, 1], reset_timeout=0.5)
    node.assign(2)
    [event] = watch().observe(backend.poll(), now=0)
    assert event.level is FaultLevel.RESTART_NPU and node.apply(event) == [0]
    wait_for_resets(node, running=[1])
    assert chips_of(fake_npu.state_file)[0]["resets"] == 1
    assert node.states()[0].health == "isolated"


def test_reset_of_an_a3_die_resets_the_other_die_with_it_and_stops_its_rank(fake_npu):
    npus = [{"id": n, "name": "Ascend910", "chips": [
        {"id": c, "logic_id": 2 * n + c, "health": "OK", "codes": [], "info": []} for c in range(2)]} for n in range(2)]
    npus[0]["chips"][1].update(health="Alarm", codes=["8C03A000"])
    node = node_devices(fake_npu("A3", npus), [0, 1, 2, 3])
    node.assign(4)
    assert node.on_worker_error(1, FaultLevel.RESTART_NPU, "chip needs a reset") == [0]  # die 0's rank goes too
    assert [s.health for s in node.states()] == ["resetting", "resetting", "ok", "ok"]
    wait_for_resets(node, running=[2, 3])
    assert [chip.get("resets") for chip in chips_of(fake_npu.state_file)] == [1, 1, None, None]
    assert not node.resetting


def test_a3_die_whose_reset_is_refused_is_isolated_and_the_other_die_goes_back_to_work(fake_npu):
    npus = [{"id": 0, "name": "Ascend910", "chips": [
        {"id": c, "logic_id": c, "health": "OK", "codes": [], "info": []} for c in range(2)]}]
    npus[0]["chips"][1].update(health="Alarm", codes=["8C03A000"], reset="unsupported")
    node = node_devices(fake_npu("A3", npus), [0, 1])
    node.assign(2)
    node.on_worker_error(1, FaultLevel.RESTART_NPU, "chip needs a reset")
    wait_for_resets(node, running=[])
    assert [s.health for s in node.states()] == ["ok", "isolated"]
    assert chips_of(fake_npu.state_file)[0].get("resets") is None  # never reset: nothing made it necessary


def test_records_of_an_a3_superpod_carry_the_super_device_and_pod_ids(fake_npu):
    npus = [{"id": 0, "name": "Ascend910", "chips": [
        {"id": c, "logic_id": c, "health": "OK", "codes": [], "info": [], "sdid": (7 << 22) + (c << 16) + c}
        for c in range(2)]}]
    node = node_devices(fake_npu("A3", npus, super_pod_id=2), [0, 1])
    assert [(r.super_device_id, r.super_pod_id) for r in node.records({})] == [(7 << 22, 2), ((7 << 22) + 65537, 2)]


def test_records_off_a_superpod_have_no_super_ids(fake_npu):
    node = node_devices(fake_npu("A2", npu_state(1)), [0])
    assert [(r.super_device_id, r.super_pod_id) for r in node.records({})] == [(-1, -1)]


def test_probe_reports_levels_actions_and_the_unusable_devices(fake_npu):
    npus = npu_state(3)
    npus[1]["chips"][0].update(health="Alarm", codes=["80E01801"])
    npus[2]["chips"][0].update(health="Critical", codes=["8C03A000"])
    report = probe(fake_npu("A2", npus), TABLE)
    assert [(r.level, r.usable) for r in report.rows] == [
        (None, True), (FaultLevel.RESTART_BUSINESS, True), (FaultLevel.RESTART_NPU, False)]
    assert report.rows[2].action == "stop its ranks, reset the chip, respawn them"
    assert report.problem == "device 2 Critical: code 8C03A000 (RestartNPU)"
    assert report.as_dict()["usable"] is False
    assert [r.rule for r in report.rows] == ["health fallback"] + ["ftrun/detection/fault_levels.yaml"] * 2
    assert report.as_dict()["devices"][1]["rule"] == "ftrun/detection/fault_levels.yaml"


def test_probe_of_an_unreadable_tool_is_a_problem(fake_npu):
    backend = fake_npu("A2", npu_state(1), mode="fail")
    report = probe(backend, TABLE)
    assert report.rows == () and report.problem.startswith("cannot read npu device health: npu-smi")
