"""Store messages: JSON round trips, key layout, the summary text."""

from __future__ import annotations

from ftrun.errors import ExitCode
from ftrun.messages import (
    Command,
    CommandKind,
    NodeSlot,
    Report,
    ReportKind,
    RendezvousResult,
    WorkerFailure,
    from_json,
    signal_name,
    to_json,
)
from ftrun.summary import job_summary

FAILURE = WorkerFailure(rank=3, local_rank=1, node_rank=1, host="n1", pid=42, exit_code=None, signal="SIGKILL",
                        stderr_tail=("loading", "Killed"), error="", timestamp=1.0, generation=0)


def test_messages_round_trip_through_json():
    for message in (
        RendezvousResult(nodes=(NodeSlot(0, "a", "h", 2, 0), NodeSlot(1, "b", "h2", 2, 2)), world_size=4),
        Report(ReportKind.WORKER_FAILED, 1, 0, failures=(FAILURE,)),
        Command(CommandKind.START, 2, restart_count=2, worker_store="h:1234"),
    ):
        assert from_json(type(message), to_json(message)) == message


def test_unknown_fields_from_a_newer_sender_are_ignored():
    text = to_json(Command(CommandKind.STOP, 1))[:-1] + ', "future_field": 1}'
    assert from_json(Command, text) == Command(CommandKind.STOP, 1)


def test_signal_names():
    assert signal_name(-9) == "SIGKILL" and signal_name(-11) == "SIGSEGV" and signal_name(1) == ""


def test_failure_summary_names_the_root_cause_first():
    second = WorkerFailure(rank=0, local_rank=0, node_rank=0, host="n0", pid=7, exit_code=1, generation=0)
    lines = job_summary(ExitCode.JOB_FAILED, "budget spent", (FAILURE, second), 1, 1, 12.0)
    text = "\n".join(lines)
    assert lines[0].startswith("job failed after 12.0s (exit code 1); 1 of 1 restart used")
    assert text.index("root cause") < text.index("rank 3 (local rank 1) on node 1 (n1), pid 42: killed by SIGKILL")
    assert text.index("killed by SIGKILL") < text.index("other failures (1)") < text.index("rank 0 (local rank 0)")
    assert "Killed" in text


def test_success_summary_lists_recovered_faults():
    text = "\n".join(job_summary(ExitCode.OK, "", (FAILURE,), 1, 3, 5.0))
    assert text.startswith("job succeeded in 5.0s; 1 of 3 restarts used")
    assert "recovered faults (1)" in text and "killed by SIGKILL" in text
