"""Keeping ftrun's children from outliving it: the parent-death signal.

Workers also have the guardian process (``ftrun.agent.guardian``); short-lived helpers
such as a hung ``npu-smi`` rely on this alone.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """For ``preexec_fn``: runs in the child between fork and exec."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux
    if os.getppid() == 1:
        os._exit(1)  # the parent died before the signal was armed
