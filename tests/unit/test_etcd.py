"""ftrun's etcd client and the controller's office on it, against a real 3-member cluster on loopback:
members lost one by one, the quorum lost, a leader whose lease lapsed while it was stopped."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import json
import signal
import threading
import time
import urllib.request

import pytest

from ftrun.agent.control_plane import ControlPlaneLost, EtcdControlPlane
from ftrun.auth import Signer
from ftrun.config import build_launch_config
from ftrun.contract import parse_endpoint
from ftrun.controller.journal import Journal, JournalWriter, read_journal
from ftrun.controller.leadership import Leadership, LeadershipLost, StoreRecord, current_store_record
from ftrun.controller.states import JobView, Level, Phase
from ftrun.errors import ExitCode, RendezvousError
from ftrun.etcd import CALL_DEADLINE, EtcdClient, EtcdError, EtcdOptions, EtcdUnavailable, NotAGateway, created_at, put, read
from ftrun.keys import EtcdKeys
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
    with pytest.raises(EtcdUnavailable, match="no etcd member answered within 3s"):
        client.put("q/k", "no quorum")  # the deadline holds: the call gives up, saying after how long
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


def test_a_write_refused_after_the_lease_lapsed_with_no_successor_takes_the_office_back(etcd):
    # etcd without a quorum may let a lease of a few seconds lapse; the first write after it came before
    # the renewals noticed, and the controller stepped down with the repair it was deciding
    keys = EtcdKeys("lapsed")
    office = Leadership(EtcdClient(options(etcd)), keys, "agent-a", ttl=1)
    assert office.try_lead()
    term = office.term
    office._stop.set()  # no renewal: the lease lapses, and no other candidate looks meanwhile
    deadline = time.monotonic() + 30
    while office.client.get(keys.leader) is not None:
        assert time.monotonic() < deadline, "the lease never lapsed"
        time.sleep(0.1)
    office.publish(keys.journal_part("decision"), {"by": "a"})  # goes through, in a new term
    assert office.leads and office.term > term
    assert office.client.get(keys.leader).value == b"agent-a"
    assert json.loads(office.client.get(keys.journal_part("decision")).value) == {"by": "a"}
    assert not Leadership(EtcdClient(options(etcd)), keys, "agent-b", ttl=1).try_lead()
    office.resign()


def test_an_agent_that_gave_up_the_store_of_a_controller_still_in_office_follows_it_again_once_it_answers(
        etcd, host_store):
    # the controller's agent SIGSTOPped past the others' calls (5 s), while etcd had no quorum, so that its lease
    # outlived the stop: woken, it led on, and the agents that had given its store up waited for another one
    # until the job ended (it had counted them lost meanwhile: a spare given a lost node's place, the job failed)
    keys, store = EtcdKeys("x"), host_store()
    office = Leadership(EtcdClient(options(etcd)), keys, "agent-a", ttl=3)
    assert office.try_lead()
    office.publish(keys.store_record, StoreRecord(str(store.endpoint), "agent-a", "127.0.0.2", office.term))
    follower = EtcdControlPlane(launch_config(etcd.endpoints, node_timeout=3), "agent-b", "127.0.0.1", Signer())
    try:
        store.process.send_signal(signal.SIGSTOP)  # its host stopped: the follower gave it up
        with pytest.raises(ControlPlaneLost):  # a leader that still names it is waited out...
            follower.find(2, joined=True, failed=str(store.endpoint))
        store.process.send_signal(signal.SIGCONT)
        found = follower.find(30, joined=True, failed=str(store.endpoint))  # ...until it answers again
        assert (found.leads, found.store.endpoint, found.journal) == (False, store.endpoint, None)
        with open(follower.store_file) as named:  # its ranks follow it too
            assert named.read() == str(store.endpoint)
    finally:
        store.process.send_signal(signal.SIGCONT)
        follower.leave()
        office.resign()


def test_an_agent_whose_lead_is_refused_as_it_takes_it_looks_again_instead_of_failing(etcd, monkeypatch):
    # woken from a stop, an agent took the office and its lease lapsed before it said where its store is: the
    # write is refused (LeadershipLost), and the agent looks again (it once ended with a traceback)
    plane = EtcdControlPlane(launch_config(etcd.endpoints, node_timeout=3), "agent-a", "127.0.0.1", Signer())
    publish, refused = plane.leadership.publish, []

    def refused_once(key, message):
        if not refused:
            refused.append(key)
            raise LeadershipLost("this agent no longer leads the job")
        return publish(key, message)

    monkeypatch.setattr(plane.leadership, "publish", refused_once)
    try:
        found = plane.find(30, joined=False)
        assert refused == [plane.keys.store_record] and found.leads and found.store is not None
        assert current_store_record(plane.client, plane.keys).endpoint == str(found.store.endpoint)
    finally:
        plane.leave()


def test_the_store_record_is_current_only_while_the_controller_that_wrote_it_leads(etcd):
    keys, client = EtcdKeys("record"), EtcdClient(options(etcd))
    office = Leadership(client, keys, "agent-a", ttl=5)
    assert current_store_record(client, keys) is None  # no one leads
    assert office.try_lead()
    assert current_store_record(client, keys) is None  # it leads, and has not said where its store is
    record = StoreRecord("127.0.0.1:5000", "agent-a", "127.0.0.1", office.term)
    office.publish(keys.store_record, record)
    assert current_store_record(client, keys) == record
    office.resign()
    assert current_store_record(client, keys) is None  # a record left by a controller out of office

class NotEtcd(http.server.BaseHTTPRequestHandler):
    """A web server that is not etcd: 404, empty body, to every POST."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def not_etcd():
    """The address of an HTTP server on loopback that is not an etcd v3 gateway."""
    server = http.server.HTTPServer(("127.0.0.1", 0), NotEtcd)
    thread = threading.Thread(target=server.serve_forever, name="not-etcd", daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def launch_config(endpoint: str, **flags):
    raw = {"rdzv_backend": "etcd", "rdzv_endpoint": endpoint, "nnodes": "2", "run_id": "x", "script": "train.py"}
    return build_launch_config({**raw, **flags}, check_script=False)


def test_an_endpoint_that_is_not_an_etcd_gateway_is_one_line_and_exit_3_issue_40(not_etcd):
    # its 404 with an empty body was a 32-line traceback ending in KeyError: 'ID', exit 1
    client = EtcdClient(EtcdOptions((parse_endpoint(not_etcd, 2379),)), deadline=30)
    with pytest.raises(NotAGateway, match="is not an etcd v3 gateway") as raised:
        client.grant(3)  # at once: no retry would change the answer (within 30 s, it would be EtcdUnavailable)
    assert "\n" not in str(raised.value) and not_etcd in str(raised.value)
    plane = EtcdControlPlane(launch_config(not_etcd), "agent-0", "127.0.0.1", Signer())
    try:
        with pytest.raises(RendezvousError, match=f"{not_etcd} is not an etcd v3 gateway") as raised:
            plane.find(30, joined=False)
        assert raised.value.exit_code == ExitCode.RENDEZVOUS
    finally:
        plane.leave()


def test_the_first_contact_with_etcd_waits_no_longer_than_the_rdzv_timeout_issue_40():
    # an unreachable endpoint with --rdzv-timeout 3 took 10.3 s: the client's own deadline won
    plane = EtcdControlPlane(launch_config("127.0.0.1:1", rdzv_timeout=3), "agent-0", "127.0.0.1", Signer())
    assert plane.client.deadline == 3
    plane.leave()
    plane = EtcdControlPlane(launch_config("127.0.0.1:1"), "agent-0", "127.0.0.1", Signer())
    assert plane.client.deadline == CALL_DEADLINE  # --rdzv-timeout's default (600 s): a call's own deadline
    plane.leave()


def test_a_journal_comes_back_as_it_was_written():
    view = JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.PROCESS, phase=Phase.REPAIR,
                   level=Level.PROCESS, generation=2, restarts_used=1, replacing=frozenset({1, 3}),
                   lost=frozenset({0}))
    slot = NodeSlot(0, "h:1", "h", 2, 0)
    journal = Journal("h:1", "h", view, RendezvousResult((slot,), 4), (slot,), (), 4, moves=1, started_at=1795670150.73)
    assert from_json(Journal, to_json(journal)) == journal
    assert Journal.from_parts({name: to_json(part) for name, part in journal.parts().items()}) == journal


class RecordingOffice:
    """A Leadership's write, recorded: the keys each transaction puts."""

    def __init__(self):
        self.keys = EtcdKeys("journal")
        self.writes: list[list[str]] = []

    def write(self, ops: list[dict]) -> None:
        self.writes.append([base64.b64decode(op["request_put"]["key"]).decode().rsplit("/", 1)[1] for op in ops])


def journal_of(nodes: int, view_generation: int = 0) -> Journal:
    slots = tuple(NodeSlot(n, f"a{n}", "h", 2, 2 * n) for n in range(nodes))
    view = JobView(node_count=nodes, max_restarts=3, world_size=2 * nodes, generation=view_generation)
    return Journal("a0", "h", view, RendezvousResult(slots, 2 * nodes), slots, (), 2 * nodes)


def test_a_decision_rewrites_only_the_journal_parts_it_changed():
    office, writer = RecordingOffice(), JournalWriter()
    first = journal_of(4)
    writer.write(office, first)
    assert office.writes == [["decision", "roster", "rendezvous"]]  # a controller's first write: every part
    writer.write(office, dataclasses.replace(first, view=dataclasses.replace(first.view, generation=1)))
    assert office.writes[-1] == ["decision"]  # the rendezvous result and the roster stay as written
    moved = dataclasses.replace(first.nodes[1], agent_id="spare")
    writer.write(office, dataclasses.replace(first, nodes=(first.nodes[0], moved, *first.nodes[2:])))
    assert office.writes[-1] == ["decision", "roster"]
    assert JournalWriter().write(office, first) > 0 and office.writes[-1] == ["decision", "roster", "rendezvous"]


def test_once_the_job_is_over_the_exit_acknowledgements_are_not_journaled():
    office, writer, running = RecordingOffice(), JournalWriter(), journal_of(4)
    writer.write(office, running)
    exiting = dataclasses.replace(running.view, phase=Phase.EXITING, exit_code=1, reason="rank 3 failed")
    writer.write(office, dataclasses.replace(running, view=exiting))
    assert office.writes[-1] == ["decision"]  # what a successor reads: the job is over, and why
    acknowledged = dataclasses.replace(exiting, acknowledged=frozenset({0, 1}))
    assert writer.write(office, dataclasses.replace(running, view=acknowledged)) == 0
    assert len(office.writes) == 2


def test_a_successor_rewrites_only_what_it_changed_of_the_journal_it_read():
    office, read = RecordingOffice(), journal_of(4)
    writer = JournalWriter(resumed=read)
    writer.write(office, dataclasses.replace(read, leader="a1", moves=1))
    assert office.writes == [["decision"]]  # the roster and the rendezvous result are in etcd as it read them


def test_a_journal_written_in_parts_is_read_back_whole(etcd):
    keys = EtcdKeys("parts")
    office = Leadership(EtcdClient(options(etcd)), keys, "a0", ttl=3)
    assert office.try_lead()
    writer, first = JournalWriter(), journal_of(3)
    assert read_journal(office.client, keys) is None
    writer.write(office, first)
    later = dataclasses.replace(first, view=dataclasses.replace(first.view, generation=2), started_world=4)
    writer.write(office, later)
    assert read_journal(office.client, keys) == later
    office.resign()


def test_a_head_started_again_finds_a_run_going_on_by_its_leader_its_launch_or_its_journal(etcd):
    from ftrun.controller.journal import DecisionPart
    from ftrun.head.etcd import run_is_going_on

    client = EtcdClient(options(etcd))
    keys = EtcdKeys("head-again")
    assert not run_is_going_on(client, keys, gap=0.2)  # nothing in etcd: launch it
    # a head launched it a moment ago, its agents still starting: the one started again waits for a leader
    client.put(keys.launch, "head:1", client.grant(60))
    threading.Timer(0.5, lambda: client.put(keys.leader, "127.0.0.2:7")).start()
    assert run_is_going_on(client, keys, gap=0.2)
    client.delete_prefix(keys.root)
    # a launch that failed said so (its key deleted), or whose lease lapsed: nothing to wait for
    client.put(keys.launch, "head:1", client.grant(1))
    assert not run_is_going_on(client, keys, gap=0.2)
    # the journal of a run going on, between two controllers, and of one that ended
    view = JobView(node_count=2, max_restarts=3, world_size=4)
    decision = DecisionPart("127.0.0.2:7", "127.0.0.2", view, 4, 0)
    client.put(keys.journal_part("decision"), to_json(decision))
    threading.Timer(0.5, lambda: client.put(keys.leader, "127.0.0.3:8")).start()
    assert run_is_going_on(client, keys, gap=30)
    client.delete_prefix(keys.leader)
    assert not run_is_going_on(client, keys, gap=0.2)  # no controller came: its agents are gone
    over = dataclasses.replace(decision, view=dataclasses.replace(view, phase=Phase.DONE))
    client.put(keys.journal_part("decision"), to_json(over))
    assert not run_is_going_on(client, keys, gap=30)  # ended: a fresh launch, at once


def test_of_two_heads_started_at_once_for_a_run_one_says_its_launch(etcd):
    from ftrun.head.etcd import say_launch

    client = EtcdClient(options(etcd))
    keys = EtcdKeys("two-heads")
    assert say_launch(client, keys) and not say_launch(client, keys)  # the second follows the first's launch
    client.delete_prefix(keys.launch)  # the first's launch is over (its controller took office)
    assert say_launch(client, keys)
