"""``ftrun top`` in a real terminal (a tmux pane) against a real 2-node x 2-rank job started with a token:
without the token ``r`` is refused in one line; with it, rank 3's output and stack appear, ``r`` replaces
the rank through the process-level path (the event log shows the drill and the repair), and ``q``
leaves the view while the job runs on."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import WORKERS, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed")]
pytest.importorskip("textual")
COLUMNS, LINES = 130, 45


class Pane:
    """``ftrun top`` in a tmux pane of its own; the pane stays after it exits, with its exit code in a file."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict[str, str]):
        self.socket = f"ftrun-top-{os.getpid()}-{name}"
        self.exit_file = tmp / f"{name}.exit"
        assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier())
        command = (f"env {assigned} {shlex.quote(sys.executable)} -m ftrun top {shlex.join(args)}; "
                   f"echo $? > {self.exit_file}; sleep 600")
        self._tmux("new-session", "-d", "-x", str(COLUMNS), "-y", str(LINES), command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def keys(self, *keys: str) -> None:
        for key in keys:
            self._tmux("send-keys", key)
            time.sleep(0.15)

    def wait_for(self, *words: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(word in screen for word in words):
                return screen
            time.sleep(0.2)
        pytest.fail(f"the view never showed {words}:\n{screen}")

    def exit_code(self, timeout: float = 15) -> int:
        deadline = time.monotonic() + timeout
        while not self.exit_file.exists() or not self.exit_file.read_text().strip():
            assert time.monotonic() < deadline, f"ftrun top did not leave:\n{self.screen()}"
            time.sleep(0.1)
        return int(self.exit_file.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


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
    view_env = dict(os.environ, COLUMNS=str(COLUMNS), LINES=str(LINES))
    panes = []
    try:
        wait_for(lambda: (launcher.out_dir / "progress-rank3").exists(), 120, "the job's first steps")
        # without the token: the view works, and an action is refused in one line
        bare = Pane(tmp_path, "bare", ["--rdzv-endpoint", endpoint], view_env)
        panes.append(bare)
        bare.wait_for("RUNNING", "heartbeat")
        bare.keys("r")
        bare.wait_for("'r' changes the job and needs its token")
        bare.keys("q")
        assert bare.exit_code() == 0

        view = Pane(tmp_path, "token", ["--rdzv-endpoint", endpoint, "--token-file", str(token)], view_env)
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
        view.keys("/", "r", "e", "p", "a", "i", "r", "Enter")  # the filter keeps the repair only
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
