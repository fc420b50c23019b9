"""scripts/bench_recovery.py --layouts: what it reads from the runs and how it compares them (no runs)."""

import argparse
import importlib
import sys
from dataclasses import replace
from pathlib import Path

import pytest

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
