"""A torch rank's snapshots: ``ftrun.snapshots.rank`` with torch tensors for arrays.

The parameters and the optimizer's state are copied straight from each tensor into the file's pages;
GPU tensors as a :class:`~ftrun.snapshots.staging.DeviceStaging` says (a plain copy on the training's
stream, unless told otherwise), and checkpoint files (``--checkpoint-dir``) are ``torch.save`` files.
"""

from __future__ import annotations

import io
from typing import Callable

import torch

from ftrun.auth import Signer
from ftrun.contract import SnapshotSettings
from ftrun.snapshots import rank
from ftrun.snapshots.format import Header, SnapshotLayout, copy_tensors, load_states
from ftrun.snapshots.plan import RestoreSource
from ftrun.snapshots.rank import ArrayKind, own_steps, snapshot_signer, sources_to_restore
from ftrun.snapshots.staging import DeviceStaging


class TorchArrays(ArrayKind):
    """Torch tensors: copied by ``copy_tensors``, GPU ones through ``staging``."""

    name = "torch"

    def __init__(self, staging: DeviceStaging | None = None):
        #: how GPU tensors reach the file (None: the default, a plain copy on the training's stream)
        self.staging = staging if staging is not None else DeviceStaging()

    def prepare(self, tensors: list) -> None:
        self.staging.mark_ready(tensors)

    def copy(self, pages, layout: SnapshotLayout, data_offset: int, indices) -> None:
        copy_tensors(pages, layout, data_offset, indices, self.staging)

    def identity(self, tensor) -> int:
        return tensor.data_ptr()

    def load(self, header: Header, blob: bytearray) -> dict:
        return load_states(header, blob)

    def load_checkpoint(self, data: bytes, path: str) -> dict:
        return torch.load(io.BytesIO(data), weights_only=False)


#: reads snapshots back (its staging, which only writes use, makes no CUDA stream until one does)
_LOADER = TorchArrays()


class TorchSnapshotWriter(rank.SnapshotWriter):
    """A torch rank's snapshots (see ``ftrun.snapshots.rank.SnapshotWriter``)."""

    def __init__(self, folder: str, rank: int, world_size: int, sharded: bool, every: int, limit: int, copies: int,
                 staging: DeviceStaging | None = None):
        super().__init__(folder, rank, world_size, sharded, every, limit, copies, TorchArrays(staging))

    @classmethod
    def for_rank(cls, settings: SnapshotSettings | None, rank: int, world_size: int,
                 sharded: bool) -> "TorchSnapshotWriter | None":
        """The writer ftrun's agent set up for this rank (its worker environment's); None without snapshots."""
        if settings is None:
            return None
        return cls(settings.folder, rank, world_size, sharded, settings.every, settings.limit, settings.copies)

    @property
    def staging(self) -> DeviceStaging:
        return self.arrays.staging  # type: ignore[attr-defined]


def load_own(folder: str, rank_: int, step: int) -> dict:
    """This rank's own snapshot of ``step`` from its agent's folder, checked."""
    return rank.load_own(folder, rank_, step, _LOADER)


def load_source(source: RestoreSource, step: int, folder: str, signer: Signer) -> dict:
    """The registered state a restore source holds, checked: its sum, its step and its rank."""
    return rank.load_source(source, step, folder, signer, _LOADER)


def load_first_good(sources: list[RestoreSource], step: int, folder: str, signer: Signer,
                    report: Callable[[RestoreSource], None]) -> tuple[RestoreSource, dict]:
    """The first of ``sources`` whose copy passes its checks, and the state it holds (``rank.load_first_good``)."""
    return rank.load_first_good(sources, step, folder, signer, report, _LOADER)


__all__ = ["TorchSnapshotWriter", "TorchArrays", "load_own", "load_source", "load_first_good",
           "own_steps", "snapshot_signer", "sources_to_restore"]
