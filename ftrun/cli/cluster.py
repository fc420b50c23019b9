"""Where the job runs: a head node's hostfile (agents over ssh), a Slurm allocation, or this node alone.

``--print-hosts`` and ``--dry-run`` show what ftrun derived and would run, without running it. A hostfile
job under --rdzv-backend etcd that runs on without its head (or runs already) is followed here
(:func:`follow_run`), as ``ftrun status --watch`` follows it.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
import uuid
from dataclasses import replace

import click

from ftrun.cli.console import say
from ftrun.cli.launch import agent_flags
from ftrun.config import ETCD_SPELLINGS, LaunchConfig, build_launch_config, parse_nnodes, parse_rdzv_conf
from ftrun.errors import ExitCode, RendezvousError, UsageError
from ftrun.head.c10d import Head, store_endpoint
from ftrun.head.hosts import Host, parse_hostfile, select_hosts
from ftrun.head.sessions import HeadOutcome, RemoteAgent, RemoteSpec, SshOptions, forwarded_env, plan_agents
from ftrun.head.slurm import PLACEMENT_OPTIONS, slurm_plan
from ftrun.ports import parse_port_range

#: options that place the job themselves, which a hostfile does instead
NOT_WITH_HOSTFILE = ("standalone", "node_rank", "master_addr", "master_port", "spares")


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
        if plan.config.etcd is not None:
            lines = [f"controller on the node etcd elects (etcd at {plan.config.etcd.describe()}); "
                     f"run id {plan.config.run_id}"]
        else:
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
    if plan.config.etcd is not None:
        from ftrun.head.etcd import EtcdHead

        head: Head | EtcdHead = EtcdHead(plan.config, plan.agents)
    else:
        head = Head(plan.config, plan.agents)
    head.install_signal_handlers()
    return head.run()


#: how long a head that follows a run waits for its status to be there (the nodes may still be gathering)
STATUS_DEADLINE_FLOOR = 30.0
#: how long it waits, once the status says the job ended, for the journal to say so with the exit code
JOURNAL_DEADLINE = 30.0


def follow_run(outcome: HeadOutcome) -> int:
    """A hostfile job under etcd that runs on without this head's sessions: its status until it ends (live
    on a terminal, else a line at each change of phase or controller), then its exit code, read from the
    controller's journal. Ctrl-C leaves it running."""
    from ftrun.cli.status import leave_without_teardown, watch_status
    from ftrun.etcd import EtcdClient, EtcdError
    from ftrun.head.etcd import is_over, wait_for_the_controller_to_leave, wait_for_the_end
    from ftrun.head.sessions import SESSION_GRACE
    from ftrun.keys import EtcdKeys
    from ftrun.store import StoreUnavailable

    config = outcome.config
    assert config is not None and config.etcd is not None
    client, keys = EtcdClient(config.etcd, deadline=10.0), EtcdKeys(config.run_id)
    left: list[int] = []  # Ctrl-C: this head leaves, the job goes on

    def leave(signum, frame):
        left.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        reader = _status_reader(config, client, max(config.rdzv_timeout, STATUS_DEADLINE_FLOOR))
        if reader is not None:  # live on a terminal, else in lines
            watch_status(reader, reader.read(), False, 1.0, lines=not out_is_terminal())
        decision = wait_for_the_end(client, keys, JOURNAL_DEADLINE)
        if is_over(decision):  # the job's exit code once its agents have left, as a head that launched it
            wait_for_the_controller_to_leave(client, keys, config.stop_timeout + SESSION_GRACE)
    except KeyboardInterrupt:
        left.append(signal.SIGINT)
        decision = None
    except (EtcdError, StoreUnavailable, RendezvousError) as e:
        say(f"ftrun: error: lost track of run {config.run_id}: {e}", style="bold red")
        leave_without_teardown(ExitCode.RENDEZVOUS)
    if left or not is_over(decision):
        say(f"ftrun: left run {config.run_id} running; this command again follows it, and `ftrun status "
            f"--rdzv-backend etcd --rdzv-endpoint {config.etcd.describe()} --run-id {config.run_id}` shows it")
        leave_without_teardown(ExitCode.INTERRUPTED)
    code, reason = decision.view.exit_code, decision.view.reason
    if code == ExitCode.OK:
        say(f"ftrun: run {config.run_id} ended: {reason or 'job succeeded'}", style="green")
    else:
        say(f"ftrun: run {config.run_id} stopped (exit code {code}): {reason}", style="bold red")
    leave_without_teardown(code)


def out_is_terminal() -> bool:
    from ftrun.cli.console import out

    return out.is_terminal


def _status_reader(config: LaunchConfig, client, deadline: float):
    """The job's status reader once its controller published a status; None when the job ended first."""
    from ftrun.cli.status import StatusReader, StoreFinder
    from ftrun.head.etcd import is_over, read_decision
    from ftrun.keys import EtcdKeys
    from ftrun.store import StoreUnavailable

    end = time.monotonic() + deadline
    while True:
        try:
            reader = StatusReader(StoreFinder(etcd=client, run_id=config.run_id), config.run_id, 10.0)
            reader.read()
            return reader
        except (RendezvousError, StoreUnavailable, RuntimeError) as e:
            if is_over(read_decision(client, EtcdKeys(config.run_id))):
                return None
            if time.monotonic() > end:
                raise RendezvousError(f"no status of run {config.run_id} within {deadline:g}s: {e}") from None
        time.sleep(1.0)


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
        backend = str(values.get("rdzv_backend") or "c10d")
        etcd = backend in ETCD_SPELLINGS
        if not etcd and backend != "c10d":
            raise UsageError(f"--rdzv-backend {backend} cannot be used with --hostfile: the hostfile places the job "
                             "(c10d: the store on this head node; etcd: the controller on the node etcd elects)")
        clash = [name for name in NOT_WITH_HOSTFILE if name in given]
        if clash:
            raise UsageError(f"--{clash[0].replace('_', '-')} cannot be used with --hostfile: the hostfile places "
                             "the job (node ranks in file order, the store on this head node)")
        path = values["hostfile"]
        hosts = read_hosts(values)
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
        run_id = str(values.get("run_id") or "").strip() or uuid.uuid4().hex[:12]
        remote_cwd = str(values.get("remote_cwd") or "")
        conf = parse_rdzv_conf(str(values.get("rdzv_conf") or ""))
        head_values = {**values, "nnodes": nnodes, "node_rank": -1, "run_id": run_id, "standalone": False}
        if etcd:  # the agents gather in etcd (its members, --rdzv-endpoint); one of them hosts the store
            if values.get("rdzv_host"):
                raise UsageError("--rdzv-host names where the hosts reach this head node's store, and under "
                                 "--rdzv-backend etcd the store is an agent's: drop it")
            config = build_launch_config({**head_values, "rdzv_backend": "etcd"},
                                         check_script=check_script and not remote_cwd)
            config = replace(config, spares=len(spares))
            rendezvous = ["--rdzv-backend", "etcd", "--rdzv-endpoint", config.etcd.describe(), "--run-id", run_id]
            if values.get("store_bind"):
                rendezvous += ["--store-bind", str(values["store_bind"])]
            # the controller's agent writes to a file: its progress in lines
            rendezvous += ["--status", "off" if values.get("status") == "off" else "plain"]
        else:
            endpoint = store_endpoint(active, str(values.get("rdzv_endpoint") or ""), str(values.get("rdzv_host") or ""),
                                      str(values.get("local_addr") or ""), parse_port_range(values.get("worker_port_range")))
            config = build_launch_config({**head_values, "rdzv_endpoint": str(endpoint), "rdzv_backend": "c10d"},
                                         check_script=check_script and not remote_cwd)
            config = replace(config, is_host=True, local_addr=endpoint.host, spares=len(spares))
            rendezvous = ["--rdzv-endpoint", str(endpoint), "--run-id", run_id]
            conf |= {"is_host": "0"}
        flags = (*(agent_flags(command, values) if command is not None else ()),
                 *(("--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())) if conf else ()))
        spec = remote_spec(values, flags, (str(values["script"]), *config.script_args))
        ssh = ssh_options(values)
        nproc = str(values["nproc_per_node"]) if "nproc_per_node" in given else None
        agents = plan_agents(active, spec, ssh, rendezvous, nnodes, nproc, spares)
        return cls(config, agents)


def read_hosts(values: dict) -> list[Host]:
    """The hostfile's hosts left after --include/--exclude; a file that cannot be read, or a bad line, is a
    UsageError naming the file (and the line)."""
    path = values["hostfile"]
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read hostfile {path}: {getattr(e, 'strerror', None) or e}") from None
    return select_hosts(parse_hostfile(text, f"hostfile {path}"), values.get("include") or "",
                        values.get("exclude") or "")


def remote_spec(values: dict, flags: tuple[str, ...], command: tuple[str, ...],
                subcommand: tuple[str, ...] = ()) -> RemoteSpec:
    """What every host runs, from the head's --remote-python, --remote-cwd and --env: ``subcommand``
    (``probe``, or none for the launch's agent), the shared ``flags``, then ``command``."""
    return RemoteSpec(python=str(values.get("remote_python") or sys.executable),
                      cwd=str(values.get("remote_cwd") or "") or os.getcwd(),
                      env=forwarded_env(os.environ, tuple(values.get("env") or ())),
                      flags=flags, command=command, subcommand=subcommand)


def ssh_options(values: dict) -> SshOptions:
    """The head's --ssh-port and --ssh-option, checked."""
    ssh_port = values.get("ssh_port")
    if ssh_port is not None and not 0 < int(ssh_port) < 65536:
        raise UsageError(f"--ssh-port must be a port number (1-65535), got {ssh_port}")
    return SshOptions(port=ssh_port, options=tuple(_ssh_option(o) for o in values.get("ssh_option") or ()))


def _ssh_option(text: str) -> str:
    name, sep, value = str(text).partition("=")
    if not sep or not name.strip() or not name.strip().isalnum():
        raise UsageError(f"--ssh-option must be Name=Value (an ssh -o option), got '{text}'")
    return f"{name.strip()}={value}"
