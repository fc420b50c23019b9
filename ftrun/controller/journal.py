"""What a controller writes to etcd at each decision, before the commands that follow from it, so that
a successor reads exactly where the job stands and goes on (``--rdzv-backend etcd``).

The decision itself is the policy's view of the job (``policy.JobView``: phase, generation, budget
spent, the repair under way); beside it, who holds each node and which spares stand by (the roster),
and what the rendezvous decided. What a successor does not need is left out: the reports already
consumed and the commands already published live in the control store, which the successor makes
afresh, and each agent, finding the new one, reads its commands from the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.controller.policy import JobView, Phase
from ftrun.messages import NodeSlot, RendezvousResult


@dataclass(frozen=True)
class Journal:
    #: the agent whose controller wrote it, and its host
    leader: str
    host: str
    view: JobView
    #: what the rendezvous decided (the summary's and the status's nodes)
    rendezvous: RendezvousResult
    #: the roster now: who holds each node, which spares stand by
    nodes: tuple[NodeSlot, ...]
    spares: tuple[NodeSlot, ...]
    #: the world size of the last generation started
    started_world: int
    #: how many times the controller moved to another agent before this one
    moves: int = 0

    @property
    def over(self) -> bool:
        """The job has ended (or is ending): a successor has nothing left to do."""
        return self.view.phase in (Phase.EXITING, Phase.DONE)

    def held_by(self, agent_id: str) -> NodeSlot | None:
        """The node ``agent_id`` holds, if any."""
        return next((slot for slot in self.nodes if slot.agent_id == agent_id), None)
