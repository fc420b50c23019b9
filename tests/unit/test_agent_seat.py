"""Where a node sits in the job (ftrun/agent/seat.py): pure, over the controller's layouts."""

from __future__ import annotations

from ftrun.agent.seat import Seat
from ftrun.contract import DeviceAssignment
from ftrun.messages import NodeSlot
from tests.unit.node_parts import HOST, layout


def seat(node_rank: int = 1, first_rank: int = 2, agent: str = "b") -> Seat:
    return Seat(agent, HOST, NodeSlot(node_rank, agent, HOST, 2, first_rank))


def test_update_keeps_a_node_that_this_agent_still_holds():
    s = seat()
    assert s.update(layout((0, "a", 2, 0), (1, "b", 2, 2)))
    assert (s.node_rank, s.first_rank, s.layout.world_size) == (1, 2, 4)


def test_update_says_the_node_is_gone_when_another_agent_holds_it_or_none_does():
    assert not seat().update(layout((0, "a", 2, 0), (1, "spare", 2, 2)))  # replaced by a spare
    assert not seat().update(layout((0, "a", 2, 0)))  # declared lost and left out


def test_update_renumbers_the_ranks_of_a_node_whose_first_rank_moved():
    s = seat(node_rank=2, first_rank=4)
    assert s.update(layout((0, "a", 2, 0), (2, "b", 2, 2)))  # node 1 left out: node 2's ranks move down
    assert s.first_rank == 2
    assert s.placement(1).rank == 3


def test_a_spare_that_takes_a_node_takes_its_ranks_from_the_layout():
    s = seat(node_rank=-1, first_rank=-1)
    s.take(1)
    assert s.update(layout((0, "a", 2, 0), (1, "b", 2, 2)))
    assert (s.node_rank, s.first_rank) == (1, 2)


def test_placement_names_the_node_by_its_place_in_the_layout():
    s = seat(node_rank=3, first_rank=2)
    s.update(layout((0, "a", 2, 0), (3, "b", 2, 2)))
    device, visibility = DeviceAssignment(5, 1), ("CUDA_VISIBLE_DEVICES", "4,5")
    placed = s.placement(1, (device, visibility), (0, 1))
    assert (placed.local_rank, placed.rank, placed.node_rank, placed.host) == (1, 3, 1, HOST)
    assert (placed.device, placed.visibility, placed.cpus) == (device, visibility, (0, 1))


def test_local_ranks_are_those_of_the_command_this_node_holds():
    s = seat()
    assert s.local_ranks((0, 3, 2, 5)) == [1, 0]
    assert s.local_ranks(()) == []


def test_forget_layout_leaves_the_slot():
    s = seat()
    s.update(layout((0, "a", 2, 0), (1, "b", 2, 2)))
    s.forget_layout()
    assert s.layout.nodes == () and s.first_rank == 2
