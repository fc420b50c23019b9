"""What ftrun's integrations of frameworks' own training loops share (``hf.py``, ``lightning.py``).

The job is joined as the integration is imported, under ftrun: the frameworks form torch's process group while
the script sets them up (transformers' ``TrainingArguments``, Lightning's strategy), from ``MASTER_ADDR``, which
a replacement rank cannot do while its peers train; ``ftrun.elastic.init()`` must come first, and the frameworks
take the group they find (under ``--recovery process`` ftrun imports the integration for the script as it makes
its Trainer: ``ftrun/trainer_hooks.py``). Each integration reruns part of the framework's loop from the consistent step, so the
RNG states travel with the state (as the frameworks' own checkpoints keep them).
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import ftrun.elastic
from ftrun.contract import WorkerEnv
from ftrun.elastic.job import ElasticJob

_joined: list[ElasticJob] = []


def join() -> ElasticJob | None:
    """This process's job: under ftrun, joined now (once) unless torch's process group came first; else None."""
    if not _joined and WorkerEnv.from_environ() is not None and not dist.is_initialized():
        _joined.append(ftrun.elastic.init())
    return _joined[0] if _joined else None


def refuse_too_late(module: str, maker: str) -> None:
    """Under ftrun, with no job joined (torch's process group was formed before ``module`` was imported, or
    before ``maker``): the job trains on, and a fault restarts it (job level); one line says why."""
    say_job_level(f"torch's process group was formed before {module} could form it (import it before making "
                  f"{maker}, or leave it to ftrun --recovery process: docs/integrations.md)")


#: the line :func:`say_job_level` said, once per process
_said: list[str] = []


def say_job_level(why: str) -> None:
    """Under ``ftrun --recovery process``: what the integration does not cover, in one line from rank 0, once per
    process; the job trains on, and a fault restarts it. A rank that joined the job tells the controller too
    (``ElasticJob.refuse_process_level``), which then goes to job level at once."""
    if _joined:
        _joined[0].refuse_process_level(why)
        return
    env = WorkerEnv.from_environ()
    if env is None or env.recovery != "process" or _said:
        return
    _said.append(why)
    if env.rank == 0:
        print(f"ftrun.elastic: {why}; a fault will restart the job", file=sys.stderr, flush=True)


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
