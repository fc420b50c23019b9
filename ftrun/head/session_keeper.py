"""What a head node's ssh session runs on a host under ``--rdzv-backend etcd``: the host's agent, detached
from the session, and its output followed back to the head while the head is there.

Under the c10d store the agent is the session's own process, and it stops when the session closes (the
head holds the job's store, and without it the job cannot go on). Under etcd the job must outlive the
head: its terminal closed, its ssh sessions cut, its machine lost. So the session runs this keeper, which

* starts the agent in a session of its own (``setsid``: no hangup or signal to the ssh session's process
  group reaches it), its input the job's token and then nothing, its output in two files on the host
  (``HOST.stdout.log``, ``HOST.stderr.log`` in the run's folder under --log-dir, else in a folder of its
  own under the system's temporary folder: said in the first line);
* copies what the agent writes to those files to the session's output, for the head's console;
* carries out the head's one request, on the session's input after the token: ``stop SIGNUM`` sends the
  agent that signal (Ctrl-C on the head stops the job, as it does under c10d);
* ends with the agent's exit code; or at once, leaving the agent running, when the session is gone (its
  input ended or its output is closed: the head went, its ssh session was cut, or its machine).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Sequence

from ftrun.folders import run_folder

log = logging.getLogger(__name__)
#: the hidden flag a keeper starts the agent with, in place of --ssh-agent: the token on input, no session
DETACHED_FLAG = "--detached-agent"
#: what a head writes on a session's input to stop the job (with the signal's number)
STOP_REQUEST = "stop"
#: between two looks at the agent's files and its exit
COPY_INTERVAL = 0.05
#: how long the session's output may take nothing before the head counts as gone
WRITE_DEADLINE = 60.0


def stop_request(signum: int) -> bytes:
    """The line a head writes to a keeper's input for the job to stop as on ``signum``."""
    return f"{STOP_REQUEST} {int(signum)}\n".encode()


def parse_stop_request(line: bytes) -> int | None:
    """The signal a head's line asks for; None for anything else (ignored: the input is the head's alone)."""
    words = line.decode("ascii", "replace").split()
    if len(words) == 2 and words[0] == STOP_REQUEST and words[1].isdigit():
        number = int(words[1])
        return number if number in {s.value for s in signal.Signals} else None
    return None


def log_paths(log_dir: str, run_id: str, layout: str, host: str) -> tuple[str, str]:
    """Where the host's agent writes its output: the run's folder under --log-dir, else a folder made for it."""
    folder = run_folder(log_dir, run_id, layout) if log_dir else tempfile.mkdtemp(prefix=f"ftrun-{run_id}-")
    stdout, stderr = (os.path.join(folder, f"{host}.{name}.log") for name in ("stdout", "stderr"))
    return stdout, stderr


def detached_argv(argv: list[str]) -> list[str]:
    """The agent's command line: this keeper's, its --ssh-agent (the first word ftrun reads) replaced."""
    words = list(argv)
    words[words.index("--ssh-agent")] = DETACHED_FLAG
    return [sys.executable, "-u", "-m", "ftrun", *words]


def keep_session(argv: list[str], token: bytes, paths: tuple[str, str]) -> int:
    """Start the detached agent (``argv``), follow it for the head; its exit code, or 0 once the head is
    gone (the agent then goes on alone)."""
    files = [open(path, "ab") for path in paths]
    # the files of an earlier run of this id are added to: only what this agent writes goes to the head
    starts = [file.tell() for file in files]
    try:
        agent = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=files[0], stderr=files[1],
                                 start_new_session=True)
    finally:
        for file in files:
            file.close()
    agent.stdin.write(token + b"\n")
    agent.stdin.close()
    sys.stderr.write(f"ftrun: the agent runs detached (pid {agent.pid}); its output: {paths[0]}, {paths[1]}\n")
    sys.stderr.flush()
    head_gone = threading.Event()
    threading.Thread(target=_carry_out_requests, args=(agent, head_gone), name="ftrun-keeper-input",
                     daemon=True).start()
    readers = [open(path, "rb") for path in paths]
    for reader, start in zip(readers, starts):
        reader.seek(start)
    sys.stdout.flush()
    outputs = [sys.stdout.buffer, sys.stderr.buffer]
    try:
        while True:
            ended = agent.poll() is not None
            if not _copy(readers, outputs) or head_gone.is_set() and not ended:
                return 0  # the head is gone: the agent goes on, its output in its files
            if ended:
                code = agent.returncode
                return code if code >= 0 else 128 - code
            time.sleep(COPY_INTERVAL)
    finally:
        for reader in readers:
            reader.close()


def _copy(readers: Sequence[IO[bytes]], outputs: Sequence[IO[bytes]]) -> bool:
    """What the agent wrote since the last look, to the session; False when the session's output is gone,
    or takes nothing for WRITE_DEADLINE (a head cut off without the connection closing: a blocked write would
    keep this keeper past its agent's end)."""
    for reader, output in zip(readers, outputs):
        data = reader.read()
        if data and not send_within(output.fileno(), data, WRITE_DEADLINE):
            return False
    return True


def send_within(fd: int, data: bytes, timeout: float) -> bool:
    """``data`` to ``fd`` in pieces a pipe takes whole once it says it is writable; False when it is closed
    or takes nothing for ``timeout`` seconds."""
    end = time.monotonic() + timeout
    view = memoryview(data)
    while view:
        _, ready, _ = select.select([], [fd], [], max(0.0, end - time.monotonic()))
        if not ready:
            return False
        try:
            view = view[os.write(fd, view[:select.PIPE_BUF]):]
        except OSError:
            return False
        end = time.monotonic() + timeout
    return True


def _carry_out_requests(agent: subprocess.Popen, head_gone: threading.Event) -> None:
    """The head's stop requests, read from the bare descriptor until the session's input ends (``head_gone``:
    it stops nothing, since under etcd the job does not depend on the head)."""
    pending = b""
    try:
        while chunk := os.read(sys.stdin.fileno(), 4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                signum = parse_stop_request(line)
                if signum is not None and agent.poll() is None:
                    log.warning("the head node asks the job to stop (%s)", signal.Signals(signum).name)
                    agent.send_signal(signum)
    except (OSError, ValueError):
        pass
    head_gone.set()
