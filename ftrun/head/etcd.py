"""A head node under ``--rdzv-backend etcd``: it starts the agents over ssh, then only follows the job.

The controller runs in an agent on a worker node, elected through etcd as in the direct launch, and each
agent is detached from its ssh session (``ftrun.head.session_keeper``), so that the job goes on whatever
happens to the head: its terminal closed, its ssh sessions cut, its process killed, its machine lost.
While it is there the head shows the agents' output (their sessions copy it) and ends with the job's
exit code, which it reads from the controller's journal in etcd; Ctrl-C on it stops the job, as under
c10d (its sessions ask each agent to stop). A head started again for a run that etcd says is running
launches nothing: it follows that run (the CLI shows its status, as ``ftrun status --watch`` does) and
ends with its exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from ftrun.auth import new_token
from ftrun.config import LaunchConfig
from ftrun.controller.journal import DecisionPart
from ftrun.controller.states import Phase
from ftrun.errors import ExitCode, FtrunError, RendezvousError
from ftrun.etcd import EtcdClient, EtcdError, created_at, put
from ftrun.head.sessions import (
    SESSION_GRACE,
    SSH_FAILED,
    WATCH_INTERVAL,
    HeadOutcome,
    RemoteAgent,
    Session,
    agent_exit_code,
    end_sessions,
)
from ftrun.interrupts import Interrupts
from ftrun.keys import EtcdKeys
from ftrun.messages import from_json

log = logging.getLogger(__name__)
#: how long a head waits for a controller to take office when the journal says the run goes on and none
#: holds it: a successor takes office within a second of its predecessor's lease lapsing
LEADER_GAP = 10.0
#: how long a launch counts as under way before its agents chose a controller (ssh's ConnectTimeout, then
#: each host's Python starting ftrun, on a loaded machine)
LAUNCH_LEASE = 60.0
#: between two reads of the job's decision in etcd
LOOK_INTERVAL = 0.5
#: said at every launch: the job does not need this head, and how to follow it again
HEAD_IS_OPTIONAL = ("the job does not depend on this head node: its controller runs on a node, elected through "
                    "etcd; closing this terminal, cutting its ssh sessions or losing this machine leaves it "
                    "running, and this command again with --run-id {run_id} follows it")


def read_decision(client: EtcdClient, keys: EtcdKeys, after_revision: int = 0) -> DecisionPart | None:
    """The controller's last decision as its journal holds it, if written after ``after_revision``."""
    kv = client.get(keys.journal_part("decision"))
    if kv is None or kv.mod_revision <= after_revision:
        return None
    return from_json(DecisionPart, kv.value)


def is_over(decision: DecisionPart | None) -> bool:
    return decision is not None and decision.view.phase in (Phase.EXITING, Phase.DONE)


def run_is_going_on(client: EtcdClient, keys: EtcdKeys, gap: float = LEADER_GAP,
                    stop: threading.Event | None = None) -> bool:
    """Whether the run is going on: a controller holds its office; or a head launched it less than
    LAUNCH_LEASE seconds ago and a controller takes office before that launch's lease lapses; or its
    journal says it goes on and one takes office within ``gap`` seconds (its predecessor's lease lapsed a
    moment ago). A journal of a run that goes on and no controller within ``gap``: every agent of that run
    is gone. ``stop`` set (Ctrl-C) ends a wait, as if no controller came."""
    stop = stop or threading.Event()
    if client.get(keys.leader) is not None:
        return True
    if client.get(keys.launch) is not None:
        log.info("a head launched run %s less than %gs ago: waiting for its agents to choose a controller",
                 keys.run_id, LAUNCH_LEASE)
        while client.get(keys.launch) is not None and not stop.is_set():
            revision = client.revision()
            if client.get(keys.leader) is not None:
                return True
            client.wait_change(keys.root, revision, 1.0, prefix=True)
        if client.get(keys.leader) is not None:
            return True
    decision = read_decision(client, keys)
    if decision is None or is_over(decision):
        return False
    log.info("etcd's journal says run %s goes on, but no controller holds it; waiting up to %gs for one",
             keys.run_id, gap)
    end = time.monotonic() + gap
    while (left := end - time.monotonic()) > 0 and not stop.is_set():
        revision = client.revision()
        if client.get(keys.leader) is not None:
            return True
        client.wait_change(keys.leader, revision, min(1.0, left))
    if stop.is_set():
        return False
    log.warning("no controller took run %s's office within %gs: its agents are gone; starting it afresh",
                keys.run_id, gap)
    return False


def wait_for_the_end(client: EtcdClient, keys: EtcdKeys, timeout: float) -> DecisionPart | None:
    """The controller's last decision once it says the job is over, or as it is after ``timeout``. The
    controller publishes the job's final status before its journal says so (a status reader sees the end
    first)."""
    end = time.monotonic() + timeout
    while True:
        revision = client.revision()
        decision = read_decision(client, keys)
        left = end - time.monotonic()
        if is_over(decision) or left <= 0:
            return decision
        client.wait_change(keys.journal_part(""), revision, min(1.0, left), prefix=True)


def wait_for_the_controller_to_leave(client: EtcdClient, keys: EtcdKeys, timeout: float) -> bool:
    """After the job's end, until its controller's agent gave up the office (the last thing it does in etcd:
    the other agents have acknowledged the exit by then), or ``timeout``; whether it did."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        revision = client.revision()
        if client.get(keys.leader) is None:
            return True
        client.wait_change(keys.leader, revision, min(1.0, left))
    return False


def say_launch(client: EtcdClient, keys: EtcdKeys) -> bool:
    """Say this head's launch in etcd (for LAUNCH_LEASE seconds), unless another head's is said there: of two
    heads started at once for one run id, one launches it."""
    said = put(keys.launch, f"{socket.gethostname()}:{os.getpid()}", client.grant(LAUNCH_LEASE))
    return client.txn([created_at(keys.launch, 0)], [said]).succeeded


class EtcdHead:
    """Starts one agent per host over ssh and follows the job through etcd (see the module's text)."""

    def __init__(self, config: LaunchConfig, agents: list[RemoteAgent]):
        assert config.etcd is not None
        self.config = config
        self.agents = agents
        self.keys = EtcdKeys(config.run_id)
        self.client = EtcdClient(config.etcd, deadline=min(10.0, config.rdzv_timeout))
        self.interrupts = Interrupts()
        self.sessions: list[Session] = []
        #: the job's secret: the user's --token-file, else one made for this job
        self.token = config.token or new_token()
        self._etcd_silent = ""
        #: this head's launch is said in etcd (``EtcdKeys.launch``)
        self._launch_said = False

    def install_signal_handlers(self) -> None:
        self.interrupts.install()

    def run(self) -> HeadOutcome:
        where = self.config.etcd.describe()
        try:
            going_on = run_is_going_on(self.client, self.keys, stop=self.interrupts.event)
            if self.interrupts.requested:
                raise FtrunError("interrupted before anything was launched", ExitCode(self.interrupts.exit_code))
            revision = self.client.revision()  # a decision written after this one is this launch's
            if not going_on:  # said before any ssh: a head started again meanwhile follows this launch
                self._launch_said = say_launch(self.client, self.keys)
                if not self._launch_said:  # another head said its launch a moment before: its agents choose
                    going_on = run_is_going_on(self.client, self.keys, stop=self.interrupts.event)
        except EtcdError as e:
            raise RendezvousError(f"cannot reach etcd at {where}: {e}") from None
        if going_on:
            log.info("run %s is running already: following it (nothing is launched)", self.config.run_id)
            return HeadOutcome(ExitCode.OK, "", None, following=True, config=self.config)
        return self._launch(revision)

    def _forget_launch(self) -> None:
        """The launch is over (its controller took office, or it failed): a head started again no longer
        waits for it."""
        if self._launch_said:
            self._launch_said = False
            try:
                self.client.delete_prefix(self.keys.launch)
            except EtcdError:
                pass  # its lease lapses within LAUNCH_LEASE

    def _launch(self, revision: int) -> HeadOutcome:
        config = self.config
        log.info("starting %d agent%s over ssh; the controller on the node etcd elects (etcd at %s), run id %s",
                 len(self.agents), "s" if len(self.agents) != 1 else "", config.etcd.describe(), config.run_id)
        log.info(HEAD_IS_OPTIONAL.format(run_id=config.run_id))
        hurry, following = False, False
        try:
            # each host keeps its agent's output in its own files: the head keeps none
            for agent in self.agents:
                self.sessions.append(Session(agent, "", b"ftrun" if config.log_dir else b"", self.token))
            code, reason, following = self._watch(revision)
        except KeyboardInterrupt:  # a second Ctrl-C: leave at once; the agents were asked to stop
            code, reason, hurry = ExitCode.INTERRUPTED, "interrupted; the agents were asked to stop", True
        except FtrunError:
            hurry = True
            raise
        finally:
            self._forget_launch()
            end_sessions(self.sessions, 0.0 if hurry or following else config.stop_timeout + SESSION_GRACE)
        return HeadOutcome(code, reason, None, following=following, config=config)

    def _watch(self, revision: int) -> tuple[int, str, bool]:
        """Until the job ends (its exit code and reason), fails to start (raises), or every session ended
        while it runs on (following)."""
        started, stop_asked, next_look = False, 0.0, 0.0
        while True:
            now = time.monotonic()
            if self.interrupts.requested and not stop_asked:
                stop_asked = now
                log.warning("%s: stopping the job", self.interrupts.name)
                for session in self.sessions:
                    session.ask_to_stop(self.interrupts.signal)
            if stop_asked and now - stop_asked > self.config.stop_timeout + SESSION_GRACE:
                return ExitCode.INTERRUPTED, "interrupted; the agents did not all stop in time", False
            for session in self.sessions:
                if session.handled or session.proc.poll() is None:
                    continue
                session.handled = True
                started = started or self._decision(revision) is not None
                code = session.proc.returncode
                if not started and stop_asked:
                    return self.interrupts.exit_code, "interrupted before the job started", False
                if not started:
                    self._stop_the_others(session)
                    why = session.why()
                    raise FtrunError(why, agent_exit_code(code))
                if code == SSH_FAILED or code < 0:  # ssh itself ended or was ended: the agent is not its child
                    log.warning("lost the ssh session to %s (%s); its agent goes on, detached from it", session.host,
                                f"ssh exit code {code}" if code >= 0 else f"ssh killed by signal {-code}")
                elif code != 0:
                    log.warning("%s; the controller handles its node as any lost node", session.why())
            if now >= next_look:
                next_look = now + LOOK_INTERVAL
                decision = self._decision(revision)
                if decision is not None and not started:
                    self._forget_launch()
                started = started or decision is not None
                if is_over(decision):
                    return decision.view.exit_code, decision.view.reason, False
            if all(session.handled for session in self.sessions):
                log.warning("every ssh session ended while the job goes on: following it through etcd")
                return ExitCode.OK, "", True
            time.sleep(WATCH_INTERVAL)

    def _decision(self, revision: int) -> DecisionPart | None:
        """This launch's last decision; None before the first, or while etcd does not answer (said once:
        the agents and the controller wait for it as long as --store-timeout, and the head with them)."""
        try:
            decision = read_decision(self.client, self.keys, revision)
        except EtcdError as e:
            if not self._etcd_silent:
                log.warning("etcd at %s does not answer (%s); the job goes on without it for --store-timeout",
                            self.config.etcd.describe(), e)
            self._etcd_silent = str(e)
            return None
        if self._etcd_silent:
            log.info("etcd at %s answers again", self.config.etcd.describe())
            self._etcd_silent = ""
        return decision

    def _stop_the_others(self, failed: Session) -> None:
        """The job cannot start without the host whose agent ended: the others stop now, rather than at
        --rdzv-timeout (an agent under etcd does not stop with its session)."""
        for session in self.sessions:
            if session is not failed and session.proc.poll() is None:
                session.ask_to_stop(signal.SIGTERM)
