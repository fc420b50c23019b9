"""Rendezvous decisions: node ranks, clashes, deadlines (no store)."""

from __future__ import annotations

from ftrun.messages import JoinRecord, Placement
from ftrun.rendezvous import RendezvousPolicy, assign_node_ranks, decide_rendezvous

POLICY = RendezvousPolicy(min_nodes=2, max_nodes=2, last_call_timeout=5, timeout=30)


def joined(agent, host="h", rank=-1, nproc=2):
    return JoinRecord(agent_id=agent, host=host, pid=1, nproc=nproc, requested_node_rank=rank)


def test_host_gets_node_rank_zero_and_others_follow_arrival():
    result = assign_node_ranks([joined("b"), joined("c"), joined("host")], host_agent_id="host")
    assert [n.agent_id for n in result.nodes] == ["host", "b", "c"]
    assert [n.first_rank for n in result.nodes] == [0, 2, 4]
    assert result.world_size == 6


def test_requested_node_ranks_are_kept_and_gaps_filled():
    result = assign_node_ranks([joined("a", rank=2), joined("b"), joined("host")], host_agent_id="host")
    assert {n.agent_id: n.node_rank for n in result.nodes} == {"host": 0, "b": 1, "a": 2}


def test_uneven_nproc_gives_contiguous_global_ranks():
    result = assign_node_ranks([joined("host", nproc=3), joined("b", nproc=1)], host_agent_id="host")
    assert [(n.first_rank, n.nproc) for n in result.nodes] == [(0, 3), (3, 1)]
    assert result.world_size == 4


def test_waits_until_every_node_joined():
    assert decide_rendezvous([joined("host")], POLICY, "host", waited=1, min_reached_for=None) is None
    result = decide_rendezvous([joined("host"), joined("b")], POLICY, "host", waited=1, min_reached_for=0)
    assert not result.error and len(result.nodes) == 2


def test_clashing_node_ranks_fail_naming_both_hosts():
    result = decide_rendezvous([joined("a", "h1", 0), joined("b", "h2", 0)], POLICY, "a", 1, 0)
    assert "--node-rank 0" in result.error and "h1" in result.error and "h2" in result.error


def test_timeout_names_missing_node_ranks():
    policy = RendezvousPolicy(3, 3, 5, 30)
    result = decide_rendezvous([joined("a", "h1", 1)], policy, "a", waited=31, min_reached_for=None)
    assert "1 of 3 nodes joined" in result.error and "missing node ranks 0, 2" in result.error


def test_elastic_range_closes_after_last_call():
    policy = RendezvousPolicy(min_nodes=1, max_nodes=3, last_call_timeout=5, timeout=30)
    joins = [joined("host"), joined("b")]
    assert decide_rendezvous(joins, policy, "host", waited=3, min_reached_for=3) is None
    result = decide_rendezvous(joins, policy, "host", waited=6, min_reached_for=6)
    assert len(result.nodes) == 2


def test_extra_agents_beyond_max_are_not_admitted():
    joins = [joined("host"), joined("b"), joined("late")]
    result = decide_rendezvous(joins, POLICY, "host", waited=1, min_reached_for=0)
    assert "late" not in dict(result.places()) and len(result.nodes) == 2


def test_failed_preflight_on_any_node_fails_the_rendezvous_with_the_device_exit_code():
    sick = JoinRecord(agent_id="b", host="h2", pid=1, nproc=2, preflight="h2: device 0 Critical: health Critical")
    result = decide_rendezvous([joined("host"), sick], POLICY, "host", waited=0.1, min_reached_for=0.1)
    assert result.error == "preflight failed: h2: device 0 Critical: health Critical"
    assert result.exit_code == 4


SPARES = RendezvousPolicy(min_nodes=2, max_nodes=2, last_call_timeout=5, timeout=30, spares=1)


def test_agents_beyond_the_nodes_stand_by_as_spares():
    result = decide_rendezvous([joined("s"), joined("host"), joined("b")], SPARES, "host", waited=1, min_reached_for=0)
    assert [n.agent_id for n in result.nodes] == ["host", "s"] and result.world_size == 4
    assert [(s.agent_id, s.node_rank, s.first_rank) for s in result.spares] == [("b", -1, -1)]
    places = dict(result.places())
    assert places["b"].slot.node_rank == -1 and "x" not in places
    assert places["s"] == Placement(result.nodes[1], world_size=4, node_count=2)  # its own slot, and the job's size
    assert result.outcome == Placement(None, world_size=4, node_count=2)  # what one left out reads


def test_requested_node_ranks_win_over_arrival_so_an_early_spare_stays_a_spare():
    joins = [joined("spare"), joined("n1", rank=1), joined("n0", rank=0)]
    result = decide_rendezvous(joins, SPARES, "", waited=1, min_reached_for=0)
    assert [n.agent_id for n in result.nodes] == ["n0", "n1"] and [s.agent_id for s in result.spares] == ["spare"]


def test_waits_for_the_spares_until_the_last_call():
    joins = [joined("host"), joined("b")]
    assert decide_rendezvous(joins, SPARES, "host", waited=1, min_reached_for=1) is None
    result = decide_rendezvous(joins, SPARES, "host", waited=6, min_reached_for=5)
    assert len(result.nodes) == 2 and result.spares == ()


def test_agents_beyond_nodes_and_spares_are_not_admitted():
    joins = [joined("host"), joined("b"), joined("c"), joined("d")]
    result = decide_rendezvous(joins, SPARES, "host", waited=1, min_reached_for=0)
    assert [s.agent_id for s in result.spares] == ["c"] and "d" not in dict(result.places())
