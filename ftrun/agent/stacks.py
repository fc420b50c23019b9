"""A hung rank's stack, written where its output goes, before the rank is killed.

With ``py-spy`` on PATH it dumps any Python process. Otherwise a rank under
``ftrun.elastic`` has ``faulthandler`` on SIGUSR1: the signal (followed by SIGCONT,
in case the rank is stopped) makes it write every thread's stack to its stderr,
which the agent copies to the console and the rank's log like any other output.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time

log = logging.getLogger(__name__)
#: how long a stack dump may take
DUMP_TIMEOUT = 5.0
#: faulthandler's dump is done once the stderr stays quiet for this long
QUIET = 0.2
#: the signal ftrun.elastic gives to faulthandler
DUMP_SIGNAL = signal.SIGUSR1


def dump_stack(worker, uses_library: bool) -> None:
    """Dump the worker's Python stack into its log (best effort, bounded by DUMP_TIMEOUT)."""
    how, lines = stack_lines(worker, uses_library)
    if how == "py-spy":
        log.warning("rank %d stack (py-spy):\n%s", worker.placement.rank, "\n".join(lines))
    elif lines:
        log.warning("rank %d: %s", worker.placement.rank, lines[0])


def stack_lines(worker, uses_library: bool) -> tuple[str, list[str]]:
    """The worker's Python stack: (how it was taken, its lines). With faulthandler the stack also goes
    to the rank's stderr (and so its log); the lines are read back from the rank's recent output.
    Without a way to dump, one line that says so."""
    pid = worker.pid
    py_spy = shutil.which("py-spy")
    if py_spy:
        try:
            # --nonblocking: reads the memory without ptrace-stopping the process, which fails on a stopped one
            done = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=DUMP_TIMEOUT, errors="replace")
            return "py-spy", (done.stdout or done.stderr).splitlines()
        except (OSError, subprocess.TimeoutExpired) as e:
            return "py-spy", [f"py-spy failed: {e}"]
    if not uses_library:
        return "", ["no stack dump (install py-spy to get one from scripts without ftrun.elastic)"]
    before = worker.err.lines
    captured: list[str] = []
    worker.err.capture = captured
    try:
        os.kill(pid, DUMP_SIGNAL)
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        worker.err.capture = None
        return "", ["the process is gone"]
    deadline = time.monotonic() + DUMP_TIMEOUT
    seen, quiet_since = before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        if worker.err.lines != seen:
            seen, quiet_since = worker.err.lines, time.monotonic()
        elif seen != before and time.monotonic() - quiet_since > QUIET:
            worker.err.capture = None
            return "faulthandler", current_thread_first(captured)
    worker.err.capture = None
    return "", [f"did not dump its stack within {DUMP_TIMEOUT:g}s"]


def current_thread_first(lines: list[str]) -> list[str]:
    """faulthandler's dump with the thread it interrupted (the training loop) first, as py-spy shows it."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    blocks.sort(key=lambda block: not block[0].startswith("Current thread"))
    return [line for block in blocks for line in block]
