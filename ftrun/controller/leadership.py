"""Which agent is the controller, under ``--rdzv-backend etcd``: the one holding a key on an etcd lease.

Every agent, spares included, is a candidate. The first to create the run's leader key (a transaction
that finds it missing) holds it as long as its lease lives: it renews the lease every third of
``--node-timeout``; the lease lapses when the node dies, and an orderly exit gives it up at once. The
leader writes the job's control state to etcd, each write a transaction that holds only while the key
it created is still there (compared by its create revision, its *term*): a leader that lost its lease
while it was stopped can change nothing, finds so at its next write, and steps down.

Everything here is written under one prefix per run id (:class:`EtcdKeys`); nothing a rank does reaches
etcd: in steady state the leader renews its lease (one write every ``node_timeout / 3``), and each
other agent holds one watch on the leader key.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from ftrun.etcd import EtcdClient, EtcdError, EtcdUnavailable, KeyValue, created_at, put
from ftrun.keys import EtcdKeys
from ftrun.messages import from_json, to_json

log = logging.getLogger(__name__)
#: renewals per lease period: a lease survives two lost renewals
RENEWALS_PER_TTL = 3


class LeadershipLost(Exception):
    """This agent's lease lapsed, or another agent leads now: its writes are refused."""


@dataclass(frozen=True)
class StoreRecord:
    """The control store the agents and ranks use now: hosted by the controller's agent."""

    endpoint: str
    leader: str
    host: str
    #: the leader key's create revision when this controller took office
    term: int


class Leadership:
    """One candidate: takes the leader key when it is free, keeps its lease, writes only while it leads."""

    def __init__(self, client: EtcdClient, keys: EtcdKeys, candidate: str, ttl: float):
        self.client = client
        self.keys = keys
        self.candidate = candidate
        self.ttl = ttl
        #: the leader key's create revision while this candidate leads; 0 otherwise
        self.term = 0
        self._lease = 0
        #: set when the lease lapsed or a conditioned write was refused
        self.lost = threading.Event()
        #: since when (monotonic) no renewal went through because etcd did not answer; 0 while it answers.
        #: Without a quorum no other candidate can take the lead either: the lease is not lost for it
        #: (etcd extends every lease when it elects its next leader), and the controller goes on
        self.unreachable_since = 0.0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        #: held while the office is taken back in a new term (the renewals, or a refused write); reentrant:
        #: taking it back writes where the store is, a write that may find the office lost again
        self._taking_back = threading.RLock()
        #: where this candidate's store is, once it leads and said so (said again in a new term)
        self.store_record: StoreRecord | None = None
        #: the office's own client, for its renewals and its writes: each call gives up within a renewal's
        #: period, each member within as long, so that a lost quorum is seen within one, and a decision
        #: that waits for etcd goes on within one of its answering again (with the shared client's 3 s a
        #: member, the member left without a quorum held each try 3 s: a repair waiting for etcd went on 1.9 s
        #: after the members lost were started again, where it now goes on 0.2-0.5 s after etcd answers)
        period = max(1.0, ttl / RENEWALS_PER_TTL)
        self._quick = EtcdClient(client.options, deadline=period, member_timeout=period)

    @property
    def leads(self) -> bool:
        return self.term > 0 and not self.lost.is_set()

    def leader(self) -> KeyValue | None:
        """The leader key as etcd holds it now (None: no leader)."""
        return self.client.get(self.keys.leader)

    def try_lead(self) -> bool:
        """Take the leader key if no one holds it; True if this candidate leads now."""
        if self.leads:
            return True
        if not self._take_key(self.client):
            return False
        self.lost.clear()
        self._stop.clear()
        self._keeper = threading.Thread(target=self._keep, name="ftrun-lease", daemon=True)
        self._keeper.start()
        log.info("leading the job's control plane (term %d)", self.term)
        return True

    def _take_key(self, client: EtcdClient) -> bool:
        """Create the leader key on a new lease if it is missing: a new term."""
        lease = client.grant(self.ttl)
        result = client.txn([created_at(self.keys.leader, 0)], [put(self.keys.leader, self.candidate, lease)])
        if not result.succeeded:
            client.revoke(lease)
            return False
        self._lease, self.term = lease, result.revision
        return True

    def _take_back(self, client: EtcdClient) -> bool:
        """The lease lapsed while etcd had no quorum (a cluster that elects a new leader may let a lease of
        a few seconds go): take the office again, in a new term, if no other agent took it meanwhile. None
        did unless the controller's store stopped answering: its agents look for another only then.
        The caller holds ``_taking_back``: the renewals and a refused write may find the lapse together."""
        old_lease = self._lease
        try:
            if not self._take_key(client):
                return False
            if self.store_record is not None:  # where the store is, said again for the new term
                self.store_record = dataclasses.replace(self.store_record, term=self.term)
                self.publish(self.keys.store_record, self.store_record)
        except (EtcdError, LeadershipLost) as e:
            log.warning("could not take the controller's office back: %s", e)
            return False
        log.warning("the controller's lease lapsed (etcd without a quorum, or this process stopped) and no other "
                    "agent took the office; it holds it again (term %d)", self.term)
        if old_lease and old_lease != self._lease:
            try:
                client.revoke(old_lease)  # lapsed already, as a rule: nothing of the office is on it now
            except EtcdError:
                pass
        return True

    def write(self, ops: list[dict]) -> None:
        """``ops`` (``ftrun.etcd.put``/``delete``), done only while this candidate leads: else
        :class:`LeadershipLost` (and the candidate counts as having stepped down)."""
        if not self.leads:
            raise LeadershipLost("this agent no longer leads the job")
        term = self.term
        if self._quick.txn([created_at(self.keys.leader, term)], ops).succeeded:
            return
        # Refused: the term this write was conditioned on is over. Its lease may have lapsed while etcd had
        # no quorum, with no other agent in office since, or the renewals took the office back meanwhile in a
        # new term. Either way this candidate still leads, and the write goes through in the new term: the
        # first write after an outage would otherwise come before the renewals' next try and step the
        # controller down for nothing, the repair it decides with it.
        if self._still_leads(term):
            if self._quick.txn([created_at(self.keys.leader, self.term)], ops).succeeded:
                return
        self.lost.set()
        raise LeadershipLost("another agent leads the job now: this one's writes are refused")

    def _still_leads(self, refused_term: int) -> bool:
        """After a write conditioned on ``refused_term`` was refused: whether this candidate leads, in a
        term of its own taken since (by the renewals, or here if the leader key is free)."""
        with self._taking_back:
            if self.term != refused_term:
                return self.leads  # the renewals took the office back meanwhile
            if self._quick.get(self.keys.leader) is not None:
                return False  # another agent's
            return self._take_back(self._quick)

    def publish(self, key: str, message) -> None:
        self.write([put(key, to_json(message))])

    def resign(self) -> None:
        """Give the lease up (an orderly exit): the next candidate takes over at once."""
        self._stop.set()
        lease, self._lease, self.term = self._lease, 0, 0
        if lease:
            try:
                self.client.revoke(lease)
            except EtcdError as e:
                log.warning("could not give up the controller's lease: %s", e)
        if self._keeper is not None:
            self._keeper.join(self.client.deadline)

    def _keep(self) -> None:
        """Renew the lease every ttl / RENEWALS_PER_TTL, until etcd says it lapsed (this process was
        stopped, or cut off, for longer than the ttl: another candidate may lead now)."""
        while not self._stop.wait(self.ttl / RENEWALS_PER_TTL):
            lease = self._lease
            try:
                left = self._quick.keepalive(lease)
            except EtcdUnavailable:
                self.unreachable_since = self.unreachable_since or time.monotonic()
                continue
            except EtcdError:
                left = 0  # "lease not found"
            self.unreachable_since = 0.0
            if left > 0:
                continue
            with self._taking_back:
                if self._lease != lease:
                    continue  # a refused write took the office back meanwhile, on a lease of its own
                if self._take_back(self._quick):
                    continue
            log.error("the controller's lease lapsed (term %d): another agent leads now", self.term)
            self.lost.set()
            return


def read_store_record(client: EtcdClient, keys: EtcdKeys) -> StoreRecord | None:
    kv = client.get(keys.store_record)
    return from_json(StoreRecord, kv.value) if kv is not None else None


def current_store_record(client: EtcdClient, keys: EtcdKeys) -> StoreRecord | None:
    """The store record of the controller in office now; None while none leads or it has not said where
    (a record left by a controller whose lease lapsed is not current)."""
    leader, record = client.get(keys.leader), read_store_record(client, keys)
    if leader is None or record is None or record.term != leader.create_revision:
        return None
    return record
