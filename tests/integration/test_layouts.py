"""Process-level repair of the ways large models are trained, on 2 simulated nodes x 2 ranks.

Each layout of tests/workers/layouts_train.py runs once without a fault (its 4 ranks on one node) and
once with rank 1 SIGKILLed at step 5: the job ends at its final step, only rank 1 was started again,
every rank's parameters, buffers and optimizer state (its local shards) equal the fault-free run's bit
for bit, and no step is redone where a replica holds the lost state (at most K with snapshots every K).
tests/workers/torchtitan_train.py lays the same training out as torchtitan does, over torch's own
meshes and with no job.mesh(): it is repaired the same, against the declared layout's fault-free run (or
its own, for torchtitan's 3-D mesh on 2 nodes x 4 ranks and its pipeline).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import WORKERS, Launcher, unique_mark

pytestmark = pytest.mark.integration
SCRIPT = str(WORKERS / "layouts_train.py")
TORCHTITAN = str(WORKERS / "torchtitan_train.py")
STEPS = 10
SNAPSHOT_EVERY = 2
#: the layouts, with ftrun's flags for each (FSDP2's full shard has no replica: snapshots restore it)
FLAGS = {
    "ddp": (),
    "fsdp": ("--snapshot-every", str(SNAPSHOT_EVERY)),
    "hsdp": (),
    "tp": (),
    "pp": (),
}


#: the layouts of more than 4 ranks (torchtitan_train.py's 3-D mesh)
RANKS = {"3d": 8}


def run(launcher: Launcher, layout: str, flags: tuple[str, ...] | None = None, script: str = SCRIPT,
        nodes: int = 2, **env) -> list[int]:
    """``flags``: in place of the layout's own (FLAGS). ``nodes``: the ranks (4, RANKS) on 2 nodes, or on 1."""
    flags = ["--recovery", "process", "--max-restarts", "3", "--repair-timeout", "60",
             *(FLAGS.get(layout, ()) if flags is None else flags)]
    launcher.start_job(nodes, RANKS.get(layout, 4) // nodes, [script], flags=flags,
                       env=launcher.env(LAYOUT=layout, STEPS=str(STEPS), **env))
    return launcher.wait()


def commits(launcher: Launcher, rank: int) -> list[int]:
    return [int(line) for line in (launcher.out_dir / f"commits-rank{rank}").read_text().split()]


def start_pids(launcher: Launcher) -> dict[int, list[int]]:
    pids: dict[int, list[int]] = {}
    for path in launcher.out_dir.glob("pid-start-rank*"):
        rank, pid = path.name[len("pid-start-rank"):].split("-")
        pids.setdefault(int(rank), []).append(int(pid))
    return pids


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """Each layout's fault-free digests (of layouts_train.py, or of ``script``), run once for the module, when a
    test first asks."""
    digests: dict[tuple[str, str], dict[int, str]] = {}

    def get(layout: str, script: str = SCRIPT) -> dict[int, str]:
        if (layout, script) not in digests:
            # a mark of its own: kill_all() ends every process with it, another checkout's test run's too
            runner = Launcher(tmp_path_factory.mktemp(f"{layout}-fault-free"), unique_mark(f"{layout}-fault-free"))
            try:
                # one agent and no step sleep: the digests depend on neither, and the run starts faster
                assert run(runner, layout, script=script, nodes=1, STEP_SLEEP="0") == [0], runner.output()
                digests[layout, script] = {rank: r["digest"] for rank, r in runner.results().items()}
            finally:
                runner.kill_all()
            assert sorted(digests[layout, script]) == list(range(RANKS.get(layout, 4)))
        return digests[layout, script]

    return get


def assert_repaired(launcher: Launcher, reference: dict[int, str], generations: int = 1, redone: int = 0):
    output = launcher.output()
    results = launcher.results()
    assert sorted(results) == sorted(reference), output
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == reference  # bit for bit, every rank's own state
    pids = start_pids(launcher)
    for rank, result in results.items():
        if rank == 1:
            assert result["replacement"] == "1" and len(pids[1]) == 1 + generations and result["pid"] in pids[1]
        else:  # the healthy ranks lived through the repair in one process
            assert pids[rank] == [result["pid"]] and result["replacement"] == "0", (rank, pids)
    for rank in results:
        done = commits(launcher, rank)
        assert sorted(set(done)) == list(range(STEPS))
        assert len(done) - STEPS <= redone, (rank, done)
    assert "process-level repair into generation 1" in output and "falling back to job level" not in output
    assert "1 of 3 restarts used" in output  # a fault during the repair costs no second unit
    assert f"generation {generations} resumed training" in output


@pytest.mark.parametrize("layout", ["ddp", "hsdp", "tp", "pp"])
def test_a_lost_rank_gets_its_state_from_its_replica_set(launcher, fault_free, layout):
    assert run(launcher, layout, FAULT="1:5:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free(layout))
    if layout == "ddp":  # torch's own DDP: its layout is DDP's, and the replacement's comes with the state
        assert "DDP expects same model" not in launcher.output()


def test_a_torch_ddp_rank_lost_in_the_first_step_ends_as_the_fault_free_run(launcher, fault_free):
    # before DDP laid its buckets out: the healthy ranks' backward of the lost step noted its gradients' order, the
    # replacement has none; every rank forgets it, runs the step again in DDP's first layout, and lays its buckets
    # out after it as the fault-free run did (issue 52 item 3)
    assert run(launcher, "ddp", FAULT="1:0:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free("ddp"))


@pytest.mark.parametrize("layout, declared", [("hsdp", "hsdp"), ("tp-dp", "tp")])
def test_torchtitan_s_layouts_over_torch_s_own_meshes_are_repaired_as_if_declared(launcher, fault_free, layout,
                                                                                  declared):
    # init_device_mesh, no job.mesh(). HSDP over (rep, shard): the placements (Replicate over "rep") show the
    # copies. DP x TP over (dp, tp): the parameters lie on mesh["tp"] alone, and the first step's gradients
    # averaged by hand over mesh["dp"].get_group() show the copies. The same training as the declared layout
    assert run(launcher, layout, script=TORCHTITAN, FAULT="1:5:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free(declared))
    assert "without job.mesh()" not in launcher.output()


@pytest.mark.parametrize("layout, described", [
    ("hsdp", "rep 2 x shard 2 (replica dimensions: rep)"),
    ("3d", "dp_replicate 2 x dp_shard 2 x tp 2 (replica dimensions: dp_replicate)"),
])
def test_init_sharded_gives_way_to_the_replica_dimension_the_placements_show(launcher, fault_free, layout,
                                                                             described):
    # init(sharded=True) over torch's own meshes: HSDP over (rep, shard), and torchtitan's 3-D mesh (TP over
    # mesh["tp"], then FSDP2 over mesh["dp_replicate", "dp_shard"]) on 2 nodes x 4 ranks. Every parameter is
    # Replicate over the first dimension: rank 1's copy lives on (rank 3, rank 5), and the repair takes it from
    # there instead of falling back to job level for want of a replica (issue 42)
    reference = fault_free("hsdp") if layout == "hsdp" else fault_free(layout, TORCHTITAN)
    assert run(launcher, layout, script=TORCHTITAN, FAULT="1:5:sigkill", SHARDED="1") == [0, 0], launcher.output()
    assert_repaired(launcher, reference)
    assert {r["layout"] for r in launcher.results().values()} == {described}


def test_pp_x_dp_over_torch_s_own_mesh_is_repaired_as_the_first_step_s_gradient_reduction_shows(launcher,
                                                                                                fault_free):
    # torch.distributed.pipelining's stages over mesh["pp"] of init_device_mesh, each in torch's
    # DistributedDataParallel over mesh["dp"], no job.mesh(): plain parameters, and groups of ftrun's that
    # are the mesh's dimensions; the first step's all-reduce of the stage's gradients over dp shows the copies
    reference = fault_free("pp-dp", TORCHTITAN)
    assert run(launcher, "pp-dp", script=TORCHTITAN, FAULT="1:5:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, reference)
    assert {r["layout"] for r in launcher.results().values()} == {"pp 2 x dp 2 (replica dimensions: dp)"}
    assert "without job.mesh()" not in launcher.output()


def test_full_shard_without_a_replica_rolls_every_rank_back_to_the_snapshot(launcher, fault_free):
    assert run(launcher, "fsdp", FAULT="1:5:sigkill") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free("fsdp"), redone=SNAPSHOT_EVERY)
    assert any(len(commits(launcher, rank)) > STEPS for rank in range(4))  # the snapshot's step and after, again


def test_full_shard_without_snapshots_falls_back_to_job_level_said_once_by_the_controller(launcher, fault_free):
    # init(sharded=True) and no --snapshot-every: nothing can put rank 1's shard back at process level. The
    # ranks find that at the rollback and wait quietly for the restart; the controller says it, once
    logs = launcher.tmp / "logs"
    assert run(launcher, "fsdp", flags=("--log-dir", str(logs)), FAULT="1:5:sigkill") == [0, 0], launcher.output()
    output = launcher.output()
    line = ("process-level repair of generation 1 falls back to job level: no healthy replica holds the training "
            "state, and the ranks take no snapshots; --snapshot-every K or a replica dimension "
            "(job.mesh({...}, replicate=(...))) would keep it at process level")
    assert output.count(line) == 1, output
    events = [json.loads(e) for e in (logs / launcher.mark / "events.jsonl").read_text().splitlines()]
    assert [e["detail"] for e in events if e["kind"] == "repair_failed"] == [line]
    assert "Traceback" not in output and "RepairError" not in output  # the ranks' stderr is in the nodes' output
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free("fsdp")  # restarted from step 0
    assert "2 of 3 restarts used" in output  # the repair, then the job-level restart


def test_a_rank_lost_during_the_repair_carries_it_into_the_next_generation(launcher, fault_free):
    # rank 1's first replacement dies once it made its groups, in the middle of the repair
    assert run(launcher, "tp", FAULT="1:5:sigkill", FAULT_REPLACEMENT="1") == [0, 0], launcher.output()
    assert_repaired(launcher, fault_free("tp"), generations=2)


def test_a_mesh_whose_replicas_the_library_cannot_tell_says_its_one_line_and_restarts_the_job(launcher):
    # torch's (dp, tp) mesh and tensor parallelism, with nothing reduced over dp: each dp rank trains alone.
    # The line comes at the end of step 0; slower steps let the controller read it before the fault at step 5
    # even on a loaded machine (else the repair finds no replica and falls back to job level all the same)
    assert run(launcher, "tp-alone", script=TORCHTITAN, FAULT="1:5:sigkill", STEP_SLEEP="0.2") == [0, 0], \
        launcher.output()
    output = launcher.output()
    line = ("ftrun.elastic: the registered DTensors lie on tp 2 of the mesh dp 2 x tp 2, made without job.mesh(), "
            "and the first step all-reduced no gradients over dp: ftrun cannot tell which ranks hold copies of "
            'each other\'s state (say it with job.mesh({"dp": 2, "tp": 2}, replicate=("dp",))); a fault will '
            "restart the job")
    assert output.count(line) == 1, output
    assert "process-level recovery is off" in output and "using job-level recovery" in output
    assert "process-level repair" not in output
    assert {r["step"] for r in launcher.results().values()} == {STEPS}
