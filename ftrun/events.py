"""The job's event log: every fault, decision, phase and repair as one JSON object.

The controller is the only writer. It keeps the events in memory (the status view and the summary
read them there) and, with ``--log-dir``, appends each as a line to ``events.jsonl`` in the run's log folder,
``<log-dir>/<run-id>/`` (``<log-dir>/<run-id>_<suffix>/`` with ``--log-layout torchrun``)
(``ftrun report`` reads that file later). Every event has these fields:

``t``           wall-clock seconds; never decreases within the log, even if the clock steps back
``elapsed``     seconds since the job started, by the controller's monotonic clock
``source``      who timed it: ``controller``, or ``node<N>`` for an agent's fault evidence
``kind``        one of ``KINDS``
``generation``  the generation the event belongs to
``node``, ``rank``, ``host``   where it happened, or null
``detail``      one line for a person

and, by kind: ``evidence`` (fault: cause, exit code, signal, pid, error, stderr tail, the agent's
detection time), ``level`` (decision, repair_done, generation_started), ``phase`` (phase),
``durations`` (seconds by step of the repair: detect, stop, env clear, repair, rollback at process
level; detect, stop, restart at job level) and ``total`` (repair_done), ``step`` (progress,
job_finished), ``steps_per_s`` (progress), ``exit_code``, ``reason``, ``duration``, ``restarts_used``,
``max_restarts`` (job_finished), ``budget_left`` and ``target_generation`` (decision), ``world_size``
(job_started, generation_started, resized), ``run_id``, ``nodes``, ``spares``, ``recovery`` (job_started),
``step`` and ``sources`` (restore), ``step`` and ``path`` (checkpoint), ``cause`` and ``remedy`` (repair_failed:
why the ranks found no state to go back to and what would have kept the repair at process level, each
"" when none), ``action``, ``who`` and ``accepted`` (operator), ``score``, ``named``, ``action`` (straggler: report or
replace) and ``outside`` (straggler: named from outside, by its CPU share: a script without the worker
library), ``before``, ``slowed`` and ``after`` (straggler_gain: seconds per step).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import IO, Iterable

from ftrun.folders import private_dirs
from ftrun.messages import WorkerFailure

log = logging.getLogger(__name__)

KINDS = (
    "job_started",  # the rendezvous is done: nodes, spares, world size, recovery level, budget
    "generation_started",  # a generation's workers start (level: start, job, grow)
    "fault",  # a rank failed: one event per rank, with the agent's evidence
    "node_lost",  # a node's agent is gone (keepalive silent, ssh session ended, no usable device)
    "decision",  # what the controller does about it: a process- or job-level repair, or the end
    "phase",  # the job moved to a recovery phase (stopping, env_clear, repair, rollback, running, exiting)
    "repair_done",  # training resumed: the repair's phase breakdown and its total time
    "repair_failed",  # a process-level repair could not finish: job-level fallback
    "takeover",  # a spare node took a lost node's place
    "controller_moved",  # --rdzv-backend etcd: another agent holds the controller (the one before lost its lease)
    "resized",  # the job went on with fewer nodes, or grew back
    "progress",  # the lowest committed step across ranks, and the training rate
    "restore",  # a job-level restart resumes from snapshots: the step, and where each rank reads it
    "checkpoint",  # every rank's snapshot of a step is on disk, with its manifest
    "job_finished",  # exit code, reason, duration, final step, budget used
    "operator",  # a person's action from ftrun top (restart drill, drain, stop): who asked, and the answer
    "link",  # a node's data link went dark or came back, or the job waits for it (ftrun.controller.links)
    "stall",  # every rank lives and beats but no step was committed past the job's own bound; and its end
    "straggler",  # a rank every step waits for was named (or cleared): its score, and whether its node's ranks move
    "straggler_gain",  # the job's step time before the slowdown, with the straggler, and after its ranks moved
)
REQUIRED = ("t", "elapsed", "source", "kind", "generation", "node", "rank", "host", "detail")
EVENTS_FILE = "events.jsonl"


class EventLog:
    """The job's events, in memory and (optionally) in a JSON-lines file. Thread-safe."""

    def __init__(self, path: str = "", go_on: bool = False):
        """``go_on``: the file is the same job's, from a controller before this one (--rdzv-backend etcd):
        add to it rather than start it afresh."""
        self.path = path
        self.events: list[dict] = []
        self._lock = threading.Lock()
        #: when the job started (monotonic clock): ``elapsed`` counts from it
        self.started = time.monotonic()
        self._last_t = 0.0
        self._file: IO[str] | None = None
        if path:
            private_dirs(os.path.dirname(path) or ".")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if go_on else os.O_TRUNC), 0o600)  # one job per file
            os.fchmod(fd, 0o600)  # also when an older run left the file
            self._file = os.fdopen(fd, "a", encoding="utf-8")

    def emit(self, kind: str, generation: int, detail: str = "", *, node: int | None = None,
             rank: int | None = None, host: str | None = None, source: str = "controller", **fields) -> dict:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        with self._lock:
            self._last_t = max(self._last_t, time.time())
            event = {"t": round(self._last_t, 6), "elapsed": round(time.monotonic() - self.started, 6),
                     "source": source, "kind": kind, "generation": generation, "node": node, "rank": rank,
                     "host": host, "detail": detail, **fields}
            self.events.append(event)
            if self._file is not None:
                try:
                    self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
                    self._file.flush()
                except OSError as e:  # a full disk must not stop the job
                    log.warning("cannot write the event log %s: %s; going on without it", self.path, e)
                    self._file = None
        return event

    def fault(self, failure: WorkerFailure) -> dict:
        evidence = {"cause": failure.cause or ("signal" if failure.signal else "exit"), "exit_code": failure.exit_code,
                    "signal": failure.signal, "pid": failure.pid, "error": failure.error,
                    "stderr_tail": list(failure.stderr_tail), "level": failure.level,
                    "detected_at": failure.timestamp}
        return self.emit("fault", failure.generation, failure.describe(), node=failure.node_rank, rank=failure.rank,
                         host=failure.host, source=f"node{failure.node_rank}", evidence=evidence)

    def last(self, kinds: Iterable[str], count: int) -> list[dict]:
        wanted = set(kinds)
        with self._lock:
            return [e for e in self.events if e["kind"] in wanted][-count:]

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict]:
    """The events of an ``events.jsonl`` file; a line that does not parse is named in a ValueError."""
    events = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as e:
                if number > 1 and not line.endswith("\n"):
                    break  # the last line of a log whose writer died mid-line
                raise ValueError(f"{path} line {number} is not JSON ({e.msg})") from None
            missing = [name for name in REQUIRED if name not in event] if isinstance(event, dict) else REQUIRED
            if missing:
                raise ValueError(f"{path} line {number} is not an ftrun event (no {', '.join(missing)})")
            events.append(event)
    return events
