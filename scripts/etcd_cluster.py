#!/usr/bin/env python3
"""A real etcd cluster on this machine's loopback, for the tests, the benchmarks and a first try.

    python scripts/etcd_cluster.py --members 3 --dir /tmp/etcd

starts three members (Debian's ``etcd-server`` package: ``apt-get install etcd-server``), prints the
``--rdzv-endpoint`` that reaches them, and runs until Ctrl-C. Tests use :class:`EtcdCluster` directly:
it can kill one member, or several, and bring them back, to take the quorum away and return it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

#: how long a member, or the whole cluster, gets to answer its health check
START_DEADLINE = 20.0
HEALTH_TIMEOUT = 1.0


class EtcdUnavailable(Exception):
    """Why no cluster could be started here (the tests skip with this reason)."""


def etcd_program() -> str:
    for path in (shutil.which("etcd"), "/usr/bin/etcd"):
        if path and Path(path).exists():
            return path
    raise EtcdUnavailable("etcd is not installed (Debian: apt-get install etcd-server)")


def _free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=HEALTH_TIMEOUT) as answer:
                return json.load(answer).get("health") == "true"
        except (OSError, ValueError):
            return False


@dataclass
class EtcdCluster:
    """``members`` etcd servers on loopback, their data under ``folder``."""

    folder: Path
    members: list[Member] = field(default_factory=list)

    @classmethod
    def start(cls, folder: Path, size: int = 3, token: str = "ftrun") -> EtcdCluster:
        program = etcd_program()
        folder.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(2 * size)
        cluster = cls(folder, [Member(f"m{i}", ports[2 * i], ports[2 * i + 1], folder / f"m{i}", folder / f"m{i}.log")
                               for i in range(size)])
        initial = ",".join(f"{m.name}={m.peer_url}" for m in cluster.members)
        try:
            for member in cluster.members:
                cluster._launch(program, member, initial, token)
            cluster.wait_healthy()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def endpoints(self) -> str:
        """What ``--rdzv-endpoint`` takes: every member, comma-separated."""
        return ",".join(m.endpoint for m in self.members)

    def _launch(self, program: str, member: Member, initial: str = "", token: str = "ftrun") -> None:
        argv = [program, "--name", member.name, "--data-dir", str(member.data_dir),
                "--listen-client-urls", f"http://{member.endpoint}",
                "--advertise-client-urls", f"http://{member.endpoint}",
                "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                # short elections: a member lost is noticed in a fraction of a second, as on a LAN
                "--heartbeat-interval", "50", "--election-timeout", "500"]
        if initial:
            argv += ["--initial-cluster", initial, "--initial-cluster-state", "new",
                     "--initial-cluster-token", token]
        with open(member.log, "ab") as log:
            member.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)

    def wait_healthy(self, members: list[Member] | None = None, deadline: float = START_DEADLINE) -> None:
        members = self.members if members is None else members
        end = time.monotonic() + deadline
        while not all(m.healthy() for m in members):
            for m in members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise EtcdUnavailable(f"etcd member {m.name} exited ({m.proc.returncode}): "
                                          f"{m.log.read_text(errors='replace')[-400:]}")
            if time.monotonic() > end:
                raise EtcdUnavailable(f"the etcd cluster was not healthy within {deadline:.0f}s (logs in {self.folder})")
            time.sleep(0.1)

    def leader(self) -> int | None:
        """The index of the member that leads the cluster now, by the members' own word; None if none says."""
        for member in self.members:
            try:
                request = urllib.request.Request(f"http://{member.endpoint}/v3/maintenance/status", data=b"{}",
                                                 method="POST")
                with urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT) as answer:
                    status = json.load(answer)
            except (OSError, ValueError):
                continue
            if status.get("leader") and status["leader"] == status.get("header", {}).get("member_id"):
                return self.members.index(member)
        return None

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data stays: :meth:`revive` brings it back)."""
        member = self.members[index]
        if member.proc is not None and member.proc.poll() is None:
            member.proc.send_signal(signal.SIGKILL)
            member.proc.wait()

    def revive(self, index: int) -> None:
        """Start a killed member again from its data (it rejoins the cluster it was part of)."""
        member = self.members[index]
        self._launch(etcd_program(), member)

    def stop(self, graceful: bool = True) -> None:
        """Stop every member: with SIGTERM (a member may take seconds to hand its leadership over), or, not
        ``graceful``, with SIGKILL, for a cluster whose data goes with it."""
        for member in self.members:
            if member.proc is not None and member.proc.poll() is None:
                member.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        for member in self.members:
            if member.proc is None:
                continue
            try:
                member.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                member.proc.kill()
                member.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=3, help="how many members (default 3)")
    parser.add_argument("--dir", type=Path, required=True, help="where the members keep their data and logs")
    args = parser.parse_args()
    try:
        cluster = EtcdCluster.start(args.dir, args.members)
    except EtcdUnavailable as e:
        print(f"etcd_cluster: {e}", file=sys.stderr)
        return 2
    print(f"etcd up: --rdzv-backend etcd --rdzv-endpoint {cluster.endpoints}", flush=True)
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
