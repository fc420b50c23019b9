"""What a generation's workers on this node are told beyond their rank (``GenerationEnv``): the generation,
its worker store, the control store, the rank tables written for it, the snapshots' folder, the relay."""

from __future__ import annotations

import logging
from typing import Callable

from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.node_snapshots import NodeSnapshots
from ftrun.agent.seat import Seat
from ftrun.agent.workers import GenerationEnv
from ftrun.contract import Endpoint
from ftrun.messages import Command
from ftrun.ranktable import FTRUN_TABLE, HCCL_TABLE, ftrun_table, hccl_table, write_table

log = logging.getLogger(__name__)


class GenerationEnvs:
    """Builds each generation's ``GenerationEnv`` from the controller's command, writing its rank tables
    in ``folder``. ``control_store`` gives the control store's endpoint now (it moves under etcd)."""

    def __init__(self, run_id: str, seat: Seat, devices: NodeDevices, folder: str,
                 control_store: Callable[[], Endpoint], control_store_file: str = "",
                 snapshots: NodeSnapshots | None = None, relay_dir: str = ""):
        self.run_id = run_id
        self.seat = seat
        self.devices = devices
        self.folder = folder
        self.control_store = control_store
        #: --rdzv-backend etcd: the file that names the control store as it moves
        self.control_store_file = control_store_file
        self.snapshots = snapshots
        #: --framework mindspore: the node's relay folder
        self.relay_dir = relay_dir
        #: why the last generation had no HCCL rank table ("" when it had one), said once until it changes
        self._no_hccl_table = ""

    def rank_tables(self, generation: int) -> tuple[str, str]:
        """Write this generation's rank tables (from the controller's layout); their paths: ftrun's
        (FTRUN_RANKTABLE) and, on Ascend, HCCL's (RANK_TABLE_FILE), "" for none."""
        table = ftrun_table(self.run_id, generation, self.seat.layout.nodes, self.seat.node_rank,
                            self.devices.assigned)
        ftrun_path, hccl_path = write_table(self.folder, FTRUN_TABLE, table), ""
        if self.devices.backend.kind == "npu" and self.devices.allocator is not None:
            try:
                hccl_path = write_table(self.folder, HCCL_TABLE, hccl_table(table))
                self._no_hccl_table = ""
            except ValueError as e:
                if str(e) != self._no_hccl_table:
                    log.warning("no RANK_TABLE_FILE from generation %d on: %s; HCCL negotiates through the store "
                                "instead", generation, e)
                self._no_hccl_table = str(e)
        return ftrun_path, hccl_path

    def for_command(self, command: Command, replacement: bool = False) -> GenerationEnv:
        """The environment of ``command``'s generation (``replacement``: for a repair's new ranks)."""
        host, _, port = command.worker_store.rpartition(":")
        layout = self.seat.layout
        ranktable, hccl_ranktable = self.rank_tables(command.generation)
        return GenerationEnv(
            generation=command.generation,
            restart_count=command.restart_count,
            world_size=layout.world_size,
            node_count=len(layout.nodes),
            master_addr=host,
            master_port=int(port),
            control_store=str(self.control_store()),
            max_restarts=command.max_restarts,
            replacement=replacement,
            ranktable=ranktable,
            hccl_ranktable=hccl_ranktable,
            previous_world_size=command.previous_world_size,
            snapshots=self.snapshots.settings(command) if self.snapshots is not None else None,
            control_store_file=self.control_store_file,
            scheduler=command.scheduler,
            relay_dir=self.relay_dir,
        )
