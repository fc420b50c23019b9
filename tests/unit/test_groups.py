"""ftrun's reconfigurable process groups and sharded state, in one process over a real gloo group."""

from __future__ import annotations

import datetime
import io
import threading
import time
import types
import weakref

import pytest
import torch
import torch.distributed as dist

from ftrun.elastic.backends import CommBackend
from ftrun.elastic.groups import WAIT_SLICE, ElasticGroup, GroupSet, _Guarded, answer_locally, init_default_group, install
from ftrun.elastic.shards import SHARD, from_local, load_local, to_local
from ftrun.step_times import CollectiveWait, Standing, collective_text, read_collective


@pytest.fixture
def groups():
    """A one-rank job whose default group is ftrun's, in generation 0."""
    owned = GroupSet(CommBackend(), dist.HashStore(), lambda generation: f"g{generation}/pg", timeout=30)
    install(owned, ("cpu",))
    owned.reconfigure(0)
    init_default_group(owned, rank=0, world_size=1, timeout=30)
    yield owned
    owned.release()
    dist.destroy_process_group()


def test_each_group_counts_the_elements_all_reduced_over_it_the_evidence_of_data_parallelism(groups):
    sub = dist.new_group([0], group_desc="mesh_dp")
    dist.all_reduce(torch.ones(3), group=sub)
    dist.all_reduce(torch.ones(2))  # over the default group
    dist.broadcast(torch.ones(5), src=0, group=sub)  # not a reduction
    assert sub.reduced == 3 and dist.group.WORLD.reduced == 2 and sub.group_desc == "mesh_dp"
    groups.count_reductions()
    dist.all_reduce(torch.ones(2, 3), group=sub)
    assert sub.reduced == 6 and dist.group.WORLD.reduced == 0


def test_the_script_s_groups_stay_the_same_objects_and_reconnect_in_the_next_generation(groups):
    world = dist.group.WORLD
    sub = dist.new_group([0])
    assert isinstance(world, ElasticGroup) and isinstance(sub, ElasticGroup) and groups.groups == [world, sub]
    assert dist.get_backend(world) == "ftrun" and sub.global_ranks == (0,)
    tensor = torch.ones(3)
    dist.all_reduce(tensor, group=sub)
    first = sub.real()
    groups.release()  # the repair drops every real group
    groups.reconfigure(1)
    dist.all_reduce(tensor, group=sub)  # connects again, under generation 1's keys
    assert sub.real() is not first and dist.group.WORLD is world
    assert torch.equal(tensor, torch.ones(3))


@pytest.mark.parametrize("held_in_a_cycle", [False, True], ids=["dropped", "cycle"])
def test_release_destroys_every_real_group_so_gloo_closes_its_sockets(groups, held_in_a_cycle):
    world = dist.group.WORLD
    dist.all_reduce(torch.ones(1))
    real = weakref.ref(world.real())
    if held_in_a_cycle:  # as queued asynchronous work may hold one: only the garbage collector frees it
        cycle: list = [world.real()]
        cycle.append(cycle)
        del cycle
    groups.release()
    assert real() is None


def test_collectives_torch_calls_with_named_options_reach_the_real_group_pytorch_barrier_opts(groups):
    # dist.barrier() calls group.barrier(opts=...) by name: a group that took positional arguments only
    # failed every script ending with a barrier
    dist.barrier()
    groups.local = True  # a replacement's setup: answered locally, named or not
    dist.barrier()
    assert dist.group.WORLD.barrier(opts=dist.BarrierOptions()).wait()


def test_groups_of_another_backend_are_named_as_foreign(groups):
    other = dist.new_group([0], backend="gloo")
    assert groups.foreign_groups() == [f"{other.group_name} (gloo)"]


class Failing(dist._Work):
    def wait(self, timeout=None):
        raise RuntimeError("Connection closed by peer")

    def get_future(self):
        future = torch.futures.Future()
        future.set_exception(RuntimeError("Connection closed by peer"))
        return future


class BrokenGroup:
    """A real group whose all-reduce goes as ``allreduce`` says (a peer died)."""

    def __init__(self, allreduce):
        self.allreduce = allreduce


def test_a_failed_collective_in_a_step_is_recorded_and_the_rest_of_the_step_is_answered_locally(groups):
    world = dist.group.WORLD
    world.real()
    groups.in_step = True
    world._real = BrokenGroup(allreduce=lambda *args: Failing())
    tensor = torch.full((2,), 3.0)
    work = dist.all_reduce(tensor, async_op=True)
    assert work.wait() and groups.failure is not None  # recorded, not raised
    work = world.allreduce([tensor])  # answered locally from now on
    assert work.get_future().value() == [tensor]
    groups.reconfigure(1)
    assert groups.failure is None


def test_a_collective_the_backend_already_waited_for_is_no_failure_nccl_returns_no_work(groups):
    """NCCL answers a collective whose caller will not wait (``opts.asyncOp`` False) with no work: it
    ordered the streams itself. On an H200 that None was taken for a failed collective, and a healthy
    job was repaired online."""
    world = dist.group.WORLD
    world.real()
    groups.in_step = True
    world._real = BrokenGroup(allreduce=lambda *args: None)
    dist.all_reduce(torch.ones(2))
    assert world.allreduce([torch.ones(2)], dist.AllreduceOptions()) is None and groups.failure is None


def test_a_failed_future_settles_with_the_collective_s_outputs(groups):
    world = dist.group.WORLD
    world.real()
    groups.in_step = True
    world._real = BrokenGroup(allreduce=lambda *args: Failing())
    tensor = torch.ones(2)
    future = world.allreduce([tensor], dist.AllreduceOptions()).get_future()
    assert future.value() == [tensor] and groups.failure is not None


def test_outside_a_step_a_failed_collective_raises(groups):
    world = dist.group.WORLD
    world.real()
    world._real = BrokenGroup(allreduce=lambda *args: (_ for _ in ()).throw(RuntimeError("peer died")))
    with pytest.raises(RuntimeError, match="peer died"):
        dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize(
    "op, make, expect",
    [
        ("allgather", lambda: ([[torch.zeros(2), torch.zeros(2)]], [torch.tensor([1.0, 2.0])]),
         lambda a: all(torch.equal(t, torch.tensor([1.0, 2.0])) for t in a[0][0])),
        ("_allgather_base", lambda: (torch.zeros(4), torch.tensor([1.0, 2.0])),
         lambda a: torch.equal(a[0], torch.tensor([1.0, 2.0, 1.0, 2.0]))),
        ("_reduce_scatter_base", lambda: (torch.zeros(2), torch.arange(4.0)),
         lambda a: torch.equal(a[0], torch.tensor([2.0, 3.0]))),  # rank 1's part
        ("reduce_scatter", lambda: ([torch.zeros(1)], [[torch.tensor([5.0]), torch.tensor([7.0])]]),
         lambda a: torch.equal(a[0][0], torch.tensor([7.0]))),
        ("broadcast", lambda: ([torch.tensor([9.0])],), lambda a: torch.equal(a[0][0], torch.tensor([9.0]))),
    ],
)
def test_a_replacement_s_setup_collectives_are_answered_as_if_every_rank_held_its_tensors(op, make, expect):
    args = make()
    work = answer_locally(op, rank=1, size=2, args=args)
    assert work.wait() and expect(args)


@pytest.fixture
def mesh(groups):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))


def test_sharded_state_travels_as_local_shards_and_comes_back_on_the_receiver_s_own_mesh(mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 2), mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = to_local({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    shard = state["model"]["weight"]
    assert SHARD in shard and shard["placements"] == ["S(0)"] and shard["shape"] == [2, 4]
    buffer = io.BytesIO()
    torch.save(state, buffer)  # readable without unpickling code
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    torch.manual_seed(1)
    other = fully_shard(torch.nn.Linear(4, 2), mesh=mesh)
    fresh = torch.optim.Adam(other.parameters())  # has not stepped: no state of its own yet
    load_local(other, loaded["model"])
    load_local(fresh, loaded["optimizer"])
    assert isinstance(other.weight, DTensor) and torch.equal(other.weight.to_local(), model.weight.to_local())
    moment = fresh.state[other.weight]["exp_avg"]
    assert isinstance(moment, DTensor) and torch.equal(moment.to_local(), optimizer.state[model.weight]["exp_avg"].to_local())


def test_a_shard_without_a_dtensor_to_land_in_is_an_error():
    with pytest.raises(ValueError, match="no DTensor"):
        from_local({SHARD: torch.zeros(1), "shape": [1], "stride": [1], "placements": ["S(0)"]}, torch.zeros(1))


def test_the_dimensions_a_model_is_sharded_over_are_read_from_its_dtensors(mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ftrun.elastic.job import _sharded_dims

    assert _sharded_dims(fully_shard(torch.nn.Linear(4, 2), mesh=mesh)) == {"shard"}
    assert _sharded_dims(fully_shard(torch.nn.Linear(4, 2), mesh=init_device_mesh("cpu", (1,)))) == {"#0"}
    assert _sharded_dims(torch.nn.Linear(4, 2)) == set() and _sharded_dims(object()) == set()


def settle(monkeypatch, *, made=0, foreign=(), sharded_over=(), declared=None, sharded=False):
    from ftrun.elastic import job as job_module
    from ftrun.elastic.layout import ReplicaLayout

    monkeypatch.setattr(job_module, "_sharded_dims", lambda obj: set(sharded_over))
    groups = types.SimpleNamespace(foreign_groups=lambda: list(foreign), groups=[object()] * (1 + made))
    layout, refusal, _ = job_module.settle_layout(4, {"model": object()},
                                                  ReplicaLayout.declared(declared) if declared else None, sharded,
                                                  groups)
    return layout.replica_sets(), refusal


@pytest.mark.parametrize(
    "case, sets, refusal",
    [
        ({}, [(0, 1, 2, 3)], ""),  # pure data parallelism
        ({"sharded": True}, [(0,), (1,), (2,), (3,)], ""),
        ({"declared": {"dp": 2, "tp": 2}, "made": 2}, [(0, 2), (1, 3)], ""),
        ({"declared": {"dp": 2, "tp": 2}, "made": 2, "sharded_over": {"tp"}}, [(0, 2), (1, 3)], ""),
        ({"declared": {"dp": 4}, "sharded_over": {"dp"}}, [(0,), (1,), (2,), (3,)], ""),  # FSDP2 over "dp"
        ({"declared": {"dp": 4}, "sharded_over": {"#0"}}, [(0,), (1,), (2,), (3,)], ""),  # over a mesh of its own
        ({"made": 2}, [(0,), (1,), (2,), (3,)], "this script makes 2 process groups of its own without job.mesh()"),
        ({"sharded_over": {"#0"}}, [(0,), (1,), (2,), (3,)], "this script makes sharded DTensors without job.mesh()"),
        ({"foreign": ["3 (gloo)"]}, [(0,), (1,), (2,), (3,)], "group 3 (gloo) was made with another backend"),
    ],
)
def test_the_layout_a_repair_goes_by_or_why_it_cannot(monkeypatch, case, sets, refusal):
    got_sets, got_refusal = settle(monkeypatch, **case)
    assert got_sets == sets
    assert got_refusal.startswith(refusal) and bool(got_refusal) == bool(refusal)


class _Mesh:
    """What _layout_from_placements reads of a DeviceMesh."""

    def __init__(self, ranks, names):
        self.mesh = torch.tensor(ranks)
        self.mesh_dim_names = names
        self.ndim = self.mesh.ndim

    def __eq__(self, other):
        return self.mesh.tolist() == other.mesh.tolist() and self.mesh_dim_names == other.mesh_dim_names


class _Placement:
    def __init__(self, replicate: bool):
        self.replicate = replicate

    def is_replicate(self):
        return self.replicate

    def is_shard(self):
        return not self.replicate


class _DTensor:
    def __init__(self, mesh, *replicate):
        self.device_mesh, self.placements = mesh, [_Placement(r) for r in replicate]


class _Holding(torch.nn.Module):
    def __init__(self, *params):
        super().__init__()
        self.held = params

    def parameters(self, recurse=True):
        return iter(self.held)


WHOLE = _Mesh([[0, 1], [2, 3]], ("rep", "shard"))


@pytest.mark.parametrize(
    "params, replicate",
    [
        ([_DTensor(WHOLE, True, False), _DTensor(WHOLE, True, False)], ("rep",)),  # HSDP, whatever the name
        ([_DTensor(WHOLE, True, False), _DTensor(WHOLE, True, True)], ("rep",)),  # one parameter replicated too
        ([_DTensor(WHOLE, False, False)], ()),  # sharded over both: each rank alone
        ([_DTensor(_Mesh([[0, 1], [2, 3]], None), True, False)], ("#0",)),  # a mesh without names
        ([_DTensor(_Mesh([0, 1], ("tp",)), False)], None),  # tensor parallelism's sub-mesh: its peers are not on it
        ([_DTensor(_Mesh([[0, 2], [1, 3]], ("rep", "shard")), True, False)], None),  # not in rank order
        ([_DTensor(WHOLE, True, False), _DTensor(_Mesh([[0, 1], [2, 3]], ("a", "b")), True, False)], None),  # two meshes
        ([_DTensor(WHOLE, True, False), torch.nn.Parameter(torch.ones(1))], None),  # a plain parameter beside them
        ([], None),
    ],
)
def test_a_mesh_is_read_from_the_placements_of_the_registered_parameters_stand_in_dtensors(monkeypatch, params, replicate):
    from ftrun.elastic import job as job_module

    monkeypatch.setattr(job_module, "is_dtensor", lambda value: isinstance(value, _DTensor))
    layout = job_module._layout_from_placements({"model": _Holding(*params), "step": object()}, 4)
    assert (layout.replicate if layout else None) == replicate
    if layout is not None:
        assert layout.shape == (2, 2)


def test_the_layout_the_placements_show_is_the_one_a_repair_goes_by(monkeypatch):
    from ftrun.elastic import job as job_module

    monkeypatch.setattr(job_module, "is_dtensor", lambda value: isinstance(value, _DTensor))
    groups = types.SimpleNamespace(foreign_groups=lambda: [], groups=[object()] * 3)
    model = _Holding(_DTensor(WHOLE, True, False))
    layout, refusal, _ = job_module.settle_layout(4, {"model": model}, None, False, groups)
    assert layout.replica_sets() == [(0, 2), (1, 3)] and refusal == ""
    # init(sharded=True) says only that each rank holds its own part, as HSDP's shards do: the copies along
    # "rep" still hold (issue 42: it fell back to job level, recommending a replica dimension the script had)
    layout, refusal, _ = job_module.settle_layout(4, {"model": model}, None, True, groups)
    assert layout.replica_sets() == [(0, 2), (1, 3)] and refusal == ""
    full = _Holding(_DTensor(WHOLE, False, False))  # FSDP2's full shard over both: each rank alone, either way
    for sharded in (False, True):
        layout, refusal, _ = job_module.settle_layout(4, {"model": full}, None, sharded, groups)
        assert layout.replica_sets() == [(0,), (1,), (2,), (3,)] and refusal == ""


def two_gloo_ranks() -> tuple[dist.Store, dict[int, dist.ProcessGroup]]:
    """Two real gloo ranks of one group in this process (each formed in a thread of its own, as they meet in the
    store): the store, and each rank's group."""
    store = dist.HashStore()
    made: dict[int, dist.ProcessGroup] = {}

    def make(rank: int) -> None:
        made[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    makers = [threading.Thread(target=make, args=(rank,), name=f"gloo-rank-{rank}") for rank in (0, 1)]
    for maker in makers:
        maker.start()
    for maker in makers:
        maker.join(30)
    return store, made


def test_a_receive_that_waits_longer_than_a_slice_is_no_failure_over_real_gloo():
    """A gloo receive's timed wait that runs out closes the connection to its peer: waited for in
    slices, a pipeline stage's receive slower than a slice (under load) failed, and a healthy job was
    repaired online."""
    store, made = two_gloo_ranks()
    owner = GroupSet(CommBackend(), store, lambda generation: f"g{generation}/pg", timeout=30)
    owner.reconfigure(0)
    received = torch.zeros(3)
    work = _Guarded(made[1].recv([received], 0, 7), owner, "recv", 1, 2, ([received], 0, 7))
    sender = threading.Timer(5 * WAIT_SLICE.total_seconds(), lambda: made[0].send([torch.arange(3.0)], 1, 7).wait())
    sender.start()
    try:
        assert work.wait() and owner.failure is None
        assert received.tolist() == [0.0, 1.0, 2.0]
    finally:
        sender.join(30)


def test_the_collective_a_rank_waits_in_is_known_while_it_waits_and_forgotten_once_done_over_real_gloo():
    """What the heartbeat reports for a stall's line: a blocking wait (a recv whose sender is late) and a
    future handed out (torch's DDP waits on it in C++), each from its start until it settles."""
    store, made = two_gloo_ranks()
    owner = GroupSet(CommBackend(), store, lambda generation: f"g{generation}/pg", timeout=30)
    owner.reconfigure(0)
    assert owner.waiting_now() is None
    received = torch.zeros(3)
    work = _Guarded(made[1].recv([received], 0, 7), owner, "recv", 1, 2, ([received], 0, 7), "3")
    waiter = threading.Thread(target=work.wait, name="test-waiter")
    began = time.time()
    waiter.start()
    deadline = time.monotonic() + 10
    while owner.waiting_now() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    wait = owner.waiting_now()
    assert wait is not None and (wait.op, wait.group, wait.group_size) == ("recv", "3", 2)
    assert began - 1 < wait.since <= time.time()
    made[0].send([torch.arange(3.0)], 1, 7).wait()
    waiter.join(30)
    assert owner.waiting_now() is None and received.tolist() == [0.0, 1.0, 2.0]
    tensor = torch.ones(2)
    future = _Guarded(made[0].allreduce([tensor]), owner, "allreduce", 0, 2, ([tensor],), "0").get_future()
    wait = owner.waiting_now()
    assert wait is not None and wait.op == "all_reduce"  # torch.distributed's word, not the ProcessGroup's
    made[1].allreduce([torch.ones(2)]).wait()
    future.wait()
    assert owner.waiting_now() is None and tensor.tolist() == [2.0, 2.0]


@pytest.mark.parametrize("wait, saving, text", [
    (None, None, "42 -"),
    (CollectiveWait("all_reduce", "0", 4, 1700000000.25), None, "42 1700000000.250 4 all_reduce 0"),
    (CollectiveWait("broadcast", "mesh dp", 2, 5.0), None, "42 5.000 2 broadcast mesh dp"),  # torch's names may hold spaces
    (None, 1700000000.5, "42 save 1700000000.500 -"),  # a checkpoint save between two steps
    # torch.distributed.checkpoint's collectives, inside its save
    (CollectiveWait("all_gather", "mesh dp", 2, 6.0), 5.0, "42 save 5.000 6.000 2 all_gather mesh dp"),
])
def test_the_collective_a_heartbeat_writes_reads_back(wait, saving, text):
    assert collective_text(wait, 42, saving) == text and read_collective(text) == Standing(42, wait, saving)


@pytest.mark.parametrize("text", ["", "x -", "42", "42 5.0 0 all_reduce 0", "42 -1 2 all_reduce 0", "42 a 2 b c",
                                  "42 save -", "42 save", "42 save x -", "42 save -1 -", "42 save 5.0",
                                  "42 save 5.0 5.0 0 all_reduce 0", "save 5.0 -"])
def test_a_collective_text_not_written_by_a_heartbeat_reads_as_none(text):
    assert read_collective(text) is None
