"""The worker contract (ftrun/contract.py): what the agent writes is what the worker library reads, and
the module stands on the standard library alone, so the worker library loads nothing of the launcher."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from ftrun.agent.workers import GenerationEnv, WorkerPlacement, base_env, worker_env
from ftrun.config import build_launch_config
from ftrun.contract import (
    DeviceAssignment,
    Endpoint,
    EndpointError,
    Fallback,
    Milestone,
    RollbackFailure,
    SnapshotSettings,
    WorkerEnv,
    parse_endpoint,
)
from tests.conftest import ROOT

CONTRACT = ROOT / "ftrun" / "contract.py"


def imported_modules(path) -> set[str]:
    """The top-level package of every module ``path`` imports, at any depth of its code."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import is one of the project's own
                found.add("." * node.level + (node.module or ""))
            else:
                found.add(node.module.split(".")[0])
    return found


def test_the_contract_imports_the_standard_library_alone():
    imported = imported_modules(CONTRACT)
    assert imported, "no import found: the check reads the wrong file"
    outside = sorted(name for name in imported if name not in sys.stdlib_module_names and name != "__future__")
    assert not outside, f"ftrun/contract.py imports {', '.join(outside)}: it may depend on the standard library only"


def test_the_worker_library_loads_nothing_of_the_launcher():
    code = "import json, sys, ftrun.elastic; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    loaded = json.loads(out.splitlines()[-1])
    assert "ftrun.elastic.job" in loaded and "ftrun.contract" in loaded
    launcher = [name for name in loaded if name.split(".")[:2] in (["ftrun", "config"], ["ftrun", "agent"],
                                                                   ["ftrun", "controller"], ["ftrun", "detection"],
                                                                   ["ftrun", "devices"])]
    assert not launcher, f"importing ftrun.elastic loads {', '.join(launcher)}"
    assert "yaml" not in loaded  # the launcher's config files are none of a training rank's business


FULL = WorkerEnv(rank=5, local_rank=1, world_size=8, run_id="job", generation=3, control_store="head:29400",
                 replacement=True, heartbeat_timeout=12.5, node_rank=2, recovery="process", previous_world_size=6,
                 ranktable="/tmp/ranktable.json", device=DeviceAssignment(device=6, index=1),
                 snapshots=SnapshotSettings(folder="/dev/shm/ftrun-x", every=10, limit=1 << 20, copies=2,
                                           restore_plan="/dev/shm/ftrun-x/plan-g00003.json"),
                 control_store_file="/tmp/ftrun-x/control_store", store_timeout=42.5, integrations=False)


@pytest.mark.parametrize("env", [
    FULL,
    WorkerEnv(rank=0, local_rank=0, world_size=1, run_id="r", generation=0, control_store="127.0.0.1:1",
              replacement=False, heartbeat_timeout=30.0),
], ids=["every-part", "cpu-without-snapshots"])
def test_the_worker_environment_reads_back_as_written(env):
    environ = env.to_environ()
    assert all(isinstance(value, str) for value in environ.values())
    assert WorkerEnv.from_environ(environ) == env


def test_what_the_agent_writes_is_what_the_worker_library_reads(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith("FTRUN_")]:
        monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text("")
    config = build_launch_config({"script": str(script), "nproc_per_node": "2", "rdzv_endpoint": "head:29400",
                                  "device": "cpu", "recovery": "process", "no_integrations": True})
    device = DeviceAssignment(device=6, index=1)
    snapshots = SnapshotSettings(folder=str(tmp_path), every=10, limit=4096, copies=2)
    gen = GenerationEnv(generation=3, restart_count=1, world_size=8, node_count=4, master_addr="head",
                        master_port=29501, control_store="head:29400", max_restarts=3, replacement=True,
                        previous_world_size=6, snapshots=snapshots)
    placement = WorkerPlacement(1, 5, 2, "node2", device=device, visibility=("CUDA_VISIBLE_DEVICES", "4,6"))
    read = WorkerEnv.from_environ(worker_env(config, placement, gen, str(tmp_path / "error.json")))
    assert read == WorkerEnv(rank=5, local_rank=1, world_size=8, run_id=config.run_id, generation=3,
                             control_store="head:29400", replacement=True, heartbeat_timeout=config.heartbeat_timeout,
                             node_rank=2, recovery="process", previous_world_size=6, device=device,
                             snapshots=snapshots, integrations=False)



#: every variable a worker of generation 3 gets beside the agent's own environment, with a device, the
#: snapshots (a MindSpore restore plan among them), both rank tables and a control store that may move
EXPECTED_WORKER_ENV = {
    "CUDA_VISIBLE_DEVICES": "4,6", "RANK_TABLE_FILE": "/logs/node2/hccl.json",
    "FTRUN_CONTROL_STORE": "head:29400", "FTRUN_CONTROL_STORE_FILE": "/tmp/ftrun-control-x/control-store",
    "FTRUN_STORE_TIMEOUT": "300", "FTRUN_DEVICE": "6", "FTRUN_DEVICE_INDEX": "1", "FTRUN_GENERATION": "3",
    "FTRUN_HEARTBEAT_TIMEOUT": "30", "FTRUN_NODE_RANK": "2", "FTRUN_PREVIOUS_WORLD_SIZE": "6",
    "FTRUN_RANKTABLE": "/logs/node2/ranktable.json", "FTRUN_RECOVERY": "process", "FTRUN_REPLACEMENT": "1",
    "FTRUN_RUN_ID": "job", "FTRUN_RESTORE_PLAN": "/dev/shm/ftrun-job/plan-g00003.json",
    "FTRUN_SNAPSHOT_COPIES": "2", "FTRUN_SNAPSHOT_DIR": "/dev/shm/ftrun-job", "FTRUN_SNAPSHOT_EVERY": "10",
    "FTRUN_SNAPSHOT_LIMIT": "4096", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "4", "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "29501", "RANK": "5", "ROLE_NAME": "default",
    "ROLE_RANK": "5", "ROLE_WORLD_SIZE": "8", "TORCHELASTIC_ERROR_FILE": "/logs/error.json",
    "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "WORLD_SIZE": "8",
    "TORCH_HCCL_ASYNC_ERROR_HANDLING": "0",  # --recovery process
}


@pytest.mark.parametrize("virtual_local_rank", [False, True])
def test_a_worker_gets_every_variable_of_its_place_key_for_key(tmp_path, monkeypatch, virtual_local_rank):
    """The environment built whole (``WorkerEnv`` with its device, snapshots and rank table) is the one
    the workers got when it was merged from parts, variable for variable."""
    for name in [name for name in os.environ if name.startswith(("FTRUN_", "PET_", "CUDA_", "RANK_TABLE"))]:
        monkeypatch.delenv(name)
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_HCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    config = build_launch_config({"script": str(script), "nproc_per_node": "2", "rdzv_endpoint": "head:29400",
                                  "device": "cpu", "recovery": "process", "run_id": "job",
                                  "virtual_local_rank": virtual_local_rank})
    snapshots = SnapshotSettings("/dev/shm/ftrun-job", every=10, limit=4096, copies=2,
                                 restore_plan="/dev/shm/ftrun-job/plan-g00003.json")
    gen = GenerationEnv(generation=3, restart_count=1, world_size=8, node_count=4, master_addr="head",
                        master_port=29501, control_store="head:29400", max_restarts=3, replacement=True,
                        ranktable="/logs/node2/ranktable.json", hccl_ranktable="/logs/node2/hccl.json",
                        previous_world_size=6, snapshots=snapshots,
                        control_store_file="/tmp/ftrun-control-x/control-store")
    placement = WorkerPlacement(1, 5, 2, "node2", DeviceAssignment(6, 1), ("CUDA_VISIBLE_DEVICES", "4,6"))
    env = worker_env(config, placement, gen, "/logs/error.json")
    expected = dict(EXPECTED_WORKER_ENV)
    if virtual_local_rank:  # the rank sees its own device alone, as device 0
        expected.update(LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="6", FTRUN_DEVICE_INDEX="0")
    assert env == {**base_env(config), **expected}
    read = WorkerEnv.from_environ(env)
    assert (read.ranktable, read.device, read.snapshots) == (
        "/logs/node2/ranktable.json", DeviceAssignment(6, 0 if virtual_local_rank else 1), snapshots)

def test_outside_ftrun_there_is_no_worker_environment():
    assert WorkerEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}) is None


def test_the_worker_environment_reads_the_ftrun_contract():
    env = WorkerEnv.from_environ({
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "FTRUN_RUN_ID": "job", "FTRUN_GENERATION": "2",
        "FTRUN_CONTROL_STORE": "head:29400", "FTRUN_REPLACEMENT": "1", "FTRUN_HEARTBEAT_TIMEOUT": "9",
    })
    assert (env.rank, env.local_rank, env.world_size, env.generation, env.replacement) == (3, 1, 4, 2, True)
    assert env.heartbeat_timeout == 9.0
    assert env.device_index == 1  # no device assigned: LOCAL_RANK, as under torchrun
    assert (env.device, env.snapshots, env.previous_world_size) == (None, None, 0)


def test_the_device_index_is_ftrun_s_choice_once_a_rank_moved():
    assert FULL.device_index == 1 and FULL.local_rank == 1
    moved = WorkerEnv.from_environ({**FULL.to_environ(), "FTRUN_DEVICE": "7", "FTRUN_DEVICE_INDEX": "0"})
    assert moved.device == DeviceAssignment(7, 0) and moved.device_index == 0


@pytest.mark.parametrize("every", ["", "0"])
def test_no_snapshots_without_a_folder_and_a_period(every):
    assert SnapshotSettings.from_environ({"FTRUN_SNAPSHOT_DIR": "/dev/shm/x", "FTRUN_SNAPSHOT_EVERY": every}) is None


@pytest.mark.parametrize("text, expected", [
    ("head:29400", Endpoint("head", 29400)), ("head", Endpoint("head", 7)), ("[::1]:1234", Endpoint("::1", 1234)),
])
def test_parse_endpoint(text, expected):
    assert parse_endpoint(text, 7) == expected


@pytest.mark.parametrize("text, message", [
    ("", "FTRUN_CONTROL_STORE is empty"), (":1", "has no host name"), ("head:x", "port 'x' is not a number"),
    ("head:0", "port 0 is outside 1-65535"), ("a" * 64 + ":1", "is not a host name or address"),
])
def test_a_bad_endpoint_is_a_value_error_naming_its_origin(text, message):
    with pytest.raises(EndpointError, match=message):
        parse_endpoint(text, 7, "FTRUN_CONTROL_STORE")
    assert issubclass(EndpointError, ValueError)


def test_the_milestones_are_the_strings_the_ranks_count():
    assert [m.value for m in Milestone] == ["stopped", "arrived", "joined", "resumed"]


def test_a_rollback_failure_reads_back_from_its_text_and_an_older_plain_reason_does_not():
    failure = RollbackFailure(Fallback.SNAPSHOT_UNREADABLE, replicas=True, detail="step 4 fails its checksum")
    assert RollbackFailure.from_text(failure.to_text()) == failure
    assert failure.reason.endswith("a snapshot to go back to is unreadable (step 4 fails its checksum)")
    assert RollbackFailure.from_text("no healthy replica holds the training state") is None
