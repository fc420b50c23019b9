"""The controller thread: the rendezvous, then a loop that observes, decides and applies.

Each turn its observers (``observers.py``) read what the store shows and return events; every event,
from them or from the process that hosts the controller, goes through one inbox (``inbox.py``), is
completed from the roster (``lookup.py``), decided by the pure policy (``policy.py``, over the frozen
view of ``states.py``) and applied by the executor (``executor.py``), which alone changes the job:
its narrator tells it (``narrator.py``), its publisher writes the commands (``publisher.py``), its
office under etcd writes the journal first (``office.py``). Beside them: who holds each node and which
spares stand by (``roster.py``), each generation's worker store (``worker_store.py``), and what the
nodes' snapshots hold (``restore_points.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

from ftrun.contract import STORE_TIMEOUT
from ftrun.controller.board import StatusBoard
from ftrun.controller.executor import Executor
from ftrun.controller.inbox import ControllerMoved, Event, HostGone, Inbox, NodeLost, Reported, StopAsked
from ftrun.controller.journal import Journal
from ftrun.controller.leadership import Leadership, LeadershipLost
from ftrun.controller.links import LinkObserver, LinkRules
from ftrun.controller.lookup import RosterLookup
from ftrun.controller.narrator import Narrator
from ftrun.controller.observers import Collectives, Library, Nodes, Operator, Repair, Reports
from ftrun.controller.office import EtcdOffice
from ftrun.controller.policy import decide, start
from ftrun.controller.publisher import Publisher
from ftrun.controller.restore_points import RestorePoints
from ftrun.controller.roster import OwnPause, Roster
from ftrun.controller.states import IN_PLACE, REPAIR_PHASES, JobView, Level, Phase
from ftrun.controller.straggler_watch import StragglerWatch
from ftrun.controller.worker_store import WorkerStores
from ftrun.errors import ExitCode
from ftrun.events import EVENTS_FILE, EventLog
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, JobKeys
from ftrun.messages import RendezvousResult, ReportKind
from ftrun.ports import PortRange
from ftrun.rendezvous import RendezvousPolicy, gather
from ftrun.snapshots.keeper import SnapshotOptions
from ftrun.store import ControlStore, StoreUnavailable, bind_address
from ftrun.timeouts import timeout_chain

if TYPE_CHECKING:
    from ftrun.controller.metrics import JobMetrics

log = logging.getLogger(__name__)
#: how often the controller reads the store: briskly while a repair or an exit is under way, and while
#: the job runs often enough that a failure report (sent the moment a worker dies) waits little: each
#: tick is one read of the report counter, whatever the job's size
BUSY_TICK = 0.01
IDLE_TICK = 0.02
#: how long the controller waits for every agent to acknowledge the exit
EXIT_GRACE = 10.0


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    max_restarts: int
    recovery: Level
    node_timeout: float
    stop_timeout: float
    #: a process-level repair that has not finished by then falls back to job level
    repair_timeout: float
    #: how long a repair's REPLACE commands are held back for more failure reports (``executor.py``)
    gather_timeout: float = 0.03
    #: --rdzv-backend etcd: how long the job goes on while etcd does not answer, before it stops
    store_timeout: float = STORE_TIMEOUT
    #: --online-window: how long a dark data link may stay dark before its node's ranks move to a spare
    online_window: float = 2.0
    #: --stragglers: report, replace (a straggling node's ranks move to a spare) or off
    stragglers: str = "report"



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
        clock: Callable[[], float] = time.monotonic,
        metrics_port: int = 0,
    ):
        self.store, self.keys = store, keys
        self.rendezvous_policy = rendezvous_policy
        self.host_agent_id = host_agent_id
        self.policy = policy
        self.snapshots = snapshots or SnapshotOptions()
        self.clock = clock
        self.stop_requested = threading.Event()
        #: who holds each node, and which spares stand by
        self.roster = Roster(store, keys)
        self.pause = OwnPause(self.roster.keepalives, policy.node_timeout)
        events = events or EventLog()
        self.library = Library(store, keys)
        self.narrator = Narrator(events, self.library.joined)
        self.publisher = Publisher(store, keys, self.roster.agents)
        self.board = StatusBoard(store, keys, events, keys.run_id)
        self.restore_points = RestorePoints(store, keys, self.snapshots, self.narrator)
        #: each generation's worker store, listening where ``bind`` says ("": the address advertised_host names)
        self.worker_stores = WorkerStores(store, advertised_host, bind or bind_address(advertised_host),
                                          worker_port, ports)
        #: --rdzv-backend etcd: this controller's office (its writes to etcd hold only while it leads)
        self.office = EtcdOffice(leadership, resume, host_agent_id, advertised_host, self.narrator, self.publisher,
                                 self.pause, policy.store_timeout, clock)
        self._resume = resume
        if leadership is not None:
            self.board.controller = {"host": advertised_host, "moves": self.office.moves}
        self.executor = Executor(self.roster, self.publisher, self.narrator, self.board, self.restore_points,
                                 self.worker_stores, self.office, self.snapshots.enabled, schedulers,
                                 policy.gather_timeout, clock)
        self.inbox = Inbox()
        self.lookup = RosterLookup(self.roster, self.board, store.signer.enabled, host_agent_id)
        self.reports = Reports(store, keys, self.roster)
        self.collectives = Collectives(store, keys, self.roster)
        self.repair = Repair(store, keys, policy.repair_timeout, lambda: self.narrator.repair_decided_at)
        self.nodes = Nodes(self.roster, policy.node_timeout, rendezvous_policy.max_nodes)
        self.operator = Operator(store, keys)
        #: a data link gone dark, and a job that stands still (``links.py``)
        self.links = LinkObserver(self.narrator.events, LinkRules(policy.online_window,
                                                                  repair_timeout=policy.repair_timeout))
        self.links.host_agent = host_agent_id
        self.stragglers = StragglerWatch(self.board, policy.stragglers)
        #: --metrics-port: the Prometheus endpoint, served from the controller's start (None without one)
        self.metrics: JobMetrics | None = None
        self.metrics_port = metrics_port
        if metrics_port:
            from ftrun.controller.metrics import JobMetrics  # prometheus_client only where it serves

            self.metrics = JobMetrics(keys.run_id)
        #: set once this controller found another leads now: it changes nothing more
        self.stepped_down = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    # -- the hosting process's handle ---------------------------------------------------------------

    @property
    def view(self) -> JobView | None:
        """The policy's view of the job: what every decision starts from (None before the rendezvous)."""
        return self.executor.view

    @view.setter
    def view(self, view: JobView | None) -> None:
        self.executor.view = view

    @property
    def rendezvous_result(self) -> RendezvousResult | None:
        """Who is which node, as the rendezvous decided (None while it is under way)."""
        return self.executor.rendezvous

    @property
    def leadership(self) -> Leadership | None:
        return self.office.leadership

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
        self.inbox.put(StopAsked(exit_code, reason))

    def host_gone(self, host: str, detail: str) -> None:
        """The agent on ``host`` is known to be gone (its ssh session ended): no need to wait for its
        keepalive. (In SSH mode every host runs one agent, named by its address.)"""
        self.inbox.put(HostGone(host, detail))

    def retire(self) -> None:
        """This controller's agent goes to another controller (or a new one of its own): change nothing
        more. Its thread ends within a keepalive."""
        self.office.retired.set()

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.metrics is not None:
            try:
                self.metrics_port = self.metrics.serve(self.metrics_port)
            except OSError as e:
                log.error("no Prometheus metrics: cannot listen on port %d: %s", self.metrics_port, e)
                self.metrics = None
        try:
            if self._resume is not None:
                self._take_over(self._resume)
            else:
                result = gather(self.store, self.keys, self.rendezvous_policy, self.host_agent_id, self.stop_requested)
                self.executor.rendezvous = result
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
                self._apply(self.executor.apply(start(self.view)))
            self._loop()
            self.executor.refresh_status()
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
            if self.metrics is not None:
                self.metrics.close()
            self.worker_stores.close()
            if self.view is not None and self.view.phase not in (Phase.EXITING, Phase.DONE):
                self.executor.job_finished()  # the controller itself failed: say so in the log
            self.events.close()

    def _loop(self) -> None:
        """Until every agent acknowledged the exit: at each keepalive, the nodes' liveness, arrivals and the
        operator's requests; at each tick, the reports, the failed collectives, the repair's milestones and
        the hosting process's news."""
        next_beat = 0.0
        exit_deadline = None
        while self.view.phase is not Phase.DONE:
            self.office.check_term()
            now = self.clock()
            self.pause.turned(now)
            if now >= next_beat:
                next_beat = now + AGENT_HEARTBEAT_INTERVAL
                self.keepalive(now)
            self.tick(now)
            if self.view.phase is Phase.EXITING:
                exit_deadline = exit_deadline or now + self.policy.stop_timeout + EXIT_GRACE
                if now > exit_deadline:
                    missing = sorted(self.view.present - self.view.acknowledged)
                    log.warning("nodes %s did not acknowledge the exit in time", missing)
                    break
            time.sleep(IDLE_TICK if self.view.phase is Phase.RUNNING else BUSY_TICK)

    def keepalive(self, now: float) -> None:
        """Once an AGENT_HEARTBEAT_INTERVAL: beat; etcd's answer, the nodes and spares, the library's word,
        the status, and ftrun top's requests."""
        self.publisher.heartbeat()
        self.take(self.office.observe(self.view, now))
        self.take(self.nodes.silent(self.view, now))
        self.roster.drop_silent_spares(now, self.policy.node_timeout)
        self.executor.admit_late_arrivals(self.nodes.room_to_grow(self.view), self.rendezvous_policy.spares)
        self.take(self.nodes.idle_spare(self.view))
        self.take(self.library.observe(self.view))
        self._watch_links(now)  # before the status: it shows a dark link or a stall
        self.executor.status_due(now)
        self.take(self.stragglers.observe(self.view, now))
        if self.metrics is not None:
            self.metrics.update(self.board.snapshot, self.events.events)
        self.take(self.operator.observe())

    def tick(self, now: float) -> None:
        """One turn: each observer's events are decided before the next one looks, so that it sees where
        they moved the job; then what the hosting process sent."""
        reports = self.links.take_reports(self.reports.observe(self.view), self.view, self.roster.nodes,
                                          self._spare_idle(), now)
        if reports:  # a rank that failed within a keepalive of joining: its level is chosen on what joined by now
            self.take(self.library.observe(self.view))
        self.take(reports)
        self.take(self.collectives.observe(self.view, now))
        self.take(self.executor.release_held())
        self.take(self.repair.observe(self.view))
        if self.narrator.restarting is not None:
            self.narrator.check_restarted(self.view, time.time())
        self.take([])

    def _watch_links(self, now: float) -> None:
        """The dark links' ladder, and the stall watch over the board's newest step; both shown in the status."""
        spare = self._spare_idle()
        self.take(self.links.observe(self.view, self.roster.nodes, spare, now))
        self.take(self.links.watch_reach(self.view, self.board.snapshot, self.roster.nodes, spare, now))
        self.links.watch_steps(self.view, self.board.snapshot, now)
        self.board.stall = self.links.status(now)

    def _spare_idle(self) -> bool:
        nproc = max((slot.nproc for slot in self.roster.nodes.values()), default=1)
        return self.roster.spare_for(nproc) is not None

    # -- deciding -----------------------------------------------------------------------------------

    def take(self, events: list[Event]) -> None:
        """``events`` into the inbox, then every event there decided and applied, oldest first (in the
        controller's thread: the hosting process puts its news in the inbox)."""
        self.inbox.extend(events)
        while (event := self.inbox.take()) is not None:
            self._decide(event)

    def _decide(self, event: Event) -> None:
        completed = self.lookup.complete(event, self.view)
        if completed is None:
            return
        if isinstance(completed, Reported) and completed.report.kind is ReportKind.WORKER_FAILED:
            self._catch_up_with_the_repair()
        self.executor.tell(completed)
        self._apply(self.executor.apply(decide(self.view, completed)))

    def _apply(self, follow_ups: list[Event]) -> None:
        """What the executor did that the policy must hear of, decided at once (before any other event)."""
        for event in follow_ups:
            self._decide(event)

    def _catch_up_with_the_repair(self) -> None:
        """Before a failure is judged: the milestones the ranks reached since the last tick, so that it is
        judged where the repair stands. After a decision that waited for etcd the ranks were a whole
        repair ahead (it ended while etcd had no quorum), and a rank killed as etcd answered joined that
        repair as a failure of its rollback, its replacement taken for one without state."""
        view = self.view
        while view.level in IN_PLACE and view.phase in REPAIR_PHASES:
            for event in self.repair.observe(view):
                self._decide(event)
            if self.view is view:
                return
            view = self.view

    # -- a successor ------------------------------------------------------------------------------------

    def _take_over(self, journal: Journal) -> None:
        """Go on from the journal of the controller before: its job, roster and layout, published in this
        controller's store; the node that hosted it counts as lost (its lease lapsed: it was silent
        for --node-timeout), and a spare takes its place as for any lost node."""
        self.executor.rendezvous = journal.rendezvous
        self.roster.take_places(journal.rendezvous)
        self.roster.nodes = {slot.node_rank: slot for slot in journal.nodes}
        self.roster.spares = list(journal.spares)
        # the predecessor may have told the healthy ranks of a repair into the next generation and died while
        # its journal waited for etcd: this controller's next generation comes after that one
        self.view = dataclasses.replace(journal.view, unjournaled=max(journal.view.unjournaled,
                                                                      journal.view.generation + 1))
        self.executor.started_world = journal.started_world
        if journal.started_at:  # the job's clock goes on: the event log's elapsed, the status's uptime
            self.executor.started_at = journal.started_at
            self.board.started = self.events.started = self.clock() - (time.time() - journal.started_at)
        self.publisher.ranks_started = journal.view.generation
        self.worker_stores.fresh()  # the next generation's, on this node (the last one's went with its node)
        self.executor.publish_layout()
        self.publisher.list_job()
        self.narrator.took_office(journal, self.host_agent_id, self.office.host, time.time())
        self.executor.record()
        # the agents reach this store only once they took the old one for gone (up to --node-timeout) and
        # found this one in etcd: their silence counts from then
        self.roster.keepalives.quiet_until(self.clock() + self.policy.node_timeout)
        generation = self.view.generation
        lost = journal.held_by(journal.leader) if journal.leader != self.host_agent_id else None
        if lost is not None and lost.node_rank in self.view.present:
            self.take([NodeLost(lost, f"node {lost.node_rank} ({lost.host}) lost with the controller it hosted")])
        elif journal.leader != self.host_agent_id:
            self.roster.spares = [s for s in self.roster.spares if s.agent_id != journal.leader]
        if self.view.generation == generation and self.view.phase in REPAIR_PHASES:
            # nothing above moved the repair on, and what it waits for was said in the store the agents left
            log.warning("the %s-level repair under way goes on with this controller%s", self.view.level.value,
                        f" in generation {self.view.next_generation}" if self.view.level in IN_PLACE else "")
            self.take([ControllerMoved()])


def controller_for(store: ControlStore, config, host_agent_id: str, advertised_host: str, run_folder: str = "",
                   leadership: Leadership | None = None, resume: Journal | None = None) -> Controller:
    """The controller a launch configuration asks for (``config`` is a ``LaunchConfig``); its event log
    goes in ``run_folder``, the run's folder under ``--log-dir`` (``ftrun.folders.run_folder``), if any."""
    path = os.path.join(run_folder, EVENTS_FILE) if run_folder else ""
    controller = Controller(
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
            online_window=config.online_window,
            stragglers=config.stragglers,
        ),
        events=EventLog(path, go_on=resume is not None),
        bind=bind_address(advertised_host, config.store_bind, config.several_nodes),
        snapshots=config.snapshots,
        worker_port=config.worker_port,
        ports=config.worker_port_range,
        leadership=leadership,
        resume=resume,
        schedulers=config.framework == "mindspore",
        metrics_port=config.metrics_port,
    )
    controller.links.bounds = timeout_chain(config, os.environ)  # checked again with the measured step time
    return controller
