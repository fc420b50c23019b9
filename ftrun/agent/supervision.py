"""What the agent sees of its node and tells the controller: its keepalive and status, what the node's
health sources find (a rank that stopped showing signs of life is dumped, killed and reported; the ranks
on a sick device are stopped; a data link gone dark, or back, is reported), ranks that ended (the failed
ones reported, success once a generation), an operator's interrupt.

The agent decides nothing about recovery: what it reports, the controller decides on (``ftrun.controller.policy``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import psutil

from ftrun.agent.cpu_time import CpuShare
from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.node_snapshots import NodeSnapshots
from ftrun.agent.protocol import NodeProtocol
from ftrun.agent.relay import FolderRelay
from ftrun.agent.seat import Seat
from ftrun.agent.spawner import Spawner
from ftrun.agent.stacks import dump_stack
from ftrun.agent.top_feed import TopFeed
from ftrun.agent.workers import Worker, WorkerGroup
from ftrun.detection.hang import HangWatch
from ftrun.detection.oom import OomWatch
from ftrun.detection.reach import PROBE_EVERY, Prober, peers_to_probe, probe_ring, spare_probe_id
from ftrun.detection.sources import HealthEvent, NodeHealth, RankSigns
from ftrun.detection.table import FaultLevel, FaultTable
from ftrun.interrupts import Interrupts
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL
from ftrun.messages import NodeStatus, RankState, ReportKind
from ftrun.step_times import StepTimes, read_collective

log = logging.getLogger(__name__)
#: after this node reported a failure, how often and for how long the agent looks for the controller's
#: answer (a replacement to start) instead of once a --monitor-interval: it is on the repair's critical path
ANSWER_TICK, ANSWER_WAIT = 0.005, 1.0
#: after a Ctrl-C, how long to wait for the controller's exit command before leaving alone
INTERRUPT_GRACE = 10.0


class Supervision:
    """One node's observing and reporting, a turn of the agent's loop at a time (``tend``, then
    ``report_ended``). ``protocol`` and ``top_feed`` give the controller's store's now (they move under etcd).
    ``health`` is the node's health sources, ``hangs`` among them (its ranks' heartbeats are read here)."""

    def __init__(self, group: WorkerGroup, seat: Seat, devices: NodeDevices, protocol: Callable[[], NodeProtocol],
                 top_feed: Callable[[], TopFeed | None], health: NodeHealth, hangs: HangWatch, interrupts: Interrupts,
                 table: FaultTable, oom: OomWatch | None = None, watch_output: bool = False):
        self.group = group
        self.seat = seat
        self.devices = devices
        self._protocol = protocol
        self._top_feed = top_feed
        self.health = health
        self.hangs = hangs
        self.interrupts = interrupts
        self.table = table
        self.oom = oom if oom is not None else OomWatch()
        #: --hang-timeout: a rank's output and CPU time count as signs of life
        self.watch_output = watch_output
        #: set once the node holds ranks: its snapshots, its MindSpore relay, its workers' starts
        self.snapshots: NodeSnapshots | None = None
        self.relay: FolderRelay | None = None
        self.spawner: Spawner | None = None
        #: the data network's probe (``ftrun.detection.reach``), once the node holds ranks (or stands by as a spare)
        #: and has a data address
        self.probe: Prober | None = None
        self._probe_aimed = 0.0
        #: a spare's probe id (below zero; None for a node, whose id is its node rank), and how many spares took
        #: one, as the last probe round read it: they are on the ring too
        self.spare_probe: int | None = None
        self._spares_claimed = 0
        #: a spare's view of the job's size: it holds no layout until it takes a node's place
        self.job_nodes = 0
        #: global rank -> how many times this agent started its process (the status view's restarts)
        self._starts: dict[int, int] = {}
        #: --rdzv-backend etcd: the failure reports of this node since its workers last started (generation,
        #: failures), said again to each new controller: the store may have gone before it took one, or its
        #: controller before its journal held the decision (it dies inside an etcd outage), and a repair that
        #: counts a dead rank healthy waits for it until its deadline. The controller leaves out what it knows
        self.failures_told: list[tuple] = []
        #: the outside view: each running rank's CPU share, sampled from /proc with the status
        self.cpu = CpuShare()
        self.begin()

    def begin(self) -> None:
        """A new run of the loop (at the start, and in a new store after the controller moved)."""
        #: when the next keepalive is due (monotonic)
        self.next_beat = 0.0
        #: when this node was interrupted (Ctrl-C, SIGTERM), or None: it then reports no more failures
        self.interrupted_at: float | None = None
        #: whether the node said that all its ranks succeeded (once a generation)
        self.reported_success = False
        #: after a failure report: until then, the loop looks for the controller's answer often
        self.answer_due = 0.0

    # -- a turn of the loop --------------------------------------------------------------------

    def tend(self, now: float) -> None:
        """The node's own upkeep: the keepalive when due, device resets, what the health sources found,
        workers waiting for a device or the warm interpreter, and an interrupt (reported once: the controller answers it)."""
        group = self.group
        if now >= self.next_beat:
            self.keepalive(now, judge_hangs=self.interrupted_at is None)
            self.next_beat = now + AGENT_HEARTBEAT_INTERVAL
        self.devices.tick(w.placement.local_rank for w in group.running)
        self.take(self.health.poll(now))
        self.aim_probe(now)
        if self.spawner is not None:
            self.spawner.tick()
        if self.relay is not None:
            self.relay.tick()
        if self.interrupts.requested and self.interrupted_at is None:
            self.interrupted_at = now
            group.stop_signal = self.interrupts.worker_signal
            self._protocol().report(ReportKind.INTERRUPTED, group.generation, exit_code=self.interrupts.exit_code,
                                    detail=f"{self.interrupts.name} on node {self.seat.node_rank} ({self.seat.host})")

    def unanswered(self, now: float) -> bool:
        """The node was interrupted and the controller did not answer within INTERRUPT_GRACE: leave alone."""
        return self.interrupted_at is not None and now - self.interrupted_at > INTERRUPT_GRACE

    def report_ended(self, now: float) -> None:
        """Ranks that ended since the last turn: the failed ones reported (and the controller's answer
        looked for often for a while), the node's success once a generation."""
        group = self.group
        ended = group.poll()
        if not ended:
            return
        # the status the report below is read with holds the ranks' last steps
        if self.relay is not None:
            self.relay.tick()  # a MindSpore rank's, written as it ended
        self.keepalive(now, judge_hangs=False)
        self.next_beat = now + AGENT_HEARTBEAT_INTERVAL
        failed = [w for w in ended if w.returncode != 0]
        if failed and self.interrupted_at is None:
            self.report_failed(failed)
            self.answer_due = now + ANSWER_WAIT
        if group.all_succeeded and not self.reported_success:
            self.reported_success = True
            self._protocol().report(ReportKind.SUCCEEDED, group.generation)

    def wait_for(self, monitor_interval: float) -> float:
        """How long the loop sleeps before its next turn: briefly while an answer to a failure is due."""
        return ANSWER_TICK if time.monotonic() < self.answer_due else monitor_interval

    # -- reports -------------------------------------------------------------------------------

    def report_failed(self, failed: list[Worker]) -> None:
        """Tell the controller why these workers failed (a device error in a rank's output marks the device)."""
        group = self.group
        failures = tuple(group.failure(w, self.table, self.oom) for w in failed)
        for worker, failure in zip(failed, failures):
            who = f"rank {failure.rank}" if failure.rank >= 0 else "the MindSpore scheduler"
            log.warning("%s failed: %s", who, failure.describe().split(": ", 1)[1])
            if failure.level and not worker.cause and failure.rank >= 0:  # a device error in a rank's own output
                also = self.devices.on_worker_error(worker.placement.local_rank, FaultLevel(failure.level),
                                                    failure.detail)
                for local_rank in also:  # on a chip reset with the faulty one
                    self.group.fail(local_rank, "device", failure.detail)
        self.failures_told.append((group.generation, failures))  # said again to the next controller
        self._protocol().report(ReportKind.WORKER_FAILED, group.generation, failures=failures)

    def moved(self) -> None:
        """The controller moved (etcd): the running ranks' keys made in its store, their heartbeats judged
        from scratch there (each rank finds the new store on its own), and the failures since the ranks
        last started, and their success, said again."""
        ranks = [w.placement.rank for w in self.group.running]
        self._protocol().prepare_ranks(ranks)
        if self.probe is not None:
            self._protocol().store.set_text(self._protocol().keys.data_probe(self.probe_id), self.probe.endpoint)
        now = time.monotonic()
        for rank in ranks:
            self.hangs.restart(rank, 0, now)
        for generation, failures in self.failures_told:
            self._protocol().report(ReportKind.WORKER_FAILED, generation, failures=failures)
        if self.group.all_succeeded:
            # said again: the old store may have gone with it, and the new controller, which may have put
            # these ranks in a repair (their peers' node lost), would wait for them until its deadline
            self._protocol().report(ReportKind.SUCCEEDED, self.group.generation)

    # -- the keepalive -------------------------------------------------------------------------

    def keepalive(self, now: float, judge_hangs: bool) -> None:
        """What the node reads at a keepalive (the controller's counter, the commands published, its
        ranks' heartbeats and steps: one round trip), the health sources polled with the running ranks' signs
        of life (the hang check), and the node's status."""
        workers = list(self.group.workers)
        beats, steps = self._protocol().observe([w.placement.rank for w in workers], now)
        if judge_hangs:
            signs = [self._signs(w, b) for w, b in zip(workers, beats) if w.returncode is None]
            self.take(self.health.poll(now, signs), signs)
        self.publish_status(dict(zip((w.placement.rank for w in workers), steps)), now)

    def publish_status(self, steps: dict[int, int | None] | None = None, now: float | None = None) -> None:
        """This node's ranks (with ``steps``, their committed steps as read at ``now``, and their
        heartbeats' ages), standbys and devices, for the status view (with its keepalive)."""
        group = self.group
        steps = steps or {}
        now = time.monotonic() if now is None else now
        self.cpu.sample({w.placement.rank: w.pid for w in group.workers if w.returncode is None}, now)
        ranks = tuple(
            RankState(w.placement.rank, w.placement.local_rank, w.pid, w.returncode is None,
                      max(0, self._starts.get(w.placement.rank, 1) - 1), steps.get(w.placement.rank),
                      self.hangs.heartbeat_age(w.placement.rank, now) if w.placement.rank in steps else None,
                      self._times_of(w), self._collective_of(w), *self._outside_of(w, now))
            for w in group.workers
        )
        probe = self.probe
        status = NodeStatus(self.seat.agent_id, self.seat.host, group.generation, ranks, int(group.warm_ready),
                            self.devices.states(), probe.probed if probe else (), probe.unreachable if probe else (),
                            self.spare_probe if self.seat.node_rank < 0 else None)
        self._protocol().keepalive(status, now)
        top_feed = self._top_feed()
        if top_feed is not None:
            top_feed.publish(group)
        if self.snapshots is not None:
            self.snapshots.at_keepalive()

    def _times_of(self, worker: Worker) -> str:
        """The worker's step times as its heartbeat wrote them, if this process wrote them: "" else."""
        return _own(worker, self._protocol().step_times, StepTimes.from_text)

    def _outside_of(self, worker: Worker, now: float) -> tuple[float | None, int | None, float | None]:
        """What is seen of the worker from outside: its CPU share, and the last step its output said with the
        seconds since (``now``: the monotonic clock its output pumps read)."""
        cpu = self.cpu.share(worker.placement.rank) if worker.returncode is None else None
        last = worker.steps.last
        if last is None:
            return cpu, None, None
        return cpu, last[0], round(max(0.0, now - last[1]), 1)

    def _collective_of(self, worker: Worker) -> str:
        """The collective the worker waits in now as its heartbeat wrote it, if this process wrote it: "" else."""
        return _own(worker, self._protocol().collectives, read_collective)

    def started(self, workers: list[Worker]) -> None:
        """Workers just started: counted for the status, and judged for hangs from now on, against
        their heartbeat counters as they stand (one round trip)."""
        protocol = self._protocol()
        keys = protocol.keys
        ranks = [w.placement.rank for w in workers]
        beats, _ = protocol.store.readings([keys.rank_heartbeat(r) for r in ranks], [])
        for rank, count in zip(ranks, beats):
            self._starts[rank] = self._starts.get(rank, 0) + 1
            self.hangs.restart(rank, count, time.monotonic())

    # -- health ------------------------------------------------------------------------------

    def take(self, events: list[HealthEvent], signs: Sequence[RankSigns] = ()) -> None:
        """Act on what the health sources found: the ranks on a device that needs them gone are stopped
        (and reported when they end); a rank found hung (``signs``: what it was judged by) is dumped and killed."""
        for event in events:
            if event.link:
                self.report_link(event)
            elif event.device is not None:
                for local_rank in self.devices.apply(event):
                    self.group.fail(local_rank, "device", event.reason)
            elif event.rank is not None:
                beats = next((s.beats for s in signs if s.rank == event.rank), 0)
                self._stop_hung(event, uses_library=beats > 0)

    def report_link(self, event: HealthEvent) -> None:
        """A data link of the node went dark or came back: the controller decides (``ftrun.controller.links``)."""
        (log.info if event.link_up else log.error)("%s", event.reason)
        kind = ReportKind.LINK_UP if event.link_up else ReportKind.LINK_DOWN
        self._protocol().report(kind, self.group.generation, detail=event.reason)

    def start_probe(self, address: str) -> None:
        """Answer and send the data network's probe from ``address`` (this node's data address): as the node, or
        as a spare (a probe id of its own, claimed from the store's counter). A spare that takes a node's place
        keeps its probe, published under the node's rank too."""
        protocol = self._protocol()
        if self.probe is None:
            try:
                self.probe = Prober(address)
            except OSError as e:
                log.warning("the data network is not probed from this node (%s): %s", address, e)
                return
            self.probe.start()
        if self.seat.node_rank < 0 and self.spare_probe is None:
            self.spare_probe = spare_probe_id(protocol.store.add(protocol.keys.spare_probes, 1))
        protocol.store.set_text(protocol.keys.data_probe(self.probe_id), self.probe.endpoint)

    @property
    def probe_id(self) -> int:
        """This agent's place on the probe's ring: its node rank, or as a spare its own id below zero."""
        return self.seat.node_rank if self.seat.node_rank >= 0 or self.spare_probe is None else self.spare_probe

    def aim_probe(self, now: float) -> None:
        """Once a probe round: the peers on the ring (the nodes and the spares) and their listeners, read from
        the store in one round trip."""
        if self.probe is None or now < self._probe_aimed:
            return
        self._probe_aimed = now + PROBE_EVERY
        nodes = [n.node_rank for n in self.seat.layout.nodes] or list(range(self.job_nodes))
        peers = peers_to_probe(self.probe_id, probe_ring(nodes, self._spares_claimed))
        keys = self._protocol().keys
        (claimed,), endpoints = self._protocol().store.readings([keys.spare_probes], [keys.data_probe(n) for n in peers])
        self._spares_claimed = claimed
        self.probe.aim({node: endpoint for node, endpoint in zip(peers, endpoints) if endpoint})

    def _stop_hung(self, event: HealthEvent, uses_library: bool) -> None:
        worker = next((w for w in self.group.running if w.placement.rank == event.rank), None)
        if worker is None:
            return  # it ended meanwhile: its exit is reported as it is
        log.error("rank %d (pid %d) is hung: %s; dumping its stack and killing it", event.rank, worker.pid, event.reason)
        dump_stack(worker, uses_library=uses_library)
        # the source's name is the kind of fault the rank's report gives ("hang")
        self.group.fail(worker.placement.local_rank, event.source, event.reason)

    def _signs(self, worker: Worker, beats: int) -> RankSigns:
        activity, stopped = signs_of_life(worker) if self.watch_output else ((), False)
        return RankSigns(worker.placement.rank, beats, activity, stopped)


def signs_of_life(worker: Worker) -> tuple[tuple, bool]:
    """Output lines and CPU time, the signs of life of a rank without heartbeats (--hang-timeout),
    and whether its process is stopped."""
    try:
        process = psutil.Process(worker.pid)
        times, stopped = process.cpu_times(), process.status() == psutil.STATUS_STOPPED
        cpu = round(times.user + times.system, 2)
    except psutil.Error:
        cpu, stopped = -1.0, False
    return (worker.out.lines, worker.err.lines, cpu), stopped


def _own(worker: Worker, texts: dict[int, str], read: Callable[[str], object]) -> str:
    """The worker's rank's text as its heartbeat wrote it (``read`` parses it: a ``pid`` comes out), if the
    worker's own process wrote it and lives (a replaced process's last heartbeat may land on its rank's key
    after its replacement's first): "" else."""
    text = texts.get(worker.placement.rank, "")
    parsed = read(text)
    return text if worker.returncode is None and parsed is not None and getattr(parsed, "pid", None) == worker.pid else ""
