"""Ascend npu-smi: parsers on fixtures, the runner on tiny real scripts, NpuBackend on the stand-in npu-smi."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftrun.devices import Device, DeviceOptions, DeviceReading, DeviceToolError, Health, npu_smi
from ftrun.devices.npu import NpuBackend
from ftrun.devices.npu_smi import (
    ChipHealth,
    ChipRow,
    ListedNpu,
    LogicChip,
    NpuSmi,
    ToolUnavailable,
    hccn_device_ip,
    parse_health,
    parse_hccn_ip,
    parse_info_table,
    parse_list,
    parse_mapping,
    parse_npu_health,
    parse_spod_info,
)

TESTS = Path(__file__).resolve().parent.parent
FIXTURES = TESTS / "fixtures" / "npu_smi"
PARSERS = [parse_info_table, parse_health, parse_npu_health, parse_list, parse_mapping, parse_hccn_ip]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# --- parsers -------------------------------------------------------------------------------------------


def test_info_table_a2_reads_eight_npus_and_stops_at_the_process_section():
    rows = parse_info_table(fixture("info_a2.txt"))
    assert [(r.npu, r.chip) for r in rows] == [(n, 0) for n in range(8)]  # the process row "0 0" is not a chip
    assert rows[0] == ChipRow(0, 0, "910B2", Health.OK, "0000:C1:00.0", None)
    assert {r.npu: r.health for r in rows if r.health is not Health.OK} == {3: Health.ALARM, 5: Health.WARNING}
    assert rows[7].bus_id == "0000:82:00.0"


def test_info_table_a3_reads_two_chips_per_npu_with_phy_ids():
    rows = parse_info_table(fixture("info_a3.txt"))
    assert [(r.npu, r.chip, r.phy_id) for r in rows] == [(n, c, 2 * n + c) for n in range(4) for c in range(2)]
    assert {(r.npu, r.chip) for r in rows if r.health is not Health.OK} == {(2, 1)}
    assert rows[5].health is Health.CRITICAL
    assert rows[1] == ChipRow(0, 1, "Ascend910", Health.OK, "0000:9F:00.0", 1)  # "-" power is no obstacle


def test_info_table_tolerates_spacing_case_tabs_and_unknown_lines():
    rows = parse_info_table(fixture("info_spacing.txt"))
    assert [(r.npu, r.chip, r.name, r.health, r.bus_id) for r in rows] == [
        (2, 0, "910B3", Health.ALARM, "0000:41:00.0"),
        (6, 0, "910B3", Health.CRITICAL, "0000:82:00.0"),
        (7, 0, "910B3", Health.OK, "0000:83:00.0"),
    ]


def test_info_table_300i_device_column_is_not_a_phy_id():
    # Atlas 300I/310P boards head the chip row "Chip  Device": that number is not the board's Phy-ID
    rows = parse_info_table(fixture("info_300i_duo.txt"))
    assert [(r.npu, r.chip, r.health, r.phy_id) for r in rows] == [
        (8, 0, Health.OK, None), (8, 1, Health.ALARM, None), (9, 0, Health.OK, None), (9, 1, Health.OK, None)]


def test_info_table_950_reads_the_npu_id_column_and_empty_chip_rows():
    # npu-smi 25.6 on Ascend 950 (one third-party sample): "NPU ID" is a column of its own and the chip row
    # leaves the first two cells empty, one chip per NPU
    rows = parse_info_table(fixture("info_950.txt"))
    assert rows == [ChipRow(0, 0, "Ascend950DT", Health.OK, "NA", has_chip_id=False),
                    ChipRow(1, 0, "Ascend950DT", Health.CRITICAL, "NA", has_chip_id=False),
                    ChipRow(2, 0, "Ascend950DT", Health.OK, "NA", has_chip_id=False)]


@pytest.mark.parametrize("name, expected", [
    ("health_ok.txt", ChipHealth(Health.OK)),
    ("health_alarm_codes.txt",
     ChipHealth(Health.ALARM, ("80E01801", "A4025021", "8C084E00"), "on-chip memory uncorrectable error")),
    ("health_continuation.txt",
     ChipHealth(Health.CRITICAL, ("80E18005", "80CB8002"),
                "aicore exception; node type=process-manager, event state=exit abnormally; hbm multi bit ecc error")),
])
def test_parse_health_one_chip(name, expected):
    assert parse_health(fixture(name)) == expected


def test_parse_npu_health_without_chip_reads_every_chip():
    assert parse_npu_health(fixture("health_npu.txt")) == [
        ChipHealth(Health.OK, (), "", chip=0),
        ChipHealth(Health.WARNING, ("80CB8002",), "retry the request; link flapped once", chip=1),
    ]


def test_parse_npu_health_mcu_block_leaves_the_last_chip_alone():
    # the MCU block (no "Chip ID") comes after the chips: its "Health : OK" must not become chip 1's
    assert parse_npu_health(fixture("health_npu_mcu.txt")) == [
        ChipHealth(Health.OK, (), "", chip=0),
        ChipHealth(Health.ALARM, ("80E01801",), "on-chip memory uncorrectable error", chip=1),
    ]


def test_parse_health_refuses_output_for_two_chips():
    with pytest.raises(DeviceToolError, match="2 health statuses"):
        parse_health(fixture("health_npu.txt"))


@pytest.mark.parametrize("name, expected", [
    ("list_new.txt", [ListedNpu(0, 2), ListedNpu(1, 2), ListedNpu(2, 2)]),
    # old boards: Card Count, Product Name, Serial Number; no Chip Count means one chip
    ("list_old.txt", [ListedNpu(1, 1, "IT21PDDA01"), ListedNpu(2, 4, "IT21PDDA01")]),
])
def test_parse_list(name, expected):
    assert parse_list(fixture(name)) == expected


def test_parse_list_of_a_node_without_npus_is_empty():
    assert parse_list("        Total Count                    : 0\n") == []


@pytest.mark.parametrize("name, expected", [
    ("mapping_a2.txt", {(n, 0): LogicChip(n, "Ascend 910B2") for n in range(4)}),
    ("mapping_a3_mcu.txt", {(4, 0): LogicChip(0, "Ascend910"), (4, 1): LogicChip(1, "Ascend910"),
                            (6, 0): LogicChip(2, "Ascend910"), (6, 1): LogicChip(3, "Ascend910")}),
    # newer A3 releases add a "Chip Phy-ID" column before the name
    ("mapping_a3_phy_id.txt", {(0, 0): LogicChip(0, "Ascend910"), (0, 1): LogicChip(1, "Ascend910"),
                               (1, 0): LogicChip(2, "Ascend910"), (1, 1): LogicChip(3, "Ascend910")}),
])
def test_parse_mapping_skips_mcu_rows(name, expected):
    assert parse_mapping(fixture(name)) == expected


def test_parse_spod_info_reads_the_super_device_and_pod_ids():
    assert parse_spod_info(fixture("spod_info_a3.txt")) == (29425665, 2)


def test_parse_spod_info_of_a_board_outside_a_superpod_is_an_error():
    with pytest.raises(DeviceToolError, match="printed no SDID"):
        parse_spod_info("This device does not support querying spod-info.\n")


def test_parse_hccn_ip():
    assert parse_hccn_ip(fixture("hccn_ip.txt")) == "192.168.100.11"
    with pytest.raises(DeviceToolError, match="invalid address"):
        parse_hccn_ip("ipaddr:300.1.1.1\n")


@pytest.mark.parametrize("parser, name, message", [
    (parse_info_table, "empty.txt", "npu-smi info printed nothing"),
    (parse_info_table, "blank.txt", "npu-smi info printed nothing"),
    (parse_info_table, "garbage.txt", "npu-smi info printed no NPU rows"),
    (parse_info_table, "invalid_card.txt", "npu-smi info refused: Invalid card id."),
    (parse_health, "empty.txt", "npu-smi info -t health printed nothing"),
    (parse_health, "garbage.txt", "npu-smi info -t health printed no health status"),
    (parse_health, "invalid_card.txt", "npu-smi info -t health refused: Invalid card id."),
    (parse_health, "invalid_parameter.txt", "npu-smi info -t health refused: Error parameter of -i"),
    (parse_npu_health, "health_ok.txt", "npu-smi info -t health printed no chip health"),
    (parse_npu_health, "invalid_parameter.txt", "refused: Error parameter of -i"),
    (parse_list, "empty.txt", "npu-smi info -l printed nothing"),
    (parse_list, "garbage.txt", "npu-smi info -l printed no NPU ids"),
    (parse_list, "invalid_card.txt", "npu-smi info -l refused"),
    (parse_mapping, "garbage.txt", "npu-smi info -m printed no compute chips"),
    (parse_mapping, "mapping_mcu_only.txt", "printed no compute chips (only Mcu rows)"),
    (parse_mapping, "empty.txt", "npu-smi info -m printed nothing"),
    (parse_hccn_ip, "garbage.txt", "hccn_tool -ip -g printed no ipaddr"),
    (parse_hccn_ip, "empty.txt", "hccn_tool -ip -g printed nothing"),
])
def test_unusable_output_is_one_line_device_tool_error(parser, name, message):
    with pytest.raises(DeviceToolError) as caught:
        parser(fixture(name))
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("parser, text", [
    (parse_info_table, "| ² 910B2 | OK | 1 |\n| ³ | 0000:C1:00.0 | 0 |\n"),
    (parse_info_table, f"| {'9' * 5000} 910B2 | OK | 1 |\n| 0 | 0000:C1:00.0 | 0 |\n"),
    (parse_mapping, "² ³ ⁴ Ascend910\n"),
    (parse_list, f"NPU ID : {'1' * 5000}\n"),
])
def test_digits_int_refuses_are_not_ids(parser, text):
    with pytest.raises(DeviceToolError):
        parser(text)


# a few real labels and separators among the noise, so the generator reaches past the first checks
_NEAR_MISS = st.lists(st.one_of(
    st.text(max_size=40),
    st.sampled_from(["| 0 910B2 | Alarm | 1 |", "| 0 1 | 0000:C1:00.0 | 0 |", "| 1 | OK |", "+===+",
                     "Health Status : Alarm", "Error Code : 80E01801 zz", "   : more", "Chip ID : 1",
                     "Chip ID : x", "NPU ID : 3", "Chip Count : -1", "Total Count : 0", "0 1 - Mcu",
                     "0 0 0 Ascend", "ipaddr:1.2.3.4", "ipaddr:", "Process id", "Health : "]),
), max_size=12).map("\n".join)


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.__name__)
@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(), _NEAR_MISS))
def test_parsers_raise_nothing_but_device_tool_error(parser, text):
    try:
        parser(text)
    except DeviceToolError as exc:
        assert "\n" not in str(exc)


# --- the runner ----------------------------------------------------------------------------------------


def script(tmp_path: Path, body: str, name: str = "tool", mode: int = 0o755) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(mode)
    return path


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_runner_returns_output_of_both_streams(tmp_path):
    tool = script(tmp_path, 'echo "out $1 $2"; echo err >&2')
    # the tool's deadline is not what this tests: generous, as a loaded machine once took 5 s to run it
    assert NpuSmi(str(tool), 60).run("info", "-l").split() == ["out", "info", "-l", "err"]


def test_runner_tool_missing_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolUnavailable, match="^npu-smi not found on PATH$"):
        NpuSmi("npu-smi", 5).run("info")


def test_runner_tool_not_executable(tmp_path, monkeypatch):
    script(tmp_path, "echo hi", name="npu-smi", mode=0o644)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolUnavailable, match="npu-smi is not executable"):
        NpuSmi("npu-smi", 5).run("info")


def test_runner_non_zero_exit_names_command_and_first_line(tmp_path):
    tool = script(tmp_path, 'echo; echo "Invalid card id."; echo "Usage: npu-smi info"; exit 2', name="npu-smi")
    with pytest.raises(DeviceToolError) as caught:
        NpuSmi(str(tool), 5).run("info", "-t", "health", "-i", "9")
    assert str(caught.value) == "npu-smi info -t health -i 9 failed with exit code 2: Invalid card id."
    assert not isinstance(caught.value, ToolUnavailable)


def test_runner_kills_a_hung_tool_and_its_children_at_the_deadline(tmp_path):
    pids = tmp_path / "pids"
    tool = script(tmp_path, f'sleep 60 & echo $$ $! > {pids}; wait', name="npu-smi")
    with pytest.raises(ToolUnavailable, match="^npu-smi info did not answer within 0.5s$"):
        NpuSmi(str(tool), 0.5).run("info")
    # both were killed: left alone, the shell waits on its 60 s sleep
    shell, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 2
    while not (gone(shell) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.02)  # the orphaned sleep is reaped by init, not by us
    assert gone(shell) and gone(child)


def test_runner_replaces_bytes_that_are_not_utf8(tmp_path):
    tool = script(tmp_path, r"printf 'NPU \377\376 ok\n'")
    assert NpuSmi(str(tool), 5).run() == "NPU \ufffd\ufffd ok\n"


def test_hccn_device_ip_is_empty_without_hccn_tool(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(npu_smi, "DRIVER_HCCN_TOOL", str(tmp_path / "driver" / "tools" / "hccn_tool"))
    assert hccn_device_ip(0) == ""


def test_hccn_device_ip_finds_hccn_tool_where_the_driver_installs_it(tmp_path, monkeypatch):
    # the Ascend docs run /usr/local/Ascend/driver/tools/hccn_tool, which is usually not on PATH
    tools = tmp_path / "driver" / "tools"
    tools.mkdir(parents=True)
    script(tools, 'echo "ipaddr:192.168.10$2.11"', name="hccn_tool")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(npu_smi, "DRIVER_HCCN_TOOL", str(tools / "hccn_tool"))
    assert hccn_device_ip(3) == "192.168.103.11"


def test_hccn_device_ip_asks_for_the_device(tmp_path, monkeypatch):
    script(tmp_path, 'echo "ipaddr:192.168.10$2.11"; echo "netmask:255.255.255.0"', name="hccn_tool")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hccn_device_ip(3) == "192.168.103.11"


# --- NpuBackend on the stand-in npu-smi ----------------------------------------------------------------

ALARM_INFO = ["on-chip memory uncorrectable error", "node type=process-manager, event state=exit abnormally"]


def chip(id, logic_id, health="OK", codes=(), info=(), **extra):
    return {"id": id, "logic_id": logic_id, "health": health, "codes": list(codes), "info": list(info), **extra}


def set_mode(state_file: Path, mode: str) -> None:
    state_file.write_text(json.dumps(dict(json.loads(state_file.read_text()), mode=mode)))


def test_backend_a2_discover_and_poll_with_an_alarm_chip(fake_npu):
    npus = [{"id": n, "name": "910B2", "chips": [chip(0, n)]} for n in range(4)]
    npus[2]["chips"] = [chip(0, 2, "Alarm", ["80E01801", "A4025021"], ALARM_INFO)]
    backend = fake_npu("A2", npus)
    assert backend.kind == "npu" and backend.visibility_var == "ASCEND_RT_VISIBLE_DEVICES"
    devices = backend.discover()
    assert devices == [Device(n, "910B2", f"npu {n} chip 0") for n in range(4)]
    statuses = backend.poll()
    assert [(s.device.index, s.health) for s in statuses] == [
        (0, Health.OK), (1, Health.OK), (2, Health.ALARM), (3, Health.OK)]
    assert statuses[2] == DeviceReading(devices[2], Health.ALARM, ("80E01801", "A4025021"),
                                       "on-chip memory uncorrectable error; "
                                       "node type=process-manager, event state=exit abnormally")
    assert statuses[0].codes == () and statuses[0].info == ""


def test_backend_a3_counts_chips_by_logic_id(fake_npu):
    # logic ids deliberately out of NPU order, as inside a container that sees some chips only
    npus = [{"id": 0, "name": "Ascend910", "chips": [chip(0, 2, phy_id=0), chip(1, 3, phy_id=1)]},
            {"id": 1, "name": "Ascend910", "chips": [chip(0, 0, phy_id=2),
                                                     chip(1, 1, "Critical", ["8C03A000"], ["reset the chip"],
                                                          phy_id=3)]}]
    backend = fake_npu("A3", npus)
    devices = backend.discover()
    assert [(d.index, d.physical) for d in devices] == [
        (0, "npu 1 chip 0"), (1, "npu 1 chip 1"), (2, "npu 0 chip 0"), (3, "npu 0 chip 1")]
    statuses = backend.poll()
    assert [(s.device.index, s.health, s.codes, s.info) for s in statuses] == [
        (0, Health.OK, (), ""), (1, Health.CRITICAL, ("8C03A000",), "reset the chip"),
        (2, Health.OK, (), ""), (3, Health.OK, (), "")]
    assert [backend.physical_id(i) for i in range(4)] == [2, 3, 0, 1]
    assert backend.device_ip(0) == ""  # no hccn_tool here


def test_backend_950_reads_the_table_and_asks_health_without_a_chip(fake_npu):
    # npu-smi 25.6 on Ascend 950: "NPU ID" column, blank chip rows, and no -c for info -t health
    npus = [{"id": n, "name": "Ascend950DT", "chips": [chip(0, n)]} for n in range(2)]
    npus[1]["chips"] = [chip(0, 1, "Critical", ["8C03A000"], ["reset the chip"])]
    backend = fake_npu("950", npus)
    backend.discover()
    assert [(s.device.index, s.health, s.codes, s.info) for s in backend.poll()] == [
        (0, Health.OK, (), ""), (1, Health.CRITICAL, ("8C03A000",), "reset the chip")]


def test_backend_poll_marks_a_chip_missing_from_the_table_unknown(fake_npu):
    npus = [{"id": n, "name": "910B2", "chips": [chip(0, n)]} for n in range(2)]
    backend = fake_npu("A2", npus)
    backend.discover()
    fake_npu("A2", npus[:1])
    assert [(s.device.index, s.health) for s in backend.poll()] == [(0, Health.OK), (1, Health.UNKNOWN)]


def test_backend_discover_falls_back_to_info_l_without_info_m(fake_npu):
    npus = [{"id": n, "name": "Ascend910", "chips": [chip(0, 2 * n), chip(1, 2 * n + 1)]} for n in range(2)]
    backend = fake_npu("A3", npus, mapping=False)
    assert [(d.index, d.physical) for d in backend.discover()] == [
        (0, "npu 0 chip 0"), (1, "npu 0 chip 1"), (2, "npu 1 chip 0"), (3, "npu 1 chip 1")]


@pytest.mark.parametrize("mode, message", [
    # -m fails, so does the -l fallback: its error is the one reported
    ("fail", "npu-smi info -l failed with exit code 1: dcmi module initialize failed. ret is -8005"),
    ("garbage", "npu-smi info -l printed no NPU ids"),  # -m junk, then -l junk
    ("hang", "npu-smi info -m did not answer within 0.5s"),  # no second wait on -l: its error would name -l
])
def test_backend_discover_on_a_broken_tool_raises_one_line(fake_npu, mode, message):
    backend = fake_npu("A2", [{"id": 0, "name": "910B2", "chips": [chip(0, 0)]}], timeout=0.5)
    set_mode(fake_npu.state_file, mode)
    with pytest.raises(DeviceToolError) as caught:
        backend.discover()
    assert str(caught.value) == message


def test_backend_poll_on_a_failing_tool_raises(fake_npu):
    backend = fake_npu("A2", [{"id": 0, "name": "910B2", "chips": [chip(0, 0)]}])
    backend.discover()
    set_mode(fake_npu.state_file, "fail")
    with pytest.raises(DeviceToolError, match="^npu-smi info failed with exit code 1"):
        backend.poll()


def test_backend_without_npu_smi_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DeviceToolError, match="^npu-smi not found on PATH$"):
        NpuBackend(DeviceOptions()).discover()


def test_stand_in_refuses_an_unknown_chip(fake_npu):
    fake_npu("A2", [{"id": 0, "name": "910B2", "chips": [chip(0, 0)]}])
    with pytest.raises(DeviceToolError, match="exit code 2: Invalid chip id."):
        NpuSmi("npu-smi", 5).run("info", "-t", "health", "-i", "0", "-c", "1")
