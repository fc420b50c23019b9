"""What the controller publishes for the agents after failure reports, over a real TCPStore on loopback
(the policy's decisions are test_policy.py's; here: when their commands go out)."""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time

import pytest

from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.contract import Milestone
from ftrun.controller.controller import Controller, RecoveryPolicy
from ftrun.controller.inbox import Reported
from ftrun.controller.states import JobView, Level, Phase
from ftrun.etcd import EtcdUnavailable
from ftrun.keys import EtcdKeys, JobKeys
from ftrun.messages import Command, CommandKind, NodeLayout, NodeSlot, RendezvousResult, Report, ReportKind, WorkerFailure
from ftrun.rendezvous import RendezvousPolicy
from ftrun.store import ControlStore
from tests.conftest import FakeClock

HOLD = 0.08


@pytest.fixture
def controller():
    """A controller of a running 2 nodes x 2 ranks job under ftrun.elastic, --recovery process."""
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    store = ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, Signer())
    made = Controller(store, JobKeys("commands"), RendezvousPolicy(2, 2, 0.0, 5.0), "agent-0", "127.0.0.1",
                      RecoveryPolicy(max_restarts=3, recovery=Level.PROCESS, node_timeout=10.0, stop_timeout=5.0,
                                     repair_timeout=60.0, gather_timeout=HOLD))
    made.view = JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.PROCESS, library_ranks=4)
    made.publisher.clock = FakeClock()  # the held commands' moment comes when the test says
    return made


def failed(*ranks: int) -> Report:
    node = ranks[0] // 2
    return Report(ReportKind.WORKER_FAILED, node, 0, tuple(
        WorkerFailure(rank=r, local_rank=r % 2, node_rank=node, host=f"h{node}", pid=100 + r, exit_code=-9,
                      generation=0) for r in ranks))


def published(controller: Controller) -> list[Command]:
    return controller.store.read_from(controller.keys.command_count, controller.keys.command, Command, 0)


def test_a_repair_s_replacements_go_out_a_moment_after_the_healthy_ranks_are_told(controller):
    controller.take([Reported(failed(3))])
    assert (controller.view.phase, controller.view.level) == (Phase.STOPPING, Level.PROCESS)
    assert controller.store.try_text(controller.keys.target_generation) == "1"  # the healthy ranks leave now
    controller.publisher.release_held()
    assert published(controller) == []  # the replacement waits for more reports
    controller.publisher.clock.advance(HOLD)
    controller.publisher.release_held()
    assert [(c.kind, c.generation, c.ranks) for c in published(controller)] == [(CommandKind.REPLACE, 1, (3,))]


def test_a_whole_job_crash_reported_rank_by_rank_takes_no_warm_standby_for_a_doomed_repair(controller):
    # the deaths of a whole job's crash come a few milliseconds apart, each node's in its own report
    for report in (failed(2), failed(0, 1), failed(3)):
        controller.take([Reported(report)])
    assert (controller.view.phase, controller.view.level, controller.view.no_replica) == (Phase.STOPPING, Level.JOB,
                                                                                          True)
    controller.publisher.clock.advance(HOLD)
    controller.publisher.release_held()
    # no REPLACE ever reached an agent: the restart's ranks find every standby warm
    assert [c.kind for c in published(controller)] == [CommandKind.STOP]


def test_staggered_deaths_of_every_rank_after_the_replacements_started_stay_one_repair_with_snapshots(controller):
    # the first death's replacement took its node's warm standby; the others die over the next second.
    # A job-level restart now would kill it and want four warm standbys where three are left
    controller.view = dataclasses.replace(controller.view, snapshots=True)
    controller.take([Reported(failed(3))])
    controller.publisher.clock.advance(HOLD)
    controller.take(controller.executor.release_held())
    assert controller.view.replacements_started
    for report in (failed(2), failed(0, 1)):
        controller.take([Reported(report)])
    controller.publisher.clock.advance(HOLD)
    controller.take(controller.executor.release_held())
    view = controller.view
    assert (view.phase, view.level, view.generation, view.restarts_used) == (Phase.STOPPING, Level.PROCESS, 3, 1)
    assert [(c.kind, c.generation, c.ranks) for c in published(controller)] == [
        (CommandKind.REPLACE, 1, (3,)), (CommandKind.REPLACE, 2, (2,)), (CommandKind.REPLACE, 3, (0, 1))]
    assert controller.store.try_text(controller.keys.target_generation) == "3"


def test_a_job_level_restart_waits_for_every_node_s_signed_acknowledgement_and_counts_its_failures(controller,
                                                                                                  monkeypatch):
    from ftrun.agent.protocol import NodeProtocol

    controller.roster.nodes = {n: NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in (0, 1)}
    controller.view = dataclasses.replace(controller.view, recovery=Level.JOB, library_ranks=0)
    controller.take([Reported(failed(3))])
    assert (controller.view.phase, controller.view.level) == (Phase.STOPPING, Level.JOB)
    agents = []
    for n in (0, 1):
        agents.append(NodeProtocol(controller.store, controller.keys, f"agent-{n}", node_timeout=10.0))
        agents[-1].node_rank = n
    agents[0].acknowledge_stop(0)
    controller.tick(0.0)
    assert controller.view.phase is Phase.STOPPING  # node 1 still has workers
    # a stale agent's word for node 1, and a text anyone could write under its agent's key: neither counts
    NodeProtocol(controller.store, controller.keys, "gone", node_timeout=10.0).acknowledge_stop(0)
    controller.store.set_text(controller.keys.stopped(0, "agent-1"), '{"kind": "stopped"}')
    controller.tick(0.0)
    assert (controller.view.phase, controller.view.acknowledged) == (Phase.STOPPING, frozenset({0}))
    # node 1's rank 2 died as it stopped: reported, then the stop acknowledged, both just after the
    # controller read the reports; the failure still counts before the restart
    read_from, written = controller.store.read_from, []

    def written_as_the_reports_are_read(*args):
        found = read_from(*args)
        if not written:
            written.append(agents[1].report(ReportKind.WORKER_FAILED, 0, failures=failed(2).failures))
            agents[1].acknowledge_stop(0)
        return found

    monkeypatch.setattr(controller.store, "read_from", written_as_the_reports_are_read)
    controller.tick(0.0)
    controller.tick(0.0)
    assert (controller.view.phase, controller.view.generation) == (Phase.RUNNING, 1)
    assert sorted(f.rank for f in controller.view.failures) == [2, 3]  # counted before the restart
    assert [c.kind for c in published(controller)] == [CommandKind.STOP, CommandKind.START]
    assert controller.store.counter(controller.keys.report_count) == 1  # the failure: no acknowledgement in it


def test_a_start_says_the_world_before_it_and_the_layout_a_repair_s_replacement_sees_no_resize(controller):
    controller.roster.nodes = {n: NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in (0, 1)}
    controller.executor.apply((controller.view, [Command(CommandKind.START, 0)]))
    # node 1 lost, no spare: the job goes on with node 0 alone (a scale-in restarts every rank)
    shrunk = dataclasses.replace(controller.view, lost=frozenset({1}), world_size=2)
    controller.executor.apply((shrunk, [Command(CommandKind.START, 1)]))
    controller.executor.apply((shrunk, [Command(CommandKind.REPLACE, 2, ranks=(1,))]))
    controller.publisher.clock.advance(HOLD)
    controller.publisher.release_held()
    first, second, repair = published(controller)
    assert (first.previous_world_size, first.layout) == (0, 1)
    assert (second.previous_world_size, second.layout) == (4, 2)  # what on_resize is called with: 4 -> 2
    assert (repair.previous_world_size, repair.layout) == (2, 2)  # the same world as the generation before
    assert controller.store.get(NodeLayout, controller.keys.layout).nodes == (controller.roster.nodes[0],)


#: only there to turn a controller that stopped beating into a failure
BEATS_DEADLINE = 30


class OfficeWithoutQuorum:
    """A controller's office in an etcd that has lost its quorum: its writes wait as ``waits`` say, each
    (beats, refused): a write returns once the controller's keepalive (``heartbeats()``, the counter an
    agent watches) has moved ``beats`` times while it waited; a refused one then gives up
    (EtcdUnavailable), as the client does. Later ones are written at once. No wall time is measured: a
    controller that beats only between its tries never lets a write return, and the deadline fails it."""

    def __init__(self, waits: list[tuple[int, bool]], heartbeats):
        self.keys = EtcdKeys("no-quorum")
        self.lost = threading.Event()
        self.unreachable_since = 1.0  # the lease's renewals fail too
        self.waits, self.written, self.heartbeats = waits, 0, heartbeats

    def write(self, ops: list[dict]) -> None:
        beats, refused = self.waits.pop(0) if self.waits else (0, False)
        first, deadline = self.heartbeats(), time.monotonic() + BEATS_DEADLINE
        while self.heartbeats() < first + beats:
            assert time.monotonic() < deadline, f"the keepalive did not move {beats} times while etcd was awaited"
            time.sleep(0.02)
        if refused:
            raise EtcdUnavailable("no etcd member answered within 1s")
        self.written += 1


def test_a_decision_that_waits_for_etcd_keeps_the_controllers_keepalive_beating_issue_40(controller):
    # the decision's journal waited in the controller's thread (10 s a try, while etcd had no quorum):
    # its keepalive stopped, and every agent took the controller for lost after --node-timeout
    # what an agent's keepalive reads: the controller's counter, beaten all along each try of etcd (every
    # 0.5 s), not once after each
    office = OfficeWithoutQuorum([(1, True), (3, False)],
                                 lambda: controller.store.counter(controller.keys.controller_heartbeat))
    controller.office.leadership = office
    controller.roster.nodes = {n: NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in (0, 1)}
    controller.executor.rendezvous = RendezvousResult(tuple(controller.roster.nodes.values()), 4)
    controller.take([Reported(failed(3))])  # waits for the journal: one try refused, the next one written
    assert office.written == 1 and office.waits == []
    assert controller.narrator.etcd_down  # said once, while it waited
    assert controller.store.try_text(controller.keys.target_generation) == "1"  # the ranks were told at once
    controller.publisher.clock.advance(HOLD)
    controller.take(controller.executor.release_held())  # and the replacement goes out once the journal holds the decision
    assert [(c.kind, c.generation, c.ranks) for c in published(controller)] == [(CommandKind.REPLACE, 1, (3,))]


def test_a_failure_after_the_ranks_resumed_is_a_repair_of_its_own_however_far_behind_the_controller_is(controller):
    # the controller's decisions waited for etcd while the ranks finished the repair on their own; a rank
    # killed as etcd answered was taken for a failure of that repair's rollback, its replacement for one
    # without state (issue 40)
    controller.take([Reported(failed(3))])
    controller.publisher.clock.advance(HOLD)
    controller.take(controller.executor.release_held())
    controller.view = dataclasses.replace(controller.view, phase=Phase.REPAIR)  # as far as it got
    for milestone in (Milestone.JOINED, Milestone.RESUMED):  # where the ranks are: training again
        controller.store.add(controller.keys.milestone(1, milestone.value), 4)
    controller.take([Reported(dataclasses.replace(failed(2), generation=1))])  # its agent is in generation 1 too
    view = controller.view
    assert (view.phase, view.level, view.generation, view.restarts_used) == (Phase.STOPPING, Level.PROCESS, 2, 2)
    assert view.replacing == {2} and view.stateless == frozenset()  # rank 3's replacement holds the state now


def test_a_controller_stopped_past_the_node_timeout_counts_no_silence_of_its_own_stop(controller):
    # its agent SIGSTOPped for 8 s with --node-timeout 3, and woken still in office (etcd kept its lease):
    # every agent was silent meanwhile, its store stopped with it. Counted, the spares were dropped at once,
    # the agents that looked for it in etcd meanwhile were lost, and with them the job
    timeout = controller.policy.node_timeout
    for now in (100.0, 100.5, 101.0):  # turning: nothing to forgive
        controller.pause.turned(now)
        assert controller.roster.silent_nodes(controller.view, now, timeout) == []  # first seen at 100.0
    controller.pause.turned(101.0 + timeout + 1)  # the process stopped for longer than the timeout
    woken = 101.0 + timeout + 1
    assert controller.roster.silent_nodes(controller.view, woken, timeout) == []
    assert controller.roster.silent_nodes(controller.view, woken + timeout + 0.5, timeout) == []  # back from etcd
    assert controller.roster.silent_nodes(controller.view, woken + 2 * timeout + 0.5, timeout) == [0, 1]  # never


def test_a_controller_that_turns_counts_the_agents_silence_as_ever(controller):
    timeout = controller.policy.node_timeout
    now = 100.0
    controller.roster.silent_nodes(controller.view, now, timeout)  # first seen
    while now < 100.0 + timeout + 0.5:
        now += 1.0
        controller.pause.turned(now)
    assert controller.roster.silent_nodes(controller.view, now, timeout) == [0, 1]
