"""Inside a Slurm allocation: the job's nodes, this node's rank and the store's address, from SLURM_*.

``srun --ntasks-per-node=1 ftrun train.py`` starts one agent per node; each finds the
others here, without ``scontrol``. The first node of the step hosts the store.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Mapping

from ftrun.config import DEFAULT_RDZV_PORT, Endpoint
from ftrun.errors import UsageError
from ftrun.head.hosts import check_host_name, expand_nodelist

#: options that, when given, mean the user placed the job themselves: Slurm's values are not used
PLACEMENT_OPTIONS = ("nnodes", "node_rank", "rdzv_endpoint", "master_addr", "standalone", "hostfile")
#: jobs and steps get ports spread over this many from the default one
PORT_SPREAD = 1000


@dataclass(frozen=True)
class SlurmPlan:
    job_id: str
    hosts: tuple[str, ...]
    node_rank: int
    endpoint: Endpoint
    run_id: str

    def options(self) -> dict[str, str | int]:
        """The launch options this plan sets."""
        return {"nnodes": str(len(self.hosts)), "node_rank": self.node_rank,
                "rdzv_endpoint": str(self.endpoint), "run_id": self.run_id}

    def describe(self) -> list[str]:
        lines = [f"Slurm job {self.job_id}: {len(self.hosts)} node{'s' if len(self.hosts) != 1 else ''}, "
                 f"this is node {self.node_rank}; store on {self.endpoint}; run id {self.run_id}"]
        lines += [f"  node {rank}  {host}" for rank, host in enumerate(self.hosts)]
        return lines


def slurm_plan(env: Mapping[str, str]) -> SlurmPlan | None:
    """What SLURM_* says about this job, or None outside an allocation."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UsageError("inside a Slurm allocation but SLURM_JOB_NODELIST is not set; run ftrun under srun")
    hosts = expand_nodelist(nodelist, "SLURM_JOB_NODELIST")
    for host in hosts:
        try:
            check_host_name(host)
        except UsageError as e:
            raise UsageError(f"SLURM_JOB_NODELIST: {e.message}") from None
    count = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if count and _whole(count, "SLURM_NNODES") != len(hosts):
        raise UsageError(f"SLURM_NNODES is {count} but the node list '{nodelist}' names {len(hosts)} nodes")
    node_rank = _whole(env.get("SLURM_NODEID", "0"), "SLURM_NODEID")
    if node_rank >= len(hosts):
        raise UsageError(f"SLURM_NODEID {node_rank} is out of range for {len(hosts)} nodes")
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE")
    if tasks and _most_tasks_on_a_node(tasks) > 1:
        raise UsageError(f"Slurm starts {tasks} tasks per node; ftrun is one agent per node that starts the "
                         "ranks itself: use srun --ntasks-per-node=1 and ftrun --nproc-per-node N")
    step = env.get("SLURM_STEP_ID", "")
    for name, value in (("SLURM_JOB_ID", job_id), ("SLURM_STEP_ID", step)):
        if value and not re.fullmatch(r"[A-Za-z0-9_.+-]+", value):  # ids go into store keys and the port
            raise UsageError(f"{name} must be a Slurm job or step id, got '{value}'")
    port = env.get("MASTER_PORT", "")
    if port:
        port_number = _whole(port, "MASTER_PORT")
        if not 0 < port_number < 65536:
            raise UsageError(f"MASTER_PORT must be a port number (1-65535), got {port}")
    else:
        port_number = derived_port(job_id, step)
    run_id = f"slurm-{job_id}" + (f".{step}" if step else "")
    return SlurmPlan(job_id, tuple(hosts), node_rank, Endpoint(hosts[0], port_number), run_id)


def derived_port(job_id: str, step: str) -> int:
    """The store's port without MASTER_PORT: the same on every node of a step, spread over
    ``PORT_SPREAD`` ports so that jobs and steps side by side on one first node do not share a store."""
    return DEFAULT_RDZV_PORT + zlib.crc32(f"{job_id}.{step}".encode()) % PORT_SPREAD


def _whole(text: str, name: str) -> int:
    if not re.fullmatch(r"[0-9]{1,18}", text.strip()):  # int() refuses 4300 digits and more
        raise UsageError(f"{name} must be a whole number, got '{text}'")
    return int(text)


def _most_tasks_on_a_node(text: str) -> int:
    """SLURM_TASKS_PER_NODE looks like ``2(x3),1``: the largest count on any node."""
    items = text.split(",")
    counts = [re.fullmatch(r"\s*([0-9]{1,18})(\(x[0-9]+\))?\s*", item) for item in items]
    if not all(counts):
        raise UsageError(f"SLURM_TASKS_PER_NODE must look like 1 or 2(x3),1, got '{text}'")
    return max(int(match.group(1)) for match in counts)
