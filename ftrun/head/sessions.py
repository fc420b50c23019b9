"""A head node's ssh side, under either store: the command line each host runs, one ssh session per host
with its output on the head's console, how the sessions end, and what the head's run comes to.

The head starts one agent per host with ``ssh`` (no TTY, BatchMode, the user's ssh config honoured); the
job's secret goes on the session's input, never on a command line. Under the c10d store
(``ftrun.head.c10d``) the agent is the session's own process; under etcd (``ftrun.head.etcd``) the session
runs the host's keeper (``ftrun.head.session_keeper``), and the agent outlives it.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence, cast

from ftrun.agent.output import STDERR, STDOUT, ConsoleStream, StreamPump
from ftrun.config import LaunchConfig
from ftrun.errors import ExitCode, UsageError
from ftrun.head.hosts import Host
from ftrun.head.session_keeper import stop_request
from ftrun.orphans import die_with_parent

if TYPE_CHECKING:  # an outcome carries the c10d head's controller; the etcd head never loads one
    from ftrun.controller.controller import Controller

#: environment variables every remote agent gets from the head, besides --env. torch_npu names its HCCL
#: knobs TORCH_HCCL_*, MindSpore's process-level recovery reads MS_ENABLE_TFT, and torch_npu's UCE check
#: refuses to run with PYTORCH_NO_NPU_MEMORY_CACHING=1, so each node must see the value set here.
FORWARDED_ENV = ("NCCL_*", "HCCL_*", "TORCH_HCCL_*", "ASCEND_*", "GLOO_*", "MS_ENABLE_TFT",
                 "PYTORCH_NO_NPU_MEMORY_CACHING", "PYTHONPATH", "FTRUN_LOG_LEVEL")
SSH_CONNECT_TIMEOUT = 10
#: after the job ended, how long the ssh sessions get to finish before they are ended
SESSION_GRACE = 15.0
#: ssh's own exit code when it could not connect or authenticate
SSH_FAILED = 255
WATCH_INTERVAL = 0.05


@dataclass(frozen=True)
class SshOptions:
    port: int | None = None
    #: ``Name=Value`` pairs given with -o, before ftrun's own (ssh takes the first value it reads)
    options: tuple[str, ...] = ()
    #: the program; tests and odd setups may point elsewhere
    program: str = "ssh"


@dataclass(frozen=True)
class RemoteSpec:
    """How each host starts its agent: everything but the per-host flags."""

    python: str
    cwd: str
    env: tuple[tuple[str, str], ...]
    #: the agent flags shared by every host (forwarded from the head's own)
    flags: tuple[str, ...]
    #: the script (or module/program) and its arguments
    command: tuple[str, ...]
    #: the ftrun command the host runs (``probe``); none: the launch's agent
    subcommand: tuple[str, ...] = ()


@dataclass(frozen=True)
class RemoteAgent:
    host: Host
    #: -1 for a spare
    node_rank: int
    argv: tuple[str, ...]
    #: its --nproc-per-node, and its --devices when the hostfile picked some of the host's devices
    nproc: str
    devices: tuple[int, ...] = ()

    @property
    def role(self) -> str:
        return f"node {self.node_rank}" if self.node_rank >= 0 else "spare"


def forwarded_env(environ: Mapping[str, str], requested: tuple[str, ...] | list[str]) -> tuple[tuple[str, str], ...]:
    """The variables the agents get: the default patterns, then ``--env NAME`` / ``--env NAME=VALUE``."""
    chosen = {k: v for k, v in environ.items() if any(fnmatch.fnmatchcase(k, p) for p in FORWARDED_ENV)}
    for item in requested:
        name, sep, value = str(item).partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
            raise UsageError(f"--env: '{item}' is not NAME or NAME=VALUE")
        if sep:
            chosen[name] = value
        elif name in environ:
            chosen[name] = environ[name]
        else:
            raise UsageError(f"--env {name}: {name} is not set here (give --env {name}=VALUE)")
    return tuple(sorted(chosen.items()))


def remote_command(spec: RemoteSpec, host_flags: list[str]) -> str:
    """The shell command line a host runs: every word quoted for a POSIX shell."""
    argv = [spec.python, "-u", "-m", "ftrun", *spec.subcommand, "--ssh-agent", *host_flags, *spec.flags, *spec.command]
    env = [f"{name}={value}" for name, value in spec.env]
    run = ["exec", *(["env", *env] if env else []), *argv]
    return f"cd {shlex.quote(spec.cwd)} && {shlex.join(run)}"


def ssh_argv(host: Host, command: str, ssh: SshOptions) -> tuple[str, ...]:
    argv = [ssh.program, "-T"]
    for option in ssh.options:
        argv += ["-o", option]
    argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT}"]
    if ssh.port:
        argv += ["-p", str(ssh.port)]
    return (*argv, host.name, command)


def plan_agents(hosts: list[Host], spec: RemoteSpec, ssh: SshOptions, rendezvous: Sequence[str],
                nnodes: str, nproc: str | None, spares: Sequence[Host] = ()) -> list[RemoteAgent]:
    """One agent per host, node ranks in hostfile order, then the spares (node rank -1: they stand by).
    ``rendezvous``: the flags that say where the agents gather (--rdzv-endpoint, --run-id, --rdzv-backend).

    ``nproc`` None: each host runs as many ranks as the hostfile gives it devices (else --nproc-per-node's
    default, LaunchConfig's).
    """
    agents = []
    for rank, host in enumerate([*hosts, *spares]):
        node_rank = rank if rank < len(hosts) else -1
        flags = ["--nnodes", nnodes, "--spares", str(len(spares)), "--node-rank", str(node_rank),
                 *rendezvous, "--local-addr", host.address]
        count, devices = nproc or str(LaunchConfig.nproc_per_node), cast(tuple[int, ...], ())
        if nproc is None and host.devices is not None:
            count = str(len(host.devices))
            devices = host.devices if host.devices != tuple(range(len(host.devices))) else ()
        flags += ["--nproc-per-node", count]
        if devices:
            flags += ["--devices", ",".join(map(str, devices))]
        agents.append(RemoteAgent(host, node_rank, ssh_argv(host, remote_command(spec, flags), ssh), count, devices))
    return agents


class Session:
    """One host's ssh process, its output on the head's console (and in a log file), how it ended."""

    def __init__(self, agent: RemoteAgent, log_dir: str, console_filter: bytes, token: bytes | None,
                 collect: list[str] | None = None, what: str = "the agent"):
        """``log_dir``: where the head keeps each host's output ("": nowhere, as under etcd, where each
        host keeps its own); ``console_filter``: only lines holding it reach the console; ``token``: the
        job's secret, the session's first line of input (None: the host reads none); ``collect``: the host's
        stdout goes into this list instead of the console (``ftrun probe``'s JSON); ``what`` the host runs,
        as the messages name it."""
        self.agent = agent
        self.what = what
        self.handled = False
        paths = {name: os.path.join(log_dir, f"{agent.host.address}.{name}.log") if log_dir else None
                 for name in ("stdout", "stderr")}
        self.proc = subprocess.Popen(
            agent.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=die_with_parent,
        )
        try:  # the job's secret, on the session's input: never on a command line
            if token is not None:
                self.proc.stdin.write(token + b"\n")
                self.proc.stdin.flush()
        except OSError:
            pass  # ssh is gone already: why() will say why
        prefix = f"{agent.host.address}: ".encode()
        self.out = StreamPump(self.proc.stdout, f"ftrun-ssh-out-{agent.node_rank}",
                              None if collect is not None else ConsoleStream(STDOUT), prefix, paths["stdout"],
                              console_filter, capture=collect)
        self.err = StreamPump(self.proc.stderr, f"ftrun-ssh-err-{agent.node_rank}", ConsoleStream(STDERR), prefix,
                              paths["stderr"], console_filter)

    @property
    def host(self) -> str:
        return self.agent.host.name

    def why(self) -> str:
        """How the session ended, in the words of ssh or the remote agent."""
        self.err.drain(2.0)
        self.out.drain(0.5)
        lines = [line.strip() for line in self.err.tail if line.strip()]
        errors = [line for line in lines if "error" in line.lower()]
        said = (errors or lines or ["no output"])[-1]
        code = self.proc.returncode
        if code == SSH_FAILED:
            return f"cannot start {self.what} on {self.host} over ssh: {said}"
        return f"{self.what} on {self.host} exited with code {code}: {said}"

    def ask_to_stop(self, signum: int) -> None:
        """etcd: ask the host's session keeper to send its agent ``signum`` (the job stops as on it)."""
        try:
            self.proc.stdin.write(stop_request(signum))
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the session is gone: the other agents tell the controller

    def close_input(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def end(self, deadline: float) -> None:
        """Close the session's input (the agent stops), then end ssh if it has not gone by ``deadline``."""
        self.close_input()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                return
            except subprocess.TimeoutExpired:
                self.proc.send_signal(sig)
                deadline = time.monotonic() + 2.0
        self.proc.wait()


@dataclass(frozen=True)
class HeadOutcome:
    exit_code: int
    reason: str
    controller: Controller | None
    #: etcd: the job runs on without this head's ssh sessions (a head started again for a running job, or
    #: one whose sessions were all cut): the CLI follows it through etcd, as ``ftrun status --watch`` does
    following: bool = False
    config: LaunchConfig | None = None


def end_sessions(sessions: list[Session], wait: float) -> None:
    """Give the sessions ``wait`` seconds to end by themselves, then close their input (under c10d their
    agents stop) and end ssh where it lingers; their output copied to the last line."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(s.proc.poll() is None for s in sessions):
        time.sleep(WATCH_INTERVAL)
    for session in sessions:
        session.close_input()
    deadline = time.monotonic() + SESSION_GRACE
    for session in sessions:
        session.end(deadline)
    for session in sessions:
        session.out.drain(1.0)
        session.err.drain(1.0)


def agent_exit_code(code: int) -> ExitCode:
    """Why the job could not start, from the exit code of an agent's session that ended before the
    rendezvous: the agent's own where it is one of ftrun's, else the rendezvous's (ssh could not connect,
    a missing Python, a shell error)."""
    return ExitCode(code) if code in {c.value for c in ExitCode} and code != ExitCode.OK else ExitCode.RENDEZVOUS
