"""A warm standby worker: a Python process that has already imported torch and waits for a rank.

Importing torch costs seconds; a replacement rank handed to a standby skips that.
The agent starts it like any worker (own process group, parent-death signal, the
guardian told), then writes one JSON line on its stdin: the worker's argv, its
environment and its working directory. The standby takes them on and runs the
script as ``python -u SCRIPT`` or ``python -u -m MODULE`` would.

It warms up at a lower CPU priority (nice +10, ``lower_priority``), so that its import does not
slow the ranks that run beside it, and takes its priority back once it is handed a rank.

Runs as ``python -u -m ftrun.agent.standby``.
"""

from __future__ import annotations

import errno
import json
import os
import runpy
import sys
import time
from typing import Callable

#: how much lower the priority a standby warms up at (nice value added)
WARM_UP_NICE = 10
#: the scheduler's session (autogroup) of this process, and how long a change to its nice value may wait
AUTOGROUP = "/proc/self/autogroup"
SESSION_NICE_WAIT = 2.0


def warm_up() -> None:
    """Pay, before any rank is assigned, for what every training script pays in its first second."""
    import torch
    import torch.distributed  # noqa: F401

    import ftrun.elastic  # noqa: F401

    # the first optimizer loads torch's compiler stack (close to a second here); a tiny step
    # also readies autograd
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.sum().backward()
    optimizer.step()


def lower_priority() -> list[Callable[[], None]]:
    """Lower this process's CPU priority for the warm-up, where it can be raised again; what raises it.

    Two levers: the process's own nice value (only where a priority may be raised: root, CAP_SYS_NICE
    or RLIMIT_NICE), and, where the scheduler groups processes by session first (autogroups: a
    standby leads a session of its own), its session's nice value, which may go back to zero freely.
    """
    undo: list[Callable[[], None]] = []
    started = os.getpriority(os.PRIO_PROCESS, 0)
    try:  # allowed only where a priority can be raised: then going back after the warm-up is too
        os.setpriority(os.PRIO_PROCESS, 0, started - 1)
    except OSError:
        pass
    else:
        os.setpriority(os.PRIO_PROCESS, 0, min(started + WARM_UP_NICE, 19))
        undo.append(lambda: _every_thread_at(started))
    session = _session_nice() if os.getsid(0) == os.getpid() else None
    if session is not None and session >= 0 and _set_session_nice(min(session + WARM_UP_NICE, 19)):
        undo.append(lambda: _restore_session_nice(session))
    return undo


def _every_thread_at(priority: int) -> None:
    """Every thread of this process (the warm-up may have started some) at ``priority``."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread), priority)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def _session_nice() -> int | None:
    try:
        with open(AUTOGROUP) as f:
            return int(f.read().split()[-1])  # "/autogroup-123 nice 0"
    except (OSError, ValueError, IndexError):
        return None  # no autogroups here


def _restore_session_nice(nice: int) -> None:
    if not _set_session_nice(nice):
        print(f"ftrun: a warm standby could not set its session's nice value back to {nice}: this rank "
              "runs at a lower CPU priority than its peers", file=sys.stderr, flush=True)


def _set_session_nice(nice: int) -> bool:
    """The kernel takes one such change a tenth of a second from anyone but an administrator (EAGAIN
    otherwise): standbys starting together take turns."""
    deadline = time.monotonic() + SESSION_NICE_WAIT
    while True:
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return True
        except OSError as e:
            if e.errno != errno.EAGAIN or time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def run(assignment: dict) -> None:
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    argv = assignment["argv"]  # [python, -u, SCRIPT, args...] or [python, -u, -m, MODULE, args...]
    if argv[2] == "-m":
        sys.argv = [argv[3], *argv[4:]]
        runpy.run_module(argv[3], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[2:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[2])))
        runpy.run_path(argv[2], run_name="__main__")


def main() -> None:
    raise_priority = lower_priority()
    warm_up()
    line = sys.stdin.readline()
    if not line:
        return  # the agent let this standby go unused
    sys.stdin.close()
    for undo in raise_priority:  # a rank runs at its peers' priority
        undo()
    run(json.loads(line))


def can_run(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether a worker command is one a standby can take over (python -u SCRIPT / -m MODULE)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u" and argv[2] != "-c"


if __name__ == "__main__":
    main()
