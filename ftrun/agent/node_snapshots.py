"""The node's snapshots as its agent tends them (--snapshot-every): the keeper (memory, server, persister,
``ftrun/snapshots/keeper.py``), what it holds published for the controller's restore plans, where its
replicas go, and the files a restarted MindSpore generation reads its plan from."""

from __future__ import annotations

import os
import subprocess
from typing import Callable

from ftrun import mindspore
from ftrun.agent.seat import Seat
from ftrun.agent.workers import ProcessOps
from ftrun.auth import Signer
from ftrun.config import LaunchConfig
from ftrun.contract import SnapshotSettings
from ftrun.keys import JobKeys
from ftrun.messages import Command
from ftrun.snapshots.keeper import SnapshotKeeper, ring_peers
from ftrun.snapshots.plan import RestorePlan, SnapshotInventory
from ftrun.store import ControlStore, bind_address


class NodeSnapshots:
    """One node's snapshots, for its agent. ``store`` gives the control store now (under etcd it is
    another one once the controller moved: then call ``moved``)."""

    def __init__(self, keeper: SnapshotKeeper, store: Callable[[], ControlStore], keys: JobKeys, seat: Seat,
                 replicas: int, save_on_failure: bool = False):
        self.keeper = keeper
        self._store = store
        self.keys = keys
        self.seat = seat
        #: how many other nodes hold a replica of this node's snapshots
        self.replicas = replicas
        self.save_on_failure = save_on_failure
        #: the inventory last published
        self._inventory: SnapshotInventory | None = None
        #: peer agent id -> its snapshot server's address
        self._peer_addresses: dict[str, str] = {}

    @classmethod
    def start(cls, config: LaunchConfig, seat: Seat, store: Callable[[], ControlStore], signer: Signer, token: bytes,
              ops: ProcessOps) -> NodeSnapshots | None:
        """The node's snapshot memory, server and persister, started and published; None without --snapshot-every."""
        options = config.snapshots
        if not options.enabled:
            return None
        bind = bind_address(seat.host, config.store_bind, config.several_nodes)

        persister: tuple[str, ...] = ()
        env = dict(os.environ)
        if config.framework == "mindspore":  # .ckpt files, written by a python that has mindspore
            persister, env = mindspore.persister_command(config.entrypoint), mindspore.with_ftrun_on_path(env)

        def spawn(argv: list[str]) -> subprocess.Popen:
            return ops.spawn(argv, env, stdin=subprocess.PIPE)

        keeper = SnapshotKeeper(options, config.run_id, seat.nproc, seat.host, bind, signer, token, spawn, persister)
        ops.remove_on_exit(keeper.folder)
        keeper.start()
        node = cls(keeper, store, JobKeys(config.run_id), seat, options.replicas, options.save_on_failure)
        node.publish()
        return node

    def stop(self) -> None:
        self.keeper.stop()

    def publish(self, verify: bool = False) -> None:
        """What the node's snapshot memory holds, for the controller (only when it changed). ``verify``:
        the ranks are stopped, their snapshots final: check each one's sum now."""
        inventory = self.keeper.inventory(self.seat.agent_id, self.seat.node_rank, verify)
        if inventory != self._inventory:
            self._store().set(self.keys.snapshot_inventory(self.seat.agent_id), inventory)
            self._inventory = inventory

    def at_keepalive(self) -> None:
        """With each keepalive of a node that holds ranks: the inventory when it changed, and the peers."""
        if self.seat.node_rank >= 0:
            self.publish()
            self.find_peers()

    def find_peers(self) -> None:
        """Where this node sends its replicas: the next nodes in node order, at their snapshot servers."""
        nodes = self.seat.layout.nodes
        peers = []
        for node_rank in ring_peers([n.node_rank for n in nodes], self.seat.node_rank, self.replicas):
            agent_id = next(n.agent_id for n in nodes if n.node_rank == node_rank)
            if agent_id not in self._peer_addresses:
                inventory = self._store().try_get(SnapshotInventory, self.keys.snapshot_inventory(agent_id))
                if inventory is None:
                    continue  # not up yet: looked for again at the next keepalive
                self._peer_addresses[agent_id] = inventory.address
            peers.append((node_rank, self._peer_addresses[agent_id]))
        self.keeper.set_peers(peers)

    def after_stop(self) -> None:
        """Ranks stopped: their snapshots are final. Check each one's sum, so that the controller's
        restore skips a damaged one, and (--save-on-failure) write them to disk."""
        self.publish(verify=True)
        self.save_if_asked()

    def save_if_asked(self) -> None:
        """--save-on-failure: write the newest snapshots to disk (a fault, or an exit that is no success)."""
        if self.save_on_failure:
            self.keeper.save_newest()

    def settings(self, command: Command) -> SnapshotSettings:
        """What the ranks of ``command``'s generation need to write their snapshots here; for a
        MindSpore generation after a restart, the file of its restore plan too."""
        return self.keeper.settings(self._left_plan(command))

    def _left_plan(self, command: Command) -> str:
        """A MindSpore job's ranks cannot read the control store (their python has no torch): the node's
        restore plan of a restarted generation goes to a file beside their snapshots. "": none."""
        if not command.scheduler or command.generation <= 0:
            return ""
        plan = self._store().try_get(RestorePlan, self.keys.restore_plan(command.generation, self.seat.node_rank))
        return self.keeper.leave_plan(command.generation, plan) if plan is not None else ""

    def moved(self) -> None:
        """The controller moved (etcd): the inventory is published again in its store, the peers looked up there."""
        self._inventory = None
        self._peer_addresses = {}
