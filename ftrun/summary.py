"""The job-wide summary: the root cause first, then the rest."""

from __future__ import annotations

import time

from ftrun.errors import ExitCode
from ftrun.messages import WorkerFailure

STDERR_LINES_SHOWN = 10


def describe_failure(failure: WorkerFailure, indent: str = "  ") -> list[str]:
    when = time.strftime("%H:%M:%S", time.localtime(failure.timestamp)) if failure.timestamp else "?"
    lines = [f"{indent}{failure.describe()}  [generation {failure.generation}, {when}]"]
    if failure.error:
        lines.append(f"{indent}  error: {failure.error.splitlines()[0]}")
    tail = [line for line in failure.stderr_tail if line.strip()][-STDERR_LINES_SHOWN:]
    if tail:
        lines.append(f"{indent}  last stderr lines:")
        lines.extend(f"{indent}    {line}" for line in tail)
    return lines


def job_summary(
    exit_code: int,
    reason: str,
    failures: tuple[WorkerFailure, ...],
    restarts_used: int,
    max_restarts: int,
    duration: float,
    replaced_nodes: tuple[str, ...] = (),
    resized: tuple[str, ...] = (),
) -> list[str]:
    """The lines printed when the job ends."""
    budget = f"{restarts_used} of {max_restarts} restart{'s' if max_restarts != 1 else ''} used"
    if exit_code == ExitCode.OK:
        head = f"job succeeded in {duration:.1f}s; {budget}"
    else:
        head = f"job failed after {duration:.1f}s (exit code {exit_code}); {budget}"
    lines = [head]
    if reason and exit_code != ExitCode.OK:
        lines.append(f"reason: {reason}")
    for title, events in (("nodes replaced by a spare", replaced_nodes), ("job resized", resized)):
        if events:
            lines.append(f"{title} ({len(events)}):")
            lines.extend(f"  {line}" for line in events)
    if failures and exit_code == ExitCode.OK:
        lines.append(f"recovered faults ({len(failures)}):")
        for failure in failures:
            lines.extend(describe_failure(failure))
    elif failures:
        lines.append("root cause (first failure):")
        lines.extend(describe_failure(failures[0]))
        if len(failures) > 1:
            lines.append(f"other failures ({len(failures) - 1}):")
            for failure in failures[1:]:
                lines.extend(describe_failure(failure))
    return lines
