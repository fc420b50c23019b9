"""The fault table: its packaged entries, how statuses and messages are classified, site overrides, escalation."""

from __future__ import annotations

import pytest

from ftrun.detection.table import Escalation, EscalationRule, FaultLevel, Verdict, cuda_code, load_fault_table, most_severe
from ftrun.devices import Device, DeviceReading, Health
from ftrun.errors import UsageError

L = FaultLevel
TABLE = load_fault_table()
HOUR = 3600.0


def status(health=Health.OK, *codes):
    return DeviceReading(Device(0, "910B2", "npu 0 chip 0"), health, tuple(codes))


# -- levels ---------------------------------------------------------------------------------------


def test_levels_run_from_least_to_most_severe():
    assert [level.value for level in sorted(L, key=lambda level: level.severity)] == [
        "NotHandleFault", "SubHealthFault", "PreSeparateNPU", "RestartRequest", "RestartBusiness",
        "FreeRestartNPU", "RestartNPU", "SeparateNPU"]


@pytest.mark.parametrize("name, level", [
    ("RestartNPU", L.RESTART_NPU), ("restartnpu", L.RESTART_NPU), ("  SEPARATENPU ", L.SEPARATE),
    ("NotHandleFault", L.NOT_HANDLE), ("NotHandle", L.NOT_HANDLE), ("subhealthfault", L.SUB_HEALTH),
    ("PreSeparateNPU", L.PRE_SEPARATE), ("free_restart", L.FREE_RESTART),
    ("L1", L.NOT_HANDLE), ("l2", L.RESTART_REQUEST), ("L3", L.RESTART_BUSINESS), ("L4", L.FREE_RESTART),
    ("L5", L.RESTART_NPU), ("L6", L.SEPARATE),
])
def test_parse_level_names(name, level):
    assert L.parse(name) is level


def test_parse_unknown_level_lists_the_names():
    with pytest.raises(ValueError, match="unknown fault level 'L7' \\(choose one of NotHandleFault, SubHealthFault"):
        L.parse("L7")


def test_most_severe():
    assert most_severe([L.RESTART_REQUEST, L.SEPARATE, L.NOT_HANDLE]) is L.SEPARATE
    assert most_severe([]) is None


@pytest.mark.parametrize("code, spelled", [(79, "xid-79"), ("XID 79", "xid-79"), ("xid_48", "xid-48"),
                                           ("gpu-lost", "gpu-lost")])
def test_cuda_code_spellings(code, spelled):
    assert cuda_code(code) == spelled


# -- the packaged table -----------------------------------------------------------------------------

PACKAGED_CODES = {
    "80CB8002": L.RESTART_REQUEST, "80E01801": L.RESTART_BUSINESS, "8C084E00": L.FREE_RESTART,
    "8C03A000": L.RESTART_NPU, "80E18005": L.RESTART_NPU, "A4025021": L.NOT_HANDLE,
}
PACKAGED_CUDA = {
    "gpu-lost": L.SEPARATE, "ecc-uncorrected": L.RESTART_NPU, "retired-pages-pending": L.FREE_RESTART,
    "row-remap-failure": L.SEPARATE, "xid-13": L.NOT_HANDLE, "xid-31": L.NOT_HANDLE, "xid-43": L.NOT_HANDLE,
    "xid-48": L.RESTART_NPU, "xid-63": L.FREE_RESTART, "xid-64": L.SEPARATE, "xid-74": L.RESTART_NPU,
    "xid-79": L.SEPARATE, "xid-92": L.FREE_RESTART, "xid-94": L.RESTART_BUSINESS, "xid-95": L.RESTART_NPU,
}


def test_packaged_table_is_exactly_the_documented_one():
    assert dict(TABLE.codes["npu"]) == PACKAGED_CODES
    assert dict(TABLE.codes["cuda"]) == PACKAGED_CUDA
    assert dict(TABLE.health) == {Health.OK: None, Health.WARNING: L.NOT_HANDLE, Health.ALARM: L.RESTART_NPU,
                                  Health.CRITICAL: L.RESTART_NPU, Health.UNKNOWN: L.SEPARATE}
    assert TABLE.escalation == EscalationRule(24.0, 2, frozenset({L.RESTART_NPU, L.RESTART_BUSINESS}))
    assert TABLE.files == ("ftrun/detection/fault_levels.yaml",)


MINDCLUSTER = "MindCluster faultCode.json v26.1.0"


def test_vendor_list_is_mindclusters_default_fault_codes_with_source_and_version():
    [vendor] = TABLE.vendor_lists
    assert (vendor.source, vendor.name) == ("npu", MINDCLUSTER)
    assert len(vendor.codes) == 797  # 802 listed; 9-digit entries left out, A2301001 listed twice
    assert vendor.codes["A2301001"] is L.SEPARATE  # listed under RestartBusiness and SeparateNPU: the worse wins
    assert all(code not in vendor.codes for code in ("200001002", "020001002"))


@pytest.mark.parametrize("code, level", [
    ("80C98008", L.RESTART_REQUEST),  # AICore error
    ("80CB8009", L.RESTART_REQUEST),
    ("81078603", L.NOT_HANDLE),  # link down
    ("8C204E00", L.RESTART_BUSINESS),
])
def test_code_ftrun_does_not_list_takes_mindclusters_level_not_the_alarm(code, level):
    # ASCEND.md mismatch 6: such an Alarm isolated the chip through the health fallback
    assert TABLE.classify_device(status(Health.ALARM, code)) == Verdict(level, f"code {code}", MINDCLUSTER)


def test_ftrun_and_site_rows_take_precedence_over_the_vendor_list(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text('codes:\n  "80C98008": SeparateNPU\n')
    site = load_fault_table(str(path))
    assert site.classify_device(status(Health.ALARM, "80C98008")) == Verdict(L.SEPARATE, "code 80C98008", str(path))
    assert TABLE.classify_device(status(Health.ALARM, "80E01801")).rule == "ftrun/detection/fault_levels.yaml"


@pytest.mark.parametrize("health", [Health.ALARM, Health.CRITICAL])
def test_code_in_no_table_resets_the_chip_before_isolating_it(health):
    verdict = TABLE.classify_device(status(health, "12345678"))
    assert verdict.level is L.RESTART_NPU and verdict.rule == "health fallback"


@pytest.mark.parametrize("code, level", sorted({**PACKAGED_CODES, **PACKAGED_CUDA}.items()))
def test_every_packaged_code_decides_an_alarmed_device(code, level):
    # the code, not the Alarm (RestartNPU), decides
    assert TABLE.classify_device(status(Health.ALARM, code)) == Verdict(
        level, f"code {code}", "ftrun/detection/fault_levels.yaml")


def test_codes_are_matched_in_any_case():
    assert TABLE.classify_device(status(Health.ALARM, "80e01801")).level is L.RESTART_BUSINESS
    assert TABLE.classify_device(status(Health.CRITICAL, "XID-79")).level is L.SEPARATE


@pytest.mark.parametrize("health, level", [
    (Health.OK, None), (Health.WARNING, L.NOT_HANDLE), (Health.ALARM, L.RESTART_NPU),
    (Health.CRITICAL, L.RESTART_NPU), (Health.UNKNOWN, L.SEPARATE),
])
def test_health_decides_a_device_without_codes(health, level):
    assert TABLE.classify_device(status(health)) == Verdict(level, f"health {health.value}", "health fallback")


@pytest.mark.parametrize("health, level", [
    (Health.WARNING, L.NOT_HANDLE), (Health.ALARM, L.RESTART_NPU), (Health.OK, L.NOT_HANDLE),
])
def test_unknown_code_falls_back_to_health(health, level):
    verdict = TABLE.classify_device(status(health, "12345678"))
    assert verdict == Verdict(level, f"code 12345678 (in no fault table; health {health.value})", "health fallback")


def test_most_severe_code_wins():
    verdict = TABLE.classify_device(status(Health.ALARM, "A4025021", "8C03A000", "80E01801"))
    assert verdict == Verdict(L.RESTART_NPU, "code 8C03A000", "ftrun/detection/fault_levels.yaml")


def test_unknown_code_beside_known_ones_counts_by_health():
    verdict = TABLE.classify_device(status(Health.ALARM, "80E01801", "12345678"))
    assert verdict.level is L.RESTART_NPU and verdict.reason.startswith("code 12345678")


def test_reference_example_uce_with_a_notice_is_restart_business():
    assert TABLE.classify_device(status(Health.ALARM, "80E01801", "A4025021")).level is L.RESTART_BUSINESS


PACKAGED_ERRORS = [
    ("UCE ERROR", L.RESTART_BUSINESS), ("HBM MULTI BIT ECC ERROR", L.RESTART_NPU), ("FORCE STOP", L.RESTART_REQUEST),
    ("SUSPECT MEM ERROR", L.RESTART_BUSINESS), ("HCCS LINK ERROR", L.RESTART_REQUEST),
    ("UB LINK ERROR", L.RESTART_REQUEST), ("HCCL OP RETRY FAILED", L.RESTART_REQUEST),
    ("SUSPECT REMOTE ERROR", L.RESTART_REQUEST),
    ("507053", L.RESTART_BUSINESS), ("507054", L.RESTART_NPU), ("507055", L.RESTART_BUSINESS),
    ("507056", L.RESTART_REQUEST), ("507057", L.RESTART_REQUEST), ("507904", L.RESTART_REQUEST),
    ("uncorrectable ECC error encountered", L.RESTART_NPU),
    ("CUDA error: an illegal memory access", L.RESTART_REQUEST),
    ("ncclSystemError", L.RESTART_REQUEST), ("ncclRemoteError", L.RESTART_REQUEST), ("NCCL WARN", L.NOT_HANDLE),
]


def test_packaged_errors_are_exactly_the_documented_ones():
    assert sorted(TABLE.errors) == sorted(PACKAGED_ERRORS)


@pytest.mark.parametrize("text, level", PACKAGED_ERRORS)
def test_classify_text_finds_each_message(text, level):
    lines = ["step 41 loss 2.3", f"[E] runtime says: {text} (device 3)", "exiting"]
    assert TABLE.classify_text(lines) == Verdict(level, text)


@pytest.mark.parametrize("line, expected", [
    ("RuntimeError: npu synchronize failed, error code is 507053", Verdict(L.RESTART_BUSINESS, "507053")),
    ("ACL error 507054.", Verdict(L.RESTART_NPU, "507054")),
    ("rt error: uce error happened on device 2", Verdict(L.RESTART_BUSINESS, "UCE ERROR")),
    ("CUDA error: uncorrectable ecc error encountered", Verdict(L.RESTART_NPU, "uncorrectable ECC error encountered")),
    ("NCCL error: remote process exited (ncclremoteerror)", Verdict(L.RESTART_REQUEST, "ncclRemoteError")),
    ("step 15070531 done", None),  # a code inside a longer number is not the code
    ("all good", None),
])
def test_classify_text_case_and_codes(line, expected):
    assert TABLE.classify_text([line]) == expected


def test_classify_text_most_severe_wins_and_first_of_equals():
    lines = ["NCCL WARN something", "HCCS LINK ERROR", "UCE ERROR", "HBM MULTI BIT ECC ERROR", "507054"]
    assert TABLE.classify_text(lines) == Verdict(L.RESTART_NPU, "HBM MULTI BIT ECC ERROR")
    assert TABLE.classify_text([]) is None


# -- site overrides ---------------------------------------------------------------------------------


def write(tmp_path, text: str, name="site.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_override_adds_a_code_and_changes_levels(tmp_path):
    path = write(tmp_path, """
codes:
  "80C98000": RestartNPU
  A4025021: L6
  00000001: restartrequest
health:
  warning: SubHealthFault
cuda:
  79: RestartNPU
  xid 31: RestartRequest
errors:
  "my site's error": PreSeparateNPU
  UCE ERROR: L5
escalation:
  window_hours: 12
""")
    table = load_fault_table(path)
    assert table.codes["npu"]["80C98000"] is L.RESTART_NPU
    assert table.codes["npu"]["A4025021"] is L.SEPARATE
    assert table.codes["npu"]["00000001"] is L.RESTART_REQUEST
    assert table.codes["npu"]["80E01801"] is L.RESTART_BUSINESS  # untouched entries stay
    assert table.health[Health.WARNING] is L.SUB_HEALTH and table.health[Health.ALARM] is L.RESTART_NPU
    assert table.codes["cuda"]["xid-79"] is L.RESTART_NPU and table.codes["cuda"]["xid-31"] is L.RESTART_REQUEST
    assert dict(table.errors)["UCE ERROR"] is L.RESTART_NPU
    assert table.classify_text(["oh no: MY SITE'S ERROR"]) == Verdict(L.PRE_SEPARATE, "my site's error")
    assert table.escalation == EscalationRule(12.0, 2, frozenset({L.RESTART_NPU, L.RESTART_BUSINESS}))
    assert table.files == ("ftrun/detection/fault_levels.yaml", path)
    assert TABLE.codes["npu"]["A4025021"] is L.NOT_HANDLE  # the packaged table is not changed by it


def test_override_changes_escalation_levels_and_repairs(tmp_path):
    table = load_fault_table(write(tmp_path, "escalation:\n  repairs: 3\n  levels: [L4]\n"))
    assert table.escalation == EscalationRule(24.0, 3, frozenset({L.FREE_RESTART}))


def test_empty_override_changes_nothing(tmp_path):
    table = load_fault_table(write(tmp_path, "# nothing yet\n"))
    assert (dict(table.codes), table.errors, table.escalation) == (dict(TABLE.codes), TABLE.errors, TABLE.escalation)


@pytest.mark.parametrize("text, problem", [
    ("codes: [80E01801]\n", "'codes' must be a mapping, not a list"),
    ("codes:\n  '80E01801': RestartEverything\n", "codes.80E01801: unknown fault level 'RestartEverything'"),
    ("codes:\n  '80E0180': RestartNPU\n", "code '80E0180' is not 8 hex digits"),
    ("codes:\n  '80E01801': [RestartNPU]\n", "codes.80E01801 must be a level name, not a list"),
    ("code:\n  '80E01801': RestartNPU\n", "unknown key 'code' in fault table .*site.yaml \\(did you mean 'codes'\\?\\)"),
    ("health:\n  Fine: none\n", "unknown health 'Fine'"),
    ("health:\n  Alarm: Isolate\n", "health.Alarm: unknown fault level 'Isolate'"),
    ("cuda:\n  xid-79: \n", "cuda.xid-79 must be a level name, not empty"),
    ("errors:\n  'UCE ERROR': 5\n", "errors.'UCE ERROR': unknown fault level '5'"),
    ("escalation:\n  window_hours: soon\n", "escalation.window_hours must be a positive number of hours, not 'soon'"),
    ("escalation:\n  window_hours: -1\n", "escalation.window_hours must be a positive number"),
    ("escalation:\n  repairs: 0\n", "escalation.repairs must be a whole number of at least 1, not '0'"),
    ("escalation:\n  levels: RestartNPU\n", "escalation.levels must be a list of level names"),
    ("escalation:\n  levels: [Reboot]\n", "escalation.levels: unknown fault level 'Reboot'"),
    ("escalation:\n  window: 3\n", "unknown key 'window' in fault table .*site.yaml \\(escalation\\)"),
    ("- codes\n", "must be a mapping with keys codes, health, cuda, errors, escalation"),
    ("codes: {80E01801: [\n", "is not valid YAML at line 2"),
])
def test_bad_override_is_a_usage_error_naming_the_file(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(UsageError, match=problem) as caught:
        load_fault_table(path)
    assert path in caught.value.message and "\n" not in caught.value.message


def test_unreadable_override_is_a_usage_error(tmp_path):
    missing = str(tmp_path / "absent.yaml")
    with pytest.raises(UsageError, match=f"cannot read fault table {missing}: No such file or directory"):
        load_fault_table(missing)


def test_binary_override_is_a_usage_error(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_bytes(b"\xff\xfe\x00codes")
    with pytest.raises(UsageError, match=f"fault table {path} is not UTF-8 text"):
        load_fault_table(str(path))


# -- escalation -------------------------------------------------------------------------------------


def escalation(**rule):
    return Escalation(EscalationRule(**rule))


def test_second_repair_within_the_window_isolates_the_device():
    e = Escalation.from_table(TABLE)
    assert e.record(3, L.RESTART_NPU, now=0.0) is L.RESTART_NPU
    assert e.record(3, L.RESTART_BUSINESS, now=23 * HOUR) is L.SEPARATE


def test_repairs_further_apart_than_the_window_do_not_escalate():
    e = escalation()
    assert e.record(3, L.RESTART_NPU, now=0.0) is L.RESTART_NPU
    assert e.record(3, L.RESTART_NPU, now=24 * HOUR + 1) is L.RESTART_NPU
    assert e.record(3, L.RESTART_NPU, now=30 * HOUR) is L.SEPARATE  # the second one is still in the window


def test_repairs_on_different_devices_are_counted_apart():
    e = escalation()
    assert e.record(0, L.RESTART_NPU, now=0.0) is L.RESTART_NPU
    assert e.record(1, L.RESTART_NPU, now=1.0) is L.RESTART_NPU


@pytest.mark.parametrize("level", [L.NOT_HANDLE, L.RESTART_REQUEST, L.FREE_RESTART, L.PRE_SEPARATE])
def test_levels_that_do_not_count_pass_through(level):
    e = escalation()
    assert [e.record(0, level, now=float(t)) for t in range(3)] == [level] * 3
    assert e.record(0, L.RESTART_NPU, now=4.0) is L.RESTART_NPU  # nothing was counted before it


def test_escalation_follows_the_rule():
    e = escalation(window_hours=1.0, repairs=3, levels=frozenset({L.FREE_RESTART}))
    assert [e.record(0, L.FREE_RESTART, now=t * 60.0) for t in (0, 10, 20)] == [L.FREE_RESTART, L.FREE_RESTART,
                                                                                  L.SEPARATE]
    assert e.record(1, L.RESTART_NPU, now=0.0) is L.RESTART_NPU
