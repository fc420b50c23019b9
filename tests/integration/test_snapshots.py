"""In-memory snapshots on 2 simulated nodes x 2 ranks: restores after job-level restarts and node loss.

The worker (tests/workers/snapshot_train.py) trains a model per rank whose fault-free parameters the
test computes itself, so every run is checked bit for bit without a second run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import WORKERS, free_port, ftrun_status, wait_for

sys.path.insert(0, str(WORKERS))
from snapshot_train import reference  # noqa: E402

pytestmark = pytest.mark.integration
SCRIPT = str(WORKERS / "snapshot_train.py")
STEPS = 20


def runs(launcher) -> dict[int, list[tuple[int, int]]]:
    """Each rank's (generation, step) pairs, in the order it ran them."""
    found = {}
    for path in launcher.out_dir.glob("ran-rank*"):
        rank = int(path.name[len("ran-rank"):])
        found[rank] = [tuple(map(int, line.split())) for line in path.read_text().splitlines()]
    return found


def redone(steps: list[tuple[int, int]]) -> int:
    """How many steps a rank ran more than once."""
    counted = [s for _, s in steps]
    return len(counted) - len(set(counted))


def assert_fault_free_result(launcher, sharded: bool, steps: int = STEPS) -> None:
    """Every rank ended at the last step with the parameters of a run without any fault."""
    for rank in range(4):
        path = launcher.out_dir / f"params-rank{rank}.pt"
        assert path.exists(), launcher.output()
        got = torch.load(path)
        want = reference(rank, steps, sharded)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {rank}'s {name} differs from the fault-free run"


def restore_events(launcher) -> list[dict]:
    events = launcher.tmp / "logs" / launcher.mark / "events.jsonl"
    return [e for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "restore"]


def status_is_up(endpoint: str) -> bool:
    once = ftrun_status(endpoint)
    once.communicate(timeout=60)
    return once.returncode == 0


def test_job_level_restart_resumes_from_memory_past_a_damaged_snapshot(launcher):
    """Rank 3 exits at step 12, just after rank 1's newest snapshot (step 12) was damaged: every rank
    restarts and resumes at step 12 from the agents' memory, rank 1 from another rank's copy (data-parallel
    replicas hold the same state), never from its damaged one. Meanwhile the agents write checkpoints
    that torch.load reads in a fresh process."""
    checkpoints = launcher.tmp / "ckpt"
    env = launcher.env(STEPS=str(STEPS), SHARDED="0", FAULT="3:12:exit1", CORRUPT="1:12")
    flags = ["--recovery", "job", "--max-restarts", "2", "--snapshot-every", "1", "--snapshot-memory", "256M",
             "--replicate-every", "4", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "4",
             "--keep-checkpoints", "2", "--log-dir", str(launcher.tmp / "logs")]
    launcher.start_job(2, 2, [SCRIPT], flags=flags, env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    assert_fault_free_result(launcher, sharded=False)
    output = launcher.output()
    assert re.search(r"skipping a damaged snapshot: .*rank-00001\.\d: the snapshot of step 12 fails its checksum",
                     output), output
    (event,) = restore_events(launcher)
    assert event["step"] == 12 and {s["where"] for s in event["sources"].values()} == {"memory"}, event
    assert "/rank-00001." not in event["sources"]["1"]["path"], event  # not its own, damaged one
    for rank, history in runs(launcher).items():
        assert [s for g, s in history if g == 1][0] == 12, (rank, history)  # not step 0: the snapshot
        assert redone(history) <= 1  # K=1: at most the step in flight
    assert "restored step 12 from memory" in output
    # the newest --keep-checkpoints steps stay, each with its manifest; torch.load reads them in a fresh process
    steps = sorted(p.name for p in checkpoints.glob("step-*"))
    assert steps == ["step-00000016", "step-00000020"], steps
    manifest = json.loads((checkpoints / "step-00000016" / "manifest.json").read_text())
    assert manifest["step"] == 16 and [r["path"] for r in manifest["ranks"]] == [
        f"step-00000016/rank-{r:05d}.pt" for r in range(4)]
    target = launcher.tmp / "loaded.pt"
    code = ("import sys, torch; state = torch.load(sys.argv[1]); torch.save(state['model'], sys.argv[2]); "
            "print(sorted(state))")
    loaded = subprocess.run([sys.executable, "-c", code, str(checkpoints / "step-00000016" / "rank-00003.pt"),
                             str(target)], capture_output=True, text=True, timeout=60, cwd="/")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["['model',", "'optimizer',", "'scheduler']"]
    want = reference(3, 16, sharded=False)
    got = torch.load(target)
    assert all(torch.equal(got[k], want[k]) for k in want), "the checkpoint of step 16 differs from the run's"


def test_copies_damaged_after_their_check_are_skipped_and_left_out_of_the_next_plan(launcher):
    """Sharded state. Rank 1 damages both its own snapshots, and its pinned copy (node 0) and replica
    (node 1) of step 12, then exits. The agents check the ranks' own snapshots when they stop, but the
    pin and the replica were checked when they were made: the plan names them for step 12. Rank 1
    finds its pinned copy damaged, skips it for the replica, finds that damaged too, reports both and
    exits; the next plan leaves them out and every rank restores step 8."""
    env = launcher.env(STEPS=str(STEPS), SHARDED="1", FAULT="1:14:exit1", CORRUPT_ALL="1:14:12")
    flags = ["--recovery", "job", "--max-restarts", "2", "--snapshot-every", "1", "--snapshot-memory", "256M",
             "--replicate-every", "4", "--log-dir", str(launcher.tmp / "logs")]
    launcher.start_job(2, 2, [SCRIPT], flags=flags, env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    assert_fault_free_result(launcher, sharded=True)
    output = launcher.output()
    first, second = restore_events(launcher)
    assert first["step"] == 12 and first["sources"]["1"]["where"] == "pinned", first
    skipped = re.findall(r"rank 1: skipping a damaged copy of step 12 .*", output)
    assert len(skipped) == 2 and "(pinned on node 0)" in skipped[0] and "(replica on node 1)" in skipped[1], skipped
    assert "every copy of step 12 the restore plan names for rank 1 (2) failed its check" in output
    assert second["step"] == 8, second  # step 12 held no good copy of rank 1's state any more
    for rank, history in runs(launcher).items():
        assert [s for g, s in history if g == 2][0] == 8, (rank, history)


def test_lost_node_shards_come_back_from_the_peer_replica(launcher):
    """Node 1's agent is killed with its ranks and its memory: a spare takes its place, and ranks 2 and
    3 (sharded: no other rank holds their state) restore from the replicas node 0 kept of them."""
    steps = 30
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes", "2", "--spares", "1", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--run-id",
             launcher.mark, "--monitor-interval", "0.05", "--node-timeout", "3", "--recovery", "job",
             "--max-restarts", "2", "--snapshot-every", "1", "--replicate-every", "4", "--snapshot-memory", "256M",
             "--log-dir", str(launcher.tmp / "logs")]
    env = launcher.env(STEPS=str(steps), SHARDED="1", STEP_SLEEP="0.1")
    nodes = [launcher.start([*flags, "--local-addr", f"127.0.0.{i + 2}", SCRIPT], env=env) for i in range(3)]
    victim = wait_for(lambda: [n for n in nodes if "node 1 of 2," in n.output], timeout=120, what="node 1")[0]
    wait_for(lambda: status_is_up(endpoint), timeout=60, what="the job's status")
    watched = launcher.tmp / "status"
    watcher = ftrun_status(endpoint, "--watch", "--json", "--interval", "0.2", into=watched)
    try:
        ran = launcher.out_dir / "ran-rank2"
        wait_for(lambda: ran.exists() and len(ran.read_text().splitlines()) >= 14, timeout=120, what="step 14")
        folder = re.search(r"snapshots every 1 step in (\S+)", victim.output).group(1)
        victim.proc.send_signal(signal.SIGKILL)
        others = [n for n in nodes if n is not victim]
        assert launcher.wait(others) == [0, 0], launcher.output()
        assert watcher.wait(timeout=60) == 0, Path(f"{watched}.err").read_text()
    finally:
        watcher.kill()
    # ftrun status said where a restart would resume: by step 14, the snapshots of step 12 were held everywhere
    restorable = [json.loads(line)["restorable_step"] for line in Path(f"{watched}.out").read_text().splitlines()]
    assert max(r for r in restorable if r is not None) >= 12, restorable
    wait_for(lambda: not Path(folder).exists(), timeout=10, what="the guardian to remove the lost agent's memory")
    (event,) = restore_events(launcher)
    assert event["step"] % 4 == 0 and event["step"] >= 12, event
    sources = {int(rank): source for rank, source in event["sources"].items()}
    assert {sources[r]["where"] for r in (2, 3)} == {"replica"} and {sources[r]["node"] for r in (2, 3)} == {0}
    assert {sources[r]["where"] for r in (0, 1)} <= {"memory", "pinned"}
    assert_fault_free_result(launcher, sharded=True, steps=steps)
    for rank, history in runs(launcher).items():
        assert redone(history) <= 4 + 2, (rank, history)  # back to the last replicated step


def test_process_level_repair_of_sharded_state_and_save_on_failure(launcher):
    """Sharded state under --recovery process: rank 3 is killed and replaced while the others live on,
    and every rank goes back to the newest step all of them hold in memory (a replacement finds its
    predecessor's snapshot on its node). --save-on-failure writes those snapshots to disk too."""
    checkpoints = launcher.tmp / "ckpt"
    env = launcher.env(STEPS=str(STEPS), SHARDED="1", FAULT="3:9:sigkill")
    flags = ["--recovery", "process", "--max-restarts", "2", "--snapshot-every", "1", "--snapshot-memory", "256M",
             "--checkpoint-dir", str(checkpoints), "--save-on-failure"]
    launcher.start_job(2, 2, [SCRIPT], flags=flags, env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    assert_fault_free_result(launcher, sharded=True)
    pids = {}
    for path in launcher.out_dir.glob("pid-rank*"):
        rank, pid = path.name[len("pid-rank"):].split("-")
        pids.setdefault(int(rank), []).append(int(pid))
    assert [len(pids[r]) for r in range(4)] == [1, 1, 1, 2], pids  # only rank 3 was replaced
    assert "process-level repair into generation 1" in launcher.output()
    for rank, history in runs(launcher).items():  # step 9, in flight as rank 3 died, and only it
        assert redone(history) <= 1, (rank, history)
    # the snapshots held as the fault stopped rank 3 (the two newest of each rank: the fault comes once
    # rank 3's snapshot of step 9 is complete): every rank's file of a step, and its manifest
    saved = [p for p in checkpoints.glob("step-*") if (p / "manifest.json").exists()]
    assert {int(p.name[len("step-"):]) for p in saved} == {8, 9}, saved
    for folder in saved:
        for rank in range(4):
            state = torch.load(folder / f"rank-{rank:05d}.pt")
            want = reference(rank, int(folder.name[len("step-"):]), sharded=True)
            assert all(torch.equal(state["model"][k], want[k]) for k in want)


def test_every_rank_lost_under_process_recovery_restarts_at_job_level_from_the_snapshots(launcher):
    """Every rank is killed as step 13 begins: with no healthy replica left, --recovery process goes to
    job level at once, and the restart restores step 10 (--snapshot-every 5) from the agents' memory.
    The reports of the deaths come milliseconds apart, inside the controller's 30 ms hold; on a machine
    busy enough that the last comes later, the replacements have started and the same repair goes on
    to the same snapshots instead (test_policy.py holds both edges): either way every rank runs warm."""
    faults = ",".join(f"{rank}:13:sigkill" for rank in range(4))
    # the standbys are made once every rank committed its first step: 12 steps of 0.15 s leave them time
    env = launcher.env(STEPS=str(STEPS), SHARDED="0", FAULT=faults, STEP_SLEEP="0.15")
    flags = ["--recovery", "process", "--max-restarts", "2", "--snapshot-every", "5", "--snapshot-memory", "256M",
             "--log-dir", str(launcher.tmp / "logs")]
    launcher.start_job(2, 2, [SCRIPT], flags=flags, env=env)
    assert launcher.wait() == [0, 0], launcher.output()
    assert_fault_free_result(launcher, sharded=False)
    output = launcher.output()
    assert "falling back to job level" not in output and "1 of 2 restarts used" in output
    if "every rank failed, no healthy replica holds the training state" in output:
        # every rank of the restart is forked from the warm interpreter its node's first ranks came from
        restarted = "".join(node.output.split("restarting workers as generation")[-1] for node in launcher.nodes)
        assert sorted(re.findall(r"rank (\d) forked from the node.s warm interpreter", restarted)) == ["0", "1", "2", "3"], output
        (event,) = restore_events(launcher)
        assert event["step"] == 10 and {s["where"] for s in event["sources"].values()} == {"memory"}, event
    else:  # the repair went on: each rank replaced once (forked, as at the start), back to its own snapshot
        forked = sorted(re.findall(r"rank (\d) forked from the node.s warm interpreter", output))
        assert forked == ["0", "0", "1", "1", "2", "2", "3", "3"], output
        assert re.search(r"generation \d resumed training", output), output
    for rank, history in runs(launcher).items():
        assert [s for g, s in history if g > 0][0] == 10, (rank, history)
        assert redone(history) <= 5, (rank, history)


def test_a_snapshot_over_its_memory_share_ends_the_job_at_once(launcher):
    """A state larger than its share of --snapshot-memory: one clear line, and no restart (each would fail)."""
    env = launcher.env(STEPS=str(STEPS), SHARDED="1")
    flags = ["--recovery", "job", "--max-restarts", "3", "--snapshot-every", "1", "--snapshot-memory", "64K"]
    launcher.start_job(1, 2, [SCRIPT], flags=flags, env=env)
    assert launcher.wait() == [1], launcher.output()
    output = launcher.output()
    assert re.search(r"rank \d's snapshot takes [0-9.]+ KiB, but its share of --snapshot-memory is 5.3 KiB", output)
    assert "not retried: a restart would fail the same way" in output
    assert "0 of 3 restarts used" in output and "Traceback" not in output
