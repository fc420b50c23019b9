"""A node's parts as the agent wires them (ftrun/agent/agent.py, ``Agent._take_node``), for the unit tests
of each part: a real TCPStore on loopback, the node's real protocol over it, real worker processes (a
tiny script, no torch), a CPU node's devices. No controller: the test publishes what it would, through
its real ``Publisher``."""

from __future__ import annotations

import datetime
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ftrun.agent.commands import CommandExecutor
from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.generations import GenerationEnvs
from ftrun.agent.protocol import NodeProtocol
from ftrun.agent.seat import Seat
from ftrun.agent.spawner import Spawner
from ftrun.agent.supervision import Supervision
from ftrun.agent.workers import ProcessOps, WorkerGroup
from ftrun.auth import Signer
from ftrun.config import LaunchConfig, build_launch_config
from ftrun.contract import Endpoint
from ftrun.controller.publisher import Publisher
from ftrun.detection.hang import HangWatch
from ftrun.detection.sources import NodeHealth
from ftrun.detection.table import load_fault_table
from ftrun.interrupts import Interrupts
from ftrun.keys import JobKeys
from ftrun.messages import Command, NodeLayout, NodeSlot, Report
from ftrun.store import ControlStore

AGENT = "agent-a"
HOST = "127.0.0.1"
#: the worker: LOCAL_RANK picks its part of argv[1] ("0,3,sleep,tick": rank 0 exits 0, rank 1 exits 3, rank 2
#: sleeps, rank 3 prints a line every 0.05 s; "step": prints "step 7", then sleeps; "orphan": starts a process
#: that outlives it, and exits 0), after it wrote its environment to argv[2]/env-RANK-GENERATION.json
WORKER = """
import json, os, subprocess, sys, time
env = dict(os.environ)
name = "env-%s-%s.json" % (env["RANK"], env.get("FTRUN_GENERATION", "-"))
with open(os.path.join(sys.argv[2], name + ".part"), "w") as f:
    json.dump(env, f)
os.replace(os.path.join(sys.argv[2], name + ".part"), os.path.join(sys.argv[2], name))
part = sys.argv[1].split(",")[int(env["LOCAL_RANK"])]
if part == "step":  # a plain script that says its step
    print("step 7", flush=True)
    part = "sleep"
if part == "sleep":
    time.sleep(120)
if part == "orphan":
    subprocess.Popen(["sleep", "120"])
    part = "0"
while part == "tick":
    print("tick", flush=True)
    time.sleep(0.05)
sys.exit(int(part))
"""


def hosted_store() -> ControlStore:
    """A TCPStore hosted in this process on loopback, as the controller's agent holds it."""
    from torch.distributed import TCPStore

    raw = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10))
    return ControlStore(raw, Endpoint(HOST, raw.port), True, Signer(b"k" * 32))


def launch_config(tmp_path: Path, parts: str, nproc: int = 2, **raw) -> LaunchConfig:
    """The configuration of a standalone CPU job of ``nproc`` ranks running WORKER with ``parts``."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    values = {"script": str(script), "script_args": (parts, str(out)), "standalone": True, "device": "cpu",
              "nproc_per_node": str(nproc), "run_id": "parts", **raw}
    return build_launch_config(values)


def layout(*nodes: tuple[int, str, int, int], version: int = 1) -> NodeLayout:
    """(node rank, agent id, nproc, first rank) for each node."""
    return NodeLayout(tuple(NodeSlot(rank, agent, HOST, nproc, first) for rank, agent, nproc, first in nodes), version)


@dataclass
class Node:
    """One node's parts, wired as the agent wires them."""

    config: LaunchConfig
    store: ControlStore
    keys: JobKeys
    protocol: NodeProtocol
    seat: Seat
    group: WorkerGroup
    devices: NodeDevices
    supervision: Supervision
    spawner: Spawner
    commands: CommandExecutor
    interrupts: Interrupts
    folder: Path
    out: Path
    ops: ProcessOps
    publisher: Publisher
    reports_read: int = field(default=0)

    def command(self, kind, generation: int = 0, **fields) -> Command:
        return Command(kind, generation, worker_store=f"{HOST}:29999", **fields)

    def reports(self) -> list[Report]:
        """The reports this node sent since the last call."""
        found = self.store.read_from(self.keys.report_count, self.keys.report, Report, self.reports_read)
        self.reports_read += len(found)
        return [r for r in found if r is not None]

    def env_of(self, rank: int, generation: int, timeout: float = 30) -> dict:
        """The environment the worker of ``rank`` ran with in ``generation``."""
        path = self.out / f"env-{rank}-{generation}.json"
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"rank {rank} of generation {generation} never started"
            time.sleep(0.02)
        return json.loads(path.read_text())

    def wait_ended(self, count: int, timeout: float = 30) -> None:
        """Until ``count`` of the workers ended (their processes; the group has not polled them yet)."""
        deadline = time.monotonic() + timeout
        while sum(w.proc.poll() is not None for w in self.group.workers) < count:
            assert time.monotonic() < deadline, "the workers did not end"
            time.sleep(0.02)

    def close(self) -> None:
        self.group.stop(2.0)
        self.ops.close()


def make_node(tmp_path: Path, parts: str, nproc: int = 2, hang_timeout: float = 0.0, heartbeat_timeout: float = 30.0,
              **raw) -> Node:
    config = launch_config(tmp_path, parts, nproc, **raw)
    store = hosted_store()
    keys = JobKeys(config.run_id)
    protocol = NodeProtocol(store, keys, AGENT, node_timeout=600.0)
    protocol.node_rank = 0
    publisher = Publisher(store, keys, lambda: [AGENT])
    nodes = layout((0, AGENT, nproc, 0))
    publisher.write_layout(nodes.nodes)
    seat = Seat(AGENT, HOST, NodeSlot(0, AGENT, HOST, nproc, 0), nodes)  # as after the first START
    ops = ProcessOps()
    folder = tmp_path / "node0"
    folder.mkdir()
    group = WorkerGroup(ops, config, str(folder), warm_standbys=0)
    table = load_fault_table(None)
    devices = NodeDevices.open(config, table)
    interrupts = Interrupts()
    hangs = HangWatch(heartbeat_timeout, hang_timeout)
    supervision = Supervision(group, seat, devices, lambda: protocol, lambda: None, NodeHealth([hangs, *devices.sources()]),
                              hangs, interrupts, table, watch_output=bool(hang_timeout))
    envs = GenerationEnvs(config.run_id, seat, devices, str(folder), lambda: store.endpoint)
    spawner = Spawner(group, seat, devices, envs, lambda: protocol, supervision.started)
    supervision.spawner = spawner
    commands = CommandExecutor(group, seat, spawner, supervision, lambda: protocol, stop_timeout=2.0)
    return Node(config, store, keys, protocol, seat, group, devices, supervision, spawner, commands, interrupts,
                folder, tmp_path / "out", ops, publisher)



@pytest.fixture
def node(tmp_path):
    """Makes nodes (``make_node``'s arguments but the folder); each is closed at the test's end (the
    unit tests' conftest.py hands it on)."""
    made: list[Node] = []

    def make(parts: str, **options) -> Node:
        made.append(make_node(tmp_path, parts, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()
