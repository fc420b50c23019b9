"""Wrong input gets one clear line, a documented exit code, no traceback, no process left."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import WORKERS, free_port, marked_processes

SCRIPT = str(WORKERS / "train.py")

CASES = [
    # (id, args, exit code, words the line must contain)
    ("nnodes-zero", ["--nnodes", "0", SCRIPT], 2, "--nnodes"),
    ("nnodes-garbage", ["--nnodes", "a:b", SCRIPT], 2, "--nnodes"),
    ("nnodes-min-above-max", ["--nnodes", "3:2", SCRIPT], 2, "--nnodes"),
    ("nproc-zero", ["--nproc-per-node", "0", SCRIPT], 2, "--nproc-per-node"),
    ("nproc-word", ["--nproc_per_node", "many", SCRIPT], 2, "--nproc-per-node"),
    ("missing-script", ["no_such_train.py"], 2, "no_such_train.py"),
    ("no-script", [], 2, "no training script"),
    ("config-missing", ["--config", "missing.yaml", SCRIPT], 2, "missing.yaml"),
    ("recovery-unknown", ["--recovery", "node", SCRIPT], 2, "--recovery"),
    ("negative-budget", ["--max-restarts", "-1", SCRIPT], 2, "--max-restarts"),
    ("budget-not-a-number", ["--fault-retry-times", "lots", SCRIPT], 2, "lots"),
    ("endpoint-port-word", ["--rdzv-endpoint", "head:http", SCRIPT], 2, "port 'http'"),
    ("endpoint-port-range", ["--rdzv-endpoint", "head:70000", SCRIPT], 2, "70000"),
    ("endpoint-unresolvable", ["--rdzv-endpoint", "no-such-host.invalid:29400", SCRIPT], 2, "no-such-host.invalid"),
    ("etcd-unreachable", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--run-id",
                          "x", "--rdzv-timeout", "1", SCRIPT], 3, "cannot reach etcd at 127.0.0.1:1 within 1s: "
                                                                  "no etcd member answered within 1s"),
    ("unknown-flag", ["--frobnicate", SCRIPT], 2, "--frobnicate"),
    ("static-without-node-rank", ["--nnodes", "2", SCRIPT], 2, "--node-rank"),
    ("node-rank-out-of-range", ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "localhost:1", SCRIPT], 2, "--node-rank 2"),
    ("standalone-multi-node", ["--standalone", "--nnodes", "2", SCRIPT], 2, "--standalone"),
    ("module-and-no-python", ["-m", "--no-python", "pkg"], 2, "cannot be combined"),
    ("bad-redirects", ["-r", "7", SCRIPT], 2, "--redirects"),
    ("bad-rdzv-conf", ["--rdzv-conf", "join_timeout", SCRIPT], 2, "--rdzv-conf"),
    ("negative-interval", ["--monitor-interval", "-1", SCRIPT], 2, "--monitor-interval"),
    ("device-unknown", ["--device", "tpu", SCRIPT], 2, "--device must be one of auto, npu, cuda, cpu"),
    ("health-interval-zero", ["--health-interval", "0", SCRIPT], 2, "--health-interval"),
    ("device-timeout-word", ["--device-timeout", "soon", SCRIPT], 2, "--device-timeout"),
    ("hang-timeout-negative", ["--hang-timeout", "-3", SCRIPT], 2, "--hang-timeout"),
    ("fault-levels-missing", ["--fault-levels", "no-such-levels.yaml", SCRIPT], 2, "no-such-levels.yaml"),
    ("probe-device-unknown", ["probe", "--device", "tpu"], 2, "--device must be one of"),
    ("probe-unknown-flag", ["doctor", "--frobnicate"], 2, "--frobnicate"),
]


@pytest.mark.parametrize("args, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_clear_line(ftrun_cli, args, code, words):
    returncode, stdout, stderr = ftrun_cli(*args)
    assert returncode == code, stderr
    assert_one_clear_line(stderr, words)


def assert_one_clear_line(stderr: str, words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ftrun: error:")]
    assert len(errors) == 1, stderr
    assert words in errors[0], stderr
    assert "Traceback" not in stderr


CONFIGS = [
    ("unknown-key", "nproc_per_node: 2\nnprocs: 4\n", "unknown key 'nprocs'"),
    ("not-yaml", "nnodes: [1, 2\n", "not valid YAML"),
    ("not-a-mapping", "- 1\n- 2\n", "must be a mapping"),
    ("not-utf8", b"nnodes: \xff\xfe\n", "not UTF-8"),
    ("wrong-type", "max_restarts: [1, 2]\n", "--max-restarts"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_bad_config_file_gets_one_clear_line(ftrun_cli, tmp_path, text, words):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    returncode, _, stderr = ftrun_cli("--config", str(path), SCRIPT)
    assert returncode == 2, stderr
    assert_one_clear_line(stderr, words)


FAULT_TABLES = [
    ("unknown-level", "codes:\n  '80E01801': Explode\n", "Explode"),
    ("unknown-section", "colours:\n  red: SeparateNPU\n", "unknown key 'colours'"),
    ("not-yaml", "codes: [1, 2\n", "not valid YAML"),
    ("not-utf8", b"codes: \xff\n", "not UTF-8"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in FAULT_TABLES], ids=[c[0] for c in FAULT_TABLES])
def test_bad_fault_table_gets_one_clear_line_naming_the_file(ftrun_cli, tmp_path, text, words):
    path = tmp_path / "levels.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    for args in (["--fault-levels", str(path), SCRIPT], ["probe", "--fault-levels", str(path)]):
        returncode, _, stderr = ftrun_cli(*args)
        assert returncode == 2, stderr
        assert_one_clear_line(stderr, words)
        assert str(path) in stderr


HOSTFILES = [
    # (id, hostfile text, extra args, words the line must contain); every one exits 2 before any ssh runs
    ("missing-file", None, [], "cannot read hostfile hosts"),
    ("empty", "# nothing\n\n", [], "lists no hosts"),
    ("slots-zero", "n01 slots=0\n", [], "line 1: slots must be a whole number of at least 1, got '0'"),
    ("slots-word", "n01:many\n", [], "got 'many'"),
    ("duplicate", "n01\nn02\nn01 slots=2\n", [], "line 3: host 'n01' is already listed on line 1"),
    ("unknown-word", "n01 gpus=8\n", [], "unexpected 'gpus=8'"),
    ("option-as-host", "-oProxyCommand=x\n", [], "is not a host name"),
    ("shell-in-host", "n01;reboot\n", [], "is not a host name"),
    ("not-utf8", b"n01 slots=\xff\n", [], "cannot read hostfile hosts"),
    ("include-unknown", "n01\nn02\n", ["--include", "n09"], "--include: host 'n09' is not in the hostfile"),
    ("include-and-exclude", "n01\nn02\n", ["--include", "n01", "--exclude", "n02"], "cannot be combined"),
    ("exclude-everything", "n01\n", ["--exclude", "n01"], "--exclude leaves no host"),
    ("slot-not-there", "n01 slots=2\n", ["--include", "n01:5"], "host 'n01' has no slot 5"),
    ("too-many-nodes", "n01\nn02\n", ["--nnodes", "3"], "--nnodes 3 but the hostfile has 2 hosts"),
    ("with-node-rank", "n01\n", ["--node-rank", "0"], "--node-rank cannot be used with --hostfile"),
    ("with-standalone", "n01\n", ["--standalone"], "--standalone cannot be used with --hostfile"),
    ("bad-env", "n01\n", ["--env", "1X=2"], "--env: '1X=2' is not NAME or NAME=VALUE"),
    ("env-unset", "n01\n", ["--env", "FTRUN_NO_SUCH_VARIABLE"], "FTRUN_NO_SUCH_VARIABLE is not set here"),
    ("bad-ssh-option", "n01\n", ["--ssh-option", "-v"], "--ssh-option must be Name=Value"),
    ("bad-ssh-port", "n01\n", ["--ssh-port", "0"], "--ssh-port must be a port number"),
    ("endpoint-elsewhere", "n01\n", ["--rdzv-endpoint", "192.0.2.1:29400"], "must name it"),
    ("spares-flag", "n01\nn02 spare\n", ["--spares", "1"], "--spares cannot be used with --hostfile"),
    ("bad-devices", "n01\n", ["--devices", "0,x"], "--devices must be device ids"),
]


@pytest.mark.parametrize("text, args, words", [c[1:] for c in HOSTFILES], ids=[c[0] for c in HOSTFILES])
def test_bad_hostfile_or_cluster_flag_gets_one_clear_line(ftrun_cli, tmp_path, text, args, words):
    if text is not None:
        (tmp_path / "hosts").write_bytes(text if isinstance(text, bytes) else text.encode())
    returncode, stdout, stderr = ftrun_cli("--hostfile", "hosts", *args, SCRIPT)
    assert returncode == 2, stderr
    assert_one_clear_line(stderr, words)
    assert not stdout


def test_port_in_use_by_another_program(ftrun_cli):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        returncode, _, stderr = ftrun_cli("--rdzv-endpoint", f"127.0.0.1:{port}", SCRIPT)
    assert returncode == 2, stderr
    assert_one_clear_line(stderr, f"port {port} on 127.0.0.1 is already in use")


def test_unreachable_endpoint_names_it_and_gives_up_at_the_deadline(ftrun_cli):
    port = free_port()
    args = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=0", "--rdzv-timeout", "2"]
    returncode, _, stderr = ftrun_cli(*args, SCRIPT)
    assert returncode == 3, stderr
    assert_one_clear_line(stderr, f"cannot reach the rendezvous endpoint 127.0.0.1:{port} within 2s")


def test_rendezvous_timeout_names_who_is_missing(ftrun_cli):
    mark = "bad-input-rdzv-timeout"
    args = ["--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "2"]
    returncode, _, stderr = ftrun_cli(*args, SCRIPT, env={"FTRUN_TEST_MARK": mark})
    assert returncode == 3, stderr
    assert_one_clear_line(stderr, "1 of 3 nodes joined")
    assert "missing node ranks 1, 2" in stderr
    assert not marked_processes(mark)
