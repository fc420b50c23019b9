"""What the controller writes to the control store: its heartbeat, the job's entry in the list of jobs,
the node layout and its versions, commands (with every agent's doorbell), the repair announcements
to the ranks, restore plans, admissions, the status and what ``ftrun top`` reads beside it.

Every write of the controller's goes through its one ``Publisher``, which keeps what it last wrote
(the layout and its version, the newest generation announced) so that it writes each thing once, and
in the order the readers rely on. One object, so that a controller that must hold a lease to write
has one place to check it.
The cost of each write, for N nodes of P ranks, is in ``ftrun/keys.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Callable

from ftrun.keys import BELL_SEPARATOR, JOBS_COUNT, RENDEZVOUS_RING, JobKeys, job_entry
from ftrun.messages import Command, NodeLayout, NodeSlot
from ftrun.snapshots.plan import Restore
from ftrun.store import ControlStore

log = logging.getLogger(__name__)


class Publisher:
    """Writes what the controller decided, for the agents and the ranks to read.

    ``audience()`` names the agents that hear each decision: every node's and every idle spare's.
    ``clock`` (monotonic seconds) times the held commands; the tests give theirs.
    """

    def __init__(self, store: ControlStore, keys: JobKeys, audience: Callable[[], list[str]],
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.keys = keys
        self._audience = audience
        self.clock = clock
        #: the layout last written (``layout``); every command says its version
        self.layout = NodeLayout()
        #: the newest generation announced to the ranks, and that of the last START (every rank has
        #: started in it or later: none waits on an announcement of an older one)
        self._announced = 0
        self.ranks_started = 0
        #: REPLACE commands held back (``hold``), and when they go out
        self._held: list[Command] = []
        self._held_until = 0.0

    def heartbeat(self) -> None:
        """The controller is alive: the agents watch this counter move."""
        self.store.add(self.keys.controller_heartbeat)

    def etcd_unreachable(self, why: str) -> None:
        """--rdzv-backend etcd: tell the agents that etcd does not answer (``why``), or answers again ("")."""
        self.store.set_text(self.keys.etcd_unreachable, why)

    def list_job(self) -> None:
        """This job's entry in the store's list (``ftrun status`` finds it there)."""
        self.store.set_text(job_entry(self.store.add(JOBS_COUNT) - 1), self.keys.run_id)

    def status(self, snapshot: dict) -> None:
        self.store.set_text(self.keys.status, json.dumps(snapshot, separators=(",", ":")))

    def for_top(self, events: list[dict], history: dict | None) -> None:
        """What ``ftrun top`` reads beyond the status: the events logged since the last time, as one
        batch (nothing when there are none), and each rank's short history (when there is a new one)."""
        if events:
            self.store.set_text(self.keys.event_batch(self.store.counter(self.keys.event_count)),
                                json.dumps(events, separators=(",", ":")))
            self.store.add(self.keys.event_count)
        if history is not None:
            self.store.set_text(self.keys.rank_history, json.dumps(history, separators=(",", ":")))

    def status_final(self) -> None:
        """The status will not change again: wakes its watchers before the store goes."""
        self.store.set_text(self.keys.status_final, "1")

    # -- the nodes ----------------------------------------------------------------------------------

    def write_layout(self, nodes: tuple[NodeSlot, ...]) -> None:
        """The layout, when it changed: the whole, its change from the version before, then the new
        version, in one ``multi_set`` (an agent that reads the version finds both written)."""
        held = self.layout
        if nodes == held.nodes:
            return  # a restart of the same nodes: the agents' layouts stand
        layout = NodeLayout(nodes, held.version + 1)
        keys, store = self.keys, self.store
        change = keys.layout_change(layout.version)
        store.set_each([keys.layout, change, keys.layout_version],
                       [store.sealed(keys.layout, layout), store.sealed(change, layout.change_from(held)),
                        str(layout.version)])
        self.layout = layout

    def admit_spare(self, agent_id: str) -> None:
        """An agent that came after the rendezvous stands by as a spare; its Watch goes on."""
        self.store.set_text(self.keys.admission(agent_id), "spare", signed=True)
        self.store.set_text(self.keys.doorbell(agent_id, RENDEZVOUS_RING), "")

    def refuse(self, agent_id: str, why: str) -> None:
        """An agent that came after the rendezvous has no place: ``why``."""
        self.store.set_text(self.keys.admission(agent_id), signed=True, text=why)

    # -- commands -----------------------------------------------------------------------------------

    def commands(self, commands: list[Command]) -> None:
        """A decision's commands for every agent (broadcast keys, in order), and every agent's doorbell
        rung once for them all with their texts, which the agent's watch holds as it wakes: no agent
        reads a command again, and a takeover's two commands cost the agents one wake, not two. Each
        says the layout's version (written before), so that an agent that holds it reads nothing more."""
        if not commands:
            return
        log.debug("publishing %s", commands)
        commands = [dataclasses.replace(command, layout=self.layout.version) for command in commands]
        first = self.store.add(self.keys.command_count, len(commands)) - len(commands)  # reserved, as append does
        agents = self._audience()
        keys = [self.keys.command(first + offset) for offset in range(len(commands))]
        texts = [self.store.sealed(key, command) for key, command in zip(keys, commands)]
        bell = BELL_SEPARATOR.join(texts)
        # each sealed once; the commands' own keys first, then the bells: one round trip, in this order
        self.store.set_each(keys + [self.keys.doorbell(agent, first) for agent in agents],
                            texts + [bell] * len(agents))

    def hold(self, command: Command, seconds: float) -> None:
        """Publish ``command`` (a repair's REPLACE) ``seconds`` from the first one held, with those held
        meanwhile (``release_held``), unless a STOP or an EXIT drops them first (``drop_held``)."""
        if not self._held:
            self._held_until = self.clock() + seconds
        self._held.append(command)

    def release_held(self) -> bool:
        """The held REPLACE commands go out once their moment has passed (True when they did)."""
        if self._held and self.clock() >= self._held_until:
            held, self._held = self._held, []
            self.commands(held)
            return True
        return False

    def drop_held(self, reason: str) -> None:
        if self._held:
            log.info("%d held replacement command(s) dropped: %s", len(self._held), reason)
            self._held = []

    # -- the ranks ----------------------------------------------------------------------------------

    def announce(self, generation: int, world_size: int, online: bool = False, replaced: tuple[int, ...] = ()) -> None:
        """Tell the ranks which generation to form; ranks still forming an older one give it up. ``online``:
        the repair replaces no process (said before the target, for the MindSpore ranks' relays); ``replaced``:
        the ranks it starts again (said before the target: their old processes leave rather than join)."""
        if generation == self._announced:
            return  # more ranks for the same repair
        if online:
            self.store.set_text(self.keys.online_repair(generation), "1")
        if replaced:
            self.store.set_text(self.keys.replaced(generation), ",".join(map(str, replaced)))
        self.store.set_text(self.keys.target_generation, str(generation))  # first: what they move to
        self.store.set_texts([self.keys.group_ready(older) for older in range(self._announced, generation)],
                             "superseded")
        # a rank's repair watch waits on the generation after its own: none on those the last START passed
        newer = range(max(self._announced, self.ranks_started) + 1, generation + 1)
        self.store.set_texts([self.keys.announced(g, rank) for g in newer for rank in range(world_size)],
                             str(generation))  # wakes the repair watches
        self._announced = generation

    def restore_plans(self, generation: int, restore: Restore) -> tuple[list[dict[str, int]], dict]:
        """Each node's part of a job-level restart's restore, in one ``multi_set`` (each rank reads its
        own node's: see ``Restore``); what each node reads from where, and each rank's source."""
        keys, texts, counts, sources = [], [], [], {}
        for node, plan in restore.plans():
            keys.append(self.keys.restore_plan(generation, node))
            texts.append(self.store.sealed(keys[-1], plan))
            counts.append(plan.counts())
            sources.update({s.rank: {"where": s.where, "node": s.node_rank, "path": s.path} for s in plan.sources})
        self.store.set_each(keys, texts)
        return counts, sources
