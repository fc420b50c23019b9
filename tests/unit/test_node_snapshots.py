"""The node's snapshots as its agent tends them (ftrun/agent/node_snapshots.py): real keepers (memory,
server) on loopback, their inventories in a real TCPStore, a real rank's snapshot writer."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from ftrun.agent.node_snapshots import NodeSnapshots
from ftrun.agent.seat import Seat
from ftrun.agent.workers import ProcessOps
from ftrun.auth import Signer
from ftrun.contract import SnapshotSettings
from ftrun.elastic.arrays import TorchSnapshotWriter
from ftrun.keys import JobKeys
from ftrun.messages import Command, CommandKind, NodeSlot
from ftrun.snapshots.keeper import SnapshotKeeper
from ftrun.snapshots.plan import RestorePlan, SnapshotInventory
from tests.unit.node_parts import HOST, hosted_store, launch_config, layout

TOKEN = b"t" * 32


KEYS = JobKeys("snap")


@pytest.fixture
def nodes(tmp_path):
    """Two nodes' snapshots (node 0 of agent a, node 1 of agent b) of one job, publishing in one store.
    Node 0's is made as the agent makes it; node 1's keeper has a run id of its own, so that the two
    keepers' folders (named after the run and the process) differ in this one process."""
    store, ops, made = hosted_store(), ProcessOps(), []
    both = layout((0, "a", 1, 0), (1, "b", 1, 1))

    def make(agent: str, node_rank: int) -> NodeSnapshots:
        config = launch_config(tmp_path, "0", nproc=1, snapshot_every="1", replicate_every="1",
                               snapshot_memory="64MB", run_id=KEYS.run_id)
        seat = Seat(agent, HOST, NodeSlot(node_rank, agent, HOST, 1, node_rank), both)
        if node_rank == 0:
            node = NodeSnapshots.start(config, seat, lambda: store, Signer(TOKEN), TOKEN, ops)
        else:
            keeper = SnapshotKeeper(config.snapshots, f"snap-{agent}-{os.getpid()}", 1, HOST, HOST, Signer(TOKEN), TOKEN)
            keeper.start()
            node = NodeSnapshots(keeper, lambda: store, KEYS, seat, replicas=1)
            node.publish()
        made.append(node)
        return node

    make.store = store
    yield make
    for node in made:
        node.stop()
    ops.close()


def inventory(store, agent: str) -> SnapshotInventory | None:
    return store.try_get(SnapshotInventory, KEYS.snapshot_inventory(agent))


def test_no_snapshots_without_the_flag(tmp_path):
    config = launch_config(tmp_path, "0", nproc=1)
    seat = Seat("a", HOST, NodeSlot(0, "a", HOST, 1, 0))
    assert NodeSnapshots.start(config, seat, hosted_store, Signer(), b"", None) is None


def test_a_started_node_publishes_where_its_server_is(nodes):
    node = nodes("a", 0)
    published = inventory(nodes.store, "a")
    assert (published.agent_id, published.node_rank, published.held) == ("a", 0, ())
    assert published.address == node.keeper.address and node.keeper.address.startswith(HOST)


def test_the_inventory_is_written_when_it_changed_and_again_after_a_move(nodes):
    node = nodes("a", 0)
    key = node.keys.snapshot_inventory("a")
    nodes.store.raw.delete_key(key)
    node.publish()  # unchanged: not written
    assert inventory(nodes.store, "a") is None
    node.moved()  # a new store holds nothing of this node
    node.publish()
    assert inventory(nodes.store, "a") is not None


def test_a_nodes_snapshots_go_to_the_next_node_once_it_is_up(nodes):
    a = nodes("a", 0)
    a.find_peers()  # node 1 is not up yet: looked for again at the next keepalive
    b = nodes("b", 1)
    a.at_keepalive()
    write = TorchSnapshotWriter(a.keeper.folder, 0, 1, True, every=1, limit=0, copies=6)
    for step in (1, 2):
        write.write(step, {"w": torch.full((4,), float(step))})
    write.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not b.keeper.inventory("b", 1).held:
        time.sleep(0.05)
    assert {(h.rank, h.where) for h in b.keeper.inventory("b", 1).held} == {(0, "replica")}


def test_a_restarted_mindspore_generation_finds_its_restore_plan_in_a_file(nodes):
    node = nodes("a", 0)
    plan = RestorePlan(3, step=7, reason="resumed")
    nodes.store.set(node.keys.restore_plan(3, 0), plan)
    env = node.settings(Command(CommandKind.START, 3, scheduler="127.0.0.1:8000")).to_environ()
    settings = SnapshotSettings.from_environ(env)
    assert settings.folder == node.keeper.folder and settings.every == 1
    assert json.loads(open(settings.restore_plan).read())["step"] == 7
    assert "FTRUN_RESTORE_PLAN" not in node.settings(Command(CommandKind.START, 3)).to_environ()  # torch ranks read the store
