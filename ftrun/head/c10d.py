"""SSH mode under the c10d store: one command on a head node runs the whole job.

The head node hosts the control store and the controller, and starts one agent per host over ssh
(``ftrun.head.sessions``). Each remote agent runs until the controller tells it to exit, or until its ssh
session closes (end of input): so Ctrl-C on the head, the head dying, or a cut connection all stop every
remote worker. The store does not live on any worker node, so losing a node never takes the controller
with it; losing the head ends the job (said at every launch: :data:`HEAD_IS_SINGLE`).

Under ``--rdzv-backend etcd`` (``ftrun.head.etcd``) the controller runs in an agent elected through etcd,
the agents outlive their sessions (``ftrun.head.session_keeper``), and the head only starts and follows them.
"""

from __future__ import annotations

import logging
import socket
import time

from ftrun.auth import Signer, new_token
from ftrun.config import DEFAULT_RDZV_PORT, Endpoint, LaunchConfig, parse_endpoint
from ftrun.controller.controller import Controller, controller_for
from ftrun.errors import ExitCode, FtrunError, UsageError
from ftrun.folders import run_folder
from ftrun.head.hosts import Host
from ftrun.head.sessions import SESSION_GRACE, WATCH_INTERVAL, HeadOutcome, RemoteAgent, Session, agent_exit_code, end_sessions
from ftrun.interrupts import Interrupts
from ftrun.live_view import StatusView
from ftrun.ports import PortRange, free_port
from ftrun.store import ControlStore, host_store, is_local_host
from ftrun.top_view.attached import AttachedTop, controller_view

log = logging.getLogger(__name__)

#: said at every SSH launch: what losing the head costs, and the way that avoids it
HEAD_IS_SINGLE = ("this head node holds the job: losing it (its terminal closed, its ssh sessions cut, its machine) "
                  "stops every agent; a job that must outlive any one machine gives --rdzv-backend etcd, and its "
                  "controller runs on a node (docs/high-availability.md)")


def store_endpoint(hosts: list[Host], rdzv_endpoint: str, rdzv_host: str, local_addr: str,
                   ports: PortRange | None = None) -> Endpoint:
    """Where the head node hosts the store, as the agents reach it (a port of ``ports`` when no
    endpoint names one)."""
    if rdzv_endpoint:
        endpoint = parse_endpoint(rdzv_endpoint, DEFAULT_RDZV_PORT)
        if not is_local_host(endpoint.host):
            raise UsageError(f"--rdzv-endpoint {rdzv_endpoint}: with --hostfile the store runs on this head node, "
                             "so the endpoint must name it")
        return endpoint
    host = rdzv_host or local_addr or route_address([h.address for h in hosts])
    return Endpoint(host, free_port(ports, ""))


def route_address(hosts: list[str]) -> str:
    """This head node's address as the hosts see it: the source address of the route to the first
    one that resolves (loopback when every host is this machine)."""
    if all(h == "localhost" or h.startswith("127.") for h in hosts):
        return "127.0.0.1"
    for host in hosts:
        try:
            family, _, _, _, address = socket.getaddrinfo(host, 22, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(address)  # no packet is sent: this only picks the route
                return s.getsockname()[0]
        except OSError:
            continue  # an ssh-config alias or a host not up yet: try the next
    return socket.getfqdn()


class Head:
    """Hosts the store and the controller, runs one ssh session per host, watches them."""

    def __init__(self, config: LaunchConfig, agents: list[RemoteAgent]):
        self.config = config
        self.agents = agents
        #: the run's folder under --log-dir (ftrun.folders.run_folder): each host's output and the event log
        self.log_dir = ""
        self.interrupts = Interrupts()
        self.sessions: list[Session] = []
        self.controller: Controller | None = None
        self.display: StatusView | AttachedTop | None = None
        #: the job's secret: the user's --token-file, else one made for this job
        self.token = config.token or new_token()

    def install_signal_handlers(self) -> None:
        self.interrupts.install()

    def run(self) -> HeadOutcome:
        config = self.config
        if config.log_dir:
            self.log_dir = run_folder(config.log_dir, config.run_id, config.log_layout)
        log.info("starting %d agent%s over ssh; the store and the controller on %s", len(self.agents),
                 "s" if len(self.agents) != 1 else "", config.endpoint)
        log.info(HEAD_IS_SINGLE)
        hurry = False
        try:
            # the sessions first: the hosts start their Python while this one starts the store
            # (the agents retry the store until --rdzv-timeout)
            for agent in self.agents:
                self.sessions.append(Session(agent, self.log_dir, b"ftrun" if self.log_dir else b"", self.token))
            self.controller = self._start_controller()
            code, reason = self._watch()
        except KeyboardInterrupt:
            code, reason, hurry = ExitCode.INTERRUPTED, "interrupted", True
        except FtrunError:
            hurry = True
            raise
        finally:
            self._end_sessions(hurry)
            if self.controller is not None:
                self.controller.stop_requested.set()
                self.controller.join(config.stop_timeout + 5)
            if self.display is not None:
                self.display.stop()
        if self.controller.view is None and code != ExitCode.OK:
            raise FtrunError(reason, ExitCode(code))  # the job never started: one error line, as an agent would say it
        return HeadOutcome(code, reason, self.controller)

    def _start_controller(self) -> Controller:
        config = self.config
        server = host_store(config.endpoint, config.store_bind)
        if server is None:
            raise UsageError(f"port {config.endpoint.port} on this head node is already in use by another program")
        store = ControlStore(server, config.endpoint, is_host=True, signer=Signer(self.token))
        controller = controller_for(store, config, "", config.endpoint.host, self.log_dir)
        controller.start()
        self.display = controller_view(controller, config.status, self.token)
        return controller

    def _watch(self) -> tuple[int, str]:
        controller = self.controller
        stopped_at = None
        while controller.running:
            if self.interrupts.requested and stopped_at is None:
                stopped_at = time.monotonic()
                log.warning("%s: stopping every agent", self.interrupts.name)
                controller.stop_job(self.interrupts.exit_code, f"{self.interrupts.name} on the head node")
            if stopped_at is not None and time.monotonic() - stopped_at > self.config.stop_timeout + SESSION_GRACE:
                return ExitCode.INTERRUPTED, "interrupted; the agents did not all stop in time"
            for session in self.sessions:
                if session.handled or session.proc.poll() is None:
                    continue
                session.handled = True
                why = session.why()
                if controller.rendezvous_result is None:
                    controller.stop_requested.set()
                    return agent_exit_code(session.proc.returncode), why
                controller.host_gone(session.agent.host.address, why)
            time.sleep(WATCH_INTERVAL)
        if controller.view is not None:
            return controller.view.exit_code, controller.view.reason
        if self.interrupts.requested:
            return self.interrupts.exit_code, "interrupted during the rendezvous"
        result = controller.rendezvous_result
        if result is not None and result.error:
            return result.exit_code or ExitCode.RENDEZVOUS, result.error
        return ExitCode.JOB_FAILED, "the controller stopped"

    def _end_sessions(self, hurry: bool) -> None:
        """Every ssh session ends. The agents were told to exit (or saw the rendezvous fail) and get the
        time to; then end of input stops any agent still there, and ssh itself is ended if it lingers."""
        end_sessions(self.sessions, 0.0 if hurry else self.config.stop_timeout + SESSION_GRACE)
