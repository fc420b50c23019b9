"""Sharded state (DTensor) in a form that travels: each rank's local shard and what places it.

A DTensor holds a device mesh, which holds process groups: it cannot be sent to another rank or
written to a file as it is, and the receiving rank's mesh is its own (a TP peer's group is not
this rank's). So each DTensor of a state goes out as a plain dict (``SHARD``): the local tensor,
the global shape and stride, and the placements as text. It is readable by ``torch.load(...,
weights_only=True)`` and by the snapshot format. Coming back, each one is made a DTensor again
on the receiving rank's own mesh, taken from the object the state is loaded into: the model's
own parameters and buffers, and for an optimizer the parameter each state entry belongs to.
"""

from __future__ import annotations

from typing import Any

import torch

#: the key that marks a dict as one rank's shard of a DTensor
SHARD = "__ftrun_dtensor_shard__"


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        return None
    return DTensor


def is_dtensor(value: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(value, kind)


def local_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def to_local(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard and its placement (see the module)."""
    if is_dtensor(value):
        return {SHARD: value.to_local(), "shape": list(value.shape), "stride": list(value.stride()),
                "placements": [str(p) for p in value.placements]}
    if isinstance(value, dict):
        out = {k: to_local(v) for k, v in value.items()}
        return out if type(value) is dict else type(value)(out)
    if isinstance(value, (list, tuple)):
        return type(value)(to_local(v) for v in value)
    return value


def has_shards(value: Any) -> bool:
    if isinstance(value, dict):
        return SHARD in value or any(has_shards(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_shards(v) for v in value)
    return False


def from_local(value: Any, template: Any) -> Any:
    """``value`` with every shard made a DTensor again after the DTensor at the same place in
    ``template`` (its mesh and placements); a shard with no DTensor there is an error."""
    if isinstance(value, dict) and SHARD in value:
        if not is_dtensor(template):
            raise ValueError("a sharded tensor has no DTensor to take its mesh from on this rank")
        from torch.distributed.tensor import DTensor

        if [str(p) for p in template.placements] != value["placements"]:
            raise ValueError(f"placements differ: {value['placements']} sent, {list(map(str, template.placements))} here")
        local = value[SHARD].to(template.to_local().device)
        return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                                  shape=torch.Size(value["shape"]), stride=tuple(value["stride"]))
    if isinstance(value, dict):
        mapping = template if isinstance(template, dict) else {}
        out = {k: from_local(v, mapping.get(k)) for k, v in value.items()}
        return out if type(value) is dict else type(value)(out)
    if isinstance(value, (list, tuple)):
        items = template if isinstance(template, (list, tuple)) else ()
        return type(value)(from_local(v, items[i] if i < len(items) else None) for i, v in enumerate(value))
    return value


def template_of(obj: Any) -> Any:
    """Where ``obj``'s state finds its meshes: its current state, and for an optimizer each state
    entry's parameter (an optimizer that has not stepped yet has no state of its own)."""
    if isinstance(obj, torch.optim.Optimizer):
        params = [p for group in obj.param_groups for p in group["params"]]
        return {"state": {i: _like(param) for i, param in enumerate(params)}}
    return obj.state_dict()


class _like(dict):
    """Every key of an optimizer's state entry maps to the parameter (its moments are shaped as it)."""

    def __init__(self, param):
        super().__init__()
        self.param = param

    def get(self, key, default=None):
        return self.param


def load_local(obj: Any, state: Any) -> None:
    """``obj.load_state_dict(state)``, with shards made DTensors again first where there are any."""
    if has_shards(state):
        state = from_local(state, template_of(obj))
    obj.load_state_dict(state)
