"""Keeping ftrun's processes from outliving what started them: the parent-death signal for its children,
and the end of a head node's ssh session for what that session started.

Workers also have the guardian process (``ftrun.agent.guardian``); short-lived helpers
such as a hung ``npu-smi`` rely on this alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For ``preexec_fn``: runs in the child between fork and exec."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux
    if os.getppid() == 1:
        os._exit(1)  # the parent died before the signal was armed


def on_session_end(action: Callable[[], None]) -> None:
    """Started by a head node over ssh (no TTY, so no hangup comes): call ``action`` once the session's input
    ends, which is when the head closes it, or when the head or its connection is gone."""

    def wait_for_end():
        try:  # the bare descriptor: a buffered reader's lock would stall the interpreter's exit
            while os.read(sys.stdin.fileno(), 4096):
                pass
        except (OSError, ValueError):
            pass
        action()

    threading.Thread(target=wait_for_end, name="ftrun-session", daemon=True).start()
