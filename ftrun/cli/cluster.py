"""Where the job runs: a head node's hostfile (agents over ssh), a Slurm allocation, or this node alone.

``--print-hosts`` and ``--dry-run`` show what ftrun derived and would run, without running it.
"""

from __future__ import annotations

import os
import shlex
import sys
import uuid
from dataclasses import replace

import click

from ftrun.cli.launch import agent_flags
from ftrun.config import LaunchConfig, build_launch_config, parse_nnodes, parse_rdzv_conf
from ftrun.errors import UsageError
from ftrun.head import Head, HeadOutcome, RemoteAgent, RemoteSpec, SshOptions, forwarded_env, plan_agents, store_endpoint
from ftrun.hosts import parse_hostfile, select_hosts
from ftrun.ports import parse_port_range
from ftrun.slurm import PLACEMENT_OPTIONS, slurm_plan

#: options that place the job themselves, which a hostfile does instead
NOT_WITH_HOSTFILE = ("standalone", "node_rank", "master_addr", "master_port", "rdzv_backend", "spares")


def apply_slurm(values: dict) -> dict:
    """Inside a Slurm allocation, with no placement given: nodes, node rank and store from SLURM_*."""
    given = values.get("given", frozenset())
    if values.get("hostfile") or any(name in given for name in PLACEMENT_OPTIONS):
        return values
    environ = dict(os.environ)
    if "master_port" in given:  # the flag wins over Slurm's variable
        environ["MASTER_PORT"] = str(values["master_port"])
    plan = slurm_plan(environ)
    if plan is None:
        return values
    return {**values, **{k: v for k, v in plan.options().items() if k not in given}, "slurm": plan}


def print_hosts(values: dict) -> int:
    if values.get("hostfile"):  # the script is not needed to show the hosts
        plan = ClusterPlan.from_values({**values, "script": values.get("script") or "-"}, None, check_script=False)
        lines = [f"store on {plan.config.endpoint} (this head node); run id {plan.config.run_id}"]
        lines += [f"  {agent.role:<6}  {agent.host.name}  {_ranks(agent)}" for agent in plan.agents]
    elif values.get("slurm"):
        lines = values["slurm"].describe()
    else:
        raise UsageError("--print-hosts needs --hostfile, or a Slurm allocation (SLURM_JOB_ID)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def dry_run(values: dict, command: click.Command) -> int:
    """The exact commands: one ssh line per host, or this node's worker command per local rank."""
    if values.get("hostfile"):
        plan = ClusterPlan.from_values(values, command)
        for agent in plan.agents:
            _write(f"# {agent.role}: {agent.host.name}, {_ranks(agent)}")
            _write(shlex.join(agent.argv))
        return 0
    config = build_launch_config(values)
    _write(f"# this node: {config.nproc_per_node} rank{'s' if config.nproc_per_node != 1 else ''}, "
           f"store {config.endpoint}, run id {config.run_id}; RANK and WORLD_SIZE come from the rendezvous")
    for local_rank in range(config.nproc_per_node):
        _write(f"LOCAL_RANK={local_rank} {shlex.join([*config.entrypoint, *config.script_args])}")
    return 0


def _write(line: str) -> None:
    """A line of a command as the system would pass it: arguments that came in as bytes that are not
    UTF-8 go out as the same bytes, whatever the terminal's encoding."""
    sys.stdout.flush()
    sys.stdout.buffer.write(os.fsencode(line) + b"\n")
    sys.stdout.buffer.flush()


def run_cluster(values: dict, command: click.Command) -> HeadOutcome:
    plan = ClusterPlan.from_values(values, command)
    head = Head(plan.config, plan.agents)
    head.install_signal_handlers()
    return head.run()


def _ranks(agent: RemoteAgent) -> str:
    devices = f" on devices {','.join(map(str, agent.devices))}" if agent.devices else ""
    return f"{agent.nproc} rank{'' if agent.nproc == '1' else 's'}{devices}"


class ClusterPlan:
    """A hostfile job, worked out on the head node: its hosts, store and each host's ssh command."""

    def __init__(self, config: LaunchConfig, agents: list[RemoteAgent]):
        self.config = config
        #: the nodes' agents in node-rank order, then the spares'
        self.agents = agents

    @classmethod
    def from_values(cls, values: dict, command: click.Command | None, check_script: bool = True) -> "ClusterPlan":
        given = values.get("given", frozenset())
        if str(values.get("rdzv_backend") or "").startswith("etcd"):
            raise UsageError("--rdzv-backend etcd cannot be used with --hostfile: in SSH mode the head node hosts "
                             "the controller, away from every worker node; to survive any node's loss, start "
                             "ftrun on each node with --rdzv-backend etcd instead")
        clash = [name for name in NOT_WITH_HOSTFILE if name in given]
        if clash:
            raise UsageError(f"--{clash[0].replace('_', '-')} cannot be used with --hostfile: the hostfile places "
                             "the job (node ranks in file order, the store on this head node)")
        path = values["hostfile"]
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read hostfile {path}: {getattr(e, 'strerror', None) or e}") from None
        hosts = select_hosts(parse_hostfile(text, f"hostfile {path}"), values.get("include") or "",
                             values.get("exclude") or "")
        runnable = [h for h in hosts if not h.spare]
        if not runnable:
            raise UsageError(f"hostfile {path} has no host to run on: every host left is a spare")
        if "nnodes" in given:
            min_nodes, max_nodes = parse_nnodes(str(values["nnodes"]))
            if max_nodes > len(runnable):
                raise UsageError(f"--nnodes {values['nnodes']} but the hostfile has {len(runnable)} host"
                                 f"{'s' if len(runnable) != 1 else ''} to run on")
            nnodes = str(values["nnodes"])
        else:
            max_nodes, nnodes = len(runnable), str(len(runnable))
        active = runnable[:max_nodes]
        spares = [h for h in hosts if h not in active]  # in file order
        endpoint = store_endpoint(active, str(values.get("rdzv_endpoint") or ""), str(values.get("rdzv_host") or ""),
                                  str(values.get("local_addr") or ""), parse_port_range(values.get("worker_port_range")))
        run_id = str(values.get("run_id") or "").strip() or uuid.uuid4().hex[:12]
        remote_cwd = str(values.get("remote_cwd") or "")
        head_values = {**values, "nnodes": nnodes, "node_rank": -1, "rdzv_endpoint": str(endpoint), "run_id": run_id,
                       "rdzv_backend": "c10d", "standalone": False}
        config = build_launch_config(head_values, check_script=check_script and not remote_cwd)
        config = replace(config, is_host=True, local_addr=endpoint.host, spares=len(spares))
        conf = parse_rdzv_conf(str(values.get("rdzv_conf") or "")) | {"is_host": "0"}
        ssh_port = values.get("ssh_port")
        if ssh_port is not None and not 0 < int(ssh_port) < 65536:
            raise UsageError(f"--ssh-port must be a port number (1-65535), got {ssh_port}")
        spec = RemoteSpec(
            python=str(values.get("remote_python") or sys.executable),
            cwd=remote_cwd or os.getcwd(),
            env=forwarded_env(os.environ, tuple(values.get("env") or ())),
            flags=(*(agent_flags(command, values) if command is not None else ()),
                   "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())),
            command=(str(values["script"]), *config.script_args),
        )
        ssh = SshOptions(port=ssh_port, options=tuple(_ssh_option(o) for o in values.get("ssh_option") or ()))
        nproc = str(values["nproc_per_node"]) if "nproc_per_node" in given else None
        agents = plan_agents(active, spec, ssh, endpoint, run_id, nnodes, nproc, spares)
        return cls(config, agents)


def _ssh_option(text: str) -> str:
    name, sep, value = str(text).partition("=")
    if not sep or not name.strip() or not name.strip().isalnum():
        raise UsageError(f"--ssh-option must be Name=Value (an ssh -o option), got '{text}'")
    return f"{name.strip()}={value}"
