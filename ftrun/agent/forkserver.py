"""The node's warm interpreter: torch imported once, every rank forked from it (a fork server).

A fresh interpreter pays for ``import torch`` before its script's first line: 1.6 to 2 s of CPU here, and
more for a framework (transformers' Trainer, Lightning). A node that starts each rank, each replacement and
each restart's ranks in a fresh interpreter pays it every time, and on a small machine its ranks' imports
compete for the cores. Under ``--warm-standby`` (on by default with ``--recovery process``) the agent starts,
as it starts, one interpreter per node that imports what every rank imports (``standby.warm_up``: torch,
``ftrun.elastic``, the framework that the script names) and then forks each rank the agent asks for: a
generation's, a replacement, a job-level restart's. A replacement is ready from the first step on.

Each rank is forked twice, the middle process ending at once, and the agent is a child subreaper
(``PR_SET_CHILD_SUBREAPER``): the rank becomes the agent's own child, which it reaps and reads the exit
status of as it does a rank it started itself. The rank leads a session of its own (its process group is
what a stop signals), and arms its parent-death signal only once the agent is its parent.

One request and its answer, over a ``SOCK_SEQPACKET`` socket pair (``main()``'s first argument is the
server's end): the agent sends ``{"argv", "env", "cwd", "cpus", "agent"}`` with the write ends of the rank's
stdout and stderr pipes; the server answers ``{"pid": N}``. It says ``{"ready": true}`` once, when warm.
``python -u -m ftrun.agent.forkserver FD [SCRIPT]``.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Protocol

from ftrun.agent import standby
from ftrun.orphans import PR_SET_PDEATHSIG

log = logging.getLogger(__name__)
#: the longest a warm interpreter may take to import what the ranks import (a loaded 2-core machine took 26 s
#: for torch alone); past it the node starts its ranks in fresh interpreters
WARM_DEADLINE = 120.0
#: the longest the agent waits for a warm interpreter's answer to one fork
FORK_DEADLINE = 10.0
#: the largest request (a rank's argv and environment)
MAX_MESSAGE = 1 << 20
PR_SET_CHILD_SUBREAPER = 36
#: what the rank reads from the server once the agent is its parent
GO = b"g"


class Spawns(Protocol):
    """What starts the warm interpreter: the agent's ProcessOps (workers.py), whose guardian is told of it."""

    def spawn(self, argv: list[str], env: dict[str, str], *, pass_fds: tuple[int, ...] = (),
              output=subprocess.PIPE) -> subprocess.Popen: ...


class ForkedProcess:
    """A rank forked from the warm interpreter, seen from the agent as a ``subprocess.Popen``: its pid (and
    process group), its output pipes, its exit status, reaped by the agent whose child it became."""

    stdin = None

    def __init__(self, pid: int, stdout, stderr):
        self.pid = pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: no status to read
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The agent's side: starts the warm interpreter and asks it for ranks."""

    def __init__(self, ops: Spawns, env: dict[str, str], script: list[str]):
        become_subreaper()
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-u", "-m", "ftrun.agent.forkserver", str(theirs.fileno()), *script]
        self.proc = ops.spawn(argv, env, pass_fds=(theirs.fileno(),), output=subprocess.DEVNULL)
        theirs.close()
        self._sock.setblocking(False)
        self.started = time.monotonic()
        self.ready = False
        #: it died, failed a fork or took too long to warm: the node's ranks start in fresh interpreters
        self.failed = False
        log.info("warm interpreter importing torch (pid %d)", self.proc.pid)

    @property
    def warming(self) -> bool:
        """Still importing (the ranks wait for it); False once ready or failed."""
        if self.ready or self.failed:
            return False
        try:
            answer = self._sock.recv(MAX_MESSAGE)
        except BlockingIOError:
            answer = None
        except OSError:
            answer = b""
        if answer:
            self.ready = json.loads(answer).get("ready", False)
            if self.ready:
                log.info("warm interpreter ready in %.1fs: ranks are forked from it", time.monotonic() - self.started)
            return not self.ready
        if answer == b"" or self.proc.poll() is not None:
            self._give_up("it ended while importing")
        elif time.monotonic() - self.started > WARM_DEADLINE:
            self._give_up(f"it was not ready within {WARM_DEADLINE:g}s")
        return not self.failed

    def fork(self, argv: list[str], env: dict[str, str], cpus: tuple[int, ...]) -> ForkedProcess | None:
        """One rank, forked from the ready interpreter; None if it cannot (the caller starts a fresh one)."""
        if self.warming or not self.ready:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "cpus": list(cpus), "agent": os.getpid()}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
            pid = self._answer()
        except (OSError, ValueError, TimeoutError) as e:
            self._give_up(f"a fork failed ({e})")
            pid = None
        finally:
            os.close(out_w)
            os.close(err_w)
        if pid is None:
            os.close(out_r)
            os.close(err_r)
            return None
        return ForkedProcess(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def _answer(self) -> int:
        deadline = time.monotonic() + FORK_DEADLINE
        while True:
            try:
                answer = self._sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer within {FORK_DEADLINE:g}s") from None
                time.sleep(0.002)
                continue
            if not answer:
                raise OSError("the warm interpreter ended")
            return int(json.loads(answer)["pid"])

    def _give_up(self, why: str) -> None:
        log.warning("warm interpreter given up (%s): ranks start in fresh interpreters", why)
        self.failed = True
        self.close()

    def close(self) -> None:
        """Let it go: it ends as its socket closes (killed if it does not)."""
        self._sock.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def become_subreaper() -> None:
    """The agent adopts its descendants that lose their parent: a forked rank, once its middle process ends."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except (OSError, AttributeError):
        pass  # not Linux: no warm interpreter there (standby.can_fork)


def reap_orphans(pgid: int) -> bool:
    """Reap what the agent adopted from a rank's process group once the rank is reaped (a data loader's worker
    whose rank died); False once no child of the agent is left in the group."""
    while True:
        try:
            found = os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return False
        if found is None:
            return True


# -- the server ----------------------------------------------------------------------------------------------


def serve(sock: socket.socket) -> dict:
    """Fork a rank for each request until the agent closes its end (then exit). Returns only in a forked rank:
    its request, once the agent is its parent."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            sys.exit(0)
        if not message:
            sys.exit(0)  # the agent let it go
        request = json.loads(message)
        ready_r, ready_w = os.pipe()  # the rank's pid, once it leads its own session
        go_r, go_w = os.pipe()  # the rank goes on, once the agent adopted it
        middle = os.fork()
        if middle == 0:
            if os.fork() != 0:
                os._exit(0)  # the rank is adopted by the agent (the nearest subreaper) as this ends
            os.setsid()
            os.write(ready_w, str(os.getpid()).encode())
            for fd in (ready_r, ready_w, go_w):
                os.close(fd)
            if os.read(go_r, 1) != GO:  # the server ended first
                os._exit(1)
            os.close(go_r)
            become_rank(request, fds, sock)
            return request
        os.close(ready_w)
        os.close(go_r)
        for fd in fds:
            os.close(fd)
        pid = _read_all(ready_r)
        os.waitpid(middle, 0)
        if pid:
            os.write(go_w, GO)
        os.close(go_w)
        sock.send(json.dumps({"pid": int(pid) if pid else -1}).encode())


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 64):
        data += chunk
    os.close(fd)
    return data


def become_rank(request: dict, fds: list[int], sock: socket.socket) -> None:
    """In the forked rank: what a fresh ``subprocess.Popen`` of the agent's would have had."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != request["agent"]:
        os._exit(1)  # the agent died before the signal was armed
    sock.close()
    stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if request["cpus"]:
        os.sched_setaffinity(0, request["cpus"])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:  # a fresh interpreter seeds numpy's global generator from the OS
        numpy_random.seed()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    standby.warm_up(sys.argv[2] if len(sys.argv) > 2 else None)
    gc.collect()
    gc.freeze()  # the forked ranks share these pages: the collector does not touch them
    sock.send(json.dumps({"ready": True}).encode())
    request = serve(sock)
    standby.run(request)


if __name__ == "__main__":
    main()
