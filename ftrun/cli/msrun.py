"""msrun's flags, mapped onto ftrun's, so that replacing ``msrun`` by ``ftrun`` in a launch script is the
whole migration.

``--master_addr``, ``--master_port``, ``--node_rank`` and ``--log_dir`` are ftrun's own flags already (every
flag takes both spellings). The others are read here: ``--worker_num`` and ``--local_worker_num`` become
``--nnodes`` and ``--nproc-per-node`` (with msrun's defaults, 8 and 8, once either is given),
``--cluster_time_out`` the cluster's MS_TOPO_TIMEOUT, ``--bind_core True`` ``--numa-binding exclusive``,
``--bind_numa True`` ``--numa-binding node``, and ``--tail_worker_log`` (global ranks, as msrun compares them
with each worker's RANK_ID) this node's ``--local-ranks-filter``. ``--join`` and ``--worker_log_name`` are
accepted with a note: ftrun always stays with its job (it must, to recover it), and it names its log files
itself, one folder per node and per restart. Any of them implies ``--framework mindspore``, and
``--master_port`` then defaults to msrun's 8118. Several nodes without ``--node_rank`` meet at
``--master_addr:--master_port`` as ftrun's c10d rendezvous (node ranks in the order the nodes join, as msrun
numbers them then).

Refused, one line each: ``--rank_table_file`` (ftrun writes RANK_TABLE_FILE itself at every restart, from
where the ranks run then; a static table would be stale after a repair moves one) and ``--sim_level`` /
``--sim_rank_id`` (msrun's dry run compiles in one process with no cluster: there is nothing to launch or
recover, and the line gives the command that runs it). A combination that contradicts itself is one line
and exit code 2 too.
"""

from __future__ import annotations

import shlex
from typing import Any

from ftrun.config import LaunchConfig
from ftrun.errors import UsageError
from ftrun.mindspore import detect_framework

#: msrun's defaults (mindspore/parallel/cluster/run.py) for --worker_num and --local_worker_num
MSRUN_WORKER_NUM = 8
#: msrun's --master_port default, taken by a launch that uses msrun's flags (firewalls opened for msrun fit)
MSRUN_MASTER_PORT = 8118
#: the option names (as click stores them) that only msrun has
MSRUN_ONLY = ("worker_num", "local_worker_num", "join", "cluster_time_out", "bind_core", "bind_numa",
              "tail_worker_log", "worker_log_name", "rank_table_file", "sim_level", "sim_rank_id")
#: how --bind_core True binds: each worker to CPUs near its device, no two sharing one (msrun's automatic mode)
BIND_CORE_MODE = "exclusive"
#: how --bind_numa True binds: each worker to its device's NUMA node (msrun: numactl --cpunodebind N)
BIND_NUMA_MODE = "node"
#: --numa-binding modes that keep a worker on its device's NUMA node, so they satisfy --bind_numa True too
WITHIN_NUMA_NODE = ("node", "exclusive", "core-complex")
#: what msrun's flags with --log_dir copy into the log files, unless --tee or --redirects says otherwise: both
#: streams of every worker, as msrun writes each worker's log there (and the console shows it too)
MSRUN_STREAMS = "3"
#: --tail_worker_log's default: every worker's output reaches the console
TAIL_EVERY_WORKER = "-1"
#: msrun's flags ftrun cannot honour: why, and what to do instead
REFUSED = {
    "rank_table_file": "--rank_table_file: ftrun writes the HCCL rank table itself at every restart "
                       "(RANK_TABLE_FILE on Ascend) from where each rank runs then, and a static table goes stale "
                       "once a repair moves a rank to another node or device: drop the flag (--device-ips FILE "
                       "supplies device IPs where hccn_tool is missing)",
}


def translate(values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` (the merged options) with msrun's flags turned into ftrun's; the notes to print."""
    given = set(values.get("given") or ())
    used = [name for name in MSRUN_ONLY if name in given]
    if not used:
        return values, []
    _refuse(values, given)
    values = dict(values)
    flags = ", ".join(f"--{name}" for name in used)
    if "framework" in given and values.get("framework") != "mindspore":
        one = len(used) == 1
        raise UsageError(f"{flags} {'is' if one else 'are'} msrun's, for a MindSpore job: {'it does' if one else 'they do'} "
                         f"not go with --framework {values.get('framework')}")
    values["framework"] = "mindspore"
    if "master_port" not in given and not values.get("hostfile"):  # a hostfile places the job itself
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
    if "bind_numa" in given:
        _bind_numa(values, given)
    if "tail_worker_log" in given:
        notes += _tail_worker_log(values, given)
    if _text(values, "log_dir") and not {"tee", "redirects"} & given:
        # msrun writes every worker's output into LOG_DIR as well as to the console (--join)
        values["tee"] = MSRUN_STREAMS
        given.add("tee")
    if _text(values, "worker_log_name"):
        notes.append(f"--worker_log_name {values['worker_log_name']}: ftrun names the log files itself, one folder "
                     "per node and per restart (LOG_DIR/RUN_ID/node<N>/attempt_<G>/<RANK>/stdout.log), so nodes "
                     "sharing LOG_DIR need no {ip} or {hostname} to tell them apart")
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


def _refuse(values: dict[str, Any], given: set[str]) -> None:
    """msrun's flags that have no honest equivalent under ftrun: one line each, with what to do instead."""
    for name, text in REFUSED.items():
        if name in given and _text(values, name):  # msrun's default, "", asks for nothing
            raise UsageError(text)
    if "sim_level" in given or _text(values, "sim_rank_id") not in ("", "-1"):
        # msrun's dry run: MS_SIMULATION_LEVEL, no scheduler, no MS_ROLE, RANK_ID the simulated rank. One
        # process compiling without devices has no cluster to form and no fault to recover from.
        level = values.get("sim_level") if "sim_level" in given else "LEVEL"
        size = values.get("worker_num") if "worker_num" in given else MSRUN_WORKER_NUM
        one = _text(values, "sim_rank_id") not in ("", "-1")
        rank = values.get("sim_rank_id") if one else 0
        script = shlex.join(["python", str(values.get("script") or "SCRIPT"), *(values.get("script_args") or ())])
        flag = "--sim_level" if "sim_level" in given else "--sim_rank_id"
        every = "" if one else f" (msrun dry-runs every rank so: RANK_ID 0 to {int(size) - 1})"
        raise UsageError(f"{flag} is msrun's dry run, compiling without devices, with no cluster to launch or "
                         f"recover: run it without a launcher, MS_SIMULATION_LEVEL={level} RANK_SIZE={size} "
                         f"RANK_ID={rank} {script}{every}")


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


def _bind_numa(values: dict[str, Any], given: set[str]) -> None:
    """--bind_numa True: msrun runs each worker under ``numactl --cpunodebind N --membind N``, N its device's
    NUMA node. ftrun's node mode binds the same CPUs; memory then comes from that node by Linux's
    local-first policy rather than by a hard rule."""
    text = str(values["bind_numa"]).strip()
    if text.startswith("{") or text.lower().endswith(".json"):
        raise UsageError("--bind_numa with a NUMA map or a bind file is msrun's own: ftrun binds each worker to "
                         f"its device's NUMA node (--bind_numa True, as --numa-binding {BIND_NUMA_MODE}), or to "
                         "part of it (--numa-binding exclusive or core-complex)")
    if not _truth(text, "--bind_numa"):
        return
    if "numa_binding" in given:
        if values.get("numa_binding") not in WITHIN_NUMA_NODE:
            raise UsageError(f"--bind_numa True binds to the device's NUMA node: it contradicts --numa-binding "
                             f"{values.get('numa_binding')}")
        return  # --bind_core True's exclusive (or the user's mode) already keeps each worker on its node
    values["numa_binding"] = BIND_NUMA_MODE
    given.add("numa_binding")


def _tail_worker_log(values: dict[str, Any], given: set[str]) -> list[str]:
    """--tail_worker_log R,R: msrun tails the workers whose RANK_ID (the global rank) is listed; "-1" tails
    all. ftrun's filter counts local ranks, so the global ones are taken onto this node's."""
    text = str(values["tail_worker_log"]).strip()
    if text == TAIL_EVERY_WORKER:
        return []
    try:
        ranks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        ranks = [-1]
    if not ranks or ranks[0] < 0:
        raise UsageError(f"--tail_worker_log must be -1 (every worker) or comma-separated ranks, got '{text}'")
    if "local_ranks_filter" in given:
        raise UsageError("--tail_worker_log and --local-ranks-filter both choose whose output the console shows: "
                         "give one of them")
    node_rank = values.get("node_rank")
    if str(values.get("nnodes")).strip() == "1":
        node_rank, per_node = 0, max(ranks) + 1  # one node: global ranks are local ranks
    elif "node_rank" in given and isinstance(node_rank, int) and node_rank >= 0:
        per_node = _whole(values.get("nproc_per_node"), "--tail_worker_log with --nproc-per-node")
    else:
        raise UsageError("--tail_worker_log names global ranks, and a node without --node_rank learns which it runs "
                         "only at rendezvous: give --node_rank, or --local-ranks-filter with local ranks")
    first = node_rank * per_node
    local = frozenset(rank - first for rank in ranks if first <= rank < first + per_node)
    values["local_ranks_filter"] = local
    given.add("local_ranks_filter")
    if local:
        return []
    return [f"--tail_worker_log {text}: none of those ranks runs on node {node_rank} (ranks {first}-"
            f"{first + per_node - 1}): its workers' output stays off the console"]


def _text(values: dict[str, Any], name: str) -> str:
    return str(values.get(name) or "").strip()


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
    """A head node (--hostfile) under c10d hosts the worker store but runs no agent to start the scheduler
    beside it. Under etcd the controller, the worker store and the scheduler are an agent's, as in the direct
    launch."""
    if str(values.get("rdzv_backend") or "").startswith("etcd"):
        return
    framework = values.get("framework") or detect_framework(str(values.get("script") or ""))
    if framework == "mindspore":
        raise UsageError("--framework mindspore does not run from a head node (--hostfile) under the c10d store, "
                         "which the head hosts with no agent beside it to start the scheduler: give "
                         "--rdzv-backend etcd (the controller and the scheduler then run on a node), or start one "
                         "ftrun per node with --rdzv-endpoint")
