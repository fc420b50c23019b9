"""An agent's connection to the controller (ftrun/agent/connection.py), c10d backend: a real store hosted
on loopback with the real controller in it, and a second agent's connection to it. Following a controller
that moves (etcd) is exercised end to end by tests/integration/test_high_availability.py."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ftrun.agent.connection import ControlConnection
from tests.unit.node_parts import launch_config

TOKEN = b"c" * 32


@pytest.fixture
def connections(tmp_path):
    made = []
    config = launch_config(tmp_path, "0", status="plain")

    def make(host: bool = True, token: bytes = TOKEN) -> ControlConnection:
        connection = ControlConnection(config if host else dataclasses.replace(config, is_host=False),
                                       f"agent-{len(made)}", "127.0.0.1")
        connection.open(token)
        made.append(connection)
        return connection

    yield make
    for connection in reversed(made):
        connection.stop_controller()
        connection.close()


def test_the_stores_host_runs_the_controller_beside_it(connections):
    host = connections()
    assert host.store.is_host and host.controller is not None and host.controller.running
    assert host.signer.enabled and not host.stepped_down
    assert host.endpoint == host.store.endpoint


def test_another_agent_reaches_the_same_store_and_its_messages_arrive(connections):
    host = connections()
    other = connections(host=False)
    assert not other.store.is_host and other.controller is None
    other.protocol.node_rank = 1
    other.protocol.keepalive()
    assert host.store.counter(host.keys.node_heartbeat(1)) == 1


def test_an_unsigned_job_is_said_once_on_its_host(connections, caplog):
    with caplog.at_level(logging.WARNING, logger="ftrun.agent.connection"):
        connections(token=b"")
    assert "control messages are not signed" in caplog.text


def test_finish_hands_back_the_controller_whose_view_holds_the_summary(connections):
    host = connections()
    controller = host.controller
    assert host.finish() is controller and not controller.running
    assert connections(host=False).finish() is None


def test_stop_controller_ends_its_thread(connections):
    host = connections()
    controller = host.controller
    host.stop_controller()
    assert host.controller is None and not controller.running
