"""Why a worker ended: one pure decision over its evidence.

:func:`classify_exit` weighs what the agent knows about a worker that ended (its
exit status, the last lines of its stderr, the exception it recorded, whether
the kernel's OOM killer took it, whether it hung) and names one cause, in this
order: hang, device error, OOM, Python exception, signal, exit code.
:func:`is_cpp_trace_line` names the lines of torch's C++ stack traces, which are no evidence. The
OOM evidence comes from :class:`ftrun.detection.oom.OomWatch`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Sequence

from ftrun.detection.table import FaultLevel, FaultTable
from ftrun.errors import WORKER_SETTING_EXIT

KINDS = ("exit", "signal", "oom", "exception", "device", "hang", "setting")
#: a matched error message at or above this level explains a worker's death; milder ones are notes
DEVICE_ERROR_FLOOR = FaultLevel.RESTART_REQUEST
#: what mindspore.communication.init() says without msrun's variables: a launch setting, no retry helps
MINDSPORE_WITHOUT_CLUSTER = "init()' without using 'mpirun'"
#: longest exception message kept in a detail line
MESSAGE_LIMIT = 200

# torch.distributed prefixes every line of an uncaught exception with the rank ("[rank0]: ")
_RANK_PREFIX = re.compile(r"^\[(?:rank)?\d+\]:\s?")
# c10's errors (TCPStore, gloo, NCCL) carry the C++ stack trace of where they were raised, and torch's C++
# logging prints it whole: a TCPStore client whose server was killed (torch 2.13) logs a warning, then
#   Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
#   frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<...>) + 0x9d (0x7f34b4d94b8d in .../libc10.so)
#   <omitting python frames>
# and 20 more frames. With TORCH_SHOW_CPP_STACKTRACES=1 the Python exception carries one too, symbolized:
#   C++ CapturedTraceback:
#   #12 c10d::TCPStore::get(std::__cxx11::basic_string<...> const&) from ??:0
_CPP_TRACE_LINE = re.compile(
    r"Exception raised from .+ \(most recent call first\):|frame #\d+: .*|<omitting python frames>"
    r"|C\+\+ CapturedTraceback:|#\d+ .+ from \S+:\d+")
_EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::\s?(?P<message>.*))?$")
# without its Traceback header a line must look unmistakably like an exception to count
_BARE_EXCEPTION_LINE = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt))(?::\s?(?P<message>.*))?$")


@dataclass(frozen=True)
class ProcessFault:
    """The cause of one worker's end."""

    #: one of KINDS: exit, signal, oom, exception, device, hang, setting
    kind: str
    #: one readable line of evidence
    detail: str
    #: the fault level of a device error (None for the other kinds)
    level: FaultLevel | None = None


def classify_exit(
    returncode: int | None,
    stderr_tail: Sequence[str],
    error: str,
    table: FaultTable,
    oom: bool | str = False,
    hung: bool = False,
) -> ProcessFault:
    """Why a worker ended.

    ``returncode`` is Popen's (negative: killed by that signal); ``error`` is the
    exception it recorded (torch's error file), if any; ``oom`` is True or the
    OOM killer's evidence (only believed for a worker killed by SIGKILL, since the
    cgroup's counter also counts other processes); ``hung``: the agent stopped it
    for making no progress.
    """
    ended = _how_it_ended(returncode)
    if hung:
        return ProcessFault("hang", f"made no progress and was stopped by the agent ({ended})")

    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in stderr_tail]
    if returncode == WORKER_SETTING_EXIT:
        said = next((line.strip() for line in reversed(lines) if line.strip()), "no message")
        return ProcessFault("setting", f"{ended}, a setting it cannot work with: {shorten(said)}")
    if any(MINDSPORE_WITHOUT_CLUSTER in line for line in lines):
        return ProcessFault("setting", f"{ended}: mindspore.communication.init() found no MindSpore cluster "
                                       "(launch it with --framework mindspore)")
    verdict = table.classify_text([*lines, *error.splitlines()])
    if verdict is not None and verdict.level.severity >= DEVICE_ERROR_FLOOR.severity:
        return ProcessFault(
            "device", f"device error in its last output: {verdict.reason} ({verdict.level.value})", verdict.level)

    if oom and _killed_by_sigkill(returncode):
        evidence = f" ({oom})" if isinstance(oom, str) else ""
        return ProcessFault("oom", f"{ended}: the kernel's OOM killer{evidence}")

    exception = exception_from_error(error) or exception_from_traceback(lines)
    if exception:
        return ProcessFault("exception", f"Python exception {exception}")

    if returncode is not None and returncode < 0:
        return ProcessFault("signal", ended)
    return ProcessFault("exit", ended)


def is_cpp_trace_line(line: str) -> bool:
    """Whether ``line`` belongs to a C++ stack trace that torch prints with a c10 error (its header, a frame).

    Such a trace says where in libtorch a failure surfaced, not why, and its 20 to 30 lines per error would
    push the Python exception, which does say why, out of a rank's last lines.
    """
    return _CPP_TRACE_LINE.fullmatch(_RANK_PREFIX.sub("", line.rstrip())) is not None


def exception_from_error(error: str) -> str:
    """``Type: message`` from a recorded error's text ("" when there is none)."""
    first = next((line.strip() for line in error.splitlines() if line.strip()), "")
    if not first:
        return ""
    found = _EXCEPTION_LINE.match(first)
    return _exception_text(found) if found else f"(no type recorded): {shorten(first)}"


def exception_from_traceback(lines: Sequence[str]) -> str:
    """``Type: message`` of the last traceback in ``lines`` ("" when there is none)."""
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if headers:
        for line in lines[headers[-1] + 1:]:
            if line and not line[0].isspace():  # frames are indented; the exception line is not
                found = _EXCEPTION_LINE.match(line.strip())
                if found:
                    return _exception_text(found)
                break
    # the tail may have cut the header off: accept only a line that is plainly an exception
    for line in reversed(lines):
        found = _BARE_EXCEPTION_LINE.match(line.strip())
        if found:
            return _exception_text(found)
    return ""


def _exception_text(found: re.Match) -> str:
    message = (found.group("message") or "").strip()
    return f"{found.group('type')}: {shorten(message)}" if message else found.group("type")


def shorten(text: str) -> str:
    """``text``, cut to MESSAGE_LIMIT characters for a detail line."""
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def _killed_by_sigkill(returncode: int | None) -> bool:
    # 137: a shell between the agent and Python reports its child's SIGKILL so
    return returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "ended with an unknown exit status"
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    if 128 < returncode < 128 + 65:
        return f"exited with code {returncode} (128 + {_signal_name(returncode - 128)}, as a shell reports it)"
    return f"exited with code {returncode}"
