"""A warm standby worker: a Python process that has already imported torch and waits for a rank.

Importing torch costs seconds; a replacement rank handed to a standby skips that.
The agent starts it like any worker (own process group, parent-death signal, the
guardian told), then writes one JSON line on its stdin: the worker's argv, its
environment and its working directory. The standby takes them on and runs the
script as ``python -u SCRIPT`` or ``python -u -m MODULE`` would.

Runs as ``python -u -m ftrun.agent.standby``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def warm_up() -> None:
    """Pay, before any rank is assigned, for what every training script pays in its first second."""
    import torch
    import torch.distributed  # noqa: F401

    import ftrun.elastic  # noqa: F401

    # the first optimizer loads torch's compiler stack (close to a second here); a tiny step
    # also readies autograd
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.sum().backward()
    optimizer.step()


def run(assignment: dict) -> None:
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    argv = assignment["argv"]  # [python, -u, SCRIPT, args...] or [python, -u, -m, MODULE, args...]
    if argv[2] == "-m":
        sys.argv = [argv[3], *argv[4:]]
        runpy.run_module(argv[3], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[2:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[2])))
        runpy.run_path(argv[2], run_name="__main__")


def main() -> None:
    warm_up()
    line = sys.stdin.readline()
    if not line:
        return  # the agent let this standby go unused
    sys.stdin.close()
    run(json.loads(line))


def can_run(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether a worker command is one a standby can take over (python -u SCRIPT / -m MODULE)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u" and argv[2] != "-c"


if __name__ == "__main__":
    main()
