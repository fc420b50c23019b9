"""The outer loop of a rank's part in a repair, the same for torch ranks (ftrun/elastic/repair.py) and
MindSpore ranks (ftrun/mindspore_elastic/repair.py): form the target generation, roll back, and when the
rollback fails because a newer repair was announced meanwhile, go on into that one. Framework-free, as
ftrun/rollback.py is: it imports nothing but the standard library (a MindSpore python has no torch).
"""

from __future__ import annotations

from typing import Callable


class RepairError(RuntimeError):
    """The repair could not finish on this rank (not every rank arrived in its generation in time): the
    process ends, and the controller falls back to job level."""


def repair_until_resumed(target: int, join: Callable[[int], int], rollback: Callable[[int], None],
                         interrupted: Callable[[int, Exception], int | None], joined: bool = False) -> None:
    """``join(target)`` forms generation ``target`` (or a newer one, which it returns) unless ``joined``
    says the rank is in it already; ``rollback(generation)`` puts the state back. A rollback that raises
    anything but RepairError asks ``interrupted(generation, error)`` for a newer generation to go on into;
    None there (no newer repair came) raises the error."""
    while True:
        if not joined:
            target = join(target)
        joined = False
        try:
            rollback(target)
            return
        except RepairError:
            raise
        except Exception as e:
            newer = interrupted(target, e)
            if newer is None:
                raise
            target = newer
