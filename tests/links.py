"""A link fault made for real: the TCP connections between one rank's process and its peers' are destroyed
by the kernel (``ss -K``, root), while every process lives, as a flapping link or a switch's reset leaves
them. Its other connections (to the control store and to its agent) are left alone."""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil
import pytest


def can_cut_links() -> str:
    """Why links cannot be cut here ("" when they can)."""
    if os.geteuid() != 0:
        return "destroying another process's sockets (ss -K) needs root"
    if shutil.which("ss") is None:
        return "ss (iproute2) is not installed"
    return ""


def _endpoints(pid: int) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """The established TCP connections of a process, as (local, remote) addresses."""
    return [(tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.raddr]


def cut_links(pid: int, peers: list[int]) -> int:
    """Destroy every connection between process ``pid`` and the processes ``peers``, on both ends (the
    kernel resets each): how many were cut. A connection to anything else (a store) stays."""
    theirs = {local for peer in peers for local, _ in _endpoints(peer)}
    cut = 0
    for local, remote in _endpoints(pid):
        if remote not in theirs:
            continue
        done = subprocess.run(["ss", "-K", "-tn", "src", f"{local[0]}:{local[1]}", "dst", f"{remote[0]}:{remote[1]}"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            pytest.fail(f"ss -K failed: {done.stderr.strip()}")
        cut += 1
    return cut
