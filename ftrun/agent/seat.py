"""Where this node sits in the job: its node rank and ranks (the rendezvous's slot), and who holds which
node (the controller's layout). Pure: the caller reads the layout (``NodeProtocol.layout``)."""

from __future__ import annotations

import dataclasses
import logging

from ftrun.agent.workers import WorkerPlacement
from ftrun.contract import DeviceAssignment
from ftrun.messages import NodeLayout, NodeSlot

log = logging.getLogger(__name__)


class Seat:
    """This agent's node in the job, as the rendezvous gave it and the controller's layouts changed it."""

    def __init__(self, agent_id: str, host: str, slot: NodeSlot, layout: NodeLayout | None = None):
        self.agent_id = agent_id
        self.host = host
        self.slot = slot
        #: which agent holds which node (the rendezvous's, then the controller's after takeovers and resizes)
        self.layout = layout if layout is not None else NodeLayout()

    @property
    def node_rank(self) -> int:
        """-1: a spare that holds no node (yet)."""
        return self.slot.node_rank

    @property
    def first_rank(self) -> int:
        return self.slot.first_rank

    @property
    def nproc(self) -> int:
        return self.slot.nproc

    def take(self, node_rank: int) -> None:
        """A spare takes the place of node ``node_rank`` (the controller's TAKEOVER)."""
        self.slot = dataclasses.replace(self.slot, node_rank=node_rank)

    def update(self, layout: NodeLayout) -> bool:
        """The layout the controller published last (before a generation starts); False when this agent
        holds no node in it any more (it was declared lost and left out, or replaced)."""
        self.layout = layout
        mine = next((n for n in layout.nodes if n.node_rank == self.node_rank), None)
        if mine is None or mine.agent_id != self.agent_id:
            return False
        if 0 <= self.first_rank != mine.first_rank:  # renumbered (a spare taking over held none)
            log.warning("node %d now holds ranks %d-%d of %d", self.node_rank, mine.first_rank,
                        mine.first_rank + mine.nproc - 1, layout.world_size)
        self.slot = dataclasses.replace(self.slot, first_rank=mine.first_rank)
        return True

    def forget_layout(self) -> None:
        """The controller moved (etcd): its store's layout is read whole."""
        self.layout = NodeLayout()

    def local_ranks(self, ranks: tuple[int, ...] | list[int]) -> list[int]:
        """The local ranks of those of global ``ranks`` this node holds."""
        return [r - self.first_rank for r in ranks if 0 <= r - self.first_rank < self.nproc]

    def placement(self, local_rank: int, device: tuple[DeviceAssignment | None, tuple[str, str] | None] = (None, None),
                  cpus: tuple[int, ...] = ()) -> WorkerPlacement:
        """Where the worker of ``local_rank`` sits (``device``: its device and the runtime's variable of
        the devices it sees, as ``NodeDevices.placed`` gives them; ``cpus``: its binding)."""
        group_rank = next(i for i, n in enumerate(self.layout.nodes) if n.node_rank == self.node_rank)
        return WorkerPlacement(local_rank, self.first_rank + local_rank, group_rank, self.host, *device, cpus)
