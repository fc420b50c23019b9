"""The control store moves to a successor's node (issue 31, the ranks' side): two real ranks over gloo keep
training while their store is gone, follow FTRUN_CONTROL_STORE_FILE to the new one, and repair into the
generation the successor announces there, the same processes throughout.

No ftrun launcher: the ranks get the environment a WorkerEnv writes, and the test plays the agents (it
hosts the stores and rewrites the file) and the successor controller (its Publisher announces)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from torch.distributed import TCPStore

from ftrun.contract import Milestone, WorkerEnv
from ftrun.controller.publisher import Publisher
from ftrun.keys import JobKeys
from ftrun.store import ControlStore
from tests.conftest import ROOT, WORKERS, name_store, step_reached, wait_for

WORLD = 2
#: against hangs only: each rank imports torch on a shared 2-core machine
DEADLINE = 120


def progress(out: Path, rank: int) -> int:
    return step_reached(out, rank)


def slowest(out: Path) -> int:
    return min(progress(out, rank) for rank in range(WORLD))


def test_ranks_follow_the_control_store_to_its_successor_and_repair_there(host_store, tmp_path):
    host_a, host_b = host_store(), host_store()  # B is the successor's store, named only later
    file, out, stop = tmp_path / "control_store", tmp_path / "out", tmp_path / "stop"
    out.mkdir()
    name_store(file, host_a.endpoint)
    keys = JobKeys("moving")
    ranks = []
    for rank in range(WORLD):
        env = WorkerEnv(rank=rank, local_rank=rank, world_size=WORLD, run_id="moving", generation=0,
                        control_store=str(host_a.endpoint), replacement=False, heartbeat_timeout=30,
                        recovery="process", control_store_file=str(file), store_timeout=DEADLINE)
        environ = {**os.environ, **env.to_environ(), "LOCAL_WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT), "OUT_DIR": str(out), "STEPS": "100000", "STEP_SLEEP": "0.05",
                   "STOP_FILE": str(stop)}
        ranks.append(subprocess.Popen([sys.executable, str(WORKERS / "elastic_train.py")], env=environ,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        wait_for(lambda: slowest(out) >= 3, DEADLINE, "both ranks training on store A")
        host_a.kill()
        at_loss = max(progress(out, rank) for rank in range(WORLD))
        wait_for(lambda: slowest(out) >= at_loss + 3, DEADLINE, "training to go on without a store")

        successor = TCPStore(host_b.endpoint.host, host_b.endpoint.port, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
        name_store(file, host_b.endpoint)
        beats = [keys.rank_heartbeat(rank) for rank in range(WORLD)]
        wait_for(lambda: successor.check(beats), DEADLINE, "both ranks' heartbeats in store B")

        # the successor controller: a process-level repair into the next generation, in its own store
        Publisher(ControlStore(successor, host_b.endpoint, is_host=True), keys, lambda: []).announce(1, WORLD)
        resumed = keys.milestone(1, Milestone.RESUMED.value)
        wait_for(lambda: successor.add(resumed, 0) == WORLD, DEADLINE, "both ranks resumed in generation 1")
        assert successor.add(keys.milestone(1, Milestone.JOINED.value), 0) == WORLD
        at_repair = max(progress(out, rank) for rank in range(WORLD))
        wait_for(lambda: slowest(out) >= at_repair + 2, DEADLINE, "training to go on in generation 1")

        temporary = tmp_path / "stop.tmp"
        temporary.write_text(str(max(progress(out, rank) for rank in range(WORLD)) + 3))
        os.replace(temporary, stop)
        outputs = [rank.communicate(timeout=DEADLINE)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for rank, output in enumerate(outputs):
        assert ranks[rank].returncode == 0, output
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["generation"] == 1, output
        assert result["step"] > at_repair
        started = sorted(out.glob(f"pid-start-rank{rank}-*"))
        assert [path.name for path in started] == [f"pid-start-rank{rank}-{result['pid']}"]  # the same process
        assert "Traceback" not in output
