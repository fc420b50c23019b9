"""The node's warm interpreter (ftrun/agent/forkserver.py): torch imported once, the node's ranks forked from it,
each the agent's own child. Real processes: the warm interpreter, its ranks, a data loader's kind of orphan; the
test's process plays the agent (a subreaper for the test's length)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from ftrun.agent.forkserver import PR_SET_CHILD_SUBREAPER, ForkedProcess
from ftrun.messages import CommandKind, NodeStatus
from tests.conftest import wait_for
from tests.unit.node_parts import AGENT

#: the longest a warm interpreter may take to import torch on a loaded machine here
WARM = 90


@pytest.fixture
def subreaper():
    """The test's process adopts orphans only for the test's length."""
    yield
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0)
    for child in psutil.Process().children():
        if child.status() == psutil.STATUS_ZOMBIE:
            os.waitpid(child.pid, 0)


def warm_node(node, parts: str):
    n = node(parts)
    n.group.warm_wanted = True
    n.group.keep_warm()
    return n


def started_when_warm(n, command) -> None:
    """The command's workers wait for the warm interpreter, then are forked from it."""
    n.commands.carry_out(command)
    wait_for(lambda: n.spawner.tick() or n.spawner.pending is None, WARM, "the warm interpreter's ranks")


def test_ranks_wait_for_the_warm_interpreter_then_are_the_agents_own_children(node, subreaper):
    n = warm_node(node, "sleep,tick")
    start = n.command(CommandKind.START)
    n.commands.carry_out(start)
    assert n.group.warming and n.spawner.pending is not None and n.group.workers == []  # importing torch
    wait_for(lambda: n.spawner.tick() or n.spawner.pending is None, WARM, "the warm interpreter's ranks")
    workers = n.group.workers
    assert all(isinstance(w.proc, ForkedProcess) for w in workers)
    for worker in workers:
        process = psutil.Process(worker.pid)
        assert process.ppid() == os.getpid()  # adopted: the agent reaps it and reads its exit status
        assert os.getpgid(worker.pid) == os.getsid(worker.pid) == worker.pid  # a stop signals its group
    env = n.env_of(1, 0)
    assert (env["RANK"], env["LOCAL_RANK"], env["FTRUN_GENERATION"]) == ("1", "1", "0")
    wait_for(lambda: "tick" in workers[1].out.recent, 30, "rank 1's output through its pipe")
    n.supervision.publish_status()
    assert n.store.try_get(NodeStatus, n.keys.agent_status(AGENT)).standbys == 1  # the status: warm

    # rank 1 lost: the agent reads its exit status; its replacement is forked at once
    lost = workers[1].pid
    os.kill(lost, signal.SIGKILL)
    n.wait_ended(1)
    [ended] = n.group.poll()
    assert (ended.placement.rank, ended.returncode) == (1, -signal.SIGKILL)
    n.commands.carry_out(n.command(CommandKind.REPLACE, 1, ranks=(1,)))
    assert n.spawner.pending is None
    assert n.env_of(1, 1)["FTRUN_REPLACEMENT"] == "1"
    replacement = n.group.workers[1]
    assert isinstance(replacement.proc, ForkedProcess) and replacement.pid != lost

    warm = n.group.warm.proc.pid
    n.group.stop(2.0)
    assert n.group.warm is None and not psutil.pid_exists(warm)
    assert [w.returncode for w in n.group.workers] == [-signal.SIGTERM, -signal.SIGTERM]


def test_what_a_forked_rank_leaves_behind_is_reaped_by_the_agent(node, subreaper):
    n = warm_node(node, "orphan,0")
    started_when_warm(n, n.command(CommandKind.START))
    n.wait_ended(2)
    wait_for(lambda: not n.group.poll() and all(w.returncode == 0 for w in n.group.workers), 30, "the ranks' exits")

    def zombies() -> list[psutil.Process]:
        return [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]

    # rank 0's sleep, killed with its group and adopted by the agent, does not stay a zombie
    wait_for(lambda: n.group.poll() == [] and not zombies(), 30, "the orphan reaped")


def test_a_warm_interpreter_that_ends_while_importing_leaves_the_ranks_to_fresh_interpreters(node, subreaper):
    n = warm_node(node, "sleep,sleep")
    n.group.warm.proc.kill()
    n.group.warm.proc.wait()
    n.commands.carry_out(n.command(CommandKind.START))
    assert n.spawner.pending is None and n.group.warm.failed
    assert all(isinstance(w.proc, subprocess.Popen) for w in n.group.workers)
    assert n.env_of(0, 0)["RANK"] == "0"


AGENT_SCRIPT = """
import os, sys, time
from ftrun.agent.forkserver import ForkServer
from ftrun.agent.workers import ProcessOps
warm = ForkServer(ProcessOps(), dict(os.environ), [])
while warm.warming:
    time.sleep(0.05)
rank = warm.fork([sys.executable, "-u", *sys.argv[1:]], dict(os.environ), ())
print(warm.proc.pid, rank.pid, flush=True)
time.sleep(120)
"""


RANK_SCRIPT = """
import json, sys, time
with open(sys.argv[1] + ".part", "w") as f:
    json.dump({"path": sys.path, "argv": sys.argv, "main": __name__}, f)
os.replace(sys.argv[1] + ".part", sys.argv[1])
time.sleep(120)
"""


def test_ranks_and_the_warm_interpreter_end_with_a_killed_agent(tmp_path):
    (tmp_path / "scripts").mkdir()
    rank_script, seen = tmp_path / "scripts" / "rank.py", tmp_path / "seen.json"
    rank_script.write_text("import os\n" + RANK_SCRIPT)
    agent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(AGENT_SCRIPT), str(rank_script), str(seen)],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        warm, rank = map(int, agent.stdout.readline().split())
        assert psutil.Process(rank).ppid() == agent.pid
        wait_for(seen.exists, 30, "the rank's script to run")
        # as `python -u rank.py SEEN` would: its folder first on the path (not the working directory), its argv
        ran = json.loads(seen.read_text())
        assert ran["path"][0] == str(rank_script.parent) and str(tmp_path) not in ran["path"]
        assert (ran["argv"], ran["main"]) == ([str(rank_script), str(seen)], "__main__")
    finally:
        agent.kill()
        agent.wait()
    for pid in (warm, rank):
        wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30,
                 f"process {pid} gone with its agent")
