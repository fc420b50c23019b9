"""The orphan guardian: a tiny process that outlives a SIGKILLed agent just long enough.

The agent writes ``+PGID`` / ``-PGID`` lines on the guardian's stdin as it
starts and reaps worker process groups, and ``dFOLDER`` for each folder it made
(its snapshot memory, its temporary folders).
When the agent dies, however it dies, the pipe closes; the guardian then SIGKILLs
every group still listed (the workers and anything they started), removes the
folders, and exits. Workers also carry a parent-death
signal; the guardian is what catches their grandchildren.

Runs as ``python -m ftrun.agent.guardian``; imports nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys


def main() -> None:
    # the user's Ctrl-C goes to the agent, which stops the workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups: set[int] = set()
    folders: set[str] = set()
    for line in sys.stdin:
        line = line.strip()
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
        elif line[:1] == "d":
            folders.add(line[1:])
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in folders:  # the agent's snapshot memory and temporary folders: gone with it, whatever ended it
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
