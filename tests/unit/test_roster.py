"""Who is in the job (ftrun.controller.roster): the nodes' and spares' liveness by their keepalive
counters, late agents, takeovers and the ranks' numbering, over a real TCPStore on loopback."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.controller.states import JobView
from ftrun.controller.roster import Roster
from ftrun.keys import JobKeys
from ftrun.messages import JoinRecord, NodeSlot, RendezvousResult
from ftrun.store import ControlStore

KEYS = JobKeys("roster")
TIMEOUT = 3.0


@pytest.fixture
def roster():
    """Three nodes of 2 ranks and one idle spare, as the rendezvous placed them."""
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    made = Roster(ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, Signer()), KEYS)
    nodes = tuple(NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in range(3))
    made.take_places(RendezvousResult(nodes, 6, spares=(NodeSlot(-1, "spare", "h9", 2, -1),)))
    return made


def test_a_node_whose_keepalive_stands_still_past_the_timeout_is_silent_once(roster):
    view = JobView(node_count=3, max_restarts=1, world_size=6)
    assert roster.silent_nodes(view, 100.0, TIMEOUT) == []  # first seen now
    roster.store.add(KEYS.node_heartbeat(0))
    roster.store.add(KEYS.node_heartbeat(2))
    assert roster.silent_nodes(view, 102.0, TIMEOUT) == []
    roster.store.add(KEYS.node_heartbeat(0))
    assert roster.silent_nodes(view, 103.5, TIMEOUT) == [1]  # silent since 100.0; 2 moved at 102.0
    # its clock starts again (a spare that takes the node gets a whole timeout of its own)
    assert roster.silent_nodes(view, 104.0, TIMEOUT) == []


def test_a_successor_counts_no_silence_of_the_agents_still_finding_its_store(roster):
    # a controller that took office at 100.0: the agents reach its store once they took the old one for
    # gone and found this one in etcd, up to --node-timeout later
    view = JobView(node_count=3, max_restarts=1, world_size=6)
    roster.keepalives.quiet_until(100.0 + TIMEOUT)
    assert roster.silent_nodes(view, 100.0, TIMEOUT) == []
    roster.store.add(KEYS.node_heartbeat(0))  # node 0's agent found it at once
    assert roster.silent_nodes(view, 105.5, TIMEOUT) == []  # nodes 1 and 2: silent since 103.0 only
    roster.store.add(KEYS.node_heartbeat(1))  # node 1's agent arrived late; node 2's never does
    assert roster.silent_nodes(view, 106.5, TIMEOUT) == [2]  # silent for a whole timeout since 103.0


def test_a_silent_spare_is_dropped(roster):
    roster.drop_silent_spares(100.0, TIMEOUT)
    roster.drop_silent_spares(102.0, TIMEOUT)
    assert [s.agent_id for s in roster.spares] == ["spare"]
    roster.drop_silent_spares(103.5, TIMEOUT)
    assert roster.spares == [] and roster.agents() == ["agent-0", "agent-1", "agent-2"]


def test_late_agents_are_those_not_in_the_job_each_seen_once(roster):
    for agent in ("agent-0", "agent-1", "agent-2", "spare"):  # the rendezvous's: answered by it
        roster.store.append(KEYS.arrivals, KEYS.join, JoinRecord(agent, "h", 1, 2))
    for agent in ("agent-0", "late", "spare"):  # joined again, or came late
        roster.store.append(KEYS.arrivals, KEYS.join, JoinRecord(agent, "h", 1, 2))
    assert [j.agent_id for j in roster.arrivals()] == ["late"]
    assert roster.arrivals() == []


def test_a_spare_takes_a_lost_node_s_ranks_and_a_scale_in_renumbers_the_nodes_after_a_gap(roster):
    spare, lost = roster.hand_over("spare", 1)
    assert (spare.host, lost.agent_id) == ("h9", "agent-1")
    assert roster.nodes[1] == NodeSlot(1, "spare", "h9", 2, 2) and roster.spares == []
    assert roster.holder_of_rank(3) == roster.nodes[1] and roster.holder_of_rank(6) is None
    view = dataclasses.replace(JobView(node_count=3, max_restarts=1, world_size=6), lost=frozenset({1}))
    assert [(n.node_rank, n.first_rank) for n in roster.renumber(view)] == [(0, 0), (2, 2)]
    assert roster.nodes[2].first_rank == 2


def test_an_agent_the_preflight_left_out_is_no_late_arrival(roster):
    result = RendezvousResult(nodes=tuple(roster.nodes.values()), world_size=6, spares=tuple(roster.spares),
                              left_out=(("slow", "preflight: left out: ..."),))
    roster.take_places(result)
    for agent in ("agent-0", "agent-1", "agent-2", "spare", "slow"):  # the rendezvous's, the slow one last (its matmul)
        roster.store.append(KEYS.arrivals, KEYS.join, JoinRecord(agent, "h", 1, 2))
    roster.store.append(KEYS.arrivals, KEYS.join, JoinRecord("late", "h", 1, 2))
    assert [j.agent_id for j in roster.arrivals()] == ["late"]
