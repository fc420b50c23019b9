"""MindSpore's launch contract without MindSpore: the scheduler's and the workers' variables, the
framework a script needs, the workers' python, msrun's flags mapped onto ftrun's."""

from __future__ import annotations

import importlib.util
import signal
import sys

import pytest

from ftrun import mindspore
from ftrun.agent.workers import GenerationEnv, WorkerPlacement, generation_env, worker_env
from ftrun.cli import launch_command, msrun
from ftrun.config import build_launch_config, parse_rank_filter
from ftrun.contract import DeviceAssignment
from ftrun.detection.exits import classify_exit
from ftrun.detection.table import load_fault_table
from ftrun.errors import UsageError
from ftrun.messages import WorkerFailure

SCHEDULER = mindspore.Scheduler("10.0.0.1", 31000)


def test_the_scheduler_gets_msrun_s_variables_and_rank_id_0():
    assert mindspore.scheduler_variables(SCHEDULER, 4, 600) == {
        "MS_ROLE": "MS_SCHED", "MS_WORKER_NUM": "4", "MS_SCHED_HOST": "10.0.0.1", "MS_SCHED_PORT": "31000",
        "MS_TOPO_TIMEOUT": "600", "RANK_ID": "0", "RANK_SIZE": "4"}


def test_a_worker_is_numbered_by_its_global_rank_and_sees_its_device():
    env = mindspore.worker_variables(SCHEDULER, 4, -1, rank=3, device_index=1)
    assert env["MS_ROLE"] == "MS_WORKER"
    assert env["MS_NODE_ID"] == env["RANK_ID"] == "3"
    assert env["DEVICE_ID"] == "1" and env["RANK_SIZE"] == env["MS_WORKER_NUM"] == "4"
    assert env["MS_TOPO_TIMEOUT"] == "-1"


def test_the_scheduler_address_round_trips_through_a_command():
    assert mindspore.Scheduler.parse(str(SCHEDULER)) == SCHEDULER
    assert mindspore.Scheduler.parse("") is None


def generation(scheduler: str = "") -> GenerationEnv:
    return GenerationEnv(generation=1, restart_count=1, world_size=4, node_count=2, master_addr="10.0.0.1",
                         master_port=29500, control_store="10.0.0.1:29400", max_restarts=3, scheduler=scheduler)


def script(tmp_path, text: str = "") -> str:
    path = tmp_path / "train.py"
    path.write_text(text)
    return str(path)


def test_a_mindspore_job_s_workers_get_both_contracts(tmp_path):
    config = build_launch_config({"script": script(tmp_path), "standalone": True, "device": "cpu",
                                  "nproc_per_node": "2", "cluster_timeout": 30}, check_script=False)
    placement = WorkerPlacement(local_rank=1, rank=3, node_rank=1, host="h",
                                device=DeviceAssignment(5, 0))
    env = worker_env(config, placement, generation(str(SCHEDULER)), "/tmp/e.json")
    assert (env["RANK"], env["MS_NODE_ID"], env["RANK_ID"]) == ("3", "3", "3")
    assert env["DEVICE_ID"] == "0"  # the device as the worker's runtime counts it, not the local rank
    assert (env["MS_SCHED_HOST"], env["MS_SCHED_PORT"], env["MS_TOPO_TIMEOUT"]) == ("10.0.0.1", "31000", "30")
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["FTRUN_GENERATION"] == "1"
    assert "MS_ROLE" not in worker_env(config, placement, generation(), "/tmp/e.json")  # a torch job's


@pytest.mark.parametrize("text, found", [
    ("import mindspore as ms\nfrom mindspore import ops\n", "mindspore"),
    ("import numpy\n    from mindspore.communication import init\n", "mindspore"),
    ("import torch\n", "torch"),
    ("import torch\nimport mindspore\n", "both"),
    ("import mindsporex\n# import mindspore\nx = 'import mindspore'\n", None),
    ("", None),
], ids=["mindspore", "indented", "torch", "both", "lookalikes", "empty"])
def test_a_script_s_framework_is_told_only_from_its_own_imports(tmp_path, text, found):
    assert mindspore.detect_framework(script(tmp_path, text)) == found


def test_a_script_that_cannot_be_read_tells_nothing(tmp_path):
    assert mindspore.detect_framework(str(tmp_path / "absent.py")) is None


def test_the_framework_flag_wins_over_detection_and_both_imports_need_it(tmp_path):
    both = script(tmp_path, "import torch\nimport mindspore\n")
    with pytest.raises(UsageError, match="imports both torch and mindspore"):
        build_launch_config({"script": both, "standalone": True, "device": "cpu"})
    assert build_launch_config({"script": both, "standalone": True, "device": "cpu",
                                "framework": "torch"}).framework == "torch"
    with pytest.raises(UsageError, match="--framework must be one of torch, mindspore"):
        build_launch_config({"script": both, "standalone": True, "device": "cpu", "framework": "jax"})


def test_mindspore_refused_when_the_workers_python_cannot_import_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mindspore, "finds_mindspore", lambda python: False)
    with pytest.raises(UsageError, match="cannot import mindspore.*--python"):
        build_launch_config({"script": script(tmp_path), "standalone": True, "device": "cpu", "framework": "mindspore"})


def test_mindspore_runs_at_job_level_without_standbys_in_the_python_that_has_it(tmp_path, monkeypatch):
    monkeypatch.setattr(mindspore, "finds_mindspore", lambda python: python == sys.executable)
    config = build_launch_config({"script": script(tmp_path), "standalone": True, "device": "cpu",
                                  "framework": "mindspore", "recovery": "process", "nproc_per_node": "2"})
    assert (config.recovery, config.warm_standby, config.entrypoint[0]) == ("job", 0, sys.executable)


@pytest.mark.parametrize("device, npu_smi_on_path, recovery", [
    ("npu", False, "process"),
    ("auto", True, "process"),  # npu-smi found: Ascend
    ("auto", False, "job"),
    ("cuda", True, "job"),
])
def test_mindspore_repairs_at_process_level_only_on_ascend(tmp_path, monkeypatch, device, npu_smi_on_path, recovery):
    monkeypatch.setattr(mindspore, "finds_mindspore", lambda python: python == sys.executable)
    folder = tmp_path / "bin"
    folder.mkdir()
    if npu_smi_on_path:  # the stand-in npu-smi: only its presence is looked at
        (folder / "npu-smi").write_text("#!/bin/sh\n")
        (folder / "npu-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    values = {"script": script(tmp_path), "standalone": True, "device": device, "framework": "mindspore",
              "recovery": "process", "nproc_per_node": "2"}
    config = build_launch_config(values)
    assert config.recovery == recovery
    notes = msrun.framework_notes(values | {"given": frozenset(values)}, config)
    assert any("needs Ascend NPUs" in note for note in notes) is (recovery == "job")


def test_a_process_level_mindspore_worker_gets_recovery_and_its_relay_folder(tmp_path):
    gen = GenerationEnv(1, 0, 2, 1, "127.0.0.1", 29500, "127.0.0.1:29400", 3, replacement=True,
                        scheduler=str(SCHEDULER), relay_dir=str(tmp_path / "relay"))
    for device, recovery in (("npu", "1"), ("cpu", None)):  # process level on Ascend only
        config = build_launch_config({"script": script(tmp_path), "standalone": True, "device": device,
                                      "framework": "mindspore",
                                      "nproc_per_node": "2", "recovery": "process"}, check_script=False)
        env = worker_env(config, WorkerPlacement(1, 1, 0, "node0"), gen, str(tmp_path / "error.json"))
        # the relay folder either way: the rank's progress goes through it
        assert (env.get("MS_ENABLE_RECOVERY"), env["MS_NODE_ID"], env["FTRUN_RELAY_DIR"]) == \
            (recovery, "1", str(tmp_path / "relay"))
        assert env["MS_SCHED_PORT"] == str(SCHEDULER.port)  # the running scheduler's
        assert env.get("MS_ENABLE_TFT") == (mindspore.FAULT_TOLERANCE if recovery else None)


def test_process_level_on_ascend_switches_on_mindspore_s_fault_tolerance_unless_the_user_set_it(tmp_path, monkeypatch):
    """Pins mismatch 3 of ASCEND.md: MindSpore tags UCEs, fails a stopped step and turns its HCCL watchdog off
    only with MS_ENABLE_TFT's UCE:1 and ARF:1."""
    gen = GenerationEnv(1, 0, 2, 1, "127.0.0.1", 29500, "127.0.0.1:29400", 3, scheduler=str(SCHEDULER),
                        relay_dir=str(tmp_path / "relay"))
    config = build_launch_config({"script": script(tmp_path), "standalone": True, "device": "npu",
                                  "framework": "mindspore", "nproc_per_node": "2", "recovery": "process"},
                                 check_script=False)
    monkeypatch.delenv("MS_ENABLE_TFT", raising=False)
    env = generation_env(config, gen, str(tmp_path / "error.json"))  # the scheduler's and every worker's
    assert {"UCE:1", "ARF:1", "HCCE:1"} <= set(env["MS_ENABLE_TFT"].strip("{}").split(","))
    monkeypatch.setenv("MS_ENABLE_TFT", "{UCE:1,ARF:1,TSP:1}")
    assert generation_env(config, gen, str(tmp_path / "error.json"))["MS_ENABLE_TFT"] == "{UCE:1,ARF:1,TSP:1}"


def test_python_on_path_runs_mindspore_when_ftrun_s_own_cannot(tmp_path, monkeypatch):
    other = tmp_path / "bin" / "python"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", str(other.parent))
    monkeypatch.setattr(mindspore, "finds_mindspore", lambda python: python == str(other))
    assert mindspore.worker_python("", sys.executable) == str(other)
    assert mindspore.worker_python(str(other), sys.executable) == str(other)
    assert mindspore.worker_python("/no/such/python", sys.executable) == ""


def test_finds_mindspore_asks_the_interpreter_itself():
    assert not mindspore.finds_mindspore("/no/such/python")
    assert mindspore.finds_mindspore(sys.executable) == (importlib.util.find_spec("mindspore") is not None)


def parsed(argv: list[str]) -> dict:
    return launch_command.main(argv, prog_name="ftrun", standalone_mode=False)


def test_msrun_s_command_line_maps_onto_ftrun_s():
    values, notes = msrun.translate(parsed(
        ["--worker_num=4", "--local_worker_num=2", "--master_addr=10.0.0.1", "--master_port=8118", "--node_rank=1",
         "--log_dir=logs", "--join=True", "--cluster_time_out=120", "--bind_core=True", "train.py", "--lr", "1"]))
    assert values["framework"] == "mindspore"
    assert (values["nnodes"], values["nproc_per_node"], values["node_rank"]) == ("2", "2", 1)
    assert (values["master_addr"], values["master_port"], values["log_dir"]) == ("10.0.0.1", 8118, "logs")
    assert values["cluster_timeout"] == 120 and values["numa_binding"] == "exclusive"
    assert values["script_args"] == ("--lr", "1") and not notes
    assert "rdzv_endpoint" not in values["given"]  # --node_rank given: the static rendezvous, as msrun's


def test_msrun_without_node_rank_meets_at_the_master_address():
    values, _ = msrun.translate(parsed(["--worker_num", "4", "--local_worker_num", "2", "--master_port", "8118",
                                        "train.py"]))
    assert values["rdzv_endpoint"] == "127.0.0.1:8118"


def test_msrun_s_defaults_are_eight_workers_on_one_node_and_port_8118():
    values, _ = msrun.translate(parsed(["--worker_num=8", "train.py"]))
    assert (values["nnodes"], values["nproc_per_node"], values["master_port"]) == ("1", "8", 8118)


def test_no_msrun_flag_leaves_the_values_alone():
    values = parsed(["--nproc-per-node", "2", "train.py"])
    assert msrun.translate(values) == (values, [])


def test_join_false_is_accepted_with_a_note():
    _, notes = msrun.translate(parsed(["--worker_num=2", "--local_worker_num=2", "--join=False", "train.py"]))
    assert notes == ["--join False: ftrun stays with the job anyway (it watches it to recover it)"]


@pytest.mark.parametrize("argv, words", [
    (["--worker_num=5", "--local_worker_num=2"], "--worker_num 5 is not a multiple of --local_worker_num 2"),
    (["--worker_num=2", "--local_worker_num=4"], "--local_worker_num 4 is more than --worker_num 2"),
    (["--worker_num=4", "--local_worker_num=2", "--nproc-per-node=4"], "--nproc-per-node 4 contradicts"),
    (["--worker_num=4", "--local_worker_num=2", "--nnodes=1"], "--nnodes 1 contradicts"),
    (["--worker_num=two"], "--worker_num must be a whole number"),
    (["--worker_num=0"], "--worker_num must be at least 1"),
    (["--worker_num=2", "--framework", "torch"], "--worker_num is msrun's, for a MindSpore job"),
    (["--join=maybe"], "--join must be True or False"),
    (["--cluster_time_out=soon"], "--cluster_time_out must be a whole number"),
    (["--bind_core={\"0\": [1]}"], "--bind_core with a core map is msrun's own"),
    (["--bind_core=True", "--numa-binding", "node"], "contradicts --numa-binding node"),
    (["--bind_numa={\"device0\": [\"0\"]}"], "--bind_numa with a NUMA map or a bind file is msrun's own"),
    (["--bind_numa=bind.json"], "--bind_numa with a NUMA map or a bind file is msrun's own"),
    (["--bind_numa=True", "--numa-binding", "socket"], "--bind_numa True .* contradicts --numa-binding socket"),
    (["--bind_numa=maybe"], "--bind_numa must be True or False"),
    (["--tail_worker_log=0,x"], "--tail_worker_log must be -1 .* got '0,x'"),
    (["--tail_worker_log=-2"], "--tail_worker_log must be -1"),
    (["--tail_worker_log=0", "--local-ranks-filter=1"], "give one of them"),
    (["--worker_num=4", "--local_worker_num=2", "--tail_worker_log=0"], "give --node_rank, or --local-ranks-filter"),
    (["--rank_table_file=/etc/hccl_8p.json"], "--rank_table_file: ftrun writes the HCCL rank table itself"),
    (["--sim_level=1", "--sim_rank_id=3", "--worker_num=16", "--local_worker_num=8"],
     "--sim_level is msrun's dry run.* MS_SIMULATION_LEVEL=1 RANK_SIZE=16 RANK_ID=3 python train.py$"),
    (["--sim_rank_id=3"], "--sim_rank_id is msrun's dry run.* RANK_ID=3 "),
], ids=["not-a-multiple", "local-above-total", "nproc-clash", "nnodes-clash", "word", "zero", "torch",
        "join-word", "timeout-word", "core-map", "numa-clash", "numa-map", "numa-file", "numa-socket", "numa-word",
        "tail-word", "tail-negative", "tail-and-filter", "tail-without-node-rank", "rank-table", "sim-level",
        "sim-rank-id"])
def test_an_msrun_combination_that_cannot_work_is_one_line(argv, words):
    with pytest.raises(UsageError, match=words.replace("{", r"\{")):
        msrun.translate(parsed([*argv, "train.py"]))


@pytest.mark.parametrize("argv", [["--bind_numa=True"], ["--bind-numa", "true"]], ids=["msrun", "ftrun"])
def test_bind_numa_true_binds_each_worker_to_its_device_s_numa_node(argv):
    values, notes = msrun.translate(parsed([*argv, "train.py"]))
    assert values["numa_binding"] == "node" and values["framework"] == "mindspore" and not notes


def test_bind_numa_with_bind_core_keeps_bind_core_s_exclusive_cpus_on_that_node():
    values, _ = msrun.translate(parsed(["--bind_core=True", "--bind_numa=True", "train.py"]))
    assert values["numa_binding"] == "exclusive"
    values, _ = msrun.translate(parsed(["--bind_numa=True", "--numa-binding", "core-complex", "train.py"]))
    assert values["numa_binding"] == "core-complex"
    values, _ = msrun.translate(parsed(["--bind_numa=False", "train.py"]))
    assert "numa_binding" not in values["given"]


@pytest.mark.parametrize("argv", [["--tail_worker_log=0,2"], ["--tail-worker-log", "2,0"]], ids=["msrun", "ftrun"])
def test_tail_worker_log_on_one_node_shows_those_ranks(argv):
    values, notes = msrun.translate(parsed(["--worker_num=4", "--local_worker_num=4", *argv, "train.py"]))
    assert values["local_ranks_filter"] == frozenset({0, 2}) and not notes


def test_tail_worker_log_names_global_ranks_taken_onto_this_node_s_local_ones():
    """msrun compares the listed ranks with each worker's RANK_ID: node 1 of 2x4 runs ranks 4-7."""
    node = ["--worker_num=8", "--local_worker_num=4", "--node_rank=1"]
    values, notes = msrun.translate(parsed([*node, "--tail_worker_log=0,5,7", "train.py"]))
    assert values["local_ranks_filter"] == frozenset({1, 3}) and not notes
    values, notes = msrun.translate(parsed([*node, "--tail_worker_log=0", "train.py"]))
    assert values["local_ranks_filter"] == frozenset()  # this node's workers stay off the console
    assert notes == ["--tail_worker_log 0: none of those ranks runs on node 1 (ranks 4-7): its workers' output "
                     "stays off the console"]
    assert parse_rank_filter(values["local_ranks_filter"]) == frozenset()  # the launch's config: none shown


def test_tail_worker_log_minus_one_is_msrun_s_default_every_worker():
    values, notes = msrun.translate(parsed(["--worker_num=8", "--local_worker_num=4", "--tail_worker_log=-1",
                                            "train.py"]))
    assert not values["local_ranks_filter"] and "local_ranks_filter" not in values["given"] and not notes


def test_worker_log_name_is_accepted_with_a_note_on_where_the_logs_go():
    _, notes = msrun.translate(parsed(["--worker_log_name=worker_{ip}_{hostname}", "train.py"]))
    assert len(notes) == 1 and notes[0].startswith("--worker_log_name worker_{ip}_{hostname}: ftrun names the log")
    assert "node<N>/attempt_<G>/<RANK>/stdout.log" in notes[0]


def test_msrun_s_log_dir_writes_every_worker_s_output_there_as_msrun_does():
    values, _ = msrun.translate(parsed(["--worker_num=2", "--local_worker_num=2", "--log_dir=logs", "train.py"]))
    assert values["tee"] == "3"  # both streams copied to the files, and still on the console
    values, _ = msrun.translate(parsed(["--worker_num=2", "--local_worker_num=2", "--log_dir=logs", "--redirects", "1", "train.py"]))
    assert values.get("tee") != "3"  # the user's own choice stands
    values, _ = msrun.translate(parsed(["--worker_num=2", "--local_worker_num=2", "train.py"]))
    assert values.get("tee") != "3"  # no log folder, no files


def test_msrun_s_empty_defaults_ask_for_nothing():
    """Launch scripts pass their variables through: --rank_table_file "" and --sim_rank_id -1 are msrun's
    defaults, not a request."""
    values, notes = msrun.translate(parsed(["--rank-table-file=", "--sim_rank_id=-1", "--worker_log_name=",
                                            "train.py"]))
    assert values["framework"] == "mindspore" and not notes


@pytest.mark.parametrize("argv, words", [
    (["--rank_table_file", "hccl.json"], ("--rank_table_file: ftrun writes the HCCL rank table itself",)),
    (["--sim-level", "2"], ("MS_SIMULATION_LEVEL=2 RANK_SIZE=8 RANK_ID=0 python", "every rank so: RANK_ID 0 to 7)")),
], ids=["rank-table", "sim-level"])
def test_a_refused_msrun_flag_is_one_line_and_exit_code_2(argv, words, tmp_path, monkeypatch, capsys):
    import logging

    from ftrun.cli import main

    logger = logging.getLogger("ftrun")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))  # main() sets up logging: put it back
    monkeypatch.setattr(logger, "level", logger.level)
    (tmp_path / "train.py").write_text("import mindspore\n")
    with pytest.raises(SystemExit) as leaving:
        main([*argv, str(tmp_path / "train.py")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert leaving.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("ftrun: error: ") and all(w in lines[0] for w in words)


def test_the_scheduler_s_failure_is_named_as_such():
    failure = WorkerFailure(rank=mindspore.SCHEDULER_RANK, local_rank=-1, node_rank=0, host="h", pid=7,
                            exit_code=None, signal="SIGKILL")
    assert failure.describe() == "the MindSpore scheduler on node 0 (h), pid 7: killed by SIGKILL"


def test_a_mindspore_script_launched_as_torch_fails_once_with_the_flag_to_give():
    tail = ["RuntimeError: Maybe you are trying to call 'mindspore.communication.init()' without using 'mpirun', "
            "which will make MindSpore load several environment variables"]
    fault = classify_exit(1, tail, "", load_fault_table())
    assert fault.kind == "setting" and "--framework mindspore" in fault.detail
    assert classify_exit(-signal.SIGKILL, [], "", load_fault_table()).kind == "signal"
