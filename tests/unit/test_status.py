"""The status snapshot (built from a real store), its rendering, and the event log."""

from __future__ import annotations

import datetime
import json
import os
import re
import select
import stat
import threading
import time

import pytest
from rich.console import Console

from ftrun.config import Endpoint
from ftrun.controller.board import Rate, StatusBoard
from ftrun.controller.states import JobView, Level, Phase
from ftrun.events import EventLog, read_events
from ftrun.keys import JobKeys
from ftrun.messages import DeviceState, NodeSlot, NodeStatus, RankState, WorkerFailure
from ftrun.live_view import StatusView, live_wanted, plain_line, render
from ftrun.step_times import CollectiveWait, StepTimes, collective_text
from ftrun.store import ControlStore
from tests.conftest import ftrun_status

KEYS = JobKeys("job1")
NODES = {0: NodeSlot(0, "a0", "host-a", 2, 0), 1: NodeSlot(1, "a1", "host-b", 2, 2)}
SPARE = NodeSlot(-1, "s0", "host-c", 2, -1)


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return ControlStore(raw, Endpoint("127.0.0.1", raw.port), is_host=True)


def publish_node(store, agent: str, host: str, first: int, alive=(True, True), devices=(), steps=(None, None), ages=(None, None)):
    """An agent's status as it publishes it: its ranks summed up, with their steps and heartbeats' ages."""
    ranks = tuple(RankState(first + i, i, 100 + first + i, up, 1 if not up else 0, step, age)
                  for i, (up, step, age) in enumerate(zip(alive, steps, ages)))
    store.set(KEYS.agent_status(agent), NodeStatus(agent, host, 0, ranks, 1, devices))


def snapshot(store, view: JobView, events: EventLog | None = None, saved: dict | None = None) -> dict:
    board = StatusBoard(store, KEYS, events or EventLog(), "job1")
    return board.refresh(view, NODES, [SPARE], board.started, saved)


def test_board_is_built_from_one_status_per_node(store):
    publish_node(store, "a0", "host-a", 0, devices=(DeviceState(0), DeviceState(1, "isolated", "SeparateNPU")),
                 steps=(7, 7), ages=(0.0, 0.4))
    publish_node(store, "a1", "host-b", 2, alive=(True, False), steps=(6, None), ages=(1.2, None))
    for rank in range(4):  # what the ranks write themselves is the agents' to read, not the controller's
        store.set_text(KEYS.rank_progress(rank), "1")
    view = JobView(node_count=2, max_restarts=3, world_size=4, restarts_used=1, generation=1)
    s = snapshot(store, view)
    assert (s["phase"], s["generation"], s["step"], s["world_size"]) == ("running", 1, 6, 4)
    assert (s["restorable_step"], s["checkpoint_step"]) == (None, None)  # no snapshots
    saved = snapshot(store, view, saved={"restorable_step": 6, "checkpoint_step": 4})
    assert (saved["restorable_step"], saved["checkpoint_step"]) == (6, 4)
    rows = {(n["role"], n["host"]): n for n in s["nodes"]}
    assert rows["active", "host-a"]["devices"][1] == {"index": 1, "health": "isolated", "reason": "SeparateNPU"}
    assert (rows["active", "host-b"]["ranks_alive"], rows["active", "host-b"]["ranks_total"]) == (1, 2)
    assert rows["spare", "host-c"]["state"] == "standing by"
    rank3 = s["ranks"][3]
    assert (rank3["pid"], rank3["alive"], rank3["restarts"], rank3["step"], rank3["heartbeat_age"]) == (103, False, 1, None, None)
    assert s["ranks"][0]["step"] == 7 and s["ranks"][0]["heartbeat_age"] == 0.0
    assert (s["ranks"][2]["step"], s["ranks"][2]["heartbeat_age"], s["ranks"][2]["node"]) == (6, 1.2, 1)
    json.dumps(s)  # what ftrun status reads: plain data only


def test_board_shows_the_collective_each_rank_waits_in_for_how_long_and_those_in_none(store):
    since = time.time() - 12.0
    waiting = collective_text(CollectiveWait("all_reduce", "0", 4, since), 100)
    ranks = (RankState(0, 0, 100, True, step=9, collective=waiting),
             RankState(1, 1, 101, True, step=9, collective=collective_text(None, 101)))
    store.set(KEYS.agent_status("a0"), NodeStatus("a0", "host-a", 0, ranks, 1, ()))
    s = snapshot(store, JobView(node_count=2, max_restarts=3, world_size=4))
    first, second, third = s["ranks"][:3]
    wait = first["collective"]
    assert (wait["op"], wait["group"], wait["group_size"]) == ("all_reduce", "0", 4)
    assert 12.0 <= wait["for"] < 60  # at the snapshot's time, from the rank's word of when it began
    assert second["collective"] == {}  # in none: computing
    assert "collective" not in third  # node 1 sent no status: no word


def test_board_shows_the_checkpoint_a_rank_saves_and_its_longest_save(store):
    since = time.time() - 30.0
    saving = collective_text(None, 100, saving=since)
    times = StepTimes(20, 0.1, 0.08, 0.02, 100, save=31.5).to_text()
    ranks = (RankState(0, 0, 100, True, step=9, times=times, collective=saving),
             RankState(1, 1, 101, True, step=9, collective=collective_text(None, 101)))
    store.set(KEYS.agent_status("a0"), NodeStatus("a0", "host-a", 0, ranks, 1, ()))
    s = snapshot(store, JobView(node_count=2, max_restarts=3, world_size=4))
    first, second = s["ranks"][:2]
    assert 30.0 <= first["saving"] < 90 and first["collective"] == {}  # at the snapshot's time, from its word
    assert first["save_s"] == 31.5 and first["step_s"] == 0.1
    assert second["saving"] is None and second["save_s"] is None


def test_board_shows_lost_and_vacant_nodes_and_the_repair(store):
    view = JobView(node_count=3, max_restarts=3, world_size=4, lost=frozenset({2}), phase=Phase.REPAIR,
                   level=Level.PROCESS, clearing=frozenset({1}), reason="rank 3 killed")
    s = snapshot(store, view)
    states = {n["node"]: n["state"] for n in s["nodes"] if n["role"] == "active"}
    assert states == {0: "waiting", 1: "repairing", 2: "lost"}
    assert (s["phase"], s["level"]) == ("repair", "process")


def test_rate_measures_a_window_and_starts_again_after_a_rollback():
    rate = Rate()
    assert rate.add(0.0, 10) == 0.0
    assert rate.add(1.0, 12) == pytest.approx(2.0)
    assert rate.add(2.0, 16) == pytest.approx(3.0)
    assert rate.add(3.0, 5) == 0.0  # rolled back: no negative rate
    assert rate.add(4.0, 6) == pytest.approx(1.0)
    for t in range(5, 20):
        last = rate.add(float(t), 6 + 10 * (t - 4))
    assert last == pytest.approx(10.0)  # the slow start has left the window


def example(phase: str = "running", width_events: int = 3) -> dict:
    events = EventLog()
    events.emit("generation_started", 0, "generation 0 starts with 4 ranks")
    events.fault(WorkerFailure(3, 1, 1, "host-b", 55, None, "SIGKILL", timestamp=1.0, generation=0))
    events.emit("repair_done", 1, "generation 1 resumed training 0.81s after the fault " + "x" * 200, level="process")
    return {"run_id": "job1", "time": 0, "elapsed": 3725.0, "generation": 1, "phase": phase,
            "level": "process" if phase != "running" else "", "phase_for": 0.4, "recovery": "process",
            "restarts_used": 1, "max_restarts": 3, "world_size": 4, "step": 42, "steps_per_s": 12.5,
            "reason": "rank 3 killed", "exit_code": None,
            "nodes": [{"node": 0, "host": "host-a", "agent": "a0", "role": "active", "state": "running",
                       "ranks_total": 2, "ranks_alive": 2, "standbys": 1,
                       "devices": [{"index": 0, "health": "ok", "reason": ""}]},
                      {"node": -1, "host": "host-c", "agent": "s0", "role": "spare", "state": "standing by",
                       "ranks_total": 0, "ranks_alive": 0, "standbys": 1, "devices": []}],
            "ranks": [{"rank": r, "node": 0, "pid": 100 + r, "step": 42, "heartbeat_age": 0.5, "alive": True,
                       "restarts": 0} for r in range(4)],
            "events": events.events[:width_events]}


def text_of(renderable, width: int) -> str:
    console = Console(record=True, width=width, height=40, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


def test_view_shows_the_job_line_nodes_ranks_and_events():
    text = text_of(render(example(), 120, 40), 120)
    assert "run job1 · generation 1 · RUNNING · step 42 · 12.5 steps/s · budget 2/3 left · up 1:02:05" in text
    assert "devices" in text and "0:ok" in text and "host-c" in text and "spare" in text
    assert re.search(r"rank\s+node\s+pid\s+step\s+heartbeat\s+restarts", text) and " 103 " in text
    assert "fault" in text and "killed by SIGKILL" in text and "repaired" in text
    assert all(len(line) <= 120 for line in text.splitlines())  # long details are cut, not wrapped


def test_the_view_says_where_a_restart_would_resume():
    s = dict(example(), restorable_step=40, checkpoint_step=30)
    assert "step 42 · 12.5 steps/s · restorable at step 40 · checkpoint step 30 · budget" in text_of(render(s, 200), 200)
    assert ", restorable at step 40, checkpoint step 30, 2/4 ranks alive" in plain_line(s)
    assert "restorable" not in text_of(render(example(), 200), 200) + plain_line(example())


def test_view_adapts_to_a_narrow_short_terminal():
    text = text_of(render(example(), 70, 12), 70)
    assert "devices" not in text and "host-a" in text
    assert "pid" not in text  # no room for the rank rows
    assert all(len(line) <= 70 for line in text.splitlines())  # cut, never wrapped: the view keeps its height
    assert text.splitlines()[0] == "ftrun run job1 · generation 1 · RUNNING · step 42 · 12.5 steps/s · bu…"


def test_view_during_a_repair_shows_the_phase_track():
    text = text_of(render(example("rollback"), 120, 40), 120)
    assert "PROCESS-LEVEL REPAIR: rollback (0.4s)" in text
    assert "stopping  ▸  env clear  ▸  repair  ▸  rollback" in text and "rank 3 killed" in text


def test_view_before_the_rendezvous_and_the_plain_line():
    assert "waiting for the nodes" in text_of(render({}), 80)
    line = plain_line(example())
    assert line == "generation 1, running, step 42 (12.5 steps/s), 2/4 ranks alive, 1 spare, budget 2/3 left, up 1:02:05"


def test_view_modes_off_the_terminal():
    assert not live_wanted("auto") and live_wanted("live") and not live_wanted("plain")
    console = Console(file=open(os.devnull, "w"))
    for mode, kind in (("auto", "plain"), ("plain", "plain"), ("off", "off")):
        view = StatusView(dict, mode, console)
        assert view.mode == kind
        view.start()
        view.stop()


def test_a_watcher_wakes_for_the_end_of_the_job(store):
    """``ftrun status --watch`` waits on the store between reads, so the job's end wakes it even with a long
    --interval, and it prints the last state before the store goes with the job."""
    store.set_text(KEYS.status, json.dumps(example()))
    watcher = ftrun_status(f"127.0.0.1:{store.endpoint.port}", "--run-id", "job1", "--watch", "--json", "--interval", "600")
    try:
        ready, _, _ = select.select([watcher.stdout], [], [], 60)
        assert ready, "the watcher printed nothing"
        first = json.loads(watcher.stdout.readline())  # it has read once: it waits for its next read now
        final = dict(example("exiting"), exit_code=0, reason="every worker finished")
        store.set_text(KEYS.status, json.dumps(final))
        store.set_text(KEYS.status_final, "1")
        out, err = watcher.communicate(timeout=60)  # an --interval sleep would be 600 s
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    phases = [first["phase"]] + [json.loads(line)["phase"] for line in out.splitlines()]
    assert phases == ["running", "exiting"], phases


def test_event_log_file_is_private_and_times_never_go_back(tmp_path, monkeypatch):
    path = tmp_path / "logs" / "run" / "events.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("an older job's events\n")
    log = EventLog(str(path))
    clock = iter([100.0, 99.0, 101.0])
    monkeypatch.setattr("ftrun.events.time.time", lambda: next(clock))
    for kind in ("job_started", "phase", "job_finished"):
        log.emit(kind, 0, kind)
    log.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    events = read_events(str(path))
    assert [e["kind"] for e in events] == ["job_started", "phase", "job_finished"]  # the older job's are gone
    assert [e["t"] for e in events] == [100.0, 100.0, 101.0]
    with pytest.raises(ValueError, match="unknown event kind"):
        EventLog().emit("rumour", 0)


def test_reading_a_damaged_event_log(tmp_path):
    path = tmp_path / "events.jsonl"
    good = json.dumps({"t": 1.0, "elapsed": 0.5, "source": "controller", "kind": "phase", "generation": 0,
                       "node": None, "rank": None, "host": None, "detail": ""})
    path.write_text(f"{good}\n{good}\n{{\"kind\": \"pha")  # the writer died mid-line: the last line goes
    assert len(read_events(str(path))) == 2
    path.write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_events(str(path))
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1 is not an ftrun event"):
        read_events(str(path))
    path.write_text('{"kind": "phase"}\n')
    with pytest.raises(ValueError, match=r"line 1 is not an ftrun event \(no t, elapsed, source, generation"):
        read_events(str(path))


def test_status_of_a_refused_port_answers_at_once_without_waiting_for_its_timeout(monkeypatch):
    """ftrun status --rdzv-endpoint host:PORT where nothing listens waited its whole --timeout."""
    import ftrun.store
    from ftrun.cli.status import StatusReader, StoreFinder
    from ftrun.config import Endpoint
    from ftrun.errors import RendezvousError
    from tests.conftest import free_port

    def no_retry(seconds):
        raise AssertionError("ftrun status retried a refused connection")

    monkeypatch.setattr(ftrun.store.time, "sleep", no_retry)
    with pytest.raises(RendezvousError, match="refused"):
        StatusReader(StoreFinder(Endpoint("127.0.0.1", free_port())), "", timeout=600)


def test_a_slow_first_import_of_torch_leaves_the_store_s_handshake_its_whole_deadline(store, monkeypatch):
    """ftrun status --watch printed nothing for 60 s on a loaded 2-core run: its first import of torch, made
    in the handshake's guard (3 s), took longer than the guard and then than the whole --timeout (6 s
    measured at a load of 8.6), and it left with "does not answer as a store" before its first line. Here
    the first import of torch.distributed takes 0.6 s, and every other thread's waits for it, as Python's
    module lock makes them; the store answers at once."""
    import builtins
    import time

    from ftrun.store import connect_store

    real_import, imported, first = builtins.__import__, threading.Event(), []

    def slow_import(name, *args, **kwargs):
        if name == "torch.distributed" and not imported.is_set():
            if not first:
                first.append(threading.get_ident())
                time.sleep(0.6)
                imported.set()
            elif first[0] != threading.get_ident():
                imported.wait()
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", slow_import)
    client = connect_store(store.endpoint, timeout=0.3, refused_is_final=True)
    monkeypatch.undo()
    store.set_text(KEYS.status, json.dumps({"step": 5}))
    assert client.get(KEYS.status) == b'{"step": 5}'


def test_a_known_total_gives_a_progress_bar_and_an_eta(store):
    publish_node(store, "a0", "host-a", 0, steps=(25, 25), ages=(0.1, 0.1))
    publish_node(store, "a1", "host-b", 2, steps=(25, 25), ages=(0.1, 0.1))
    view = JobView(node_count=2, max_restarts=3, world_size=4)
    s = snapshot(store, view)
    assert (s["total_steps"], s["eta_s"]) == (None, None)  # the script has not said its total
    assert "step 25 · " in text_of(render(s, 200), 200)
    store.set_text(KEYS.total_steps, "100")
    s = dict(snapshot(store, view), steps_per_s=5.0, eta_s=15.0)  # the rate needs two refreshes apart
    assert snapshot(store, view)["total_steps"] == 100
    assert "step 25/100 ━━━━━━━━━━━━━━━━━━━━ 5.0 steps/s · ETA 0:00:15" in text_of(render(s, 200), 200)
    assert "step 25/100 (5.0 steps/s, ETA 0:00:15)" in plain_line(s)
    json.dumps(s)


@pytest.mark.parametrize("step, total, rate, expected", [(25, 100, 5.0, 15.0), (25, 100, 0.0, None), (None, 100, 5.0, None),
                                                         (25, None, 5.0, None), (100, 100, 0.0, 0.0)])
def test_eta(step, total, rate, expected):
    from ftrun.controller.board import eta

    assert eta(step, total, rate) == expected


# --- a view that follows the controller (--rdzv-backend etcd) ---------------------------------------------------

class MovingFinder:
    """etcd as a view reads it: each look names the next of ``answers`` (a Location, or None while no
    controller is in office); the last one stays."""

    moves = True

    def __init__(self, *answers):
        self.answers = list(answers)
        self.looks = 0

    def __call__(self):
        from ftrun.errors import RendezvousError

        answer = self.answers[min(self.looks, len(self.answers) - 1)]
        self.looks += 1
        if answer is None:
            raise RendezvousError("job 'job1' has no controller in etcd")
        return answer

    def revision(self) -> int:
        return 1

    def wait(self, after_revision: int, timeout: float) -> None:
        import time

        time.sleep(min(timeout, 0.01))


def hosted_store(status: dict | None = None) -> ControlStore:
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    store = ControlStore(raw, Endpoint("127.0.0.1", raw.port), is_host=True)
    if status is not None:
        store.set_text(KEYS.status, json.dumps(status))
    return store


def located(store: ControlStore, host: str):
    from ftrun.cli.status import Location

    return Location(store.endpoint, host)


def test_follow_waits_out_the_old_store_record_and_no_leader_then_reads_the_successors_store():
    from ftrun.cli.status import Location, StatusReader
    from tests.conftest import free_port

    old, new = hosted_store({"step": 5}), hosted_store({"step": 6})
    gone = Location(Endpoint("127.0.0.1", free_port()), "127.0.0.9")
    # the lease of the store that went has not lapsed yet; then no one leads; then a successor whose store went
    # at once (refused); then the one that answers
    find = MovingFinder(located(old, "127.0.0.2"), located(old, "127.0.0.2"), None, gone, located(new, "127.0.0.3"))
    reader = StatusReader(find, "job1", timeout=5)  # type: ignore[arg-type]
    assert reader.read() == {"step": 5}
    assert reader.follow(deadline=10) == "127.0.0.3"
    assert reader.read() == {"step": 6} and reader.endpoint == new.endpoint and find.looks == 5


def test_follow_gives_up_at_its_deadline_while_etcd_names_the_store_that_went():
    import time

    from ftrun.cli.status import StatusReader

    old = hosted_store({"step": 5})
    reader = StatusReader(MovingFinder(located(old, "127.0.0.2")), "job1", timeout=5)  # type: ignore[arg-type]
    began = time.monotonic()
    assert reader.follow(deadline=0.3) == ""
    assert time.monotonic() - began < 2 and reader.endpoint == old.endpoint


def test_follow_waits_for_the_successors_status_before_it_reads_there():
    """A successor publishes its store in etcd before its controller took over and wrote the status: a
    read there in between said 'has no status' and ended the watch."""
    import threading

    from ftrun.cli.status import StatusReader

    old, new = hosted_store({"step": 5}), hosted_store()
    reader = StatusReader(MovingFinder(located(old, "127.0.0.2"), located(new, "127.0.0.3")), "job1", timeout=5)  # type: ignore[arg-type]
    threading.Timer(0.3, lambda: new.set_text(KEYS.status, json.dumps({"step": 6}))).start()
    assert reader.follow(deadline=10) == "127.0.0.3" and reader.read() == {"step": 6}


class StoppedHostClient:
    """A TCPStore client whose store's host stopped (SIGSTOP) once it had connected: every call waits for
    good (a real one's check was still waiting after 200 s) until the test lets it go."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.released.wait()
        raise RuntimeError("Connection reset by peer")

    get = wait = check


def test_a_moving_store_that_stops_answering_as_the_view_opens_it_is_given_up_within_the_timeout(monkeypatch):
    """The view's first read of a store found through etcd (is it a --master-port?) was a bare TCPStore call:
    at a controller stopped just as the view connected, it waited for good, where every later call gives up
    within --timeout and the view looks for the next controller."""
    import ftrun.store
    from ftrun.cli.status import Location, StatusReader
    from ftrun.store import StoreUnavailable

    client, outcome = StoppedHostClient(), []
    monkeypatch.setattr(ftrun.store, "connect_store", lambda *args, **kwargs: client)

    def open_view() -> None:
        try:
            StatusReader(MovingFinder(Location(Endpoint("127.0.0.2", 29400), "127.0.0.2")), "job1",  # type: ignore[arg-type]
                         timeout=0.2)
        except Exception as e:
            outcome.append(e)

    opening = threading.Thread(target=open_view, name="test-open-view", daemon=True)
    opening.start()
    opening.join(5)
    waited = not outcome
    client.released.set()  # the thread left in the read goes
    opening.join(5)
    assert not waited, "the view's first read waits on a stopped store"
    assert len(outcome) == 1 and isinstance(outcome[0], StoreUnavailable), outcome


def test_a_c10d_store_is_not_followed(store):
    from ftrun.cli.status import StatusReader, StoreFinder

    store.set_text(KEYS.status, json.dumps({"step": 5}))
    reader = StatusReader(StoreFinder(store.endpoint), "job1", timeout=5)
    assert reader.follow(deadline=600) == ""  # at once: its store never moves


class MovingReader:
    """A StatusReader whose store goes once (after the first snapshot) and is found again on ``host``."""

    def __init__(self, snapshots: list[dict], host: str):
        self.snapshots, self.host = snapshots, host
        self.endpoint = Endpoint("127.0.0.2", 29500)
        self.find = MovingFinder()
        self.reads = 0
        self.follows = 0

    def pause(self, seconds: float) -> bool:
        return False

    def read(self) -> dict:
        from ftrun.store import StoreUnavailable

        self.reads += 1
        if self.reads == 1:
            raise StoreUnavailable(f"the control store at {self.endpoint} stopped answering")
        return self.snapshots[self.reads - 2]

    def follow(self, deadline: float) -> str:
        self.follows += 1
        return self.host


def status_of(step: int, phase: str, host: str) -> dict:
    return {"phase": phase, "step": step, "controller": {"host": host, "moves": int(host != "127.0.0.2")}}


def test_watch_says_once_that_the_controller_moved_and_goes_on_with_the_new_ones_status(capsys):
    from ftrun.cli.status import watch_status

    first = status_of(5, "running", "127.0.0.2")
    reader = MovingReader([status_of(9, "running", "127.0.0.3"), status_of(40, "done", "127.0.0.3")], "127.0.0.3")
    assert watch_status(reader, first, as_json=True, interval=0.1) == 0  # type: ignore[arg-type]
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [(s["step"], s["controller"]["host"]) for s in lines] == [(5, "127.0.0.2"), (9, "127.0.0.3"), (40, "127.0.0.3")]
    assert captured.err.count("the controller moved to 127.0.0.3; following it") == 1


def test_watch_gives_up_with_the_stores_last_state_when_no_controller_came(store, capsys):
    from ftrun.cli.status import watch_status
    from ftrun.errors import RendezvousError

    last = snapshot(store, JobView(node_count=2, max_restarts=3, world_size=4))
    reader = MovingReader([], "")
    with pytest.raises(RendezvousError, match=r"at 127.0.0.2:29500 went away \(the job ended, or its host is gone\); "
                                              r"etcd named no other controller within 60s; last seen: generation 0"):
        watch_status(reader, last, as_json=True, interval=0.1)  # type: ignore[arg-type]
    assert "moved" not in capsys.readouterr().err
    assert reader.follows == 1


def test_status_and_top_find_a_job_through_the_same_four_options():
    from ftrun.cli.status import status_command
    from ftrun.cli.top import top_command

    def where(command) -> list[tuple]:
        return [(p.name, p.opts, p.secondary_opts, p.default, p.required, p.metavar)
                for p in command.params if p.name in {"endpoint", "run_id", "backend", "rdzv_conf"}]

    assert [name for name, *_ in where(status_command)] == ["endpoint", "run_id", "backend", "rdzv_conf"]
    assert where(status_command) == where(top_command)
