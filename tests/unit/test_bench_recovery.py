"""scripts/bench_recovery.py --layouts: what it reads from the runs and how it compares them (no runs)."""

import argparse
import importlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests import parts

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("bench_recovery")
    finally:
        sys.path.remove(str(SCRIPTS))


def run(bench, name: str, regain: float | None, median_step: float | None, redone: int | None = 0):
    return bench.RunResult(
        launcher=name, description=name, nnodes=2, nproc_per_node=2, kill_rank=3, outcome="ok", exit_codes=[0, 0],
        last_step=60, resumed_after_step=None if redone is None else 25 - redone, steps_redone=redone,
        healthy_pids_kept=True, regain_progress_s=regain, median_step_s=median_step, launch_to_first_step_s=5.0,
        wall_s=30.0,
    )


def test_repair_lines_are_the_controllers_lines_after_a_fault(bench, tmp_path):
    log = tmp_path / "node0.log"
    log.write_text(
        "ftrun: node 0 of 2, ranks 0-1 of 4\n"
        "ftrun: generation 1 resumed training 0.61s after the fault (detect 20 ms, stop 56 ms, env clear 45 ms, "
        "repair 300 ms, rollback 190 ms)\n"
        "rank 0 of 4: starting after step 0 (restart 0)\n"
        "ftrun: generation 3 back in training 6.40s after the fault (detect 43 ms, restart 6282 ms)\n"
    )
    assert bench.repair_lines([log]) == (
        "generation 1 resumed training 0.61s after the fault (detect 20 ms, stop 56 ms, env clear 45 ms, "
        "repair 300 ms, rollback 190 ms)",
        "generation 3 back in training 6.40s after the fault (detect 43 ms, restart 6282 ms)",
    )


def test_layout_row_ratios_are_medians_over_repeats(bench):
    case = bench.layout_cases(5)["ddp"]
    row = bench.LayoutRow(
        case,
        ftrun=[run(bench, "f", 0.5, 0.102), run(bench, "f", 0.7, 0.104)],
        torchrun=[run(bench, "t", 6.0, 0.100), run(bench, "t", 6.0, 0.100)],
        torch_ddp=[run(bench, "d", 6.0, 0.103)],
    )
    assert row.regain_ratio == pytest.approx(0.1)
    assert row.step_ratio == pytest.approx(1.03)
    assert row.step_ratio_vs_torch_ddp == pytest.approx(1.0)
    assert row.to_json()["steps_redone"] == {"ftrun": 0, "torchrun": 0}


def test_layout_row_without_a_measurement_has_no_ratio(bench):
    row = bench.LayoutRow(bench.layout_cases(5)["fsdp"], ftrun=[run(bench, "f", None, 0.1, redone=None)],
                          torchrun=[run(bench, "t", 6.0, 0.1)], torch_ddp=[])
    assert row.regain_ratio is None
    assert row.most_redone(row.ftrun) is None
    assert row.step_ratio_vs_torch_ddp is None


def test_layout_names(bench):
    assert bench.layout_names("all") == list(bench.LAYOUT_NAMES)
    assert bench.layout_names("fsdp, pp") == ["fsdp", "pp"]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.layout_names("fsdp,zero3")


def test_layout_launchers_run_the_cases_script_with_its_options(bench, tmp_path):
    case = bench.layout_cases(5)["all-lost"]
    torchrun, ftrun, reference = bench.layout_launchers(case)
    assert reference is None
    scenario = bench.Scenario(nnodes=2, nproc_per_node=2, steps=60, ckpt_every=10, kill_rank=3, kill_at_step=25,
                              step_sleep=0.0, deadline=90.0, kill_all=True)
    command = bench.launcher_command(ftrun, scenario, 29400, "run", tmp_path, 0)
    assert command[command.index("--recovery") + 1:command.index("--recovery") + 4] == [
        "process", "--snapshot-every", "5"]
    assert command[command.index("--kill-rank") + 1] == "all"
    fsdp = bench.layout_cases(5)["fsdp"]
    command = bench.launcher_command(bench.layout_launchers(fsdp)[0], replace(scenario, kill_all=False), 29400, "run",
                                     tmp_path, 0)
    script = command.index(str(fsdp.script))
    assert command[script + 1:script + 3] == ["--layout", "fsdp"]
    assert command[command.index("--kill-rank") + 1] == "3"


def test_layouts_mode_has_its_own_defaults(bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py", "--layouts", "all", "--repeat", "2"])
    args, scenarios, _ = bench.parse_args()
    assert args.layouts == list(bench.LAYOUT_NAMES)
    assert (scenarios[0].steps, scenarios[0].kill_at_step, scenarios[0].warmup_s) == (160, 135, 5.0)
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py"])
    assert bench.parse_args()[1][0].warmup_s == 0.0  # the single run measures as before


def test_median_step_leaves_out_the_warmup_but_never_more_than_half(bench):
    slow_then_fast = [bench.ProgressLine(t, 0, step, 1, 0) for step, t in
                      enumerate([0.0, 1.0, 2.0, 3.0, 3.1, 3.2, 3.3, 3.4, 3.5, 3.6], start=1)]
    assert bench.median_step_s(slow_then_fast) == pytest.approx(0.1)
    assert bench.median_step_s(slow_then_fast, warmup_s=2.5) == pytest.approx(0.1)
    assert bench.median_step_s(slow_then_fast[:4], warmup_s=2.5) == pytest.approx(1.0)  # half of the steps still count
    assert bench.median_step_s([]) is None


def test_every_other_repeat_runs_the_launchers_the_other_way_round(bench, monkeypatch, tmp_path):
    case = bench.layout_cases(5)["torch-ddp"]
    torchrun, ftrun, _ = bench.layout_launchers(case)
    order = []

    def measured(launcher, scenario, workdir):
        order.append(launcher.name)
        return run(bench, launcher.name, 1.0, 0.1 if launcher.name == torchrun.name else 0.105)

    monkeypatch.setattr(bench, "benchmark", measured)
    scenario = bench.Scenario(nnodes=2, nproc_per_node=2, steps=60, ckpt_every=10, kill_rank=3, kill_at_step=25,
                              step_sleep=0.0, deadline=60.0)
    rows = bench.run_layouts([case], scenario, tmp_path, 3)
    assert order == [torchrun.name, ftrun.name, ftrun.name, torchrun.name, torchrun.name, ftrun.name]
    # each repeat's results in the launchers' order again: the ratio is ftrun's over torchrun's
    assert [r.launcher for r in rows[0].torchrun] == [torchrun.name] * 3
    assert [r.launcher for r in rows[0].ftrun] == [ftrun.name] * 3
    assert rows[0].step_ratio == pytest.approx(1.05)


# --- --controller-loss ----------------------------------------------------------------------------


def controller_loss_scenario(bench):
    return bench.Scenario(nnodes=2, nproc_per_node=2, steps=60, ckpt_every=10, kill_rank=3, kill_at_step=25,
                          step_sleep=0.05, deadline=180.0, node_loss=True, controller_loss=True, node_timeout=3.0)


def test_controller_loss_under_etcd_starts_candidates_on_the_clusters_endpoints(bench, tmp_path):
    scenario = controller_loss_scenario(bench)
    assert (scenario.lost_node, replace(scenario, controller_loss=False).lost_node) == (0, 1)
    etcd = bench.LAUNCHERS["ftrun-etcd"]
    assert scenario.spares(etcd) == 1
    command = bench.launcher_command(etcd, scenario, 29400, "run", tmp_path, 2, "127.0.0.1:2379,127.0.0.1:2381")
    assert command[command.index("--rdzv-endpoint") + 1] == "127.0.0.1:2379,127.0.0.1:2381"
    assert command[command.index("--rdzv-backend") + 1] == "etcd"
    assert command[command.index("--local-addr") + 1] == "127.0.0.4"
    assert command[command.index("--spares"):command.index("--spares") + 4] == ["--spares", "1", "--node-timeout", "3"]
    assert "--rdzv-conf" not in command and "--node-rank" not in command  # node 0 leads by starting first
    c10d = bench.launcher_command(bench.LAUNCHERS["ftrun-c10d"], scenario, 29400, "run", tmp_path, 0)
    assert c10d[c10d.index("--rdzv-endpoint") + 1] == "127.0.0.1:29400"
    assert c10d[c10d.index("--rdzv-conf") + 1] == "is_host=1"  # the store on the node that is lost
    assert c10d[c10d.index("--node-rank") + 1] == "0" and "--rdzv-backend" not in c10d


def progress(bench, *rows):
    return [bench.ProgressLine(t, rank, step, pid, 0) for t, rank, step, pid in rows]


def test_controller_loss_regained_under_etcd_keeps_the_other_nodes_pids(bench):
    scenario = replace(controller_loss_scenario(bench), steps=26)
    lines = progress(bench, *[(10.0 + step * 0.1, rank, step, 100 + rank) for step in range(1, 26) for rank in range(4)],
                     # the spare's replacements of ranks 0 and 1, and ranks 2 and 3 in their own processes
                     (16.0, 0, 26, 200), (16.0, 1, 26, 201), (16.1, 2, 26, 102), (16.2, 3, 26, 103))
    loss = bench.NodeLoss(12.6, frozenset({100, 101, 50}))
    result = bench.analyse(bench.LAUNCHERS["ftrun-etcd"], scenario, 5.0, [0, 0], lines, 30.0, loss)
    assert result.outcome == "ok" and result.outcome_text() == "ok"
    assert result.regain_progress_s == pytest.approx(3.6)
    assert result.healthy_pids_kept is True  # node 0's ranks are the lost ones: 2 and 3 kept theirs
    assert result.steps_redone == 0


def test_controller_loss_under_c10d_ends_the_job_and_says_so(bench):
    scenario = controller_loss_scenario(bench)
    lines = progress(bench, *[(10.0 + step * 0.1, rank, step, 100 + rank) for step in range(1, 26) for rank in range(4)])
    loss = bench.NodeLoss(12.6, frozenset({100, 101}))
    result = bench.analyse(bench.LAUNCHERS["ftrun-c10d"], scenario, 5.0, [1, 1], lines, 20.0, loss)
    assert result.regain_progress_s is None
    assert result.outcome_text() == "job ended: lost the controller (exit 1, 1; last step 25)"
    # the node loss without a spare, stopped by the benchmark, still reads as before
    stopped = bench.analyse(bench.LAUNCHERS["ftrun-c10d"], scenario, 5.0, [None, None], lines, 60.0, loss)
    assert stopped.outcome == "fails"


def test_controller_loss_row_goal_is_the_node_timeout_plus_a_second(bench, tmp_path):
    etcd = replace(run(bench, "ftrun-etcd", 3.9, 0.06), lost_controller_lines=())
    c10d = replace(run(bench, "ftrun-c10d", None, 0.06), outcome="ended", exit_codes=[1, 1],
                   lost_controller_lines=("ftrun: lost the controller: the store went",))
    row = bench.ControllerLossRow(c10d, etcd, 3.0)
    assert (row.goal_s, row.goal_met) == (4.0, True)
    assert replace(row, etcd=replace(etcd, regain_progress_s=4.5)).goal_met is False
    assert replace(row, etcd=replace(etcd, regain_progress_s=None)).goal_met is None
    document = row.to_json()
    assert document["row"] == "controller's node lost, spare"
    assert document["c10d"]["outcome"] == "ended" and document["etcd"]["regain_progress_s"] == 3.9
    assert document["c10d"]["lost_controller_lines"] == ("ftrun: lost the controller: the store went",)
    log = tmp_path / "node1.log"
    log.write_text("ftrun: node 1 of 2\nftrun: lost the controller: the control store stopped answering\n")
    assert bench.lines_saying([log], bench.LOST_CONTROLLER_LINE) == (
        "ftrun: lost the controller: the control store stopped answering",)


def test_controller_loss_mode_runs_its_own_pair_at_2x2(bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py", "--controller-loss", "--node-timeout", "3"])
    args, scenarios, launchers = bench.parse_args()
    scenario = scenarios[0]
    assert args.controller_loss and [launcher.name for launcher in launchers] == list(bench.CONTROLLER_PAIR)
    assert (scenario.nnodes, scenario.nproc_per_node, scenario.node_loss, scenario.lost_node) == (2, 2, True, 0)
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py", "--controller-loss", "--launchers", "ftrun"])
    with pytest.raises(SystemExit):
        bench.parse_args()


# --- --layouts link-cut: the online level ---------------------------------------------------------


def link_cut_scenario(bench):
    args = bench.Scenario(nnodes=2, nproc_per_node=2, steps=160, ckpt_every=10, kill_rank=3, kill_at_step=135,
                          step_sleep=0.0, deadline=240.0, warmup_s=5.0)
    return bench.layout_scenario(bench.layout_cases(5)["link-cut"], args)


def test_layout_names_take_link_cut_and_all_takes_it_too(bench):
    assert bench.layout_names("link-cut") == ["link-cut"]
    assert "link-cut" in bench.layout_names("all")


def test_layout_names_refuses_an_empty_list_without_a_name_error(bench):
    # it read an undefined `args` when no name was given
    with pytest.raises(argparse.ArgumentTypeError):
        bench.layout_names(",")


def test_link_cut_runs_at_1x4_cutting_rank_1_and_the_script_kills_nothing(bench, tmp_path):
    scenario = link_cut_scenario(bench)
    assert (scenario.nnodes, scenario.nproc_per_node, scenario.kill_rank, scenario.kill_at_step) == (1, 4, 1, 135)
    assert scenario.link_cut and not scenario.script_kills and scenario.shape == "1 node x 4 ranks"
    torchrun, ftrun, reference = bench.layout_launchers(bench.layout_cases(5)["link-cut"])
    assert reference is None and torchrun.name == "link-cut-torchrun-noshare"
    for launcher in (torchrun, ftrun):
        command = bench.launcher_command(launcher, scenario, 29400, "run", tmp_path, 0)
        assert "--kill-rank" not in command and "--kill-at-step" not in command
        assert command[command.index("--nproc-per-node") + 1] == "4"
    fault_free = replace(scenario, link_cut=False, fault_free=True)
    assert "--kill-rank" not in bench.launcher_command(ftrun, fault_free, 29400, "run", tmp_path, 0)
    # the other layouts keep the command line's shape and their kill
    fsdp = bench.layout_scenario(bench.layout_cases(5)["fsdp"], replace(scenario, nnodes=2, nproc_per_node=2, kill_rank=3))
    assert (fsdp.nnodes, fsdp.kill_rank, fsdp.link_cut, fsdp.script_kills) == (2, 3, False, True)


def connection(local_port, remote_port, host="127.0.0.1"):
    return ((host, local_port), (host, remote_port))


def test_only_connections_whose_other_end_is_a_peers_are_cut(bench):
    rank1 = [connection(40001, 50000),  # to rank 0's listening gloo port
             connection(40002, 29400),  # to the control store (the agent's process): stays
             connection(40003, 41000)]  # rank 2 connected to rank 1: its end is rank 2's own
    rank0 = [connection(50000, 40001), connection(50001, 29400)]
    rank2 = [connection(41000, 40003)]
    assert bench.connections_to_peers(rank1, [rank0, rank2]) == [connection(40001, 50000), connection(40003, 41000)]
    assert bench.connections_to_peers(rank1, []) == []


def test_ss_kill_command_names_one_connection_with_ipv6_hosts_in_brackets(bench):
    assert bench.ss_kill_command(connection(40001, 50000)) == [
        "ss", "-K", "-tn", "src", "127.0.0.1:40001", "dst", "127.0.0.1:50000"]
    assert bench.ss_kill_command(connection(1, 2, "::1"))[4:] == ["[::1]:1", "dst", "[::1]:2"]
    assert bench.ss_address(("::ffff:127.0.0.1", 80)) == "[::ffff:127.0.0.1]:80"


def test_rank_pids_are_each_ranks_latest(bench):
    lines = progress(bench, (1.0, 0, 1, 100), (1.0, 1, 1, 101), (2.0, 1, 1, 201))
    assert bench.rank_pids(lines) == {0: 100, 1: 201}


def test_cut_rank_links_resets_each_connection_to_a_peer_and_checks_they_are_gone(bench, monkeypatch):
    connections = {101: [connection(40001, 50000), connection(40002, 29400)], 100: [connection(50000, 40001)],
                   102: [], 103: []}
    commands = []

    def ss(command, **kwargs):
        commands.append(command)
        connections[101] = [c for c in connections[101] if bench.ss_kill_command(c) != command]
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench, "tcp_connections", lambda pid: connections[pid])
    monkeypatch.setattr(bench.subprocess, "run", ss)
    cut = bench.cut_rank_links({0: 100, 1: 101, 2: 102, 3: 103}, 1)
    assert (cut.rank, cut.connections, cut.started) == (1, 1, ())
    assert commands == [["ss", "-K", "-tn", "src", "127.0.0.1:40001", "dst", "127.0.0.1:50000"]]
    # a kernel that cannot destroy sockets: ss says nothing, the connection stays, and the run must not count
    connections[101] = [connection(40001, 50000)]
    monkeypatch.setattr(bench.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 0))
    with pytest.raises(RuntimeError, match="left 1 of rank 1's 1 connections"):
        bench.cut_rank_links({0: 100, 1: 101}, 1)


def test_recovery_level_is_the_lowest_that_ftrun_decided(bench):
    online = "ftrun: online repair into generation 1: a collective of rank 1 failed while every process lived (...)"
    down = ("ftrun: process-level repair into generation 1: rank 2 ...; replacing rank 2 (the online repair under way "
            "goes down to it)")
    fell = "ftrun: online repair of generation 1 falls back to job level: the re-formed groups failed"
    assert bench.recovery_level((online,)) == "online"
    assert bench.recovery_level((online, down)) == "process"
    assert bench.recovery_level((online, fell)) == "job"
    assert bench.recovery_level(()) == "-"


def test_decision_lines_come_from_every_log_in_order(bench, tmp_path):
    log = tmp_path / "node0.log"
    log.write_text("ftrun: node 0 of 1\nftrun: online repair into generation 1: a collective failed\n"
                   "rank 1: step 43 interrupted; repairing into generation 1\n"
                   "ftrun: online repair of generation 1 falls back to job level: x\n")
    assert bench.lines_saying([log], *bench.DECISION_LINES) == (
        "ftrun: online repair into generation 1: a collective failed",
        "ftrun: online repair of generation 1 falls back to job level: x")


def train_to(bench, last_step, pids, start=1, t0=10.0):
    return [(t0 + step * 0.1, rank, step, pid) for step in range(start, last_step + 1) for rank, pid in enumerate(pids)]


def test_a_cut_repaired_in_place_stands_still_from_the_first_reset_and_redoes_nothing(bench):
    scenario = replace(link_cut_scenario(bench), steps=60, kill_at_step=40)
    pids = [100, 101, 102, 103]
    # every rank at step 42 when the links go; rank 2 finishes step 43 as the others' collectives fail; all go on at 44
    lines = progress(bench, *train_to(bench, 42, pids), (14.35, 2, 43, 102),
                     *train_to(bench, 60, pids, start=44, t0=10.9))
    cut = bench.LinkCut(14.25, 1, 3)
    result = bench.analyse(bench.LAUNCHERS["ftrun-process"], scenario, 5.0, [0], lines, 30.0, None, cut)
    assert result.regain_progress_s == pytest.approx(0.1 * 44 + 10.9 - 14.25)
    assert result.steps_redone == 0 and result.healthy_pids_kept is True
    assert (result.links_cut, result.started_after_fault, result.outcome) == (3, (), "ok")


def test_a_cut_that_restarts_every_worker_counts_the_redone_steps_and_the_new_processes(bench):
    scenario = replace(link_cut_scenario(bench), steps=60, kill_at_step=40)
    lines = progress(bench, *train_to(bench, 43, [100, 101, 102, 103]),
                     *train_to(bench, 60, [200, 201, 202, 203], start=41, t0=20.0))  # from the checkpoint at 40
    started = tuple(f"{pid} python train_ddp_elastic.py" for pid in (200, 201, 202, 203))
    cut = bench.LinkCut(14.35, 1, 4, started)
    result = bench.analyse(bench.LAUNCHERS[bench.BASELINE], scenario, 5.0, [0], lines, 40.0, None, cut)
    assert result.steps_redone == 3 and result.healthy_pids_kept is False
    assert result.regain_progress_s == pytest.approx(20.0 + 4.4 - 14.35)
    assert result.started_after_fault == started


def test_a_warm_standby_that_takes_a_ranks_place_after_the_cut_counts_as_started(bench):
    # the online repair went down to process level: rank 2 replaced in a standby started at launch (pid 300)
    scenario = replace(link_cut_scenario(bench), steps=60, kill_at_step=40)
    lines = progress(bench, *train_to(bench, 43, [100, 101, 102, 103]),
                     *train_to(bench, 60, [100, 101, 300, 103], start=44, t0=25.0))
    cut = bench.LinkCut(14.35, 1, 3, ("7841 python -m ftrun.agent.standby",))  # the standby made again after
    result = bench.analyse(bench.LAUNCHERS["ftrun-process"], scenario, 5.0, [0], lines, 40.0, None, cut)
    assert result.started_after_fault == ("7841 python -m ftrun.agent.standby", "300 (in rank 2's place)")
    assert result.healthy_pids_kept is False and result.steps_redone == 0


def test_stand_still_after_a_cut_counts_from_the_step_in_flight_that_still_finished(bench):
    # every rank at step 42 at the cut (14.25); step 43's collectives were done, so 43 finishes at 14.27, and
    # 44's fail: the restart's ranks come back from the checkpoint at 40 and pass 43 at 24.4
    old, new = [100, 101, 102, 103], [200, 201, 202, 203]
    lines = progress(bench, *train_to(bench, 42, old), *[(14.27, rank, 43, pid) for rank, pid in enumerate(old)],
                     *train_to(bench, 60, new, start=41, t0=20.0))
    # the measure of a kill, every rank past the step finished at the fault, would stop at 14.27: 0.02 s
    assert bench.stand_still(lines, 4, 14.25) == pytest.approx((14.27, 20.0 + 4.4 - 14.27))
    scenario = replace(link_cut_scenario(bench), steps=60, kill_at_step=40)
    result = bench.analyse(bench.LAUNCHERS[bench.BASELINE], scenario, 5.0, [0], lines, 40.0, None,
                           bench.LinkCut(14.25, 1, 4))
    assert result.regain_progress_s == pytest.approx(10.13)
    assert result.steps_redone == 3  # 41 to 43, the step in flight at the cut included


def test_stand_still_is_none_when_training_never_goes_on(bench):
    lines = progress(bench, *train_to(bench, 42, [100, 101, 102, 103]), (14.35, 2, 43, 102))
    assert bench.stand_still(lines, 4, 14.25) is None
    assert bench.stand_still([], 4, 14.25) is None


def link_cut_row(bench, ftrun_digests=("a", "a"), torchrun_digests=("a", "a"), started=((), ())):
    case = bench.layout_cases(5)["link-cut"]
    ftrun = [replace(run(bench, "f", regain, 0.09), final_digest=digest, started_after_fault=s,
                     decision_lines=("ftrun: online repair into generation 1: x",))
             for regain, digest, s in zip((0.9, 1.1), ftrun_digests, started)]
    torchrun = [replace(run(bench, "t", regain, 0.09, redone=5), final_digest=digest, healthy_pids_kept=False,
                        started_after_fault=("1 a", "2 b", "3 c", "4 d"))
                for regain, digest in zip((8.0, 12.0), torchrun_digests)]
    return bench.LayoutRow(case, ftrun=ftrun, torchrun=torchrun, torch_ddp=[],
                           ftrun_fault_free=replace(run(bench, "ff", None, 0.09), final_digest="a"),
                           torchrun_fault_free=replace(run(bench, "tf", None, 0.09), final_digest="a"))


def test_link_cut_row_holds_ftrun_to_one_second_no_process_and_the_fault_free_state(bench):
    row = link_cut_row(bench)
    assert row.regain_ratio == pytest.approx(0.1)
    assert row.link_cut_goals() == {"stand_still": True, "no_process_started": True, "bit_identical": True}
    document = row.to_json()
    assert document["stand_still_s"] == {"ftrun": pytest.approx(1.0), "torchrun": pytest.approx(10.0)}
    assert document["processes_started"] == {"ftrun": [0, 0], "torchrun": [4, 4]}
    assert document["steps_redone"] == {"ftrun": 0, "torchrun": 5}
    assert document["bit_identical"] == {"ftrun": [True, True], "torchrun": [True, True]}
    assert document["ftrun_levels"] == ["online", "online"] and document["fault_free_runs_agree"] is True
    missed = link_cut_row(bench, ftrun_digests=("a", "b"), started=((), ("7 python -m ftrun.agent.standby",)))
    assert missed.link_cut_goals() == {"stand_still": True, "no_process_started": False, "bit_identical": False}
    unknown = replace(row, ftrun_fault_free=None)
    assert unknown.bit_identical(unknown.ftrun, None) == [None, None]
    assert unknown.link_cut_goals()["bit_identical"] is None


def test_link_cut_is_skipped_in_one_line_without_root_or_ss(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "why_links_cannot_be_cut", lambda: "ss (iproute2) is not installed")
    monkeypatch.setattr(bench, "benchmark", lambda *args: pytest.fail("nothing runs"))
    rows = bench.run_layouts([bench.layout_cases(5)["link-cut"]], link_cut_scenario(bench), tmp_path, 3)
    assert rows[0].skipped == "ss (iproute2) is not installed"
    assert rows[0].to_json() == {"layout": "link-cut", "description": rows[0].case.description,
                                 "skipped": "ss (iproute2) is not installed"}
    bench.print_layouts_table(rows, link_cut_scenario(bench), 3)
    assert "link-cut: skipped: ss (iproute2) is not installed" in capsys.readouterr().err


def test_link_cut_runs_each_launcher_fault_free_once_then_the_repeats(bench, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "why_links_cannot_be_cut", lambda: "")
    runs = []

    def measured(launcher, scenario, workdir):
        runs.append((launcher.name, scenario.link_cut, scenario.fault_free))
        return replace(run(bench, launcher.name, 0.9, 0.09), description=launcher.description, final_digest="a")

    monkeypatch.setattr(bench, "benchmark", measured)
    rows = bench.run_layouts([bench.layout_cases(5)["link-cut"]], link_cut_scenario(bench), tmp_path, 2)
    torchrun, ftrun = "link-cut-torchrun-noshare", "link-cut-ftrun-process"
    assert runs == [(f"{torchrun}-fault-free", False, True), (f"{ftrun}-fault-free", False, True),
                    (torchrun, True, False), (ftrun, True, False), (ftrun, True, False), (torchrun, True, False)]
    row = rows[0]
    assert (row.ftrun_fault_free.launcher, row.torchrun_fault_free.launcher) == (f"{ftrun}-fault-free",
                                                                                 f"{torchrun}-fault-free")
    assert [r.launcher for r in row.ftrun] == [ftrun, ftrun]
    bench.print_layouts_table(rows, link_cut_scenario(bench), 2)
    err = capsys.readouterr().err
    assert "Online level" in err and "Process-level recovery by layout" not in err  # no other row, no other table


def test_checkpoint_digest_tells_one_bit_apart(bench, tmp_path):
    torch = parts.module("torch")
    state = {"model": {"0.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
             "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2, 3)}}, "param_groups": [{"lr": 0.01}]},
             "step": 160}
    torch.save(state, tmp_path / "a.pt")
    torch.save(state, tmp_path / "b.pt")
    state["optimizer"]["state"][0]["momentum_buffer"][1, 2] = -0.0  # the same value, another bit
    torch.save(state, tmp_path / "c.pt")
    digest = bench.checkpoint_digest
    assert digest(tmp_path / "a.pt") == digest(tmp_path / "b.pt")
    assert digest(tmp_path / "a.pt") != digest(tmp_path / "c.pt")
    assert digest(tmp_path / "missing.pt") is None


# -- the start's row ------------------------------------------------------------------------------------


def test_the_start_row_compares_launch_to_first_step_per_repeat_and_over_the_medians(bench):
    case = bench.layout_cases(5)["start"]
    assert case.start and case.shape == (1, 4) and "start" in bench.layout_names("all")
    ftrun = [replace(run(bench, "f", None, 0.1), launch_to_first_step_s=s) for s in (6.6, 6.0, 7.2)]
    torchrun = [replace(run(bench, "t", None, 0.1), launch_to_first_step_s=s) for s in (6.0, 6.0, 6.0)]
    row = bench.LayoutRow(case, ftrun=ftrun, torchrun=torchrun, torch_ddp=[])
    assert row.start_ratio == pytest.approx(1.1)
    assert row.start_ratios() == [pytest.approx(1.1), pytest.approx(1.0), pytest.approx(1.2)]
    summary = row.to_json()
    assert summary["goal"] == bench.START_GOAL and summary["goal_met"] is True
    assert summary["each_run_s"] == {"ftrun": [6.6, 6.0, 7.2], "torchrun": [6.0, 6.0, 6.0]}


def test_the_start_row_without_a_first_step_has_no_ratio(bench):
    ftrun = [replace(run(bench, "f", None, 0.1), launch_to_first_step_s=None)]
    row = bench.LayoutRow(bench.layout_cases(5)["start"], ftrun=ftrun, torchrun=[run(bench, "t", None, 0.1)],
                          torch_ddp=[])
    assert row.start_ratio is None and row.to_json()["goal_met"] is None


def test_dark_link_mode_runs_bench_dark_link_s_scenarios_and_holds_each_ftrun_row_to_the_goals(bench, monkeypatch,
                                                                                                tmp_path, capsys):
    import bench_dark_link

    figures = {"no-spare": {"said_s": 0.1, "resumed_s": 0.9, "processes_started": 0},
               "spare": {"said_s": 0.1, "resumed_s": 3.4, "processes_started": 2},
               "torchrun": {"said_s": None, "resumed_s": 24.5, "processes_started": 0},
               "silent": {"said_s": 2.5, "resumed_s": 3.5, "processes_started": 0},  # past the 3 s goal
               "never-back": {"said_s": 0.2, "ended_s": 10.1, "exit_codes": [1, 1], "left_behind": 0,
                              "reason": "reason: node 1: data link data dark (operstate down, no carrier) for 8s"},
               "leave-out": {"said_s": 0.2, "left_out_s": 8.3, "ended_s": 20.0, "exit_codes": [0, 1],
                             "left_behind": 1, "reason": ""},  # a process left behind
               "silent-spare": {"said_s": 2.7, "resumed_s": 4.6, "processes_started": 2}}
    cases = []

    def run(scenario, case, reference, workdir):
        cases.append(case)
        if reference is None:
            return {"scenario": "fault-free", "digests": {0: "d"}}
        return {"scenario": scenario, "bit_identical": True, "final_step": case.steps, "digests": {0: "d"},
                **figures[scenario]}

    monkeypatch.setattr(bench_dark_link, "run", run)
    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    out = tmp_path / "dark.json"
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py", "--dark-link", "--dark-for", "5", "--json", str(out),
                                      "--work-dir", str(tmp_path / "work")])
    assert bench.main() == 0
    assert {(c.dark_for, c.steps, c.step_sleep, c.scenarios) for c in cases} == {(5.0, 40, 0.1, bench_dark_link.SCENARIOS)}
    rows = json.loads(out.read_text())["dark_link"]["rows"]
    assert [(r["scenario"], r["goal_met"]) for r in rows] == [("no-spare", True), ("spare", True), ("torchrun", None),
                                                              ("silent", False), ("never-back", True),
                                                              ("leave-out", False), ("silent-spare", True)]
    never_back = rows[4]
    assert bench_dark_link.goal_met({**never_back, "exit_codes": [0, 1]}) is False  # a launcher that said success
    assert bench_dark_link.goal_met({**never_back, "ended_s": 13.5}) is False  # past --repair-timeout 8 + 5 s
    assert bench_dark_link.goal_met({**rows[5], "left_behind": 0}) is True
    assert all("digests" not in r for r in rows)
    assert "a dark data link: 2 nodes x 2 ranks" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["bench_recovery.py", "--dark-link", "--nnodes", "3"])
    with pytest.raises(SystemExit):
        bench.parse_args()
