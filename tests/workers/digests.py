"""A bit-for-bit digest of training state, shared by the test workers."""

import hashlib

import torch

from ftrun.elastic.shards import to_local


def digest(*states) -> str:
    """A hash of every tensor's bytes in the states, local shards for DTensors, in key order."""
    h = hashlib.sha256()

    def walk(value, where):
        if isinstance(value, torch.Tensor):
            h.update(where.encode())
            h.update(value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key], f"{where}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}/{i}")

    for state in states:
        walk(to_local(state), "")
    return h.hexdigest()
