"""ftrun's etcd client and the controller's office on it, against a real 3-member cluster on loopback:
members lost one by one, the quorum lost, a leader whose lease lapsed while it was stopped."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from ftrun.contract import parse_endpoint
from ftrun.controller.journal import Journal
from ftrun.controller.leadership import EtcdKeys, Leadership, LeadershipLost
from ftrun.controller.policy import JobView, Level, Phase
from ftrun.etcd import EtcdClient, EtcdError, EtcdOptions, EtcdUnavailable, created_at, put, read
from ftrun.messages import NodeSlot, RendezvousResult, from_json, to_json


def options(cluster, **auth) -> EtcdOptions:
    return EtcdOptions(tuple(parse_endpoint(e, 2379) for e in cluster.endpoints.split(",")), **auth)


def test_reads_writes_transactions_leases_and_a_watch(etcd):
    client = EtcdClient(options(etcd))
    client.put("t/a", "1")
    client.put("t/b", b"\x00\xff")
    assert client.get("t/a").value == b"1" and client.get("t/missing") is None
    assert [kv.key for kv in client.get_prefix("t/")] == ["t/a", "t/b"]
    assert client.get("t/b").value == b"\x00\xff"
    taken = client.txn([created_at("t/leader", 0)], [put("t/leader", "me")], [read("t/leader")])
    again = client.txn([created_at("t/leader", 0)], [put("t/leader", "you")], [read("t/leader")])
    assert taken.succeeded and not again.succeeded and again.read[0].value == b"me"
    lease = client.grant(1)
    client.put("t/leased", "x", lease)
    assert client.keepalive(lease) >= 1
    client.revoke(lease)
    assert client.get("t/leased") is None  # gone with the lease, at once
    revision = client.revision()
    threading.Timer(0.2, lambda: EtcdClient(client.options).put("t/watched", "now")).start()
    assert client.wait_change("t/watched", revision, timeout=30)
    assert not client.wait_change("t/quiet", client.revision(), timeout=0.3)
    assert client.delete_prefix("t/") == 4


def test_one_member_lost_changes_nothing_and_no_quorum_is_said_within_the_deadline(etcd):
    client = EtcdClient(options(etcd), deadline=3)
    client.put("q/k", "before")
    etcd.kill(0)  # the member the client used last: the next call goes to another
    client.put("q/k", "one member down")
    assert client.get("q/k").value == b"one member down"
    etcd.kill(1)
    started = time.monotonic()
    with pytest.raises(EtcdUnavailable, match="no etcd member answered within 3s"):
        client.put("q/k", "no quorum")
    assert time.monotonic() - started < 30  # the deadline holds (generous: the machine may be busy)
    etcd.revive(0)
    etcd.revive(1)
    etcd.wait_healthy()
    client.deadline = 30
    client.put("q/k", "quorum back")  # (the write that timed out may have been applied since: etcd's way)
    assert client.get("q/k").value == b"quorum back"


def test_user_and_password_as_rdzv_conf_gives_them(etcd):
    member = etcd.members[0].endpoint
    for path, body in (("user/add", {"name": "root", "password": "secret"}),
                       ("user/grant", {"user": "root", "role": "root"}), ("enable", {})):
        request = urllib.request.Request(f"http://{member}/v3/auth/{path}", json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert "error" not in json.load(answer)
    assert EtcdClient(options(etcd, user="root", password="secret")).put("a/k", "v") > 0
    with pytest.raises(EtcdError, match="root"):
        EtcdClient(options(etcd, user="root", password="wrong")).put("a/k", "v")
    with pytest.raises(EtcdError, match="refused"):
        EtcdClient(options(etcd)).put("a/k", "v")  # no user: etcd says no, in one line


def test_a_leader_stopped_past_its_lease_is_refused_and_steps_down(etcd):
    keys = EtcdKeys("office")
    first = Leadership(EtcdClient(options(etcd)), keys, "agent-a", ttl=1)
    second = Leadership(EtcdClient(options(etcd)), keys, "agent-b", ttl=1)
    assert first.try_lead() and not second.try_lead()
    first.publish(keys.journal, {"by": "a"})
    first._stop.set()  # as if SIGSTOPped: no renewal any more, and the process does not know
    deadline = time.monotonic() + 30
    while not second.try_lead():
        assert time.monotonic() < deadline, "the lapsed lease was never taken over"
        time.sleep(0.1)
    assert first.leads  # it does not know yet...
    with pytest.raises(LeadershipLost):
        first.publish(keys.journal, {"by": "a, late"})  # ...but its write is refused
    assert not first.leads
    second.publish(keys.journal, {"by": "b"})
    assert json.loads(second.client.get(keys.journal).value) == {"by": "b"}
    second.resign()  # an orderly exit: the next candidate leads at once
    third = Leadership(EtcdClient(options(etcd)), keys, "agent-c", ttl=1)
    assert third.try_lead()
    third.resign()


def test_a_journal_comes_back_as_it_was_written():
    view = JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.PROCESS, phase=Phase.REPAIR,
                   level=Level.PROCESS, generation=2, restarts_used=1, replacing=frozenset({1, 3}),
                   lost=frozenset({0}))
    slot = NodeSlot(0, "h:1", "h", 2, 0)
    journal = Journal("h:1", "h", view, RendezvousResult((slot,), 4), (slot,), (), 4, moves=1)
    assert from_json(Journal, to_json(journal)) == journal
