"""The control store over real loopback sockets, and the orphan guardian as a real process."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ftrun.config import Endpoint
from ftrun.errors import RendezvousError, UsageError
from ftrun.keys import JobKeys
from ftrun.messages import Command, CommandKind
from ftrun.store import MULTI_GET_KEYS, MULTI_SET_BYTES, MULTI_SET_KEYS, connect_store, open_control_store
from tests.conftest import free_port


def test_first_agent_to_bind_hosts_and_the_next_joins():
    endpoint = Endpoint("127.0.0.1", free_port())
    host = open_control_store(endpoint, None, timeout=5)
    guest = open_control_store(endpoint, None, timeout=5)
    assert host.is_host and not guest.is_host
    keys = JobKeys("t")
    guest.append(keys.command_count, keys.command, Command(CommandKind.START, 0))
    host.append(keys.command_count, keys.command, Command(CommandKind.STOP, 0))
    assert [c.kind for c in host.read_from(keys.command_count, keys.command, Command, 0)] == [
        CommandKind.START, CommandKind.STOP,
    ]
    assert guest.try_get(Command, keys.command(7)) is None


def test_a_listener_that_is_not_a_store_is_refused_at_the_deadline():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        endpoint = Endpoint("127.0.0.1", other.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(RendezvousError, match="does not answer as a store"):
            connect_store(endpoint, timeout=1)
        assert time.monotonic() - started < 30  # a deadline, not a hang


class Counted:
    """A TCPStore client that keeps what each multi_set and multi_get sent."""

    def __init__(self, raw):
        self.raw, self.sent, self.asked = raw, [], []

    def multi_set(self, keys, texts):
        self.sent.append((list(keys), list(texts)))
        self.raw.multi_set(keys, texts)

    def multi_get(self, keys):
        self.asked.append(list(keys))
        return self.raw.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def test_many_keys_go_in_messages_the_store_s_server_handles_in_linear_time():
    """A multi_set of a whole job's keys (every rank's announcement, every node's restore plan) or a
    multi_get of every node's keys is split, in order; what is read back is what was written."""
    endpoint = Endpoint("127.0.0.1", free_port())
    host = open_control_store(endpoint, True, timeout=5)
    counted = Counted(host.raw)
    store = type(host)(counted, endpoint, is_host=True)
    keys = [f"k/{i}" for i in range(300)]
    texts = ["x" * (5_700 if 100 <= i < 130 else 1) for i in range(300)]  # 30 plans' worth among small ones
    store.set_each(keys, texts)
    assert [k for sent, _ in counted.sent for k in sent] == keys  # all of them, in order
    assert all(len(sent) <= MULTI_SET_KEYS for sent, _ in counted.sent)
    assert all(sum(map(len, sent + values)) <= MULTI_SET_BYTES for sent, values in counted.sent)
    for (sent, values), (after, more) in zip(counted.sent, counted.sent[1:]):  # and each as full as it may be
        assert len(sent) == MULTI_SET_KEYS or sum(map(len, sent + values + after[:1] + more[:1])) > MULTI_SET_BYTES
    assert [len(sent) for sent, _ in counted.sent] == [64, 47, 11, 64, 64, 50]  # 36 small + 11 big; 11; 8 + 56
    many = [f"k/{i % 300}" for i in range(2 * MULTI_GET_KEYS + 5)]
    assert store.readings([], many)[1] == [texts[i % 300] for i in range(len(many))]
    assert [len(asked) for asked in counted.asked] == [MULTI_GET_KEYS, MULTI_GET_KEYS, 5]
    store.set_each([], [])  # nothing: nothing sent
    assert len(counted.sent) == 6


LATE_CONNECT = """
import atexit, sys, threading

@atexit.register  # before ftrun.store's own: it runs after it
def left_connecting():
    print(*[t.name for t in threading.enumerate() if t.name == "ftrun-store-connect"])

from ftrun.config import Endpoint
from ftrun.errors import RendezvousError
from ftrun.store import connect_store

try:
    connect_store(Endpoint("127.0.0.1", int(sys.argv[1])), timeout=0.5)
except RendezvousError:
    print("gave up")
"""


def test_the_interpreter_ends_after_a_connect_left_in_tcpstore_s_constructor():
    """A store that answers only after connect_store gave up: the thread left in TCPStore's
    constructor finishes before the interpreter tears down (one that returned, or failed, meanwhile
    aborted the process: "terminate called without an active exception")."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.socket() as relay:
        relay.bind(("127.0.0.1", 0))
        relay.listen()
        threading.Thread(target=_relay_late, args=(relay, store.port, 1.0), daemon=True).start()
        done = subprocess.run([sys.executable, "-c", LATE_CONNECT, str(relay.getsockname()[1])],
                              capture_output=True, text=True, timeout=60)
    assert "terminate called" not in done.stderr
    # no connect thread left as the interpreter tears down
    assert (done.returncode, done.stdout) == (0, "gave up\n\n"), done.stderr


def _relay_late(relay: socket.socket, port: int, delay: float) -> None:
    """Hand each connection to ``port`` after ``delay``."""
    while True:
        try:
            client, _ = relay.accept()
        except OSError:
            return
        threading.Timer(delay, _join_late, args=(client, port)).start()


def _join_late(client: socket.socket, port: int) -> None:
    server = socket.create_connection(("127.0.0.1", port))
    for source, sink in ((client, server), (server, client)):
        threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            end.close()


def test_forced_host_on_a_taken_port_is_a_usage_error():
    endpoint = Endpoint("127.0.0.1", free_port())
    first = open_control_store(endpoint, True, timeout=5)
    with pytest.raises(UsageError, match="already in use"):
        open_control_store(endpoint, True, timeout=5)
    assert first.is_host


def test_guardian_kills_listed_groups_when_its_agent_goes():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    guardian = subprocess.Popen([sys.executable, "-m", "ftrun.agent.guardian"], stdin=subprocess.PIPE)
    guardian.stdin.write(f"+{victim.pid}\n".encode())
    guardian.stdin.flush()
    guardian.stdin.close()  # what the kernel does when the agent dies
    assert guardian.wait(timeout=30) == 0
    assert victim.wait(timeout=30) == -9
    assert not psutil.pid_exists(victim.pid)


def test_guardian_spares_groups_it_was_told_to_forget():
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        guardian = subprocess.Popen([sys.executable, "-m", "ftrun.agent.guardian"], stdin=subprocess.PIPE)
        guardian.communicate(f"+{keeper.pid}\n-{keeper.pid}\n".encode(), timeout=30)
        assert keeper.poll() is None
    finally:
        keeper.kill()
        keeper.wait()
