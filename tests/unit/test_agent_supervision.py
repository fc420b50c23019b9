"""What a node sees and reports (ftrun/agent/supervision.py): real worker processes, the node's real
protocol over a real TCPStore, the clock passed in where a wait would be."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

from ftrun.detection.links import interface_watch
from ftrun.messages import CommandKind, NodeStatus, ReportKind
from tests.unit.node_parts import AGENT


def started(node):
    node.commands.carry_out(node.command(CommandKind.START))
    return node


def test_a_keepalive_publishes_the_nodes_ranks_and_beats(node):
    n = started(node("sleep,sleep"))
    n.supervision.tend(now=100.0)
    status = n.store.try_get(NodeStatus, n.keys.agent_status(AGENT))
    assert [(r.rank, r.alive, r.restarts) for r in status.ranks] == [(0, True, 0), (1, True, 0)]
    assert n.store.counter(n.keys.node_heartbeat(0)) == 1
    n.supervision.tend(now=100.1)  # the next one is not due yet
    assert n.store.counter(n.keys.node_heartbeat(0)) == 1


def test_a_rank_that_fails_is_reported_with_its_exit_code_and_the_answer_is_looked_for_often(node):
    n = started(node("0,3"))
    n.wait_ended(2)
    n.supervision.report_ended(now=10.0)
    [report] = n.reports()
    assert report.kind is ReportKind.WORKER_FAILED
    assert [(f.rank, f.exit_code) for f in report.failures] == [(1, 3)]
    assert n.supervision.answer_due == 10.0 + 1.0
    n.supervision.report_ended(now=11.0)  # nothing new ended
    assert n.reports() == []


def test_a_generation_that_succeeds_is_reported_once(node):
    n = started(node("0,0"))
    n.wait_ended(2)
    n.supervision.report_ended(now=1.0)
    assert [r.kind for r in n.reports()] == [ReportKind.SUCCEEDED]
    n.supervision.report_ended(now=2.0)
    assert n.reports() == []


def test_an_interrupt_is_reported_once_and_left_alone_after_the_grace(node):
    n = started(node("sleep,sleep"))
    n.interrupts.request(signal.SIGINT)
    n.supervision.tend(now=50.0)
    n.supervision.tend(now=51.0)
    [report] = n.reports()
    assert (report.kind, report.exit_code) == (ReportKind.INTERRUPTED, n.interrupts.exit_code)
    assert n.group.stop_signal == n.interrupts.worker_signal
    assert not n.supervision.unanswered(now=55.0)
    assert n.supervision.unanswered(now=61.0)


def test_a_failure_after_the_interrupt_is_not_reported(node):
    n = started(node("sleep,3"))
    n.interrupts.request(signal.SIGTERM)
    n.supervision.tend(now=1.0)
    n.wait_ended(1)
    n.supervision.report_ended(now=2.0)
    assert [r.kind for r in n.reports()] == [ReportKind.INTERRUPTED]


def test_a_stopped_rank_without_heartbeats_is_judged_hung_killed_and_reported(node):
    n = started(node("tick,sleep", hang_timeout=1.0))
    os.kill(n.group.workers[1].pid, signal.SIGSTOP)
    now = time.monotonic()  # the clock its start was judged from
    n.supervision.keepalive(now=now + 1.0, judge_hangs=True)
    time.sleep(0.3)  # rank 0 prints meanwhile
    n.supervision.keepalive(now=now + 5.0, judge_hangs=True)  # past --hang-timeout and a sleeper's grace
    n.wait_ended(1)
    n.supervision.report_ended(now=now + 6.0)
    [report] = n.reports()
    [failure] = report.failures
    assert (failure.rank, failure.cause) == (1, "hang")
    assert "no output and no CPU progress" in failure.detail
    assert n.group.workers[0].returncode is None


def test_hangs_are_not_judged_without_the_flag(node):
    n = started(node("sleep,sleep"))
    os.kill(n.group.workers[1].pid, signal.SIGSTOP)
    now = time.monotonic()
    n.supervision.keepalive(now=now + 1.0, judge_hangs=True)
    n.supervision.keepalive(now=now + 100.0, judge_hangs=True)
    assert all(w.returncode is None and w.proc.poll() is None for w in n.group.workers)


def test_each_start_of_a_rank_counts_as_a_restart_in_the_status(node):
    n = started(node("sleep,3"))
    n.wait_ended(1)
    n.supervision.report_ended(now=1.0)
    n.commands.carry_out(n.command(CommandKind.REPLACE, 1, ranks=(1,)))
    n.supervision.keepalive(now=2.0, judge_hangs=False)
    status = n.store.try_get(NodeStatus, n.keys.agent_status(AGENT))
    assert [(r.rank, r.restarts) for r in status.ranks] == [(0, 0), (1, 1)]


def test_after_the_controller_moved_the_failures_since_the_ranks_started_are_said_to_each_new_controller(node):
    """The old store may have gone before it took the report, or its controller before its journal held the
    decision (it died inside an etcd outage): every successor hears them, and leaves out what it knows."""
    n = started(node("sleep,sleep"))
    n.supervision.failures_told.append((0, ()))  # reported in the old store
    n.supervision.moved()
    [report] = n.reports()
    assert (report.kind, report.generation) == (ReportKind.WORKER_FAILED, 0)
    n.supervision.moved()  # and the next controller too
    [report] = n.reports()
    assert (report.kind, report.generation) == (ReportKind.WORKER_FAILED, 0)


def test_a_data_link_gone_dark_and_back_is_reported_and_the_probe_is_published(node, tmp_path):
    n = node("sleep,sleep")
    sysfs = tmp_path / "net" / "data"
    sysfs.mkdir(parents=True)
    (sysfs / "operstate").write_text("up\n")
    (sysfs / "carrier").write_text("1\n")
    n.supervision.health.sources.append(interface_watch({"GLOO_SOCKET_IFNAME": "data"}, str(tmp_path / "net")))
    n.supervision.tend(now=1.0)
    (sysfs / "operstate").write_text("down\n")
    (sysfs / "carrier").write_text("0\n")
    n.supervision.tend(now=2.0)
    (sysfs / "operstate").write_text("up\n")
    (sysfs / "carrier").write_text("1\n")
    n.supervision.tend(now=3.0)
    assert [(r.kind, r.detail) for r in n.reports()] == [
        (ReportKind.LINK_DOWN, "data link data dark (operstate down, no carrier)"),
        (ReportKind.LINK_UP, "data link data back up (operstate up, carrier)")]
    n.supervision.start_probe("127.0.0.1")
    try:
        assert n.store.try_text(n.keys.data_probe(0)) == n.supervision.probe.endpoint
        n.supervision.tend(now=4.0)  # a node alone probes nobody
        assert n.store.try_get(NodeStatus, n.keys.agent_status(AGENT)).unreachable == ()
    finally:
        n.supervision.probe.stop()


def test_a_spare_probes_the_data_network_under_an_id_of_its_own_and_keeps_its_probe_when_it_takes_a_node(node):
    n = node("sleep,sleep")
    supervision, seat = n.supervision, n.supervision.seat
    seat.slot = dataclasses.replace(seat.slot, node_rank=-1)  # standing by: no node yet
    n.store.add(n.keys.spare_probes, 1)  # another spare took -1 before
    supervision.start_probe("127.0.0.1")
    try:
        endpoint = supervision.probe.endpoint
        assert supervision.probe_id == -2 and n.store.try_text(n.keys.data_probe(-2)) == endpoint
        supervision.publish_status()
        assert n.store.try_get(NodeStatus, n.keys.agent_status(AGENT)).probe_id == -2
        for peer in (-1, 0):
            n.store.set_text(n.keys.data_probe(peer), f"127.0.0.1:{9000 - peer}")
        supervision.aim_probe(now=1.0)
        assert supervision.probe._targets == {0: ("127.0.0.1", 9000)}  # the spares on the ring: read in this round
        supervision.aim_probe(now=2.0)
        assert supervision.probe._targets == {-1: ("127.0.0.1", 9001), 0: ("127.0.0.1", 9000)}  # never itself
        seat.take(0)
        supervision.start_probe("127.0.0.1")  # the node's parts start: the spare's probe goes on, under its node rank too
        assert supervision.probe.endpoint == endpoint and supervision.probe_id == 0
        assert n.store.try_text(n.keys.data_probe(0)) == endpoint
        supervision.publish_status()
        assert n.store.try_get(NodeStatus, n.keys.agent_status(AGENT)).probe_id is None
    finally:
        supervision.probe.stop()
