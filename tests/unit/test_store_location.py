"""A rank's control store that moves (ftrun/elastic/store_location.py): the controller's node is lost, a
successor hosts a new store and the agent names it in FTRUN_CONTROL_STORE_FILE. The location's waits run on a
fake clock that its sleeps move, so no test waits for a deadline; real TCPStores, each hosted in a child
process that the test kills with SIGKILL as a lost node would go."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from torch.distributed import TCPStore

from ftrun.auth import Signer
from ftrun.contract import Endpoint, WorkerEnv
from ftrun.elastic.backends import make_comm_backend
from ftrun.elastic.groups import GroupSet
from ftrun.elastic.link import ControlLink
from ftrun.elastic.store_location import FILE_POLL, MovableStore, StoreGone, StoreLocation
from ftrun.keys import JobKeys
from tests.conftest import FakeClock, name_store

#: generous deadlines, against hangs only (a child imports torch on a busy machine)
DEADLINE = 60.0


def client(endpoint: Endpoint) -> TCPStore:
    return TCPStore(endpoint.host, endpoint.port, is_master=False, timeout=datetime.timedelta(seconds=10))


def fake_time() -> tuple[FakeClock, dict]:
    """A fake clock, and the location's arguments that time it: its sleeps move the clock at once."""
    clock = FakeClock()
    return clock, {"clock": clock, "sleep": clock.advance}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE:g}s: {what}"
        time.sleep(0.05)


# -- the location alone --------------------------------------------------------------------------------


def test_the_file_names_the_store_once_it_holds_an_endpoint(tmp_path):
    file = tmp_path / "control_store"
    start = Endpoint("10.0.0.1", 29400)
    location = StoreLocation(start, str(file), timeout=5)
    assert location.endpoint == start and location.named() is None  # no file yet: FTRUN_CONTROL_STORE
    file.write_text("")
    assert location.named() is None
    name_store(file, Endpoint("10.0.0.2", 29500))
    assert location.named() == Endpoint("10.0.0.2", 29500)
    assert StoreLocation(start, str(file)).endpoint == Endpoint("10.0.0.2", 29500)  # the file wins at the start


def test_a_location_moves_once_the_file_names_another_store(tmp_path):
    file = tmp_path / "control_store"
    old, new = Endpoint("10.0.0.1", 29400), Endpoint("10.0.0.2", 29500)
    name_store(file, old)
    clock = FakeClock()
    began = clock.now

    def sleep(seconds: float) -> None:  # the successor names its store 0.2s into the wait
        clock.advance(seconds)
        if clock.now - began >= 0.2:
            name_store(file, new)

    location = StoreLocation(old, str(file), timeout=DEADLINE, clock=clock, sleep=sleep)
    assert location.successor(old) == new
    assert clock.now - began == pytest.approx(0.2, abs=FILE_POLL)  # it read the file until it named the new
    assert location.endpoint == new and location.back_at == 0.0  # moved; back once a connection reached it
    assert location.successor(old) == new  # a connection that finds the old store gone later follows at once
    clock.advance(1.0)
    location.reached(new)
    assert location.back_at == clock.now


def test_a_store_not_yet_listening_is_tried_again_until_the_file_names_another_or_time_runs_out(tmp_path):
    file = tmp_path / "control_store"
    old, slow, other = Endpoint("10.0.0.1", 29400), Endpoint("10.0.0.2", 29500), Endpoint("10.0.0.3", 29600)
    name_store(file, slow)
    clock, timed = fake_time()
    location = StoreLocation(old, str(file), timeout=0.3, **timed)
    assert location.endpoint == slow  # the file named it already at the start
    assert location.try_again(slow) == slow  # named, and time is left: the same store once more
    name_store(file, other)
    clock.advance(0.2)
    assert location.try_again(slow) == other
    assert location.try_again(other) == other  # time is left still
    clock.advance(0.1)
    with pytest.raises(SystemExit, match="named no other within 0.3s"):  # the clock ran from the first failure
        location.try_again(other)


def test_a_location_gives_up_in_one_line_when_the_file_names_no_other_store(tmp_path):
    file = tmp_path / "control_store"
    gone = Endpoint("10.0.0.1", 29400)
    name_store(file, gone)
    clock, timed = fake_time()
    began = clock.now
    location = StoreLocation(gone, str(file), timeout=0.3, rank=3, **timed)
    with pytest.raises(SystemExit, match=rf"rank 3: the control store at {gone} is gone, and {file} named no "
                                         r"other within 0\.3s \(FTRUN_STORE_TIMEOUT\)"):
        location.successor(gone)
    assert clock.now - began == pytest.approx(0.3, abs=FILE_POLL)  # it read the file until the timeout, no longer
    with pytest.raises(StoreGone):  # said once; later calls (the interpreter's end) fail at once
        location.successor(gone)


def test_without_a_file_the_store_never_moves():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    connection = StoreLocation(Endpoint("127.0.0.1", server.port)).connect(timeout=DEADLINE)
    assert isinstance(connection, TCPStore)


# -- real stores -----------------------------------------------------------------------------------------


def test_a_connection_whose_store_is_killed_gives_up_after_the_store_timeout(host_store, tmp_path):
    host = host_store()
    endpoint = host.endpoint
    file = tmp_path / "control_store"
    name_store(file, endpoint)
    store = StoreLocation(endpoint, str(file), timeout=0.5, **fake_time()[1]).connect(timeout=DEADLINE)
    assert isinstance(store, MovableStore)
    store.set("key", "value")
    host.kill()
    with pytest.raises(SystemExit, match="named no other within 0.5s"):
        store.check(["key"])


def test_a_link_carries_on_through_the_successor_s_store(host_store, tmp_path):
    """Store A dies; B starts and the file names it: await_target, called while A is gone, returns the
    generation announced in B; the heartbeat and the repair watch carry on there, and so does GroupSet."""
    host_a, host_b = host_store(), host_store()  # B starts now (importing torch takes a while), named later
    a = host_a.endpoint
    file = tmp_path / "control_store"
    name_store(file, a)
    env = WorkerEnv(rank=0, local_rank=0, world_size=1, run_id="moving", generation=0, control_store=str(a),
                    replacement=False, heartbeat_timeout=30, control_store_file=str(file), store_timeout=DEADLINE)
    keys = JobKeys(env.run_id)
    link = ControlLink(env, Signer(), collective_timeout=DEADLINE, fault_wait=0.2)
    groups = GroupSet(make_comm_backend("gloo"), link.store.raw, keys.process_group, DEADLINE)
    link.generation = 0
    link.start(groups, progress=lambda: 7)
    try:
        in_a = client(a)
        wait_until(lambda: in_a.check([keys.rank_heartbeat(0)]), "a heartbeat in store A")
        host_a.kill()

        def succeed() -> None:  # the successor agent: its new store, with its announcement, named in the file
            client(host_b.endpoint).set(keys.target_generation, "1")
            time.sleep(0.5)  # longer than fault_wait: the wait's clock stops while no store answers
            name_store(file, host_b.endpoint)

        threading.Thread(target=succeed, name="successor").start()
        assert link.await_target(above=0, timeout=0.2) == 1
        b = host_b.endpoint
        in_b = client(b)
        wait_until(lambda: in_b.check([keys.rank_heartbeat(0), keys.rank_progress(0)]), "the heartbeat in store B")
        assert in_b.get(keys.rank_progress(0)) == b"7"
        assert link.location.endpoint == b
        assert groups.store is link.store.raw and groups.store.endpoint == b
        groups.store.set("through-the-groups", "yes")
        assert in_b.get("through-the-groups") == b"yes"
    finally:
        link.let_go()
    assert not link._heartbeat.is_alive() and not link._watcher.is_alive()


RANK_WITHOUT_SUCCESSOR = """
import sys, time
from ftrun.auth import Signer
from ftrun.contract import WorkerEnv
from ftrun.elastic.backends import make_comm_backend
from ftrun.elastic.groups import GroupSet
from ftrun.elastic.link import ControlLink
env = WorkerEnv.from_environ()
link = ControlLink(env, Signer(), collective_timeout=60, fault_wait=1)
link.generation = 0
link.start(GroupSet(make_comm_backend("gloo"), link.store.raw, link.keys.process_group, 60), progress=lambda: 0)
print("started", flush=True)
time.sleep(120)  # training peer to peer: no store call from the main thread
"""


def test_a_training_rank_whose_store_never_comes_back_ends_with_one_line(host_store, tmp_path):
    host = host_store()
    endpoint = host.endpoint
    file = tmp_path / "control_store"
    name_store(file, endpoint)
    env = WorkerEnv(rank=2, local_rank=0, world_size=4, run_id="moving", generation=0, control_store=str(endpoint),
                    replacement=False, heartbeat_timeout=30, control_store_file=str(file), store_timeout=1)
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(RANK_WITHOUT_SUCCESSOR)],
                            env={**os.environ, **env.to_environ()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout.readline() == "started\n"
        host.kill()
        _, stderr = rank.communicate(timeout=DEADLINE)
    finally:
        rank.kill()
        rank.wait()
    assert rank.returncode == 1
    lines = [line for line in stderr.splitlines() if line.startswith("ftrun.elastic:")]
    assert lines == [f"ftrun.elastic: rank 2: the control store at {endpoint} is gone, and {file} named no other "
                     "within 1s (FTRUN_STORE_TIMEOUT)"], stderr
    assert "Traceback" not in stderr
