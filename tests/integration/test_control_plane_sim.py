"""The control-plane simulator's smallest size as a smoke test: 8 simulated agents and a spare speak the
agents' real protocol (ftrun.agent.protocol) to the real controller and store; and the largest job of
real agents this machine holds, 32 of them. Counts and message flow only: the timings are the
benchmark's (scripts/bench_control_plane.py), never asserted here."""

from __future__ import annotations

import logging
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_control_plane import COMPARED_COLUMNS, real_run, simulate, table  # noqa: E402
from etcd_cluster import EtcdUnavailable, etcd_program  # noqa: E402

from tests.conftest import marked_processes  # noqa: E402
from tests.parts import unavailable  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def ftrun_s_log_level():
    """simulate() quiets ftrun's logger for its thousands of agents: the level comes back after each test,
    whatever its outcome, so that a later test of the same process that reads the log finds it."""
    logger = logging.getLogger("ftrun")
    level = logger.level
    yield
    logger.setLevel(level)


def test_simulated_agents_join_hold_every_decision_and_a_spare_takes_a_lost_node():
    """Job level, a lost node, process level: the counts of each, from one run of 8 nodes."""
    figures = simulate(8, 2, agent_processes=1, steady=1.0, node_timeout=2.0)
    assert figures["joined"] == 9  # 8 nodes and the spare all hold a place
    assert figures["holders"] == 8  # every node but the lost one read the STOP after the failure report
    # a job-level restart, a spare's takeover, then (the ranks now run the worker library) a process-level repair
    assert figures["events"] == ["generation_started", "decision", "generation_started", "node_lost", "decision",
                                 "takeover", "generation_started", "decision"]
    assert figures["replace_holders"] == 8  # every node but the lost one read the REPLACE
    assert figures["steady_step"] is not None  # the status board saw the simulated ranks' steps
    assert figures["board_bytes"] > 0 and figures["plan_bytes"] > 0
    # the layout: the rendezvous's, then the takeover's (a restart of the same nodes writes none); an
    # agent that holds the first reads the takeover's change, a node of the 8, not the whole again
    assert figures["layout_versions"] == 2
    assert 0 < figures["layout_change_bytes"] < figures["layout_bytes"] / 4


def test_on_etcd_every_decision_is_journaled_and_a_successor_takes_over_from_the_journal():
    """--backend etcd at its smallest: the same counts, the journal written at each decision (whole once,
    then the decision's part alone), and a successor's first command after the controller's lease lapsed."""
    try:
        etcd_program()
    except EtcdUnavailable as e:
        unavailable(str(e))
    figures = simulate(8, 2, agent_processes=1, steady=1.0, node_timeout=2.0, backend="etcd", lease_ttl=2.0)
    assert figures["joined"] == 10  # 8 nodes and two spares: one for the lost node, one for the controller's
    assert figures["holders"] == 9 and figures["replace_holders"] == 9
    assert figures["journal_writes"] >= 4  # the start, the restart, the takeover, the repair
    assert 0 < figures["journal_write_bytes"] < figures["journal_first_bytes"] <= figures["journal_bytes"]
    assert figures["etcd_renewals_s"] > 0 and figures["etcd_puts_s"] == 0  # steady state: the lease alone
    # the second spare takes the lost controller's node; the repair under way goes on (its REPLACE, held a moment, follows)
    assert figures["failover_commands"] == "takeover"
    assert figures["lease_lapse_ms"] <= figures["failover_ms"]
    assert "etcd" in table([figures], COMPARED_COLUMNS)


def test_real_agents_running_the_worker_library_each_read_the_replacement_of_a_killed_rank():
    mark = uuid.uuid4().hex
    figures = real_run(8, "process", env={"FTRUN_TEST_MARK": mark})
    assert figures["exit_codes"] == [0]  # the job ended at its last step, on every node
    assert figures["joined"] == 8
    assert figures["replace_holders"] == 7  # every other agent read the REPLACE, and kept its rank
    assert figures["replaced"] == 1  # the killed rank's agent started its replacement
    assert figures["resumed_ms"] > 0  # the controller saw training resume at process level
    assert not marked_processes(mark)


def test_32_real_agents_each_read_the_restart_a_killed_rank_starts():
    mark = uuid.uuid4().hex
    figures = real_run(32, env={"FTRUN_TEST_MARK": mark})
    assert figures["exit_codes"] == [0]  # the job ended at its end, on every node
    assert figures["joined"] == 32  # every agent held its place
    assert figures["holders"] == 31  # every agent but the killed rank's read the STOP
    assert figures["restarted"] == 32  # and every agent the next generation's START
    assert not marked_processes(mark)
