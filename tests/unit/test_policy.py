"""The job-level recovery policy, edge by edge (no store, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from ftrun.contract import Milestone
from ftrun.controller.states import IllegalTransition, JobView, Level, Phase
from ftrun.controller.policy import on_controller_moved, on_milestone, on_node_joined, on_node_lost, on_repair_failed, on_replacements_started, on_report, start
from ftrun.messages import CommandKind, Report, ReportKind, WorkerFailure


def failure(rank=1, node=0, gen=0, code=1):
    return WorkerFailure(rank=rank, local_rank=rank % 2, node_rank=node, host=f"h{node}", pid=100 + rank,
                         exit_code=code, generation=gen)


def report(kind, node=0, gen=0, **fields):
    return Report(kind, node, gen, **fields)


def failed(node=0, gen=0, rank=1):
    return report(ReportKind.WORKER_FAILED, node, gen, failures=(failure(rank, node, gen),))


def view(**fields):
    return JobView(node_count=2, max_restarts=fields.pop("max_restarts", 2), **fields)


def test_start_publishes_generation_zero():
    _, commands = start(view())
    assert [(c.kind, c.generation, c.restart_count) for c in commands] == [(CommandKind.START, 0, 0)]


def test_transition_running_to_stopping_on_failure_with_budget_left():
    v, commands = on_report(view(), failed())
    assert v.phase is Phase.STOPPING
    assert [c.kind for c in commands] == [CommandKind.STOP]
    assert "rank 1" in commands[0].reason
    assert v.restarts_used == 0  # spent when the restart happens


def test_transition_stopping_to_running_when_every_node_stopped():
    v, _ = on_report(view(), failed())
    v, commands = on_report(v, report(ReportKind.STOPPED, node=0))
    assert v.phase is Phase.STOPPING and commands == []
    v, commands = on_report(v, report(ReportKind.STOPPED, node=1))
    assert v.phase is Phase.RUNNING
    assert (v.generation, v.restarts_used) == (1, 1)
    assert [(c.kind, c.generation, c.restart_count) for c in commands] == [(CommandKind.START, 1, 1)]


def test_transition_running_to_exiting_when_budget_spent():
    v, commands = on_report(view(max_restarts=0), failed())
    assert v.phase is Phase.EXITING and v.exit_code == 1
    assert [c.kind for c in commands] == [CommandKind.EXIT]
    assert "retry budget spent" in v.reason and "rank 1" in v.reason


def test_a_setting_fault_ends_the_job_without_spending_the_budget():
    setting = dataclasses.replace(failure(rank=3), exit_code=78, cause="setting", detail="snapshot too large")
    v, commands = on_report(view(max_restarts=5), report(ReportKind.WORKER_FAILED, failures=(setting,)))
    assert v.phase is Phase.EXITING and v.exit_code == 1 and v.restarts_used == 0
    assert [c.kind for c in commands] == [CommandKind.EXIT]
    assert "snapshot too large" in v.reason and "not retried" in v.reason


def test_budget_is_job_wide_whatever_node_fails():
    v = view(max_restarts=2)
    for gen, node in enumerate([0, 1]):
        v, _ = on_report(v, failed(node=node, gen=gen))
        for n in (0, 1):
            v, _ = on_report(v, report(ReportKind.STOPPED, node=n, gen=gen))
    assert (v.generation, v.restarts_used, v.budget_left) == (2, 2, 0)
    v, commands = on_report(v, failed(node=0, gen=2))
    assert v.phase is Phase.EXITING and commands[0].kind is CommandKind.EXIT


def test_second_failure_while_stopping_is_recorded_not_acted_on():
    v, _ = on_report(view(), failed(rank=1))
    v, commands = on_report(v, failed(rank=3, node=1))
    assert commands == [] and v.phase is Phase.STOPPING
    assert [f.rank for f in v.failures] == [1, 3]  # the first is the root cause


def test_late_report_from_an_old_generation_is_ignored():
    v = view(generation=3)
    v2, commands = on_report(v, failed(gen=2))
    assert v2 == v and commands == []


def test_transition_running_to_exiting_when_every_node_succeeded():
    v, commands = on_report(view(), report(ReportKind.SUCCEEDED, node=0))
    assert v.phase is Phase.RUNNING and commands == []
    v, commands = on_report(v, report(ReportKind.SUCCEEDED, node=1))
    assert v.phase is Phase.EXITING and v.exit_code == 0
    assert [(c.kind, c.exit_code) for c in commands] == [(CommandKind.EXIT, 0)]


@pytest.mark.parametrize("code", [130, 143])
def test_transition_to_exiting_on_interrupt_carries_its_code(code):
    v, commands = on_report(view(), report(ReportKind.INTERRUPTED, node=1, exit_code=code, detail="SIGINT on node 1"))
    assert v.phase is Phase.EXITING and v.exit_code == code
    assert commands[0].exit_code == code and commands[0].reason == "SIGINT on node 1"


def test_transition_exiting_to_done_after_every_acknowledgement():
    v, _ = on_report(view(max_restarts=0), failed())
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    assert v.phase is Phase.EXITING
    v, _ = on_report(v, report(ReportKind.EXITED, node=1))
    assert v.phase is Phase.DONE


def test_lost_node_ends_the_job_and_needs_no_acknowledgement():
    v, commands = on_node_lost(view(), 1, "node 1 lost")
    assert v.phase is Phase.EXITING and v.exit_code == 1 and v.reason == "node 1 lost"
    assert commands[0].kind is CommandKind.EXIT
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    assert v.phase is Phase.DONE


def test_node_lost_while_exiting_counts_as_its_acknowledgement():
    v, _ = on_report(view(), report(ReportKind.INTERRUPTED, node=0, exit_code=130))
    v, _ = on_report(v, report(ReportKind.EXITED, node=0))
    v, _ = on_node_lost(v, 1, "gone")
    assert v.phase is Phase.DONE and v.exit_code == 130


def test_lost_node_with_a_spare_restarts_the_job_with_the_spare_in_its_place():
    v, commands = on_node_lost(view(), 1, "node 1 lost", spare="spare:9", ranks=(2, 3))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.STOP]
    assert (commands[0].node_rank, commands[0].agent_id) == (1, "spare:9")
    assert v.phase is Phase.STOPPING and v.level is Level.JOB and v.replaced_nodes == ("node 1 lost",)
    assert v.present == {0, 1}  # the node rank lives on, held by the spare, which has nothing to stop
    v, commands = on_report(v, report(ReportKind.STOPPED, node=0))
    assert v.phase is Phase.RUNNING and (v.generation, v.restarts_used) == (1, 1)
    assert [c.kind for c in commands] == [CommandKind.START]


def test_lost_node_with_a_spare_is_a_process_level_repair_when_ready():
    ready = view(recovery=Level.PROCESS, world_size=4, library_ranks=4)
    v, commands = on_node_lost(ready, 1, "node 1 lost", spare="spare:9", ranks=(2, 3))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.REPLACE]
    assert commands[1].ranks == (2, 3) and commands[1].generation == 1
    assert v.level is Level.PROCESS and v.replacing == {2, 3} and v.clearing == {1} and v.restarts_used == 1


def test_lost_node_during_a_process_level_repair_carries_the_repair_into_a_new_generation():
    ready = view(recovery=Level.PROCESS, world_size=4, library_ranks=4)
    v, _ = on_report(ready, failed(node=1, rank=3))
    assert v.level is Level.PROCESS and v.generation == 1 and v.restarts_used == 1
    v, commands = on_node_lost(v, 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.REPLACE]
    assert commands[1].generation == 2 and set(commands[1].ranks) == {0, 1, 3}
    assert v.phase is Phase.STOPPING and v.level is Level.PROCESS and v.replacing == {0, 1, 3}
    assert v.restarts_used == 1  # one fault, one repair
    v, commands = on_node_lost(v, 1, "node 1 lost too", spare="spare:8", ranks=(2, 3))
    assert v.level is Level.JOB  # no replica left: every rank would be replaced


def test_every_rank_lost_one_by_one_after_the_replacements_started_is_one_job_level_restart():
    # without snapshots: the first deaths' replacements hold no state, so once the last healthy rank dies
    # no replica is left, however many generations the repair went through meanwhile
    v, _ = on_report(view(recovery=Level.PROCESS, world_size=4, library_ranks=4), failed(node=0, rank=1))
    for node, rank in ((0, 0), (1, 2)):
        v, _ = on_replacements_started(v)
        v, commands = on_report(v, failed(node=node, gen=0, rank=rank))
        assert v.level is Level.PROCESS and [c.kind for c in commands] == [CommandKind.REPLACE]
    v, _ = on_replacements_started(v)
    v, commands = on_report(v, failed(node=1, gen=0, rank=3))
    # the repair's unit comes back: the job-level restart spends the one unit of this fault as it starts
    assert v.level is Level.JOB and v.no_replica and v.restarts_used == 0


def test_controller_moved_during_a_process_level_repair_goes_on_in_a_new_generation_replacing_the_same_ranks():
    # the same agent took the office again in a new term: no node lost, but the announcement, the milestones
    # and the held REPLACE lived in the store the agents left (issue 40: 60 s "stuck in stopping")
    v, _ = on_report(view(recovery=Level.PROCESS, world_size=4, library_ranks=4), failed(node=0, rank=1))
    for phase in (Phase.STOPPING, Phase.ENV_CLEAR, Phase.REPAIR, Phase.ROLLBACK):
        moved, commands = on_controller_moved(dataclasses.replace(v, phase=phase, replacements_started=True))
        assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 2, (1,))]
        assert (moved.phase, moved.level, moved.replacing, moved.clearing) == (Phase.STOPPING, Level.PROCESS,
                                                                              {1}, {0})
        assert moved.restarts_used == 1 and not moved.replacements_started  # one fault, one repair


def test_controller_moved_during_a_job_level_restart_tells_the_stop_again():
    v, _ = on_report(view(), failed(node=0))
    v, _ = on_report(v, report(ReportKind.STOPPED, node=0))
    moved, commands = on_controller_moved(v)
    assert moved == v and [(c.kind, c.generation) for c in commands] == [(CommandKind.STOP, 0)]


def test_controller_moved_while_the_job_runs_changes_nothing():
    assert on_controller_moved(view()) == (view(), [])


def test_lost_node_during_a_job_level_restart_lets_the_restart_finish():
    v, _ = on_report(view(), failed(node=0))  # the lost node's peers failed first
    v, commands = on_node_lost(v, 1, "node 1 lost", spare="spare:9", ranks=(2, 3))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER] and v.phase is Phase.STOPPING
    v, commands = on_report(v, report(ReportKind.STOPPED, node=0))
    assert v.phase is Phase.RUNNING and v.restarts_used == 1  # one repair, one unit of budget
    assert [c.kind for c in commands] == [CommandKind.START]


def test_lost_node_with_a_spare_but_no_budget_ends_the_job():
    v, commands = on_node_lost(view(max_restarts=0), 1, "node 1 lost", spare="spare:9", ranks=(2, 3))
    assert v.phase is Phase.EXITING and "retry budget spent" in v.reason
    assert [c.kind for c in commands] == [CommandKind.EXIT]


def test_lost_node_while_exiting_takes_no_spare():
    v, _ = on_report(view(), report(ReportKind.INTERRUPTED, node=0, exit_code=130))
    v, commands = on_node_lost(v, 1, "gone", spare="spare:9", ranks=(2, 3))
    assert commands == [] and v.phase is Phase.EXITING and v.replaced_nodes == ()


def test_lost_node_without_a_spare_scales_in_down_to_min_nodes():
    three = JobView(node_count=3, max_restarts=2, world_size=6, min_nodes=2)
    v, commands = on_node_lost(three, 2, "node 2 lost", ranks=(4, 5))
    assert v.phase is Phase.STOPPING and v.level is Level.JOB and [c.kind for c in commands] == [CommandKind.STOP]
    assert v.present == {0, 1} and v.vacant == {2} and v.world_size == 4
    assert v.resized == ("node 2 lost; going on with 2 nodes",)
    v, commands = on_report(on_report(v, report(ReportKind.STOPPED, node=0))[0], report(ReportKind.STOPPED, node=1))
    assert v.phase is Phase.RUNNING and v.restarts_used == 1 and [c.kind for c in commands] == [CommandKind.START]
    v, commands = on_node_lost(v, 1, "node 1 lost", ranks=(2, 3))  # below MIN: the job ends
    assert v.phase is Phase.EXITING and v.exit_code == 1


def test_node_joining_a_smaller_job_grows_it_back_without_spending_budget():
    shrunk = JobView(node_count=3, max_restarts=2, world_size=4, min_nodes=2, vacant=frozenset({2}), restarts_used=1)
    v, commands = on_node_joined(shrunk, 2, "new:1", 2, "n9")
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.STOP] and commands[0].node_rank == 2
    assert v.present == {0, 1, 2} and v.world_size == 6 and v.acknowledged == {2}
    for node in (0, 1):
        v, commands = on_report(v, report(ReportKind.STOPPED, node=node))
    assert v.phase is Phase.RUNNING and v.restarts_used == 1 and not v.free_restart
    assert [c.kind for c in commands] == [CommandKind.START]


def test_node_joining_waits_while_a_repair_is_under_way():
    v, _ = on_report(JobView(node_count=2, max_restarts=2, min_nodes=1, vacant=frozenset({1})), failed(node=0))
    assert on_node_joined(v, 1, "new:1", 2, "n9") == (v, [])


def test_illegal_transition_raises():
    with pytest.raises(IllegalTransition):
        view(phase=Phase.DONE).move(Phase.RUNNING)


def process_view(**fields):
    fields = {"library_ranks": 4, "max_restarts": 3, "recovery": Level.PROCESS, **fields}
    return JobView(node_count=2, world_size=4, **fields)


def test_transition_running_to_stopping_at_process_level_replaces_only_the_failed_rank():
    v, commands = on_report(process_view(), failed(rank=1))
    assert (v.phase, v.level, v.generation, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, 1, 1)
    assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 1, (1,))]


def test_process_repair_walks_the_phases_in_order():
    v, _ = on_report(process_view(), failed(rank=1, node=0))
    v, _ = on_milestone(v, Milestone.STOPPED)
    assert v.phase is Phase.ENV_CLEAR
    v, _ = on_report(v, report(ReportKind.CLEARED, node=0, gen=1))
    assert v.phase is Phase.REPAIR
    v, _ = on_milestone(v, Milestone.RESUMED)  # out of order: ignored
    assert v.phase is Phase.REPAIR
    v, _ = on_milestone(v, Milestone.JOINED)
    assert v.phase is Phase.ROLLBACK
    v, _ = on_milestone(v, Milestone.RESUMED)
    assert v.phase is Phase.RUNNING and v.replacing == frozenset()


def test_reaped_before_every_rank_stopped_skips_straight_to_repair():
    v, _ = on_report(process_view(), failed(rank=1, node=0))
    v, _ = on_report(v, report(ReportKind.CLEARED, node=0, gen=1))
    assert v.phase is Phase.STOPPING
    v, _ = on_milestone(v, Milestone.STOPPED)
    assert v.phase is Phase.REPAIR


def test_second_failure_before_the_group_forms_joins_the_same_repair():
    v, _ = on_report(process_view(), failed(rank=1, node=0))
    v, commands = on_report(v, failed(rank=2, node=1, gen=0))  # its agent had not heard of the repair
    assert (v.generation, v.restarts_used, v.replacing) == (1, 1, frozenset({1, 2}))
    assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 1, (2,))]
    assert v.clearing == frozenset({0, 1})


def test_failure_during_rollback_moves_the_repair_to_a_new_generation_without_new_budget():
    v, _ = on_report(process_view(), failed(rank=1, node=0))
    v = dataclasses.replace(v, phase=Phase.ROLLBACK)
    v, commands = on_report(v, failed(rank=1, node=0, gen=1))
    assert (v.phase, v.generation, v.restarts_used) == (Phase.STOPPING, 2, 1)
    assert commands[0].kind is CommandKind.REPLACE and commands[0].generation == 2


def test_scripts_without_the_library_get_job_level_even_when_process_is_asked():
    v, commands = on_report(process_view(library_ranks=3), failed(rank=1))
    assert v.level is Level.JOB and commands[0].kind is CommandKind.STOP


def test_failed_repair_falls_back_to_job_level():
    v, _ = on_report(process_view(), failed(rank=1))
    v, commands = on_repair_failed(v, "no healthy replica")
    assert (v.phase, v.level) == (Phase.STOPPING, Level.JOB)
    assert commands[0].kind is CommandKind.STOP and "falling back to job level" in commands[0].reason


def test_failed_repair_with_no_budget_left_exits():
    v, _ = on_report(process_view(), failed(rank=1))
    v = dataclasses.replace(v, max_restarts=1)
    v, commands = on_repair_failed(v, "deadline")
    assert v.phase is Phase.EXITING and commands[0].kind is CommandKind.EXIT


def test_transition_running_to_exiting_when_a_node_has_no_usable_device_left():
    v, commands = on_report(view(), report(ReportKind.NODE_UNUSABLE, node=1, detail="no usable device left for local rank 1"))
    assert v.phase is Phase.EXITING and v.exit_code == 4 and v.restarts_used == 0
    assert [(c.kind, c.exit_code) for c in commands] == [(CommandKind.EXIT, 4)]
    assert commands[0].reason == "node 1: no usable device left for local rank 1; no spare node to take its place"


def test_worker_failure_names_its_cause_and_evidence():
    hung = dataclasses.replace(failure(rank=3), cause="hang", detail="no heartbeat for 3.4s")
    assert hung.describe().endswith("exit code 1 (hang: no heartbeat for 3.4s)")


def reports_of(*failed_sets, gen=0):
    """One WORKER_FAILED report per set of ranks, each from the node holding them (2 ranks a node)."""
    return [report(ReportKind.WORKER_FAILED, ranks[0] // 2, gen,
                   failures=tuple(failure(rank, ranks[0] // 2, gen) for rank in ranks)) for ranks in failed_sets]


@pytest.mark.parametrize("arrivals", [
    [(0, 1, 2, 3)],  # one report names every rank: the decision itself is job level
    [(0, 1), (2, 3)],  # a node at a time: the second report turns the process-level repair into job level
    [(2,), (0,), (3,), (1,)],  # one rank at a time
], ids=["one-report", "node-by-node", "rank-by-rank"])
def test_transition_to_stopping_at_job_level_when_every_rank_failed(arrivals):
    v = process_view()
    for failures in reports_of(*arrivals)[:-1]:
        v, _ = on_report(v, failures)
        assert (v.phase, v.level, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, 1)
    v, commands = on_report(v, reports_of(*arrivals)[-1])
    assert (v.phase, v.level, v.no_replica, v.restarts_used) == (Phase.STOPPING, Level.JOB, True, 0)
    assert [c.kind for c in commands] == [CommandKind.STOP]
    assert "every rank failed, no healthy replica holds the training state" in v.reason
    assert f"rank {arrivals[0][0]}" in v.reason  # the root cause, whichever report completed the set
    gen = v.generation  # a process-level repair's generation stays spent: the restart goes past it
    for node in (0, 1):
        v, commands = on_report(v, report(ReportKind.STOPPED, node=node, gen=gen))
    assert (v.phase, v.generation, v.restarts_used, v.no_replica) == (Phase.RUNNING, gen + 1, 1, False)
    assert [c.kind for c in commands] == [CommandKind.START]  # the controller plans the restore with it


@pytest.mark.parametrize("phase", [Phase.ENV_CLEAR, Phase.REPAIR])
def test_transition_to_stopping_at_job_level_when_the_last_healthy_rank_fails_later_in_the_repair(phase):
    v, _ = on_report(process_view(), reports_of((0, 1, 2))[0])
    v = dataclasses.replace(v, phase=phase)
    v, commands = on_report(v, reports_of((3,), gen=0)[0])
    assert (v.phase, v.level, v.restarts_used) == (Phase.STOPPING, Level.JOB, 0)
    assert [c.kind for c in commands] == [CommandKind.STOP]


def test_transition_rollback_to_stopping_at_job_level_when_every_rank_of_the_new_group_failed():
    v, _ = on_report(process_view(), failed(rank=1, node=0))
    v = dataclasses.replace(v, phase=Phase.ROLLBACK)
    v, commands = on_report(v, reports_of((0, 1, 2, 3), gen=1)[0])
    assert (v.phase, v.level, v.restarts_used) == (Phase.STOPPING, Level.JOB, 0)
    assert [c.kind for c in commands] == [CommandKind.STOP]


@pytest.mark.parametrize("arrivals", [
    [(0, 1), (2, 3)],  # a node at a time
    [(3,), (2,), (1,), (0,)],  # one rank at a time, over the repair (the staggered deaths of a whole job)
], ids=["node-by-node", "rank-by-rank"])
def test_every_rank_failed_during_a_repair_with_snapshots_stays_one_process_level_repair(arrivals):
    # its replacements already run in the warm standbys that a job-level restart would want again; each
    # later death goes on in a generation of its own (a dead rank may have counted itself into the last)
    v = process_view(snapshots=True)
    replaced = []
    for gen, failures in enumerate(reports_of(*arrivals), start=1):
        v, commands = on_report(v, failures)
        assert (v.phase, v.level, v.generation, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, gen, 1)
        replaced += [rank for c in commands if c.kind is CommandKind.REPLACE for rank in c.ranks]
        v, _ = on_replacements_started(v)  # the controller's hold is over: the REPLACE went out
    assert sorted(replaced) == [0, 1, 2, 3]  # each rank replaced once
    assert not v.no_replica and v.replacing == frozenset(arrivals[-1])
    v, _ = on_report(v, report(ReportKind.CLEARED, node=arrivals[-1][0] // 2, gen=v.generation))
    v, _ = on_milestone(v, Milestone.STOPPED)  # the replacements started before it left the last generation
    v, _ = on_milestone(v, Milestone.JOINED)
    assert v.phase is Phase.ROLLBACK  # where the ranks go back to their snapshots


@pytest.mark.parametrize("phase", [Phase.ENV_CLEAR, Phase.REPAIR])
def test_last_healthy_ranks_failing_later_in_a_repair_with_snapshots_are_replaced_in_it(phase):
    v, _ = on_report(process_view(snapshots=True), reports_of((3,))[0])
    v = dataclasses.replace(on_replacements_started(v)[0], phase=phase)
    v, commands = on_report(v, reports_of((0, 1, 2), gen=0)[0])
    assert (v.phase, v.level, v.generation, v.replacing, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, 2,
                                                                              frozenset({0, 1, 2}), 1)
    assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 2, (0, 1, 2))]


def test_a_healthy_rank_failing_after_the_replacements_started_goes_on_in_a_new_generation():
    # it may have counted itself into the new group already: that group would wait for it forever
    v, _ = on_report(process_view(), reports_of((3,))[0])
    v, _ = on_replacements_started(v)
    v, commands = on_report(v, reports_of((1,), gen=0)[0])
    assert (v.phase, v.level, v.generation, v.replacing, v.clearing) == (Phase.STOPPING, Level.PROCESS, 2,
                                                                         frozenset({1}), frozenset({0}))
    assert [(c.kind, c.generation, c.ranks) for c in commands] == [(CommandKind.REPLACE, 2, (1,))]


def test_every_rank_failing_in_the_rollback_with_snapshots_goes_on_in_a_new_generation():
    v, _ = on_report(process_view(snapshots=True), failed(rank=3, node=1))
    v = dataclasses.replace(on_replacements_started(v)[0], phase=Phase.ROLLBACK)
    v, commands = on_report(v, reports_of((0, 1, 2, 3), gen=1)[0])
    assert (v.phase, v.level, v.generation, v.restarts_used) == (Phase.STOPPING, Level.PROCESS, 2, 1)
    assert [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, (0, 1, 2, 3))]


@pytest.mark.parametrize("arrivals", [[(0, 1, 2, 3)], [(2, 3), (0, 1)]], ids=["one-report", "before-the-hold-ended"])
def test_every_rank_failing_before_any_replacement_started_restarts_at_job_level_with_snapshots(arrivals):
    # no standby taken yet: the restart finds every one warm, and restores the snapshots as quickly
    v = process_view(snapshots=True)
    for failures in reports_of(*arrivals):
        v, commands = on_report(v, failures)
    assert (v.phase, v.level, v.no_replica) == (Phase.STOPPING, Level.JOB, True)
    assert [c.kind for c in commands] == [CommandKind.STOP]


def test_transition_rollback_to_running_forgets_that_the_replacements_started():
    v, _ = on_report(process_view(snapshots=True), failed(rank=3, node=1))
    v = dataclasses.replace(on_replacements_started(v)[0], phase=Phase.ROLLBACK)
    v, _ = on_milestone(v, Milestone.RESUMED)
    assert (v.phase, v.replacements_started) == (Phase.RUNNING, False)


def test_one_healthy_rank_left_is_still_a_process_level_repair():
    v, commands = on_report(process_view(), reports_of((0, 1, 3))[0])
    assert (v.phase, v.level, v.replacing) == (Phase.STOPPING, Level.PROCESS, frozenset({0, 1, 3}))
    assert [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, (0, 1, 3))]


def test_every_rank_failed_with_the_last_unit_of_budget_restarts_once():
    v = process_view(max_restarts=1)
    v, _ = on_report(v, reports_of((0, 1))[0])
    assert v.budget_left == 0  # spent by the process-level repair...
    v, commands = on_report(v, reports_of((2, 3))[0])
    assert v.phase is Phase.STOPPING and v.budget_left == 1  # ...and given back: the restart spends it
    for node in (0, 1):
        v, commands = on_report(v, report(ReportKind.STOPPED, node=node, gen=v.generation))
    assert (v.phase, v.restarts_used) == (Phase.RUNNING, 1) and commands[0].kind is CommandKind.START


def test_every_rank_failed_without_budget_exits():
    v, commands = on_report(process_view(max_restarts=0), reports_of((0, 1, 2, 3))[0])
    assert v.phase is Phase.EXITING and "retry budget spent" in v.reason
    assert [c.kind for c in commands] == [CommandKind.EXIT]


def test_lost_node_holding_every_rank_restarts_at_job_level_on_the_spare():
    one_node = JobView(node_count=1, max_restarts=2, world_size=2, recovery=Level.PROCESS, library_ranks=2)
    v, commands = on_node_lost(one_node, 0, "node 0 lost", spare="spare:9", ranks=(0, 1))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.STOP]
    assert (v.phase, v.level, v.no_replica) == (Phase.STOPPING, Level.JOB, True)


def test_node_lost_after_the_other_nodes_ranks_finished_restarts_at_job_level_with_a_spare():
    # the controller's agent stopped past its lease while its ranks trained on to the end with the others:
    # a process-level repair would wait for ranks that ended until its deadline (60 s "stuck in stopping")
    v, _ = on_report(process_view(), report(ReportKind.SUCCEEDED, node=1))
    v, commands = on_node_lost(v, 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.STOP]
    assert (v.phase, v.level, v.no_replica) == (Phase.STOPPING, Level.JOB, True)
    assert "the ranks of node 1 had finished" in v.reason
    v, commands = on_report(v, report(ReportKind.STOPPED, node=1))  # nothing to stop there
    assert v.phase is Phase.RUNNING and (v.generation, v.restarts_used) == (1, 1)  # one unit for the node
    assert [c.kind for c in commands] == [CommandKind.START]


def test_transition_repair_to_stopping_at_job_level_when_a_healthy_nodes_ranks_finished_before_it():
    # the successor put node 1's ranks in the repair of node 0's loss; node 1 then says again, to the new
    # store, that they had finished generation 0
    v, _ = on_node_lost(process_view(), 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    assert (v.level, v.generation, v.restarts_used) == (Level.PROCESS, 1, 1)
    for phase in (Phase.STOPPING, Phase.ENV_CLEAR, Phase.REPAIR, Phase.ROLLBACK):
        given_up, commands = on_report(dataclasses.replace(v, phase=phase), report(ReportKind.SUCCEEDED, node=1, gen=0))
        assert [(c.kind, c.generation) for c in commands] == [(CommandKind.STOP, 1)]
        assert (given_up.phase, given_up.level, given_up.no_replica) == (Phase.STOPPING, Level.JOB, True)
        assert "the ranks of node 1 finished generation 0 before the repair reached them" in given_up.reason
        assert given_up.restarts_used == 0  # the job-level restart spends the fault's one unit as it starts
    # a success of the repair's own generation, or after it, is not this: it counts as ever
    assert on_report(v, report(ReportKind.SUCCEEDED, node=1, gen=1))[0].level is Level.PROCESS
    assert on_report(process_view(), report(ReportKind.SUCCEEDED, node=1, gen=0))[0].succeeded == {1}


def test_a_failure_said_again_to_a_controller_that_knows_it_changes_nothing():
    # an agent says its failures again to each new controller (etcd): the successor's journal may hold them
    v, _ = on_report(process_view(), failed(node=1, rank=3))
    assert v.generation == 1
    again, commands = on_report(v, failed(node=1, rank=3))
    assert (again, commands) == (v, [])
    v2, _ = on_node_lost(v, 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    assert on_report(v2, failed(node=1, rank=3)) == (v2, [])  # in the repair it goes on with: still known


def test_a_failure_said_again_to_a_successor_whose_journal_missed_it_joins_the_repair_it_finds():
    # issue 40: the controller died inside an etcd outage after telling the repair, before its journal held it;
    # its successor loses the controller's node, then hears rank 3's death again from its agent
    v, _ = on_node_lost(process_view(), 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    v, commands = on_report(v, failed(node=1, gen=0, rank=3))
    assert [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, (3,))]
    assert (v.level, v.replacing, v.restarts_used) == (Level.PROCESS, {0, 1, 3}, 1)  # one repair for both


def test_a_successor_never_reuses_the_generation_its_predecessor_may_have_told_the_ranks_of():
    # the predecessor told the healthy ranks of a repair into generation 1 and died while its journal waited for
    # etcd: reused, generation 1 found rank 2 past its first milestones in the old store (60 s stuck in stopping)
    successor = dataclasses.replace(process_view(), unjournaled=1)
    v, commands = on_node_lost(successor, 0, "node 0 lost with the controller it hosted", spare="spare:9", ranks=(0, 1))
    assert v.generation == 2 and [(c.kind, c.generation) for c in commands] == [(CommandKind.TAKEOVER, 0),
                                                                               (CommandKind.REPLACE, 2)]
    v, commands = on_report(successor, failed(node=1, rank=3))
    assert v.generation == 2 and commands[0].generation == 2
    v, _ = on_report(dataclasses.replace(view(), unjournaled=1), failed())  # job level: the START's too
    v, commands = on_report(v, report(ReportKind.STOPPED, node=0))
    v, commands = on_report(v, report(ReportKind.STOPPED, node=1))
    assert (v.generation, v.start_generation) == (2, 2) and [c.generation for c in commands] == [2]
    assert on_report(process_view(generation=2, unjournaled=1), failed(gen=2))[0].generation == 3  # as ever
