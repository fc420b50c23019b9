"""An agent's connection to the controller: the control store, the node's messages over it, and, on the
agent that hosts the store, the controller itself and its view.

Under ``--rdzv-backend etcd`` the controller can move: when the store stops answering (its node is lost,
or this agent's own controller stepped down), :meth:`ControlConnection.follow` looks it up in etcd again,
or takes the lead, and connects there. What the node itself must redo in a new store (its ranks' keys,
its inventory, a report the old store did not take) is the agent's part, after the move.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from ftrun.agent.control_plane import EtcdControlPlane
from ftrun.agent.protocol import NodeProtocol, Wakeup, Watch
from ftrun.agent.top_feed import TopFeed
from ftrun.auth import Signer
from ftrun.config import LaunchConfig
from ftrun.contract import Endpoint
from ftrun.controller.controller import Controller, controller_for
from ftrun.controller.journal import Journal
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL, JobKeys
from ftrun.live_view import StatusView
from ftrun.store import ControlStore, StoreUnavailable, connect_store, open_control_store
from ftrun.top_view.attached import AttachedTop, controller_view

log = logging.getLogger(__name__)
#: at the end of the job, how long the store's host waits for idle spares to read the EXIT
SPARE_LINGER = 5.0


class ControlConnection:
    """One agent's way to the controller (see the module's text). ``store``, ``protocol`` and ``top_feed``
    are those of the controller's store now: read them at each use, since a move replaces them."""

    def __init__(self, config: LaunchConfig, agent_id: str, host: str, run_folder=lambda: ""):
        #: the launch configuration, its endpoint the control store's now
        self.config = config
        self.keys = JobKeys(config.run_id)
        self.agent_id = agent_id
        self.host = host
        #: where the controller writes its event log (the run's folder, made when first asked for)
        self._run_folder = run_folder
        self.token = b""
        self.signer = Signer()
        #: --rdzv-backend etcd: this agent's candidacy and the way to the controller's store
        self.etcd: EtcdControlPlane | None = None
        self.store: ControlStore | None = None
        self.protocol: NodeProtocol | None = None
        #: the node's output and stacks for ftrun top
        self.top_feed: TopFeed | None = None
        #: the controller, while this agent hosts it
        self.controller: Controller | None = None
        #: the live status view or progress lines, where this agent hosts the controller
        self.display: StatusView | AttachedTop | None = None
        #: written to when a command is published (the doorbell's watch), so that the agent's waits end
        self.wakeup = Wakeup()

    @property
    def endpoint(self) -> Endpoint:
        return self.config.endpoint

    @property
    def stepped_down(self) -> bool:
        """This agent's controller gave up the lead (etcd): another agent leads now."""
        return self.controller is not None and self.controller.stepped_down.is_set()

    def open(self, token: bytes, remove_on_exit: Callable[[str], None] = lambda folder: None) -> None:
        """Reach the control store (host it where this agent is the store's host, or etcd says so), and
        start the controller there. ``token`` signs every message ("": unsigned). ``remove_on_exit``: told
        of each folder made here, for the orphan guardian to remove if the agent is killed."""
        config = self.config
        self.token, self.signer = token, Signer(token)
        journal = None
        if config.etcd is not None:
            self.etcd = EtcdControlPlane(config, self.agent_id, self.host, self.signer)
            remove_on_exit(self.etcd.folder)
            found = self.etcd.find(config.rdzv_timeout, joined=False)
            self.store, journal = found.store, found.journal
        else:
            self.store = open_control_store(config.endpoint, config.is_host, config.rdzv_timeout, self.signer,
                                            config.store_bind, config.several_nodes, config.worker_port,
                                            config.worker_port_range)
        self._connect()
        if self.store.is_host:
            if not self.signer.enabled:
                log.warning("control messages are not signed: anyone who reaches %s can steer this job "
                            "(give every node the same --token-file)", self.store.endpoint)
            self._lead(journal)

    def _connect(self, watch: bool = True) -> None:
        """Talk to the control store ``self.store``: the watch of this agent's doorbell (unless not ``watch``:
        the commands are then read at each keepalive), its messages, the top feed; the workers started from
        now on are told where it is."""
        config, endpoint = self.config, self.store.endpoint
        bell = Watch(lambda: connect_store(endpoint, config.rdzv_timeout), self.keys, self.agent_id,
                     self.wakeup) if watch else None
        node_rank = self.protocol.node_rank if self.protocol is not None else -1
        self.protocol = NodeProtocol(self.store, self.keys, self.agent_id, config.node_timeout, bell)
        self.protocol.node_rank = node_rank
        self.top_feed = TopFeed(self.store, self.keys, self.agent_id)
        if endpoint != config.endpoint:  # the static rendezvous (--master-port is the workers'), or etcd's leader
            self.config = dataclasses.replace(config, endpoint=endpoint)

    def _lead(self, journal: Journal | None = None) -> None:
        config = self.config
        leadership = self.etcd.leadership if self.etcd is not None else None
        self.controller = controller_for(self.store, config, self.agent_id, config.local_addr or config.endpoint.host,
                                                self._run_folder(), leadership, journal)
        self.controller.start()
        if self.display is None:
            self.display = controller_view(self.controller, config.status, self.token)

    def follow(self, why: str) -> tuple[int, str] | None:
        """--rdzv-backend etcd: the control store went (its node is lost, or this agent's controller
        stepped down). Find the controller in etcd, or become it, and connect there; how the job ended
        when it ended meanwhile."""
        failed = str(self.store.endpoint)
        log.warning("lost the control store at %s (%s); looking for the controller in etcd", failed, why)
        if self.controller is not None:
            # this agent's own controller went silent (its thread held up) or stepped down: it must change
            # nothing more before another takes its place, here or elsewhere (left running, it went on
            # deciding on the store the agents had left, counted every node lost and dropped the repair's
            # held replacement: issue 40)
            self.controller.retire()
        self.stop_controller()
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
        if found.leads:
            self._lead(found.journal)
        return None

    def stop_controller(self) -> None:
        """End this process's controller and wait for its thread (within --stop-timeout): a thread still in a
        store call of torch's as the interpreter ends aborts the process ("terminate called without an
        active exception"; seen once after a rendezvous that timed out, exit code -6 instead of 3)."""
        if self.controller is not None:
            self.controller.stop_requested.set()
            self.controller.join(self.config.stop_timeout)
            self.controller = None

    def finish(self) -> Controller | None:
        """The job ended for this node: on the store's host, keep the store up until every agent has left
        (the controller's end waits for their acknowledgements, then idle spares); leave etcd. The
        controller, on the agent that hosted it (its view holds the job-wide summary)."""
        if self.controller is not None:
            self.controller.stop_requested.set()
            self.controller.join(self.config.stop_timeout + 15)
            self._wait_for_spares()
        if self.etcd is not None:
            self.etcd.leave()
        return self.controller

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

    def close(self) -> None:
        """Stop the view, let the doorbell's watch go and remove this side's folder (the last thing the
        agent does, however its run ended)."""
        if self.etcd is not None:
            self.etcd.remove_folder()
        if self.display is not None:
            self.display.stop()
        if self.protocol is not None and self.protocol.watch is not None:
            self.protocol.watch.close(self.store)
