"""The node agent: joins the job, runs the node's workers, carries out the controller's commands.

The agent decides nothing about recovery: it observes (worker exits, signals,
the controller's liveness), reports, and executes commands. The policy lives in
``ftrun.controller.policy``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import psutil

from ftrun import mindspore
from ftrun.agent.control_plane import EtcdControlPlane
from ftrun.agent.devices import NodeDevices
from ftrun.agent.hang import HangWatch
from ftrun.agent.placement import NoDevice
from ftrun.agent.protocol import NodeProtocol, Wakeup, Watch
from ftrun.agent.relay import FolderRelay
from ftrun.agent.stacks import dump_stack
from ftrun.agent.top_feed import TopFeed
from ftrun.agent.workers import GenerationEnv, ProcessOps, Worker, WorkerGroup, WorkerPlacement
from ftrun.auth import Signer, new_token
from ftrun.config import LaunchConfig
from ftrun.contract import RelayFolder
from ftrun.controller.controller import Controller
from ftrun.controller.journal import Journal
from ftrun.errors import ExitCode, FtrunError
from ftrun.faults.levels import FaultLevel, FaultTable, load_fault_table
from ftrun.faults.process import OomWatch
from ftrun.folders import private_dirs, run_folder
from ftrun.interrupts import Interrupts
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, JobKeys
from ftrun.messages import Command, CommandKind, JoinRecord, NodeLayout, NodeSlot, NodeStatus, Placement, RankState, ReportKind
from ftrun.probe import probe
from ftrun.ranktable import FTRUN_TABLE, HCCL_TABLE, ftrun_table, hccl_table, load_device_ips, write_table
from ftrun.rendezvous import linger_for_readers
from ftrun.snapshots.keeper import SnapshotKeeper, ring_peers
from ftrun.snapshots.plan import RestorePlan, SnapshotInventory
from ftrun.status import StatusView
from ftrun.store import ControlStore, StoreUnavailable, bind_address, connect_store, open_control_store
from ftrun.top.attached import AttachedTop, controller_view

log = logging.getLogger(__name__)
T = TypeVar("T")
#: after this node reported a failure, how often and for how long the agent looks for the controller's
#: answer (a replacement to start) instead of once a --monitor-interval: it is on the repair's critical path
ANSWER_TICK, ANSWER_WAIT = 0.005, 1.0
#: seconds after a node's ranks were replaced that it starts new warm standbys in place of those taken
REFILL_AFTER = 5.0
#: after a Ctrl-C, how long to wait for the controller's exit command before leaving alone
INTERRUPT_GRACE = 10.0
#: after a failed rendezvous, how long the store's host waits for the other agents to read why
RENDEZVOUS_LINGER = 5.0
#: at the end of the job, how long the store's host waits for idle spares to read the EXIT
SPARE_LINGER = 5.0


@dataclass(frozen=True)
class JobOutcome:
    """How the job ended, as this agent saw it."""

    exit_code: int
    reason: str
    #: the controller, on the agent that hosted it: its view holds the job-wide summary
    controller: Controller | None


@dataclass
class Supervision:
    """Where the supervision loop stands between two turns."""

    #: when the next keepalive is due (monotonic)
    next_beat: float = 0.0
    #: when this node was interrupted (Ctrl-C, SIGTERM), or None: it then reports no more failures
    interrupted_at: float | None = None
    #: whether the node said that all its ranks succeeded (once a generation)
    reported_success: bool = False
    #: after a failure report: until then, the loop looks for the controller's answer often
    answer_due: float = 0.0


@dataclass(frozen=True)
class PendingSpawn:
    """Workers a command asked for that wait for a usable device (one is being reset)."""

    command: Command
    #: REPLACE: the local ranks still to respawn; START: every local rank
    local_ranks: tuple[int, ...]


class Agent:
    """One node's agent: store, rendezvous, then the supervision loop until the controller says exit."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.keys = JobKeys(config.run_id)
        self.host = config.local_addr or socket.gethostname()
        self.agent_id = f"{self.host}:{os.getpid()}"
        self.interrupts = Interrupts()
        self.controller: Controller | None = None
        #: --rdzv-backend etcd: this agent's candidacy and the way to the controller's store
        self.etcd: EtcdControlPlane | None = None
        #: the node's workers, once supervised
        self._group: WorkerGroup | None = None
        #: --rdzv-backend etcd: the failure reports of this node since its workers last started (generation,
        #: failures), said again to each new controller: the store may have gone before it took one, or its
        #: controller before its journal held the decision (it dies inside an etcd outage), and a repair that
        #: counts a dead rank healthy waits for it until its deadline. The controller leaves out what it knows
        self._failures_told: list[tuple] = []
        #: the live status view or progress lines, where this agent hosts the controller
        self.display: StatusView | AttachedTop | None = None
        self.store: ControlStore | None = None
        self.slot: NodeSlot | None = None
        #: this agent's place, as the rendezvous gave it
        self.placement: Placement | None = None
        self._tmp_log_dir: tempfile.TemporaryDirectory | None = None
        self.table: FaultTable | None = None
        self.devices: NodeDevices | None = None
        self.hangs = HangWatch(config.heartbeat_timeout, config.hang_timeout)
        self.oom = OomWatch()
        #: workers waiting for a device (one is being reset)
        self._pending: PendingSpawn | None = None
        #: when to make new warm standbys in place of those a repair took (0: none due)
        self._refill_at = 0.0
        #: where this node's rank tables go (its log folder)
        self._table_dir = ""
        #: --framework mindspore: the relay between the node's ranks and the control store
        self.relay: FolderRelay | None = None
        #: the run's folder under --log-dir, once made ("" without one)
        self._run_folder_path: str | None = None
        #: which agent holds which node (the rendezvous's, then the controller's after takeovers and resizes)
        self.layout = NodeLayout()
        #: global rank -> how many times this agent started its process (the status view's restarts)
        self._starts: dict[int, int] = {}
        #: the node's output and stacks for ftrun top (built once the store is open)
        self.top_feed: TopFeed | None = None
        #: the node's snapshots (--snapshot-every), and the inventory last published
        self.snapshots: SnapshotKeeper | None = None
        self._inventory: SnapshotInventory | None = None
        self._signer = Signer()
        self._token = b""
        #: peer agent id -> its snapshot server's address
        self._peer_addresses: dict[str, str] = {}
        #: every message this agent sends or reads (built once the store is open)
        self.protocol: NodeProtocol | None = None
        self._supervision = Supervision()
        #: how each of the controller's commands is carried out (``_supervise``)
        self._carry_out = {
            CommandKind.EXIT: self._carry_out_exit,
            CommandKind.TAKEOVER: self._carry_out_takeover,
            CommandKind.STOP: self._carry_out_stop,
            CommandKind.START: self._carry_out_start,
            CommandKind.REPLACE: self._carry_out_replace,
        }

    # -- signals -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        self.interrupts.install(self.config.signals_to_handle)

    def watch_session(self) -> None:
        """Started by a head node over ssh: when that session closes (end of input), stop as on SIGTERM."""

        def wait_for_end():
            try:  # the bare descriptor: a buffered reader's lock would stall the interpreter's exit
                while os.read(sys.stdin.fileno(), 4096):
                    pass
            except (OSError, ValueError):
                pass
            log.warning("the head node's ssh session closed; stopping")
            self.interrupts.request(signal.SIGTERM)

        threading.Thread(target=wait_for_end, name="ftrun-session", daemon=True).start()

    # -- run -----------------------------------------------------------------------------------

    def run(self) -> JobOutcome:
        try:
            return self._run()
        finally:
            if self.display is not None:
                self.display.stop()
            if self.protocol is not None and self.protocol.watch is not None:
                self.protocol.watch.close(self.store)

    def _run(self) -> JobOutcome:
        config = self.config
        self.table = load_fault_table(config.fault_levels or None)
        self.devices = NodeDevices.open(config, self.table)
        preflight = self._preflight() if config.preflight else ""
        # a single node makes its own token: no other agent needs it
        self._token = config.token or (b"" if config.several_nodes else new_token())
        signer = self._signer = Signer(self._token)
        journal = None
        if config.etcd is not None:
            self.etcd = EtcdControlPlane(config, self.agent_id, self.host, signer)
            found = self.etcd.find(config.rdzv_timeout, joined=False)
            self.store, journal = found.store, found.journal
        else:
            self.store = open_control_store(config.endpoint, config.is_host, config.rdzv_timeout, signer,
                                            config.store_bind, config.several_nodes, config.worker_port,
                                            config.worker_port_range)
        self._wakeup = Wakeup()
        self._connect()
        if self.store.is_host:
            if not signer.enabled:
                log.warning("control messages are not signed: anyone who reaches %s can steer this job "
                            "(give every node the same --token-file)", self.store.endpoint)
            self._start_controller(journal)
        config = self.config
        log.info("joined the store at %s%s", config.endpoint, " (hosting it and the controller)" if self.store.is_host else "")
        ips = load_device_ips(config.device_ips) if config.device_ips else {}
        host_ip = host_address(self.host)
        record = JoinRecord(self.agent_id, self.host, os.getpid(), config.nproc_per_node, config.node_rank, preflight,
                            host_ip, self.devices.records(ips.get(self.host) or ips.get(host_ip) or {}))
        try:
            self.placement, self.slot = self.protocol.join(record, config.rdzv_timeout, self.interrupts.event)
        except FtrunError:
            if self.interrupts.requested:
                return self._finish(self.interrupts.exit_code, "interrupted during the rendezvous")
            if self.store.is_host:
                linger_for_readers(self.store, self.keys, RENDEZVOUS_LINGER)
            self._stop_controller()
            raise
        ops = ProcessOps()
        group = WorkerGroup(ops, config, "", config.warm_standby)
        self.devices.start()
        try:
            if self.slot.node_rank < 0:
                ended = self._stand_by(group)
                if ended is not None:
                    return self._finish(*ended)
            log.info(
                "node %d of %d, ranks %d-%d of %d",
                self.slot.node_rank, self.placement.node_count, self.slot.first_rank,
                self.slot.first_rank + self.slot.nproc - 1, self.placement.world_size,
            )
            group.log_dir = self._table_dir = self._log_dir()
            self.relay = self._relay()
            self._start_snapshots(ops)
            # what the agent made to get here (torch's modules among it: 175,000 objects) lives as long
            # as it does; out of the collector's sight, its full collections no longer stop the agent
            # (and the controller beside it) for 30-160 ms each, in the middle of a repair
            gc.freeze()
            code, reason = self._supervise(group)
        finally:
            if self.snapshots is not None:
                self.snapshots.stop()
            self.devices.stop()
            group.stop(config.stop_timeout)
            ops.close()
        return self._finish(code, reason)

    def _relay(self) -> FolderRelay | None:
        """A MindSpore job: the relay between its ranks, which cannot read the control store, and the store."""
        if self.config.framework != "mindspore":
            return None
        folder = RelayFolder(os.path.join(self._table_dir, f"relay-node{self.slot.node_rank}"))
        return FolderRelay(lambda: self.store, self.keys, folder, lambda: self.layout.world_size,
                           repairs=self.config.recovery == "process")

    def _preflight(self) -> str:
        """This node's device problems before training, or "" (the rendezvous fails the job on any)."""
        report = probe(self.devices.backend, self.table)
        for row in report.rows:
            log.info("preflight: device %d %s %s: %s", row.status.device.index, row.status.health.value,
                     " ".join(row.status.codes) or "-", row.action)
        if report.problem:
            log.error("preflight failed on %s: %s", self.host, report.problem)
            return f"{self.host}: {report.problem}"
        return ""

    def _start_snapshots(self, ops: ProcessOps) -> None:
        """The node's snapshot memory, server and persister (--snapshot-every)."""
        options = self.config.snapshots
        if not options.enabled:
            return
        bind = bind_address(self.host, self.config.store_bind, self.config.several_nodes)

        persister: tuple[str, ...] = ()
        env = dict(os.environ)
        if self.config.framework == "mindspore":  # .ckpt files, written by a python that has mindspore
            persister, env = mindspore.persister_command(self.config.entrypoint), mindspore.with_ftrun_on_path(env)

        def spawn(argv: list[str]) -> subprocess.Popen:
            return ops.spawn(argv, env, stdin=subprocess.PIPE)

        self.snapshots = SnapshotKeeper(options, self.config.run_id, self.slot.nproc, self.host, bind, self._signer,
                                        self._token, spawn, persister)
        ops.remove_on_exit(self.snapshots.folder)
        self.snapshots.start()
        self._publish_inventory()

    def _publish_inventory(self, verify: bool = False) -> None:
        """What the node's snapshot memory holds, for the controller (only when it changed)."""
        if self.snapshots is None:
            return
        inventory = self.snapshots.inventory(self.agent_id, self.slot.node_rank, verify)
        if inventory != self._inventory:
            self.store.set(self.keys.snapshot_inventory(self.agent_id), inventory)
            self._inventory = inventory

    def _find_peers(self) -> None:
        """Where this node sends its replicas: the next nodes in node order, at their snapshot servers."""
        nodes = self.layout.nodes
        peers = []
        for node_rank in ring_peers([n.node_rank for n in nodes], self.slot.node_rank,
                                    self.config.snapshots.replicas):
            agent_id = next(n.agent_id for n in nodes if n.node_rank == node_rank)
            if agent_id not in self._peer_addresses:
                inventory = self.store.try_get(SnapshotInventory, self.keys.snapshot_inventory(agent_id))
                if inventory is None:
                    continue  # not up yet: looked for again at the next keepalive
                self._peer_addresses[agent_id] = inventory.address
            peers.append((node_rank, self._peer_addresses[agent_id]))
        self.snapshots.set_peers(peers)

    def _connect(self, watch: bool = True) -> None:
        """Talk to the control store ``self.store``: the watch of this agent's doorbell (unless not ``watch``:
        the commands are then read at each keepalive), its messages, the top feed; the workers started from
        now on are told where it is."""
        config, endpoint = self.config, self.store.endpoint
        bell = Watch(lambda: connect_store(endpoint, config.rdzv_timeout), self.keys, self.agent_id,
                     self._wakeup) if watch else None
        node_rank = self.protocol.node_rank if self.protocol is not None else -1
        self.protocol = NodeProtocol(self.store, self.keys, self.agent_id, config.node_timeout, bell)
        self.protocol.node_rank = node_rank
        self.top_feed = TopFeed(self.store, self.keys, self.agent_id)
        if endpoint != config.endpoint:  # the static rendezvous (--master-port is the workers'), or etcd's leader
            self.config = dataclasses.replace(config, endpoint=endpoint)

    def _start_controller(self, journal: Journal | None = None) -> None:
        config = self.config
        leadership = self.etcd.leadership if self.etcd is not None else None
        self.controller = Controller.for_config(self.store, config, self.agent_id, config.local_addr or config.endpoint.host,
                                                self._run_folder(), leadership, journal)
        self.controller.start()
        if self.display is None:
            self.display = controller_view(self.controller, config.status, self._token)

    def _follow(self, why: str) -> tuple[int, str] | None:
        """--rdzv-backend etcd: the control store went (its node is lost, or this agent's controller
        stepped down). Find the controller in etcd, or become it, and go on there with the workers
        untouched; how the job ended when it ended meanwhile."""
        failed = str(self.store.endpoint)
        log.warning("lost the control store at %s (%s); looking for the controller in etcd", failed, why)
        if self.controller is not None:
            # this agent's own controller went silent (its thread held up) or stepped down: it must change
            # nothing more before another takes its place, here or elsewhere (left running, it went on
            # deciding on the store the agents had left, counted every node lost and dropped the repair's
            # held replacement: issue 40)
            self.controller.retire()
        self._stop_controller()
        if self.protocol is not None and self.protocol.watch is not None:
            self.protocol.watch.close(self.store)
        found = self.etcd.find(self.config.store_timeout, joined=True, failed=failed)
        if found.ended is not None:
            return found.ended
        before, again = self.protocol, str(found.store.endpoint) == failed
        self.store = found.store
        self._connect(watch=not again)
        if again and before is not None:
            # the store given up, its controller back (stopped, and woken before another agent took its office):
            # its commands go on from where this agent was. Its doorbells are not watched: the old watch rang
            # them empty as it let go, and a new one took those for commands not yet written (its read waited
            # 5 s, and the store was given up again)
            self.protocol.next_command = before.next_command
        self.layout = NodeLayout()  # the new store's layout is read whole
        self._inventory = None  # published again in the new store
        self._peer_addresses = {}
        if found.leads:
            self._start_controller(found.journal)
        ranks = [w.placement.rank for w in self._group.running] if self._group else []
        self.protocol.prepare_ranks(ranks)
        now = time.monotonic()
        for rank in ranks:  # their heartbeats start again in the new store, once each rank finds it
            self.hangs.restart(rank, 0, now)
        for generation, failures in self._failures_told:
            self._report(ReportKind.WORKER_FAILED, generation, failures=failures)
        if self._group is not None and self._group.all_succeeded:
            # said again: the old store may have gone with it, and the new controller, which may have put
            # these ranks in a repair (their peers' node lost), would wait for them until its deadline
            self._report(ReportKind.SUCCEEDED, self._group.generation)
        log.warning("going on with the controller at %s", self.store.endpoint)
        return None

    def _stop_controller(self) -> None:
        """End this process's controller and wait for its thread (within --stop-timeout): a thread still in a
        store call of torch's as the interpreter ends aborts the process ("terminate called without an
        active exception"; seen once after a rendezvous that timed out, exit code -6 instead of 3)."""
        if self.controller is not None:
            self.controller.stop_requested.set()
            self.controller.join(self.config.stop_timeout)
            self.controller = None

    def _finish(self, code: int, reason: str) -> JobOutcome:
        if self.controller is not None:
            # the store lives in this process: keep it up until every agent has left
            self.controller.stop_requested.set()
            self.controller.join(self.config.stop_timeout + 15)
            self._wait_for_spares()
        if self.etcd is not None:
            self.etcd.leave()
        if self._tmp_log_dir is not None:
            self._tmp_log_dir.cleanup()
        return JobOutcome(code, reason, self.controller)

    def _wait_for_spares(self) -> None:
        """Idle spares are not part of the exit's acknowledgements: keep the store up until they have
        read the EXIT too (they poll every AGENT_HEARTBEAT_INTERVAL), so that they leave with the job's status
        rather than with "lost the controller"."""
        idle = len(self.controller.roster.spares)
        deadline = time.monotonic() + SPARE_LINGER
        try:
            while idle and self.store.counter(self.keys.spares_left) < idle and time.monotonic() < deadline:
                time.sleep(AGENT_HEARTBEAT_INTERVAL / 5)
        except StoreUnavailable:
            pass

    def _run_folder(self) -> str:
        """This run's folder under --log-dir, made once: the controller's event log and the node's logs
        share it (torchrun's layout: the one DIR/RUN_ID_XXXXXXXX of the run); "" without --log-dir."""
        if self._run_folder_path is None:
            config = self.config
            self._run_folder_path = run_folder(config.log_dir, config.run_id, config.log_layout) if config.log_dir else ""
        return self._run_folder_path

    def _log_dir(self) -> str:
        config = self.config
        if config.log_dir and config.log_layout == "torchrun":
            return self._run_folder()  # torchrun's: attempt_G/LOCAL_RANK/ right in the run's folder
        if config.log_dir:
            path = os.path.join(self._run_folder(), f"node{self.slot.node_rank}")
            private_dirs(path)
            return path
        if (config.redirects.default or config.redirects.per_rank or config.tee.default or config.tee.per_rank
                or config.duplicate_stdout_filters or config.duplicate_stderr_filters):
            path = tempfile.mkdtemp(prefix=f"ftrun-{config.run_id}-")  # kept: the user asked for these files
            log.info("worker logs in %s (set --log-dir to choose)", path)
            return path
        # only the workers' error files: gone with the job
        self._tmp_log_dir = tempfile.TemporaryDirectory(prefix="ftrun-")
        return self._tmp_log_dir.name

    # -- the supervision loop: observe, report, execute ----------------------------------------

    def _following(self, turns: Callable[[], T]) -> T | tuple[int, str]:
        """``turns()``; when it loses the control store under etcd, find the controller (or become it) and
        run it again there, as often as the controller moves: a loop, not a call deeper each time."""
        while True:
            try:
                return turns()
            except StoreUnavailable as e:
                if self.etcd is None:
                    return ExitCode.JOB_FAILED, f"lost the controller: {e}"
                ended = self._follow(str(e))
                if ended is not None:
                    return ended

    def _stand_by(self, group: WorkerGroup) -> tuple[int, str] | None:
        """A spare node: keep alive, keep warm standby workers, and wait to take over a lost node.
        Returns how the job ended, when it ended first."""
        return self._following(lambda: self._stand_by_turns(group))

    def _stand_by_turns(self, group: WorkerGroup) -> tuple[int, str] | None:
        log.info("standing by as a spare node (the job has %d nodes)", self.placement.node_count)
        group.fill_standbys()
        while True:
            now = time.monotonic()
            self._publish_status(group)  # the spare's keepalive
            self.protocol.observe([], now)  # the controller's keepalive, and the commands published
            if self.interrupts.requested:
                return self.interrupts.exit_code, "interrupted while standing by as a spare"
            for command in self.protocol.commands():
                if command.kind is CommandKind.EXIT:
                    self.store.add(self.keys.spares_left)  # the store's host may go now
                    return command.exit_code, command.reason
                if command.kind is CommandKind.TAKEOVER and command.agent_id == self.agent_id:
                    # the controller published the layout with this agent in it before the command
                    self.slot = dataclasses.replace(self.slot, node_rank=command.node_rank)
                    self.protocol.node_rank = command.node_rank
                    self._refresh_layout(command.layout)
                    log.warning("taking the place of node %d: %s", command.node_rank, command.reason)
                    return None
            select.select([self._wakeup], [], [], AGENT_HEARTBEAT_INTERVAL)
            self._wakeup.drain()

    def _supervise(self, group: WorkerGroup) -> tuple[int, str]:
        """The supervision loop: tend the node, report what its ranks did, carry out the controller's
        commands, wait; until a command ends it (or an interrupt that the controller does not answer)."""
        return self._following(lambda: self._supervise_turns(group))

    def _supervise_turns(self, group: WorkerGroup) -> tuple[int, str]:
        loop = self._supervision = Supervision()
        self._group = group
        while True:
            if self.controller is not None and self.controller.stepped_down.is_set():
                raise StoreUnavailable("this agent's controller stepped down: another agent leads now")
            now = time.monotonic()
            self._tend(group, now)
            if loop.interrupted_at is not None and now - loop.interrupted_at > INTERRUPT_GRACE:
                return self.interrupts.exit_code, "interrupted; the controller did not answer"
            self._report_ended(group, now)
            for command in self.protocol.commands():
                loop.answer_due = 0.0
                ended = self._carry_out[command.kind](group, command)
                if ended is not None:
                    return ended
            answer_soon = time.monotonic() < loop.answer_due
            group.wait(ANSWER_TICK if answer_soon else self.config.monitor_interval, self._wakeup)

    def _tend(self, group: WorkerGroup, now: float) -> None:
        """The node's own upkeep: the keepalive when due, device events, workers waiting for a device, warm
        standbys, and an interrupt (reported once: the controller answers it)."""
        loop = self._supervision
        if now >= loop.next_beat:
            self._keepalive(group, now, judge_hangs=loop.interrupted_at is None)
            loop.next_beat = now + AGENT_HEARTBEAT_INTERVAL
        for event in self.devices.tick(w.placement.local_rank for w in group.running):
            for local_rank in self.devices.apply(event):
                group.fail(local_rank, "device", event.reason)
        self._retry_pending(group)
        if self.relay is not None:
            self.relay.tick()
        if self._refill_at and now >= self._refill_at:
            self._refill_at = 0.0
            group.fill_standbys()
        if self.interrupts.requested and loop.interrupted_at is None:
            loop.interrupted_at = now
            group.stop_signal = self.interrupts.worker_signal
            self._report(ReportKind.INTERRUPTED, group.generation, exit_code=self.interrupts.exit_code,
                         detail=f"{self.interrupts.name} on node {self.slot.node_rank} ({self.host})")

    def _report_ended(self, group: WorkerGroup, now: float) -> None:
        """Ranks that ended since the last turn: the failed ones reported (and the controller's answer
        looked for often for a while), the node's success once a generation."""
        loop = self._supervision
        ended = group.poll()
        if not ended:
            return
        # the status the report below is read with holds the ranks' last steps
        if self.relay is not None:
            self.relay.tick()  # a MindSpore rank's, written as it ended
        self._keepalive(group, now, judge_hangs=False)
        loop.next_beat = now + AGENT_HEARTBEAT_INTERVAL
        failed = [w for w in ended if w.returncode != 0]
        if failed and loop.interrupted_at is None:
            self._report_failed(group, failed)
            loop.answer_due = now + ANSWER_WAIT
        if group.all_succeeded and not loop.reported_success:
            loop.reported_success = True
            self._report(ReportKind.SUCCEEDED, group.generation)

    # -- the controller's commands: each returns how the node's part of the job ended, or None -------

    def _carry_out_exit(self, group: WorkerGroup, command: Command) -> tuple[int, str] | None:
        self._pending = None
        group.stop(self.config.stop_timeout)
        if command.exit_code != ExitCode.OK:
            self._save_on_failure()  # an exit straight from training (a stop asked for, etcd lost for good)
        self._report(ReportKind.EXITED, command.generation)
        return command.exit_code, command.reason

    def _carry_out_takeover(self, group: WorkerGroup, command: Command) -> tuple[int, str] | None:
        if command.node_rank != self.slot.node_rank:
            return None  # another node's place, given to a spare
        # this node was declared lost (silent past --node-timeout) and handed to a spare
        group.stop(self.config.stop_timeout)
        return ExitCode.JOB_FAILED, (f"this node was declared lost and node {self.slot.node_rank} "
                                     f"given to a spare ({command.reason}); leaving")

    def _carry_out_stop(self, group: WorkerGroup, command: Command) -> tuple[int, str] | None:
        self._pending = None
        log.warning("stopping generation %d: %s", command.generation, command.reason)
        # ranks that failed on their own before this stop, or as it came
        failed = [w for w in group.poll() if w.returncode != 0]
        # the restart's ranks take warm interpreters that import torch while this one stops
        group.fill_standbys(at_least=self.slot.nproc)
        failed += group.stop(self.config.stop_timeout, keep_standbys=True)
        if failed and self._supervision.interrupted_at is None:
            self._report_failed(group, failed)
        self._snapshots_after_stop()
        self.protocol.acknowledge_stop(command.generation)
        return None

    def _carry_out_start(self, group: WorkerGroup, command: Command) -> tuple[int, str] | None:
        self._supervision.reported_success = False
        self._failures_told.clear()  # every rank starts anew: what failed before concerns no repair
        if not self._refresh_layout(command.layout):
            group.stop(self.config.stop_timeout)
            return ExitCode.JOB_FAILED, f"node {self.slot.node_rank} was declared lost and left out of the job; leaving"
        if command.generation > 0:
            log.warning("restarting workers as generation %d (restart %d of %d)", command.generation,
                        command.restart_count, command.max_restarts)
        self._start_workers(group, command)
        return None

    def _carry_out_replace(self, group: WorkerGroup, command: Command) -> tuple[int, str] | None:
        self._supervision.reported_success = False
        self._replace_ranks(group, command)
        return None

    def _report_failed(self, group: WorkerGroup, failed: list[Worker]) -> None:
        failures = tuple(group.failure(w, self.table, self.oom) for w in failed)
        for worker, failure in zip(failed, failures):
            who = f"rank {failure.rank}" if failure.rank >= 0 else "the MindSpore scheduler"
            log.warning("%s failed: %s", who, failure.describe().split(": ", 1)[1])
            if failure.level and not worker.cause and failure.rank >= 0:  # a device error in a rank's own output
                self.devices.on_worker_error(worker.placement.local_rank, FaultLevel(failure.level), failure.detail)
        self._failures_told.append((group.generation, failures))  # said again to the next controller
        self._report(ReportKind.WORKER_FAILED, group.generation, failures=failures)

    def _keepalive(self, group: WorkerGroup, now: float, judge_hangs: bool) -> None:
        """What the node reads at a keepalive (the controller's counter, the commands published, its
        ranks' heartbeats and steps: one round trip), the hang check, and the node's status."""
        workers = list(group.workers)
        beats, steps = self.protocol.observe([w.placement.rank for w in workers], now)
        if judge_hangs:
            running = [(w, b) for w, b in zip(workers, beats) if w.returncode is None]
            self._check_hangs(group, [w for w, _ in running], [b for _, b in running], now)
        self._publish_status(group, dict(zip((w.placement.rank for w in workers), steps)), now)

    def _publish_status(self, group: WorkerGroup, steps: dict[int, int | None] | None = None,
                        now: float | None = None) -> None:
        """This node's ranks (with ``steps``, their committed steps as read at ``now``, and their
        heartbeats' ages), standbys and devices, for the status view (with its keepalive)."""
        steps = steps or {}
        now = time.monotonic() if now is None else now
        ranks = tuple(
            RankState(w.placement.rank, w.placement.local_rank, w.pid, w.returncode is None,
                      max(0, self._starts.get(w.placement.rank, 1) - 1), steps.get(w.placement.rank),
                      self.hangs.heartbeat_age(w.placement.rank, now) if w.placement.rank in steps else None)
            for w in group.workers
        )
        standbys = sum(1 for p in group.standbys if p.poll() is None)
        status = NodeStatus(self.agent_id, self.host, group.generation, ranks, standbys, self.devices.states())
        self.protocol.keepalive(status, now)
        self.top_feed.publish(group)
        if self.snapshots is not None and self.slot.node_rank >= 0:
            self._publish_inventory()
            self._find_peers()

    def _started(self, workers: list[Worker]) -> None:
        """Workers just started: counted for the status, and judged for hangs from now on, against
        their heartbeat counters as they stand (read in one round trip)."""
        ranks = [w.placement.rank for w in workers]
        for rank, beats in zip(ranks, self.store.counters([self.keys.rank_heartbeat(r) for r in ranks])):
            self._starts[rank] = self._starts.get(rank, 0) + 1
            self.hangs.restart(rank, beats, time.monotonic())

    def _placement(self, local_rank: int, device_env=(), cpus: tuple[int, ...] = ()) -> WorkerPlacement:
        group_rank = next(i for i, n in enumerate(self.layout.nodes) if n.node_rank == self.slot.node_rank)
        return WorkerPlacement(local_rank, self.slot.first_rank + local_rank, group_rank, self.host, device_env,
                               cpus)

    def _refresh_layout(self, published: int) -> bool:
        """Read who holds which node now (before a generation starts), unless this agent holds the
        layout a command said (``published``); False when this agent holds none any more (it was
        declared lost and left out, or replaced)."""
        self.layout = self.protocol.layout(published)
        mine = next((n for n in self.layout.nodes if n.node_rank == self.slot.node_rank), None)
        if mine is None or mine.agent_id != self.agent_id:
            return False
        if 0 <= self.slot.first_rank != mine.first_rank:  # renumbered (a spare taking over held none)
            log.warning("node %d now holds ranks %d-%d of %d", self.slot.node_rank, mine.first_rank,
                        mine.first_rank + mine.nproc - 1, self.layout.world_size)
        self.slot = dataclasses.replace(self.slot, first_rank=mine.first_rank)
        return True

    def _start_workers(self, group: WorkerGroup, command: Command) -> None:
        try:
            assigned = self.devices.assign(self.slot.nproc)
        except NoDevice as e:
            self._wait_for_device(command, tuple(range(self.slot.nproc)), e)
            return
        cpus = self.devices.binding()
        placements = [self._placement(i, self.devices.env(assigned.get(i)), cpus.get(i, ()))
                      for i in range(self.slot.nproc)]
        self._pending = None
        self.protocol.prepare_ranks([p.rank for p in placements])
        gen = self._generation_env(command)
        if command.scheduler and self.controller is not None and group.scheduler is None:
            group.start_scheduler(gen, self.slot.node_rank, self.host)  # beside the worker store, as msrun's
        group.start(placements, gen)
        self._started(group.workers)
        group.fill_standbys()

    def _respawn(self, group: WorkerGroup, command: Command, local_ranks: tuple[int, ...]) -> None:
        """Process level (repair): start replacements for these local ranks, on usable devices."""
        gen = self._generation_env(command, replacement=True)
        for done, local_rank in enumerate(local_ranks):
            try:
                device = self.devices.device_for_respawn(local_rank)
            except NoDevice as e:
                self._wait_for_device(command, local_ranks[done:], e)
                return
            cpus = self.devices.binding().get(local_rank, ())
            group.respawn(self._placement(local_rank, self.devices.env(device), cpus), gen)
            self._started([group.workers[local_rank]])
        self._pending = None
        # the standbys taken are made again once the repair is over: a new one's torch import would
        # compete for the CPU with the ranks' repair and their first steps
        self._refill_at = time.monotonic() + REFILL_AFTER

    def _wait_for_device(self, command: Command, local_ranks: tuple[int, ...], problem: NoDevice) -> None:
        """No usable device now: wait for a reset under way (the repair deadline bounds it), else the
        node cannot run its ranks (a node-level fault)."""
        if not self.devices.resetting:
            self._pending = None
            self._report(ReportKind.NODE_UNUSABLE, command.generation, detail=str(problem))
            return
        if self._pending is None or self._pending.local_ranks != local_ranks:
            log.warning("local rank%s %s wait%s for a device reset", "s" if len(local_ranks) > 1 else "",
                        ", ".join(map(str, local_ranks)), "" if len(local_ranks) > 1 else "s")
        self._pending = PendingSpawn(command, local_ranks)

    def _retry_pending(self, group: WorkerGroup) -> None:
        pending = self._pending
        if pending is None:
            return
        if pending.command.kind is CommandKind.START:
            self._start_workers(group, pending.command)
        else:
            self._respawn(group, pending.command, pending.local_ranks)

    def _check_hangs(self, group: WorkerGroup, running: list[Worker], all_beats: list[int], now: float) -> None:
        """A rank that stopped showing signs of life (``all_beats``: the heartbeat counters of the
        ``running`` ranks): its stack is dumped, then it is killed and reported."""
        for worker, beats in zip(running, all_beats):
            rank = worker.placement.rank
            activity, stopped = self._activity(worker)
            reason = self.hangs.observe(rank, beats, activity, now, stopped)
            if reason:
                log.error("rank %d (pid %d) is hung: %s; dumping its stack and killing it", rank, worker.pid, reason)
                dump_stack(worker, uses_library=beats > 0)
                group.fail(worker.placement.local_rank, "hang", reason)
                self.hangs.forget(rank)

    def _activity(self, worker: Worker) -> tuple[tuple, bool]:
        """Output lines and CPU time, the signs of life of a rank without heartbeats (--hang-timeout),
        and whether its process is stopped."""
        if not self.config.hang_timeout:
            return (), False
        try:
            process = psutil.Process(worker.pid)
            times, stopped = process.cpu_times(), process.status() == psutil.STATUS_STOPPED
            cpu = round(times.user + times.system, 2)
        except psutil.Error:
            cpu, stopped = -1.0, False
        return (worker.out.lines, worker.err.lines, cpu), stopped

    def _replace_ranks(self, group: WorkerGroup, command: Command) -> None:
        """Process level: reap the failed local ranks (env clear), say so, respawn them (repair)."""
        self._refresh_layout(command.layout)  # a spare may hold a node now (global ranks never move at process level)
        self._save_on_failure()  # every node's: the healthy ranks' newest snapshots stay put until they resume
        mine = [r - self.slot.first_rank for r in command.ranks if 0 <= r - self.slot.first_rank < self.slot.nproc]
        if self._pending is not None and self._pending.command.kind is CommandKind.REPLACE:
            mine = sorted(set(mine) | set(self._pending.local_ranks))  # still waiting from the repair before
        if not mine:
            if command.ranks:
                log.info("generation %d: rank%s %s replaced on another node; this node's ranks stay and repair in place",
                         command.generation, "s" if len(command.ranks) > 1 else "", ", ".join(map(str, command.ranks)))
            else:
                log.debug("generation %d: an online repair; every rank stays and repairs in place", command.generation)
            group.generation = command.generation
            self._rank_tables(command.generation)  # the new generation's table (a spare may hold a node now)
            return
        log.warning("replacing rank%s %s for generation %d", "s" if len(mine) > 1 else "",
                    ", ".join(str(self.slot.first_rank + i) for i in mine), command.generation)
        for local_rank in mine:
            group.clear(local_rank, self.config.stop_timeout)
        self._publish_inventory(verify=True)
        self._report(ReportKind.CLEARED, command.generation)
        self._respawn(group, command, tuple(mine))

    def _snapshots_after_stop(self) -> None:
        """Ranks stopped: their snapshots are final. Check each one's sum, so that the controller's
        restore skips a damaged one, and (--save-on-failure) write them to disk."""
        self._publish_inventory(verify=True)
        self._save_on_failure()

    def _save_on_failure(self) -> None:
        if self.snapshots is not None and self.config.snapshots.save_on_failure:
            self.snapshots.save_newest()

    def _rank_tables(self, generation: int) -> tuple[tuple[str, str], ...]:
        """Write this generation's rank tables (from the controller's layout); their variables."""
        table = ftrun_table(self.config.run_id, generation, self.layout.nodes, self.slot.node_rank,
                            self.devices.assigned)
        folder = self._table_dir
        tables = [("FTRUN_RANKTABLE", write_table(folder, FTRUN_TABLE, table))]
        if self.devices.backend.kind == "npu" and self.devices.allocator is not None:
            try:
                tables.append(("RANK_TABLE_FILE", write_table(folder, HCCL_TABLE, hccl_table(table))))
            except ValueError as e:
                log.warning("no HCCL rank table for generation %d: %s", generation, e)
        return tuple(tables)

    def _generation_env(self, command: Command, replacement: bool = False) -> GenerationEnv:
        host, _, port = command.worker_store.rpartition(":")
        return GenerationEnv(
            generation=command.generation,
            restart_count=command.restart_count,
            world_size=self.layout.world_size,
            node_count=len(self.layout.nodes),
            master_addr=host,
            master_port=int(port),
            control_store=str(self.config.endpoint),
            max_restarts=command.max_restarts,
            replacement=replacement,
            rank_tables=self._rank_tables(command.generation),
            previous_world_size=command.previous_world_size,
            snapshot_env=tuple(self.snapshots.worker_env(self._left_plan(command)).items()) if self.snapshots else (),
            control_store_file=self.etcd.store_file if self.etcd is not None else "",
            scheduler=command.scheduler,
            relay_dir=self.relay.folder.path if self.relay is not None else "",
        )

    def _left_plan(self, command: Command) -> str:
        """A MindSpore job's ranks cannot read the control store (their python has no torch): the node's
        restore plan of a restarted generation goes to a file beside their snapshots. "": none."""
        if not command.scheduler or command.generation <= 0 or self.snapshots is None:
            return ""
        plan = self.store.try_get(RestorePlan, self.keys.restore_plan(command.generation, self.slot.node_rank))
        return self.snapshots.leave_plan(command.generation, plan) if plan is not None else ""

    def _report(self, kind: ReportKind, generation: int, **fields) -> None:
        self.protocol.report(kind, generation, **fields)


def host_address(host: str) -> str:
    """``host``'s IPv4 address (the HCCL rank table's server_id), or "" when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""
