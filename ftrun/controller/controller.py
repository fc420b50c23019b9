"""The controller thread: rendezvous, then turn what the store shows into policy events and apply them.

The loop reads (reports, keepalives, milestones, operator requests), asks the policy
(``policy.py``: pure transitions), and applies each decision: its narrator tells it
(``narrator.py``), its publisher writes its commands (``publisher.py``). Beside them: who holds each
node and which spares stand by (``roster.py``), each generation's worker store (``worker_store.py``),
and what the nodes' snapshots hold (``restore_points.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from typing import Callable

from ftrun.contract import STORE_TIMEOUT, CollectiveFailure, Milestone, RollbackFailure
from ftrun.controller.board import StatusBoard
from ftrun.controller.journal import Journal, JournalWriter
from ftrun.controller.leadership import Leadership, LeadershipLost
from ftrun.controller.narrator import Narrator
from ftrun.controller.policy import (
    MILESTONE_OF,
    REPAIR_PHASES,
    JobView,
    Level,
    Phase,
    on_collective_failed,
    on_controller_moved,
    on_library_ranks,
    on_milestone,
    on_node_joined,
    on_node_lost,
    on_operator,
    on_process_level_refused,
    on_repair_failed,
    on_replacements_started,
    on_report,
    on_stop,
    on_stopped,
    operator_refusal,
    start,
)
from ftrun.controller.publisher import Publisher
from ftrun.controller.restore_points import RestorePoints
from ftrun.controller.roster import Roster
from ftrun.controller.worker_store import WorkerStores
from ftrun.errors import ExitCode
from ftrun.etcd import EtcdUnavailable
from ftrun.events import EVENTS_FILE, EventLog
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, JobKeys, board_interval
from ftrun.messages import Command, CommandKind, OperatorAction, OperatorRequest, RendezvousResult, Report, ReportKind
from ftrun.ports import PortRange
from ftrun.rendezvous import RendezvousPolicy, gather
from ftrun.snapshots.keeper import SnapshotOptions
from ftrun.store import ControlStore, StoreUnavailable, bind_address

log = logging.getLogger(__name__)
#: how often the controller reads the store: briskly while a repair or an exit is under way, and while
#: the job runs often enough that a failure report (sent the moment a worker dies) waits little: each
#: tick is one read of the report counter, whatever the job's size
BUSY_TICK = 0.01
IDLE_TICK = 0.02
#: how long a rank's failed collective is held before it counts as a fault of its own (the online level):
#: a peer that died breaks the same collectives, and its agent, which sees the death at once (pidfds),
#: reports it within this; the death then decides, and the failed collective was its echo. It is held
#: too until every node's agent has sent a keepalive since (at most AGENT_HEARTBEAT_INTERVAL): a node
#: whose agent died with its ranks reports nothing, and its loss, told by --node-timeout, decides
ONLINE_GRACE = 0.25
#: how long the controller waits for every agent to acknowledge the exit
EXIT_GRACE = 10.0
#: between two tries of a journal write while etcd has no quorum
JOURNAL_RETRY = 0.5


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    max_restarts: int
    recovery: Level
    node_timeout: float
    stop_timeout: float
    #: a process-level repair that has not finished by then falls back to job level
    repair_timeout: float
    #: how long a repair's REPLACE commands are held back for more failure reports (see Controller._ready_replace)
    gather_timeout: float = 0.03
    #: --rdzv-backend etcd: how long the job goes on while etcd does not answer, before it stops
    store_timeout: float = STORE_TIMEOUT


class Controller:
    """Runs the job's decisions in a thread of the hosting agent."""

    def __init__(
        self,
        store: ControlStore,
        keys: JobKeys,
        rendezvous_policy: RendezvousPolicy,
        host_agent_id: str,
        advertised_host: str,
        policy: RecoveryPolicy,
        events: EventLog | None = None,
        bind: str = "",
        snapshots: SnapshotOptions | None = None,
        worker_port: int = 0,
        ports: PortRange | None = None,
        leadership: Leadership | None = None,
        resume: Journal | None = None,
        schedulers: bool = False,
    ):
        self.store = store
        self.keys = keys
        self.rendezvous_policy = rendezvous_policy
        self.host_agent_id = host_agent_id
        self.policy = policy
        self.snapshots = snapshots or SnapshotOptions()
        #: the policy's view of the job: what every decision starts from (None before the rendezvous)
        self.view: JobView | None = None
        #: who is which node, as the rendezvous decided (None while it is under way)
        self.rendezvous_result: RendezvousResult | None = None
        self.stop_requested = threading.Event()
        #: who holds each node, and which spares stand by
        self.roster = Roster(store, keys)
        events = events or EventLog()
        self.narrator = Narrator(events, self._joined)
        self.publisher = Publisher(store, keys, self.roster.agents)
        self.board = StatusBoard(store, keys, events, keys.run_id)
        self.restore_points = RestorePoints(store, keys, self.snapshots, self.narrator)
        #: each generation's worker store, listening where ``bind`` says ("": the address advertised_host names)
        self.worker_stores = WorkerStores(store, advertised_host, bind or bind_address(advertised_host),
                                          worker_port, ports)
        #: --framework mindspore: each generation's START names a fresh port for its scheduler
        self.schedulers = schedulers
        #: the running generation's scheduler: a process-level repair keeps it, and its replacements rejoin it
        self._scheduler = ""
        #: when the status board is due again, and the (phase, generation) it last showed
        self._next_board = 0.0
        self._board_shows: tuple | None = None
        #: when the job entered its current phase (monotonic), for the status's "for 1.2s"
        self._phase_since = time.monotonic()
        #: news from the process hosting the controller, applied in the controller's thread
        self._news: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: the agents' reports read so far, and the operator's requests (sequences)
        self._next_report = 0
        self._next_operator = 0
        #: the generation whose failed collective is held (ONLINE_GRACE), since when (monotonic), and every
        #: node's keepalive counter then
        self._collective_held: tuple[int, float, dict[int, int]] | None = None
        #: the world size of the last generation started (0 before the first)
        self._started_world = 0
        #: how each kind of command is made ready to publish (None: held back for now)
        self._ready: dict[CommandKind, Callable[[Command, JobView | None], Command | None]] = {
            CommandKind.START: self._ready_start,
            CommandKind.REPLACE: self._ready_replace,
            CommandKind.TAKEOVER: self._ready_takeover,
            CommandKind.STOP: self._ready_stop,
            CommandKind.EXIT: self._ready_stop,
        }
        #: --rdzv-backend etcd: this controller's office (its writes to etcd hold only while it leads), and
        #: the journal of the controller before it, which it goes on from (None: it starts the job)
        self.leadership = leadership
        self._resume = resume
        self._journal = JournalWriter(resume)
        #: when the job started, by the wall clock (the journal carries it to a successor)
        self._started_at = time.time() - (time.monotonic() - events.started)
        self.advertised_host = advertised_host
        if leadership is not None:
            self.board.controller = {"host": advertised_host, "moves": resume.moves + 1 if resume is not None else 0}
        #: set once this controller found another leads now: it changes nothing more
        self.stepped_down = threading.Event()
        #: set by its agent when it goes to another controller (``retire``)
        self.retired = threading.Event()
        #: etcd did not answer for --store-timeout: why the job stops ("" while it answers)
        self._etcd_lost = ""
        #: when the controller's thread last turned (monotonic; 0 before its loop)
        self._turned = 0.0
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    @classmethod
    def for_config(cls, store: ControlStore, config, host_agent_id: str, advertised_host: str,
                   run_folder: str = "", leadership: Leadership | None = None,
                   resume: Journal | None = None) -> "Controller":
        """The controller a launch configuration asks for (``config`` is a ``LaunchConfig``); its event log
        goes in ``run_folder``, the run's folder under ``--log-dir`` (``ftrun.folders.run_folder``), if any."""
        path = os.path.join(run_folder, EVENTS_FILE) if run_folder else ""
        return cls(
            store=store,
            keys=JobKeys(config.run_id),
            rendezvous_policy=RendezvousPolicy(config.min_nodes, config.max_nodes, config.last_call_timeout,
                                               config.rdzv_timeout, config.spares),
            host_agent_id=host_agent_id,
            advertised_host=advertised_host,
            policy=RecoveryPolicy(
                max_restarts=config.max_restarts,
                recovery=Level(config.recovery),
                node_timeout=config.node_timeout,
                stop_timeout=config.stop_timeout,
                repair_timeout=config.repair_timeout,
                store_timeout=config.store_timeout,
            ),
            events=EventLog(path, go_on=resume is not None),
            bind=bind_address(advertised_host, config.store_bind, config.several_nodes),
            snapshots=config.snapshots,
            worker_port=config.worker_port,
            ports=config.worker_port_range,
            leadership=leadership,
            resume=resume,
            schedulers=config.framework == "mindspore",
        )

    # -- the hosting process's handle ---------------------------------------------------------------

    @property
    def events(self) -> EventLog:
        """Every fault, decision, phase and repair (the summary, the status view and events.jsonl)."""
        return self.narrator.events

    @property
    def status(self) -> dict:
        """The latest status snapshot ({} before the rendezvous is done)."""
        return self.board.snapshot

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop_job(self, exit_code: int, reason: str) -> None:
        """End the job (Ctrl-C on a head node): every agent stops its workers and exits."""
        self.stop_requested.set()  # ends a rendezvous still under way
        self._news.put(lambda: self._apply(on_stop(self.view, exit_code, reason)))

    def host_gone(self, host: str, detail: str) -> None:
        """The agent on ``host`` is known to be gone (its ssh session ended): no need to wait for its
        keepalive. (In SSH mode every host runs one agent, named by its address.)"""
        self._news.put(lambda: self._host_gone(host, detail))

    def _host_gone(self, host: str, detail: str) -> None:
        node = self.roster.forget_host(host)
        if node is not None and node in self.view.present:
            log.error(detail)
            self.lose_node(node, detail)

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._resume is not None:
                self._take_over(self._resume)
            else:
                result = self.rendezvous_result = gather(self.store, self.keys, self.rendezvous_policy,
                                                         self.host_agent_id, self.stop_requested)
                if result.error:
                    return
                self.roster.take_places(result)
                self.publisher.write_layout(result.nodes)
                self.view = JobView(
                    node_count=len(result.nodes),
                    max_restarts=self.policy.max_restarts,
                    world_size=result.world_size,
                    recovery=self.policy.recovery,
                    min_nodes=self.rendezvous_policy.min_nodes,
                    snapshots=self.snapshots.enabled,
                )
                self.narrator.job_started(self.keys.run_id, result, self.view)
                self.publisher.list_job()
                self._apply(start(self.view))
            self._loop()
            self._refresh_status()
        except LeadershipLost as e:
            # another agent leads now (this one was stopped past its lease): it changes nothing more, and
            # its agent follows the new controller like any other
            log.error("the controller steps down: %s", e)
            self.stepped_down.set()
            self.view = None
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
            self.worker_stores.close()
            if self.view is not None and self.view.phase not in (Phase.EXITING, Phase.DONE):
                self._job_finished(self.view)  # the controller itself failed: say so in the log
            self.events.close()

    def _loop(self) -> None:
        """Until every agent acknowledged the exit: at each keepalive, the nodes' liveness, arrivals and the
        operator's requests; at each tick, the reports, the repair's milestones and the hosting process's news."""
        next_beat = 0.0
        exit_deadline = None
        while self.view.phase is not Phase.DONE:
            if self.leadership is not None and self.leadership.lost.is_set():
                raise LeadershipLost("this agent's lease lapsed: another may lead now")
            if self.retired.is_set():
                raise LeadershipLost("this agent follows another controller now")
            now = time.monotonic()
            self._after_own_pause(now)
            if now >= next_beat:
                next_beat = now + AGENT_HEARTBEAT_INTERVAL
                self._keepalive(now)
            self._take_reports()
            self._check_collectives(now)
            self._release_replacements()
            self._check_repair()
            if self.narrator.restarting is not None:
                self.narrator.check_restarted(self.view, time.time())
            while not self._news.empty():
                self._news.get()()
            if self.view.phase is Phase.EXITING:
                exit_deadline = exit_deadline or now + self.policy.stop_timeout + EXIT_GRACE
                if now > exit_deadline:
                    missing = sorted(self.view.present - self.view.acknowledged)
                    log.warning("nodes %s did not acknowledge the exit in time", missing)
                    break
            time.sleep(IDLE_TICK if self.view.phase is Phase.RUNNING else BUSY_TICK)

    def _after_own_pause(self, now: float) -> None:
        """A thread that did not turn for longer than --node-timeout: this process was stopped (SIGSTOP, its
        host suspended), and the agents' silence meanwhile is its own. Those whose calls to its store gave up
        look for the controller in etcd, and come back once it answers; each agent gets a whole timeout from
        then, as with a successor (counted, a controller woken after 8 s took its spares for lost at once)."""
        if self._turned and now - self._turned > self.policy.node_timeout:
            log.warning("the controller did not run for %.1fs (its process stopped?): the agents' silence "
                        "counts from now", now - self._turned)
            self.roster.keepalives.quiet_until(now + self.policy.node_timeout)
        self._turned = now

    def _keepalive(self, now: float) -> None:
        """Once an AGENT_HEARTBEAT_INTERVAL: beat, look at the nodes and spares, the library's word, the
        status, and ftrun top's requests."""
        self.publisher.heartbeat()
        self._check_etcd(now)
        self._check_nodes(now)
        self.roster.drop_silent_spares(now, self.policy.node_timeout)
        self._admit_late_arrivals()
        self._grow()
        self._check_library()
        if now >= self._next_board or (self.view.phase, self.view.generation) != self._board_shows:
            self._next_board = now + board_interval(self.view.world_size, AGENT_HEARTBEAT_INTERVAL)
            self._board_shows = (self.view.phase, self.view.generation)
            self._refresh_status()
        for request in self.store.read_from(self.keys.operator_count, self.keys.operator_request, OperatorRequest,
                                            self._next_operator):
            self._next_operator += 1  # ftrun top's requests: once a keepalive is soon enough
            if request is not None:  # None: forged, ignored (and logged)
                self._on_operator(request)

    def _refresh_status(self, final: bool = False) -> None:
        saved = self.restore_points.refresh(self.view, self.roster.present(self.view), final)
        snapshot = self.board.refresh(self.view, self.roster.nodes, self.roster.spares, self._phase_since, saved)
        self.publisher.status(snapshot)
        self.publisher.for_top(*self.board.for_top())

    def _job_finished(self, view: JobView) -> None:
        try:
            self._refresh_status(final=True)  # the final step, and the last checkpoints
            self.publisher.status_final()
        except StoreUnavailable:
            pass
        self.narrator.job_finished(view, time.monotonic() - self.board.started, self.board.snapshot.get("step"))

    # -- applying a decision ------------------------------------------------------------------------

    def _apply(self, decision: tuple[JobView, list[Command]]) -> None:
        """A decision of the policy: the job's new view, told; each command made ready, then published."""
        before = self.view
        self.view, commands = decision
        if self.narrator.decided(before, self.view, time.time()):
            self._phase_since = time.monotonic()
            if self.view.phase is Phase.EXITING:
                self._job_finished(self.view)
        ready = [command for command in (self._ready[c.kind](c, before) for c in commands) if command is not None]
        self._write_journal()  # before the commands: a successor goes on from here
        self.publisher.commands(ready)
        if any(command.kind is CommandKind.REPLACE and command.ranks for command in ready):  # not held back
            self._apply(on_replacements_started(self.view))

    # -- the journal (--rdzv-backend etcd) -----------------------------------------------------------

    def _write_journal(self) -> None:
        """The job's state, in etcd, if this controller still leads (else LeadershipLost). While etcd has
        no quorum the decision waits, the keepalive going on (no other agent can lead meanwhile); past
        --store-timeout the job stops."""
        if self.leadership is None or self.view is None or self._etcd_lost:
            return
        moves = self._resume.moves + 1 if self._resume is not None else 0
        journal = Journal(self.host_agent_id, self.advertised_host, self.view, self.rendezvous_result,
                          tuple(self.roster.nodes[n] for n in sorted(self.roster.nodes)), tuple(self.roster.spares),
                          self._started_world, moves, self._started_at)
        if not self._journal.due(journal):
            return
        since = time.monotonic()
        while True:
            try:
                self._beating_while(lambda: self._journal.write(self.leadership, journal))
                return
            except EtcdUnavailable as e:
                self._say_etcd_unreachable(str(e))
                if time.monotonic() - since > self.policy.store_timeout:
                    self._etcd_lost = self._etcd_lost_reason(str(e))
                    return
                self._beating_while(lambda: time.sleep(JOURNAL_RETRY))

    def _beating_while(self, call: Callable[[], object]) -> None:
        """``call()`` (a write to etcd) in a thread of its own while this one beats the controller's
        keepalive, so that a decision that waits for etcd is not taken for a controller gone. Each call to
        etcd may take the client's deadline (10 s) or more while it has no quorum; done in this thread, the
        keepalive stopped with it, every agent took the controller for lost after --node-timeout and the
        repair under way fell to job level (issue 40). Only this thread beats: a controller that hangs
        anywhere else still goes silent."""
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                call()
            except BaseException as e:  # raised again in the controller's thread
                outcome.append(e)

        worker = threading.Thread(target=run, name="ftrun-journal", daemon=True)
        worker.start()
        while True:
            worker.join(AGENT_HEARTBEAT_INTERVAL)
            self._after_own_pause(time.monotonic())  # waiting for etcd is no pause; being stopped while it waits is
            if not worker.is_alive():
                break
            if self.retired.is_set():  # what it writes, if etcd takes it, is the journal it had decided
                raise LeadershipLost("this agent follows another controller now")
            self.publisher.heartbeat()
            if self.leadership is not None and self.leadership.unreachable_since:
                self._say_etcd_unreachable("its lease could not be renewed")
        if outcome:
            raise outcome[0]

    def retire(self) -> None:
        """This controller's agent goes to another controller (or a new one of its own): change nothing
        more. Its thread ends within a keepalive."""
        self.retired.set()

    def _etcd_lost_reason(self, detail: str) -> str:
        return f"the control store (etcd) was unreachable for {self.policy.store_timeout:g}s: {detail}"

    def _check_etcd(self, now: float) -> None:
        """--rdzv-backend etcd: say once that etcd does not answer; stop the job past --store-timeout."""
        if self.leadership is None or self.view.phase in (Phase.EXITING, Phase.DONE):
            return
        since = self.leadership.unreachable_since
        if since and not self._etcd_lost:
            self._say_etcd_unreachable("its lease could not be renewed")
            if now - since > self.policy.store_timeout:
                self._etcd_lost = self._etcd_lost_reason("its lease could not be renewed")
        elif not since and self.narrator.etcd_down:
            self.narrator.etcd_back(self.view.generation)
            self.publisher.etcd_unreachable("")
        if self._etcd_lost:
            self._apply(on_stop(self.view, ExitCode.JOB_FAILED, self._etcd_lost))

    def _say_etcd_unreachable(self, detail: str) -> None:
        if not self.narrator.etcd_down:
            self.narrator.etcd_unreachable(self.view.generation, detail)
            self.publisher.etcd_unreachable(detail)

    def _take_over(self, journal: Journal) -> None:
        """Go on from the journal of the controller before: its job, roster and layout, published in this
        controller's store; the node that hosted it counts as lost (its lease lapsed: it was silent
        for --node-timeout), and a spare takes its place as for any lost node."""
        self.rendezvous_result = journal.rendezvous
        self.roster.take_places(journal.rendezvous)
        self.roster.nodes = {slot.node_rank: slot for slot in journal.nodes}
        self.roster.spares = list(journal.spares)
        # the predecessor may have told the healthy ranks of a repair into the next generation and died while
        # its journal waited for etcd: this controller's next generation comes after that one
        self.view = dataclasses.replace(journal.view, unjournaled=max(journal.view.unjournaled,
                                                                      journal.view.generation + 1))
        self._started_world = journal.started_world
        if journal.started_at:  # the job's clock goes on: the event log's elapsed, the status's uptime
            self._started_at = journal.started_at
            self.board.started = self.events.started = time.monotonic() - (time.time() - journal.started_at)
        self.publisher.ranks_started = journal.view.generation
        self.worker_stores.fresh()  # the next generation's, on this node (the last one's went with its node)
        self._publish_layout()
        self.publisher.list_job()
        self.narrator.took_office(journal, self.host_agent_id, self.advertised_host, time.time())
        self._write_journal()
        # the agents reach this store only once they took the old one for gone (up to --node-timeout) and
        # found this one in etcd: their silence counts from then
        self.roster.keepalives.quiet_until(time.monotonic() + self.policy.node_timeout)
        generation = self.view.generation
        lost = journal.held_by(journal.leader) if journal.leader != self.host_agent_id else None
        if lost is not None and lost.node_rank in self.view.present:
            self.lose_node(lost.node_rank, f"node {lost.node_rank} ({lost.host}) lost with the controller it hosted")
        elif journal.leader != self.host_agent_id:
            self.roster.spares = [s for s in self.roster.spares if s.agent_id != journal.leader]
        if self.view.generation == generation and self.view.phase in REPAIR_PHASES:
            # nothing above moved the repair on, and what it waits for was said in the store the agents left
            log.warning("the %s-level repair under way goes on with this controller%s", self.view.repair_level,
                        f" in generation {self.view.next_generation}" if self.view.level is Level.PROCESS else "")
            self._apply(on_controller_moved(self.view))

    def _ready_start(self, command: Command, before: JobView | None) -> Command:
        """A generation starts: the layout (a scale-in or a grow-back renumbers the global ranks), the
        restore it takes, a fresh worker store."""
        self.narrator.generation_started(command.generation, self.view.world_size,
                                         grow=before is not None and before.free_restart)
        previous, self._started_world = self._started_world, self._publish_layout()
        self.publisher.ranks_started = command.generation
        if command.generation > 0 and self.snapshots.enabled:
            restore = self.restore_points.choose(command.generation, self.view, self.roster.present(self.view))
            counts, sources = self.publisher.restore_plans(command.generation, restore)
            self.narrator.restore(command.generation, restore, counts, sources)
        worker_store = self.worker_stores.fresh()
        self._scheduler = self.worker_stores.scheduler() if self.schedulers else ""
        return dataclasses.replace(command, previous_world_size=previous, worker_store=worker_store,
                                   scheduler=self._scheduler)

    def _ready_replace(self, command: Command, before: JobView | None) -> Command | None:
        # the generation before a repair's ran in the same world: a replacement sees no resize
        command = dataclasses.replace(command, worker_store=self.worker_stores.address,
                                      previous_world_size=self._started_world, scheduler=self._scheduler)
        # the healthy ranks leave their groups now, before the journal is written: a rank whose collective
        # failed waits ``fault_wait`` (10 s) for this to tell a peer's fault from its own, and while etcd
        # has no quorum the journal waits longer (announced after it, the healthy ranks took the lost peer
        # for an error of their own, exited and were replaced too: 7 process starts for one fault)
        self.publisher.announce(command.generation, self.view.world_size, online=not command.ranks,
                                replaced=command.ranks)
        if not command.ranks:
            return command  # the online level: nothing to start, the agents only move to the new generation
        if self.policy.gather_timeout <= 0:
            return command
        # The replacements start a moment later (the healthy ranks take longer to stop). If the reports
        # that come meanwhile name every rank (a whole job's crash, whose deaths come a few milliseconds
        # apart), the policy gives the repair up for a job-level restart, and no replacement has taken a
        # warm standby that the restart's ranks need.
        self.publisher.hold(command, self.policy.gather_timeout)
        return None

    def _release_replacements(self) -> None:
        """The held REPLACE commands go out once their moment has passed: warm standbys are taken from now."""
        if self.publisher.release_held():
            self._apply(on_replacements_started(self.view))

    def _ready_takeover(self, command: Command, before: JobView | None) -> Command:
        """The spare holds the node from now on."""
        spare, lost = self.roster.hand_over(command.agent_id, command.node_rank)
        self._publish_layout()
        self.narrator.took_over(command.generation, command.node_rank, spare, lost)
        return command

    def _ready_stop(self, command: Command, before: JobView | None) -> Command:
        """A STOP or an EXIT: the repair's held replacements are not wanted any more."""
        self.publisher.drop_held(command.reason)
        return command

    # -- the nodes ----------------------------------------------------------------------------------

    def _publish_layout(self) -> int:
        """The layout of the nodes in the job now, written when it changed; their world size."""
        nodes = self.roster.renumber(self.view)
        self.publisher.write_layout(nodes)
        return sum(slot.nproc for slot in nodes)

    def _check_nodes(self, now: float) -> None:
        timeout = self.policy.node_timeout
        for node in self.roster.silent_nodes(self.view, now, timeout):
            detail = f"node {node} ({self.roster.nodes[node].host}) lost: no keepalive from its agent for {timeout:g}s"
            log.error(detail)
            self.lose_node(node, detail)

    def lose_node(self, node: int, detail: str) -> None:
        """A node's agent is gone: a spare takes its place when one is idle (and the policy agrees)."""
        slot = self.roster.nodes[node]
        self.narrator.node_lost(self.view.generation, slot, detail)
        spare = self.roster.spare_for(slot.nproc)
        ranks = tuple(range(slot.first_rank, slot.first_rank + slot.nproc))
        self._apply(on_node_lost(self.view, node, detail, spare.agent_id if spare else "", ranks))

    def _room_to_grow(self) -> bool:
        """Fewer nodes than --nnodes MAX: after a scale-in, or when some were late for the rendezvous."""
        return bool(self.view.vacant) or self.view.node_count < self.rendezvous_policy.max_nodes

    def _grow(self) -> None:
        """An idle spare and room for a node: it joins the job as a node of its own."""
        if not self.roster.spares or not self._room_to_grow() or self.view.phase is not Phase.RUNNING:
            return
        spare = self.roster.spares[0]
        node_rank = min(self.view.vacant) if self.view.vacant else self.view.node_count
        self._apply(on_node_joined(self.view, node_rank, spare.agent_id, spare.nproc, spare.host))

    def _admit_late_arrivals(self) -> None:
        """Agents that joined after the rendezvous: spares while the job wants more, else refused."""
        for join in self.roster.arrivals():
            if len(self.roster.spares) < self.rendezvous_policy.spares or self._room_to_grow():
                self.roster.add_spare(join)
                self.publisher.admit_spare(join.agent_id)
                log.info("%s joined as a spare node", join.host)
            else:
                spares = self.rendezvous_policy.spares
                self.publisher.refuse(join.agent_id, f"the job already has its {len(self.roster.nodes)} nodes and "
                                                     f"{spares} spare{'s' if spares != 1 else ''}")

    # -- what the agents and the ranks say ----------------------------------------------------------

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

    def _on_report(self, report: Report) -> None:
        owner = self.roster.nodes.get(report.node_rank)
        if report.agent_id and owner is not None and report.agent_id != owner.agent_id:
            log.warning("ignoring a %s report from %s: node %d now belongs to %s", report.kind.value,
                        report.agent_id, report.node_rank, owner.agent_id)
            return
        spare = self.roster.spare_for(owner.nproc) if owner is not None else None
        if report.kind is ReportKind.NODE_UNUSABLE and spare is not None:
            self.lose_node(report.node_rank, f"node {report.node_rank} ({owner.host}): {report.detail}")
            return
        if report.kind is ReportKind.WORKER_FAILED:
            self._catch_up_with_the_repair()
        self._apply(on_report(self.view, report))

    def _catch_up_with_the_repair(self) -> None:
        """Before a failure is judged: the milestones the ranks reached since the last tick, so that it is
        judged where the repair stands. After a decision that waited for etcd the ranks were a whole
        repair ahead (it ended while etcd had no quorum), and a rank killed as etcd answered joined that
        repair as a failure of its rollback, its replacement taken for one without state."""
        view = self.view
        while view.level is Level.PROCESS and view.phase in REPAIR_PHASES:
            self._check_repair()
            if self.view is view:
                return
            view = self.view

    def _stop_acknowledgements(self) -> tuple[int, frozenset[int]] | None:
        """During a job-level STOP, once every node waited for has acknowledged it (one ``check`` of their
        agents' keys per tick): the generation and the nodes whose acknowledgement holds."""
        view = self.view
        if view.phase is not Phase.STOPPING or view.level is not Level.JOB:
            return None
        nodes = self.roster.nodes
        waiting = [(node, nodes[node].agent_id) for node in sorted(view.present - view.acknowledged) if node in nodes]
        if not waiting:
            return None
        acks = self.store.all_set(Report, [self.keys.stopped(view.generation, agent) for _, agent in waiting])
        if acks is None:
            return None
        # a forged one (None) does not count: its node is waited for still
        return view.generation, frozenset(node for (node, agent), ack in zip(waiting, acks)
                                          if ack is not None and ack.agent_id == agent)

    def _check_collectives(self, now: float) -> None:
        """A rank's collective failed in the running generation (or in an online repair's): once it was
        held ONLINE_GRACE with no death reported meanwhile, and every node's agent was heard from since,
        the policy repairs in place. One read a tick, only where process level is ready (else a rank's own
        wait for an announcement ends it), and the keepalive counters while one is held."""
        view = self.view
        watched = (view.phase is Phase.RUNNING and view.process_level_ready) or (
            view.online and view.phase in REPAIR_PHASES)
        if not watched:
            return
        said = self.store.try_text(self.keys.collective_failure(view.generation))
        failure = CollectiveFailure.from_text(said) if said else None
        if failure is None:
            return
        held = self._collective_held
        if held is None or held[0] != view.generation:
            self._collective_held = (view.generation, now, self.roster.keepalive_counts(view))
            return
        if now - held[1] < ONLINE_GRACE:
            return
        counts = self.roster.keepalive_counts(view)
        if any(counts.get(node, 0) <= before for node, before in held[2].items()):
            return  # a node not heard from since: its agent may be gone with its ranks
        slot = self.roster.holder_of_rank(failure.rank)
        self._apply(on_collective_failed(view, failure, slot.node_rank if slot else -1, slot.host if slot else ""))

    def _check_library(self) -> None:
        """Whether every rank runs ftrun.elastic, and whether its layout allows process-level repair."""
        view = self.view
        if view.recovery is not Level.PROCESS or view.phase is not Phase.RUNNING or view.refusal:
            return
        if not view.process_level_ready:
            self._apply(on_library_ranks(view, self._joined(view.generation)))
        else:
            refusal = self.store.try_text(self.keys.process_level_refused)
            if refusal:
                self._apply(on_process_level_refused(view, refusal))

    def _joined(self, generation: int) -> int:
        """How many ranks joined the generation's process group: ranks under ftrun.elastic say so."""
        return self.store.counter(self.keys.milestone(generation, Milestone.JOINED.value))

    def _check_repair(self) -> None:
        """During a process-level repair: count the ranks' milestones, watch the deadline."""
        view = self.view
        if view.level is not Level.PROCESS or view.phase not in REPAIR_PHASES:
            return
        said = self.store.try_text(self.keys.rollback_failure(view.generation))
        if said:
            failure = RollbackFailure.from_text(said)
            self._apply(on_repair_failed(view, failure.reason if failure else said, failure))
            return
        if time.time() - self.narrator.repair_decided_at > self.policy.repair_timeout:
            phase = view.phase.value
            self._apply(on_repair_failed(
                view, f"the repair did not finish within {self.policy.repair_timeout:g}s (stuck in {phase})"))
            return
        if view.phase in MILESTONE_OF:
            milestone, _ = MILESTONE_OF[view.phase]
            expected = view.world_size - len(view.replacing) if milestone is Milestone.STOPPED else view.world_size
            if self.store.counter(self.keys.milestone(view.generation, milestone.value)) >= expected:
                self._apply(on_milestone(view, milestone))

    def _on_operator(self, request: OperatorRequest) -> None:
        """A person's request from ``ftrun top``: told with who asked and the answer, then applied."""
        slot = self.roster.holder_of_rank(request.rank)
        if request.action is OperatorAction.DRAIN:
            slot = self.roster.nodes.get(request.node_rank)
        spare = self.roster.spare_for(slot.nproc) if slot is not None else None
        refusal = operator_refusal(self.view, request, self.store.signer.enabled, spare.agent_id if spare else "")
        if slot is None and not refusal and request.action is not OperatorAction.STOP:
            refusal = "no node holds it"
        self.narrator.operator(self.view.generation, request, slot, refusal)
        if refusal:
            return
        if request.action is OperatorAction.STOP:
            self._apply(on_operator(self.view, request))
        elif request.action is OperatorAction.DRAIN:
            self.narrator.node_lost(self.view.generation, slot, f"node {slot.node_rank} drained by {request.who}")
            ranks = tuple(range(slot.first_rank, slot.first_rank + slot.nproc))
            self._apply(on_operator(self.view, request, spare=spare.agent_id, ranks=ranks))
        else:
            pid = next((r.get("pid", 0) for r in self.board.snapshot.get("ranks", ()) if r["rank"] == request.rank), 0)
            self._apply(on_operator(self.view, request, slot.node_rank, request.rank - slot.first_rank, slot.host, pid,
                                    at=time.time()))
