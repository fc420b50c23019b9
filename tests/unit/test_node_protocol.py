"""An agent's side of the control protocol (ftrun.agent.protocol) against the real controller's
publishing, over a real TCPStore on loopback: what each message costs the store in round trips."""

from __future__ import annotations

import datetime
import time

import pytest

from ftrun.agent.protocol import NodeProtocol, Watch
from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.controller.controller import Controller, RecoveryPolicy
from ftrun.controller.policy import Level
from ftrun.keys import RENDEZVOUS_RING, JobKeys
from ftrun.messages import Command, CommandKind, NodeSlot, NodeStatus, RankState
from ftrun.rendezvous import RendezvousPolicy
from ftrun.store import ControlStore

AGENT = "agent-1"
KEYS = JobKeys("protocol")


class Counted:
    """A TCPStore client that counts its requests."""

    def __init__(self, raw):
        self.raw, self.requests = raw, 0

    def __getattr__(self, name):
        method = getattr(self.raw, name)

        def counted(*args):
            self.requests += 1
            return method(*args)

        return counted


def client(port: int) -> Counted:
    from torch.distributed import TCPStore

    return Counted(TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5)))


@pytest.fixture
def job():
    """A controller hosting the store, with one node (AGENT) whose protocol has a Watch; the
    rendezvous' bell already rung, as the controller's gather rings it."""
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    signer = Signer(b"secret")
    store = ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, signer)
    controller = Controller(store, KEYS, RendezvousPolicy(1, 1, 0.0, 5.0), "agent-0", "127.0.0.1",
                            RecoveryPolicy(max_restarts=3, recovery=Level.JOB, node_timeout=10.0, stop_timeout=5.0,
                                           repair_timeout=60.0))
    controller.nodes[0] = NodeSlot(0, AGENT, "h1", 2, 0)
    store.set_text(KEYS.doorbell(AGENT, RENDEZVOUS_RING), "")
    agent_store = client(raw.port)
    watch = Watch(lambda: client(raw.port), KEYS, AGENT)
    protocol = NodeProtocol(ControlStore(agent_store, store.endpoint, False, signer), KEYS, AGENT, 10.0, watch)
    protocol.node_rank = 0
    assert watch.rendezvous.wait(5)
    yield controller, protocol, agent_store
    watch.close(protocol.store)


def wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.005)


def test_the_doorbell_carries_the_command_so_the_agent_reads_nothing_back(job):
    controller, protocol, agent_store = job
    stop = Command(CommandKind.STOP, 0, reason="rank 3 failed")
    controller._publish([stop])
    wait_for(lambda: protocol.watch.published == 1)
    before = agent_store.requests
    assert list(protocol.commands()) == [stop]
    assert agent_store.requests == before  # held by the watch as it woke: no round trip
    assert list(protocol.commands()) == []  # each command is taken once

    # a bell set by someone without the job's token: the command's own key is read instead
    start = Command(CommandKind.START, 1, restart_count=1)
    controller.store.append(KEYS.command_count, KEYS.command, start)
    controller.store.set_texts([KEYS.doorbell(AGENT, 1)], '{"mac": "0", "body": "{}"}')
    wait_for(lambda: protocol.watch.published == 2)
    assert list(protocol.commands()) == [start]
    assert agent_store.requests == before + 1

    # a lost node's decision: its two commands ring the bell once, and the watch holds both
    takeover = Command(CommandKind.TAKEOVER, 1, node_rank=1, agent_id="spare", reason="node 1 lost")
    stop = Command(CommandKind.STOP, 1, reason="node 1 lost")
    controller._publish([takeover, stop])
    wait_for(lambda: protocol.watch.published == 4)
    assert list(protocol.commands()) == [takeover, stop]
    assert agent_store.requests == before + 1
    assert controller.store.raw.check([KEYS.doorbell(AGENT, 2)]) and not controller.store.raw.check([KEYS.doorbell(AGENT, 3)])


def test_a_keepalive_is_one_round_trip_and_carries_the_status_at_the_boards_pace(job):
    controller, protocol, agent_store = job
    protocol.status_interval = 60.0  # a job of 245,760 ranks: its board is rebuilt once a minute
    ranks = (RankState(0, 0, 100, True, step=5), RankState(1, 1, 101, True, step=5))
    status_key = KEYS.agent_status(AGENT)

    def beat(now: float, status: NodeStatus) -> NodeStatus | None:
        before = agent_store.requests
        protocol.keepalive(status, now)
        assert agent_store.requests == before + 1
        return controller.store.try_get(NodeStatus, status_key)

    first = NodeStatus(AGENT, "h1", 0, ranks)
    assert beat(100.0, first) == first
    # the steps moved, nothing else did: the status waits for the board's next rebuild
    moved = NodeStatus(AGENT, "h1", 0, tuple(RankState(r.rank, r.local_rank, r.pid, True, step=6) for r in ranks))
    assert beat(100.5, moved) == first
    assert beat(160.0, moved) == moved
    # a rank ended: news, written at once
    ended = NodeStatus(AGENT, "h1", 0, (ranks[0], RankState(1, 1, 101, False, step=6)))
    assert beat(160.5, ended) == ended
    # the controller finds the node alive: its heartbeat key changed at every keepalive
    counts = [controller.store.counters([KEYS.node_heartbeat(0)])[0]]
    protocol.keepalive(ended, 161.0)
    counts.append(controller.store.counters([KEYS.node_heartbeat(0)])[0])
    assert counts == [4, 5]
