"""The controller thread: rendezvous, then apply the recovery policy to what agents report."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from ftrun.controller.policy import JobView, Phase, on_node_lost, on_report, start
from ftrun.errors import ExitCode
from ftrun.keys import JobKeys
from ftrun.messages import Command, CommandKind, Report, RendezvousResult
from ftrun.rendezvous import RendezvousPolicy, gather
from ftrun.store import ControlStore, StoreUnavailable, start_worker_store

log = logging.getLogger(__name__)
TICK = 0.02
HEARTBEAT_INTERVAL = 0.5
#: how long the controller waits for every agent to acknowledge the exit
EXIT_GRACE = 10.0


class Controller:
    """Runs the job's decisions in a thread of the hosting agent."""

    def __init__(
        self,
        store: ControlStore,
        keys: JobKeys,
        rendezvous: RendezvousPolicy,
        host_agent_id: str,
        advertised_host: str,
        max_restarts: int,
        node_timeout: float,
        stop_timeout: float,
    ):
        self.store = store
        self.keys = keys
        self.rendezvous_policy = rendezvous
        self.host_agent_id = host_agent_id
        self.advertised_host = advertised_host
        self.max_restarts = max_restarts
        self.node_timeout = node_timeout
        self.stop_timeout = stop_timeout
        self.view: JobView | None = None
        self.rendezvous: RendezvousResult | None = None
        self.stop_requested = threading.Event()
        self._worker_stores: dict[int, object] = {}
        self._thread = threading.Thread(target=self._run, name="ftrun-controller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self.rendezvous = gather(self.store, self.keys, self.rendezvous_policy, self.host_agent_id, self.stop_requested)
            if self.rendezvous.error:
                return
            self.view = JobView(node_count=len(self.rendezvous.nodes), max_restarts=self.max_restarts)
            self._apply(start(self.view))
            self._loop()
        except StoreUnavailable as e:
            log.error("controller lost its store: %s", e)
        except Exception:
            log.exception("controller failed")
            if self.view is not None:
                self.view = dataclasses.replace(self.view, exit_code=ExitCode.JOB_FAILED, reason="the controller failed")
        finally:
            self._worker_stores.clear()

    def _loop(self) -> None:
        next_report = 0
        beats: dict[int, tuple[int, float]] = {}
        next_beat = 0.0
        exit_deadline = None
        while self.view.phase is not Phase.DONE:
            now = time.monotonic()
            if now >= next_beat:
                self.store.add(self.keys.controller_heartbeat)
                next_beat = now + HEARTBEAT_INTERVAL
                self._check_nodes(beats, now)
            for report in self.store.read_from(self.keys.report_count, self.keys.report, Report, next_report):
                next_report += 1
                self._apply(on_report(self.view, report))
            if self.view.phase is Phase.EXITING:
                exit_deadline = exit_deadline or now + self.stop_timeout + EXIT_GRACE
                if now > exit_deadline:
                    missing = sorted(self.view.present - self.view.acknowledged)
                    log.warning("nodes %s did not acknowledge the exit in time", missing)
                    break
            time.sleep(TICK)

    def _check_nodes(self, beats: dict[int, tuple[int, float]], now: float) -> None:
        for node in self.view.present:
            count = self.store.counter(self.keys.node_heartbeat(node))
            seen, since = beats.get(node, (-1, now))
            if count != seen:
                beats[node] = (count, now)
            elif now - since > self.node_timeout:
                host = self.rendezvous.nodes[node].host
                detail = f"node {node} ({host}) lost: no keepalive from its agent for {self.node_timeout:g}s"
                log.error(detail)
                self._apply(on_node_lost(self.view, node, detail))

    def _apply(self, decision) -> None:
        self.view, commands = decision
        for command in commands:
            if command.kind is CommandKind.START:
                command = self._with_worker_store(command)
            log.debug("publishing %s", command)
            self.store.append(self.keys.command_count, self.keys.command, command)

    def _with_worker_store(self, command: Command) -> Command:
        # Each generation gets a fresh store for the workers' env:// rendezvous; the
        # previous generation's workers are all stopped by now, so its store goes.
        self._worker_stores.clear()
        store, port = start_worker_store(self.advertised_host)
        self._worker_stores[command.generation] = store
        return dataclasses.replace(command, worker_store=f"{self.advertised_host}:{port}")
