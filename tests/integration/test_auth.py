"""Signed control messages on a real job: forged ones written straight into the store are ignored
and logged, and the job runs on as if nothing happened (tests/unit/test_auth.py: an agent with
another token is not let in)."""

from __future__ import annotations

import datetime
import os

import pytest

from ftrun.auth import Signer
from ftrun.keys import JobKeys
from ftrun.messages import Command, CommandKind, NodeLayout, Report, ReportKind, WorkerFailure, to_json
from tests.conftest import WORKERS, free_port, step_reached, wait_for

pytestmark = pytest.mark.integration
ELASTIC = str(WORKERS / "elastic_train.py")
STEPS = 24


def token_file(path, text: str) -> str:
    path.write_text(text)
    os.chmod(path, 0o600)
    return str(path)


def start(launcher, port: int, token: str, node_rank: int, *extra: str, env=None, conf: str = ""):
    conf = ",".join(filter(None, [f"is_host={int(node_rank == 0)}", conf]))
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id",
            launcher.mark, "--node-rank", str(node_rank), "--rdzv-conf", conf,
            "--token-file", token, "--monitor-interval", "0.05", *extra, ELASTIC]
    return launcher.start(args, env=env)


def test_forged_messages_are_ignored_and_logged_and_the_job_is_unaffected(launcher, tmp_path):
    from torch.distributed import TCPStore

    token = token_file(tmp_path / "token", "a-secret-of-the-jobs-own-0123456789")
    port = free_port()
    env = launcher.env(STEPS=str(STEPS), STEP_SLEEP="0.1")
    for node in (0, 1):
        start(launcher, port, token, node, "--recovery", "process", "--max-restarts", "1", env=env)
    wait_for(lambda: step_reached(launcher.out_dir, 3) >= 3, 120, "training to begin")

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    keys = JobKeys(launcher.mark)

    def append(count_key, item_key, data) -> str:
        key = item_key(store.add(count_key, 1) - 1)
        store.set(key, data)
        return key

    stranger = Signer(b"somebody else's secret, not the job's")
    forged = {
        append(keys.command_count, keys.command, to_json(Command(CommandKind.EXIT, 0, exit_code=1, reason="forged"))):
            "unsigned",
        append(keys.command_count, keys.command, stranger.seal("x", to_json(Command(CommandKind.STOP, 0)))):
            "wrongly signed",
        append(keys.report_count, keys.report, to_json(Report(
            ReportKind.WORKER_FAILED, 1, 0, (WorkerFailure(3, 1, 1, "h", 1, 1),)))): "unsigned",
    }
    store.set(keys.layout, to_json(NodeLayout()))  # an empty rank table for the next generation, if it were read

    assert launcher.wait() == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r["step"] == STEPS and r["generation"] == 0 for r in results.values())
    output = launcher.output()
    assert "0 of 1 restart used" in output  # no repair, no stop: as if nothing was written
    for key, problem in forged.items():
        assert f"ignoring a message at {key} in the store: {problem}" in output, output
    assert "control messages are not signed" not in output
