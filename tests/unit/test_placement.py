"""Device allocation: fresh starts, respawns, isolation, pre-separation, shortages."""

import pytest

from ftrun.agent.placement import DeviceAllocator, RankDevice, NoDevice


def test_fresh_start_gives_the_lowest_devices_in_local_rank_order():
    slots = DeviceAllocator([2, 0, 1, 3]).assign_all(3)
    assert slots == {0: RankDevice(0, (0, 1, 2)), 1: RankDevice(1, (0, 1, 2)), 2: RankDevice(2, (0, 1, 2))}
    assert [slots[r].index for r in range(3)] == [0, 1, 2]  # index == LOCAL_RANK at a fresh start


def test_respawn_on_a_healthy_device_keeps_it():
    allocator = DeviceAllocator([0, 1, 2])
    allocator.assign_all(2)
    assert allocator.reassign(1) == RankDevice(1, (0, 1))


def test_transition_isolated_device_moves_its_rank_to_the_free_one():
    allocator = DeviceAllocator([0, 1, 2])
    allocator.assign_all(2)
    allocator.isolate(1, "SeparateNPU")
    slot = allocator.reassign(1)
    assert (slot.device, slot.visible, slot.index) == (2, (0, 2), 1)
    assert allocator.ranks_on(1) == [] and allocator.ranks_on(2) == [1]


def test_moved_rank_can_have_an_index_other_than_its_local_rank():
    allocator = DeviceAllocator([0, 1, 2])
    allocator.assign_all(2)
    allocator.isolate(0, "lost")
    slot = allocator.reassign(0)
    assert (slot.device, slot.visible, slot.index) == (2, (1, 2), 1)  # ascending, as Ascend demands


def test_preseparated_device_keeps_its_ranks_but_takes_no_new_one():
    allocator = DeviceAllocator([0, 1, 2])
    allocator.assign_all(2)
    allocator.preseparate(0, "PreSeparateNPU")
    assert allocator.ranks_on(0) == [0]  # nothing moves until the rank is respawned
    assert allocator.reassign(0).device == 2


def test_no_free_device_is_a_node_level_fault_naming_why():
    allocator = DeviceAllocator([0, 1])
    allocator.assign_all(2)
    allocator.isolate(1, "Alarm 80E38003")
    with pytest.raises(NoDevice, match=r"no usable device left for local rank 1 .*device 1 isolated \(Alarm 80E38003\)"):
        allocator.reassign(1)


def test_too_few_devices_for_a_fresh_start():
    allocator = DeviceAllocator([0, 1, 2])
    allocator.isolate(2, "Critical")
    with pytest.raises(NoDevice, match=r"no usable device left for 3 ranks \(2 free of 3\)"):
        allocator.assign_all(3)
