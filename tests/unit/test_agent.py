"""The agent's loop (ftrun/agent/agent.py) around its parts, in this process: a standalone job of two real
worker processes (a tiny script, no torch), the real store and controller, the outcome as the CLI reads it."""

from __future__ import annotations

import signal
import threading
import time

from ftrun.agent.agent import Agent
from ftrun.errors import ExitCode
from tests.unit.node_parts import launch_config


def test_a_job_whose_ranks_succeed_ends_with_code_0(tmp_path):
    outcome = Agent(launch_config(tmp_path, "0,0", status="plain")).run()
    assert outcome.exit_code == ExitCode.OK
    assert outcome.controller is not None  # it hosted the controller: the summary is read from it


def test_a_rank_that_fails_with_no_budget_left_ends_the_job_naming_it(tmp_path):
    outcome = Agent(launch_config(tmp_path, "0,3", status="plain", max_restarts="0")).run()
    assert outcome.exit_code == ExitCode.JOB_FAILED
    assert "rank 1" in outcome.reason


def test_an_interrupt_stops_the_workers_and_ends_with_its_code(tmp_path):
    agent = Agent(launch_config(tmp_path, "sleep,sleep", status="plain"))

    def interrupt_once_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (agent.supervision and agent.supervision.group.running):
            time.sleep(0.02)
        agent.interrupts.request(signal.SIGTERM)

    threading.Thread(target=interrupt_once_running, name="test-interrupt", daemon=True).start()
    outcome = agent.run()
    assert outcome.exit_code == agent.interrupts.exit_code != ExitCode.OK
    assert all(w.returncode is not None for w in agent.supervision.group.workers)
