"""Wrong input gets one clear line, a documented exit code, no traceback, no process left: as ``python -m ftrun``
where a process of its own matters (most cases run in-process: tests/unit/test_bad_input_matrix.py)."""

from __future__ import annotations

import socket

import pytest

from tests.conftest import WORKERS, free_port, marked_processes

SCRIPT = str(WORKERS / "train.py")

#: each case's error comes from a started agent: in-process (tests/unit/test_bad_input_matrix.py) they would launch
CASES = [
    # (id, args, exit code, words the line must contain)
    ("endpoint-unresolvable", ["--rdzv-endpoint", "no-such-host.invalid:29400", SCRIPT], 2, "no-such-host.invalid"),
    ("etcd-unreachable", ["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "2", "--run-id",
                          "x", "--rdzv-timeout", "1", SCRIPT], 3, "cannot reach etcd at 127.0.0.1:1 within 1s: "
                                                                  "no etcd member answered within 1s"),
]
#: the first case of each of the matrix's tables that came from here, as ``python -m ftrun`` (the rest run in-process)
EACH_FIRST = [
    ("nnodes-zero", ["--nnodes", "0", SCRIPT], 2, "--nnodes"),
    ("config-unknown-key", ["--config", "job.yaml", SCRIPT], 2, "unknown key 'nprocs'"),
    ("hostfile-missing", ["--hostfile", "hosts", SCRIPT], 2, "cannot read hostfile hosts"),
]


@pytest.mark.parametrize("args, code, words", [c[1:] for c in CASES + EACH_FIRST], ids=[c[0] for c in CASES + EACH_FIRST])
def test_bad_input_gets_one_clear_line(ftrun_cli, tmp_path, args, code, words):
    (tmp_path / "job.yaml").write_text("nproc_per_node: 2\nnprocs: 4\n")
    returncode, stdout, stderr = ftrun_cli(*args)
    assert returncode == code, stderr
    assert_one_clear_line(stderr, words)


def assert_one_clear_line(stderr: str, words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ftrun: error:")]
    assert len(errors) == 1, stderr
    assert words in errors[0], stderr
    assert "Traceback" not in stderr


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
