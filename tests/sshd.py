"""A real OpenSSH server for the SSH-mode tests: on a free loopback port, with keys made for the test.

Every address 127.0.0.2, 127.0.0.3, ... is this machine, so each stands in for a host.
The server lets in only the key it generated, and only the user running the tests.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

#: the loopback addresses the server listens on: each one a "host"
HOSTS = tuple(f"127.0.0.{n}" for n in range(2, 7))
START_DEADLINE = 15.0


class SshdUnavailable(Exception):
    """Why no server could be started here (the tests skip with this reason; on CI they fail)."""


@dataclass
class Sshd:
    proc: subprocess.Popen
    port: int
    key: Path
    log: Path

    @property
    def options(self) -> list[str]:
        """ssh -o options that reach this server with the test's key and nothing from the user's setup."""
        return [f"IdentityFile={self.key}", "IdentitiesOnly=yes", "UserKnownHostsFile=/dev/null",
                "StrictHostKeyChecking=no", "LogLevel=ERROR", f"User={getpass.getuser()}"]

    def client_flags(self) -> list[str]:
        """The same, as ftrun flags."""
        flags = ["--ssh-port", str(self.port)]
        for option in self.options:
            flags += ["--ssh-option", option]
        return flags

    def ssh(self, host: str, *command: str) -> list[str]:
        """A plain ssh command line to one of the hosts."""
        argv = ["ssh", "-T", "-p", str(self.port)]
        for option in self.options:
            argv += ["-o", option]
        return [*argv, host, *command]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def find_sshd() -> str:
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SshdUnavailable("no sshd here (install openssh-server; scripts/setup.sh does when run as root)")


def start_sshd(folder: Path) -> Sshd:
    sshd = find_sshd()
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        raise SshdUnavailable("no ssh client here (install openssh-client)")
    folder.mkdir(parents=True, exist_ok=True)
    host_key, client_key = folder / "host_key", folder / "client_key"
    for key in (host_key, client_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    port = _free_port()
    config = folder / "sshd_config"
    listen = "".join(f"ListenAddress {host}:{port}\n" for host in ("127.0.0.1", *HOSTS))
    config.write_text(
        f"{listen}HostKey {host_key}\nPidFile {folder / 'sshd.pid'}\nAuthorizedKeysFile {folder / 'authorized_keys'}\n"
        "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nAllowTcpForwarding no\nX11Forwarding no\n"
        "PrintMotd no\nLogLevel ERROR\nMaxStartups 100:30:200\nMaxSessions 100\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # privilege separation needs it
    check = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True)
    if check.returncode != 0:
        raise SshdUnavailable(f"sshd refuses the test's config: {check.stderr.strip()}")
    log = folder / "sshd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT)
    server = Sshd(proc, port, client_key, log)
    deadline = time.monotonic() + START_DEADLINE
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SshdUnavailable(f"sshd exited: {log.read_text().strip()}")
        try:
            with socket.create_connection((HOSTS[0], port), timeout=1):
                return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise SshdUnavailable(f"sshd did not listen within {START_DEADLINE:g}s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
