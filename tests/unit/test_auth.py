"""Signed control messages, the token file, and where the stores listen."""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading

import pytest

from ftrun.auth import Forged, Signer, read_token
from ftrun.config import Endpoint
from ftrun.errors import UsageError
from ftrun.keys import JobKeys
from ftrun.messages import Command, CommandKind, JoinRecord, NodeLayout, Placement, to_json
from ftrun.rendezvous import RendezvousPolicy, gather
from ftrun.store import ControlStore, bind_address, host_store

TOKEN = b"0123456789abcdef0123456789abcdef"
KEYS = JobKeys("j")


def test_sealed_messages_open_only_with_the_token_and_under_their_key():
    signer = Signer(TOKEN)
    sealed = signer.seal("ftrun/j/cmd/3", "hello")
    assert signer.open("ftrun/j/cmd/3", sealed.encode()) == "hello"
    with pytest.raises(Forged, match="wrongly signed"):
        signer.open("ftrun/j/cmd/4", sealed)  # the same message copied to another key
    with pytest.raises(Forged, match="wrongly signed"):
        Signer(b"another secret of some length").open("ftrun/j/cmd/3", sealed)
    tampered = json.loads(sealed) | {"body": "goodbye"}
    with pytest.raises(Forged, match="wrongly signed"):
        signer.open("ftrun/j/cmd/3", json.dumps(tampered))
    for unsigned in ("hello", '{"body": "hello"}', "[1]", '{"mac": 3, "body": "x"}', b"\xff\xfe"):
        with pytest.raises(Forged):
            signer.open("ftrun/j/cmd/3", unsigned)


def test_without_a_token_messages_pass_through():
    assert Signer().seal("k", "body") == "body" and Signer().open("k", b"body") == "body"
    assert not Signer().enabled and Signer(TOKEN).enabled


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return raw


def test_store_ignores_forged_messages_and_logs_each_key_once(store, caplog):
    ours = ControlStore(store, Endpoint("127.0.0.1", store.port), True, Signer(TOKEN))
    ours.append(KEYS.command_count, KEYS.command, Command(CommandKind.START, 0))
    forged = ControlStore(store, Endpoint("127.0.0.1", store.port), True, Signer(b"not the job's token at all"))
    forged.append(KEYS.command_count, KEYS.command, Command(CommandKind.EXIT, 0, exit_code=1))
    index = store.add(KEYS.command_count, 1) - 1  # unsigned, straight into the store
    store.set(KEYS.command(index), to_json(Command(CommandKind.STOP, 0)))
    store.set(KEYS.command(store.add(KEYS.command_count, 1) - 1), b"\x00garbage")
    ours.append(KEYS.command_count, KEYS.command, Command(CommandKind.EXIT, 0))
    store.add(KEYS.command_count, 1)  # reserved, never written (yet)
    items = ours.read_from(KEYS.command_count, KEYS.command, Command, 0)
    assert [c.kind if c else None for c in items] == [CommandKind.START, None, None, None, CommandKind.EXIT]
    ours.read_from(KEYS.command_count, KEYS.command, Command, 0)
    warnings = [r.getMessage() for r in caplog.records if "ignoring a message" in r.getMessage()]
    assert len(warnings) == 3 and "wrongly signed" in warnings[0] and "unsigned" in warnings[1]
    store.set(KEYS.layout, to_json(NodeLayout()))
    assert ours.try_get(NodeLayout, KEYS.layout) is None
    ours.set_text(KEYS.admission("a"), "spare", signed=True)
    assert ours.try_text(KEYS.admission("a"), signed=True) == "spare"
    store.set(KEYS.admission("b"), "spare")
    assert ours.try_text(KEYS.admission("b"), signed=True) == ""


def test_a_message_that_is_not_json_is_ignored_even_unsigned(store):
    plain = ControlStore(store, Endpoint("127.0.0.1", store.port), True)
    store.set(KEYS.layout, b"{not json")
    assert plain.try_get(NodeLayout, KEYS.layout) is None  # a crash of the controller would be worse


def write_token(path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    os.chmod(path, mode)
    return str(path)


def test_token_file_rules(tmp_path):
    assert read_token(write_token(tmp_path / "t", b"  " + TOKEN + b"\n")) == TOKEN
    with pytest.raises(UsageError, match=r"can be read by others \(mode 0644\); chmod 600"):
        read_token(write_token(tmp_path / "open", TOKEN, 0o644))
    with pytest.raises(UsageError, match="holds 5 bytes; a token needs at least 16"):
        read_token(write_token(tmp_path / "short", b"short"))
    with pytest.raises(UsageError, match="holds 0 bytes"):
        read_token(write_token(tmp_path / "empty", b"\n"))
    with pytest.raises(UsageError, match="longer than 4096 bytes"):
        read_token(write_token(tmp_path / "huge", b"x" * 5000))
    with pytest.raises(UsageError, match="No such file"):
        read_token(str(tmp_path / "missing"))


def test_bind_address_is_the_named_one_unless_asked():
    assert bind_address("127.0.0.2") == "127.0.0.2"
    assert bind_address("localhost") == "127.0.0.1"
    assert bind_address("127.0.0.2", "0.0.0.0") == bind_address("x", "*") == "0.0.0.0"
    assert bind_address("127.0.0.2", "127.0.0.3") == "127.0.0.3"
    with pytest.raises(UsageError, match="cannot resolve"):
        bind_address("no-such-host.invalid")


def test_bind_address_of_a_name_that_means_loopback_here(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    assert bind_address("head") == "0.0.0.0"  # the other nodes reach "head" at its real address
    assert bind_address("head", several_nodes=False) == "127.0.1.1"


def test_store_listens_only_where_it_is_told_and_a_second_host_finds_the_port_taken():
    probe = socket.socket()
    probe.bind(("127.0.0.2", 0))
    port = probe.getsockname()[1]
    probe.close()
    server = host_store(Endpoint("127.0.0.2", port))
    assert server is not None
    with socket.create_connection(("127.0.0.2", port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    assert host_store(Endpoint("127.0.0.2", port)) is None  # taken: the agent that bound first hosts


def test_an_agent_with_another_token_is_not_let_in(store, caplog):
    endpoint = Endpoint("127.0.0.1", store.port)
    controller = ControlStore(store, endpoint, True, Signer(TOKEN))
    stranger = ControlStore(store, endpoint, False, Signer(b"another secret entirely, 987654"))
    controller.append(KEYS.arrivals, KEYS.join, JoinRecord("a0", "h0", 1, 2))
    stranger.append(KEYS.arrivals, KEYS.join, JoinRecord("a1", "h1", 2, 2))
    result = gather(controller, KEYS, RendezvousPolicy(2, 2, 0.0, 0.5), "a0", threading.Event())
    assert "1 of 2 nodes joined" in result.error  # the stranger's join does not count
    assert any(f"{KEYS.join(1)} in the store: wrongly signed" in r.getMessage() for r in caplog.records)
    assert controller.try_get(Placement, KEYS.rendezvous_result) == result.outcome
    assert stranger.try_get(Placement, KEYS.rendezvous_result) is None  # nor can it read the answer
