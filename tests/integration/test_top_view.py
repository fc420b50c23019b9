"""``ftrun top`` in a real terminal (a tmux pane) against a real 2-node x 2-rank job started with a token:
without the token ``r`` is refused in one line; with it, rank 3's output and stack appear, ``r`` replaces
the rank through the process-level path (the event log shows the drill and the repair), and ``q``
leaves the view while the job runs on. Then the same view on the controller's own terminal (a 1-node x
2-rank job started in the pane): keys, a drill signed with the token the controller holds, ``q`` back to
plain lines while the job goes on to finish, and Ctrl-C in the view stopping the job as outside it; each
time the terminal is given back as it was."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import WORKERS, free_port, marked_processes, wait_for
from tests.parts import tmux
from tests.terminal import Pane

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _needs_tmux():
    tmux()


def test_top_shows_a_ranks_output_and_stack_and_restarts_it_with_the_token(launcher, tmp_path):
    token = tmp_path / "token"
    token.write_text("a-test-token-of-enough-length\n")
    token.chmod(0o600)
    endpoint = f"127.0.0.1:{free_port()}"
    env = launcher.env(STEPS="2000", STEP_SLEEP="0.1", PRINT_STEPS="1")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--run-id", "top",
              "--recovery", "process", "--max-restarts", "2", "--monitor-interval", "0.05", "--token-file", str(token),
              "--status", "off"]
    script = str(WORKERS / "elastic_train.py")
    nodes = [launcher.start([*common, "--node-rank", str(n), script], env=env) for n in (0, 1)]
    view_env = dict(os.environ)
    panes = []
    try:
        wait_for(lambda: (launcher.out_dir / "progress-rank3").exists(), 120, "the job's first steps")
        # without the token: the view works, and an action is refused in one line
        reach = ["--rdzv-endpoint", endpoint, "--timeout", "60"]  # a store slow to answer on a loaded machine
        bare = Pane(tmp_path, "bare", ["top", *reach], view_env)
        panes.append(bare)
        bare.wait_for("RUNNING", "heartbeat")
        bare.keys("r")
        bare.wait_for("'r' changes the job and needs its token")
        bare.keys("q")
        assert bare.exit_code() == 0

        view = Pane(tmp_path, "token", ["top", *reach, "--token-file", str(token)], view_env)
        panes.append(view)
        view.wait_for("RUNNING", "heartbeat")
        view.keys("j", "j", "Down", "Enter")  # rank 3: node 1's second rank
        screen = view.wait_for("rank 3 ·", "last output", "rank 3 step ")
        assert "node 1" in screen
        view.keys("s")
        screen = view.wait_for("rank 3 stack", "elastic_train.py", timeout=30)
        assert "rank 3 step" not in screen.split("rank 3 stack", 1)[1]  # the stack, not the output around it
        before = next(line for line in screen.splitlines() if line.strip().startswith("3 "))
        view.keys("r")
        view.wait_for("Restart rank 3")
        view.keys("y")
        view.wait_for("asked the controller to restart rank 3")
        view.keys("e")
        screen = view.wait_for("asked for a restart drill of rank 3", "drill", "repaired", timeout=90)
        assert "fault" in screen
        view.keys("/")
        view.wait_for("filter the events")
        view.keys("r", "e", "p", "a", "i", "r", "Enter")  # the filter keeps the repair only
        screen = view.wait_for("matching 'repair'")
        assert "repaired" in screen and "asked for a restart drill" not in screen
        after = next(line for line in view.screen().splitlines() if line.strip().startswith("3 "))
        assert before.split()[3] != after.split()[3], (before, after)  # a new pid for rank 3
        view.keys("q")
        assert view.exit_code() == 0
        time.sleep(1)
        assert [node.proc.poll() for node in nodes] == [None, None], launcher.output()  # q left the job running
    finally:
        for pane in panes:
            pane.close()
        for node in nodes:
            if node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGTERM)
        for node in nodes:
            try:
                node.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def controller_in_a_pane(launcher, tmp_path: Path, name: str, **env_extra: str) -> Pane:
    """A 1-node x 2-rank job whose controller's terminal is the pane (``--status live``; its single node
    makes the job's token itself), the ranks printing a line every 0.2 s until OUT_DIR/finish appears."""
    env = launcher.env(TICK="0.2", **env_extra)
    args = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-id", name,
            "--max-restarts", "1", "--monitor-interval", "0.05", "--status", "live", str(WORKERS / "ticker.py")]
    return Pane(tmp_path, name, args, env)


def outside_cpu(screen: str) -> float:
    """The opened rank's CPU seconds per second as its pane shows them (the outside view), with its step from output."""
    found = re.search(r"outside cpu ([0-9.]+) CPU-s/s · step \d+ from output", screen)
    assert found, screen
    return float(found.group(1))


def no_processes_left(launcher) -> None:
    wait_for(lambda: not marked_processes(launcher.mark), 30, "the job's processes to go")


def test_the_controllers_terminal_gets_the_view_and_q_leaves_it_while_the_job_finishes(launcher, tmp_path):
    # a plain script (no ftrun.elastic): seen from outside, its step read from its lines ("step N"), its ranks'
    # CPU time from /proc; rank 1 burns 0.1 CPU-seconds a tick, rank 0 next to none
    view = controller_in_a_pane(launcher, tmp_path, "own", BURN="1:0.1")
    try:
        screen = view.wait_for("RUNNING", "rank 0 ·", "rank 0 tick", "(from output)", timeout=120)
        assert screen.splitlines()[0].startswith("ftrun run own")
        assert re.search(r"step \d+ \(from output\)", screen.splitlines()[0]), screen
        assert re.search(r"\d+ \(output\)", screen), screen  # each rank's step cell
        view.keys("e")
        view.wait_for("event log (")
        view.keys("j", "Enter")  # the selection moves to rank 1, Enter opens it
        screen = view.wait_for("rank 1 ·", "last output", "rank 1 tick", "CPU-s/s")
        # the workers' lines the controller copies to its terminal stay out of the view, which stays whole
        assert "rank 0 tick" not in screen and screen.splitlines()[0].startswith("ftrun run own"), screen
        burning = outside_cpu(screen)
        view.keys("k")
        screen = view.wait_for("rank 0 ·", "rank 0 tick", "CPU-s/s")
        assert outside_cpu(screen) < burning, screen
        view.keys("j", "r")  # signed with the token the controller holds: no --token-file here
        view.wait_for("Restart rank 1")
        view.keys("y")
        view.wait_for("asked the controller to restart rank 1")
        view.keys("e")
        screen = view.wait_for("asked for a restart drill of rank 1", "generation 1 starts", timeout=90)
        assert "refused" not in screen
        view.keys("q")  # leaves the view, never the job
        view.wait_for("left the view; the job goes on")
        wait_for(lambda: " tick " in view.everything().split("left the view", 1)[1], 30,
                 "the workers' lines as plain lines after the view")
        (launcher.out_dir / "finish").touch()
        assert view.exit_code(timeout=120) == 0, view.everything()
        everything = view.everything()
        assert "job succeeded" in everything and "1 of 1 restart used" in everything, everything
        assert everything.index("left the view") < everything.index("job succeeded")
        view.given_back()
        no_processes_left(launcher)
    finally:
        view.close()


def test_ctrl_c_in_the_controllers_view_stops_the_job_and_gives_the_terminal_back(launcher, tmp_path):
    view = controller_in_a_pane(launcher, tmp_path, "interrupted")
    try:
        view.wait_for("RUNNING", "rank 0 tick", timeout=120)
        view.keys("C-c")
        assert view.exit_code(timeout=120) == 130, view.everything()
        assert "reason: SIGINT on node 0" in view.everything()
        view.given_back()
        no_processes_left(launcher)
    finally:
        view.close()
