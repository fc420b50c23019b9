"""SSH mode's pure parts: what each host runs, and which variables it gets."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from ftrun.config import Endpoint
from ftrun.errors import UsageError
from ftrun.head.c10d import store_endpoint
from ftrun.head.hosts import Host
from ftrun.head.session_keeper import DETACHED_FLAG, detached_argv, parse_stop_request, send_within, stop_request
from ftrun.head.sessions import RemoteSpec, SshOptions, forwarded_env, plan_agents, remote_command, ssh_argv
from ftrun.store import is_local_host

#: every character a shell treats specially
HOSTILE = ["a b", "it's", '"q"', "$HOME", "$(id)", "`id`", "x;y", "a|b", "c&d", "<in", ">out", "\\", "*", "~", "", "\n",
           "#not-a-comment", "!bang"]


def spec(tmp_path, **changes) -> RemoteSpec:
    values = dict(python=sys.executable, cwd=str(tmp_path), env=(), flags=("--max-restarts", "2"),
                  command=("train.py", "--lr", "3e-4"))
    values.update(changes)
    return RemoteSpec(**values)


def test_remote_command_survives_a_real_posix_shell_unchanged(tmp_path):
    folder = tmp_path / "dir 'with' $x; `y`"
    folder.mkdir()
    recorder = folder / "print args"  # stands in for python: records its arguments, folder and variable
    recorder.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        "print(json.dumps([sys.argv[1:], os.getcwd(), os.environ.get('HOSTILE')]))\n")
    recorder.chmod(0o755)
    hostile_value = "v'a\"l $HOME `id` ;x"
    command = remote_command(spec(folder, python=str(recorder), env=(("HOSTILE", hostile_value),),
                                  command=("train.py", *HOSTILE)), ["--node-rank", "1"])
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30, check=True)
    argv, cwd, value = json.loads(done.stdout)
    assert argv == ["-u", "-m", "ftrun", "--ssh-agent", "--node-rank", "1", "--max-restarts", "2", "train.py", *HOSTILE]
    assert cwd == str(folder) and value == hostile_value


def test_remote_command_without_variables_runs_python_directly(tmp_path):
    words = shlex.split(remote_command(spec(tmp_path), []))
    assert words[:4] == ["cd", str(tmp_path), "&&", "exec"] and words[4] == sys.executable


def test_ssh_argv_puts_the_users_options_first_and_the_command_last():
    argv = ssh_argv(Host("alice@n1"), "echo hi", SshOptions(port=2222, options=("ConnectTimeout=3", "User=bob")))
    assert argv[:2] == ("ssh", "-T")
    options = [argv[i + 1] for i, word in enumerate(argv) if word == "-o"]
    assert options == ["ConnectTimeout=3", "User=bob", "BatchMode=yes", "ConnectTimeout=10"]  # ssh keeps the first
    assert argv[-4:] == ("-p", "2222", "alice@n1", "echo hi")


def test_ssh_argv_leaves_the_port_to_ssh_when_not_given():
    assert "-p" not in ssh_argv(Host("n1"), "true", SshOptions())


def test_forwarded_env_takes_the_default_families_and_nothing_else():
    environ = {"NCCL_DEBUG": "INFO", "HCCL_CONNECT_TIMEOUT": "600", "ASCEND_RT_VISIBLE_DEVICES": "0,1",
               "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/src", "FTRUN_LOG_LEVEL": "DEBUG",
               "HOME": "/root", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "SECRET_TOKEN": "x", "MY_NCCL": "no"}
    assert dict(forwarded_env(environ, [])) == {
        "NCCL_DEBUG": "INFO", "HCCL_CONNECT_TIMEOUT": "600", "ASCEND_RT_VISIBLE_DEVICES": "0,1",
        "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/src", "FTRUN_LOG_LEVEL": "DEBUG"}


def test_forwarded_env_takes_torch_npu_and_mindspore_knobs():
    # torch_npu reads TORCH_HCCL_* (fnmatch "HCCL_*" does not match it), MindSpore reads MS_ENABLE_TFT, and
    # torch_npu's UCE check needs PYTORCH_NO_NPU_MEMORY_CACHING as the user set it (ASCEND.md, mismatch 9)
    environ = {"TORCH_HCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_HCCL_BLOCKING_WAIT": "1",
               "MS_ENABLE_TFT": "{UCE:1,ARF:1}", "PYTORCH_NO_NPU_MEMORY_CACHING": "1", "MS_OTHER": "no"}
    assert dict(forwarded_env(environ, [])) == {
        "TORCH_HCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_HCCL_BLOCKING_WAIT": "1",
        "MS_ENABLE_TFT": "{UCE:1,ARF:1}", "PYTORCH_NO_NPU_MEMORY_CACHING": "1"}


def test_forwarded_env_adds_named_and_set_variables():
    env = dict(forwarded_env({"WANDB_API_KEY": "k", "NCCL_DEBUG": "INFO"},
                             ["WANDB_API_KEY", "OMP_NUM_THREADS=8", "URL=a=b", "EMPTY=", "NCCL_DEBUG=WARN"]))
    assert env == {"WANDB_API_KEY": "k", "OMP_NUM_THREADS": "8", "URL": "a=b", "EMPTY": "", "NCCL_DEBUG": "WARN"}


@pytest.mark.parametrize("item, words", [
    ("1X=2", "is not NAME or NAME=VALUE"),
    ("=x", "is not NAME or NAME=VALUE"),
    ("A-B=1", "is not NAME or NAME=VALUE"),
    ("A B", "is not NAME or NAME=VALUE"),
    ("FTRUN_UNSET_IN_TEST", "FTRUN_UNSET_IN_TEST is not set here"),
])
def test_forwarded_env_refuses_what_cannot_be_a_variable(item, words):
    with pytest.raises(UsageError) as caught:
        forwarded_env({}, [item])
    assert words in caught.value.message


def test_agents_get_node_ranks_in_file_order_and_ranks_from_their_slots(tmp_path):
    hosts = [Host("n1", (0, 1, 2, 3)), Host("n2", (1, 3)), Host("n3", None)]
    agents = plan_agents(hosts, spec(tmp_path), SshOptions(), ["--rdzv-endpoint", "head:29400", "--run-id", "job"], "3",
                         None)
    flags = [dict(zip(words, words[1:])) for words in (shlex.split(a.argv[-1]) for a in agents)]
    assert [a.node_rank for a in agents] == [0, 1, 2] and [a.argv[-2] for a in agents] == ["n1", "n2", "n3"]
    assert [f["--nproc-per-node"] for f in flags] == ["4", "2", "1"]
    assert "--devices" not in flags[0] and flags[1]["--devices"] == "1,3"
    assert {f["--rdzv-endpoint"] for f in flags} == {"head:29400"} and {f["--nnodes"] for f in flags} == {"3"}
    assert [f["--local-addr"] for f in flags] == ["n1", "n2", "n3"]


def test_given_nproc_wins_over_slots(tmp_path):
    agents = plan_agents([Host("n1", (0, 1)), Host("n2", (1, 3))], spec(tmp_path), SshOptions(),
                         ["--rdzv-endpoint", "head:1", "--run-id", "job"], "2", "auto")
    for agent in agents:
        words = shlex.split(agent.argv[-1])
        assert words[words.index("--nproc-per-node") + 1] == "auto" and "--devices" not in words


def test_store_endpoint_on_loopback_hosts_is_loopback():
    endpoint = store_endpoint([Host("127.0.0.2"), Host("localhost")], "", "", "")
    assert endpoint.host == "127.0.0.1" and 0 < endpoint.port < 65536


def test_store_endpoint_takes_the_named_address_first():
    assert store_endpoint([Host("n1")], "", "head.example", "10.0.0.1").host == "head.example"
    assert store_endpoint([Host("n1")], "", "", "10.0.0.1").host == "10.0.0.1"
    assert store_endpoint([Host("n1")], "127.0.0.1:29555", "", "") == Endpoint("127.0.0.1", 29555)


def test_store_endpoint_must_be_on_the_head_node():
    with pytest.raises(UsageError) as caught:
        store_endpoint([Host("n1")], "192.0.2.1:29400", "", "")
    assert "must name it" in caught.value.message


def test_store_endpoint_follows_the_route_to_a_remote_host():
    host = store_endpoint([Host("192.0.2.10")], "", "", "").host  # TEST-NET-1: routed, never answered
    assert is_local_host(host)  # one of this machine's own addresses (the route's source)


@pytest.mark.parametrize("line, signum", [
    (b"stop 2", 2), (b"stop 15", 15), (b" stop  15 ", 15),
    (b"stop", None), (b"stop x", None), (b"stop -15", None), (b"stop 999", None), (b"halt 15", None), (b"", None),
    (b"stop 15 now", None), (b"\xff\xfe", None),
])
def test_a_keeper_takes_only_the_heads_stop_request_with_a_real_signal(line, signum):
    assert parse_stop_request(line) == signum
    if signum is not None:
        assert parse_stop_request(stop_request(signum).strip()) == signum


def test_the_detached_agent_runs_the_keepers_own_command_line_with_its_flag_replaced():
    argv = detached_argv(["--ssh-agent", "--nnodes", "2", "train.py", "--ssh-agent"])
    assert argv[:4] == [sys.executable, "-u", "-m", "ftrun"]
    assert argv[4:] == [DETACHED_FLAG, "--nnodes", "2", "train.py", "--ssh-agent"]  # the script's own untouched


def test_a_keeper_counts_a_session_output_that_takes_nothing_as_the_head_gone():
    read, write = os.pipe()
    try:
        assert send_within(write, b"x" * 10, timeout=1.0) and os.read(read, 100) == b"x" * 10
        assert not send_within(write, b"y" * 1_000_000, timeout=0.2)  # more than a pipe holds, and nobody reads
        os.close(read)
        read = -1
        assert not send_within(write, b"z", timeout=1.0)  # closed: the head went
    finally:
        for fd in (read, write):
            if fd >= 0:
                os.close(fd)
