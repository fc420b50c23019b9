"""Who is in the job, as the controller keeps it: which agent holds each node rank now, which spare
agents stand by idle, and whether each one's keepalive still moves.

The rendezvous fills it; takeovers, scale-ins and agents that come late change it. It reads the
agents' keepalive counters and join records from the store and writes nothing: the controller's
publisher writes the layout made from it, and the answers to late agents.
"""

from __future__ import annotations

import dataclasses
import logging

from ftrun.controller.states import JobView
from ftrun.keys import JobKeys
from ftrun.messages import JoinRecord, NodeSlot, RendezvousResult
from ftrun.rendezvous import node_slot
from ftrun.store import ControlStore

log = logging.getLogger(__name__)


class Keepalives:
    """When each keepalive counter last moved, by this process's clock (so hosts need no clock sync)."""

    def __init__(self):
        self._seen: dict[str, tuple[int, float]] = {}
        #: silence before this moment does not count (``quiet_until``)
        self._heard_until = 0.0

    def quiet_until(self, moment: float) -> None:
        """No counter counts as quiet before ``moment``: a controller that took office in a store of its own
        hears the agents only once each found it, and counted from its first look a node whose agent was
        still on its way (etcd slow to answer it) would be lost --node-timeout later."""
        self._heard_until = max(self._heard_until, moment)

    def quiet_for(self, key: str, count: int, now: float) -> float:
        """Seconds since ``key``'s counter last changed; 0 when it just did (or is new)."""
        seen, since = self._seen.get(key, (None, now))
        if count != seen:
            self._seen[key] = (count, now)
            return 0.0
        return max(0.0, now - max(since, self._heard_until))

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)


class OwnPause:
    """A controller whose thread did not turn for longer than --node-timeout: its process was stopped
    (SIGSTOP, its host suspended), and the agents' silence meanwhile is its own. Those whose calls to its
    store gave up look for the controller in etcd, and come back once it answers; each agent gets a whole
    timeout from then, as with a successor (counted, a controller woken after 8 s took its spares for lost
    at once)."""

    def __init__(self, keepalives: Keepalives, timeout: float):
        self.keepalives, self.timeout = keepalives, timeout
        #: when the controller's thread last turned (monotonic; 0 before its loop)
        self._turned = 0.0

    def turned(self, now: float) -> None:
        if self._turned and now - self._turned > self.timeout:
            log.warning("the controller did not run for %.1fs (its process stopped?): the agents' silence "
                        "counts from now", now - self._turned)
            self.keepalives.quiet_until(now + self.timeout)
        self._turned = now


class Roster:
    """The job's nodes and idle spares, by agent."""

    def __init__(self, store: ControlStore, keys: JobKeys):
        self.store = store
        self.keys = keys
        #: node rank -> the node as it is now (a spare's agent after a takeover)
        self.nodes: dict[int, NodeSlot] = {}
        #: idle spare agents
        self.spares: list[NodeSlot] = []
        #: the nodes' and spares' keepalive counters, as this controller last saw them move
        self.keepalives = Keepalives()
        #: join records answered so far (the rendezvous's, then late arrivals)
        self._arrivals_seen = 0

    def take_places(self, result: RendezvousResult) -> None:
        """The places the rendezvous gave."""
        self.nodes = {slot.node_rank: slot for slot in result.nodes}
        self.spares = list(result.spares)
        self._arrivals_seen = len(self.nodes) + len(self.spares) + len(result.left_out)  # --preflight left some out
        if self.spares:
            log.info("%d spare node%s standing by: %s", len(self.spares), "s" if len(self.spares) != 1 else "",
                     ", ".join(s.host for s in self.spares))

    def agents(self) -> list[str]:
        """Every agent that hears the controller's decisions: each node's, then each idle spare's."""
        return [slot.agent_id for slot in [*self.nodes.values(), *self.spares]]

    def present(self, view: JobView) -> list[NodeSlot]:
        """The nodes that hold a place in the job now, in node order."""
        return [self.nodes[node] for node in sorted(view.present & set(self.nodes))]

    def renumber(self, view: JobView) -> tuple[NodeSlot, ...]:
        """The nodes that hold a place in the job now, global ranks numbered over them in node order
        (a scale-in or a grow-back renumbers them)."""
        first_rank, nodes = 0, []
        for slot in self.present(view):
            if slot.first_rank != first_rank:
                slot = self.nodes[slot.node_rank] = dataclasses.replace(slot, first_rank=first_rank)
            nodes.append(slot)
            first_rank += slot.nproc
        return tuple(nodes)

    def holder_of_rank(self, rank: int) -> NodeSlot | None:
        return next((n for n in self.nodes.values() if n.first_rank <= rank < n.first_rank + n.nproc), None)

    def spare_for(self, nproc: int) -> NodeSlot | None:
        """An idle spare that can run a node of ``nproc`` ranks."""
        return next((s for s in self.spares if s.nproc == nproc), None)

    def hand_over(self, agent_id: str, node_rank: int) -> tuple[NodeSlot, NodeSlot | None]:
        """The spare ``agent_id`` holds node ``node_rank`` from now on: the spare, and the node's agent
        before it (None for a node new to the job)."""
        spare = next(s for s in self.spares if s.agent_id == agent_id)
        self.spares.remove(spare)
        lost = self.nodes.get(node_rank)
        self.nodes[node_rank] = dataclasses.replace(spare, node_rank=node_rank,
                                                    first_rank=lost.first_rank if lost else -1)
        return spare, lost

    def forget_host(self, host: str) -> int | None:
        """The agent on ``host`` is gone: no spare stands by there any more; the node it held, if any."""
        self.spares = [s for s in self.spares if s.host != host]
        return next((n.node_rank for n in self.nodes.values() if n.host == host), None)

    def silent_nodes(self, view: JobView, now: float, timeout: float) -> list[int]:
        """The nodes in the job whose keepalive has not moved for ``timeout`` seconds (one round trip for
        every node); each one's clock starts again, for a spare that takes the node."""
        silent = []
        for node, count in self.keepalive_counts(view).items():
            key = self.keys.node_heartbeat(node)
            if self.keepalives.quiet_for(key, count, now) > timeout:
                silent.append(node)
                self.keepalives.forget(key)
        return silent

    def keepalive_counts(self, view: JobView) -> dict[int, int]:
        """Each node's keepalive counter now (one round trip for every node)."""
        nodes = sorted(view.present)
        return dict(zip(nodes, self.store.counters([self.keys.node_heartbeat(node) for node in nodes])))

    def drop_silent_spares(self, now: float, timeout: float) -> None:
        for spare in list(self.spares):
            key = self.keys.spare_heartbeat(spare.agent_id)
            if self.keepalives.quiet_for(key, self.store.counter(key), now) > timeout:
                log.warning("spare %s lost: no keepalive for %gs", spare.host, timeout)
                self.spares.remove(spare)

    def arrivals(self) -> list[JoinRecord]:
        """Agents that joined since the last look, and are neither a node nor a spare of the job."""
        admitted = {s.agent_id for s in self.spares} | {n.agent_id for n in self.nodes.values()}
        found = self.store.read_from(self.keys.arrivals, self.keys.join, JoinRecord, self._arrivals_seen)
        self._arrivals_seen += len(found)
        return [join for join in found if join is not None and join.agent_id not in admitted]

    def add_spare(self, join: JoinRecord) -> None:
        self.spares.append(node_slot(join, -1, -1))
