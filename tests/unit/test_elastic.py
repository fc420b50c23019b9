"""The worker library's pure parts: rollback choice, backend seams (with fakes), environment."""

from __future__ import annotations

import sys
import types

import pytest

from ftrun.agent import standby
from ftrun.elastic.backends import CommBackend, HcclBackend, NcclBackend, make_backend
from ftrun.elastic.job import WorkerEnv
from ftrun.elastic.rollback import NO_STATE, RollbackPlan, choose_rollback


@pytest.mark.parametrize(
    "committed, plan",
    [
        ([5, NO_STATE, 5, 5], RollbackPlan(5, 0, (1,))),  # one replacement
        ([NO_STATE, 7, 7, NO_STATE], RollbackPlan(7, 1, (0, 3))),  # rank 0 replaced: rank 1 sends
        ([4, 5, 5, NO_STATE], RollbackPlan(5, 1, (0, 3))),  # one rank finished a step more
        ([3, 3, 3, 3], RollbackPlan(3, 0, ())),  # nothing to send
        ([NO_STATE, NO_STATE], None),  # nobody holds the state: job level must take over
    ],
)
def test_choose_rollback(committed, plan):
    assert choose_rollback(committed) == plan


class FakeDist:
    """Records what a backend does to torch.distributed."""

    def __init__(self):
        self.calls = []
        self.initialized = True
        outer = self

        class World:
            def abort(self):
                outer.calls.append("abort")

        self.group = types.SimpleNamespace(WORLD=World())

    def is_initialized(self):
        return self.initialized

    def destroy_process_group(self):
        self.calls.append("destroy")
        self.initialized = False

    def init_process_group(self, name, **kwargs):
        self.calls.append(("init", name, kwargs["rank"], kwargs["world_size"]))
        self.initialized = True


def test_gloo_release_destroys_the_group():
    fake = FakeDist()
    CommBackend(dist=fake).release()
    assert fake.calls == ["destroy"]


def test_nccl_release_aborts_the_communicator_first():
    fake = FakeDist()
    backend = NcclBackend(dist=fake)
    backend.release()
    assert fake.calls == ["abort", "destroy"]


def test_nccl_interrupt_aborts_from_another_thread():
    fake = FakeDist()
    NcclBackend(dist=fake).interrupt()
    assert fake.calls == ["abort"]


@pytest.fixture
def fake_torch_npu(monkeypatch):
    calls = []
    npu = types.SimpleNamespace(
        stop_device=lambda device: calls.append(("stop_device", device)),
        restart_device=lambda device, rebuild_all_resources: calls.append(("restart_device", device, rebuild_all_resources)),
    )
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=npu))
    return calls


def test_hccl_release_stops_and_restarts_the_device_then_destroys(fake_torch_npu):
    fake = FakeDist()
    HcclBackend(dist=fake, local_rank=3).release()
    assert fake_torch_npu == [("stop_device", 3), ("restart_device", 3, False)]
    assert fake.calls == ["destroy"]


def test_hccl_interrupt_stops_the_device(fake_torch_npu):
    HcclBackend(dist=FakeDist(), local_rank=1).interrupt()
    assert fake_torch_npu == [("stop_device", 1)]


def test_gloo_forms_its_group_through_torch():
    fake = FakeDist()
    fake.initialized = False
    CommBackend(dist=fake).form_group(store=object(), rank=2, world_size=4, timeout=30)
    assert fake.calls == [("init", "gloo", 2, 4)]


def test_backend_names():
    assert isinstance(make_backend("nccl", dist=FakeDist()), NcclBackend)
    assert make_backend("gloo", dist=FakeDist()).name == "gloo"
    with pytest.raises(ValueError, match="unknown backend"):
        make_backend("mpi", dist=FakeDist())


def test_worker_env_outside_ftrun_is_none():
    assert WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}) is None


def test_worker_env_reads_the_ftrun_contract():
    env = WorkerEnv.from_environ({
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "FTRUN_RUN_ID": "job", "FTRUN_GENERATION": "2",
        "FTRUN_CONTROL_STORE": "head:29400", "FTRUN_REPLACEMENT": "1", "FTRUN_HEARTBEAT_TIMEOUT": "9",
    })
    assert (env.rank, env.local_rank, env.world_size, env.generation, env.replacement) == (3, 1, 4, 2, True)
    assert env.heartbeat_timeout == 9.0


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


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_elastic_ddp_averages_gradients_like_plain_backward(one_rank_group):
    import torch

    from ftrun.elastic.job import ElasticDDP

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 2)
    wrapped = ElasticDDP(torch.nn.Linear(4, 2))
    wrapped.module.load_state_dict(plain.state_dict())
    batch = torch.randn(3, 4)
    plain(batch).pow(2).sum().backward()
    wrapped(batch).pow(2).sum().backward()
    for a, b in zip(plain.parameters(), wrapped.module.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_interrupted_step_puts_running_statistics_back(one_rank_group):
    import torch

    from ftrun.elastic.job import ElasticDDP

    wrapped = ElasticDDP(torch.nn.BatchNorm1d(3))
    before = wrapped.module.running_mean.clone()
    wrapped.save_buffers()
    wrapped(torch.randn(8, 3) + 5)  # the forward of a step that a fault then interrupts
    assert not torch.equal(wrapped.module.running_mean, before)
    wrapped.restore_buffers()
    assert torch.equal(wrapped.module.running_mean, before)


@pytest.mark.parametrize("previous, now, calls", [("3", 2, [(3, 2)]), ("2", 3, [(2, 3)]), ("2", 2, []), ("", 2, [])])
def test_on_resize_tells_the_script_when_the_world_changed_size(monkeypatch, previous, now, calls):
    from types import SimpleNamespace

    from ftrun.elastic import ElasticJob

    monkeypatch.setenv("FTRUN_PREVIOUS_WORLD_SIZE", previous)
    seen = []
    ElasticJob.on_resize(SimpleNamespace(world_size=now), lambda old, new: seen.append((old, new)))
    assert seen == calls
