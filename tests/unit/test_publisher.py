"""What the controller's publisher writes (ftrun.controller.publisher), read back from a real TCPStore on
loopback: the keys, their order and how often each is written (test_node_protocol.py reads the same
writes as an agent does)."""

from __future__ import annotations

import datetime
import json

import pytest

from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.controller.publisher import Publisher
from ftrun.keys import BELL_SEPARATOR, RENDEZVOUS_RING, JobKeys
from ftrun.messages import Command, CommandKind, NodeLayout, NodeLayoutChange, NodeSlot
from ftrun.store import ControlStore
from tests.conftest import FakeClock

KEYS = JobKeys("publisher")
AGENTS = ["agent-0", "agent-1", "spare"]


@pytest.fixture
def publisher():
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    store = ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, Signer(b"secret"))
    return Publisher(store, KEYS, lambda: AGENTS, clock=FakeClock())


def published(publisher: Publisher) -> list[Command]:
    return publisher.store.read_from(KEYS.command_count, KEYS.command, Command, 0)


def test_a_decision_s_commands_each_go_under_their_own_key_and_ring_every_agent_once(publisher):
    nodes = (NodeSlot(0, "agent-0", "h0", 2, 0), NodeSlot(1, "agent-1", "h1", 2, 2))
    publisher.write_layout(nodes)
    takeover = Command(CommandKind.TAKEOVER, 1, node_rank=1, agent_id="spare", reason="node 1 lost")
    stop = Command(CommandKind.STOP, 1, reason="node 1 lost")
    publisher.commands([takeover, stop])
    assert published(publisher) == [Command(CommandKind.TAKEOVER, 1, node_rank=1, agent_id="spare",
                                            reason="node 1 lost", layout=1),
                                    Command(CommandKind.STOP, 1, reason="node 1 lost", layout=1)]
    store = publisher.store
    texts = [store.raw.get(KEYS.command(index)).decode() for index in (0, 1)]
    for agent in AGENTS:  # each bell rung at the decision's first index, with both texts
        assert store.raw.get(KEYS.doorbell(agent, 0)).decode() == BELL_SEPARATOR.join(texts)
        assert not store.raw.check([KEYS.doorbell(agent, 1)])
    publisher.commands([])  # nothing decided: nothing written
    assert store.counter(KEYS.command_count) == 2


def test_the_layout_is_written_when_it_changed_with_its_change_and_then_its_version(publisher):
    nodes = (NodeSlot(0, "agent-0", "h0", 2, 0), NodeSlot(1, "agent-1", "h1", 2, 2))
    store = publisher.store
    publisher.write_layout(nodes)
    publisher.write_layout(nodes)  # a restart of the same nodes
    assert publisher.layout == NodeLayout(nodes, 1) and store.try_text(KEYS.layout_version) == "1"
    taken = (nodes[0], NodeSlot(1, "spare", "h9", 2, 2))
    publisher.write_layout(taken)
    assert store.get(NodeLayout, KEYS.layout) == NodeLayout(taken, 2)
    assert store.get(NodeLayoutChange, KEYS.layout_change(2)) == NodeLayoutChange(2, (taken[1],))
    assert store.try_text(KEYS.layout_version) == "2"


def test_held_replacements_go_out_together_once_their_moment_passed_unless_a_stop_drops_them(publisher):
    replace = [Command(CommandKind.REPLACE, 1, ranks=(rank,)) for rank in (3, 2)]
    publisher.hold(replace[0], 0.05)
    publisher.hold(replace[1], 10.0)  # the first one held sets the moment
    publisher.release_held()
    assert published(publisher) == []
    publisher.clock.advance(0.05)
    publisher.release_held()
    assert [c.ranks for c in published(publisher)] == [(3,), (2,)]
    publisher.hold(Command(CommandKind.REPLACE, 2, ranks=(1,)), 0.0)
    publisher.drop_held("every rank failed")
    publisher.release_held()
    assert len(published(publisher)) == 2


def test_an_announcement_wakes_the_ranks_of_each_newer_generation_once(publisher):
    store = publisher.store
    publisher.ranks_started = 1  # generation 1 started: no rank waits on generation 1's key
    publisher.announce(3, world_size=2)
    assert store.try_text(KEYS.target_generation) == "3"
    assert [store.try_text(KEYS.group_ready(g)) for g in (0, 1, 2, 3)] == ["superseded"] * 3 + [""]
    assert [store.try_text(KEYS.announced(g, r)) for g in (1, 2, 3) for r in (0, 1)] == ["", "", "3", "3", "3", "3"]
    store.set_text(KEYS.target_generation, "changed")
    publisher.announce(3, world_size=2)  # more ranks for the same repair: nothing written again
    assert store.try_text(KEYS.target_generation) == "changed"


def test_a_late_agent_is_admitted_as_a_spare_and_its_watch_rung_or_told_why_not(publisher):
    store = publisher.store
    publisher.admit_spare("late")
    publisher.refuse("later", "the job already has its 2 nodes and 1 spare")
    assert store.try_text(KEYS.admission("late"), signed=True) == "spare"
    assert store.raw.check([KEYS.doorbell("late", RENDEZVOUS_RING)])
    assert store.try_text(KEYS.admission("later"), signed=True) == "the job already has its 2 nodes and 1 spare"
    assert not store.raw.check([KEYS.doorbell("later", RENDEZVOUS_RING)])


def test_ftrun_top_s_feed_is_one_batch_per_call_with_news_and_the_history_when_there_is_one(publisher):
    store = publisher.store
    publisher.for_top([], None)  # nothing new: nothing written
    assert store.counter(KEYS.event_count) == 0 and not store.raw.check([KEYS.rank_history])
    publisher.for_top([{"kind": "fault"}, {"kind": "decision"}], {"0": [[1, 5, 0.2]]})
    publisher.for_top([{"kind": "repair_done"}], None)
    assert [json.loads(store.try_text(KEYS.event_batch(i))) for i in (0, 1)] == [
        [{"kind": "fault"}, {"kind": "decision"}], [{"kind": "repair_done"}]]
    assert store.counter(KEYS.event_count) == 2
    assert json.loads(store.try_text(KEYS.rank_history)) == {"0": [[1, 5, 0.2]]}
