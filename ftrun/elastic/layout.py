"""Which ranks hold a copy of each other's training state, from the mesh the script declares.

The mesh is a grid of ranks in row-major order (torch's ``init_device_mesh``). Along a replica
dimension (data parallelism: ``dp``, HSDP's ``replicate``) the ranks hold the same state; along
any other (``tp``, ``pp``, FSDP's ``shard``) each holds its own part. A rank's replica set is the
ranks that share its coordinate on every other dimension:

* pure DP: every rank;
* HSDP (replicate, shard): the replicate dimension's ranks with the same shard coordinate;
* DP x TP: the DP peers with the same TP coordinate;
* DP x PP: the DP peers of the same stage;
* FSDP2's full sharding: each rank alone (its state comes from snapshots).

Pure: no torch, no groups.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

#: dimension names taken for replica dimensions unless the script says otherwise
REPLICA_NAMES = frozenset({"dp", "ddp", "data", "replicate", "dp_replicate"})


@dataclass(frozen=True)
class ReplicaLayout:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    #: the dimensions along which ranks hold the same state
    replicate: tuple[str, ...]
    #: False while the script's first step has yet to show the replica dimensions (a mesh made with
    #: torch's own API, ftrun/elastic/meshes.py); until then each rank is taken to hold its own state
    known: bool = True

    @classmethod
    def declared(cls, dims: dict[str, int], replicate: tuple[str, ...] | None = None) -> "ReplicaLayout":
        """From ``job.mesh({"dp": 2, "tp": 2})``; ``replicate`` names the replica dimensions
        (by default those called dp, ddp, data, replicate or dp_replicate)."""
        names = tuple(dims)
        if not names:
            raise ValueError("a mesh needs at least one dimension")
        for name, size in dims.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {name!r}: size {size!r} is not a positive integer")
        if replicate is None:
            replicate = tuple(n for n in names if n in REPLICA_NAMES)
        unknown = [n for n in replicate if n not in names]
        if unknown:
            raise ValueError(f"replicate names {', '.join(unknown)}, which the mesh ({', '.join(names)}) does not have")
        return cls(tuple(dims.values()), names, tuple(replicate))

    @classmethod
    def data_parallel(cls, world_size: int) -> "ReplicaLayout":
        return cls((world_size,), ("dp",), ("dp",))

    @classmethod
    def sharded(cls, world_size: int) -> "ReplicaLayout":
        return cls((world_size,), ("shard",), ())

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def without(self, names: set[str]) -> "ReplicaLayout":
        """The same mesh with ``names`` no longer taken for replica dimensions."""
        return ReplicaLayout(self.shape, self.names, tuple(n for n in self.replicate if n not in names), self.known)

    def replica_mask(self) -> int:
        """The replica dimensions as bits (bit i: ``names[i]``), for the rollback's rows; -1 while not known."""
        return sum(1 << i for i, name in enumerate(self.names) if name in self.replicate) if self.known else -1

    def agreed(self, masks: list[int]) -> "ReplicaLayout":
        """This layout, or where it is not known yet, the replica dimensions the ranks that know them
        say (their ``replica_mask()``, one per rank): a replacement never ran the step that shows them."""
        said = {mask for mask in masks if mask >= 0}
        if self.known or len(said) != 1 or next(iter(said)) >= 1 << len(self.names):
            return self
        mask = next(iter(said))
        return ReplicaLayout(self.shape, self.names, tuple(n for i, n in enumerate(self.names) if mask >> i & 1))

    def replica_sets(self) -> list[tuple[int, ...]]:
        """Each set of ranks that hold the same state, in order of their lowest rank."""
        keep = [i for i, name in enumerate(self.names) if name not in self.replicate]
        sets: dict[tuple[int, ...], list[int]] = {}
        for rank, coords in enumerate(itertools.product(*(range(n) for n in self.shape))):
            sets.setdefault(tuple(coords[i] for i in keep), []).append(rank)
        return sorted((tuple(members) for members in sets.values()), key=lambda members: members[0])

    def describe(self) -> str:
        dims = " x ".join(f"{name} {size}" for name, size in zip(self.names, self.shape))
        copies = (", ".join(self.replicate) or "none") if self.known else "not known before the first step"
        return f"{dims} (replica dimensions: {copies})"
