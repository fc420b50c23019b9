"""Store messages: JSON round trips, key layout, the summary text."""

from __future__ import annotations

import threading
import time

import ftrun.messages
from ftrun.events import EventLog
from ftrun.messages import (
    Command,
    CommandKind,
    NodeSlot,
    RendezvousResult,
    Report,
    ReportKind,
    WorkerFailure,
    from_json,
    signal_name,
    to_json,
)
from ftrun.summary import figures, job_summary

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


def test_threads_reading_the_same_bytes_at_once_build_the_message_once(monkeypatch):
    """A process of simulated agents reads the rendezvous result of a thousand nodes in 256 threads at
    once: the first builds it, the others wait for it instead of each missing the cache."""
    built, build = [], ftrun.messages._build

    def slow_build(cls, data):
        built.append(cls)
        time.sleep(0.05)  # lets the GIL go, as a long build is made to by the interpreter
        return build(cls, data)

    monkeypatch.setattr(ftrun.messages, "_build", slow_build)
    text = to_json(RendezvousResult(nodes=(NodeSlot(0, "fresh", "h", 2, 0),), world_size=2)).encode()
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(from_json(RendezvousResult, bytes(text))))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(results) == 8 and len(set(results)) == 1
    assert built.count(RendezvousResult) == 1


def test_signal_names():
    assert signal_name(-9) == "SIGKILL" and signal_name(-11) == "SIGSEGV" and signal_name(1) == ""


def _events(*failures, exit_code=1, reason="budget spent", repairs=()):
    log = EventLog()
    log.emit("job_started", 0, run_id="r", max_restarts=3)
    for failure in failures:
        log.fault(failure)
    for level, total in repairs:
        log.emit("repair_done", 1, "back", level=level, total=total, durations={"detect": total})
    log.emit("job_finished", 1, "", exit_code=exit_code, reason=reason, duration=12.0, step=40, restarts_used=1,
             max_restarts=1 if exit_code else 3)
    return log.events


def test_failure_summary_names_the_root_cause_first():
    second = WorkerFailure(rank=0, local_rank=0, node_rank=0, host="n0", pid=7, exit_code=1, generation=0)
    lines = job_summary(_events(FAILURE, second))
    text = "\n".join(lines)
    assert lines[0] == "job failed after 12.0s at step 40 (exit code 1); 1 of 1 restart used"
    assert lines[1] == "reason: budget spent"
    assert text.index("root cause") < text.index("rank 3 (local rank 1) on node 1 (n1), pid 42: killed by SIGKILL")
    assert text.index("killed by SIGKILL") < text.index("other failures (1)") < text.index("rank 0 (local rank 0)")
    assert "Killed" in text


def test_success_summary_counts_faults_and_repairs():
    exited = WorkerFailure(rank=1, local_rank=1, node_rank=0, host="n0", pid=8, exit_code=1, generation=0, cause="exit")
    events = _events(FAILURE, exited, exit_code=0, reason="every worker finished",
                     repairs=(("process", 0.5), ("process", 0.9), ("process", 0.7), ("job", 6.0)))
    text = "\n".join(job_summary(events))
    assert text.startswith("job succeeded in 12.0s at step 40; 1 of 3 restarts used")
    assert "faults: 2 (1 exit, 1 signal)" in text
    assert "repairs: 3 process-level repairs, median time to repair 0.70s" in text
    assert "repairs: 1 job-level repair, median time to repair 6.00s" in text
    assert "recovered faults (2)" in text and "killed by SIGKILL" in text and "reason:" not in text
    assert figures(events)["faults_by_kind"] == {"signal": 1, "exit": 1}


def test_summary_of_a_log_without_its_end():
    events = _events(FAILURE)[:-1]
    assert job_summary(events)[0].startswith("job still running (or its controller died)")


def test_summary_names_the_steps_committed_as_the_status_does_whatever_the_script_s_numbering():
    # a finished 60-step job said "at step 59" for one script (its loop numbered from 0) and "at step 60"
    # for another (from 1, over 61 of job.steps' positions): now the steps committed, the status's "step 60"
    events = [{"kind": "job_started", "elapsed": 0.0, "run_id": "r", "max_restarts": 0},
              {"kind": "job_finished", "elapsed": 3.0, "exit_code": 0, "reason": "done", "duration": 3.0, "step": 60,
               "restarts_used": 0, "max_restarts": 0}]
    assert job_summary(events)[0] == "job succeeded in 3.0s at step 60; 0 of 0 restarts used"
    events[-1]["step"] = 0  # nothing committed: no step to name
    assert job_summary(events)[0] == "job succeeded in 3.0s; 0 of 0 restarts used"
