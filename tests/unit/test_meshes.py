"""Which ranks hold copies, read from meshes made with torch's own API (ftrun/elastic/meshes.py)."""

from __future__ import annotations

import types

import pytest
import torch

from ftrun.elastic import meshes
from ftrun.elastic.layout import ReplicaLayout
from ftrun.elastic.meshes import Axis, axis_through, complete_grid, read_part_mesh
from tests.unit.test_groups import _Holding, _Mesh


@pytest.mark.parametrize(
    "rank, ranks, axis",
    [
        (1, [1, 3], Axis("g", 2, 2)),
        (6, [2, 6], Axis("g", 2, 4)),
        (2, [0, 2, 4, 6], Axis("g", 4, 2)),  # a flattened dimension
        (1, [1, 2], None),  # straddles two blocks of a grid
        (1, [1, 3, 4], None),  # not evenly spaced
        (1, [0, 2], None),  # not through this rank
        (1, [1], None),
    ],
)
def test_a_group_is_a_dimension_of_a_grid_when_its_ranks_are_evenly_spaced_within_a_block(rank, ranks, axis):
    assert axis_through(rank, "g", ranks) == axis


TP, DP = Axis("tp", 2, 1), Axis("dp", 2, 2)


@pytest.mark.parametrize(
    "world, mesh_axes, group_axes, grid",
    [
        (4, [TP], [DP], ([DP, TP], [("dp",)])),  # DP x TP
        (4, [DP], [TP], ([DP, TP], [("tp",)])),  # the parameters on the outer dimension
        (4, [TP], [None, DP], ([DP, TP], [(), ("dp",)])),  # a group that is no dimension of it
        (8, [TP], [Axis("dp_cp", 4, 2), Axis("dp", 2, 4), Axis("cp", 2, 2)],  # and a flattened one
         ([Axis("dp", 2, 4), Axis("cp", 2, 2), TP], [("cp", "dp"), ("dp",), ("cp",)])),
        (8, [TP], [Axis("dp_cp", 4, 2)], ([Axis("dp_cp", 4, 2), TP], [("dp_cp",)])),
        (8, [TP], [DP], None),  # nothing completes it: half the job
        (4, [TP], [], None),
        (4, [Axis("tp", 2, 2)], [Axis("x", 2, 1)], ([Axis("tp", 2, 2), Axis("x", 2, 1)], [("x",)])),
    ],
)
def test_groups_complete_the_parameters_mesh_to_a_grid_of_the_whole_job(world, mesh_axes, group_axes, grid):
    assert complete_grid(world, mesh_axes, group_axes) == grid


class _DTensor:
    """What meshes.py reads of a DTensor parameter: its mesh, its placements, its local shard."""

    def __init__(self, mesh, *replicate, numel=4):
        self.device_mesh, self.requires_grad, self.numel = mesh, True, numel
        self.placements = [types.SimpleNamespace(is_replicate=lambda r=r: r, is_shard=lambda r=r: not r)
                           for r in replicate]


def group(ranks, desc="undefined", name="7", reduced=0):
    return types.SimpleNamespace(global_ranks=tuple(ranks), group_desc=desc, group_name=name, reduced=reduced)


@pytest.fixture(autouse=True)
def fake_dtensors(monkeypatch):
    monkeypatch.setattr(meshes, "is_dtensor", lambda value: isinstance(value, _DTensor))
    monkeypatch.setattr(meshes, "local_tensor", lambda value: torch.zeros(value.numel))


def tensor_parallel(rank: int, names=("tp",)) -> _Holding:
    """Colwise and rowwise halves (Shard over tp) and a rowwise bias (Replicate over tp), 4 + 4 + 2 elements."""
    tp = _Mesh([rank - rank % 2, rank - rank % 2 + 1], names)
    return _Holding(_DTensor(tp, False), _DTensor(tp, False), _DTensor(tp, True, numel=2))


@pytest.mark.parametrize("names, desc", [(("tp",), "mesh_dp"), (("b",), "mesh_a"), (("tp",), "undefined")])
def test_dp_x_tp_over_torch_s_mesh_shows_its_replicas_in_the_first_step_s_gradient_reduction(names, desc):
    # rank 3 of (dp 2, tp 2): its tp peers are [2, 3], its dp group [1, 3]; the world group and the tp group
    # do not cross the parameters' mesh in this rank alone
    dp = group([1, 3], desc)
    part = read_part_mesh({"model": tensor_parallel(3, names), "optimizer": object()}, 4, 3,
                          [group(range(4), "default_pg", "0"), group([2, 3], f"mesh_{names[0]}"), dp])
    assert isinstance(part, meshes.PartMesh) and part.gradients == 10
    dp_name = desc[len("mesh_"):] if desc.startswith("mesh_") else "group7"
    assert part.layout == ReplicaLayout((2, 2), (dp_name, names[0]), (), known=False)
    assert part.layout.replica_sets() == [(0,), (1,), (2,), (3,)]  # until the first step shows them
    dp.reduced = 1  # a loss averaged for a log
    assert part.settle()[1].startswith("the registered DTensors lie on")
    dp.reduced = 10  # the gradients, by hand or by job.ddp
    layout, refusal = part.settle()
    assert refusal == "" and layout.known and layout.replicate == (dp_name,)
    assert layout.replica_sets() == [(0, 2), (1, 3)]


def test_with_no_reduction_the_line_names_the_mesh_and_the_argument_that_settles_it():
    part = read_part_mesh({"model": tensor_parallel(1)}, 4, 1, [group([1, 3], "mesh_dp"), group([0, 1], "mesh_tp")])
    layout, refusal = part.settle()
    assert layout.replicate == () and layout.known
    assert refusal == ("the registered DTensors lie on tp 2 of the mesh dp 2 x tp 2, made without job.mesh(), and "
                       "the first step all-reduced no gradients over dp: ftrun cannot tell which ranks hold copies "
                       "of each other's state (say it with job.mesh({\"dp\": 2, \"tp\": 2}, replicate=(\"dp\",)))")


@pytest.mark.parametrize(
    "params, groups, expect",
    [
        ([], [], None),
        ([torch.nn.Parameter(torch.ones(1))], [], None),  # plain parameters
        ([_DTensor(_Mesh([[0, 1], [2, 3]], ("a", "b")), True, False)], [], None),  # the whole job's mesh
        ([_DTensor(_Mesh([0, 1], ("tp",)), False), _DTensor(_Mesh([0, 1], ("x",)), False)], [], None),  # two
        ([_DTensor(_Mesh([0, 1], ("tp",)), False)], [], "no group the script made completes it"),
        ([_DTensor(_Mesh([0, 1], ("tp",)), False)], [group([0, 1, 2, 3])], "no group the script made completes"),
    ],
)
def test_what_is_no_mesh_of_part_of_the_job_and_what_is_one_no_group_completes(params, groups, expect):
    part = read_part_mesh({"model": _Holding(*params)}, 4, 0, groups)
    assert part == expect if expect is None else expect in part


def test_a_replacement_takes_the_replica_dimensions_from_the_ranks_that_ran_the_first_step():
    pending = ReplicaLayout((2, 2), ("dp", "tp"), (), known=False)
    shown = ReplicaLayout((2, 2), ("dp", "tp"), ("dp",))
    assert pending.replica_mask() == -1 and shown.replica_mask() == 1
    assert pending.agreed([1, -1, 1, 1]) == shown
    assert pending.agreed([-1, -1, -1, -1]) == pending  # a fault in the first step: nobody knows yet
    assert pending.agreed([1, 2]) == pending  # ranks that disagree: none is taken
    assert shown.agreed([-1, 2]) == shown


def test_with_init_sharded_a_step_that_shows_no_copies_leaves_each_rank_alone_without_a_line():
    # init(sharded=True): each rank holds its own part, its snapshots restore it; that is no reason for job level
    dp = group([1, 3], "mesh_dp")
    part = read_part_mesh({"model": tensor_parallel(1)}, 4, 1, [dp, group([0, 1], "mesh_tp")], sharded=True)
    assert part.settle() == (ReplicaLayout((2, 2), ("dp", "tp"), ()), "")
    dp.reduced = 10  # the copies the step shows count whatever sharded says
    assert part.settle() == (ReplicaLayout((2, 2), ("dp", "tp"), ("dp",)), "")


def test_a_pipeline_stage_s_hsdp_shows_its_copies_in_its_placements_whatever_the_step_reduced():
    # pp 2 x rep 2 x shard 2, rank 5: its stage's FSDP2 over mesh["rep", "shard"] (ranks 4-7), Replicate over
    # rep; the pp group [1, 5] completes the mesh. HSDP reduce-scatters the gradients over shard and
    # all-reduces only the scattered part over rep: less than the gradients, yet the placements say it
    stage = _Mesh([[4, 5], [6, 7]], ("rep", "shard"))
    model = _Holding(_DTensor(stage, True, False), _DTensor(stage, True, False))
    rep = group([5, 7], "mesh_rep", reduced=4)
    part = read_part_mesh({"model": model}, 8, 5, [group(range(8), "default_pg", "0"), group([1, 5], "mesh_pp"),
                                                   rep, group([4, 5], "mesh_shard")])
    layout, refusal = part.settle()
    assert refusal == "" and layout == ReplicaLayout((2, 2, 2), ("pp", "rep", "shard"), ("rep",))
    assert layout.replica_sets() == [(0, 2), (1, 3), (4, 6), (5, 7)]


def pipeline_groups(rank: int, **reduced):
    """pp 2 x dp 2 made with init_device_mesh, as torch makes its groups on ``rank``, and the default group."""
    pp, dp = rank // 2, rank % 2
    return [group(range(4), "default_pg", "0", reduced.get("world", 0)),
            group([dp, 2 + dp], "mesh_pp", "1", reduced.get("pp", 0)),
            group([2 * pp, 2 * pp + 1], "mesh_dp", "2", reduced.get("dp", 0))]


@pytest.mark.parametrize(
    "reduced, replicate, sets",
    [
        ({"dp": 12}, ("dp",), [(0, 1), (2, 3)]),  # DDP over mesh["dp"] (its buckets hold every gradient)
        ({"dp": 20}, ("dp",), [(0, 1), (2, 3)]),
        ({"world": 12}, ("pp", "dp"), [(0, 1, 2, 3)]),  # DDP over the whole job: every rank holds the same
    ],
)
def test_pp_x_dp_over_torch_s_mesh_with_plain_parameters_shows_its_replicas_in_the_first_step(reduced, replicate,
                                                                                              sets):
    stage = _Holding(torch.nn.Parameter(torch.ones(2, 4)), torch.nn.Parameter(torch.ones(4)))  # 12 elements
    part = read_part_mesh({"model": stage, "optimizer": object()}, 4, 3, pipeline_groups(3, **reduced))
    assert isinstance(part, meshes.PartMesh) and part.gradients == 12
    assert part.layout == ReplicaLayout((2, 2), ("pp", "dp"), (), known=False)
    layout, refusal = part.settle()
    assert refusal == "" and layout.replicate == replicate and layout.replica_sets() == sets


def test_pp_x_dp_with_no_gradients_reduced_says_the_mesh_and_the_argument_that_settles_it():
    stage = _Holding(torch.nn.Parameter(torch.ones(12)))
    part = read_part_mesh({"model": stage}, 4, 0, pipeline_groups(0, world=1, dp=11))  # a loss, and too little
    assert part.settle() == (ReplicaLayout((2, 2), ("pp", "dp"), ()), (
        "the registered parameters are plain tensors, and the groups made without job.mesh() are the mesh pp 2 x "
        "dp 2, and the first step all-reduced no gradients over pp or dp: ftrun cannot tell which ranks hold "
        'copies of each other\'s state (say it with job.mesh({"pp": 2, "dp": 2}, replicate=("dp",)))'))


@pytest.mark.parametrize(
    "groups",
    [
        [group(range(4), "default_pg", "0")],  # pure data parallelism: the caller's layout
        [group(range(4), "default_pg", "0"), group(range(4), "undefined", "1")],  # no group of part of the job
        [group(range(4), "default_pg", "0"), group([0, 1, 3], "undefined", "1")],  # no dimension of a grid
        [group(range(4), "default_pg", "0"), group([0, 2], "mesh_pp", "1")],  # half a grid
    ],
)
def test_plain_parameters_beside_groups_that_make_no_grid_are_left_to_the_caller(groups):
    assert read_part_mesh({"model": _Holding(torch.nn.Parameter(torch.ones(2)))}, 4, 0, groups) is None


@pytest.mark.parametrize("sharded", [False, True])
def test_what_the_state_and_the_groups_show_comes_before_init_sharded(monkeypatch, sharded):
    from ftrun.elastic import job as job_module

    monkeypatch.setattr(job_module, "is_dtensor", lambda value: isinstance(value, _DTensor))
    made = types.SimpleNamespace(foreign_groups=lambda: [], groups=[group(range(4), "default_pg", "0"),
                                                                    group([0, 1], "mesh_tp", "1"),
                                                                    group([1, 3], "mesh_dp", "2")])
    # DP x TP over torch's mesh: the first step shows the copies, with or without sharded=True
    layout, refusal, part = job_module.settle_layout(4, {"model": tensor_parallel(1)}, None, sharded, made, 1)
    assert isinstance(part, meshes.PartMesh) and part.sharded == sharded and refusal == ""
    assert layout == ReplicaLayout((2, 2), ("dp", "tp"), (), known=False)
    # PP x DP over torch's mesh, plain parameters: the same
    stage = _Holding(torch.nn.Parameter(torch.ones(12)))
    groups = types.SimpleNamespace(foreign_groups=lambda: [], groups=pipeline_groups(1))
    layout, refusal, part = job_module.settle_layout(4, {"model": stage}, None, sharded, groups, 1)
    assert isinstance(part, meshes.PartMesh) and refusal == "" and layout.names == ("pp", "dp")
    # DTensors on a mesh of part of the job that nothing completes: said at once, unless sharded=True
    alone = types.SimpleNamespace(foreign_groups=lambda: [], groups=[group(range(4), "default_pg", "0")])
    layout, refusal, part = job_module.settle_layout(4, {"model": tensor_parallel(1)}, None, sharded, alone, 1)
    assert part is None and layout.replica_sets() == [(0,), (1,), (2,), (3,)]
    assert ("no group the script made completes it" in refusal) != sharded
