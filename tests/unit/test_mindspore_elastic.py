"""MindSpore snapshots without MindSpore: numpy arrays through the snapshot format and a rank's writer, the
restore plan the agent leaves in a file, the persister's command, and the rule that the library imports no
torch (a MindSpore python has none), and the Model.train callback driven by a real Model.train (in the
MindSpore python, outside ftrun). The rest of the library's MindSpore side runs in
tests/integration/test_mindspore.py."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np

from ftrun.messages import to_json
from ftrun.mindspore import persister_command, with_ftrun_on_path
from ftrun.mindspore_elastic import read_plan
from ftrun.snapshots.format import HEADER_SIZE, copy_arrays, lay_out, load_arrays, load_states, read_verified
from ftrun.snapshots.plan import MEMORY, RestorePlan, RestoreSource
from ftrun.snapshots.rank import ArrayKind, SnapshotWriter, load_own, own_steps
from tests import parts
from tests.conftest import ROOT
from tests.integration.test_mindspore import needs_mindspore


def parameters() -> collections.OrderedDict:
    """What a MindSpore rank snapshots: arrays by parameter name, as asnumpy() gives them."""
    return collections.OrderedDict([
        ("fc.weight", np.arange(16, dtype=np.float32).reshape(2, 8) / 3),
        ("fc.bias", np.array([0.5, -1.25], dtype=np.float32)),
        ("beta1_power", np.array(0.9, dtype=np.float32)),  # 0-d, as Adam's are
        ("global_step", np.array([7], dtype=np.int32)),
        ("moment1.fc.weight", np.arange(16, dtype=np.float64).reshape(8, 2).T),  # not contiguous
        ("mask", np.array([True, False])),
        ("empty", np.empty((0, 3), dtype=np.float16)),
    ])


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)


def test_numpy_arrays_come_back_from_a_snapshot_exactly_with_their_dtypes_and_shapes(tmp_path):
    writer = SnapshotWriter(str(tmp_path), 1, 2, False, every=2, limit=0, copies=2, arrays=ArrayKind())
    assert writer.write(4, parameters())
    writer.wait()
    header, blob = read_verified(writer.paths[0])
    assert (header.step, header.rank, header.world_size, header.sharded) == (4, 1, 2, False)
    assert same(load_arrays(header, blob), parameters())
    assert own_steps(str(tmp_path), 1) == [4]
    assert same(load_own(str(tmp_path), 1, 4, ArrayKind()), parameters())


def test_a_numpy_snapshot_reads_back_as_torch_tensors_of_the_same_dtypes():
    torch = parts.module("torch")
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([3], dtype=np.int64),
             "m": np.array([True])}
    layout = lay_out(state, "numpy")
    assert [spec[0] for spec in pickle.loads(layout.meta)[1]] == ["float32", "int64", "bool"]
    tensors = lay_out({k: torch.from_numpy(v) for k, v in state.items()})
    assert tensors.meta == layout.meta  # one format: the same structure and specs either way
    header = layout.header(1, 3, 0, 1, False)
    blob = bytearray(header.total)
    blob[:HEADER_SIZE] = header.pack().ljust(HEADER_SIZE, b"\0")
    blob[HEADER_SIZE:HEADER_SIZE + len(layout.meta)] = layout.meta
    copy_arrays(blob, layout, header.data_offset, range(len(layout.tensors)))
    loaded = load_states(header, blob)
    assert all(torch.equal(loaded[k], torch.from_numpy(v)) for k, v in state.items())


def test_the_restore_plan_the_agent_leaves_reads_back_in_the_rank(tmp_path):
    plan = RestorePlan(2, 6, (RestoreSource(0, 0, "127.0.0.1:5000", MEMORY, "/dev/shm/x/rank-00000.1", 100, 42),
                              RestoreSource(1, 0, "127.0.0.1:5000", MEMORY, "/dev/shm/x/rank-00001.0", 100, 43)))
    path = tmp_path / "plan-g00002.json"
    path.write_text(to_json(plan))
    assert read_plan(str(path)) == plan
    assert read_plan("") is None and read_plan(str(tmp_path / "gone.json")) is None
    path.write_text("{not json")
    assert read_plan(str(path)) is None


def test_a_mindspore_job_s_persister_runs_in_the_workers_python_and_finds_this_ftrun():
    command = persister_command(("/opt/ms/bin/python", "-u", "train.py"))
    assert command == ("/opt/ms/bin/python", "-u", "-m", "ftrun.snapshots.persist", "mindspore")
    assert persister_command(("./train.sh",))[0] == sys.executable  # --no-python: no python of its own
    env = with_ftrun_on_path({"PYTHONPATH": f"/elsewhere{os.pathsep}{ROOT}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]


def test_the_mindspore_library_imports_no_torch_and_nothing_of_the_launcher():
    code = ("import json, sys; sys.modules['torch'] = None; import ftrun.mindspore_elastic; "
            "print(json.dumps(sorted(n for n, m in sys.modules.items() if m is not None)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    loaded = json.loads(out.splitlines()[-1])
    assert "ftrun.snapshots.rank" in loaded
    assert not [name for name in loaded if name.split(".")[0] in ("torch", "numpy", "mindspore", "yaml", "psutil")]
    assert not [name for name in loaded if name.split(".")[:2] in (["ftrun", "elastic"], ["ftrun", "agent"],
                                                                   ["ftrun", "controller"], ["ftrun", "config"],
                                                                   ["ftrun", "detection"], ["ftrun", "devices"])]


#: a tiny Model.train (3 batches a epoch, 2 epochs) with job.callback(), recording restore() and commit() calls
MODEL_TRAIN = textwrap.dedent("""
    import json
    import numpy as np
    from mindspore import nn
    from mindspore.dataset import NumpySlicesDataset
    from mindspore.train import Model
    import ftrun.mindspore_elastic

    net = nn.Dense(2, 1)
    job = ftrun.mindspore_elastic.init()
    job.register(network=net)
    calls = []
    restore, commit = job.restore, job.commit
    job.restore = lambda start=0: calls.append(["restore", job.step]) or restore(start)
    job.commit = lambda: calls.append(["commit", job.step]) or commit()
    data = NumpySlicesDataset({"x": np.ones((6, 2), np.float32), "y": np.zeros((6, 1), np.float32)},
                              shuffle=False).batch(2)
    model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.1))
    model.train(2, data, callbacks=[job.callback()], dataset_sink_mode=False)
    print(json.dumps({"step": job.step, "calls": calls}))
""")


def test_the_model_train_callback_restores_at_train_begin_and_commits_every_step():
    """Outside ftrun (no FTRUN_* variables) nothing is restored or snapshotted: the callback's calls and the
    step count are what Model.train drives. About 7 s, most of it importing mindspore."""
    python = needs_mindspore()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "MS_", "RANK_"))}
    done = subprocess.run([python, "-c", MODEL_TRAIN], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**env, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["calls"] == [["restore", 0]] + [["commit", step] for step in range(6)]
    assert result["step"] == 6
