"""What ftrun's integrations of frameworks' own training loops share (``hf.py``, ``lightning.py``).

The job is joined as the integration is imported, under ftrun: the frameworks form torch's process group while
the script sets them up (transformers' ``TrainingArguments``, Lightning's strategy), from ``MASTER_ADDR``, which
a replacement rank cannot do while its peers train; ``ftrun.elastic.init()`` must come first, and the frameworks
take the group they find. Each integration reruns part of the framework's loop from the consistent step, so the
RNG states travel with the state (as the frameworks' own checkpoints keep them).
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

import ftrun.elastic
from ftrun.contract import WorkerEnv
from ftrun.elastic.job import ElasticJob
from ftrun.errors import WORKER_SETTING_EXIT

_joined: list[ElasticJob] = []


def join() -> ElasticJob | None:
    """This process's job: under ftrun, joined now (once) unless torch's process group came first; else None."""
    if not _joined and WorkerEnv.from_environ() is not None and not dist.is_initialized():
        _joined.append(ftrun.elastic.init())
    return _joined[0] if _joined else None


def refuse_too_late(module: str, maker: str) -> None:
    """Under ftrun, with no job joined (the framework formed the process group before ``module`` was imported):
    one line, and an exit that tells the controller not to restart (every restart would fail alike)."""
    if WorkerEnv.from_environ() is not None:
        refuse(module, f"import {module} before making {maker}: it forms torch's process group, which ftrun "
                       "must form first for a replacement rank to join its peers")


def refuse(module: str, line: str) -> NoReturn:
    print(f"{module}: {line}", file=sys.stderr, flush=True)
    sys.exit(WORKER_SETTING_EXIT)


def wrap(owner: Any, name: str, wrapper: Callable) -> None:
    """``owner.name(...)`` becomes ``wrapper(original, ...)``, on this instance alone."""
    original = getattr(owner, name)

    def call(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    call.__name__ = name
    setattr(owner, name, call)


def rng_states() -> dict[str, Any]:
    """Every RNG state the frameworks' own checkpoints keep: python's, numpy's, torch's, CUDA's."""
    numpy_state: Any = np.random.get_state()
    kind, keys, position, has_gauss, gauss = numpy_state
    states: dict[str, Any] = {"python": random.getstate(),
                              "numpy": (kind, torch.from_numpy(keys.copy()), position, has_gauss, gauss),
                              "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, gauss))
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
