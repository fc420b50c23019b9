"""Seeing the job: the live view in a real terminal (tmux), ``ftrun status --json`` against the running
job, the event log's schema, and ``ftrun report`` after it, all from one 2-node x 2-rank run in which
rank 3 is SIGKILLed and replaced at process level (cold, without a warm standby, so the repair lasts
long enough to be seen while it happens), and rank 1 saves a checkpoint between two steps while the others
wait for it: shown while it lasts, and measured."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ftrun.events import KINDS, REQUIRED
from tests.conftest import JOB_DEADLINE, WORKERS, Launcher, free_port, ftrun_status, marked_processes, unique_mark
from tests.parts import tmux

pytestmark = pytest.mark.integration
STEPS = 40
#: how long rank 1's checkpoint save takes, once 10 steps are committed (its heartbeat says it once a second)
SAVE = 3
REPAIR_PHASES = {"stopping", "env_clear", "repair", "rollback"}
TMUX = shutil.which("tmux")
#: the terminal the view is drawn in
COLUMNS, LINES = 120, 50
#: between the two captures of one screen: far below the view's half second between frames
STEADY_GAP = 0.05


@dataclass
class WatchedRun:
    """What the test saw of the run: terminal screens, ``ftrun status`` output, the event log."""

    tmp: Path
    screens: list[str] = field(default_factory=list)
    statuses: list[dict] = field(default_factory=list)
    status_text: str = ""
    console: str = ""
    codes: list[int] = field(default_factory=list)
    output: str = ""

    @property
    def events_file(self) -> Path:
        return self.tmp / "logs" / "statusview" / "events.jsonl"


class Terminal:
    """Node 0's agent in a tmux pane (a real terminal, so --status auto draws the live view; its input is
    /dev/null, which keeps the view that takes no keys rather than ftrun top's), or, where tmux is missing,
    a plain process (plain status lines)."""

    def __init__(self, runner: Launcher, args: list[str], env: dict[str, str]):
        self.runner = runner
        self.socket = f"ftrun-{runner.mark}"
        self.exit_file = runner.tmp / "node0.exit"
        self.node = None
        if TMUX:
            assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier())
            command = (f"env {assigned} {shlex.quote(sys.executable)} -m ftrun {shlex.join(args)} < /dev/null; "
                       f"echo $? > {self.exit_file}.tmp; mv {self.exit_file}.tmp {self.exit_file}")  # whole, once there
            self._tmux("new-session", "-d", "-x", str(COLUMNS), "-y", str(LINES), command + "; sleep 600")
        else:
            self.node = runner.start([*args[:-1], "--status", "plain", args[-1]], env=env)

    def _tmux(self, *args: str) -> str:
        return subprocess.run([TMUX, "-L", self.socket, *args], capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        """The screen once it holds still ("" when not): tmux reads a frame in pieces (terminal writes
        arrive 2,048 bytes at a time), and a capture between two pieces shows half a frame, so a capture
        is kept only when a second one a moment later is the same. The view redraws twice a second."""
        if not TMUX:
            return ""
        first = self._tmux("capture-pane", "-p")
        time.sleep(STEADY_GAP)
        return first if self._tmux("capture-pane", "-p") == first else ""

    def finished(self) -> bool:
        return self.exit_file.exists() if TMUX else self.node.proc.poll() is not None

    def code(self) -> int:
        return int(self.exit_file.read_text()) if TMUX else self.node.proc.returncode

    def everything(self) -> str:
        """All the terminal showed, scrollback included."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-") if TMUX else self.node.output

    def close(self) -> None:
        if TMUX:
            subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> WatchedRun:
    tmp = tmp_path_factory.mktemp("status-view")
    runner = Launcher(tmp, unique_mark("statusview"))
    run = WatchedRun(tmp)
    port = free_port()
    # the job holds after step 2 until the watcher printed its first look (it imports torch: on a loaded machine
    # it once came after the fault at step 25, and saw generation 1 first)
    hold = runner.out_dir / "hold-steps"
    hold.touch()
    env = runner.env(STEPS=str(STEPS), STEP_SLEEP="0.15", FAULT="3:25:sigkill", COLUMNS=str(COLUMNS), HOLD_AFTER="2",
                     SLOW_SAVE=f"1:10:{SAVE}")
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id",
              "statusview", "--recovery", "process", "--max-restarts", "3", "--warm-standby", "0",
              "--monitor-interval", "0.05", "--log-dir", str(tmp / "logs")]
    script = str(WORKERS / "elastic_train.py")
    other = runner.start([*common, "--node-rank", "1", "--rdzv-conf", "is_host=0", "--status", "off", script], env=env)
    terminal = Terminal(runner, [*common, "--node-rank", "0", "--rdzv-conf", "is_host=1", script], env)
    once = watcher = None
    try:
        deadline = time.monotonic() + JOB_DEADLINE
        while not terminal.finished() and time.monotonic() < deadline:
            screen = terminal.screen()
            if screen and (not run.screens or screen != run.screens[-1]):
                run.screens.append(screen)
            if watcher is None and "generation_started" in read_text(run.events_file):
                # the workers are starting: one look, and a watcher that follows the job to its end
                once = status(port)
                watcher = status(port, "--watch", "--json", "--interval", "0.2", into=tmp / "watch")
            if watcher is not None and hold.exists() and read_text(tmp / "watch.out").strip():
                hold.unlink()
            time.sleep(0.1)
        assert terminal.finished(), "node 0 did not finish in time"
        run.codes = [terminal.code(), other.proc.wait(timeout=30)]
        run.console = terminal.everything()
        run.output = run.console + "\n--- node 1 ---\n" + other.output
        if watcher is not None:
            out, err = once.communicate(timeout=30)
            assert once.returncode == 0, err
            run.status_text = out
            watcher.wait(timeout=30)
            out, err = (read_text(tmp / f"watch.{name}") for name in ("out", "err"))
            run.statuses = [json.loads(line) for line in out.splitlines()]
            assert watcher.returncode == 0, err  # the end wakes it before the store goes
    finally:
        terminal.close()
        for proc in (once, watcher):
            if proc is not None and proc.poll() is None:
                proc.kill()
        runner.kill_all()
    assert not marked_processes(runner.mark), "processes left behind"
    return run


def read_text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def status(port: int, *args: str, into: Path | None = None) -> subprocess.Popen:
    return ftrun_status(f"127.0.0.1:{port}", *args, into=into, env=dict(os.environ, COLUMNS=str(COLUMNS)))


def test_the_job_recovers(watched):
    assert watched.codes == [0, 0], watched.output
    assert "process-level repair into generation 1" in watched.output


def test_live_view_shows_the_nodes_the_repair_and_the_summary(watched):
    tmux()
    screens = watched.screens
    before = next((s for s in screens if "generation 0 · RUNNING" in s and " steps/s" in s), None)
    assert before is not None, "\n=====\n".join(screens[-5:])
    for node in (0, 1):  # a row per node: host, active, running, both ranks alive
        assert re.search(rf"^{node}\s+\S+\s+active\s+running\s+2/2", before, re.M), before
    assert re.search(r"^\s+3\s+1\s+\d+\s+", before, re.M), before  # rank 3's row: node 1, its pid
    during = [s for s in screens if "PROCESS-LEVEL REPAIR" in s]
    assert during, "no screen showed the repair under way"
    assert any(re.search(r"stopping\s+▸\s+env clear\s+▸\s+repair\s+▸\s+rollback", s) for s in during)
    assert any("fault" in s and "rank 3" in s and "SIGKILL" in s for s in during)
    after = screens[-1] if "job succeeded" in screens[-1] else watched.console
    assert re.search(r"repaired\s+generation 1 resumed training [0-9.]+s after the fault", after), after
    assert "job succeeded" in after and "1 process-level repair, median time to repair" in after
    for screen in screens:
        assert_not_torn(screen)


def assert_not_torn(screen: str) -> None:
    """Between the node table's header and the end of the rank table, only table rows."""
    lines = screen.splitlines()
    if not any(line.startswith("node  host") for line in lines):
        return
    start = next(i for i, line in enumerate(lines) if line.startswith("node  host"))
    for line in lines[start + 1:]:
        if line.startswith("last events") or not line.strip():
            break
        assert re.match(r"^(\d+|-)\s+\S+\s+(active|spare)\s|^\s*rank\s+node\s+pid|^\s+\d+\s+(\d+|-)\s+(\d+|-)\s", line), (
            f"a stray line inside the view: {line!r}\n{screen}")


def test_status_json_follows_the_running_job(watched):
    assert "run statusview" in watched.status_text and re.search(r"^0\s+\S+\s+active", watched.status_text, re.M)
    statuses = watched.statuses
    assert statuses, "ftrun status --watch --json printed nothing"
    for status in statuses:
        assert status["run_id"] == "statusview" and status["world_size"] == 4
        assert {n["node"] for n in status["nodes"] if n["role"] == "active"} == {0, 1}
        assert [r["rank"] for r in status["ranks"]] == [0, 1, 2, 3]
    phases = [s["phase"] for s in statuses]
    assert "running" in phases and REPAIR_PHASES & set(phases), phases
    assert statuses[0]["generation"] == 0 and statuses[-1]["generation"] == 1
    assert statuses[-1]["phase"] in ("exiting", "done") and statuses[-1]["exit_code"] == 0, statuses[-1]
    # rank 3 was replaced once: its two processes are the only pids shown for it (a watcher started under
    # load may not catch the first), the last is the one that finished, and it counts one restart
    started = {int(p.name.rsplit("-", 1)[1]) for p in (watched.tmp / "out").glob("pid-start-rank3-*")}
    finished = json.loads((watched.tmp / "out" / "rank3.json").read_text())["pid"]
    shown = [s["ranks"][3]["pid"] for s in statuses if s["ranks"][3].get("pid")]
    assert len(started) == 2 and set(shown) <= started and shown[-1] == finished, (started, shown)
    assert statuses[-1]["ranks"][3]["restarts"] == 1
    steps = [s["step"] for s in statuses if s["step"] is not None]
    assert steps and max(steps) > min(steps)
    # rank 1's save, from its heartbeat: shown while it lasts, then measured (its process outlives the repair)
    assert any((s["ranks"][1].get("saving") or 0) >= 1 for s in statuses), [s["ranks"][1] for s in statuses]
    assert max(s["ranks"][1].get("save_s") or 0 for s in statuses) >= SAVE, [s["ranks"][1] for s in statuses]


def test_event_log_schema(watched):
    path = watched.events_file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (path.parent.parent, path.parent, path.parent / "node0"):  # logs/, logs/<run id>/, its nodes
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    events = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses
    for event in events:
        assert set(REQUIRED) <= set(event), event
        assert event["kind"] in KINDS and isinstance(event["generation"], int) and isinstance(event["detail"], str)
    last_t: dict[str, float] = {}
    for event in events:  # times never go back within a source
        assert event["t"] >= last_t.get(event["source"], 0.0), event
        last_t[event["source"]] = event["t"]
    assert [e["elapsed"] for e in events] == sorted(e["elapsed"] for e in events)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "job_started" and kinds[-2:] == ["job_finished", "phase"]
    assert "straggler" not in kinds  # no rank is slow: a repair's replacement is none either
    fault = next(e for e in events if e["kind"] == "fault")
    assert (fault["rank"], fault["node"], fault["evidence"]["signal"]) == (3, 1, "SIGKILL")
    assert fault["source"] == "node1" and fault["evidence"]["pid"] > 0
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["level"] == "process" and decision["budget_left"] == 2
    phases = [e["phase"] for e in events if e["kind"] == "phase"]
    assert phases[:2] == ["stopping", "env_clear"] or phases[:2] == ["stopping", "repair"], phases
    assert "rollback" in phases and phases[-2:] == ["exiting", "done"]
    repair = next(e for e in events if e["kind"] == "repair_done")
    assert list(repair["durations"]) == ["detect", "stop", "env clear", "repair", "rollback"]
    assert repair["total"] == pytest.approx(sum(repair["durations"].values()), abs=1e-3)
    finished = next(e for e in events if e["kind"] == "job_finished")
    assert finished["exit_code"] == 0 and finished["restarts_used"] == 1 and finished["step"] == STEPS
    assert any(e["kind"] == "progress" and e["steps_per_s"] > 0 for e in events)


def test_report_prints_the_summary_again(watched, ftrun_cli):
    code, out, err = ftrun_cli("report", str(watched.events_file), "--html", str(watched.tmp / "report.html"))
    assert code == 0, err
    again = [line for line in (out + err).splitlines() if line and not line.startswith("wrote ")]
    printed = [line.removeprefix("ftrun: ") for line in watched.console.splitlines()]
    start = next(i for i, line in enumerate(printed) if line.startswith("job succeeded"))
    assert printed[start:start + len(again)] == again
    assert re.search(r"class=['\"]fault-marker['\"]", (watched.tmp / "report.html").read_text())
