"""MindSpore's launch contract, as msrun gives it: a scheduler process per generation and the ``MS_*``
variables of its dynamic cluster; which framework a script needs; which python runs its workers.

msrun (``mindspore/parallel/cluster/process_entity/_api.py`` in mindspore 2.10) starts the training
script once as the scheduler (``MS_ROLE=MS_SCHED``, ``RANK_ID=0``: its ``mindspore.communication.init()``
serves the cluster, and the process ends when the workers are done) and once per rank as a worker
(``MS_ROLE=MS_WORKER``, ``MS_NODE_ID`` and ``RANK_ID`` the rank, ``DEVICE_ID`` the device). Both get
``MS_WORKER_NUM``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``, ``MS_TOPO_TIMEOUT`` and ``RANK_SIZE``. Without them
``init()`` fails ("... without using 'mpirun' ...").

This module decides; it starts nothing (``agent/workers.py`` spawns the scheduler beside the workers). Its
``*_variables`` functions give MindSpore's part of a process's environment; the agent adds it to the whole
(``agent/workers.py``'s ``worker_env``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

#: --framework's values: the worker contract a job gets (torchrun's, or msrun's)
FRAMEWORKS = ("torch", "mindspore")
#: msrun's --cluster_time_out default: how long the dynamic cluster waits for its members (MS_TOPO_TIMEOUT)
DEFAULT_CLUSTER_TIMEOUT = 600
#: the scheduler's place in the job's messages (WorkerFailure.rank) and logs: it holds no rank
SCHEDULER_RANK = -1
#: what a worker's python may take to answer whether it can import mindspore (it only looks: find_spec)
INTERPRETER_CHECK_TIMEOUT = 30.0
#: the most of a script read to tell its framework: imports come first
DETECTION_BYTES = 1 << 20
_IMPORT = re.compile(r"^[ \t]*(?:import|from)[ \t]+(mindspore|torch)\b", re.MULTILINE)


@dataclass(frozen=True)
class Scheduler:
    """Where a generation's MindSpore scheduler listens (the controller picks a fresh port each
    generation, on the node that hosts the generation's worker store)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "Scheduler | None":
        """``host:port`` as a command carries it; None for "" (not a MindSpore job)."""
        if not text:
            return None
        host, _, port = text.rpartition(":")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def cluster_variables(scheduler: Scheduler, world_size: int, topo_timeout: int) -> dict[str, str]:
    """What the scheduler and every worker share: the cluster's size, its scheduler, how long it forms."""
    return {
        "MS_WORKER_NUM": str(world_size),
        "MS_SCHED_HOST": scheduler.host,
        "MS_SCHED_PORT": str(scheduler.port),
        "MS_TOPO_TIMEOUT": str(topo_timeout),
        "RANK_SIZE": str(world_size),
    }


def scheduler_variables(scheduler: Scheduler, world_size: int, topo_timeout: int) -> dict[str, str]:
    """The scheduler's variables (msrun's ``start_scheduler``: its RANK_ID is always 0)."""
    return cluster_variables(scheduler, world_size, topo_timeout) | {"MS_ROLE": "MS_SCHED", "RANK_ID": "0"}


def worker_variables(scheduler: Scheduler, world_size: int, topo_timeout: int, rank: int, device_index: int) -> dict[str, str]:
    """A worker's variables: ftrun always knows the global rank, so MS_NODE_ID and RANK_ID are set as
    msrun sets them with --node_rank (the cluster then numbers the ranks as ftrun does)."""
    return cluster_variables(scheduler, world_size, topo_timeout) | {
        "MS_ROLE": "MS_WORKER",
        "MS_NODE_ID": str(rank),
        "RANK_ID": str(rank),
        "DEVICE_ID": str(device_index),
    }


#: MindSpore's own fault tolerance, as MindCluster's jobs switch it on with ``MS_ENABLE_TFT``. UCE:1: the
#: runtime tags an on-chip memory error ("UCEError ...") and keeps its address, which
#: ``_get_uce_process_strategy`` reads. ARF:1: a step blocked when ``_stop_device`` runs fails instead of
#: hanging, and the HCCL watchdog, which would send SIGTERM to the worker's process group on a
#: communicator error, is off (``mindspore/utils/utils.py``, ``_parser_tft_and_thm_env``). HCCE:1: an HCCL
#: error in the step is tagged too ("HCCEError"), the error the online level repairs. Without TTP:1 and
#: without MindIO: ftrun plays MindIO's part, and nothing calls MindSpore's ``TftHandle.init``.
FAULT_TOLERANCE = "{UCE:1,HCCE:1,ARF:1}"


def recovery_variables(given: dict[str, str] | None = None) -> dict[str, str]:
    """Process level (Ascend), in the scheduler and every worker: the dynamic cluster's recovery, so that
    a replacement started under its predecessor's MS_NODE_ID rejoins the running scheduler (msrun sets
    the same for its own restarts: ``process_entity/_api.py``); and MindSpore's own fault tolerance
    (FAULT_TOLERANCE), which the repair's hooks need. An ``MS_ENABLE_TFT`` of the user's own, in
    ``given`` (the environment the workers inherit), is kept as it is."""
    fault_tolerance = (given or {}).get("MS_ENABLE_TFT", FAULT_TOLERANCE)
    return {"MS_ENABLE_RECOVERY": "1", "MS_ENABLE_TFT": fault_tolerance}


#: the lines a worker's python runs to say whether it can import mindspore (without importing it: 2 s)
_FINDS_MINDSPORE = "import importlib.util, sys; sys.exit(importlib.util.find_spec('mindspore') is None)"


def persister_command(entrypoint: tuple[str, ...]) -> tuple[str, ...]:
    """The persister of a MindSpore job (``ftrun.snapshots.persist``): run by the workers' python, which
    has mindspore, so that it writes the ranks' snapshots as ``.ckpt`` files."""
    python = entrypoint[0] if len(entrypoint) > 1 and entrypoint[1] == "-u" else sys.executable
    return (python, "-u", "-m", "ftrun.snapshots.persist", "mindspore")


def with_ftrun_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this ftrun first on PYTHONPATH: another python (the workers') imports the same ftrun."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root)]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def detect_framework(script: str) -> str | None:
    """The framework a script imports at its own top level, when that is certain: "mindspore" or "torch"
    when it imports one of them and not the other; "both" when it imports both; None when it imports
    neither (or cannot be read): its helpers may import anything, so nothing is guessed."""
    try:
        with open(script, "rb") as f:
            text = f.read(DETECTION_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    found = set(_IMPORT.findall(text))
    if len(found) == 2:
        return "both"
    return found.pop() if found else None


def finds_mindspore(python: str) -> bool:
    """Whether the interpreter ``python`` can import mindspore (it only looks for the package)."""
    try:
        done = subprocess.run([python, "-c", _FINDS_MINDSPORE], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=INTERPRETER_CHECK_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def worker_python(given: str, own: str) -> str:
    """The interpreter that runs a MindSpore job's workers and scheduler: ``given`` (--python) when set;
    else ftrun's own (``own``) when it can import mindspore; else ``python`` from PATH, as msrun runs
    them. "" when none of them can (the caller says so in one line)."""
    if given:
        return given if finds_mindspore(given) else ""
    if finds_mindspore(own):
        return own
    on_path = shutil.which("python") or shutil.which("python3")
    if on_path and os.path.realpath(on_path) != os.path.realpath(own) and finds_mindspore(on_path):
        return on_path
    return ""
