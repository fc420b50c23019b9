"""The end-of-job summary, from the job's events: the root cause first, then the rest.

The same lines come at the end of a run and from ``ftrun report events.jsonl`` later.
"""

from __future__ import annotations

import collections
import statistics
import time

STDERR_LINES_SHOWN = 10


def figures(events: list[dict]) -> dict:
    """The summary's numbers (``ftrun report --json``)."""
    finished = _last(events, "job_finished") or {}
    started = _last(events, "job_started") or {}
    faults = [e for e in events if e["kind"] == "fault"]
    repairs: dict[str, list[float]] = collections.defaultdict(list)
    for event in events:
        if event["kind"] == "repair_done":
            repairs[event.get("level", "job")].append(event.get("total", 0.0))
    steps = [e["step"] for e in events if e.get("step") is not None]
    return {
        "run_id": started.get("run_id", ""),
        "finished": bool(finished),
        "exit_code": finished.get("exit_code"),
        "reason": finished.get("reason", ""),
        "duration": finished.get("duration", events[-1]["elapsed"] if events else 0.0),
        "step": finished.get("step") if finished.get("step") is not None else (steps[-1] if steps else None),
        "restarts_used": finished.get("restarts_used", sum(len(v) for v in repairs.values())),
        "max_restarts": finished.get("max_restarts", started.get("max_restarts")),
        "faults": len(faults),
        "faults_by_kind": dict(collections.Counter(_cause(e) for e in faults)),
        "nodes_lost": sum(1 for e in events if e["kind"] == "node_lost"),
        "repairs": {level: {"count": len(times), "median_s": round(statistics.median(times), 3)}
                    for level, times in sorted(repairs.items())},
        "repairs_failed": sum(1 for e in events if e["kind"] == "repair_failed"),
    }


def job_summary(events: list[dict]) -> list[str]:
    """The lines printed when the job ends (and by ``ftrun report``)."""
    f = figures(events)
    faults = [e for e in events if e["kind"] == "fault"]
    # the steps committed, the number the status view and ftrun status show as "step N": counted from 1,
    # the last step finished (job.steps numbers the loop from 0, so its last was N - 1)
    at_step = f" at step {f['step']}" if f["step"] else ""
    budget = ""
    if f["max_restarts"] is not None:
        plural = "s" if f["max_restarts"] != 1 else ""
        budget = f"; {f['restarts_used']} of {f['max_restarts']} restart{plural} used"
    if not f["finished"]:
        lines = [f"job still running (or its controller died) after {f['duration']:.1f}s{at_step}{budget}"]
    elif f["exit_code"] == 0:
        lines = [f"job succeeded in {f['duration']:.1f}s{at_step}{budget}"]
    else:
        lines = [f"job failed after {f['duration']:.1f}s{at_step} (exit code {f['exit_code']}){budget}",
                 f"reason: {f['reason']}"]
        if faults:
            lines.append("root cause (first failure):")
            lines.extend(describe_fault(faults[0]))
    if faults:
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(f["faults_by_kind"].items()))
        lines.append(f"faults: {len(faults)} ({kinds})" + (f", {f['nodes_lost']} node(s) lost" if f["nodes_lost"] else ""))
    elif f["nodes_lost"]:
        lines.append(f"faults: {f['nodes_lost']} node(s) lost")
    for level, repairs in f["repairs"].items():
        plural = "s" if repairs["count"] != 1 else ""
        lines.append(f"repairs: {repairs['count']} {level}-level repair{plural}, median time to repair "
                     f"{repairs['median_s']:.2f}s")
    if f["repairs_failed"]:
        lines.append(f"process-level repairs that fell back to job level: {f['repairs_failed']}")
    for title, kind in (("nodes replaced by a spare", "takeover"), ("controller moved", "controller_moved"),
                        ("job resized", "resized")):
        happened = [e["detail"] for e in events if e["kind"] == kind]
        if happened:
            lines.append(f"{title} ({len(happened)}):")
            lines.extend(f"  {line}" for line in happened)
    rest = faults[1:] if f["finished"] and f["exit_code"] != 0 else faults
    if rest:
        lines.append(f"{'other failures' if rest is not faults else 'recovered faults'} ({len(rest)}):")
        for fault in rest:
            lines.extend(describe_fault(fault))
    return lines


def describe_fault(event: dict, indent: str = "  ") -> list[str]:
    evidence = event.get("evidence") or {}
    detected = evidence.get("detected_at") or event.get("t")
    when = time.strftime("%H:%M:%S", time.localtime(detected)) if detected else "?"
    lines = [f"{indent}{event['detail']}  [generation {event['generation']}, {when}]"]
    if evidence.get("error"):
        lines.append(f"{indent}  error: {evidence['error'].splitlines()[0]}")
    tail = [line for line in evidence.get("stderr_tail") or () if line.strip()][-STDERR_LINES_SHOWN:]
    if tail:
        lines.append(f"{indent}  last stderr lines:")
        lines.extend(f"{indent}    {line}" for line in tail)
    return lines


def _cause(event: dict) -> str:
    return (event.get("evidence") or {}).get("cause") or "unknown"


def _last(events: list[dict], kind: str) -> dict | None:
    return next((e for e in reversed(events) if e["kind"] == kind), None)
