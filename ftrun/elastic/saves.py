"""A rank's checkpoint saves, seen as they happen: ``torch.save`` and ``torch.distributed.checkpoint``'s
``save``/``async_save`` run inside the rank's :class:`~ftrun.step_times.SaveClock`, which its heartbeat reads.

Why: a rank that writes a checkpoint for 30 s holds every other rank in the next collective for as long; the
controller would take that for a stall (a dark link, a hung rank) were it not told, and it is told by the
heartbeat (``save SINCE``, and the longest save measured), so that it gives a save the job's own save time.

The functions are wrapped where scripts and frameworks call them (the ``torch`` module's ``save``, the
``torch.distributed.checkpoint`` package's), as ``track_torch_ddp`` wraps DDP's constructor: nothing runs
while no save happens. ``torch.distributed.checkpoint`` (0.7 s to import) is wrapped only once the script
imported it: at ``init()`` and again at the first ``steps()``. A save of another kind (safetensors, a
framework's own writer) is counted inside :func:`saving` (``job.saving()``; the integrations wrap the
Trainer's and Lightning's checkpoint saving so).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

import torch

from ftrun.step_times import SaveClock

#: torch.distributed.checkpoint's saving functions, in the modules a script reaches them through
DCP_MODULES = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict_saver")
DCP_SAVES = ("save", "async_save", "save_state_dict")

#: the clock of this process's job (one job a process); None outside ftrun
_clock: SaveClock | None = None


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Around a checkpoint save the library cannot see (a writer of the script's own): the heartbeat says the
    rank saves, and the save is measured. Nothing outside ftrun, and once inside another save."""
    clock = _clock
    if clock is None:
        yield
        return
    with clock.saving():
        yield


def _counted(original: Callable) -> Callable:
    if getattr(original, "_ftrun_saves", False):
        return original

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        with saving():
            return original(*args, **kwargs)

    save._ftrun_saves = True  # type: ignore[attr-defined]
    return save


def count_saves_of(owner: Any, name: str) -> None:
    """``owner.name(...)`` counted as a checkpoint save from now on, on this instance alone (once): a framework's
    own checkpoint saving, which writes more than its ``torch.save`` calls do (safetensors, a file write after
    ``torch.save`` into memory)."""
    method = getattr(owner, name, None)
    if callable(method) and not getattr(method, "_ftrun_saves", False):
        setattr(owner, name, _counted(method))


def track_saves(clock: SaveClock) -> None:
    """Count this process's saves on ``clock`` from now on: ``torch.save`` and, where the script imported it
    already, ``torch.distributed.checkpoint``'s (call again once it may have: :func:`track_checkpoint`)."""
    global _clock
    _clock = clock
    torch.save = _counted(torch.save)  # type: ignore[assignment]
    track_checkpoint()


def track_checkpoint() -> None:
    """``torch.distributed.checkpoint``'s saves counted, if the script imported it by now (never imported here)."""
    for name in DCP_MODULES:
        module = sys.modules.get(name)
        for function in DCP_SAVES if module is not None else ():
            if callable(getattr(module, function, None)):
                setattr(module, function, _counted(getattr(module, function)))
