"""torchrun's command line, as the installed torch prints it, runs under ftrun; and the flags that
came with torch 2.13 do what they say: signals, virtual local ranks, filters, NUMA binding."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys

import click
import pytest

from ftrun.agent.device_slots import NodeDevices
from ftrun.agent.numa import HostCpus, bind_ranks
from ftrun.agent.output import FilteredCopy, line_prefix
from ftrun.agent.workers import WorkerPlacement, own_device_only
from ftrun.cli import launch_command
from ftrun.cli.launch import accepted_only_notes
from ftrun.config import build_launch_config, parse_filters, parse_signals
from ftrun.contract import DeviceAssignment
from ftrun.detection.table import load_fault_table
from ftrun.devices import CpuBackend, DeviceToolError
from ftrun.devices.topology import parse_affinity_matrix, parse_cpu_list
from ftrun.errors import UsageError
from ftrun.folders import run_folder
from ftrun.interrupts import Interrupts
from ftrun.ports import PortRange, listen_in_range, parse_port_range
from tests.conftest import ROOT


def torchrun_flags() -> set[str]:
    """Every option string in the installed torch's ``torchrun --help``."""
    help_text = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                               text=True, timeout=120, check=True).stdout
    flags = set()
    for line in help_text.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):  # an option's own line: its spellings, then maybe its help after a gap
            spellings = re.split(r"\s{2,}", line.strip())[0]
            flags |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", spellings))
    return flags - {"-h", "--help"}


def test_ftrun_accepts_every_flag_the_installed_torchrun_lists():
    flags = torchrun_flags()
    assert {"--nnodes", "--nproc-per-node", "--nproc_per_node", "-m", "-r", "-t"} <= flags  # the help parsed
    ours = {opt for param in launch_command.params if isinstance(param, click.Option) for opt in param.opts}
    missing = sorted(flags - ours)
    assert not missing, f"torchrun flags ftrun does not accept: {', '.join(missing)}"


def config(tmp_path, **raw):
    script = tmp_path / "train.py"
    script.write_text("")
    return build_launch_config({"script": str(script), "standalone": True, "device": "cpu", **raw})


def parse(argv: list[str]) -> dict:
    return launch_command.main(argv, prog_name="ftrun", standalone_mode=False)


# -- aliases and accepted-only flags ---------------------------------------------------------------


def test_shutdown_timeout_sets_the_stop_timeout(tmp_path, monkeypatch):
    assert parse(["--shutdown-timeout", "7", "x.py"])["stop_timeout"] == 7
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "9")
    assert parse(["x.py"])["stop_timeout"] == 9
    with pytest.raises(UsageError, match="set one option"):
        parse(["--stop-timeout", "3", "x.py"])


@pytest.mark.parametrize("flag, value, word", [("--start-method", "fork", "fresh interpreter"),
                                                ("--logs-specs", "mine", "LogsSpecs"),
                                                ("--event-log-handler", "console", "events.jsonl")])
def test_a_flag_that_means_nothing_to_ftrun_is_accepted_with_one_line(flag, value, word):
    notes = accepted_only_notes(parse([flag, value, "x.py"]))
    assert len(notes) == 1 and flag in notes[0] and word in notes[0]


def test_no_note_without_those_flags():
    assert accepted_only_notes(parse(["x.py"])) == []


# -- --signals-to-handle ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("SIGTERM,SIGINT,SIGHUP,SIGQUIT", (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)),
    ("USR1, sigusr2", (signal.SIGUSR1, signal.SIGUSR2)),
    ("10,SIGUSR1", (signal.SIGUSR1,)),
    ("", ()),
])
def test_signal_list(text, expected):
    assert parse_signals(text) == expected


@pytest.mark.parametrize("text, words", [("SIGNOPE", "SIGNOPE"), ("SIGKILL", "cannot be caught"), ("999", "999")])
def test_bad_signal_list(text, words):
    with pytest.raises(UsageError, match=words):
        parse_signals(text)


@pytest.mark.parametrize("received, workers_get", [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGTERM),
                                                   (signal.SIGUSR1, signal.SIGUSR1), (signal.SIGHUP, signal.SIGHUP)])
def test_workers_get_the_forwarded_signal_itself_and_sigterm_for_a_plain_stop(received, workers_get):
    interrupts = Interrupts()
    interrupts.request(received)
    assert interrupts.worker_signal == workers_get
    assert interrupts.exit_code == (130 if received == signal.SIGINT else 143)


# -- --virtual-local-rank --------------------------------------------------------------------------


@pytest.mark.parametrize("var", ["CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"])
def test_virtual_local_rank_narrows_the_visible_devices_to_the_rank_s_own(var):
    placed = own_device_only(WorkerPlacement(2, 2, 0, "h", DeviceAssignment(5, 2), (var, "0,2,5")))
    assert (placed.visibility, placed.device) == ((var, "5"), DeviceAssignment(5, 0))


def test_virtual_local_rank_without_a_device_changes_no_device_variable():
    placed = WorkerPlacement(2, 2, 0, "h")
    assert own_device_only(placed) == placed


# -- --duplicate-*-filters -------------------------------------------------------------------------


@pytest.mark.parametrize("text, words", [("apple,orange", ("apple", "orange")), ("a,,b,c", ("a,b", "c")),
                                         ("", ()), (None, ()), ("x,", ("x",))])
def test_filter_words_as_torchrun_splits_them(text, words):
    assert parse_filters(text) == words


def test_filtered_copy_keeps_only_lines_with_a_word(tmp_path):
    copy = FilteredCopy(str(tmp_path / "filtered_stdout.log"), ("loss", "a,b"))
    for line in (b"[rank 0]: step 1 loss 0.5\n", b"[rank 1]: nothing\n", b"[rank 1]: a,b\n"):
        copy.offer(line)
    copy.close()
    assert (tmp_path / "filtered_stdout.log").read_bytes() == b"[rank 0]: step 1 loss 0.5\n[rank 1]: a,b\n"


def test_filtered_copy_without_a_match_writes_no_file(tmp_path):
    copy = FilteredCopy(str(tmp_path / "filtered_stderr.log"), ("loss",))
    copy.offer(b"hello\n")
    assert not (tmp_path / "filtered_stderr.log").exists()


# -- --numa-binding: the topology ------------------------------------------------------------------

NVIDIA_TOPO = """\
\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tSYS\t0-31,64-95\t0\t\tN/A
GPU1\tNV12\t X \tSYS\t32-63,96-127\t1\t\tN/A
NIC0\tSYS\tSYS\t X

Legend:

  X    = Self
"""


def test_npu_smi_topology_fixture():
    text = (ROOT / "tests" / "fixtures" / "npu_smi" / "topo_a2.txt").read_text()
    assert parse_affinity_matrix(text, "NPU") == {0: frozenset(range(24)), 1: frozenset(range(24)),
                                                  2: frozenset(range(24, 48)), 3: frozenset(range(24, 48))}


def test_nvidia_smi_topology_with_a_nic_column():
    found = parse_affinity_matrix(NVIDIA_TOPO, "GPU")
    assert found == {0: frozenset([*range(32), *range(64, 96)]), 1: frozenset([*range(32, 64), *range(96, 128)])}


@pytest.mark.parametrize("text", ["", "garbage\nmore", "    NPU0   CPU Affinity\nNPU0   X   N/A\n"])
def test_topology_without_affinities_is_a_tool_error(text):
    with pytest.raises(DeviceToolError):
        parse_affinity_matrix(text, "NPU")


@pytest.mark.parametrize("text, cpus", [("0-3", {0, 1, 2, 3}), ("1,5-6", {1, 5, 6}), ("7", {7})])
def test_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["N/A", "3-1", "a-b", ""])
def test_bad_cpu_list(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


# -- --numa-binding: the modes ---------------------------------------------------------------------

#: two sockets of 8 CPUs, each of two L3 groups of 4; devices 0,1 near CPUs 0-7, devices 2,3 near 8-15
HOST = HostCpus(frozenset(range(16)), {c: c // 8 for c in range(16)},
                tuple(frozenset(range(s, s + 4)) for s in range(0, 16, 4)))
NEAR = {0: frozenset(range(8)), 1: frozenset(range(8)), 2: frozenset(range(8, 16)), 3: frozenset(range(8, 16))}
FOUR = {0: 0, 1: 1, 2: 2, 3: 3}

BINDINGS = [
    ("node", FOUR, NEAR, HOST, {0: range(8), 1: range(8), 2: range(8, 16), 3: range(8, 16)}),
    ("exclusive", FOUR, NEAR, HOST, {0: range(4), 1: range(4, 8), 2: range(8, 12), 3: range(12, 16)}),
    ("core-complex", FOUR, NEAR, HOST, {0: range(4), 1: range(4, 8), 2: range(8, 12), 3: range(12, 16)}),
    ("socket", {0: 0}, {0: frozenset({1, 2})}, HOST, {0: range(8)}),
    # exclusive with three ranks on 8 CPUs: 2, 2 and the rest
    ("exclusive", {0: 0, 1: 1, 2: 0}, NEAR, HOST, {0: range(2), 1: range(2, 4), 2: range(4, 8)}),
    # the agent may use CPUs 0-3 only: everything is cut down to them
    ("node", {0: 0}, NEAR, HostCpus(frozenset(range(4))), {0: range(4)}),
    # no CPU near the device is allowed, or its affinity is unknown: not bound
    ("node", {0: 2, 1: 4}, NEAR, HostCpus(frozenset(range(4))), {}),
    # no L3 groups known: core-complex binds as node
    ("core-complex", {0: 0}, NEAR, HostCpus(frozenset(range(16))), {0: range(8)}),
]


@pytest.mark.parametrize("mode, assigned, affinity, host, expected", BINDINGS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BINDINGS)])
def test_binding(mode, assigned, affinity, host, expected):
    assert bind_ranks(mode, assigned, affinity, host) == {r: tuple(c) for r, c in expected.items()}


def test_binding_on_cpu_says_once_that_it_is_skipped(tmp_path, caplog):
    cfg = config(tmp_path, numa_binding="node")
    with caplog.at_level(logging.INFO, logger="ftrun"):
        devices = NodeDevices.open(cfg, load_fault_table(None))
    assert [r.message for r in caplog.records if "numa-binding" in r.message] == [
        "--numa-binding node: no cpu devices to bind near; workers are not bound"]
    assert devices.binding() == {}


def test_binding_without_a_topology_says_so(caplog):
    class NoTopology(CpuBackend):
        kind, visibility_var = "npu", "ASCEND_RT_VISIBLE_DEVICES"

        def cpu_affinity(self):
            raise DeviceToolError("npu-smi info -t topo failed with exit code 2")

    devices = NodeDevices(NoTopology(), load_fault_table(None), [0, 1], 5.0)
    with caplog.at_level(logging.INFO, logger="ftrun"):
        devices.read_affinity("node")
    assert any("exit code 2" in r.message and "not bound" in r.message for r in caplog.records)
    devices.assign(2)
    assert devices.binding() == {}


def test_the_switch_and_choices_reach_the_config(tmp_path):
    cfg = config(tmp_path, numa_binding="exclusive", virtual_local_rank=True, signals_to_handle="SIGUSR1",
                 duplicate_stdout_filters="a,,b")
    assert (cfg.numa_binding, cfg.virtual_local_rank, cfg.signals_to_handle) == ("exclusive", True, (signal.SIGUSR1,))
    assert cfg.duplicate_stdout_filters == ("a,b",)


# -- --worker-port-range ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("30000-30003", PortRange(30000, 30003)), ("30000", PortRange(30000, 30000)),
                                            (" 1 - 2 ", PortRange(1, 2)), ("", None), (None, None)])
def test_port_range(text, expected):
    assert parse_port_range(text) == expected


@pytest.mark.parametrize("text", ["a-b", "3-1", "0-5", "1-65536", "1-2-3", "-5"])
def test_bad_port_range(text):
    with pytest.raises(UsageError, match="--worker-port-range"):
        parse_port_range(text)


def test_listening_in_a_range_takes_its_free_ports_then_says_it_is_full():
    first = listen_in_range("127.0.0.1", None, 1)
    port = first.getsockname()[1]
    first.close()
    ports = PortRange(port, port)
    taken = listen_in_range("127.0.0.1", ports, 1)
    try:
        assert taken.getsockname()[1] == port
        with pytest.raises(OSError, match="every port"):
            listen_in_range("127.0.0.1", ports, 1)
    finally:
        taken.close()


def test_the_static_rendezvous_sets_the_worker_port_and_others_do_not(tmp_path):
    assert config(tmp_path, standalone=False, master_port=29777).worker_port == 29777
    assert config(tmp_path).worker_port == 0
    assert config(tmp_path, standalone=False, rdzv_endpoint="localhost:29400").worker_port == 0


# -- torchrun's log shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("layout, template, expected", [
    ("ftrun", "", "[rank 5]: "),
    ("torchrun", "", "[trainer1]:"),  # torchrun's TailLog header: role and local rank, no space
    ("ftrun", "[${role_name}${local_rank}|${rank}]: ", "[trainer1|5]: "),
    ("torchrun", "${rank}> ", "5> "),
    ("torchrun", "[${nope}]:", "[${nope}]:"),  # safe_substitute, as torchrun: an unknown name stays
])
def test_line_prefix(layout, template, expected):
    assert line_prefix(layout, template, "trainer", 5, 1) == expected


def test_log_layout_and_the_prefix_template_reach_the_config(tmp_path, monkeypatch):
    assert (config(tmp_path).log_layout, config(tmp_path).log_line_prefix_template) == ("ftrun", "")
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${rank}]")
    cfg = config(tmp_path, log_layout="torchrun")
    assert (cfg.log_layout, cfg.log_line_prefix_template) == ("torchrun", "[${rank}]")
    with pytest.raises(UsageError, match="--log-layout"):
        config(tmp_path, log_layout="deepspeed")


def test_the_run_folder_holds_the_whole_run_torchrun_s_a_fresh_one_per_process(tmp_path):
    """Where the agent, the head node and the controller's event log put one run under --log-dir."""
    logs = tmp_path / "logs"
    assert run_folder(str(logs), "job", "ftrun") == str(logs / "job") == run_folder(str(logs), "job", "ftrun")
    first, second = run_folder(str(logs), "job", "torchrun"), run_folder(str(logs), "job", "torchrun")
    assert first != second and all(re.fullmatch(r"job_\w{8}", os.path.basename(p)) for p in (first, second))
    assert sorted(p.name for p in logs.iterdir()) == sorted(["job", os.path.basename(first), os.path.basename(second)])
    assert all((os.stat(p).st_mode & 0o777) == 0o700 for p in (logs, logs / "job", first, second))
