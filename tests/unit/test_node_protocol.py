"""An agent's side of the control protocol (ftrun.agent.protocol) against the real controller's
publishing, over a real TCPStore on loopback: what each message costs the store in round trips."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from ftrun.agent import protocol as protocol_module
from ftrun.agent.protocol import NodeProtocol, Watch
from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.controller.controller import Controller, RecoveryPolicy
from ftrun.controller.states import Level
from ftrun.keys import RENDEZVOUS_RING, JobKeys
from ftrun.errors import RendezvousError
from ftrun.messages import (
    Command, CommandKind, JoinRecord, NodeLayout, NodeLayoutChange, NodeSlot, NodeStatus, Placement, RankState,
)
from ftrun.rendezvous import RendezvousPolicy, gather, join
from ftrun.store import ControlStore

AGENT = "agent-1"
KEYS = JobKeys("protocol")


class Counted:
    """A TCPStore client that counts its requests, and keeps the keys each one named."""

    def __init__(self, raw):
        self.raw, self.requests, self.named = raw, 0, []

    def __getattr__(self, name):
        method = getattr(self.raw, name)

        def counted(*args):
            self.requests += 1
            self.named += args[0] if isinstance(args[0], list) else [args[0]]
            return method(*args)

        return counted


def client(port: int) -> Counted:
    from torch.distributed import TCPStore

    return Counted(TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5)))


def hosted() -> ControlStore:
    """A store hosted here, as the controller sees it (sealing with the job's token)."""
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, Signer(b"secret"))


@pytest.fixture
def job():
    """A controller hosting the store, with one node (AGENT) whose protocol has a Watch; the
    rendezvous' bell already rung, as the controller's gather rings it."""
    store = hosted()
    raw, signer = store.raw, store.signer
    controller = Controller(store, KEYS, RendezvousPolicy(1, 1, 0.0, 5.0), "agent-0", "127.0.0.1",
                            RecoveryPolicy(max_restarts=3, recovery=Level.JOB, node_timeout=10.0, stop_timeout=5.0,
                                           repair_timeout=60.0))
    controller.roster.nodes[0] = NodeSlot(0, AGENT, "h1", 2, 0)
    store.set_text(KEYS.doorbell(AGENT, RENDEZVOUS_RING), "")
    agent_store = client(raw.port)
    watch = Watch(lambda: client(raw.port), KEYS, AGENT)
    protocol = NodeProtocol(ControlStore(agent_store, store.endpoint, False, signer), KEYS, AGENT, 10.0, watch)
    protocol.node_rank = 0
    assert watch.rendezvous_decided.wait(5)
    yield controller, protocol, agent_store
    watch.close(protocol.store)


def wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.005)


def test_the_doorbell_carries_the_command_so_the_agent_reads_nothing_back(job):
    controller, protocol, agent_store = job
    stop = Command(CommandKind.STOP, 0, reason="rank 3 failed", layout=0)  # none written in this job yet
    controller.publisher.commands([stop])
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
    takeover = Command(CommandKind.TAKEOVER, 1, node_rank=1, agent_id="spare", reason="node 1 lost", layout=0)
    stop = Command(CommandKind.STOP, 1, reason="node 1 lost", layout=0)
    controller.publisher.commands([takeover, stop])
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


def test_the_rendezvous_bell_carries_the_agent_s_own_place_so_it_reads_nothing_back():
    store = hosted()
    port, signer = store.raw.port, store.signer
    agent_store = client(port)
    watch = Watch(lambda: client(port), KEYS, AGENT)
    protocol = NodeProtocol(ControlStore(agent_store, store.endpoint, False, signer), KEYS, AGENT, 10.0, watch)
    other = ControlStore(client(port), store.endpoint, False, signer)  # an agent without a watch: it polls
    joined = {}
    first = threading.Thread(target=lambda: joined.update(
        first=protocol.join(JoinRecord(AGENT, "h1", 1, 2), 10, threading.Event())))
    first.start()
    wait_for(lambda: agent_store.requests >= 3)  # joined, and looked once: the rendezvous is not decided yet
    second = threading.Thread(target=lambda: joined.update(
        second=join(other, KEYS, JoinRecord("agent-2", "h2", 2, 2), 10, threading.Event())))
    second.start()
    result = gather(store, KEYS, RendezvousPolicy(2, 2, 0.0, 10.0), AGENT, threading.Event())
    first.join(10)
    second.join(10)
    try:
        placement, slot = joined["first"]
        assert placement == Placement(result.nodes[0], world_size=4, node_count=2) and slot == result.nodes[0]
        # the place came with the bell: none of its keys, nor the layout, was asked for
        assert not {KEYS.rendezvous_place(AGENT), KEYS.rendezvous_result, KEYS.layout} & set(agent_store.named[3:])
        assert joined["second"] == (Placement(result.nodes[1], 4, 2), result.nodes[1])  # read from its own key
        # a bell that does not open (anyone can ring one): the place is read from its own key
        rung = threading.Event()
        rung.set()
        forged = b'{"mac": "0", "body": "{}"}'
        again = join(other, KEYS, JoinRecord("agent-2", "h2", 2, 2), 10, threading.Event(), rung, lambda: forged)
        assert again[1] == result.nodes[1]
        # one that came too late has no place: it waits for its admission as a spare (none comes here)
        with pytest.raises(RendezvousError, match="did not admit this agent"):
            join(other, KEYS, JoinRecord("agent-3", "h3", 3, 2), 10, rung)
    finally:
        watch.close(protocol.store)


def test_an_agent_reads_the_whole_layout_once_then_only_each_version_s_changes(job, monkeypatch):
    controller, protocol, agent_store = job
    nodes = tuple(NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in range(3))

    def read() -> tuple[NodeLayout, list[str]]:
        # the controller's writes wait for no answer: one round trip on its connection has the server
        # apply them before the agent asks (an agent reads the layout after a doorbell that comes later)
        controller.store.raw.check([KEYS.layout_version])
        before = len(agent_store.named)
        layout = protocol.layout()
        return layout, agent_store.named[before:]

    controller.publisher.write_layout(nodes)
    layout, asked = read()
    assert layout == NodeLayout(nodes, 1) and KEYS.layout in asked  # the whole, the first time

    controller.publisher.write_layout(nodes)  # a restart of the same nodes publishes nothing
    layout, asked = read()
    assert layout.version == 1 and asked == [KEYS.layout_version]  # its version, in one request: no change
    # a takeover: one node's change
    spare = NodeSlot(1, "spare", "h9", 2, 2)
    taken = (nodes[0], spare, nodes[2])
    controller.publisher.write_layout(taken)
    layout, asked = read()
    assert layout == NodeLayout(taken, 2) and KEYS.layout not in asked and KEYS.layout_change(2) in asked
    assert controller.store.get(NodeLayoutChange, KEYS.layout_change(2)) == NodeLayoutChange(2, (spare,))
    before = agent_store.requests
    assert protocol.layout(published=2) == layout and agent_store.requests == before  # a command said it: held
    # node 1 lost, then the scale-in that renumbers the ranks after it: two versions behind, read at once
    shrunk = (nodes[0], NodeSlot(2, "agent-2", "h2", 2, 2))
    controller.publisher.write_layout((nodes[0], nodes[2]))
    controller.publisher.write_layout(shrunk)
    layout, asked = read()
    assert layout == NodeLayout(shrunk, 4) and KEYS.layout not in asked
    assert controller.store.get(NodeLayoutChange, KEYS.layout_change(4)) == NodeLayoutChange(4, (shrunk[1],))
    # further behind than LAYOUT_CHANGES versions, or a change that does not open: the whole again
    monkeypatch.setattr(protocol_module, "LAYOUT_CHANGES", 1)
    controller.publisher.write_layout(nodes)
    controller.publisher.write_layout(taken)
    layout, asked = read()
    assert layout == NodeLayout(taken, 6) and KEYS.layout in asked
    controller.publisher.write_layout(nodes)
    controller.store.set_text(KEYS.layout_change(7), '{"mac": "0", "body": "{}"}')
    layout, asked = read()
    assert layout == NodeLayout(nodes, 7) and KEYS.layout in asked


def test_a_layout_made_from_its_changes_is_the_layout():
    nodes = tuple(NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in range(4))
    shapes = [nodes, (nodes[0], NodeSlot(1, "spare", "h9", 2, 2)) + nodes[2:], (nodes[0],) + nodes[2:],
              nodes[:2] + (NodeSlot(5, "late", "h5", 4, 4),), (), nodes]
    held = NodeLayout()
    for version, shape in enumerate(shapes, 1):
        layout = NodeLayout(shape, version)
        change = layout.change_from(held)
        assert held.changed(change) == layout
        assert len(change.nodes) == sum(1 for n in shape if n not in held.nodes)  # only what differs travels
        held = layout
