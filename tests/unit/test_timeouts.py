"""The timeout chain: every bound of a fault listed from a launch's configuration, and each contradiction said
in one line with what to change (``ftrun timeouts``, and at a launch's start)."""

from __future__ import annotations

import pytest

from ftrun.cli import main
from ftrun.config import LaunchConfig
from ftrun.timeouts import contradictions, table, timeout_chain


def test_the_default_chain_contradicts_nothing_and_lists_the_collectives_of_the_device():
    bounds = timeout_chain(LaunchConfig(), {})
    names = [b.name for b in bounds]
    assert names[:3] == ["data link seen dark", "--online-window", "stall bound (at least)"]
    assert "gloo (torch's default)" in names and "HCCL_EXEC_TIMEOUT" not in names
    assert contradictions(bounds) == []
    assert len(table(bounds)) == len(bounds)


def test_each_contradiction_is_one_line_with_what_to_change():
    config = LaunchConfig(online_window=90.0, node_timeout=70.0, stop_timeout=80.0, repair_timeout=60.0)
    found = contradictions(timeout_chain(config, {}))
    assert [line.split(" ", 1)[0] for line in found] == ["--online-window", "--node-timeout", "--stop-timeout"]
    assert "raise --repair-timeout above 70" in found[1] and "\n" not in "".join(found)


def test_hccl_timeouts_from_the_environment_are_checked_against_the_stall_bound_and_a_measured_save():
    bounds = timeout_chain(LaunchConfig(device="npu"), {"HCCL_EXEC_TIMEOUT": "5", "HCCL_CONNECT_TIMEOUT": "x"})
    connect = next(b for b in bounds if b.name == "HCCL_CONNECT_TIMEOUT")
    assert connect.seconds == 120.0 and "no number" in connect.source
    [line] = contradictions(bounds)
    assert line.startswith("HCCL_EXEC_TIMEOUT 5s is not longer than the stall bound 10s") and "raise it above 10s" in line
    # the job's own figures: a step of 100 s makes the stall bound 400 s, past ftrun.elastic's 300 s
    measured = contradictions(timeout_chain(LaunchConfig(), {}), step_time=100.0, save_time=400.0)
    assert any("collective_timeout (ftrun.elastic.init) 300s is not longer than the stall bound 400s" in m
               for m in measured)
    assert any("shorter than a checkpoint save (400s measured)" in m for m in measured)


def run_cli(capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    out, err = capsys.readouterr()
    return ended.value.code, out + err


def test_ftrun_timeouts_prints_the_chain_and_exits_1_on_a_contradiction(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    code, text = run_cli(capsys, "timeouts", "--standalone", "--online-window", "90", str(script))
    assert code == 1, text
    assert "--repair-timeout" in text and "timeouts contradict: --online-window 90 is not shorter" in text
    assert run_cli(capsys, "timeouts", "--standalone", str(script))[0] == 0
    code, text = run_cli(capsys, "timeouts", "--standalone", "--online-window", "-1", str(script))
    assert code == 2 and "--online-window" in text and "Traceback" not in text


def test_ftrun_timeouts_checks_the_chain_against_a_jobs_step_and_save_times(capsys, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    code, text = run_cli(capsys, "timeouts", "--save-time", "400", "--standalone", str(script))
    assert code == 1, text
    assert ("timeouts contradict: collective_timeout (ftrun.elastic.init) 300s is shorter than a checkpoint save "
            "(400s measured)") in text and "raise it above 400s" in text
    code, text = run_cli(capsys, "timeouts", "--step_time", "100", "--save_time", "30", "--standalone", str(script))
    assert code == 1 and "300s is not longer than the stall bound 400s" in text and "checkpoint save" not in text
    assert run_cli(capsys, "timeouts", "--save-time", "30", "--standalone", str(script))[0] == 0
    for bad in ("-5", "0", "soon"):
        code, text = run_cli(capsys, "timeouts", "--save-time", bad, "--standalone", str(script))
        assert code == 2 and "--save-time" in text and "Traceback" not in text, text
