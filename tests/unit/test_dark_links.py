"""A data link gone dark: the OS's link state as a health source, the controller's ladder (online, spare,
wait, job level, flapping), the stall bound from the job's own step times, the policy's edges, and how the
status shows it. Pure logic with the clock passed in: no store, no process, no network."""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import pytest

from ftrun.config import LaunchConfig
from ftrun.controller.inbox import LinkBack, LinkLost, NodeLost, Reported
from ftrun.controller.links import (
    EndJob,
    LeaveOut,
    LinkObserver,
    LinkRules,
    Links,
    MoveToSpare,
    RepairOnline,
    Say,
    Saving,
    StallWatch,
    on_link_report,
    on_link_tick,
    where_ranks_stand,
)
from ftrun.controller.narrator import Narrator
from ftrun.controller.policy import decide, on_link_back, on_link_lost, on_node_lost
from ftrun.controller.states import JobView, Level, Phase
from ftrun.detection.links import (
    LinkReading,
    LinkWatch,
    data_interfaces,
    hccn_watch,
    interface_watch,
    parse_hccn_link,
    read_interface,
)
from ftrun.detection.reach import Prober, Verdict, interface_address, localise, peers_to_probe, probe_ring
from ftrun.devices import DeviceToolError
from ftrun.errors import ExitCode
from ftrun.events import EventLog
from ftrun.live_view import job_line, plain_line, stall_lines
from ftrun.messages import CommandKind, NodeSlot, Report, ReportKind
from ftrun.timeouts import timeout_chain
from ftrun.top_view.panes import rank_rows

RULES = LinkRules(online_window=2.0, flaps=3, flap_window=300.0, repair_timeout=60.0)


def sysfs(root: Path, name: str, operstate: str, carrier: str | None) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "operstate").write_text(operstate + "\n")
    if carrier is None:
        (folder / "carrier").unlink(missing_ok=True)
    else:
        (folder / "carrier").write_text(carrier + "\n")


# -- the OS's word -----------------------------------------------------------------------------------

def test_data_interfaces_come_from_the_collectives_variables_in_order_without_exclusions():
    env = {"GLOO_SOCKET_IFNAME": "data,eth1", "NCCL_SOCKET_IFNAME": "=ib0", "HCCL_SOCKET_IFNAME": "^docker0"}
    assert data_interfaces(env) == ["data", "eth1", "ib0"]
    assert data_interfaces({"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"}) == ["eth1"]
    assert data_interfaces({}) == []


def test_read_interface_is_up_only_with_operstate_up_and_a_carrier(tmp_path):
    sysfs(tmp_path, "data", "up", "1")
    assert read_interface("data", str(tmp_path)) == LinkReading("data", True, "operstate up, carrier")
    sysfs(tmp_path, "data", "down", "0")
    assert read_interface("data", str(tmp_path)) == LinkReading("data", False, "operstate down, no carrier")
    sysfs(tmp_path, "data", "down", None)  # the kernel refuses to read carrier of an interface set down
    assert not read_interface("data", str(tmp_path)).up
    sysfs(tmp_path, "tun0", "unknown", "1")  # tunnels say unknown
    assert read_interface("tun0", str(tmp_path)).up
    assert read_interface("gone", str(tmp_path)) == LinkReading("gone", False, "no such interface")


def test_link_watch_says_only_changes_and_nothing_for_a_link_first_seen_up(tmp_path):
    sysfs(tmp_path, "data", "up", "1")
    watch = interface_watch({"GLOO_SOCKET_IFNAME": "data,missing"}, str(tmp_path))
    assert watch is not None and len(watch.readers) == 1  # the missing one is said once and left out
    assert watch.poll(0.0) == []
    sysfs(tmp_path, "data", "lowerlayerdown", "0")
    assert watch.poll(0.1) == []  # within LINK_POLL of the last read: not read again
    [dark] = watch.poll(0.3)
    assert (dark.source, dark.link, dark.link_up) == ("link", "data", False)
    assert dark.describe() == "data link data dark (operstate lowerlayerdown, no carrier)"
    assert watch.poll(0.6) == [] and watch.dark == ["data"]
    sysfs(tmp_path, "data", "up", "1")
    [back] = watch.poll(0.9)
    assert back.link_up and "back up" in back.reason and watch.dark == []
    assert interface_watch({}, str(tmp_path)) is None


def test_a_link_dark_when_first_seen_is_said():
    watch = LinkWatch([])
    [event] = watch.observe([LinkReading("npu 3", False, "hccn_tool link status DOWN")])
    assert event.link == "npu 3" and not event.link_up


def test_a_reader_that_fails_is_said_once_and_the_others_still_read(caplog):
    def broken() -> LinkReading:
        raise DeviceToolError("hccn_tool did not answer within 10s")

    watch = LinkWatch([broken, lambda: LinkReading("data", False, "operstate down, no carrier")], interval=0.0)
    assert [e.link for e in watch.poll(0.0)] == ["data"]
    watch.poll(1.0)
    assert caplog.text.count("hccn_tool did not answer") == 1


def test_parse_hccn_link_reads_the_link_status_line():
    assert parse_hccn_link("link status: UP\n") is True
    assert parse_hccn_link("  Link Status : DOWN") is False
    with pytest.raises(DeviceToolError, match="no link status"):
        parse_hccn_link("Invalid device id\n")


# -- the ladder ---------------------------------------------------------------------------------------

def test_transition_dark_then_back_within_the_window_repairs_online():
    links, actions = on_link_report(Links(), 1, False, "data link data dark", 10.0, RULES, spare=True)
    assert [type(a) for a in actions] == [Say] and "stand still" in actions[0].line
    links, actions = on_link_tick(links, 11.0, RULES, spare=True, running=True)
    assert actions == []  # within the online window
    links, actions = on_link_report(links, 1, True, "data link data back up", 11.5, RULES, spare=True)
    assert [type(a) for a in actions] == [Say, RepairOnline]
    assert actions[1].node_rank == 1 and "after 1.5s dark" in actions[1].detail
    assert links.dark == ()


def test_transition_dark_past_the_window_with_a_spare_moves_the_node_once():
    links, _ = on_link_report(Links(), 1, False, "data link data dark", 10.0, RULES, spare=True)
    links, actions = on_link_tick(links, 12.5, RULES, spare=True, running=True)
    assert actions == [MoveToSpare(1, "data link data dark for 2.5s (past the online window, 2s)")]
    assert on_link_tick(links, 13.0, RULES, spare=True, running=True)[1] == []
    # the moved node's word, when its link comes back, changes nothing: it is leaving
    assert on_link_report(links, 1, True, "back", 20.0, RULES, spare=True)[1] == []


def test_transition_dark_without_a_spare_waits_says_so_once_with_its_deadline_then_ends_the_job():
    links, _ = on_link_report(Links(), 1, False, "data link data dark", 10.0, RULES, spare=False)
    links, actions = on_link_tick(links, 12.5, RULES, spare=False, running=True)
    assert len(actions) == 1 and "no spare node" in actions[0].line
    assert "up to --repair-timeout 60s; then the job ends" in actions[0].line
    links, actions = on_link_tick(links, 69.9, RULES, spare=False, running=True)
    assert actions == []
    links, actions = on_link_tick(links, 70.5, RULES, spare=False, running=True)
    assert [type(a) for a in actions] == [EndJob]
    assert "node 1: data link data dark for 60s (--repair-timeout 60s), with no spare node" in actions[0].detail
    assert on_link_tick(links, 80.0, RULES, spare=False, running=True)[1] == []


def test_transition_dark_without_a_spare_leaves_the_node_out_where_nnodes_allows_never_the_controllers():
    links, _ = on_link_report(Links(), 1, False, "data link data dark", 10.0, RULES, spare=False)
    links, [said] = on_link_tick(links, 12.5, RULES, spare=False, running=True, shrink=True)
    assert "then the job goes on without the node (--nnodes allows it)" in said.line
    links, actions = on_link_tick(links, 70.5, RULES, spare=False, running=True, shrink=True)
    assert actions == [LeaveOut(1, "data link data dark for 60s (--repair-timeout 60s), with no spare node to move "
                                   "its ranks to")]
    assert on_link_tick(links, 80.0, RULES, spare=False, running=True, shrink=True)[1] == []
    # the controller's own node would take the store with it: the job ends instead
    links, _ = on_link_report(Links(), 0, False, "data link data dark", 10.0, RULES, spare=False, host=0)
    links, [said] = on_link_tick(links, 12.5, RULES, spare=False, running=True, host=0, shrink=True)
    assert "then the job ends" in said.line
    assert [type(a) for a in on_link_tick(links, 70.5, RULES, spare=False, running=True, host=0, shrink=True)[1]] == [EndJob]


def test_the_observer_leaves_a_dark_node_out_through_the_scale_in_and_forgets_its_link_once_vacant(caplog):
    observer = LinkObserver(EventLog(), RULES)
    elastic = ready(min_nodes=1)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], elastic, slots(), False, 10.0)
    assert observer.observe(elastic, slots(), False, 12.5) == []
    [lost] = observer.observe(elastic, slots(), False, 70.5)
    assert isinstance(lost, NodeLost) and lost.slot.node_rank == 1 and lost.spare == ""
    view, commands = decide(elastic, lost)
    assert view.vacant == {1} and (view.phase, view.level) == (Phase.STOPPING, Level.JOB)
    assert view.reason.endswith("going on with 1 nodes") and [c.kind for c in commands] == [CommandKind.STOP]
    assert observer.status(71.0) is not None  # still dark until the scale-in leaves it out
    observer.observe(dataclasses.replace(view, phase=Phase.RUNNING), slots(), False, 72.0)
    assert observer.status(72.0) is None and observer.links == Links()
    # a fixed size: the job ends, with the link as its reason
    observer = LinkObserver(EventLog(), RULES)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], ready(), slots(), False, 10.0)
    observer.observe(ready(), slots(), False, 12.5)
    [ends] = observer.observe(ready(), slots(), False, 70.5)
    view, commands = decide(ready(), ends)
    assert view.phase is Phase.EXITING and view.reason.startswith("node 1: data link data dark (operstate down, no "
                                                                  "carrier) for 60s (--repair-timeout 60s)")
    # --nnodes allows one node fewer, but leaving it out is a restart and none is left: the wait says the job
    # ends, and it does
    observer = LinkObserver(EventLog(), RULES)
    spent = ready(min_nodes=1, max_restarts=0)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], spent, slots(), False, 10.0)
    caplog.clear()
    assert observer.observe(spent, slots(), False, 12.5) == []
    assert [r.getMessage() for r in caplog.records] == ["no spare node to move node 1's ranks to: waiting for its "
                                                        "data link to come back (up to --repair-timeout 60s; then "
                                                        "the job ends)"]
    [ends] = observer.observe(spent, slots(), False, 70.5)
    assert isinstance(ends, LinkLost) and decide(spent, ends)[0].phase is Phase.EXITING


def test_nothing_is_decided_while_a_repair_is_under_way():
    links, _ = on_link_report(Links(), 1, False, "dark", 10.0, RULES, spare=True)
    assert on_link_tick(links, 20.0, RULES, spare=True, running=False) == (links, [])


def test_transition_a_flapping_link_moves_its_node_to_a_spare_at_the_threshold():
    links = Links()
    for n, at in enumerate((0.0, 5.0)):
        links, _ = on_link_report(links, 1, False, "dark", at, RULES, spare=True)
        links, actions = on_link_report(links, 1, True, "back", at + 1.0, RULES, spare=True)
        assert [type(a) for a in actions] == [Say, RepairOnline]
    links, actions = on_link_report(links, 1, False, "data link data dark", 10.0, RULES, spare=True)
    assert [type(a) for a in actions] == [Say, MoveToSpare] and "3 times in 300s" in actions[1].detail
    # downs older than the window do not count
    old = Links(downs=((1, 0.0), (1, 1.0)))
    assert [type(a) for a in on_link_report(old, 1, False, "dark", 400.0, RULES, spare=True)[1]] == [Say]


# -- the stall bound ----------------------------------------------------------------------------------

def test_stall_bound_comes_from_the_jobs_own_step_times_with_a_floor():
    watch = StallWatch(factor=4.0, floor=1.0)
    assert watch.observe(0.0, None, True) is None  # before the first committed step: never judged
    watch.observe(0.0, 0, True)
    assert watch.observe(30.0, 0, True) is None  # nor before a step time is known (the first step's setup)
    now, step = 0.0, 0
    for _ in range(20):
        watch.observe(now, step, True)
        now, step = now + 0.5, step + 1
    bound, basis = watch.bound()
    assert bound == pytest.approx(2.0) and "4 x p90 step 0.50s" in basis
    watch.observe(now, step, True)
    assert watch.observe(now + 1.9, step, True) is None
    stall = watch.observe(now + 2.1, step, True)
    assert stall is not None and stall.waited == pytest.approx(2.1) and stall.since == pytest.approx(now)
    assert watch.observe(now + 2.2, step, False) is None  # a rank not beating: the hang check's
    assert watch.observe(now + 2.3, step + 1, True) is None  # a step committed: over


def test_stall_bound_allows_for_the_longest_step_a_checkpoint_save_among_them():
    watch = StallWatch(factor=4.0, floor=1.0)
    times = [0.1] * 30 + [6.0] + [0.1] * 5  # one step that saved a checkpoint
    now = 0.0
    for step, took in enumerate(times):
        watch.observe(now, step, True)
        now += took
    bound, basis = watch.bound()
    assert bound == pytest.approx(12.0) and "longest step 6.00s" in basis
    assert StallWatch(floor=10.0).bound() == (10.0, "floor 10s")


def trained(watch: StallWatch, steps: int = 20, took: float = 0.5) -> tuple[float, int]:
    """``steps`` steps of ``took`` seconds each through the watch: where the clock and the step stand after."""
    now = 0.0
    for step in range(steps):
        watch.observe(now, step, True)
        now += took
    watch.observe(now, steps, True)
    return now, steps


def test_transition_a_save_is_no_stall_within_its_bound_and_is_one_past_it():
    watch = StallWatch(factor=4.0, floor=1.0)
    now, step = trained(watch)  # a step bound of 2 s
    # rank 2 saves for 40 s, the others wait for it: before any save was measured, FIRST_SAVE (60 s) bounds it
    for second in range(1, 41):
        assert watch.observe(now + second, step, True, Saving(2, float(second))) is None
    # the save ends, and the step that waited for it takes a moment: the clock starts again at the save's end
    assert watch.observe(now + 41.0, step, True, None, longest_save=40.0) is None
    assert watch.observe(now + 42.5, step, True) is None
    now, step = now + 43.0, step + 1
    watch.observe(now, step, True)
    assert watch.durations[-1] == pytest.approx(2.0)  # the save is no step time: it has its own bound
    assert watch.save_bound() == (80.0, "2 x the longest save 40.00s")
    assert watch.observe(now + 79.0, step, True, Saving(2, 79.0)) is None
    stall = watch.observe(now + 81.0, step, True, Saving(2, 81.0))
    assert stall is not None and stall.saving == Saving(2, 81.0) and stall.bound == 80.0
    assert stall.basis == "2 x the longest save 40.00s" and stall.since == now
    # the save ends: the job moves again; without a save, the step's bound holds once more
    assert watch.observe(now + 82.0, step, True, None) is None
    bound, _ = watch.bound()
    assert watch.observe(now + 82.0 + bound + 0.5, step, True) is not None


def test_a_save_bound_is_never_under_the_steps_bound():
    watch = StallWatch(factor=4.0, floor=1.0)
    now, step = trained(watch, took=10.0)  # a step bound of 40 s
    assert watch.observe(now, step, True, Saving(0, 0.0), longest_save=5.0) is None
    assert watch.save_bound() == (40.0, "4 x p90 step 10.00s")
    assert watch.observe(now + 39.0, step, True, Saving(0, 39.0)) is None
    assert watch.observe(now + 41.0, step, True, Saving(0, 41.0)) is not None


def test_a_repair_pauses_the_stall_clock():
    watch = StallWatch(factor=4.0, floor=1.0)
    watch.observe(0.0, 5, True)
    watch.pause(1.0)
    assert watch.observe(30.0, 5, True) is None  # the clock starts again at the first sight after it


def test_the_first_step_of_a_start_or_a_repair_is_no_step_time():
    # the job's first step imports and forms the groups for 15 s: counted, "2 x the longest step" would bound
    # the next 50 steps at 30 s; so would a repair's first step (the groups formed again)
    watch = StallWatch(factor=4.0, floor=1.0)
    watch.observe(0.0, 0, True)
    now, step = 15.0, 1
    for _ in range(10):
        watch.observe(now, step, True)
        now, step = now + 0.5, step + 1
    assert watch.durations == [0.5] * 9 and watch.bound()[0] == pytest.approx(2.0)
    watch.pause(now)
    watch.observe(now, step, True)
    watch.observe(now + 20.0, step + 1, True)
    assert watch.durations == [0.5] * 9  # the repair's first step
    watch.observe(now + 20.5, step + 2, True)
    assert watch.durations == [0.5] * 10


# -- the policy's edges -------------------------------------------------------------------------------

def ready(**fields) -> JobView:
    fields = {"max_restarts": 3, "library_ranks": 4, **fields}
    return JobView(node_count=2, world_size=4, recovery=Level.PROCESS, **fields)


def test_transition_running_to_stopping_online_when_the_link_is_back():
    view, commands = on_link_back(ready(), 1, "h1", 2, "node 1: data link data back up after 4.0s dark", at=50.0)
    assert (view.phase, view.level, view.generation, view.restarts_used) == (Phase.STOPPING, Level.ONLINE, 1, 1)
    assert [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, ())]
    assert view.reason == "node 1: data link data back up after 4.0s dark" == commands[0].reason
    assert view.failures[-1].cause == "link" and view.failures[-1].timestamp == 50.0
    assert view.failures[-1].describe() == "node 1 (h1): node 1: data link data back up after 4.0s dark"
    # through decide, as the controller hands it
    assert decide(ready(), LinkBack(1, "h1", 2, "back", 50.0))[0].level is Level.ONLINE


def test_link_back_changes_nothing_without_process_level_or_outside_running():
    assert on_link_back(ready(library_ranks=2), 1, "h1", 2, "back") == (ready(library_ranks=2), [])
    stopping = ready(phase=Phase.STOPPING, level=Level.PROCESS)
    assert on_link_back(stopping, 1, "h1", 2, "back") == (stopping, [])


def test_transition_running_to_exiting_when_the_link_stays_dark_whatever_budget_is_left():
    # found on the test bed: the job-level restart this was, into the same dark link, failed to connect at once,
    # its online repair stood until its deadline, and the job ended 28 s after the dark with the repair as its reason
    for budget in (0, 2):
        view, commands = decide(ready(max_restarts=budget), LinkLost("node 1: dark for 60s"))
        assert view.phase is Phase.EXITING and view.reason == "node 1: dark for 60s"
        assert view.exit_code == ExitCode.JOB_FAILED and view.restarts_used == 0
        assert [c.kind for c in commands] == [CommandKind.EXIT]
    stopping = ready(phase=Phase.STOPPING, level=Level.PROCESS)
    assert on_link_lost(stopping, "node 1: dark for 60s") == (stopping, [])


# -- the observer and the status -----------------------------------------------------------------------

def slots() -> dict[int, NodeSlot]:
    return {0: NodeSlot(0, "a0", "h0", 2, 0), 1: NodeSlot(1, "a1", "h1", 2, 2)}


def link_report(kind: ReportKind, agent="a1") -> Reported:
    return Reported(Report(kind, 1, 0, detail="data link data dark (operstate down, no carrier)", agent_id=agent))


def test_observer_takes_link_reports_out_of_the_stream_and_makes_events():
    events = EventLog()
    observer = LinkObserver(events, RULES)
    other = Reported(Report(ReportKind.SUCCEEDED, 0, 0))
    kept = observer.take_reports([other, link_report(ReportKind.LINK_DOWN)], ready(), slots(), True, 10.0)
    assert kept == [other]
    assert [e["kind"] for e in events.events] == ["link"] and events.events[0]["node"] == 1
    assert observer.take_reports([link_report(ReportKind.LINK_DOWN, agent="fenced")], ready(), slots(), True, 10.5) == []
    [lost] = observer.observe(ready(), slots(), True, 12.5)
    assert isinstance(lost, NodeLost) and lost.slot.node_rank == 1 and "past the online window" in lost.detail
    status = observer.status(13.0)
    assert status["dark"] == {"1": "data link data dark (operstate down, no carrier)"} and status["for"] == 3.0

    observer = LinkObserver(EventLog(), RULES)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], ready(), slots(), False, 10.0)
    [back] = observer.take_reports([link_report(ReportKind.LINK_UP)], ready(), slots(), False, 11.0)
    assert isinstance(back, LinkBack) and (back.node_rank, back.rank, back.host) == (1, 2, "h1")


def test_a_node_taken_over_by_the_spare_starts_afresh_and_its_own_dark_link_goes_down_the_ladder():
    # found on the test bed: after a move to the spare, node 1's old dark link stayed in the status (the job
    # showed "stalled" for good while it trained) and the new holder's reports were dropped as the moved node's
    observer = LinkObserver(EventLog(), RULES)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], ready(), slots(), True, 10.0)
    [lost] = observer.observe(ready(), slots(), True, 12.5)
    assert isinstance(lost, NodeLost)
    assert observer.observe(ready(), slots(), True, 13.0) == [] and observer.status(13.0) is not None  # not yet over
    spare_holds = {**slots(), 1: NodeSlot(1, "s0", "h2", 2, 2)}
    assert observer.observe(ready(), spare_holds, False, 14.0) == []
    assert observer.status(14.0) is None and observer.links == Links()
    observer.take_reports([link_report(ReportKind.LINK_DOWN, agent="s0")], ready(), spare_holds, False, 20.0)
    observer.observe(ready(), spare_holds, False, 20.5)
    assert observer.links.waiting == {1}  # no spare left: waited for, said so
    [restart] = observer.observe(ready(), spare_holds, False, 80.5)
    assert isinstance(restart, LinkLost) and "--repair-timeout 60s" in restart.detail


def test_the_stall_is_said_once_shown_and_cleared():
    events = EventLog()
    observer = LinkObserver(events, RULES, StallWatch(factor=4.0, floor=1.0))
    ranks = [{"rank": r, "heartbeat_age": 0.4, "step": 4 + (r < 2), "collective": waits("all_reduce", 5.0 - r, size=4)}
             for r in range(4)]
    for second in range(5):
        observer.watch_steps(ready(), {"generation": 0, "step": second, "ranks": ranks}, float(second))
    assert observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": ranks}, 4.9) is None
    assert observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": ranks}, 9.0) is not None
    observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": ranks}, 9.5)
    said = [e for e in events.events if e["kind"] == "stall"]
    assert len(said) == 1 and "no step committed for 5.0s while every rank lives and beats" in said[0]["detail"]
    assert "; ranks 0-1 wait in all_reduce (step 5) for 5s; ranks 2-3 in all_reduce (step 4) for 3s" in said[0]["detail"]
    status = observer.status(9.5)
    snapshot = {"run_id": "r", "generation": 0, "phase": "running", "level": "", "phase_for": 1.0, "step": 4,
                "total_steps": 10, "steps_per_s": 0.0, "eta_s": None, "restarts_used": 0, "max_restarts": 3,
                "elapsed": 9.5, "recovery": "process", "world_size": 4, "nodes": [], "stall": status}
    assert "STALLED 6s: no step committed" in job_line(snapshot, 200).plain
    where = "ranks 0-1 wait in all_reduce (step 5) for 5s; ranks 2-3 in all_reduce (step 4) for 3s"
    assert status["ranks"] == where
    assert "running" not in plain_line(snapshot) and f"stalled for 6s (no step committed; {where})" in plain_line(snapshot)
    assert [line.plain for line in stall_lines(snapshot)] == [f"  waiting: {where}"]
    states = [cells[4] for _, cells in rank_rows({**snapshot, "ranks": [{**r, "pid": 10 + r["rank"]} for r in ranks]})]
    assert states == ["in all_reduce 5s", "in all_reduce 4s", "in all_reduce 3s", "in all_reduce 2s"]  # ftrun top's
    observer.watch_steps(ready(), {"generation": 0, "step": 5, "ranks": ranks}, 10.0)
    assert [e["detail"] for e in events.events if e["kind"] == "stall"][-1] == "training moves again"
    assert observer.status(10.0) is None


def saving_ranks(step: int, saving: float | None, longest: float = 30.0) -> list[dict]:
    """Rank 2 saves a checkpoint (for ``saving`` seconds; None: it does not) while ranks 0, 1 and 3 wait for it."""
    return [{"rank": r, "heartbeat_age": 0.4, "step": step, "save_s": longest if r == 2 else None, "pid": 10 + r,
             "saving": saving if r == 2 else None,
             "collective": {} if r == 2 else waits("all_reduce", saving or 0.0, size=4)} for r in range(4)]


def test_a_save_past_its_bound_is_said_with_the_rank_that_saves_and_shown():
    events = EventLog()
    observer = LinkObserver(events, RULES, StallWatch(factor=4.0, floor=1.0))
    for second in range(5):  # a step a second: a step bound of 4 s
        observer.watch_steps(ready(), {"generation": 0, "step": second, "ranks": saving_ranks(second, None)},
                             float(second))
    # rank 2 saves for 50 s: within 2 x the longest save measured (30 s), no stall
    assert observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": saving_ranks(4, 50.0)}, 54.0) is None
    assert not [e for e in events.events if e["kind"] == "stall"] and observer.status(54.0) is None
    ranks = saving_ranks(4, 61.0)
    assert observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": ranks}, 65.0) is not None
    [said] = [e["detail"] for e in events.events if e["kind"] == "stall"]
    where = "rank 2 saves a checkpoint for 61s (step 4); ranks 0-1, 3 wait in all_reduce (step 4) for 61s"
    assert said == ("training stands still: rank 2 saves a checkpoint for 61s, longer than the job's saves allow; no "
                    f"step committed for 61.0s while every rank lives and beats (bound 60.0s: 2 x the longest save "
                    f"30.00s); {where}")
    status = observer.status(65.0)
    assert (status["reason"], status["ranks"], status["bound"]) == ("rank 2 saves a checkpoint", where, 60.0)
    snapshot = {"run_id": "r", "generation": 0, "phase": "running", "level": "", "phase_for": 1.0, "step": 4,
                "total_steps": 10, "steps_per_s": 0.0, "eta_s": None, "restarts_used": 0, "max_restarts": 3,
                "elapsed": 65.0, "recovery": "process", "world_size": 4, "nodes": [], "stall": status, "ranks": ranks}
    assert "STALLED 61s: rank 2 saves a checkpoint" in job_line(snapshot, 200).plain
    assert [line.plain for line in stall_lines(snapshot)] == [f"  waiting: {where}"]
    assert [cells[4] for _, cells in rank_rows(snapshot)] == ["in all_reduce 61s"] * 2 + ["saving 61s", "in all_reduce 61s"]
    # the save ends: the job moves again
    observer.watch_steps(ready(), {"generation": 0, "step": 4, "ranks": saving_ranks(4, None)}, 66.0)
    assert [e["detail"] for e in events.events if e["kind"] == "stall"][-1] == "training moves again"


def test_the_timeout_chain_is_checked_against_each_longer_save_measured_each_timeout_once(caplog):
    observer = LinkObserver(EventLog(), RULES, StallWatch(factor=4.0, floor=1.0))
    observer.bounds = timeout_chain(LaunchConfig(device="cpu"), {})  # gloo's, no NCCL's
    for step, longest in enumerate([0.0, 400.0, 500.0, 500.0, 2000.0]):  # ftrun.elastic's 300 s, then gloo's 1,800 s
        observer.watch_steps(ready(), {"generation": 0, "step": step, "ranks": saving_ranks(step, None, longest)},
                             float(step))
    said = [r.getMessage() for r in caplog.records if "timeouts contradict" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("timeouts contradict, with the job's longest checkpoint save (400.0s): "
                              "collective_timeout (ftrun.elastic.init) 300s is shorter than a checkpoint save")
    assert "gloo (torch's default) 1800s is shorter than a checkpoint save (2000s measured)" in said[1]
    assert "raise it above 2000s" in said[1]


def test_a_process_level_repair_after_an_online_one_ended_is_not_said_as_its_step_down():
    # found on the test bed: a node moved to a spare after two online repairs was said as "the online repair
    # under way goes down to it", since the view keeps the last repair's level once it runs again
    events = EventLog()
    narrator = Narrator(events, lambda generation: 4)
    online, _ = on_link_back(ready(), 1, "h1", 2, "back", at=50.0)
    running = dataclasses.replace(online, phase=Phase.RUNNING)
    moved, _ = on_node_lost(running, 1, "node 1: dark 3 times", spare="spare", ranks=(2, 3))
    assert narrator.decided(running, moved, 60.0)
    [decision] = [e for e in events.events if e["kind"] == "decision"]
    assert decision["detail"] == "process-level repair into generation 2: node 1: dark 3 times"
    assert "action" not in decision


# -- the data network's probe ---------------------------------------------------------------------------

def test_localise_puts_the_fault_on_a_node_cut_off_from_every_peer():
    probed = {0: (1, 2), 1: (0, 2), 2: (0, 1)}
    verdict = localise({0: (1,), 1: (0, 2), 2: (1,)}, probed)
    assert verdict.nodes == (1,) and verdict.links == ()
    assert verdict.text == "node 1 reaches no peer on the data network, and no peer reaches it"
    assert localise({0: (), 1: (), 2: ()}, probed) == Verdict()


def test_localise_puts_the_fault_on_a_link_when_only_one_pair_fails():
    verdict = localise({0: (2,), 1: (), 2: (0,)}, {0: (1, 2), 1: (0, 2), 2: (0, 1)})
    assert verdict.nodes == () and verdict.links == ((0, 2),)
    assert verdict.text == "nodes 0 and 2 cannot reach each other on the data network"
    # two nodes alone: which side is dark, only the OS can say
    assert localise({0: (1,), 1: (0,)}, {0: (1,), 1: (0,)}).links == ((0, 1),)


def test_localise_with_a_spare_puts_a_silent_fault_on_the_node_not_the_pair():
    # 2 nodes and a spare (probe id -1), node 1's port off the switch: the spare reaches node 0 and not node 1
    probed = {0: (-1, 1), 1: (-1, 0), -1: (0, 1)}
    verdict = localise({0: (1,), 1: (-1, 0), -1: (1,)}, probed, {-1: "spare node h2"})
    assert verdict.nodes == (1,) and verdict.links == ()
    assert verdict.text == "node 1 reaches no peer on the data network, and no peer reaches it"
    # the spare's own link silent: the spare is named, the nodes are not blamed
    verdict = localise({0: (-1,), 1: (-1,), -1: (0, 1)}, probed, {-1: "spare node h2"})
    assert verdict.nodes == (-1,) and verdict.links == ()
    assert verdict.text == "spare node h2 reaches no peer on the data network, and no peer reaches it"
    # the link between the two nodes alone: a pair, as without a spare
    verdict = localise({0: (1,), 1: (0,), -1: ()}, probed, {-1: "spare node h2"})
    assert verdict.nodes == () and verdict.links == ((0, 1),)
    assert verdict.text == "nodes 0 and 1 cannot reach each other on the data network"
    verdict = localise({0: (-1,), -1: (0,)}, probed, {-1: "spare node h2"})
    assert verdict.links == ((-1, 0),) and verdict.text == "spare node h2 and node 0 cannot reach each other on the data network"
    # found on the bed: a spare that took node 1's place said, for a round, its probe of node 1's old holder as node 1
    assert localise({0: (), 1: (1,), -1: ()}, probed) == Verdict()


def test_the_probe_ring_holds_the_spares_beside_the_nodes():
    assert probe_ring([1, 0], 2) == [0, 1, -1, -2] and probe_ring([0, 1], 0) == [0, 1]
    assert peers_to_probe(1, probe_ring([0, 1], 1)) == [-1, 0]
    assert peers_to_probe(-1, probe_ring([0, 1], 1)) == [0, 1]
    # a large job: a spare probes its nearest on the ring as a node does, and is probed by theirs
    ring = probe_ring(list(range(100)), 1)
    assert peers_to_probe(-1, ring, reach=2) == [0, 1, 98, 99] and -1 in peers_to_probe(0, ring, reach=2)


def test_peers_to_probe_are_every_other_node_or_the_nearest_on_a_ring():
    assert peers_to_probe(1, [0, 1, 2]) == [0, 2]
    assert peers_to_probe(0, list(range(100)), reach=2) == [1, 2, 98, 99]


def test_the_prober_finds_a_listener_reachable_and_a_silent_address_not():
    assert interface_address("lo") == "127.0.0.1" and interface_address("no-such-if") == ""
    prober = Prober("127.0.0.1", every=0.05, timeout=0.2)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    refused = closed.getsockname()[1]  # bound, never listening: refused, so the host answers
    # a listener whose backlog is full drops the next SYN, as a dark link does: the connect times out
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(0)
    held = [socket.socket() for _ in range(3)]
    for client in held:
        client.setblocking(False)
        client.connect_ex(silent.getsockname())
    try:
        assert prober._reaches(("127.0.0.1", int(prober.endpoint.rsplit(":", 1)[1])))
        assert prober._reaches(("127.0.0.1", refused))
        prober.start()
        prober.aim({3: prober.endpoint, 4: "127.0.0.1:%d" % silent.getsockname()[1], 5: "not an endpoint"})
        deadline = time.monotonic() + 10
        while prober.probed != (3, 4) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert prober.probed == (3, 4) and prober.unreachable == (4,)
    finally:
        prober.stop()
        for sock in (closed, silent, *held):
            sock.close()


def test_a_prober_aimed_anew_forgets_what_it_found_of_peers_no_longer_aimed_at():
    # a spare that took node 1's place had probed node 1's old holder; its id is 1 now: not said again
    prober = Prober("127.0.0.1", every=60.0)  # no round of its own within the test
    prober.start()
    try:
        prober.probed, prober.unreachable = (0, 1), (1,)
        prober.aim({-1: prober.endpoint, 0: prober.endpoint})
        assert prober.probed == (0,) and prober.unreachable == ()
    finally:
        prober.stop()


def test_the_observer_moves_a_node_the_probe_finds_cut_off_and_repairs_when_a_link_answers_again():
    def board(unreachable: dict[int, tuple[int, ...]]) -> dict:
        return {"nodes": [{"node": n, "role": "active", "probed": [p for p in range(3) if p != n],
                           "unreachable": list(unreachable.get(n, ()))} for n in range(3)]}

    nodes = {n: NodeSlot(n, f"a{n}", f"h{n}", 2, 2 * n) for n in range(3)}
    observer = LinkObserver(EventLog(), RULES)
    assert observer.watch_reach(ready(), board({0: (1,), 1: (0, 2), 2: (1,)}), nodes, True, 10.0) == []
    assert observer.links.dark[0].source == "probe"
    [lost] = observer.observe(ready(), nodes, True, 12.5)
    assert isinstance(lost, NodeLost) and "unreachable on the data network from every peer (probe)" in lost.detail
    observer = LinkObserver(EventLog(), RULES)
    assert observer.watch_reach(ready(), board({0: (2,), 2: (0,)}), nodes, True, 10.0) == []
    [back] = observer.watch_reach(ready(), board({}), nodes, True, 11.0)
    assert isinstance(back, LinkBack) and back.detail == "nodes 0 and 2 reach each other on the data network again (probe)"


def waits(op: str, seconds: float, group: str = "0", size: int = 6) -> dict:
    return {"op": op, "group": group, "group_size": size, "for": seconds}


def spare_board(unreachable: dict[int, tuple[int, ...]], stale: tuple[int, ...] = ()) -> dict:
    """The board's rows of 2 nodes and a spare of probe id -1 (its host h2) on the probe's ring; ``stale``:
    ids in every prober's round that no row holds now (a spare that took a node's place, or left)."""
    ring = (0, 1, -1)
    rows = [{"node": n, "role": "active", "probe_id": None} for n in (0, 1)]
    rows.append({"node": -1, "role": "spare", "host": "h2", "probe_id": -1})
    for row, me in zip(rows, ring):
        row["probed"] = [p for p in ring + stale if p != me]
        row["unreachable"] = list(unreachable.get(me, ())) + list(stale)
    return {"nodes": rows}


def test_the_observer_with_a_spare_moves_a_node_cut_off_silently_and_never_the_spare():
    nodes = {n: NodeSlot(n, f"a{n}", f"h{n}", 2, 2 * n) for n in range(2)}
    events = EventLog()
    observer = LinkObserver(events, RULES)
    assert observer.watch_reach(ready(), spare_board({0: (1,), 1: (-1, 0), -1: (1,)}, stale=(-2,)), nodes, True,
                                10.0) == []
    assert observer.verdict.text == "node 1 reaches no peer on the data network, and no peer reaches it"
    [lost] = observer.observe(ready(), nodes, True, 12.5)
    assert isinstance(lost, NodeLost) and lost.slot.node_rank == 1
    # found on the bed: the spare holds node 1 now, and node 0's probe reaches its listener a round later; that pair
    # answering again is no link's return (it was repaired online, in vain)
    spare_holds = {**nodes, 1: NodeSlot(1, "s0", "h2", 2, 2)}
    assert observer.observe(ready(), spare_holds, False, 13.0) == []
    two = {"nodes": [row for row in spare_board({0: (1,)})["nodes"] if row["role"] == "active"]}
    assert observer.watch_reach(ready(), two, spare_holds, False, 13.5) == [] and observer.verdict.links == ((0, 1),)
    assert observer.watch_reach(ready(), spare_board({}), spare_holds, False, 14.5) == []
    # the spare's own link: said, and nothing moved or repaired, then or when it answers again
    observer = LinkObserver(events, RULES)
    assert observer.watch_reach(ready(), spare_board({0: (-1,), 1: (-1,), -1: (0, 1)}), nodes, True, 20.0) == []
    assert observer.verdict.nodes == (-1,) and observer.links == Links()
    assert observer.watch_reach(ready(), spare_board({0: (-1,), -1: (0,)}), nodes, True, 21.0) == []
    assert observer.watch_reach(ready(), spare_board({}), nodes, True, 22.0) == [] and observer.links == Links()
    said = [e["detail"] for e in events.events if e["kind"] == "link"]
    assert said[-2:] == ["data network probe: spare node h2 reaches no peer on the data network, and no peer reaches it",
                         "data network probe: spare node h2 and node 0 cannot reach each other on the data network"]


def test_a_node_cut_off_silently_is_dark_since_its_first_broken_pair_not_the_verdict():
    # node 0 misses node 1 at 10.0; the spare's round tells node 1 cut off only at 11.5: its online window (2 s)
    # counts from 10.0, when the link went, so its ranks move at 12.0, not 13.5
    nodes = {n: NodeSlot(n, f"a{n}", f"h{n}", 2, 2 * n) for n in range(2)}
    observer = LinkObserver(EventLog(), RULES)
    assert observer.watch_reach(ready(), spare_board({0: (1,), 1: (0,)}), nodes, True, 10.0) == []
    assert observer.verdict.links == ((0, 1),) and observer.links == Links()
    assert observer.watch_reach(ready(), spare_board({0: (1,), 1: (-1, 0), -1: (1,)}), nodes, True, 11.5) == []
    assert observer.verdict.nodes == (1,) and observer.links.dark[0].since == 10.0
    [lost] = observer.observe(ready(), nodes, True, 12.0)
    assert isinstance(lost, NodeLost) and lost.slot.node_rank == 1
    # a pair that answered again in between starts afresh
    observer = LinkObserver(EventLog(), RULES)
    observer.watch_reach(ready(), spare_board({0: (1,), 1: (0,)}), nodes, True, 10.0)
    observer.watch_reach(ready(), spare_board({}), nodes, True, 11.0)
    observer.watch_reach(ready(), spare_board({0: (1,), 1: (-1, 0), -1: (1,)}), nodes, True, 20.0)
    assert observer.links.dark[0].since == 20.0


def test_where_ranks_stand_names_the_collective_each_rank_waits_in_the_longest_first():
    ranks = [{"rank": 0, "step": 23, "collective": waits("all_reduce", 12.2)},
             {"rank": 1, "step": 23, "collective": waits("all_reduce", 11.6)},
             {"rank": 3, "step": 23, "collective": waits("broadcast", 3.4, "2", 2)},
             {"rank": 2, "step": 23, "collective": waits("broadcast", 2.0, "2", 2)},
             {"rank": 4, "step": 22, "collective": {}},
             {"rank": 5, "step": None, "collective": None}]
    assert where_ranks_stand(ranks) == ("ranks 0-1 wait in all_reduce (step 23) for 12s; ranks 2-3 in broadcast on "
                                        "group 2 of 2 ranks (step 23) for 3s; rank 4 computes (step 22); rank 5: no report")


@pytest.mark.parametrize("ranks, said", [
    ([], "no rank has reported"),
    ([{"rank": r, "step": 7, "collective": waits("all_reduce", 4.0, size=4)} for r in range(4)],
     "ranks 0-3 wait in all_reduce (step 7) for 4s"),
    ([{"rank": 0, "step": 7, "collective": waits("all_reduce", 4.0, size=3)}, {"rank": 2, "step": 7, "collective": {}},
      {"rank": 1, "step": 7, "collective": {}}], "rank 0 waits in all_reduce (step 7) for 4s; ranks 1-2 compute (step 7)"),
    ([{"rank": r, "step": None, "collective": None} for r in (0, 1, 3)], "ranks 0-1, 3: no report"),
    ([{"rank": 0, "step": 5}, {"rank": 1, "step": 5, "collective": {}}], "rank 1 computes (step 5); rank 0: no report"),
    # a rank that saves a checkpoint comes first, whatever collective its save waits in (a distributed one's)
    ([{"rank": 1, "step": 7, "collective": waits("all_reduce", 4.0, size=3)},
      {"rank": 0, "step": 7, "collective": waits("all_gather", 1.0, size=3), "saving": 3.4},
      {"rank": 2, "step": 7, "collective": {}, "saving": None}],
     "rank 0 saves a checkpoint for 3s (step 7); rank 1 waits in all_reduce (step 7) for 4s; rank 2 computes (step 7)"),
])
def test_where_ranks_stand_says_ranks_in_no_collective_and_those_without_a_report(ranks, said):
    assert where_ranks_stand(ranks) == said


def test_a_pair_the_probe_finds_broken_while_the_os_said_the_link_dark_is_not_repaired_twice():
    # found with scripts/bench_dark_link.py: the link's return repaired the job, and the probe, a second
    # later, took the pair answering again for a fault of its own
    observer = LinkObserver(EventLog(), RULES)
    probed = {"nodes": [{"node": n, "role": "active", "probed": [1 - n], "unreachable": [1 - n]} for n in (0, 1)]}
    answered = {"nodes": [{"node": n, "role": "active", "probed": [1 - n], "unreachable": []} for n in (0, 1)]}
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], ready(), slots(), False, 10.0)
    assert observer.watch_reach(ready(), probed, slots(), False, 11.0) == []
    [back] = observer.take_reports([link_report(ReportKind.LINK_UP)], ready(), slots(), False, 30.0)
    assert isinstance(back, LinkBack)
    assert observer.watch_reach(ready(), answered, slots(), False, 40.0) == []  # long after: explained all the same


def test_hccn_watch_reads_each_chips_port_through_the_tool(tmp_path):
    # a stand-in hccn_tool printing what CANN's prints for `-i N -link -g`, from a state file the test writes
    tool = tmp_path / "hccn_tool"
    state = tmp_path / "links"
    tool.write_text(f"#!/bin/sh\nif grep -qx \"$2\" {state}; then echo 'link status: DOWN'; else echo 'link status: UP'; fi\n")
    tool.chmod(0o755)
    state.write_text("")
    watch = hccn_watch([0, 5], str(tool), timeout=10.0)
    assert watch is not None and watch.poll(0.0) == []
    state.write_text("5\n")
    [dark] = watch.poll(1.0)
    assert (dark.link, dark.link_up, dark.reason) == ("npu 5", False, "data link npu 5 dark (hccn_tool link status DOWN)")
    assert hccn_watch([0], str(tmp_path / "missing")) is None and hccn_watch([], str(tool)) is None


def test_the_timeout_chain_is_checked_once_more_against_the_measured_step_time(caplog):
    observer = LinkObserver(EventLog(), RULES, StallWatch(factor=4.0, floor=1.0))
    observer.bounds = timeout_chain(LaunchConfig(), {})
    ranks = [{"rank": r, "heartbeat_age": 0.4, "step": 0} for r in range(4)]
    for step in range(22):  # 100 s a step: a stall bound of 400 s, past ftrun.elastic's 300 s collective timeout
        observer.watch_steps(ready(), {"generation": 0, "step": step, "ranks": ranks}, 100.0 * step)
    said = [r.getMessage() for r in caplog.records if "timeouts contradict" in r.getMessage()]
    assert len(said) == 1 and "with the job's step time (p90 100.00s)" in said[0]
    assert "collective_timeout (ftrun.elastic.init) 300s is not longer than the stall bound 400s" in said[0]


def test_the_controllers_own_node_never_moves_to_a_spare_it_is_waited_for():
    # its agent would leave on the takeover, and the job's store with it
    links, _ = on_link_report(Links(), 0, False, "data link data dark", 10.0, RULES, spare=True, host=0)
    links, actions = on_link_tick(links, 12.5, RULES, spare=True, running=True, host=0)
    assert len(actions) == 1 and actions[0].line.startswith("node 0 hosts the controller: its ranks stay")
    assert on_link_tick(links, 30.0, RULES, spare=True, running=True, host=0)[1] == []
    assert [type(a) for a in on_link_tick(links, 70.5, RULES, spare=True, running=True, host=0)[1]] == [EndJob]
    flapping = Links(downs=((0, 1.0), (0, 2.0)))
    assert [type(a) for a in on_link_report(flapping, 0, False, "dark", 3.0, RULES, spare=True, host=0)[1]] == [Say]
    observer = LinkObserver(EventLog(), RULES)
    observer.host_agent = "a0"
    observer.take_reports([Reported(Report(ReportKind.LINK_DOWN, 0, 0, detail="dark", agent_id="a0"))], ready(),
                          slots(), True, 10.0)
    assert observer.observe(ready(), slots(), True, 20.0) == []


def test_a_probe_verdict_that_lags_the_oss_word_is_no_new_dark_link_until_it_outlasts_it():
    # with a spare on the probe's ring, a short dark (said and repaired by the OS's word) comes back from the probe a
    # round or two late as node 1 cut off: that is no new dark link to move to the spare
    nodes = {n: NodeSlot(n, f"a{n}", f"h{n}", 2, 2 * n) for n in range(2)}
    observer = LinkObserver(EventLog(), RULES)
    observer.take_reports([link_report(ReportKind.LINK_DOWN)], ready(), nodes, True, 10.0)
    [back] = observer.take_reports([link_report(ReportKind.LINK_UP)], ready(), nodes, True, 11.0)
    assert isinstance(back, LinkBack)
    cut_off = spare_board({0: (1,), 1: (-1, 0), -1: (1,)})
    assert observer.watch_reach(ready(), cut_off, nodes, True, 12.0) == [] and observer.links.dark == ()
    assert observer.watch_reach(ready(), cut_off, nodes, True, 15.9) == [] and observer.links.dark == ()
    assert observer.watch_reach(ready(), cut_off, nodes, True, 16.1) == []  # it outlasted the OS's word
    assert [(d.node_rank, d.source) for d in observer.links.dark] == [(1, "probe")]
    [lost] = observer.observe(ready(), nodes, True, 18.2)
    assert isinstance(lost, NodeLost) and lost.slot.node_rank == 1
