"""How a node carries out the controller's commands (ftrun/agent/commands.py): real worker processes,
the node's real protocol over a real TCPStore, the layout published by the controller's real Publisher."""

from __future__ import annotations

import json
import os

import pytest

from ftrun.errors import ExitCode
from ftrun.messages import CommandKind, Report, ReportKind
from tests.unit.node_parts import AGENT, HOST, layout


def test_start_runs_every_local_rank_with_the_generations_environment(node):
    n = node("sleep,sleep")
    n.supervision.failures_told.append((1, ()))
    start = n.command(CommandKind.START, 2, restart_count=1, max_restarts=3)
    assert n.commands.carry_out(start) is None
    assert n.supervision.failures_told == []  # every rank starts anew: no earlier failure concerns a repair
    env = n.env_of(1, 2)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "1", "2", "0")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (HOST, "29999")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("1", "3")
    assert (env["FTRUN_CONTROL_STORE"], env["FTRUN_REPLACEMENT"]) == (str(n.store.endpoint), "0")
    table = json.loads(open(env["FTRUN_RANKTABLE"]).read())
    assert table["generation"] == 2
    assert [w.returncode for w in n.group.workers] == [None, None] and n.group.generation == 2


def test_start_on_a_node_left_out_of_the_layout_ends_the_nodes_part(node):
    n = node("sleep,sleep")
    n.publisher.write_layout(layout((1, "agent-b", 2, 0)).nodes)
    code, reason = n.commands.carry_out(n.command(CommandKind.START, 1))
    assert code == ExitCode.JOB_FAILED and "left out of the job" in reason
    assert n.group.workers == []


def test_stop_ends_every_worker_reports_the_failed_and_acknowledges(node):
    n = node("sleep,3")
    n.commands.carry_out(n.command(CommandKind.START))
    n.wait_ended(1)
    assert n.commands.carry_out(n.command(CommandKind.STOP, 0, reason="rank 7 failed")) is None
    assert all(w.returncode is not None for w in n.group.workers)
    [report] = n.reports()
    assert report.kind is ReportKind.WORKER_FAILED and [f.rank for f in report.failures] == [1]
    assert n.store.try_get(Report, n.keys.stopped(0, AGENT)).kind is ReportKind.STOPPED


def test_exit_stops_the_workers_and_says_so(node):
    n = node("sleep,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    ended = n.commands.carry_out(n.command(CommandKind.EXIT, 0, exit_code=ExitCode.JOB_FAILED, reason="budget spent"))
    assert ended == (ExitCode.JOB_FAILED, "budget spent")
    assert all(w.returncode is not None for w in n.group.workers)
    assert [r.kind for r in n.reports()] == [ReportKind.EXITED]


def test_a_takeover_of_another_node_changes_nothing_here(node):
    n = node("sleep,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    assert n.commands.carry_out(n.command(CommandKind.TAKEOVER, 0, node_rank=3, agent_id="spare")) is None
    assert all(w.proc.poll() is None for w in n.group.workers)


def test_a_takeover_of_this_node_means_it_was_declared_lost(node):
    n = node("sleep,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    code, reason = n.commands.carry_out(n.command(CommandKind.TAKEOVER, 0, node_rank=0, agent_id="spare"))
    assert code == ExitCode.JOB_FAILED and "declared lost" in reason
    assert all(w.returncode is not None for w in n.group.workers)


def test_replace_clears_and_respawns_only_this_nodes_failed_rank(node):
    n = node("sleep,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    n.env_of(1, 0)
    healthy, failed = (w.pid for w in n.group.workers)
    assert n.commands.carry_out(n.command(CommandKind.REPLACE, 1, ranks=(1, 5))) is None  # rank 5: another node's
    assert [r.kind for r in n.reports()] == [ReportKind.CLEARED]
    env = n.env_of(1, 1)
    assert (env["FTRUN_REPLACEMENT"], env["FTRUN_GENERATION"]) == ("1", "1")
    assert n.group.workers[0].pid == healthy and n.group.workers[1].pid != failed
    assert n.group.workers[0].proc.poll() is None
    with pytest.raises(ProcessLookupError):
        os.kill(failed, 0)


def test_replace_of_ranks_elsewhere_repairs_in_place_in_the_new_generation(node, tmp_path):
    n = node("sleep,sleep")
    n.commands.carry_out(n.command(CommandKind.START))
    pids = [w.pid for w in n.group.workers]
    table = tmp_path / "node0" / "ranktable.json"
    assert n.commands.carry_out(n.command(CommandKind.REPLACE, 4, ranks=(6,))) is None
    assert n.reports() == []
    assert [w.pid for w in n.group.workers] == pids and n.group.generation == 4
    assert json.loads(table.read_text())["generation"] == 4
