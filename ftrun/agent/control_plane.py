"""An agent's way to the job's control store under ``--rdzv-backend etcd``: lead, or follow the leader.

The control store (a TCPStore: every agent's keepalives and reports, every rank's heartbeat and repair)
is hosted by whichever agent holds the leader key in etcd (``controller/leadership.py``), on a port of
its own, and etcd says where (its store record). When that agent's node goes, its lease lapses after
``--node-timeout``; each agent that loses the store comes here again: one of them takes the lead, hosts a
new store and goes on from the journal its predecessor wrote; the others connect to it. The ranks find
the new store in a file their agent rewrites (``FTRUN_CONTROL_STORE_FILE``), so that ranks never talk to
etcd.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass

from ftrun.auth import Signer
from ftrun.contract import Endpoint, parse_endpoint
from ftrun.controller.journal import Journal, read_journal
from ftrun.controller.leadership import Leadership, LeadershipLost, StoreRecord, current_store_record
from ftrun.errors import ExitCode, FtrunError, RendezvousError
from ftrun.etcd import CALL_DEADLINE, EtcdClient, EtcdError, EtcdUnavailable
from ftrun.keys import EtcdKeys
from ftrun.store import PROBE_DEADLINE, ControlStore, _store_server, bind_address, connect_store

log = logging.getLogger(__name__)
#: how long one look for a new leader waits on etcd before it looks again
LOOK_AGAIN = 1.0
#: the shortest time a follower's call to the control store may take before its host counts as gone
MIN_CALL_TIMEOUT = 5.0
#: how long a look tries the store this agent gave up, while the controller in office still names it
REVISIT = 0.5


class ControlPlaneLost(FtrunError):
    """etcd stayed unreachable (no quorum) past --store-timeout: the job stops."""

    def __init__(self, message: str):
        super().__init__(message, ExitCode.JOB_FAILED)


@dataclass(frozen=True)
class Found:
    """The control store this agent uses now."""

    #: None once the job has ended (``ended``)
    store: ControlStore | None
    #: this agent leads: it hosts the store and runs the controller
    leads: bool
    #: the leader's journal when this agent took over a running job (None: a fresh job, or a follower)
    journal: Journal | None
    #: the job ended while this agent looked (a follower reads it from the journal): (exit code, reason)
    ended: tuple[int, str] | None = None


class EtcdControlPlane:
    """One agent's side of the etcd backend: its candidacy, and the file that tells its ranks where
    the control store is."""

    def __init__(self, config, agent_id: str, host: str, signer: Signer):
        self.config = config
        self.agent_id = agent_id
        self.host = host
        self.signer = signer
        # no call waits longer than the first contact may (--rdzv-timeout): the client's own 10 s won over
        # a --rdzv-timeout of 3 with an unreachable endpoint
        self.client = EtcdClient(config.etcd, deadline=min(CALL_DEADLINE, config.rdzv_timeout))
        self.keys = EtcdKeys(config.run_id)
        self.leadership = Leadership(self.client, self.keys, agent_id, config.node_timeout)
        self._folder = tempfile.TemporaryDirectory(prefix="ftrun-control-")
        #: the folder of the file below, removed when the agent ends (by its guardian if it is killed)
        self.folder = self._folder.name
        #: the file this node's ranks read the control store's address from
        self.store_file = os.path.join(self.folder, "control-store")

    def find(self, deadline: float, joined: bool, failed: str = "") -> Found:
        """The control store to use now, waiting up to ``deadline`` seconds while etcd has no quorum or
        no leader has published its store yet. ``joined``: this agent is in the job already (it takes
        over from the journal if it leads; a fresh agent that leads starts the job afresh). ``failed``:
        the address of the store that just went (a leader still listed there is waited out)."""
        end = time.monotonic() + deadline
        unreachable = ""
        while True:
            try:
                found = self._look(joined, failed)
                if unreachable:
                    log.warning("the control store (etcd at %s) answers again", self.config.etcd.describe())
                if found is not None:
                    if found.store is not None:
                        self._tell_ranks(found.store.endpoint)
                    return found
            except EtcdUnavailable as e:
                if not unreachable:
                    unreachable = str(e)
                    left = end - time.monotonic()
                    if left > 0:
                        log.error("the control store (etcd at %s) is unreachable: %s; trying for %.0fs more",
                                  self.config.etcd.describe(), e, left)
            except EtcdError as e:  # it answers, and says no (not a gateway, a refused user): no retry helps
                where = f"etcd at {self.config.etcd.describe()}"
                if not joined:
                    raise RendezvousError(f"cannot use {where}: {e}") from None
                raise ControlPlaneLost(f"the control store ({where}) refused this agent: {e}") from None
            if time.monotonic() > end:
                where = f"etcd at {self.config.etcd.describe()}"
                if not joined:  # the launch: as a c10d store that never answers
                    raise RendezvousError(f"cannot reach {where} within {deadline:g}s: "
                                          f"{unreachable or 'no controller published its store'}")
                raise ControlPlaneLost(f"the control store ({where}) was unreachable for {deadline:g}s: "
                                       f"{unreachable or 'no controller published its store'}")
            self._wait_for_store_record(min(LOOK_AGAIN, max(0.05, end - time.monotonic())))

    def _look(self, joined: bool, failed: str) -> Found | None:
        if self.leadership.try_lead():
            try:
                return self._lead(joined)
            except LeadershipLost:
                # the lease lapsed as the office was taken (this agent's process was stopped in between, or
                # starved): another agent leads, or will; look again
                log.warning("the lead was lost as it was taken; looking for the controller again")
                return None
        record = current_store_record(self.client, self.keys)
        again = record is not None and record.endpoint == failed
        if record is None or again:
            if joined:
                journal = self._journal()
                if journal is not None and journal.over:
                    return _ended(journal)
            if record is None:
                return None  # no leader yet, or it has not published its store
        endpoint = parse_endpoint(record.endpoint, 0, "the store record in etcd")
        # A fresh agent waits as long as for any rendezvous; one in the job, as long as for a node. The store
        # this agent gave up, still named by the controller in office, is tried for a moment only: its lease
        # has yet to lapse (waited out), or the controller is back, stopped and woken before another agent
        # took its office (it renewed its lease, or took the office back in a new term). Waiting only for
        # another store, the agents that had given it up waited until the job ended, and it counted them
        # lost (a spare given a node's place among them: the job failed)
        wait = REVISIT if again else max(self.config.node_timeout, PROBE_DEADLINE) if joined else self.config.rdzv_timeout
        try:
            raw = connect_store(endpoint, wait, refused_is_final=again)  # refused: its host is up, its agent gone
        except Exception as e:
            if not again:
                log.warning("the controller's store at %s did not answer: %s", record.endpoint, e)
            return None
        if again:
            log.warning("the controller on %s answers again at %s; following it", record.host, record.endpoint)
        else:
            log.info("following the controller on %s (its store at %s)", record.host, record.endpoint)
        # a host that stops answering without closing the connection (stopped, cut off) is given up within
        # --node-timeout, as any lost node is
        return Found(ControlStore(raw, endpoint, is_host=False, signer=self.signer,
                                  call_timeout=max(self.config.node_timeout, MIN_CALL_TIMEOUT)), False, None)

    def _lead(self, joined: bool) -> Found:
        """This agent took the office: its journal read, its store hosted (LeadershipLost where the lease
        lapsed meanwhile)."""
        journal = self._journal()
        if not joined:
            journal = None  # a fresh launch: whatever an earlier run of this id left is not this job's
            self.client.delete_prefix(self.keys.journal)
        elif journal is not None and journal.over:
            self.leadership.resign()
            return _ended(journal)
        return Found(self._host(), True, journal)

    def _host(self) -> ControlStore:
        """Host a fresh control store on a free port, and say where in etcd (as the leader); the store goes
        again where the lead was lost before it was said."""
        config = self.config
        address = bind_address(self.host, config.store_bind, True)
        server = _store_server(self.host, address, 0, config.worker_port_range)
        endpoint = Endpoint(self.host, server.port)
        record = StoreRecord(str(endpoint), self.agent_id, self.host, self.leadership.term)
        try:
            self.leadership.publish(self.keys.store_record, record)
        except LeadershipLost:
            del server  # its only reference: the store closes with it
            raise
        self.leadership.store_record = record
        log.info("hosting the control store at %s and the controller", endpoint)
        return ControlStore(server, endpoint, is_host=True, signer=self.signer)

    def _journal(self) -> Journal | None:
        return read_journal(self.client, self.keys)

    def _wait_for_store_record(self, timeout: float) -> None:
        """Until one of the run's keys changes (a leader's lease lapsed, a new one published its store), or
        ``timeout``."""
        try:
            self.client.wait_change(self.keys.root, self.client.revision(), timeout, prefix=True)
        except EtcdError:
            time.sleep(min(timeout, 0.2))

    def _tell_ranks(self, endpoint: Endpoint) -> None:
        """Rewrite the file the ranks follow (atomically: a rank never reads half an address)."""
        part = self.store_file + ".part"
        with open(part, "w") as f:
            f.write(str(endpoint))
        os.replace(part, self.store_file)

    def leave(self) -> None:
        """The job is over for this agent: give the lead up at once (an orderly exit)."""
        if self.leadership.term:
            self.leadership.resign()
        self.remove_folder()

    def remove_folder(self) -> None:
        """Remove the ranks' file and its folder (again, or gone already: nothing)."""
        self._folder.cleanup()


def _ended(journal: Journal) -> Found:
    return Found(None, False, journal, (journal.view.exit_code, journal.view.reason))
