"""Folders only their owner may enter: the job's logs, error files and event log hold its output.

Below every module that writes them (the agent's output, the head node, the event log); ``run_folder`` is
where one run's files go under ``--log-dir``, in either layout.
"""

from __future__ import annotations

import os
import tempfile


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


def run_folder(log_dir: str, run_id: str, layout: str) -> str:
    """The one folder under ``--log-dir`` that holds everything this process writes of the run (its ranks'
    logs, the rank tables, the event log, the head node's per-host logs), made owner-only.

    ftrun's layout: ``<log_dir>/<run_id>``, shared by the nodes (each writes ``node<N>/`` in it). torchrun's:
    a fresh ``<log_dir>/<run_id>_<8 random characters>`` per process, as torchrun's agent makes with
    ``tempfile.mkdtemp``, so the log dir holds one folder per run and nothing beside it."""
    if layout == "torchrun":
        private_dirs(log_dir)
        return tempfile.mkdtemp(prefix=f"{run_id}_", dir=log_dir)
    path = os.path.join(log_dir, run_id)
    private_dirs(path)
    return path
