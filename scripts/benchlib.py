"""What the benchmark scripts share: ports, programs, their JSON, and leaving no process behind."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def emit_json(document, where: str) -> None:
    """The results as JSON: on standard output for "-", else into the file ``where`` (and said on stderr)."""
    text = json.dumps(document, indent=2)
    if where == "-":
        print(text)
    else:
        Path(where).write_text(text + "\n")
        print(f"JSON written to {where}", file=sys.stderr)


def find_program(name: str, who: str) -> str:
    """A launcher next to this Python (the venv's) or on PATH; exits naming ``who`` when missing."""
    beside_python = Path(sys.executable).parent / name
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{who}: cannot find {name} next to {sys.executable} or on PATH")
    return found


def marked_processes(marker_variable: str, marker: str) -> list[psutil.Process]:
    """Every process whose environment carries the marker (of any parent: launchers detach their workers)."""
    found = []
    for candidate in psutil.process_iter():
        try:
            if candidate.environ().get(marker_variable) == marker:
                found.append(candidate)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def kill_everything(processes: list[subprocess.Popen], marker_variable: str, marker: str) -> None:
    """SIGKILL the launchers' process groups and every process whose environment carries the marker,
    then reap. Launchers put their workers in sessions of their own, hence the marker."""
    interrupts = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, interrupts)  # a second Ctrl-C waits until this is done
    try:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # each launcher leads its own group (start_new_session)
            except ProcessLookupError:
                pass
        marked = marked_processes(marker_variable, marker)
        for candidate in marked:
            try:
                candidate.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(marked, timeout=10)
        for process in processes:
            process.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, interrupts)
