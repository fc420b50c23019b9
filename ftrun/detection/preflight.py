"""``--preflight``'s speed check: a small matmul on each of a node's devices before the first step, and the
rendezvous's verdict over every node's time (a node past twice the median is left out for a spare, or the
job refuses to start, with one line per finding).

The timing runs in a child interpreter with a deadline (the agent does not import torch); the verdict is a
pure function over the nodes' join records, decided with the rendezvous (``ftrun.rendezvous``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import subprocess
import sys

from ftrun.detection.pairs import PairTime, judge_pairs
from ftrun.orphans import die_with_parent

log = logging.getLogger(__name__)
#: a node whose slowest device takes more than this many times the job's median is slow
SLOW_FACTOR = 2.0
#: the matmul: square matrices of this size, timed this many times after one warm-up (the median counts)
MATMUL_SIZE, MATMUL_REPEATS = 512, 5
#: seconds the child interpreter may take (torch's import is most of it)
MATMUL_DEADLINE = 120.0

_CHILD = """
import json, sys, time, statistics
import torch
kind, count, size, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if kind == "npu":
    import torch_npu  # noqa: F401
devices = [torch.device("cpu")] if kind == "cpu" else [torch.device(kind, i) for i in range(count)]
sync = (lambda d: None) if kind == "cpu" else (lambda d: getattr(torch, kind).synchronize(d))
times = []
for device in devices:
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
    b = a @ a
    sync(device)
    taken = []
    for _ in range(repeats):
        began = time.perf_counter()
        b = a @ a
        sync(device)
        taken.append(time.perf_counter() - began)
    times.append(statistics.median(taken))
print(json.dumps(times))
"""


def matmul_times(kind: str, count: int, python: str = sys.executable, deadline: float = MATMUL_DEADLINE) -> list[float]:
    """Each device's median time for a MATMUL_SIZE matmul (``kind``: cpu, cuda or npu; ``count`` devices, one
    for cpu), timed in a child interpreter; [] when it cannot run (one warning: the check goes on without it)."""
    try:
        done = subprocess.run([python, "-c", _CHILD, kind, str(max(count, 1)), str(MATMUL_SIZE), str(MATMUL_REPEATS)],
                              capture_output=True, text=True, timeout=deadline, preexec_fn=die_with_parent)
        times = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        times = None
    if not isinstance(times, list) or not all(isinstance(t, (int, float)) and t > 0 for t in times):
        log.warning("preflight: the matmul check did not run on this node's %s devices; going on without it", kind)
        return []
    return [float(t) for t in times]


@dataclasses.dataclass(frozen=True)
class NodeSpeed:
    """A node's preflight time: its slowest device's matmul, in seconds (0: not measured)."""

    agent_id: str
    host: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class SpeedVerdict:
    """The slow nodes (agent id, the line that says why), and whether the job can start without them (they
    go; spares take their places) or must refuse."""

    slow: tuple[tuple[str, str], ...] = ()
    refuse: bool = False

    @property
    def findings(self) -> tuple[str, ...]:
        return tuple(line for _, line in self.slow)


def judge_speeds(nodes: list[NodeSpeed], spare_room: int, keep: str = "", factor: float = SLOW_FACTOR) -> SpeedVerdict:
    """A node past ``factor`` times the job's median (the lower median) is slow. With ``spare_room`` agents beyond
    the nodes the job needs, that many slow nodes are left out; more, or a slow ``keep`` (the agent that hosts
    the store), and the job refuses to start."""
    return decide(speed_findings(nodes, factor), spare_room, keep)


def judge_preflight(nodes: list[NodeSpeed], pairs: list[PairTime], spare_room: int, keep: str = "") -> SpeedVerdict:
    """The matmul's findings and the data network's (``pairs.judge_pairs``: a node that cannot reach a peer, or
    whose best pair is past twice the median), decided together: one line per node, its first finding."""
    findings = speed_findings(nodes)
    named = {agent for agent, _ in findings}
    findings += [(agent, line) for agent, line in judge_pairs(pairs, {n.agent_id: n.host for n in nodes})
                 if agent not in named]
    return decide(findings, spare_room, keep)


def speed_findings(nodes: list[NodeSpeed], factor: float = SLOW_FACTOR) -> list[tuple[str, str]]:
    """(agent id, line) for each node whose matmul takes past ``factor`` times the median (the lower median)."""
    measured = [n for n in nodes if n.seconds > 0]
    if len(measured) < 2:
        return []
    median = statistics.median_low(n.seconds for n in measured)
    return [(n.agent_id, f"{n.host}: its matmul takes {n.seconds * 1000:.1f} ms, {n.seconds / median:.1f}x the "
                         f"median {median * 1000:.1f} ms") for n in measured if n.seconds > factor * median]


def decide(findings: list[tuple[str, str]], spare_room: int, keep: str = "") -> SpeedVerdict:
    """The nodes found are left out when ``spare_room`` agents can take their places and none of them is
    ``keep``; else the job refuses to start."""
    if not findings:
        return SpeedVerdict()
    refuse = len(findings) > spare_room or any(agent == keep for agent, _ in findings)
    return SpeedVerdict(tuple(findings), refuse)
