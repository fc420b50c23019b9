"""Flag parsing and the launch configuration (no processes started)."""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import sys

import click
import pytest

from ftrun.cli import launch_command
from ftrun.cli.cluster import ClusterPlan
from ftrun.cli.probe import probe_command
from ftrun.config import (
    DEFAULTS,
    Endpoint,
    LaunchConfig,
    StreamSpec,
    build_launch_config,
    parse_device_list,
    parse_endpoint,
    parse_filters,
    parse_nnodes,
    parse_nproc,
    parse_rank_filter,
    parse_rdzv_conf,
    parse_signals,
    parse_streams,
)
from ftrun.errors import UsageError
from ftrun.ports import parse_port_range
from tests.conftest import ROOT


def parse(args, env=None, monkeypatch=None):
    return launch_command.main(list(args), prog_name="ftrun", standalone_mode=False)


@pytest.mark.parametrize(
    "text, expected", [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4)), (" 3 ", (3, 3))]
)
def test_nnodes_forms(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("head:29400", Endpoint("head", 29400)), ("head", Endpoint("head", 29500)), ("[::1]:1234", Endpoint("::1", 1234))],
)
def test_endpoint_forms(text, expected):
    assert parse_endpoint(text, 29500) == expected


@pytest.mark.parametrize(
    "text, spec, rank, bits",
    [("0", StreamSpec(0), 5, 0), ("3", StreamSpec(3), 1, 3), ("0:1,1:2", StreamSpec(0, ((0, 1), (1, 2))), 1, 2)],
)
def test_stream_specs(text, spec, rank, bits):
    assert parse_streams(text, "-r") == spec
    assert spec.for_rank(rank) == bits


def test_rdzv_conf_pairs():
    assert parse_rdzv_conf("join_timeout=5, is_host=1") == {"join_timeout": "5", "is_host": "1"}


def test_script_arguments_pass_through_untouched(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    values = parse(["--nproc_per_node", "2", str(script), "--lr", "3", "-x", "--nnodes", "9", "--", "y"])
    assert values["script"] == str(script)
    assert values["script_args"] == ("--lr", "3", "-x", "--nnodes", "9", "--", "y")
    assert values["nproc_per_node"] == "2" and values["nnodes"] == "1"


@pytest.mark.parametrize("flag", ["--max-restarts", "--max_restarts", "--fault-retry-times", "--fault_retry_times"])
def test_budget_flag_spellings(flag, tmp_path):
    values = parse([flag, "4", "x.py"])
    assert values["max_restarts"] == 4


def test_rdzv_id_is_the_run_id():
    assert parse(["--rdzv-id", "job7", "x.py"])["run_id"] == "job7"


def test_flags_override_config_file_which_overrides_defaults(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("nproc-per-node: 4\nmax_restarts: 3\nscript: from_file.py\nscript_args: [--a, '1']\n")
    values = parse(["--config", str(config), "--max-restarts", "1"])
    assert values["nproc_per_node"] == "4"  # as the flag gives it
    assert values["max_restarts"] == 1
    assert values["script"] == "from_file.py" and values["script_args"] == ["--a", "1"]


def test_pet_environment_variables_are_read_like_torchrun(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    assert parse(["x.py"])["nproc_per_node"] == "3"


def test_standalone_picks_a_free_local_port_and_a_fresh_run_id(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    a = build_launch_config({"standalone": True, "script": str(script)})
    b = build_launch_config({"standalone": True, "script": str(script)})
    assert a.endpoint.host == "localhost" and a.is_host is True
    assert a.run_id != b.run_id


def test_static_rendezvous_uses_master_addr_and_node_rank(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    raw = {"nnodes": "2", "node_rank": 1, "master_addr": "10.0.0.1", "master_port": 1234, "script": str(script)}
    config = build_launch_config(raw)
    assert config.rdzv_backend == "static"
    assert config.endpoint == Endpoint("10.0.0.1", 1234)
    assert config.is_host is False


def test_module_entrypoint_skips_the_file_check():
    config = build_launch_config({"module": True, "script": "pkg.train", "script_args": ("--x",)})
    assert config.entrypoint[-2:] == ("-m", "pkg.train") and config.script_args == ("--x",)


def test_process_recovery_is_accepted(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    assert build_launch_config({"recovery": "PROCESS", "script": str(script)}).recovery == "process"


@pytest.mark.parametrize("raw", [{"nnodes": "0"}, {"rdzv_backend": "etcd-v2"}, {"stop_timeout": "soon"},
                                 {"rdzv_backend": "etcd", "rdzv_endpoint": "e1", "rdzv_conf": "key=k.pem"}])
def test_bad_values_raise_usage_errors(raw):
    with pytest.raises(UsageError):
        build_launch_config({"script": "x.py", **raw})


@pytest.mark.parametrize("alias, value, key", [("--fault-retry-times", "2", "max_restarts"), ("--rdzv-id", "flag", "run_id")])
def test_alias_flags_also_override_the_config_file(tmp_path, alias, value, key):
    config = tmp_path / "job.yaml"
    config.write_text("max_restarts: 0\nrun_id: file\n")
    values = parse(["--config", str(config), alias, value, "x.py"])
    assert str(values[key]) == value


def test_config_values_read_as_the_flags_give_them(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("env: OMP_NUM_THREADS=8\nssh_option: [-4, ConnectTimeout=5]\ndevices: 0\nlocal_ranks_filter: 0\n")
    values = parse(["--config", str(config), "x.py"])
    assert values["env"] == ("OMP_NUM_THREADS=8",)  # one value, not a list of letters
    assert values["ssh_option"] == ("-4", "ConnectTimeout=5")
    assert (values["devices"], values["local_ranks_filter"]) == ("0", "0")  # not a false-looking 0


def test_config_reads_min_max_as_text_not_base_60(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("nnodes: 2:4\ntee: 0:1\nmonitor_interval: 0.5\n")
    values = parse(["--config", str(config), "x.py"])
    assert (values["nnodes"], values["tee"], values["monitor_interval"]) == ("2:4", "0:1", 0.5)


def test_config_script_args_as_one_string_split_like_a_shell(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("script: t.py\nscript_args: \"--lr 3 -x 'a b'\"\n")
    (tmp_path / "t.py").write_text("")
    values = parse(["--config", str(config)])
    values["script"] = str(tmp_path / "t.py")
    assert build_launch_config(values).script_args == ("--lr", "3", "-x", "a b")


def test_script_on_the_command_line_drops_the_file_s_script_args(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("script: other.py\nscript_args: [--from-file]\n")
    values = parse(["--config", str(config), "mine.py"])
    assert values["script"] == "mine.py" and values["script_args"] == ()


def test_unknown_rdzv_conf_key_is_named():
    with pytest.raises(UsageError, match="join_timout"):
        parse_rdzv_conf("join_timout=5")


def test_c10d_endpoint_without_port_uses_torchrun_s_29400(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    assert build_launch_config({"rdzv_endpoint": "head", "script": str(script)}).endpoint.port == 29400


#: configs/ holds launch configs, and the fault-level table (tested in test_fault_levels.py)
LAUNCH_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "fault_levels.yaml")


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_example_configs_are_valid(path, tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    values = parse(["--config", str(path), str(script)])
    config = build_launch_config(values)
    assert config.nproc_per_node >= 1
    if values.get("hostfile"):  # relative to the repository, as the file's usage line runs it
        monkeypatch.chdir(ROOT)
        monkeypatch.setenv("WANDB_API_KEY", "set-for-the-test")
        plan = ClusterPlan.from_values({**values, "rdzv_host": "head"}, launch_command)
        assert [agent.host.name for agent in plan.agents] == ["node01", "node02", "node03", "node04"]


#: the field an option sets, where it is not the field of the option's name ("snapshots.every": a field's field)
FIELD_OF = {
    "nnodes": ("min_nodes", "max_nodes"), "master_addr": ("endpoint.host",), "master_port": ("endpoint.port",),
    "ssh_agent": ("head_managed",), "detached_agent": ("head_managed",), "snapshot_every": ("snapshots.every",), "snapshot_replicas": ("snapshots.replicas",),
    "replicate_every": ("snapshots.replicate_every",), "checkpoint_dir": ("snapshots.checkpoint_dir",),
    "checkpoint_every": ("snapshots.checkpoint_every",), "checkpoint_interval": ("snapshots.checkpoint_interval",),
    "keep_checkpoints": ("snapshots.keep",), "save_on_failure": ("snapshots.save_on_failure",),
    "cluster_time_out": ("cluster_timeout",), "no_integrations": ("integrations",),
}
#: how a flag's value becomes its field's, where it is not the value itself
FROM_FLAG = {
    "nnodes": parse_nnodes, "nproc_per_node": parse_nproc, "redirects": lambda text: parse_streams(text, "-r"),
    "tee": lambda text: parse_streams(text, "-t"), "signals_to_handle": parse_signals,
    "local_ranks_filter": parse_rank_filter, "duplicate_stdout_filters": parse_filters,
    "duplicate_stderr_filters": parse_filters, "devices": parse_device_list, "worker_port_range": parse_port_range,
    "numa_binding": lambda value: value or "",  # None: not bound
    "no_integrations": lambda value: not value,
}
#: options whose default is None and only their help says it ("[default: 600]")
SAID_IN_HELP = {"rdzv_timeout", "max_restarts", "cluster_time_out"}
#: options that set no field of their own: where and how to run (head node, Slurm, the worker command),
#: second names of another option, torchrun's flags that ftrun only accepts, and those a field is derived
#: from with others (an empty --run-id: "default" or a fresh id; --warm-standby: from --recovery; --framework:
#: from the script's imports; --python: the worker command's first word; msrun's flags: ftrun's flags; ftrun probe's
#: --speed: a measurement of its own)
NOT_A_FIELD = {
    "hostfile", "include", "exclude", "ssh_port", "ssh_option", "remote_python", "remote_cwd", "env", "rdzv_host",
    "print_hosts", "dry_run", "standalone", "rdzv_endpoint", "rdzv_conf", "run_id", "rdzv_id", "fault_retry_times",
    "shutdown_timeout", "token_file", "warm_standby", "snapshot_memory", "module", "no_python", "run_path",
    "start_method", "logs_specs", "event_log_handler", "config", "version", "as_json", "speed",
    "framework", "python", "worker_num", "local_worker_num", "join", "bind_core", "bind_numa", "tail_worker_log",
    "worker_log_name", "rank_table_file", "sim_level", "sim_rank_id",
}


@pytest.mark.parametrize("command", [launch_command, probe_command], ids=["ftrun", "ftrun probe"])
def test_each_option_s_default_is_its_launch_config_field_s_default(command):
    """The defaults live in LaunchConfig's fields: a flag that wrote its own would drift from them. An
    option new here names its field in FIELD_OF, or says in NOT_A_FIELD why it sets none."""
    ctx = click.Context(command)
    for option in (p for p in command.params if isinstance(p, click.Option) and p.name not in NOT_A_FIELD):
        paths = FIELD_OF.get(option.name, (option.name,))
        assert all(hasattr(DEFAULTS, path.partition(".")[0]) for path in paths), f"--{option.name}: which field?"
        field_default = operator.attrgetter(*paths)(DEFAULTS)
        if option.name in SAID_IN_HELP:
            said = re.search(r"\[default: ([^\]]+)\]", option.help or "")
            assert option.default is None and said and float(said.group(1)) == field_default, option.name
        else:
            assert FROM_FLAG.get(option.name, _same)(option.get_default(ctx)) == field_default, option.name


def _same(value):
    return value

def test_a_missing_device_option_is_the_launch_config_default():
    from ftrun.config import device_options

    assert dataclasses.replace(DEFAULTS, **device_options({})) == DEFAULTS


@pytest.mark.parametrize("given", ["no flags", "an empty config file", "no options at all"])
def test_a_config_of_no_options_is_launch_config_s_defaults(given, tmp_path, monkeypatch):
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name in ("FTRUN_CONFIG", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"):
        monkeypatch.delenv(name, raising=False)
    script = tmp_path / "train.py"
    script.write_text("")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    raw = {
        "no flags": lambda: parse([str(script)]),
        "an empty config file": lambda: parse(["--config", str(empty), str(script)]),
        "no options at all": lambda: {"script": str(script)},
    }[given]()
    # what the script and the store's place make (no --rdzv-endpoint: torchrun's static rendezvous on
    # --master-addr/--master-port, this single node hosting it, its workers seeing that MASTER_PORT)
    derived = dict(entrypoint=(sys.executable, "-u", str(script)), is_host=True, worker_port=DEFAULTS.endpoint.port)
    assert build_launch_config(raw) == dataclasses.replace(LaunchConfig(), **derived)
