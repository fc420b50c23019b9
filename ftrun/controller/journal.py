"""What a controller writes to etcd at each decision, before the commands that follow from it, so that
a successor reads exactly where the job stands and goes on (``--rdzv-backend etcd``).

The decision itself is the policy's view of the job (``policy.JobView``: phase, generation, budget
spent, the repair under way); beside it, who holds each node and which spares stand by (the roster),
and what the rendezvous decided. What a successor does not need is left out: the reports already
consumed and the commands already published live in the control store, which the successor makes
afresh, and each agent, finding the new one, reads its commands from the first.

The journal is written in three parts, each under a key of its own (``EtcdKeys.journal_part``): the
decision, the roster and the rendezvous result. A decision rewrites only the parts that changed: at
1,024 nodes the rendezvous result and the roster are 280 kB of the journal's 285 kB, and writing it
whole took 120-300 ms a decision on the measuring machine (docs/scale.md); the rendezvous result never
changes after the rendezvous, and the roster changes only when a node's holder does.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.controller.leadership import Leadership
from ftrun.controller.states import JobView, Phase
from ftrun.etcd import EtcdClient, put
from ftrun.keys import EtcdKeys
from ftrun.messages import NodeSlot, RendezvousResult, from_json, to_json


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
    #: when the job started (wall clock): a successor's event log and status count from it
    started_at: float = 0.0

    @property
    def over(self) -> bool:
        """The job has ended (or is ending): a successor has nothing left to do."""
        return self.view.phase in (Phase.EXITING, Phase.DONE)

    def held_by(self, agent_id: str) -> NodeSlot | None:
        """The node ``agent_id`` holds, if any."""
        return next((slot for slot in self.nodes if slot.agent_id == agent_id), None)

    def parts(self) -> dict[str, object]:
        """The journal as it is written: each part under its own key (:data:`PARTS` names them)."""
        return {"decision": DecisionPart(self.leader, self.host, self.view, self.started_world, self.moves,
                                         self.started_at),
                "roster": RosterPart(self.nodes, self.spares),
                "rendezvous": self.rendezvous}

    @classmethod
    def from_parts(cls, texts: dict[str, str | bytes]) -> Journal | None:
        """The journal from its parts' texts, by name (None: one is missing, no journal written yet)."""
        if any(name not in texts for name in PARTS):
            return None
        decision = from_json(DecisionPart, texts["decision"])
        roster = from_json(RosterPart, texts["roster"])
        return cls(decision.leader, decision.host, decision.view, from_json(RendezvousResult, texts["rendezvous"]),
                   roster.nodes, roster.spares, decision.started_world, decision.moves, decision.started_at)


@dataclass(frozen=True)
class DecisionPart:
    """What changes at every decision: the policy's view, and who wrote it."""

    leader: str
    host: str
    view: JobView
    started_world: int
    moves: int
    started_at: float = 0.0


@dataclass(frozen=True)
class RosterPart:
    """Who holds each node, and which spares stand by: changes at a takeover, a resize, a spare's arrival."""

    nodes: tuple[NodeSlot, ...]
    spares: tuple[NodeSlot, ...]


#: the parts' names, the last of their keys
PARTS = ("decision", "roster", "rendezvous")


class JournalWriter:
    """One controller's writes of its journal: each part only when it differs from what etcd holds (as
    this controller last wrote it, or as it read it: ``resumed``, the journal a successor goes on from),
    the parts changed in one transaction conditioned on its term, so that a successor never reads half a
    decision. A successor that took the whole journal for new rewrote 262 kB at 1,024 nodes, 250 ms of
    its takeover."""

    def __init__(self, resumed: Journal | None = None) -> None:
        self._written: dict[str, object] = resumed.parts() if resumed is not None else {}

    def due(self, journal: Journal) -> bool:
        """Whether writing ``journal`` would write anything."""
        return bool(self._changed(journal))

    def write(self, leadership: Leadership, journal: Journal) -> int:
        """Write what changed (LeadershipLost, EtcdUnavailable as Leadership.write); the bytes written."""
        changed = self._changed(journal)
        if not changed:
            return 0
        texts = {name: to_json(part) for name, part in changed.items()}
        leadership.write([put(leadership.keys.journal_part(name), text) for name, text in texts.items()])
        self._written.update(changed)
        return sum(len(text) for text in texts.values())

    def _changed(self, journal: Journal) -> dict[str, object]:
        """The parts of ``journal`` that differ from what etcd holds."""
        if journal.over and self._ended_as(journal):
            return {}
        # the parts are compared as objects, not as text: the rendezvous result and the roster's slots
        # are the same objects from one decision to the next, so that most comparisons are identities
        return {name: part for name, part in journal.parts().items() if self._written.get(name) != part}

    def _ended_as(self, journal: Journal) -> bool:
        """etcd holds already that the job is over, with ``journal``'s exit code and reason: a successor
        of a job that is over only ends it (EtcdControlPlane), so the agents' exit acknowledgements, a
        decision each, are not written (at 1,024 nodes they were 1,024 writes at every job's end)."""
        written = self._written.get("decision")
        if not isinstance(written, DecisionPart) or written.view.phase not in (Phase.EXITING, Phase.DONE):
            return False
        return (written.view.exit_code, written.view.reason) == (journal.view.exit_code, journal.view.reason)


def read_journal(client: EtcdClient, keys: EtcdKeys) -> Journal | None:
    """The journal as etcd holds it now (one read: its parts at one revision); None if none was written."""
    prefix = keys.journal_part("")
    return Journal.from_parts({kv.key[len(prefix):]: kv.value for kv in client.get_prefix(prefix)})
