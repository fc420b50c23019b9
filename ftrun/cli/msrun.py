"""msrun's flags, mapped onto ftrun's, so that replacing ``msrun`` by ``ftrun`` in a launch script is the
whole migration.

``--master_addr``, ``--master_port``, ``--node_rank`` and ``--log_dir`` are ftrun's own flags already (every
flag takes both spellings). The others are read here: ``--worker_num`` and ``--local_worker_num`` become
``--nnodes`` and ``--nproc-per-node`` (with msrun's defaults, 8 and 8, once either is given),
``--cluster_time_out`` the cluster's MS_TOPO_TIMEOUT, ``--bind_core True`` ``--numa-binding exclusive``, and
``--join`` is accepted (ftrun always stays with its job: it must, to recover it). Any of them implies
``--framework mindspore``, and ``--master_port`` then defaults to msrun's 8118. Several nodes without
``--node_rank`` meet at ``--master_addr:--master_port`` as ftrun's c10d rendezvous (node ranks in the order
the nodes join, as msrun numbers them then). A combination that contradicts itself is one line and
exit code 2.
"""

from __future__ import annotations

from typing import Any

from ftrun.config import LaunchConfig
from ftrun.errors import UsageError
from ftrun.mindspore import detect_framework

#: msrun's defaults (mindspore/parallel/cluster/run.py) for --worker_num and --local_worker_num
MSRUN_WORKER_NUM = 8
#: msrun's --master_port default, taken by a launch that uses msrun's flags (firewalls opened for msrun fit)
MSRUN_MASTER_PORT = 8118
#: the option names (as click stores them) that only msrun has
MSRUN_ONLY = ("worker_num", "local_worker_num", "join", "cluster_time_out", "bind_core")
#: how --bind_core True binds: each worker to CPUs near its device, no two sharing one (msrun's automatic mode)
BIND_CORE_MODE = "exclusive"


def translate(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` (the merged options) with msrun's flags turned into ftrun's; the notes to print."""
    given = set(values.get("given") or ())
    used = [name for name in MSRUN_ONLY if name in given]
    if not used:
        return values, []
    values = dict(values)
    flags = ", ".join(f"--{name}" for name in used)
    if "framework" in given and values.get("framework") != "mindspore":
        one = len(used) == 1
        raise UsageError(f"{flags} {'is' if one else 'are'} msrun's, for a MindSpore job: {'it does' if one else 'they do'} "
                         f"not go with --framework {values.get('framework')}")
    values["framework"] = "mindspore"
    if "master_port" not in given:
        values["master_port"] = MSRUN_MASTER_PORT
        given.add("master_port")
    notes: list[str] = []
    if "worker_num" in given or "local_worker_num" in given:
        _place_workers(values, given)
    if "join" in given and not _truth(values["join"], "--join"):
        notes.append("--join False: ftrun stays with the job anyway (it watches it to recover it)")
    if "cluster_time_out" in given:
        values["cluster_timeout"] = _whole(values["cluster_time_out"], "--cluster_time_out", minimum=None)
    if "bind_core" in given:
        _bind_core(values, given)
    values["given"] = frozenset(given | {"framework"})
    return values, notes


def _place_workers(values: dict[str, Any], given: set[str]) -> None:
    """--worker_num N --local_worker_num L: L ranks on each of N / L nodes, as msrun counts them."""
    total = _whole(values.get("worker_num") if "worker_num" in given else MSRUN_WORKER_NUM, "--worker_num")
    local = _whole(values.get("local_worker_num") if "local_worker_num" in given else MSRUN_WORKER_NUM,
                   "--local_worker_num")
    if local > total:
        raise UsageError(f"--local_worker_num {local} is more than --worker_num {total}")
    if total % local:
        raise UsageError(f"--worker_num {total} is not a multiple of --local_worker_num {local}: every node "
                         "runs the same number of workers")
    nodes = total // local
    for name, flag, value in (("nproc_per_node", "--nproc-per-node", local), ("nnodes", "--nnodes", nodes)):
        if name in given and str(values[name]).strip() != str(value):
            raise UsageError(f"{flag} {values[name]} contradicts --worker_num {total} --local_worker_num {local} "
                             f"({flag} {value}): give one of them")
        values[name] = str(value)
    given.update(("nproc_per_node", "nnodes"))
    if nodes > 1 and not {"node_rank", "rdzv_endpoint", "hostfile"} & given:
        # msrun without --node_rank numbers the nodes as they come: ftrun's rendezvous at the same address
        values["rdzv_endpoint"] = f"{values.get('master_addr') or '127.0.0.1'}:{values.get('master_port')}"
        given.add("rdzv_endpoint")


def _bind_core(values: dict[str, Any], given: set[str]) -> None:
    text = str(values["bind_core"]).strip()
    if text.startswith("{"):
        raise UsageError("--bind_core with a core map is msrun's own: ftrun binds each worker to the CPUs near "
                         "its device (--numa-binding node, socket, exclusive or core-complex)")
    if not _truth(text, "--bind_core"):
        return
    if "numa_binding" in given and values.get("numa_binding") != BIND_CORE_MODE:
        raise UsageError(f"--bind_core True binds as --numa-binding {BIND_CORE_MODE}: it contradicts "
                         f"--numa-binding {values.get('numa_binding')}")
    values["numa_binding"] = BIND_CORE_MODE
    given.add("numa_binding")


def _truth(value: Any, flag: str) -> bool:
    """msrun's booleans: Python's True or False (it reads them with ast.literal_eval)."""
    text = str(value).strip()
    if text not in ("True", "False", "true", "false", "1", "0"):
        raise UsageError(f"{flag} must be True or False, got '{value}'")
    return text in ("True", "true", "1")


def _whole(value: Any, flag: str, minimum: int | None = 1) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UsageError(f"{flag} must be a whole number, got '{value}'") from None
    if minimum is not None and number < minimum:
        raise UsageError(f"{flag} must be at least {minimum}, got {number}")
    return number


def framework_notes(values: dict[str, Any], config: LaunchConfig) -> list[str]:
    """One line each for what ftrun decided about a MindSpore job that the user did not say."""
    if config.framework != "mindspore":
        return []
    notes = []
    if "framework" not in (values.get("given") or ()):
        notes.append(f"{config.script} imports mindspore: launched as msrun launches it (--framework mindspore)")
    if values.get("recovery") == "process" and config.recovery != "process":
        notes.append("--recovery process needs Ascend NPUs for a MindSpore job (its CPU and GPU builds cannot "
                     "rebuild communication in a running process): a fault restarts the scheduler and every "
                     "worker (job level)")
    return notes


def refuse_head_node(values: dict[str, Any]) -> None:
    """A head node (--hostfile) hosts the worker store but runs no agent to start the scheduler beside it."""
    framework = values.get("framework") or detect_framework(str(values.get("script") or ""))
    if framework == "mindspore":
        raise UsageError("--framework mindspore does not run from a head node (--hostfile) yet: start one ftrun per "
                         "node with --rdzv-endpoint (or msrun's --master_addr, --master_port, --node_rank)")
