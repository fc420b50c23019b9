"""The node agent: joins the job, runs the node's workers, carries out the controller's commands.

The agent decides nothing about recovery: it observes (worker exits, signals, the controller's liveness),
reports, and executes commands; the policy lives in ``ftrun.controller.policy``. It is one loop
(``Agent._supervise_turns``) over parts that are each tested alone:

* ``connection.py``: the control store, the node's messages over it, the controller where this agent
  hosts it, and under etcd the controller followed as it moves;
* ``seat.py``: where the node sits in the job (its slot, the controller's layout);
* ``supervision.py``: what the node sees and reports (keepalive and status, what its health sources find,
  ranks that ended, an interrupt), the sources themselves being ``ftrun.detection``'s;
* ``commands.py``: the controller's commands carried out, with ``spawner.py`` starting workers on usable
  devices in ``generations.py``'s environment;
* ``node_snapshots.py`` and ``relay.py``: the node's snapshots, its MindSpore ranks' relay.
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ftrun.agent.commands import CommandExecutor
from ftrun.agent.connection import ControlConnection
from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.generations import GenerationEnvs
from ftrun.agent.log_folders import LogFolders
from ftrun.agent.node_snapshots import NodeSnapshots
from ftrun.agent.relay import FolderRelay
from ftrun.agent.seat import Seat
from ftrun.agent.spawner import Spawner
from ftrun.agent.supervision import Supervision
from ftrun.agent.workers import ProcessOps, WorkerGroup
from ftrun.auth import new_token
from ftrun.config import LaunchConfig
from ftrun.contract import RelayFolder
from ftrun.controller.controller import Controller
from ftrun.detection.hang import HangWatch
from ftrun.detection.links import data_interfaces, interface_watch
from ftrun.detection.oom import OomWatch
from ftrun.detection.pairs import PairCheck
from ftrun.detection.preflight import MATMUL_SIZE, matmul_times
from ftrun.detection.probe import probe
from ftrun.detection.reach import interface_address
from ftrun.detection.sources import NodeHealth
from ftrun.detection.table import FaultTable, load_fault_table
from ftrun.errors import ExitCode, FtrunError
from ftrun.interrupts import Interrupts
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, JobKeys
from ftrun.messages import CommandKind, JoinRecord
from ftrun.orphans import on_session_end
from ftrun.ranktable import load_device_ips
from ftrun.rendezvous import linger_for_readers
from ftrun.store import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
#: after a failed rendezvous, how long the store's host waits for the other agents to read why
RENDEZVOUS_LINGER = 5.0


@dataclass(frozen=True)
class JobOutcome:
    """How the job ended, as this agent saw it."""

    exit_code: int
    reason: str
    #: the controller, on the agent that hosted it: its view holds the job-wide summary
    controller: Controller | None


class Agent:
    """One node's agent: store, rendezvous, then the supervision loop until the controller says exit."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.keys = JobKeys(config.run_id)
        self.host = config.local_addr or socket.gethostname()
        self.agent_id = f"{self.host}:{os.getpid()}"
        self.interrupts = Interrupts()
        self.folders = LogFolders(config)
        self.connection = ControlConnection(config, self.agent_id, self.host, self.folders.run_folder)
        #: the node's parts, made once it has its place (``_run``, ``_take_node``)
        self.devices: NodeDevices | None = None
        self.seat: Seat | None = None
        self.supervision: Supervision | None = None
        self.commands: CommandExecutor | None = None
        self.snapshots: NodeSnapshots | None = None

    # -- signals -----------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        self.interrupts.install(self.config.signals_to_handle)

    def watch_session(self) -> None:
        """Started by a head node over ssh: when that session closes (end of input), stop as on SIGTERM."""

        def stop():
            log.warning("the head node's ssh session closed; stopping")
            self.interrupts.request(signal.SIGTERM)

        on_session_end(stop)

    # -- run -----------------------------------------------------------------------------------

    def run(self) -> JobOutcome:
        # the orphan guardian first: it removes the agent's folders if the agent is SIGKILLed from here on
        ops = ProcessOps()
        group = WorkerGroup(ops, self.config, "", self.config.warm_standby)
        group.keep_warm()  # the warm interpreter imports torch while the node joins
        try:
            return self._run(ops, group)
        finally:
            group.stop(self.config.stop_timeout)  # stopped already, unless the join failed: the warm interpreter
            self.connection.close()
            self.folders.cleanup()  # whatever ended the run: the folders this agent made go with it
            ops.close()

    def _run(self, ops: ProcessOps, group: WorkerGroup) -> JobOutcome:
        config, connection = self.config, self.connection
        table = load_fault_table(config.fault_levels or None)
        self.devices = NodeDevices.open(config, table)
        preflight = self._preflight(table) if config.preflight else ""
        speed = self._preflight_speed() if config.preflight and config.framework == "torch" else 0.0
        # a single node makes its own token: no other agent needs it
        connection.open(config.token or (b"" if config.several_nodes else new_token()), ops.remove_on_exit)
        hosting = " (hosting it and the controller)" if connection.store.is_host else ""
        log.info("joined the store at %s%s", connection.endpoint, hosting)
        ips = load_device_ips(config.device_ips) if config.device_ips else {}
        host_ip = host_address(self.host)
        pairs = self._pair_check(host_ip) if config.preflight and config.several_nodes else None
        record = JoinRecord(self.agent_id, self.host, os.getpid(), config.nproc_per_node, config.node_rank, preflight,
                            host_ip, self.devices.records(ips.get(self.host) or ips.get(host_ip) or {}), speed,
                            pairs.endpoint if pairs is not None else "")
        try:
            placement, slot = connection.protocol.join(record, config.rdzv_timeout, self.interrupts.event, pairs)
        except FtrunError:
            if self.interrupts.requested:
                return self._finish(self.interrupts.exit_code, "interrupted during the rendezvous")
            if connection.store.is_host:
                linger_for_readers(connection.store, self.keys, RENDEZVOUS_LINGER)
            connection.stop_controller()
            raise
        finally:
            if pairs is not None:
                pairs.close()
        self.seat = seat = Seat(self.agent_id, self.host, slot)
        hangs = HangWatch(config.heartbeat_timeout, config.hang_timeout)
        links = interface_watch(os.environ)  # the collectives' interface (GLOO_SOCKET_IFNAME, ...)
        health = NodeHealth([hangs, *self.devices.sources(), *([links] if links else [])])
        self.supervision = Supervision(group, seat, self.devices, lambda: connection.protocol,
                                       lambda: connection.top_feed, health, hangs, self.interrupts, table, OomWatch(),
                                       watch_output=bool(config.hang_timeout))
        health.start()
        try:
            if seat.node_rank < 0:
                ended = self._stand_by(group, placement.node_count)
                if ended is not None:
                    return self._finish(*ended)
            log.info("node %d of %d, ranks %d-%d of %d", seat.node_rank, placement.node_count, seat.first_rank,
                     seat.first_rank + seat.nproc - 1, placement.world_size)
            self._take_node(group, ops)
            # what the agent made to get here (torch's modules among it: 175,000 objects) lives as long
            # as it does; out of the collector's sight, its full collections no longer stop the agent
            # (and the controller beside it) for 30-160 ms each, in the middle of a repair
            gc.freeze()
            code, reason = self._supervise(group)
        finally:
            if self.snapshots is not None:
                self.snapshots.stop()
            if self.supervision.probe is not None:
                self.supervision.probe.stop()
            health.stop()
            group.stop(config.stop_timeout)
        return self._finish(code, reason)

    def _take_node(self, group: WorkerGroup, ops: ProcessOps) -> None:
        """The parts of a node that holds ranks: its folder, its MindSpore relay, its snapshots, the
        start of its workers and the carrying out of the controller's commands."""
        config, seat, connection, supervision = self.config, self.seat, self.connection, self.supervision
        group.log_dir = folder = self.folders.node_folder(seat.node_rank)
        if folder == self.folders.temporary:
            ops.remove_on_exit(folder)
        relay = self._relay(folder)
        self.snapshots = NodeSnapshots.start(config, seat, lambda: connection.store, connection.signer,
                                             connection.token, ops)
        envs = GenerationEnvs(config.run_id, seat, self.devices, folder, lambda: connection.endpoint,
                              connection.etcd.store_file if connection.etcd is not None else "", self.snapshots,
                              relay.folder.path if relay is not None else "")
        spawner = Spawner(group, seat, self.devices, envs, lambda: connection.protocol, supervision.started,
                          hosts_worker_store=lambda: connection.controller is not None)
        supervision.snapshots, supervision.relay, supervision.spawner = self.snapshots, relay, spawner
        self.commands = CommandExecutor(group, seat, spawner, supervision, lambda: connection.protocol,
                                        config.stop_timeout, self.snapshots)
        self._probe_data_network()

    def _probe_data_network(self) -> None:
        """The data network's probe, from the collectives' interface (``ftrun.detection.reach``), where it has an
        address: a node's, or a spare's (a third vantage point; it keeps its probe when it takes a node's place)."""
        address = next(filter(None, (interface_address(name) for name in data_interfaces(os.environ))), "")
        if address:
            self.supervision.start_probe(address)

    def _relay(self, folder: str) -> FolderRelay | None:
        """A MindSpore job: the relay between its ranks, which cannot read the control store, and the store."""
        if self.config.framework != "mindspore":
            return None
        connection, seat = self.connection, self.seat
        return FolderRelay(lambda: connection.store, self.keys, RelayFolder(os.path.join(folder, f"relay-node{seat.node_rank}")),
                           lambda: seat.layout.world_size, repairs=self.config.recovery == "process")

    def _preflight(self, table: FaultTable) -> str:
        """This node's device problems before training, or "" (the rendezvous fails the job on any)."""
        report = probe(self.devices.backend, table)
        for row in report.rows:
            log.info("preflight: device %d %s %s: %s", row.reading.device.index, row.reading.health.value,
                     " ".join(row.reading.codes) or "-", row.action)
        if report.problem:
            log.error("preflight failed on %s: %s", self.host, report.problem)
            return f"{self.host}: {report.problem}"
        return ""

    @staticmethod
    def _pair_check(host_ip: str) -> PairCheck | None:
        """--preflight's listener for the data network's bandwidth check, on the collectives' interface (the
        host's address when no variable names one), or None when it cannot listen (one warning)."""
        address = next(filter(None, (interface_address(name) for name in data_interfaces(os.environ))), host_ip)
        try:
            return PairCheck(address)
        except OSError as e:
            log.warning("preflight: no bandwidth check on the data network: cannot listen on %s: %s", address, e)
            return None

    def _preflight_speed(self) -> float:
        """This node's slowest device's time for a small matmul (the rendezvous leaves a node past twice the
        median out), or 0 when it could not be measured."""
        kind = self.devices.backend.kind
        times = matmul_times(kind, 1 if kind == "cpu" else self.config.nproc_per_node)
        if times:
            log.info("preflight: a %dx%d matmul takes %s ms on this node's %s devices", MATMUL_SIZE, MATMUL_SIZE,
                     ", ".join(f"{t * 1000:.1f}" for t in times), kind)
        return max(times, default=0.0)

    def _finish(self, code: int, reason: str) -> JobOutcome:
        controller = self.connection.finish()
        self.folders.cleanup()
        return JobOutcome(code, reason, controller)

    # -- the loops: observe, report, execute; followed to wherever the controller moves -----------

    def _following(self, turns: Callable[[], T]) -> T | tuple[int, str]:
        """``turns()``; when it loses the control store under etcd, find the controller (or become it) and
        run it again there, as often as the controller moves: a loop, not a call deeper each time."""
        while True:
            try:
                return turns()
            except StoreUnavailable as e:
                if self.connection.etcd is None:
                    return ExitCode.JOB_FAILED, f"lost the controller: {e}"
                ended = self.connection.follow(str(e))
                if ended is not None:
                    return ended
                self._moved()

    def _moved(self) -> None:
        """The controller moved: what the node keeps in the control store is made again in the new one."""
        self.seat.forget_layout()
        if self.snapshots is not None:
            self.snapshots.moved()
        self.supervision.moved()
        log.warning("going on with the controller at %s", self.connection.store.endpoint)

    def _stand_by(self, group: WorkerGroup, node_count: int) -> tuple[int, str] | None:
        """A spare node: keep alive, keep its warm interpreter, and wait to take over a lost node.
        Returns how the job ended, when it ended first."""
        return self._following(lambda: self._stand_by_turns(group, node_count))

    def _stand_by_turns(self, group: WorkerGroup, node_count: int) -> tuple[int, str] | None:
        log.info("standing by as a spare node (the job has %d nodes)", node_count)
        connection, seat = self.connection, self.seat
        self.supervision.job_nodes = node_count
        self._probe_data_network()
        while True:
            now = time.monotonic()
            self.supervision.aim_probe(now)
            self.supervision.publish_status()  # the spare's keepalive
            protocol = connection.protocol
            protocol.observe([], now)  # the controller's keepalive, and the commands published
            if self.interrupts.requested:
                return self.interrupts.exit_code, "interrupted while standing by as a spare"
            for command in protocol.commands():
                if command.kind is CommandKind.EXIT:
                    connection.store.add(self.keys.spares_left)  # the store's host may go now
                    return command.exit_code, command.reason
                if command.kind is CommandKind.TAKEOVER and command.agent_id == self.agent_id:
                    # the controller published the layout with this agent in it before the command
                    seat.take(command.node_rank)
                    protocol.node_rank = command.node_rank
                    seat.update(protocol.layout(command.layout))
                    log.warning("taking the place of node %d: %s", command.node_rank, command.reason)
                    return None
            select.select([connection.wakeup], [], [], AGENT_HEARTBEAT_INTERVAL)
            connection.wakeup.drain()

    def _supervise(self, group: WorkerGroup) -> tuple[int, str]:
        return self._following(lambda: self._supervise_turns(group))

    def _supervise_turns(self, group: WorkerGroup) -> tuple[int, str]:
        """The supervision loop: tend the node, report what its ranks did, carry out the controller's
        commands, wait; until a command ends it (or an interrupt that the controller does not answer)."""
        connection, supervision = self.connection, self.supervision
        supervision.begin()
        while True:
            if connection.stepped_down:
                raise StoreUnavailable("this agent's controller stepped down: another agent leads now")
            now = time.monotonic()
            supervision.tend(now)
            if supervision.unanswered(now):
                return self.interrupts.exit_code, "interrupted; the controller did not answer"
            supervision.report_ended(now)
            for command in connection.protocol.commands():
                supervision.answer_due = 0.0
                ended = self.commands.carry_out(command)
                if ended is not None:
                    return ended
            group.wait(supervision.wait_for(self.config.monitor_interval), connection.wakeup)


def host_address(host: str) -> str:
    """``host``'s IPv4 address (the HCCL rank table's server_id), or "" when it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""
