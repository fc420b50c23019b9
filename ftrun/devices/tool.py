"""Running a device tool (npu-smi, nvidia-smi, hccn_tool) with a deadline.

The tool runs in a process group of its own, so the kill at the deadline reaches
whatever it started, and with a parent-death signal, so that a tool hung when the
agent leaves does not stay behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from ftrun.devices import DeviceToolError
from ftrun.orphans import die_with_parent

#: after the kill, how long to wait for the pipes (a grandchild that left the group may hold them)
REAP_GRACE = 2.0


class ToolUnavailable(DeviceToolError):
    """The tool is not there, would not start, or did not answer in time (asking again will not help)."""


@dataclass(frozen=True)
class ToolResult:
    returncode: int
    stdout: str
    stderr: str


def run_tool(argv: list[str], timeout: float, name: str, merge_stderr: bool = False) -> ToolResult:
    """Run ``argv`` to completion within ``timeout`` seconds; output decoded, never failing on bytes.

    ``name`` is how errors name the command ("npu-smi info -m"). Raises ToolUnavailable when the
    program cannot start or does not finish in time; a non-zero exit is the caller's to judge.
    """
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    except OSError as e:
        raise ToolUnavailable(f"{name} could not start: {e.strerror or e}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_and_reap(proc)
        raise ToolUnavailable(f"{name} did not answer within {timeout:g}s") from None
    return ToolResult(proc.returncode, out.decode("utf-8", "replace"), (err or b"").decode("utf-8", "replace"))


def _kill_and_reap(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.communicate(timeout=REAP_GRACE)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
        proc.wait()
