"""Folders only their owner may enter: the job's logs, error files and event log hold its output.

Below every module that writes them (the agent's output, the head node, the event log).
"""

from __future__ import annotations

import os


def private_dirs(path: str) -> None:
    """Make ``path`` and any missing folder above it, each owner-only (logs hold the job's output)."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for folder in reversed(missing):
        os.makedirs(folder, mode=0o700, exist_ok=True)
