"""The controller thread: rendezvous, then turn what the store shows into policy events and apply them."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from typing import Callable

from ftrun.controller.board import StatusBoard
from ftrun.controller.policy import (
    MILESTONE_OF,
    REPAIR_PHASES,
    JobView,
    Level,
    Milestone,
    Phase,
    on_library_ranks,
    on_milestone,
    on_node_joined,
    on_node_lost,
    on_operator,
    on_process_level_refused,
    on_repair_failed,
    on_report,
    on_stop,
    on_stopped,
    operator_refusal,
    start,
)
from ftrun.errors import ExitCode
from ftrun.events import EVENTS_FILE, EventLog
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, BELL_SEPARATOR, JOBS_COUNT, RENDEZVOUS_RING, JobKeys, board_interval, job_entry
from ftrun.messages import (
    Command,
    CommandKind,
    JoinRecord,
    NodeLayout,
    NodeSlot,
    OperatorAction,
    OperatorRequest,
    RendezvousResult,
    Report,
    ReportKind,
)
from ftrun.ports import PortRange
from ftrun.rendezvous import RendezvousPolicy, gather, node_slot
from ftrun.snapshots.format import size_text
from ftrun.snapshots.keeper import SnapshotOptions
from ftrun.snapshots.persist import step_folder
from ftrun.snapshots.plan import (
    DISK,
    MEMORY,
    PINNED,
    REPLICA,
    HeldSnapshot,
    RestoreSource,
    SnapshotInventory,
    choose_restore,
    merged_counts,
)
from ftrun.store import ControlStore, StoreUnavailable, bind_address, start_worker_store

log = logging.getLogger(__name__)
#: how often the controller reads the store: briskly while a repair or an exit is under way, and while
#: the job runs often enough that a failure report (sent the moment a worker dies) waits little: each
#: tick is one read of the report counter, whatever the job's size
BUSY_TICK = 0.01
IDLE_TICK = 0.02
#: how long the controller waits for every agent to acknowledge the exit
EXIT_GRACE = 10.0
#: with snapshots, how often (seconds) the controller reads what the nodes hold: for the status's restorable
#: step and for the checkpoint events (a plan over every node's copies is not for every keepalive of a big job)
SAVED_EVERY = 2.0
PROCESS_PHASES = (Phase.ENV_CLEAR, Phase.REPAIR, Phase.ROLLBACK)


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    max_restarts: int
    recovery: Level
    node_timeout: float
    stop_timeout: float
    #: a process-level repair that has not finished by then falls back to job level
    repair_timeout: float
    #: how long a repair's REPLACE commands are held back for more failure reports (see Controller._apply)
    gather_timeout: float = 0.03


class Keepalives:
    """When each keepalive counter last moved, by this process's clock (so hosts need no clock sync)."""

    def __init__(self):
        self._seen: dict[str, tuple[int, float]] = {}

    def quiet_for(self, key: str, count: int, now: float) -> float:
        """Seconds since ``key``'s counter last changed; 0 when it just did (or is new)."""
        seen, since = self._seen.get(key, (None, now))
        if count != seen:
            self._seen[key] = (count, now)
            return 0.0
        return now - since

    def forget(self, key: str) -> None:
        self._seen.pop(key, None)


class RepairClock:
    """When each phase of the repair under way began, for the phase breakdown.

    Wall-clock seconds. The first mark is the fault's detection, timed by the agent that saw it, so
    the "detect" figure includes any clock difference between that host and the controller's.
    """

    def __init__(self):
        self.marks: list[tuple[str, float]] = []

    def mark(self, phase: str, when: float) -> None:
        self.marks.append((phase, when))

    def breakdown(self, end: float) -> list[tuple[str, float]]:
        times = [t for _, t in self.marks[1:]] + [end]
        return [(name, later - t) for (name, t), later in zip(self.marks, times)]


class Controller:
    """Runs the job's decisions in a thread of the hosting agent."""

    def __init__(
        self,
        store: ControlStore,
        keys: JobKeys,
        rendezvous: RendezvousPolicy,
        host_agent_id: str,
        advertised_host: str,
        policy: RecoveryPolicy,
        events: EventLog | None = None,
        bind: str = "",
        snapshots: SnapshotOptions | None = None,
        worker_port: int = 0,
        ports: PortRange | None = None,
    ):
        self.store = store
        self.keys = keys
        self.rendezvous_policy = rendezvous
        self.host_agent_id = host_agent_id
        self.advertised_host = advertised_host
        #: where each generation's worker store listens ("": the address advertised_host names)
        self.bind = bind or bind_address(advertised_host)
        self.policy = policy
        self.snapshots = snapshots or SnapshotOptions()
        #: the newest step whose checkpoint is on disk for every rank
        self._checkpointed = -1
        #: the copies ranks found damaged while restoring (RestoreSource.identity; None for a forged report)
        self._damaged: list[tuple | None] = []
        #: the status's restorable and checkpoint steps, and when to look at the nodes' copies again
        self._saved: dict = {}
        self._next_saved = 0.0
        #: when the status board is due again, and the (phase, generation) it last showed
        self._next_board = 0.0
        self._board_shows: tuple | None = None
        self.view: JobView | None = None
        #: every fault, decision, phase and repair (the summary, the status view and events.jsonl)
        self.events = events or EventLog()
        self.board = StatusBoard(store, keys, self.events, keys.run_id)
        #: when the job entered its current phase (monotonic), for the view's "for 1.2s"
        self._phase_since = time.monotonic()
        self.rendezvous: RendezvousResult | None = None
        self.stop_requested = threading.Event()
        self._worker_store = None
        self._worker_store_address = ""
        #: the static rendezvous's port, where every generation's worker store listens (0: a fresh port
        #: each, from ``ports``); generation 0's is open already (ftrun.store._open_static)
        self.worker_port, self.ports = worker_port, ports
        self._first_worker_store = getattr(store, "worker_store", None)
        self._repair = RepairClock()
        #: REPLACE commands held back (see _apply), and when they go out
        self._held: list[Command] = []
        self._held_until = 0.0
        #: the agents' reports read so far (a sequence)
        self._next_report = 0
        #: a job-level restart waiting for its ranks to join (its generation), and whether the
        #: generation before it used ftrun.elastic (else there is nothing to wait for)
        self._restarting: int | None = None
        self._library_seen = False
        self._said_no_library = False
        self._announced = 0  # the newest generation announced to the ranks
        self._ranks_started = 0  # the generation of the last START: every rank has started in it or later
        #: news from the process hosting the controller, applied in the controller's thread
        self._news: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: node rank -> the node as it is now (a spare's agent after a takeover)
        self.nodes: dict[int, NodeSlot] = {}
        #: idle spare agents
        self.spares: list[NodeSlot] = []
        #: the nodes' and spares' keepalive counters, as this controller last saw them move
        self._keepalives = Keepalives()
        #: join records answered so far (the rendezvous's, then late arrivals)
        self._arrivals_seen = 0
        #: the world size of the last generation started (0 before the first)
        self._started_world = 0
        #: the layout last written (``_write_layout``)
        self._layout = NodeLayout()
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    @classmethod
    def for_config(cls, store: ControlStore, config, host_agent_id: str, advertised_host: str) -> "Controller":
        """The controller a launch configuration asks for (``config`` is a ``LaunchConfig``)."""
        path = os.path.join(config.log_dir, config.run_id, EVENTS_FILE) if config.log_dir else ""
        return cls(
            store=store,
            keys=JobKeys(config.run_id),
            rendezvous=RendezvousPolicy(config.min_nodes, config.max_nodes, config.last_call_timeout, config.rdzv_timeout,
                                        config.spares),
            host_agent_id=host_agent_id,
            advertised_host=advertised_host,
            policy=RecoveryPolicy(
                max_restarts=config.max_restarts,
                recovery=Level(config.recovery),
                node_timeout=config.node_timeout,
                stop_timeout=config.stop_timeout,
                repair_timeout=config.repair_timeout,
            ),
            events=EventLog(path),
            bind=bind_address(advertised_host, config.store_bind, config.several_nodes),
            snapshots=config.snapshots,
            worker_port=config.worker_port,
            ports=config.worker_port_range,
        )

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop_job(self, exit_code: int, reason: str) -> None:
        """End the job (Ctrl-C on a head node): every agent stops its workers and exits."""
        self.stop_requested.set()  # ends a rendezvous still under way
        self._news.put(lambda: self._apply(on_stop(self.view, exit_code, reason)))

    def host_gone(self, host: str, detail: str) -> None:
        """The agent on ``host`` is known to be gone (its ssh session ended): no need to wait for its
        keepalive. (In SSH mode every host runs one agent, named by its address.)"""
        self._news.put(lambda: self._host_gone(host, detail))

    def _host_gone(self, host: str, detail: str) -> None:
        self.spares = [s for s in self.spares if s.host != host]
        node = next((n.node_rank for n in self.nodes.values() if n.host == host), None)
        if node is not None and node in self.view.present:
            log.error(detail)
            self.lose_node(node, detail)

    def _run(self) -> None:
        try:
            self.rendezvous = gather(self.store, self.keys, self.rendezvous_policy, self.host_agent_id, self.stop_requested)
            if self.rendezvous.error:
                return
            self._take_places(self.rendezvous)
            self.view = JobView(
                node_count=len(self.rendezvous.nodes),
                max_restarts=self.policy.max_restarts,
                world_size=self.rendezvous.world_size,
                recovery=self.policy.recovery,
                min_nodes=self.rendezvous_policy.min_nodes,
            )
            self._job_started()
            self._apply(start(self.view))
            self._loop()
            self._refresh_status()
        except StoreUnavailable as e:
            log.error("controller lost its store: %s", e)
            if self.view is not None:
                self.view = dataclasses.replace(self.view, exit_code=ExitCode.JOB_FAILED,
                                                reason=f"the controller lost its store: {e}")
        except Exception:
            log.exception("controller failed")
            if self.view is not None:
                self.view = dataclasses.replace(self.view, exit_code=ExitCode.JOB_FAILED, reason="the controller failed")
        finally:
            self._worker_store = None
            if self.view is not None and self.view.phase not in (Phase.EXITING, Phase.DONE):
                self._job_finished(self.view)  # the controller itself failed: say so in the log
            self.events.close()

    def _job_started(self) -> None:
        """The first event, and this job's entry in the store's list (``ftrun status`` finds it there)."""
        result, view = self.rendezvous, self.view
        nodes = [{"node": n.node_rank, "host": n.host, "nproc": n.nproc} for n in result.nodes]
        spares = [{"host": s.host, "nproc": s.nproc} for s in result.spares]
        self.events.emit("job_started", 0, f"{len(nodes)} nodes, {result.world_size} ranks, {len(spares)} spares, "
                         f"{view.recovery.value}-level recovery, {view.max_restarts} restarts",
                         run_id=self.keys.run_id, world_size=result.world_size, nodes=nodes, spares=spares,
                         recovery=view.recovery.value, max_restarts=view.max_restarts)
        self.store.set_text(job_entry(self.store.add(JOBS_COUNT) - 1), self.keys.run_id)

    def _refresh_status(self, final: bool = False) -> None:
        if self.snapshots.every and (final or time.monotonic() >= self._next_saved):
            self._next_saved = time.monotonic() + SAVED_EVERY
            inventories = self._inventories()
            if self.snapshots.checkpoint_dir:
                self._note_checkpoints(inventories)
            self._saved = self._restorable(inventories)
        snapshot = self.board.refresh(self.view, self.nodes, self.spares, self._phase_since, self._saved)
        self.store.set_text(self.keys.status, json.dumps(snapshot, separators=(",", ":")))
        self.board.publish_for_top()

    def _restorable(self, inventories: list[SnapshotInventory]) -> dict:
        """The step a job-level restart would restore now, and the newest checkpoint on disk."""
        restore = choose_restore(self.view.generation, inventories, self.view.world_size, {}, frozenset(self._damaged))
        return {"restorable_step": restore.step if restore.step >= 0 else None,
                "checkpoint_step": self._checkpointed if self._checkpointed >= 0 else None}

    @property
    def status(self) -> dict:
        """The latest status snapshot ({} before the rendezvous is done)."""
        return self.board.snapshot

    def _loop(self) -> None:
        next_operator = 0
        next_beat = 0.0
        exit_deadline = None
        while self.view.phase is not Phase.DONE:
            now = time.monotonic()
            if now >= next_beat:
                self.store.add(self.keys.controller_heartbeat)
                next_beat = now + AGENT_HEARTBEAT_INTERVAL
                self._check_nodes(now)
                self._check_spares(now)
                self._admit_late_arrivals()
                self._grow()
                self._check_library()
                if now >= self._next_board or (self.view.phase, self.view.generation) != self._board_shows:
                    self._next_board = now + board_interval(self.view.world_size, AGENT_HEARTBEAT_INTERVAL)
                    self._board_shows = (self.view.phase, self.view.generation)
                    self._refresh_status()
                for request in self.store.read_from(self.keys.operator_count, self.keys.operator_request,
                                                    OperatorRequest, next_operator):
                    next_operator += 1  # ftrun top's requests: once a keepalive is soon enough
                    if request is not None:  # None: forged, ignored (and logged)
                        self._on_operator(request)
            self._take_reports()
            self._release_held()
            self._check_repair()
            if self._restarting is not None:
                self._check_restarted()
            while not self._news.empty():
                self._news.get()()
            if self.view.phase is Phase.EXITING:
                exit_deadline = exit_deadline or now + self.policy.stop_timeout + EXIT_GRACE
                if now > exit_deadline:
                    missing = sorted(self.view.present - self.view.acknowledged)
                    log.warning("nodes %s did not acknowledge the exit in time", missing)
                    break
            time.sleep(IDLE_TICK if self.view.phase is Phase.RUNNING else BUSY_TICK)

    def _check_nodes(self, now: float) -> None:
        nodes = sorted(self.view.present)
        keys = [self.keys.node_heartbeat(node) for node in nodes]
        for node, key, count in zip(nodes, keys, self.store.counters(keys)):  # one round trip for every node
            if self._keepalives.quiet_for(key, count, now) > self.policy.node_timeout:
                host = self.nodes[node].host
                detail = f"node {node} ({host}) lost: no keepalive from its agent for {self.policy.node_timeout:g}s"
                log.error(detail)
                self.lose_node(node, detail)
                self._keepalives.forget(key)  # a spare that took the node gets its own node_timeout

    def lose_node(self, node: int, detail: str) -> None:
        """A node's agent is gone: a spare takes its place when one is idle (and the policy agrees)."""
        slot = self.nodes[node]
        self.events.emit("node_lost", self.view.generation, detail, node=node, host=slot.host)
        spare = next((s for s in self.spares if s.nproc == slot.nproc), None)
        ranks = tuple(range(slot.first_rank, slot.first_rank + slot.nproc))
        self._apply(on_node_lost(self.view, node, detail, spare.agent_id if spare else "", ranks))

    def _on_report(self, report: Report) -> None:
        owner = self.nodes.get(report.node_rank)
        if report.agent_id and owner is not None and report.agent_id != owner.agent_id:
            log.warning("ignoring a %s report from %s: node %d now belongs to %s", report.kind.value,
                        report.agent_id, report.node_rank, owner.agent_id)
            return
        if report.kind is ReportKind.NODE_UNUSABLE and owner is not None and any(s.nproc == owner.nproc for s in self.spares):
            self.lose_node(report.node_rank, f"node {report.node_rank} ({owner.host}): {report.detail}")
            return
        self._apply(on_report(self.view, report))

    def _on_operator(self, request: OperatorRequest) -> None:
        """A person's request from ``ftrun top``: logged with who asked and the answer, then applied."""
        slot = next((n for n in self.nodes.values() if n.first_rank <= request.rank < n.first_rank + n.nproc), None)
        if request.action is OperatorAction.DRAIN:
            slot = self.nodes.get(request.node_rank)
        spare = next((s for s in self.spares if slot is not None and s.nproc == slot.nproc), None)
        refusal = operator_refusal(self.view, request, self.store.signer.enabled, spare.agent_id if spare else "")
        if slot is None and not refusal and request.action is not OperatorAction.STOP:
            refusal = "no node holds it"
        what = {OperatorAction.RESTART: f"a restart drill of rank {request.rank}",
                OperatorAction.DRAIN: f"to drain node {request.node_rank}",
                OperatorAction.STOP: "to stop the job"}[request.action]
        detail = f"{request.who} asked for {what}" + (f"; refused: {refusal}" if refusal else "")
        (log.warning if refusal else log.info)("ftrun top: %s", detail)
        node = slot.node_rank if slot is not None else None
        self.events.emit("operator", self.view.generation, detail, node=node, rank=request.rank if request.rank >= 0 else None,
                         host=slot.host if slot is not None else None, action=request.action.value, who=request.who,
                         accepted=not refusal)
        if refusal:
            return
        if request.action is OperatorAction.STOP:
            self._apply(on_operator(self.view, request))
        elif request.action is OperatorAction.DRAIN:
            self.events.emit("node_lost", self.view.generation, f"node {node} drained by {request.who}", node=node,
                             host=slot.host)
            ranks = tuple(range(slot.first_rank, slot.first_rank + slot.nproc))
            self._apply(on_operator(self.view, request, spare=spare.agent_id, ranks=ranks))
        else:
            pid = next((r.get("pid", 0) for r in self.board.snapshot.get("ranks", ()) if r["rank"] == request.rank), 0)
            self._apply(on_operator(self.view, request, slot.node_rank, request.rank - slot.first_rank, slot.host, pid,
                                    at=time.time()))

    def _take_places(self, result: RendezvousResult) -> None:
        self.nodes = {slot.node_rank: slot for slot in result.nodes}
        self.spares = list(result.spares)
        self._arrivals_seen = len(self.nodes) + len(self.spares)
        self._write_layout(result.nodes)
        if self.spares:
            log.info("%d spare node%s standing by: %s", len(self.spares), "s" if len(self.spares) != 1 else "",
                     ", ".join(s.host for s in self.spares))

    def _room_to_grow(self) -> bool:
        """Fewer nodes than --nnodes MAX: after a scale-in, or when some were late for the rendezvous."""
        return bool(self.view.vacant) or self.view.node_count < self.rendezvous_policy.max_nodes

    def _grow(self) -> None:
        """An idle spare and room for a node: it joins the job as a node of its own."""
        if not self.spares or not self._room_to_grow() or self.view.phase is not Phase.RUNNING:
            return
        spare = self.spares[0]
        node_rank = min(self.view.vacant) if self.view.vacant else self.view.node_count
        self._apply(on_node_joined(self.view, node_rank, spare.agent_id, spare.nproc, spare.host))

    def _hand_over(self, command: Command) -> None:
        """A TAKEOVER is published: the spare holds the node from now on."""
        spare = next(s for s in self.spares if s.agent_id == command.agent_id)
        self.spares.remove(spare)
        lost = self.nodes.get(command.node_rank)
        self.nodes[command.node_rank] = dataclasses.replace(spare, node_rank=command.node_rank,
                                                            first_rank=lost.first_rank if lost else -1)
        self._publish_layout()
        if lost is None:
            line = f"{spare.host} joins the job as node {command.node_rank}"
        else:
            line = f"spare {spare.host} takes the place of node {command.node_rank} ({lost.host})"
        log.warning(line)
        self.events.emit("takeover", command.generation, line, node=command.node_rank, host=spare.host)

    def _publish_layout(self) -> int:
        """The nodes that hold a place in the job now, global ranks numbered over them in node order;
        their world size."""
        first_rank, nodes = 0, []
        for rank in sorted(self.view.present & set(self.nodes)):
            if self.nodes[rank].first_rank != first_rank:
                self.nodes[rank] = dataclasses.replace(self.nodes[rank], first_rank=first_rank)
            nodes.append(self.nodes[rank])
            first_rank += self.nodes[rank].nproc
        self._write_layout(tuple(nodes))
        return first_rank

    def _write_layout(self, nodes: tuple[NodeSlot, ...]) -> None:
        """The layout, when it changed: the whole, its change from the version before, then the new
        version, in one ``multi_set`` (an agent that reads the version finds both written)."""
        held = self._layout
        if nodes == held.nodes:
            return  # a restart of the same nodes: the agents' layouts stand
        layout = NodeLayout(nodes, held.version + 1)
        keys, store = self.keys, self.store
        change = keys.layout_change(layout.version)
        store.set_each([keys.layout, change, keys.layout_version],
                       [store.sealed(keys.layout, layout), store.sealed(change, layout.change_from(held)),
                        str(layout.version)])
        self._layout = layout

    def _check_spares(self, now: float) -> None:
        for spare in list(self.spares):
            key = self.keys.spare_heartbeat(spare.agent_id)
            if self._keepalives.quiet_for(key, self.store.counter(key), now) > self.policy.node_timeout:
                log.warning("spare %s lost: no keepalive for %gs", spare.host, self.policy.node_timeout)
                self.spares.remove(spare)

    def _admit_late_arrivals(self) -> None:
        """Agents that joined after the rendezvous: spares while the job wants more, else refused."""
        admitted = {s.agent_id for s in self.spares} | {n.agent_id for n in self.nodes.values()}
        for join in self.store.read_from(self.keys.arrivals, self.keys.join, JoinRecord, self._arrivals_seen):
            self._arrivals_seen += 1
            if join is None or join.agent_id in admitted:
                continue
            if len(self.spares) < self.rendezvous_policy.spares or self._room_to_grow():
                self.spares.append(node_slot(join, -1, -1))
                self.store.set_text(self.keys.admission(join.agent_id), "spare", signed=True)
                self.store.set_text(self.keys.doorbell(join.agent_id, RENDEZVOUS_RING), "")  # its Watch goes on
                log.info("%s joined as a spare node", join.host)
            else:
                self.store.set_text(self.keys.admission(join.agent_id), signed=True, text=(
                    f"the job already has its {len(self.nodes)} nodes and "
                    f"{self.rendezvous_policy.spares} spare{'s' if self.rendezvous_policy.spares != 1 else ''}"))

    def _check_library(self) -> None:
        """Whether every rank runs ftrun.elastic, and whether its layout allows process-level repair."""
        view = self.view
        if view.recovery is not Level.PROCESS or view.phase is not Phase.RUNNING or view.refusal:
            return
        if not view.process_level_ready:
            self._apply(on_library_ranks(view, self.store.counter(self.keys.milestone(view.generation, "joined"))))
        else:
            refusal = self.store.try_text(self.keys.process_level_refused)
            if refusal:
                self._apply(on_process_level_refused(view, refusal))

    def _take_reports(self) -> None:
        """The agents' new reports, then their acknowledgements of a job-level STOP. The acknowledgements
        are looked for first: an agent reports the ranks that failed as it stopped them before it
        acknowledges, so each of those reports is in the store by then, and counts before the restart."""
        stopped = self._stop_acknowledgements()
        for report in self.store.read_from(self.keys.report_count, self.keys.report, Report, self._next_report):
            self._next_report += 1
            if report is not None:  # None: forged, ignored (and logged)
                self._on_report(report)
        if stopped and self.view.generation == stopped[0]:
            self._apply(on_stopped(self.view, stopped[1]))

    def _stop_acknowledgements(self) -> tuple[int, frozenset[int]] | None:
        """During a job-level STOP, once every node waited for has acknowledged it (one ``check`` of their
        agents' keys per tick): the generation and the nodes whose acknowledgement holds."""
        view = self.view
        if view.phase is not Phase.STOPPING or view.level is not Level.JOB:
            return None
        waiting = [(node, self.nodes[node].agent_id) for node in sorted(view.present - view.acknowledged)
                   if node in self.nodes]
        if not waiting:
            return None
        acks = self.store.all_set(Report, [self.keys.stopped(view.generation, agent) for _, agent in waiting])
        if acks is None:
            return None
        # a forged one (None) does not count: its node is waited for still
        return view.generation, frozenset(node for (node, agent), ack in zip(waiting, acks)
                                          if ack is not None and ack.agent_id == agent)

    def _check_repair(self) -> None:
        """During a process-level repair: count the ranks' milestones, watch the deadline."""
        view = self.view
        if view.level is not Level.PROCESS or view.phase not in REPAIR_PHASES:
            return
        problem = self.store.try_text(self.keys.rollback_failure(view.generation))
        if problem:
            self._apply(on_repair_failed(view, problem))
            return
        # counted from the controller's own decision ("stop"), never from another host's clock
        if time.time() - self._repair.marks[1][1] > self.policy.repair_timeout:
            phase = view.phase.value
            self._apply(on_repair_failed(
                view, f"the repair did not finish within {self.policy.repair_timeout:g}s (stuck in {phase})"))
            return
        if view.phase in MILESTONE_OF:
            milestone, _ = MILESTONE_OF[view.phase]
            expected = view.world_size - len(view.replacing) if milestone is Milestone.STOPPED else view.world_size
            if self.store.counter(self.keys.milestone(view.generation, milestone.value)) >= expected:
                self._apply(on_milestone(view, milestone))

    def _apply(self, decision) -> None:
        before = self.view
        self.view, commands = decision
        for failure in self.view.failures[len(before.failures) if before else 0:]:
            self.events.fault(failure)
        for line in self.view.resized[len(before.resized) if before else 0:]:
            log.warning(line)
            self.events.emit("resized", self.view.generation, line, world_size=self.view.world_size)
        self._note_phase(before, self.view)
        ready = []
        for command in commands:
            if command.kind is CommandKind.START:
                level = "start" if command.generation == 0 else "grow" if before.free_restart else "job"
                self.events.emit("generation_started", command.generation,
                                 f"generation {command.generation} starts with {self.view.world_size} ranks",
                                 level=level, world_size=self.view.world_size)
                # a scale-in or a grow-back renumbers the global ranks
                previous, self._started_world = self._started_world, self._publish_layout()
                command = dataclasses.replace(command, previous_world_size=previous)
                self._ranks_started = command.generation
                if command.generation > 0 and self.snapshots.enabled:
                    self._plan_restore(command.generation)
                command = self._with_new_worker_store(command)
            elif command.kind is CommandKind.REPLACE:
                # the generation before a repair's ran in the same world: a replacement sees no resize
                command = dataclasses.replace(command, worker_store=self._worker_store_address,
                                              previous_world_size=self._started_world)
                self._announce(command.generation)  # the healthy ranks leave their groups now
                if self.policy.gather_timeout > 0:
                    # The replacements start a moment later (the healthy ranks take longer to stop). If the
                    # reports that come meanwhile name every rank (a whole job's crash, whose deaths come a
                    # few milliseconds apart), the policy gives the repair up for a job-level restart, and
                    # no replacement has taken a warm standby that the restart's ranks need.
                    if not self._held:
                        self._held_until = time.monotonic() + self.policy.gather_timeout
                    self._held.append(command)
                    continue
            elif command.kind is CommandKind.TAKEOVER:
                self._hand_over(command)
            if command.kind in (CommandKind.STOP, CommandKind.EXIT) and self._held:
                log.info("%d held replacement command(s) dropped: %s", len(self._held), command.reason)
                self._held = []
            ready.append(command)
        self._publish(ready)

    def _publish(self, commands: list[Command]) -> None:
        """A decision's commands for every agent (broadcast keys, in order), and every agent's doorbell
        rung once for them all with their texts, which the agent's watch holds as it wakes: no agent
        reads a command again, and a takeover's two commands cost the agents one wake, not two. Each
        says the layout's version (written before), so that an agent that holds it reads nothing more."""
        if not commands:
            return
        log.debug("publishing %s", commands)
        commands = [dataclasses.replace(command, layout=self._layout.version) for command in commands]
        first = self.store.add(self.keys.command_count, len(commands)) - len(commands)  # reserved, as append does
        agents = [slot.agent_id for slot in self.nodes.values()] + [slot.agent_id for slot in self.spares]
        keys = [self.keys.command(first + offset) for offset in range(len(commands))]
        texts = [self.store.sealed(key, command) for key, command in zip(keys, commands)]
        bell = BELL_SEPARATOR.join(texts)
        # each sealed once; the commands' own keys first, then the bells: one round trip, in this order
        self.store.set_each(keys + [self.keys.doorbell(agent, first) for agent in agents],
                            texts + [bell] * len(agents))

    def _release_held(self) -> None:
        """The held REPLACE commands go out once their moment has passed."""
        if self._held and time.monotonic() >= self._held_until:
            held, self._held = self._held, []
            self._publish(held)

    def _inventories(self) -> list[SnapshotInventory]:
        """What the nodes in the job hold now (a lost node's agent, and its memory, are gone)."""
        found = []
        for node in sorted(self.view.present & set(self.nodes)):
            inventory = self.store.try_get(SnapshotInventory, self.keys.snapshot_inventory(self.nodes[node].agent_id))
            if inventory is not None:
                found.append(inventory)
        return found

    def _plan_restore(self, generation: int) -> None:
        """Before a job-level restart: the newest step every rank's state is held at, and where each rank
        reads it (the agents published what they hold when they stopped their ranks)."""
        homes = {rank: n.node_rank for n in self.nodes.values() if n.node_rank in self.view.present
                 for rank in range(n.first_rank, n.first_rank + n.nproc)}
        reports = self.store.read_from(self.keys.damaged_count, self.keys.damaged, RestoreSource, len(self._damaged))
        for source in reports:
            self._damaged.append(source.identity if source is not None else None)  # None: forged, ignored
        restore = choose_restore(generation, self._inventories(), self.view.world_size, homes,
                                 frozenset(self._damaged))
        keys, texts, counts, sources = [], [], [], {}
        for node, plan in restore.plans():  # node by node: see Restore
            keys.append(self.keys.restore_plan(generation, node))
            texts.append(self.store.sealed(keys[-1], plan))
            counts.append(plan.counts())
            sources.update({s.rank: {"where": s.where, "node": s.node_rank, "path": s.path} for s in plan.sources})
        self.store.set_each(keys, texts)
        if restore.step < 0:
            line = f"generation {generation} starts without a snapshot to restore: {restore.reason}"
        else:
            total = merged_counts(counts)
            places = ", ".join(f"{total[w]} from {w}" for w in (MEMORY, PINNED, REPLICA, DISK) if w in total)
            line = f"generation {generation} restores step {restore.step} ({places})"
        log.warning(line)
        self.events.emit("restore", generation, line, step=restore.step, sources=sources)

    def _note_checkpoints(self, inventories: list[SnapshotInventory]) -> None:
        """An event for each checkpoint step whose every rank's file the agents have written."""
        world = self.view.world_size
        files: dict[int, dict[int, HeldSnapshot]] = {}
        for inventory in inventories:
            for held in inventory.held:
                if held.where == DISK:
                    files.setdefault(held.step, {})[held.rank] = held
        for step in sorted(files):
            if step > self._checkpointed and set(files[step]) >= set(range(world)):
                self._checkpointed = step
                nbytes = sum(files[step][rank].nbytes for rank in range(world))
                self.events.emit("checkpoint", self.view.generation,
                                 f"checkpoint of step {step} on disk: {world} ranks, {size_text(nbytes)}", step=step,
                                 path=step_folder(self.snapshots.checkpoint_dir, step))

    def _announce(self, generation: int) -> None:
        """Tell the ranks which generation to form; ranks still forming an older one give it up."""
        if generation == self._announced:
            return  # more ranks for the same repair
        self.store.set_text(self.keys.target_generation, str(generation))  # first: what they move to
        self.store.set_texts([self.keys.group_ready(older) for older in range(self._announced, generation)],
                             "superseded")
        # a rank's repair watch waits on the generation after its own: none on those the last START passed
        newer = range(max(self._announced, self._ranks_started) + 1, generation + 1)
        self.store.set_texts([self.keys.announced(g, rank) for g in newer for rank in range(self.view.world_size)],
                             str(generation))  # wakes the repair watches
        self._announced = generation

    def _note_phase(self, before: JobView | None, after: JobView) -> None:
        """Log and record where the job moved: a decision, the repair's phases, its end."""
        if before is None or (before.phase, before.generation, before.level) == (after.phase, after.generation,
                                                                                 after.level):
            return  # nothing moved (a process-level repair that goes to job level may stay STOPPING)
        now = time.time()
        self._phase_since = time.monotonic()
        if before.phase is not after.phase:
            self.events.emit("phase", after.generation, f"{before.phase.value} -> {after.phase.value}",
                             phase=after.phase.value, level=after.level.value)
        if after.phase is Phase.EXITING:
            self._job_finished(after)
        elif before.phase is Phase.RUNNING and after.phase is Phase.STOPPING:
            self._decided(before, after, now)
        elif before.level is Level.PROCESS and after.level is Level.JOB and after.no_replica:
            self._decision(after)  # the process-level repair under way is given up: every rank failed
        elif before.level is Level.PROCESS and after.level is Level.JOB and after.phase is Phase.STOPPING:
            self.events.emit("repair_failed", after.generation, f"{after.reason}; falling back to job level",
                             level=Level.JOB.value)
        elif after.phase in PROCESS_PHASES:
            # a decision may pass through several phases at once (reaped before everyone stopped)
            start = PROCESS_PHASES.index(before.phase) + 1 if before.phase in PROCESS_PHASES else 0
            for phase in PROCESS_PHASES[start:PROCESS_PHASES.index(after.phase) + 1]:
                self._repair.mark(phase.value.replace("_", " "), now)
        elif before.phase is not Phase.RUNNING and after.phase is Phase.RUNNING and self._repair.marks:
            if before.level is Level.JOB and not before.free_restart and self._library_seen:
                # the new workers are starting: the repair ends when they all joined their group
                self._repair.mark("restart", now)
                self._restarting = after.generation
            else:
                self._repaired(before.level, before.free_restart, after, now)

    def _check_restarted(self) -> None:
        """After a job-level restart: once every new rank joined its process group, training is back."""
        view = self.view
        if view.generation != self._restarting or view.phase is not Phase.RUNNING:
            self._restarting = None
            return
        if self.store.counter(self.keys.milestone(view.generation, "joined")) >= view.world_size:
            self._restarting = None
            self._repaired(Level.JOB, False, view, time.time())

    def _decided(self, before: JobView, after: JobView, now: float) -> None:
        """A fault (or a node joining) stopped the job: the repair's clock starts."""
        self._repair = RepairClock()
        new_failures = after.failures[len(before.failures):]
        self._repair.mark("detect", min((f.timestamp for f in new_failures), default=now))
        self._repair.mark("stop", now)
        self._library_seen = self.store.counter(self.keys.milestone(before.generation, "joined")) > 0
        if (after.level is Level.JOB and after.recovery is Level.PROCESS and not after.no_replica
                and not self._said_no_library):
            self._said_no_library = True
            if after.refusal:
                log.warning("process-level recovery is off: %s: using job-level recovery", after.refusal)
            else:
                log.warning("not every rank runs ftrun.elastic (%d of %d said hello): using job-level recovery",
                            after.library_ranks, after.world_size)
        self._decision(after)

    def _decision(self, after: JobView) -> None:
        """Log and record the level the job's recovery takes (the first decision, or the move to job
        level once every rank has failed)."""
        target = after.generation if after.level is Level.PROCESS else after.generation + 1
        if after.free_restart:
            line = f"job-level restart into generation {target} to grow the job"
        else:
            line = f"{after.level.value}-level repair into generation {target}: {after.reason}"
        log.warning(line)
        self.events.emit("decision", after.generation, line, level="grow" if after.free_restart else after.level.value,
                         budget_left=after.budget_left, target_generation=target)

    def _repaired(self, level: Level, free_restart: bool, after: JobView, now: float) -> None:
        """Training runs again: the repair's phase breakdown, logged and recorded."""
        phases = self._repair.breakdown(now)
        total = sum(seconds for _, seconds in phases)
        detail = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in phases)
        if level is Level.PROCESS:
            line = f"generation {after.generation} resumed training {total:.2f}s after the fault ({detail})"
        elif free_restart:
            line = f"generation {after.generation} starting with {len(after.present)} nodes"
        elif phases[-1][0] == "restart":
            line = f"generation {after.generation} back in training {total:.2f}s after the fault ({detail})"
        else:  # a script without ftrun.elastic: no sign of its training, only that it started
            line = f"generation {after.generation} starting, {total:.2f}s after the fault ({detail})"
        log.warning(line)
        self._repair = RepairClock()
        if not free_restart:
            self.events.emit("repair_done", after.generation, line, level=level.value,
                             durations={name: round(seconds, 6) for name, seconds in phases}, total=round(total, 6))

    def _job_finished(self, view: JobView) -> None:
        try:
            self._refresh_status(final=True)  # the final step, and the last checkpoints
            self.store.set_text(self.keys.status_final, "1")  # wakes the watchers before the store goes
        except StoreUnavailable:
            pass
        snapshot = self.board.snapshot
        outcome = "succeeded" if view.exit_code == ExitCode.OK else f"failed (exit code {view.exit_code})"
        self.events.emit("job_finished", view.generation, f"job {outcome}: {view.reason}", exit_code=view.exit_code,
                         reason=view.reason, duration=round(time.monotonic() - self.board.started, 3),
                         step=snapshot.get("step"), restarts_used=view.restarts_used, max_restarts=view.max_restarts)

    def _with_new_worker_store(self, command: Command) -> Command:
        # Each generation gets a fresh store for the workers' env:// rendezvous; the
        # previous generation's workers are all stopped by now, so its store goes (and,
        # under the static rendezvous, its port comes free for the next one's).
        self._worker_store = None
        if self._first_worker_store is not None:
            self._worker_store, port = self._first_worker_store, self.worker_port
            self._first_worker_store = self.store.worker_store = None
        else:
            self._worker_store, port = start_worker_store(self.advertised_host, self.bind, self.ports,
                                                          self.worker_port, self.store.endpoint.port)
        self._worker_store_address = f"{self.advertised_host}:{port}"
        return dataclasses.replace(command, worker_store=self._worker_store_address)
