"""The worker library's pure parts: rollback choice, replica sets, backend seams (with fakes), environment."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from ftrun.agent import standby
from ftrun.elastic.backends import CommBackend, HcclBackend, NcclBackend, make_comm_backend
from ftrun.elastic.layout import ReplicaLayout
from ftrun.rollback import NO_STATE, RollbackPlan, Transfer, choose_rollback
from tests.npu_stand_in import Device, ProcessGroup, TorchNpu


def plan(step, *transfers):
    return RollbackPlan(step, tuple(Transfer(source, receivers) for source, receivers in transfers))


@pytest.mark.parametrize(
    "committed, replica_sets, expected",
    [
        ([5, NO_STATE, 5, 5], None, plan(5, (0, (1,)))),  # pure DP, one replacement
        ([NO_STATE, 7, 7, NO_STATE], None, plan(7, (1, (0, 3)))),  # rank 0 replaced: rank 1 sends
        ([4, 5, 5, NO_STATE], None, plan(5, (1, (0, 3)))),  # one rank finished a step more
        ([3, 3, 3, 3], None, plan(3)),  # nothing to send
        ([NO_STATE, NO_STATE], None, None),  # nobody holds the state: snapshots or job level
        # DP 2 x TP 2 (sets: ranks with the same TP coordinate): rank 1's DP peer 3 sends, rank 2 keeps its own
        ([6, NO_STATE, 6, 6], [(0, 2), (1, 3)], plan(6, (3, (1,)))),
        ([6, NO_STATE, 6, NO_STATE], [(0, 2), (1, 3)], None),  # a whole replica set lost
        ([NO_STATE, 6, 6, NO_STATE], [(0, 2), (1, 3)], plan(6, (2, (0,)), (1, (3,)))),  # one lost in each
        ([6, 6, 5, 6], [(0, 2), (1, 3)], plan(6, (0, (2,)))),
        ([6, NO_STATE, 6, 6], [(0,), (1,), (2,), (3,)], None),  # FSDP full shard: no replica
        ([6, 5, 6, 6], [(0, 1), (2, 3)], plan(6, (0, (1,)))),
        ([5, 5, 6, 6], [(0, 1), (2, 3)], None),  # a set holds only the older step: snapshots
    ],
)
def test_choose_rollback(committed, replica_sets, expected):
    assert choose_rollback(committed, replica_sets) == expected


def test_rollback_plan_names_each_receiver_s_source():
    chosen = plan(6, (2, (0,)), (1, (3,)))
    assert chosen.receivers == (0, 3)
    assert [chosen.source_for(rank) for rank in range(4)] == [2, None, None, 1]


@pytest.mark.parametrize(
    "dims, replicate, sets",
    [
        ({"dp": 4}, None, [(0, 1, 2, 3)]),  # pure DP
        ({"shard": 4}, None, [(0,), (1,), (2,), (3,)]),  # FSDP2 full shard
        ({"replicate": 2, "shard": 2}, None, [(0, 2), (1, 3)]),  # HSDP: the replicate dimension
        ({"dp": 2, "tp": 2}, None, [(0, 2), (1, 3)]),  # DP x TP: DP peers with the same TP coordinate
        ({"pp": 2, "dp": 2}, None, [(0, 1), (2, 3)]),  # DP x PP: the DP peers of a stage
        ({"pp": 2, "dp": 2, "tp": 2}, None, [(0, 2), (1, 3), (4, 6), (5, 7)]),
        ({"outer": 2, "inner": 2}, ("outer",), [(0, 2), (1, 3)]),  # named by the script
    ],
)
def test_replica_sets_from_the_declared_mesh(dims, replicate, sets):
    assert ReplicaLayout.declared(dims, replicate).replica_sets() == sets


def test_a_dimension_the_model_is_sharded_over_is_no_replica_dimension():
    # FSDP2 over a mesh its script called "dp": the parameters say Shard on it
    assert ReplicaLayout.declared({"dp": 4}).without({"dp"}).replica_sets() == [(0,), (1,), (2,), (3,)]


@pytest.mark.parametrize(
    "dims, replicate, message",
    [
        ({}, None, "at least one dimension"),
        ({"dp": 0}, None, "not a positive integer"),
        ({"dp": 2, "tp": 2}, ("pp",), "replicate names pp, which the mesh"),
    ],
)
def test_bad_meshes_are_refused_in_one_line(dims, replicate, message):
    with pytest.raises(ValueError, match=message):
        ReplicaLayout.declared(dims, replicate)


class FakeGroup:
    """A real group as the backends see it: it can be aborted."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def abort(self):
        self.calls.append(("abort", self.name))


def test_gloo_release_drops_the_recorded_connections():
    backend = CommBackend(dist=types.SimpleNamespace())
    backend._group_fds, backend._live = {1000}, [object()]
    backend.release([object()])
    assert backend._group_fds == set() and backend._live == []


def test_nccl_release_aborts_every_communicator():
    calls = []
    NcclBackend(dist=types.SimpleNamespace()).release([FakeGroup(calls, "world"), FakeGroup(calls, "tp")])
    assert sorted(calls) == [("abort", "tp"), ("abort", "world")]


def test_nccl_interrupt_aborts_the_live_communicators_from_another_thread():
    calls = []
    backend = NcclBackend(dist=types.SimpleNamespace())
    backend._live = [FakeGroup(calls, "world"), FakeGroup(calls, "dp")]
    backend.interrupt()
    assert sorted(calls) == [("abort", "dp"), ("abort", "world")]


def test_nccl_communicators_abort_at_once_not_one_after_another():
    """An NCCL abort took 1.05 s on the GPU check whatever the group: a mesh's groups aborted in turn
    held a repair a second per group. Each fake abort here waits for all the others: in turn, none
    would get past the barrier."""
    meeting = threading.Barrier(3, timeout=10)
    met = []

    class Meeting:
        def abort(self):
            meeting.wait()
            met.append(True)

    NcclBackend(dist=types.SimpleNamespace()).release([Meeting(), Meeting(), Meeting()])
    assert met == [True, True, True]


def recording_process_group(made: list) -> type:
    """A stand-in for torch's ProcessGroup that records how a backend builds a real group into ``made``."""

    class ProcessGroup:
        class BackendType:
            NCCL, GLOO = "NCCL", "GLOO"

        def __init__(self, store, rank, size):
            made.append(("group", store, rank, size))

        def _set_default_backend(self, kind):
            made.append(("default", kind))

        def _register_backend(self, device, kind, backend):
            made.append(("register", str(device), kind, backend))

    return ProcessGroup


def test_nccl_backend_builds_its_group_with_its_timeout_on_the_cuda_device_over_a_stand_in_dist(monkeypatch):
    made = []

    class Options:
        pass

    ProcessGroup = recording_process_group(made)

    def nccl(store, rank, size, options):
        return ("nccl", rank, size, options._timeout.total_seconds())

    fake = types.SimpleNamespace(ProcessGroup=ProcessGroup, ProcessGroupNCCL=nccl)
    nccl.Options = Options
    backend = NcclBackend(dist=fake, local_rank=1)
    monkeypatch.setattr("ftrun.elastic.backends._socket_fds", lambda: set())
    backend.connect("store", 2, 4, 30, (0, 1, 2, 3), "0_0")
    assert made == [("group", "store", 2, 4), ("default", "NCCL"), ("register", "cuda", "NCCL", ("nccl", 2, 4, 30.0))]
    assert backend.devices() == ("cuda", "cpu") and len(backend._live) == 1


@pytest.mark.parametrize("cuda", [False, True])
def test_gloo_serves_cuda_tensors_where_cuda_is_present(monkeypatch, cuda):
    """A model on a GPU trained over gloo (job.ddp(), a repair's state: the GPU check's repair)
    needs gloo registered for CUDA tensors, as init_process_group("gloo") registers it."""
    made = []
    fake = types.SimpleNamespace(ProcessGroup=recording_process_group(made),
                                 ProcessGroupGloo=lambda store, rank, size, timeout: "gloo")
    monkeypatch.setattr("ftrun.elastic.backends._cuda_present", lambda: cuda)
    monkeypatch.setattr("ftrun.elastic.backends._socket_fds", lambda: set())
    backend = CommBackend(dist=fake)
    backend.connect("store", 0, 2, 30, (0, 1), "0_0")
    expected = ["cpu", "cuda"] if cuda else ["cpu"]
    assert [m for m in made if m[0] == "register"] == [("register", device, "GLOO", "gloo") for device in expected]
    assert backend.devices() == tuple(expected)
    assert NcclBackend(dist=fake).devices() == ("cuda", "cpu")


@pytest.fixture
def torch_npu(monkeypatch):
    npu = TorchNpu()
    npu.install(monkeypatch)
    monkeypatch.setattr("ftrun.elastic.backends._socket_fds", lambda: set())
    return npu


def hccl_backend(local_rank: int) -> HcclBackend:
    return HcclBackend(dist=types.SimpleNamespace(ProcessGroup=ProcessGroup), local_rank=local_rank)


def test_hccl_release_stops_and_restarts_the_device_once_for_every_group(torch_npu):
    backend = hccl_backend(3)
    groups = [backend.connect("store", 0, 2, 30, (0, 1), name) for name in ("0_0", "0_1")]
    backend.release(groups)
    assert torch_npu.calls == [("stop_device", 3), ("check_uce_in_memory", 3), ("restart_device", 3)]


def test_hccl_backend_builds_its_group_through_a_stand_in_torch_npu_on_the_npu_device(torch_npu):
    backend = hccl_backend(2)
    group = backend.connect("store", 1, 2, 45, (4, 6), "3_dp")
    hccl = group._get_backend(Device("npu"))
    assert (hccl.rank, hccl.size, hccl.options._timeout.total_seconds()) == (1, 2, 45.0)
    assert (hccl.options.global_ranks_in_group, hccl.group_name) == ([4, 6], "group_name_3_dp")
    assert group.default_backend == "CUSTOM" and group._device_types == [Device("npu")]
    assert backend.devices() == ("npu", "cpu")


def test_hccl_interrupt_stops_the_device(torch_npu):
    hccl_backend(1).interrupt()
    assert torch_npu.calls == [("stop_device", 1)]


def test_backend_names():
    assert isinstance(make_comm_backend("nccl", dist=types.SimpleNamespace()), NcclBackend)
    assert make_comm_backend("gloo", dist=types.SimpleNamespace()).name == "gloo"
    with pytest.raises(ValueError, match="unknown backend"):
        make_comm_backend("mpi", dist=types.SimpleNamespace())


@pytest.mark.parametrize(
    "argv, ok",
    [
        ([sys.executable, "-u", "train.py"], True),
        ([sys.executable, "-u", "-m", "pkg.train"], True),
        ([sys.executable, "-u", "-c", "code", "train.py"], False),  # --run-path
        (["./train.sh"], False),  # --no-python
    ],
)
def test_which_commands_a_warm_standby_can_take(argv, ok):
    assert standby.can_run(argv) is ok


def test_standby_runs_a_script_with_its_assignment(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    out = tmp_path / "out.txt"
    script.write_text("import os, sys\nopen(os.environ['OUT'], 'w').write(os.environ['RANK'] + ' ' + ' '.join(sys.argv))\n")
    monkeypatch.chdir(tmp_path)  # run() changes directory: put it back afterwards
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    with monkeypatch.context() as m:
        m.setattr("os.environ", dict(__import__("os").environ))
        standby.run({"argv": [sys.executable, "-u", str(script), "--lr", "3"], "env": {"RANK": "5", "OUT": str(out)},
                     "cwd": str(tmp_path)})
    assert out.read_text() == f"5 {script} --lr 3"


def test_a_standby_imports_ahead_the_framework_its_script_names(tmp_path):
    hf_script, plain, missing = tmp_path / "hf.py", tmp_path / "plain.py", tmp_path / "gone.py"
    hf_script.write_text("import ftrun.elastic.hf\n")
    plain.write_text("import ftrun.elastic\n")
    assert standby.framework_imports(str(hf_script)) == ("transformers.trainer",)
    lightning_script = tmp_path / "lightning_script.py"  # by the integration's own module name
    lightning_script.write_text("from ftrun.elastic.integrations import lightning\n")
    # no module path in full, but the word: a script as written for torchrun that names Lightning
    assert standby.framework_imports(str(lightning_script)) == ("lightning.pytorch",)
    lightning_script.write_text("import ftrun.elastic.integrations.lightning\n")
    assert standby.framework_imports(str(lightning_script)) == ("lightning.pytorch",)
    assert standby.framework_imports(str(plain)) == ()
    assert standby.framework_imports(str(missing)) == standby.framework_imports(None) == ()


def test_only_a_script_that_names_torch_or_a_framework_on_it_is_worth_a_warm_interpreter(tmp_path):
    named = {"torch": "import torch.nn as nn\n", "library": "import ftrun.elastic\n",
             "framework": "from transformers import Trainer\n", "plain": "import json, time\nprint('tick')\n"}
    for name, text in named.items():
        (tmp_path / f"{name}.py").write_text(text)
    assert {name: standby.names_torch(str(tmp_path / f"{name}.py")) for name in named} == {
        "torch": True, "library": True, "framework": True, "plain": False}
    assert standby.names_torch(None)  # a module run with -m cannot be read: taken to
    assert not standby.names_torch(str(tmp_path / "gone.py"))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_elastic_ddp_averages_gradients_like_plain_backward(one_rank_group):
    import torch
    import torch.distributed as dist

    from ftrun.elastic.ddp import ElasticDDP

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    wrapped = ElasticDDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), bucket_mb=100 / 2**20)
    wrapped.module.load_state_dict(plain.state_dict())
    big = ElasticDDP(torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8))))  # 257 KiB each
    # DDP's own rule (torch's function: a bucket closes once it holds its cap or more), over the
    # parameters in the order their gradients come
    for ddp, caps, sizes in ((wrapped, [100, 100], [3, 1]), (big, [2**20, 25 * 2**20], [8, 8])):
        ddp_buckets, _ = dist._compute_bucket_assignment_by_size(list(reversed(list(ddp.module.parameters()))), caps)
        assert [len(bucket) for bucket in ddp._buckets] == [len(bucket) for bucket in ddp_buckets] == sizes
    batch = torch.randn(3, 4)
    plain(batch).pow(2).sum().backward()
    wrapped(batch).pow(2).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.module.parameters()):
        assert torch.equal(a.grad, b.grad)
        flats = [flat.data_ptr() for flat in wrapped._flats]
        assert b.grad.untyped_storage().data_ptr() in flats  # the bucket's view: nothing copied back
    with wrapped.no_sync():  # accumulated locally, averaged once
        wrapped(batch).pow(2).sum().backward()
    wrapped.sync_gradients()
    for a, b in zip(plain.parameters(), wrapped.module.parameters()):
        assert torch.equal(2 * a.grad, b.grad)
    for set_to_none in (False, True):  # zeroed in the bucket, or fresh gradients copied into it
        wrapped.zero_grad(set_to_none=set_to_none)
        wrapped(batch).pow(2).sum().backward()
        for a, b in zip(plain.parameters(), wrapped.module.parameters()):
            assert torch.equal(a.grad, b.grad)
    wrapped.zero_grad()
    with pytest.raises(RuntimeError, match="got no gradient"):  # the first layer's output alone is used
        wrapped.module[1](batch.new_ones(3, 8)).sum().backward()


def test_a_replacement_s_torch_ddp_lays_its_buckets_out_as_its_peers_did(one_rank_group):
    # issue 52 item 3: ftrun leaves DDP's own layout (the order the first iteration's gradients came in), and a
    # replacement's new DDP takes it from its peers' state, not in parameter order
    import torch

    from ftrun.elastic.ddp import BucketLayout

    def made():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        index = {id(p): i for i, p in enumerate(model.parameters())}
        orders: list[list[int]] = []

        def record(state, bucket):  # each bucket's parameters, in its order
            orders.append([index[id(p)] for p in bucket.parameters()])
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        ddp.register_comm_hook(None, record)
        return ddp, BucketLayout(ddp), orders

    peer, peer_layout, peer_orders = made()
    for _ in range(3):
        peer(torch.randn(3, 4)).sum().backward()
    assert peer_orders[0] == list(range(6)) != peer_orders[-1]  # DDP's first layout, then its own
    replacement, layout, orders = made()
    layout.load_state_dict(peer_layout.state_dict())
    replacement(torch.randn(3, 4)).sum().backward()
    assert orders == [peer_orders[-1]]


def test_interrupted_step_puts_running_statistics_back():
    import torch

    from ftrun.elastic.state import TrainingState

    state = TrainingState(ReplicaLayout.data_parallel(1))
    model = torch.nn.BatchNorm1d(3)
    state.register("model", model)
    before = model.running_mean.clone()
    state.begin_step()
    model(torch.randn(8, 3) + 5)  # the forward of a step that a fault then interrupts
    assert not torch.equal(model.running_mean, before)
    state.restore_buffers()
    assert torch.equal(model.running_mean, before)


@pytest.mark.parametrize("previous, now, calls", [("3", 2, [(3, 2)]), ("2", 3, [(2, 3)]), ("2", 2, []), ("", 2, [])])
def test_on_resize_tells_the_script_when_the_world_changed_size(previous, now, calls):
    from types import SimpleNamespace

    from ftrun.contract import WorkerEnv
    from ftrun.elastic import ElasticJob

    env = WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": str(now), "FTRUN_RUN_ID": "job", "FTRUN_GENERATION": "1",
                                  "FTRUN_CONTROL_STORE": "head:29400", "FTRUN_PREVIOUS_WORLD_SIZE": previous})
    seen = []
    ElasticJob.on_resize(SimpleNamespace(world_size=now, env=env), lambda old, new: seen.append((old, new)))
    assert seen == calls


def test_on_resize_is_never_called_under_plain_torchrun():
    from types import SimpleNamespace

    from ftrun.elastic import ElasticJob

    seen = []
    ElasticJob.on_resize(SimpleNamespace(world_size=2, env=None), lambda old, new: seen.append((old, new)))
    assert seen == []
