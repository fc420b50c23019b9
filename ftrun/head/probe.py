"""``ftrun probe --hostfile FILE``: the probe across the job's nodes (``ftrun.probe_nodes``), run once from a head
node rather than by hand on every node.

The head starts ``ftrun probe --nnodes N --rdzv-endpoint ... --json`` on each host over ssh, as the launch starts
its agents (``ftrun.head.sessions``: the same command line, the same ssh flags): the first host hosts the probe's
store (``is_host=1``), the others join it. Each host's JSON result comes back on its session's output, its
other lines on the head's console prefixed with the host. The head prints the table once (from the result of
the host that hosted the store) and every finding once, and exits with the worst of the hosts' exit codes.

A host whose probe ends without a result (ssh could not reach it, its Python is missing, a bad flag) leaves
the others waiting for a node that will never join: the head says why in one line and ends every session at
once. Each remote probe stops when its session's input ends (``--ssh-agent``: ``ftrun.orphans.on_session_end``),
so that a head that ends, is interrupted or dies leaves nothing running on any host.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from ftrun.config import DEFAULT_RDZV_PORT, parse_endpoint
from ftrun.contract import Endpoint
from ftrun.errors import ExitCode
from ftrun.head.hosts import Host
from ftrun.head.sessions import (
    WATCH_INTERVAL,
    RemoteAgent,
    RemoteSpec,
    Session,
    SshOptions,
    agent_exit_code,
    end_sessions,
    remote_command,
    ssh_argv,
)

#: what the messages call the program each host runs
WHAT = "ftrun probe"
#: worst first: a probe stopped, or one that could not run, says less than one that found a node unfit
SEVERITY = (ExitCode.TERMINATED, ExitCode.INTERRUPTED, ExitCode.USAGE, ExitCode.JOB_FAILED, ExitCode.RENDEZVOUS,
            ExitCode.DEVICE, ExitCode.OK)


@dataclass(frozen=True)
class HostProbe:
    """One host's probe as the head saw it end: its exit code, its ``--json`` result (None when it gave none)
    and, without one, why (ssh's or the probe's own words)."""

    host: str
    exit_code: int
    result: dict | None = None
    why: str = ""


def store_endpoint(hosts: Sequence[Host], rdzv_endpoint: str) -> Endpoint:
    """Where the probe's store is: ``--rdzv-endpoint`` (the first host's address as the others reach it), else
    the first host at the launch's default port."""
    if rdzv_endpoint:
        return parse_endpoint(rdzv_endpoint, DEFAULT_RDZV_PORT)
    return Endpoint(hosts[0].address, DEFAULT_RDZV_PORT)


def plan_probes(hosts: Sequence[Host], spec: RemoteSpec, ssh: SshOptions, endpoint: Endpoint,
                run_id: str) -> list[RemoteAgent]:
    """One probe per host, in hostfile order: the first hosts the store at ``endpoint``, every other joins it.
    ``spec.flags``: the head's own probe flags that every host gets (``--device``, ``--speed``, ...)."""
    probes = []
    for index, host in enumerate(hosts):
        flags = ["--nnodes", str(len(hosts)), "--rdzv-endpoint", str(endpoint), "--run-id", run_id,
                 "--rdzv-conf", f"is_host={1 if index == 0 else 0}", "--json"]
        probes.append(RemoteAgent(host, index, ssh_argv(host, remote_command(spec, flags), ssh), "1"))
    return probes


def read_result(lines: Iterable[str]) -> dict | None:
    """A host's ``--json`` result from its output's lines (the JSON object from its first line on), or None."""
    lines = list(lines)
    start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
    if start is None:
        return None
    try:
        found = json.loads("\n".join(lines[start:]))
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def host_probe(host: str, code: int, lines: Iterable[str], why: str) -> HostProbe:
    """How one host's probe ended: its result and exit code, or, with no result, the code that says why (a
    code of ftrun's own, else the rendezvous's: ssh could not connect, a missing Python)."""
    result = read_result(lines)
    if result is not None:
        return HostProbe(host, code, result)
    return HostProbe(host, int(agent_exit_code(code)), None, why)


def worst_exit_code(codes: Iterable[int]) -> int:
    """The exit code of the whole probe: the worst of the hosts' (SEVERITY; a code not in it is worst)."""
    return min(codes, key=lambda c: SEVERITY.index(c) if c in SEVERITY else -1, default=ExitCode.OK)


def findings(probes: Sequence[HostProbe]) -> list[str]:
    """Every host's findings once each, in the order the hosts said them (each node says the same verdict). A
    hostfile of one host runs no probe across nodes: its device problem, if any, is its finding."""
    seen: dict[str, None] = {}
    for probe in probes:
        result = probe.result or {}
        if "findings" in result:
            lines = result["findings"] or []
        else:  # one host alone: it ran no probe across nodes
            problem = result.get("problem") or result.get("error")
            lines = [f"{probe.host}: {problem}"] if problem else []
        for line in lines:
            seen.setdefault(str(line), None)
    return list(seen)


def run_probes(agents: Sequence[RemoteAgent]) -> list[HostProbe]:
    """Start every host's probe, wait for them all, and return how each ended; a host that ends without a
    result ends the others at once (they would wait for it until --rdzv-timeout). Ctrl-C ends them too."""
    outputs: list[list[str]] = [[] for _ in agents]
    sessions: list[Session] = []
    done: dict[int, HostProbe] = {}
    try:
        for agent, output in zip(agents, outputs):
            sessions.append(Session(agent, "", b"", None, collect=output, what=WHAT))
        while len(done) < len(sessions):
            for index, session in enumerate(sessions):
                if index in done or session.proc.poll() is None:
                    continue
                session.out.drain(1.0)
                probe = host_probe(session.agent.host.name, session.proc.returncode, outputs[index],
                                   session.why())
                done[index] = probe
                if probe.result is None:
                    return [done[i] for i in sorted(done)]
            time.sleep(WATCH_INTERVAL)
        return [done[i] for i in sorted(done)]
    finally:
        end_sessions(sessions, 0.0)  # their input closed: every probe still running stops
