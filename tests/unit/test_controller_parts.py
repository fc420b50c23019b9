"""The controller's parts one by one: the online hold and ``decide`` in the policy (pure), the observers
over a real TCPStore on loopback with an injected clock, the roster lookup, the etcd office, and one
turn of the whole loop with a clock the test moves."""

from __future__ import annotations

import dataclasses
import datetime
import threading

import pytest

from ftrun.auth import Signer
from ftrun.config import Endpoint
from ftrun.contract import CollectiveFailure, Fallback, Milestone, RollbackFailure
from ftrun.controller import inbox
from ftrun.controller.controller import Controller, RecoveryPolicy
from ftrun.controller.executor import Executor
from ftrun.controller.inbox import (
    CollectiveFailed,
    HostGone,
    MilestoneReached,
    NodeLost,
    OperatorAsked,
    RepairFailed,
    Reported,
    StopAsked,
)
from ftrun.controller.lookup import RosterLookup
from ftrun.controller.observers import Collectives, Repair
from ftrun.controller.office import EtcdOffice
from ftrun.controller.policy import (
    ONLINE_GRACE,
    decide,
    on_collective_failed,
    on_collective_seen,
    on_milestone,
    on_node_lost,
    on_report,
    on_stop,
)
from ftrun.controller.roster import Roster
from ftrun.controller.states import Heard, JobView, Level, Phase
from ftrun.errors import ExitCode
from ftrun.keys import JobKeys
from ftrun.messages import NodeSlot, OperatorAction, OperatorRequest, RendezvousResult, Report, ReportKind, WorkerFailure
from ftrun.rendezvous import RendezvousPolicy
from ftrun.store import ControlStore
from tests.conftest import FakeClock

NODES = {n: NodeSlot(n, f"agent-{n}", f"h{n}", 2, 2 * n) for n in (0, 1)}
SPARE = NodeSlot(-1, "agent-spare", "h9", 2, -1)


def ready(**fields) -> JobView:
    """A running job of 2 nodes x 2 ranks, every rank under ftrun.elastic, --recovery process."""
    return JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.PROCESS, library_ranks=4, **fields)


def cut(rank: int = 1, generation: int = 0) -> CollectiveFailure:
    return CollectiveFailure(rank, generation, "Read error [127.0.0.1]:906: Connection reset by peer", at=100.0)


def seen(at: float, counts: tuple[int, int] = (5, 5), rank: int = 1) -> CollectiveFailed:
    return CollectiveFailed(cut(rank), 0, "h0", at, tuple(Heard(n, c) for n, c in enumerate(counts)))


def died(rank: int = 1, node: int = 0, generation: int = 0, kind: ReportKind = ReportKind.WORKER_FAILED) -> Report:
    failure = WorkerFailure(rank=rank, local_rank=rank % 2, node_rank=node, host=f"h{node}", pid=100 + rank,
                            exit_code=-9, generation=generation)
    return Report(kind, node, generation, (failure,) if kind is ReportKind.WORKER_FAILED else ())


# -- the online hold (policy, pure) --------------------------------------------------------------------


def test_the_first_sight_of_a_failed_collective_holds_it_and_decides_nothing():
    v, commands = on_collective_seen(ready(), seen(10.0))
    assert (v.phase, commands) == (Phase.RUNNING, [])
    assert v.held is not None and (v.held.generation, v.held.since) == (0, 10.0)


def test_a_held_collective_waits_out_the_grace():
    held, _ = on_collective_seen(ready(), seen(10.0))
    assert on_collective_seen(held, seen(10.0 + ONLINE_GRACE / 2, (6, 6))) == (held, [])


def test_a_held_collective_waits_for_every_node_to_be_heard_from_since():
    held, _ = on_collective_seen(ready(), seen(10.0))
    # node 1's agent said nothing since: it may be gone with its ranks, and its loss decides
    assert on_collective_seen(held, seen(10.0 + ONLINE_GRACE, (6, 5))) == (held, [])


def test_transition_held_to_online_once_the_grace_passed_and_every_node_was_heard():
    held, _ = on_collective_seen(ready(), seen(10.0))
    v, commands = on_collective_seen(held, seen(10.0 + ONLINE_GRACE, (6, 6)))
    expected = on_collective_failed(held, cut(), 0, "h0")
    assert (v, commands) == expected
    assert (v.phase, v.level, v.generation) == (Phase.STOPPING, Level.ONLINE, 1)


def test_a_death_reported_during_the_hold_decides_and_the_failed_collective_was_its_echo():
    held, _ = on_collective_seen(ready(), seen(10.0))
    v, _ = on_report(held, died(rank=1))
    assert (v.phase, v.level, v.replacing) == (Phase.STOPPING, Level.PROCESS, {1})
    assert on_collective_seen(v, seen(11.0, (9, 9))) == (v, [])  # no longer watched


def test_without_process_level_a_failed_collective_is_not_even_held():
    job_level = JobView(node_count=2, max_restarts=3, world_size=4, recovery=Level.JOB, library_ranks=4)
    assert on_collective_seen(job_level, seen(10.0)) == (job_level, [])


def test_a_hold_from_an_earlier_generation_starts_again():
    held, _ = on_collective_seen(ready(), seen(10.0))
    later = dataclasses.replace(held, generation=1)
    v, commands = on_collective_seen(later, dataclasses.replace(seen(20.0), failure=cut(generation=1)))
    assert commands == [] and v.held is not None and (v.held.generation, v.held.since) == (1, 20.0)


# -- decide: each event to its rule ---------------------------------------------------------------------

STOP = OperatorRequest(OperatorAction.STOP, "ops")


@pytest.mark.parametrize("event, rule", [
    (Reported(died()), lambda v: on_report(v, died())),
    (MilestoneReached(Milestone.STOPPED), lambda v: on_milestone(v, Milestone.STOPPED)),
    (NodeLost(NODES[1], "node 1 lost", "agent-spare"), lambda v: on_node_lost(v, 1, "node 1 lost", "agent-spare", (2, 3))),
    (StopAsked(ExitCode.INTERRUPTED, "Ctrl-C"), lambda v: on_stop(v, ExitCode.INTERRUPTED, "Ctrl-C")),
    (OperatorAsked(STOP, None, "", 0, 1.0, ""), lambda v: on_stop(v, ExitCode.INTERRUPTED, "stopped by ops from ftrun top")),
    (OperatorAsked(STOP, None, "", 0, 1.0, "the job is ending"), lambda v: (v, [])),
    (inbox.StopsAcknowledged(7, frozenset({0})), lambda v: (v, [])),  # another generation's
])
def test_decide_hands_each_event_to_its_rule(event, rule):
    assert decide(ready(), event) == rule(ready())


def test_a_repair_failed_during_a_process_level_repair_falls_back_to_job_level():
    v, _ = on_report(ready(), died())
    failure = RollbackFailure(Fallback.NO_SNAPSHOTS)
    after, commands = decide(v, RepairFailed(failure.reason, failure))
    assert (after.phase, after.level, after.fallback) == (Phase.STOPPING, Level.JOB, failure)


# -- the observers (a real store on loopback, an injected clock) -------------------------------------------


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
    return ControlStore(raw, Endpoint("127.0.0.1", raw.port), True, Signer())


KEYS = JobKeys("parts")


def repairing() -> JobView:
    view, _ = on_report(ready(), died(rank=3, node=1))
    return view


def test_the_repair_observer_says_a_milestone_once_every_healthy_rank_reached_it(store):
    observer = Repair(store, KEYS, timeout=60.0, decided_at=lambda: 100.0, wall=lambda: 101.0)
    view = repairing()
    store.add(KEYS.milestone(view.generation, Milestone.STOPPED.value), 2)
    assert observer.observe(view) == []  # 3 healthy ranks stop, 2 did
    store.add(KEYS.milestone(view.generation, Milestone.STOPPED.value), 1)
    assert observer.observe(view) == [MilestoneReached(Milestone.STOPPED)]


def test_the_repair_observer_says_the_deadline_by_the_clock_it_is_given(store):
    wall = FakeClock(100.0)
    observer = Repair(store, KEYS, timeout=60.0, decided_at=lambda: 100.0, wall=wall)
    view = repairing()
    wall.advance(59.0)
    assert observer.observe(view) == []
    wall.advance(2.0)
    assert observer.observe(view) == [RepairFailed("the repair did not finish within 60s (stuck in stopping)")]
    assert observer.observe(ready()) == []  # nothing to watch while the job runs


def test_the_collectives_observer_says_the_failure_with_every_node_s_keepalives(store):
    roster = Roster(store, KEYS)
    roster.nodes = dict(NODES)
    observer = Collectives(store, KEYS, roster)
    assert observer.observe(ready(), 5.0) == []
    store.add(KEYS.node_heartbeat(1), 3)
    store.raw.compare_set(KEYS.collective_failure(0), "", cut(rank=2).to_text())
    [event] = observer.observe(ready(), 5.0)
    assert (event.failure.rank, event.node_rank, event.host, event.seen) == (2, 1, "h1", 5.0)
    assert event.heard == (Heard(0, 0), Heard(1, 3))
    assert observer.observe(JobView(node_count=2, max_restarts=3, world_size=4), 5.0) == []  # job level


# -- the roster lookup ----------------------------------------------------------------------------------


def lookup(store, spares=(SPARE,)) -> RosterLookup:
    roster = Roster(store, KEYS)
    roster.nodes, roster.spares = dict(NODES), list(spares)
    return RosterLookup(roster, type("Board", (), {"snapshot": {"ranks": [{"rank": 3, "pid": 4242}]}})(), True)


def test_a_node_without_devices_is_lost_when_a_spare_can_take_it(store):
    unusable = Report(ReportKind.NODE_UNUSABLE, 1, 0, detail="no usable NPU")
    assert lookup(store).complete(Reported(unusable), ready()) == NodeLost(NODES[1], "node 1 (h1): no usable NPU",
                                                                          "agent-spare")
    assert lookup(store, spares=()).complete(Reported(unusable), ready()) == Reported(unusable)


def test_a_report_from_an_agent_that_no_longer_holds_the_node_is_dropped(store):
    stale = dataclasses.replace(died(rank=3, node=1), agent_id="agent-gone")
    assert lookup(store).complete(Reported(stale), ready()) is None


def test_a_host_gone_is_its_node_lost_with_the_spare_that_can_take_it(store):
    event = lookup(store).complete(HostGone("h1", "h1's session ended"), ready())
    assert event == NodeLost(NODES[1], "h1's session ended", "agent-spare")
    assert lookup(store).complete(HostGone("h7", "unknown"), ready()) is None


def test_a_drill_is_answered_with_the_rank_s_node_and_pid(store):
    drill = OperatorRequest(OperatorAction.RESTART, "ops", rank=3)
    event = lookup(store).complete(OperatorAsked(drill, None, "", 0, 1.0, ""), ready())
    assert (event.slot, event.pid, event.refusal) == (NODES[1], 4242, "")
    busy = dataclasses.replace(ready(), phase=Phase.STOPPING)
    assert "a repair is under way" in lookup(store).complete(OperatorAsked(drill, None, "", 0, 1.0, ""), busy).refusal


# -- the etcd office ---------------------------------------------------------------------------------------


class Lease:
    """A leadership whose lease could not be renewed since ``unreachable_since`` (0: it answers)."""

    def __init__(self):
        self.lost, self.unreachable_since = threading.Event(), 0.0


def office(store, leadership, clock) -> EtcdOffice:
    from ftrun.controller.narrator import Narrator
    from ftrun.controller.publisher import Publisher
    from ftrun.controller.roster import OwnPause
    from ftrun.events import EventLog

    roster = Roster(store, KEYS)
    return EtcdOffice(leadership, None, "agent-0", "h0", Narrator(EventLog(), lambda g: 0),
                      Publisher(store, KEYS, roster.agents), OwnPause(roster.keepalives, 10.0), 30.0, clock)


def test_without_etcd_the_office_writes_nothing_and_stops_nothing(store):
    quiet = office(store, None, FakeClock())
    quiet.record(ready(), None, Roster(store, KEYS), 4, 0.0)  # would raise on a None leadership otherwise
    assert quiet.observe(ready(), 1e9) == []


def test_the_office_stops_the_job_once_etcd_was_silent_past_the_store_timeout(store):
    lease = Lease()
    etcd = office(store, lease, FakeClock())
    assert etcd.observe(ready(), 100.0) == []
    lease.unreachable_since = 100.0
    assert etcd.observe(ready(), 120.0) == [] and etcd.narrator.etcd_down  # said once, the job goes on
    [stop] = etcd.observe(ready(), 131.0)
    assert stop.exit_code == ExitCode.JOB_FAILED and "unreachable for 30s" in stop.reason
    lease.lost.set()
    with pytest.raises(Exception, match="lease lapsed"):
        etcd.check_term()


# -- one turn of the loop, with a clock the test moves ---------------------------------------------------


def test_a_turn_holds_a_failed_collective_then_repairs_online_once_every_agent_beat(store):
    clock = FakeClock(50.0)
    controller = Controller(store, KEYS, RendezvousPolicy(2, 2, 0.0, 5.0), "agent-0", "127.0.0.1",
                            RecoveryPolicy(max_restarts=3, recovery=Level.PROCESS, node_timeout=10.0,
                                           stop_timeout=5.0, repair_timeout=60.0), clock=clock)
    controller.roster.nodes = dict(NODES)
    controller.executor.rendezvous = RendezvousResult(tuple(NODES.values()), 4)
    controller.view = ready()
    assert isinstance(controller.executor, Executor)
    store.raw.compare_set(KEYS.collective_failure(0), "", cut(rank=2).to_text())
    controller.tick(clock())
    assert controller.view.phase is Phase.RUNNING and controller.view.held is not None
    clock.advance(ONLINE_GRACE)
    controller.tick(clock())
    assert controller.view.phase is Phase.RUNNING  # no agent beat since
    for node in (0, 1):
        store.add(KEYS.node_heartbeat(node), 1)
    controller.tick(clock())
    assert (controller.view.phase, controller.view.level, controller.view.generation) == (Phase.STOPPING,
                                                                                        Level.ONLINE, 1)
    assert store.try_text(KEYS.target_generation) == "1"  # the executor announced it
