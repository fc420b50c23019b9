"""Which ranks hold copies of each other's state, read from a mesh the script made with torch's own API.

``job.mesh()`` declares it. Without it, ftrun reads it from what the script did, never from names alone:

* every registered parameter a DTensor on one mesh of the whole job in rank order (FSDP2 or HSDP over
  ``init_device_mesh``): the dimensions every parameter is ``Replicate`` over hold copies
  (``job._layout_from_placements``);
* every registered parameter a DTensor on one mesh of part of the job (tensor parallelism over
  ``mesh["tp"]``, a pipeline stage's FSDP2 over ``mesh["dp"]``): at the first ``steps()``, the groups the
  script made that complete that mesh to a grid of the whole job in rank order are its other dimensions
  (the rest of its ``init_device_mesh`` or ``DeviceMesh``, a flattened dimension, a ``new_group`` of its
  own); at the end of the first step, those over which the step all-reduced at least as many elements as
  the parameters' local gradients hold (data parallelism by hand, ``job.ddp`` or torch's DDP) hold
  copies, and so do the mesh's dimensions every parameter is ``Replicate`` over (:func:`read_part_mesh`);
* every registered parameter a plain tensor, and groups the script made that are the dimensions of a grid
  of the whole job (pipeline parallelism over ``mesh["pp"]`` with DDP over ``mesh["dp"]``): the same, the
  grid made of those groups alone.

A loss all-reduced for a log is too small to count. A dimension's name is no evidence: the names only word
the one line said where the evidence is missing.

Groups are read by their members' global ranks (ftrun makes every group, ``groups.py``), not through
torch's private mesh bookkeeping (a mesh's root mesh or flatten mapping), which changes between releases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ftrun.elastic.layout import REPLICA_NAMES, ReplicaLayout
from ftrun.elastic.shards import is_dtensor, local_tensor


@dataclass(frozen=True)
class Axis:
    """A dimension of the job's grid of ranks: ``size`` ranks ``stride`` apart."""

    name: str
    size: int
    stride: int


def axis_through(rank: int, name: str, ranks: Sequence[int]) -> Axis | None:
    """The dimension of a row-major grid that ``ranks`` (evenly spaced, ``rank`` among them) would be;
    None where they cannot be one."""
    ordered = sorted(ranks)
    if len(ordered) < 2 or rank not in ordered:
        return None
    stride = ordered[1] - ordered[0]
    if stride < 1 or any(b - a != stride for a, b in zip(ordered, ordered[1:])):
        return None
    if ordered[0] != rank - (rank // stride % len(ordered)) * stride:  # straddles a block of the grid
        return None
    return Axis(name, len(ordered), stride)


def complete_grid(world: int, mesh_axes: Sequence[Axis], group_axes: Sequence[Axis | None]
                  ) -> tuple[list[Axis], list[tuple[str, ...]]] | None:
    """The grid of the whole job in rank order that ``mesh_axes`` (the parameters' mesh) and some of
    ``group_axes`` make, largest stride first (``init_device_mesh``'s order), and for each group the
    grid's dimensions it spans (``()``: none exactly). None where they make no such grid.

    Where two groups could be the same dimension, the smaller one is (a flattened dimension spans the
    ones it was made of)."""
    chain: list[Axis] = []
    stride = 1
    while stride < world:
        at = [a for a in mesh_axes if a.stride == stride]
        at = at or sorted((a for a in group_axes if a is not None and a.stride == stride), key=lambda a: a.size)
        if not at:
            return None
        chain.append(at[0])
        stride *= at[0].size
    if stride != world or any(a not in chain for a in mesh_axes):
        return None
    spans = []
    for group in group_axes:
        names: list[str] = []
        if group is not None:
            end, at_stride = group.stride * group.size, group.stride
            for a in chain:
                if a.stride == at_stride and at_stride < end:
                    names.append(a.name)
                    at_stride *= a.size
            if at_stride != end:
                names = []
        spans.append(tuple(names))
    return chain[::-1], spans


@dataclass
class PartMesh:
    """The registered parameters lie on a mesh of part of the job, which groups the script made complete
    to a grid of the whole job (or are plain tensors beside groups that make one): the groups of the first
    step's gradient reductions hold copies."""

    #: the grid, its replica dimensions not known yet (those of the parameters' mesh that every
    #: parameter is Replicate over are)
    layout: ReplicaLayout
    #: each group that is one or more of the grid's dimensions, with their names
    spans: list[tuple[Any, tuple[str, ...]]]
    #: how many elements the parameters' local gradients hold
    gradients: int
    #: the parameters' mesh: its dimensions' names (none for plain tensors)
    part_names: tuple[str, ...]
    #: where the parameters lie, in words: the one line's opening
    opening: str
    #: init(sharded=True): where the step shows no copies, each rank holds its own state (its snapshots
    #: restore it), which is no reason for job level
    sharded: bool = False

    def settle(self) -> tuple[ReplicaLayout, str]:
        """After the first step: the layout it showed, and the one line to say when nothing showed copies."""
        shown = {name for group, names in self.spans if group.reduced >= self.gradients > 0 for name in names}
        names = self.layout.names
        layout = ReplicaLayout(self.layout.shape, names,
                               tuple(n for n in names if n in shown or n in self.layout.replicate))
        if layout.replicate or self.sharded:
            return layout, ""
        others = [n for n in names if n not in self.part_names]
        hint = [n for n in others if n in REPLICA_NAMES] or others
        dims = ", ".join(f'"{n}": {size}' for n, size in zip(names, self.layout.shape))
        replicate = ", ".join(f'"{n}"' for n in hint) + ("," if len(hint) == 1 else "")
        return layout, (f"{self.opening}, and the first step all-reduced no gradients over {' or '.join(others)}: "
                        "ftrun cannot tell which ranks hold copies of each other's state (say it with "
                        f"job.mesh({{{dims}}}, replicate=({replicate})))")


def read_part_mesh(objects: dict[str, Any], world: int, rank: int, groups: Sequence[Any],
                   sharded: bool = False) -> PartMesh | str | None:
    """Where every registered parameter is a DTensor on one mesh of part of the job (this rank's part):
    the grid the ``groups`` complete it to, whose replicas the first step shows (a :class:`PartMesh`),
    or the one line that says why none can be read (no group completes it). Where every one is a plain
    tensor: the grid whose dimensions the groups of part of the job are, as a :class:`PartMesh`. None in
    any other case. ``sharded``: init(sharded=True)."""
    params: list[Any] = [p for obj in objects.values() if isinstance(obj, torch.nn.Module) for p in obj.parameters()]
    if params and not any(is_dtensor(p) for p in params):
        return _plain_grid(params, world, rank, groups, sharded)
    if not params or not all(is_dtensor(p) for p in params):  # DTensors from here on
        return None
    mesh = params[0].device_mesh
    ranks = mesh.mesh
    if any(p.device_mesh != mesh for p in params) or ranks.numel() >= world or rank not in ranks.flatten().tolist():
        return None
    names = tuple(mesh.mesh_dim_names or (f"#{i}" for i in range(mesh.ndim)))
    part = " x ".join(f"{name} {size}" for name, size in zip(names, ranks.shape))
    where = [int(i) for i in (ranks == rank).nonzero()[0]]
    mesh_axes: list[Axis] = []
    for i, name in enumerate(names):
        line = ranks[tuple(slice(None) if j == i else where[j] for j in range(ranks.ndim))].tolist()
        if len(line) > 1:
            made = axis_through(rank, name, line)
            if made is None:
                return _no_grid(part, world)
            mesh_axes.append(made)
    members = set(ranks.flatten().tolist())
    taken = set(names)
    group_axes: list[Axis | None] = []
    for group in groups:
        crossing = set(group.global_ranks) & members == {rank}
        group_axes.append(axis_through(rank, _name(group, taken), group.global_ranks) if crossing else None)
    grid = complete_grid(world, mesh_axes, group_axes)
    if grid is None:
        return _no_grid(part, world)
    chain, spans = grid
    copies = tuple(name for i, name in enumerate(names) if all(p.placements[i].is_replicate() for p in params))
    layout = ReplicaLayout(tuple(a.size for a in chain), tuple(a.name for a in chain),
                           tuple(a.name for a in chain if a.name in copies), known=False)
    gradients = sum(local_tensor(p).numel() for p in params if p.requires_grad)
    opening = f"the registered DTensors lie on {part} of the mesh {_words(layout)}, made without job.mesh()"
    return PartMesh(layout, [(group, span) for group, span in zip(groups, spans) if span], gradients, names,
                    opening, sharded)


def _plain_grid(params: list[Any], world: int, rank: int, groups: Sequence[Any], sharded: bool) -> PartMesh | None:
    """Plain parameters, and groups of part of the job that are the dimensions of a grid of the whole job in
    rank order (pipeline stages over mesh["pp"], DDP over mesh["dp"]): that grid, its replica dimensions
    the first step's gradient reductions. None where the script made no such groups."""
    made = [group for group in groups if len(group.global_ranks) < world]
    taken: set[str] = set()
    grid = complete_grid(world, [], [axis_through(rank, _name(group, taken), group.global_ranks) for group in made])
    if not made or grid is None:
        return None
    chain, spans = grid
    layout = ReplicaLayout(tuple(a.size for a in chain), tuple(a.name for a in chain), (), known=False)
    # a group of the whole job (the default one: DDP over every rank) spans every dimension
    wholes = [(group, layout.names) for group in groups if len(group.global_ranks) == world]
    gradients = sum(p.numel() for p in params if p.requires_grad)
    opening = (f"the registered parameters are plain tensors, and the groups made without job.mesh() are the mesh "
               f"{_words(layout)}")
    return PartMesh(layout, wholes + [(group, span) for group, span in zip(made, spans) if span], gradients, (),
                    opening, sharded)


def _name(group: Any, taken: set[str]) -> str:
    """A group's dimension name: its mesh dimension's (torch describes a mesh's groups as ``mesh_<name>``),
    else its own; unique among ``taken``, which it joins."""
    desc = getattr(group, "group_desc", "") or ""
    name = desc[len("mesh_"):] if desc.startswith("mesh_") else f"group{group.group_name}"
    while name in taken:
        name += "'"
    taken.add(name)
    return name


def _words(layout: ReplicaLayout) -> str:
    return " x ".join(f"{name} {size}" for name, size in zip(layout.names, layout.shape))


def _no_grid(part: str, world: int) -> str:
    return (f"the registered DTensors lie on the mesh {part}, part of the job's {world} ranks, and no group the "
            "script made completes it to a mesh of the whole job: ftrun cannot tell which ranks hold copies of "
            "each other's state (declare the whole mesh with job.mesh({...}, replicate=(...)))")
