"""``ftrun probe --hostfile``: each host's command line, how the hosts' ends fold into one exit code, and the
head's flags checked before any ssh (``ftrun.head.probe``, ``ftrun.cli.probe``)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest

from ftrun.cli import main
from ftrun.cli.launch import agent_flags
from ftrun.cli.probe import probe_command
from ftrun.config import Endpoint
from ftrun.errors import ExitCode
from ftrun.head.hosts import Host
from ftrun.head.probe import HostProbe, findings, host_probe, plan_probes, read_result, store_endpoint, worst_exit_code
from ftrun.head.sessions import SSH_FAILED, RemoteSpec, SshOptions


def remote_words(agent) -> list[str]:
    """What the host's shell runs, as words (after ``cd FOLDER && exec``)."""
    return shlex.split(agent.argv[-1])[4:]


def test_each_host_runs_the_probe_across_nodes_the_first_hosting_the_store(tmp_path):
    hosts = [Host("alice@n1"), Host("n2", (0, 1)), Host("n3", spare=True)]
    spec = RemoteSpec(sys.executable, str(tmp_path), (("A", "x y"),), ("--speed", "--device", "cpu"), (), ("probe",))
    agents = plan_probes(hosts, spec, SshOptions(port=2222), Endpoint("n1", 29411), "check")
    assert [a.argv[-2] for a in agents] == ["alice@n1", "n2", "n3"]  # the spare is checked too
    assert all(("-p", "2222") == a.argv[-4:-2] for a in agents)
    for index, agent in enumerate(agents):
        words = remote_words(agent)
        assert words[:3] == ["env", "A=x y", sys.executable]
        assert words[3:7] == ["-u", "-m", "ftrun", "probe"] and words[7] == "--ssh-agent"
        flags = dict(zip(words, words[1:]))
        assert flags["--nnodes"] == "3" and flags["--rdzv-endpoint"] == "n1:29411" and flags["--run-id"] == "check"
        assert flags["--rdzv-conf"] == f"is_host={1 if index == 0 else 0}"
        assert "--json" in words and words[-3:] == ["--speed", "--device", "cpu"]


def test_the_store_is_on_the_first_host_unless_an_endpoint_says_how_the_others_reach_it():
    hosts = [Host("bob@n7"), Host("n8")]
    assert store_endpoint(hosts, "") == Endpoint("n7", 29400)
    assert store_endpoint(hosts, "10.0.0.7:29555") == Endpoint("10.0.0.7", 29555)


def test_the_heads_own_probe_flags_reach_the_hosts_and_its_ssh_flags_do_not():
    ctx = probe_command.make_context("probe", ["--hostfile", "h", "--ssh-port", "22", "--ssh-option", "User=x",
                                               "--env", "A=1", "--speed", "--device", "cpu", "--rdzv-timeout", "30",
                                               "--json"])
    values = {k: v for k, v in ctx.params.items() if k != "as_json"}
    assert agent_flags(probe_command, values) == ["--device", "cpu", "--speed", "--rdzv-timeout", "30"]


FOLD = [
    ("every host fit", [0, 0, 0], ExitCode.OK),
    ("a node left out", [0, 4, 4], ExitCode.DEVICE),
    ("a host that could not join beats a finding", [4, 3], ExitCode.RENDEZVOUS),
    ("a bad flag on a host", [0, 2, 3], ExitCode.USAGE),
    ("interrupted", [4, 130], ExitCode.INTERRUPTED),
    ("a code of no meaning here is the worst", [0, 7, 130], 7),
    ("no host", [], ExitCode.OK),
]


@pytest.mark.parametrize("codes, expected", [c[1:] for c in FOLD], ids=[c[0] for c in FOLD])
def test_the_hosts_exit_codes_fold_into_the_worst(codes, expected):
    assert worst_exit_code(codes) == expected


def test_a_host_that_gave_no_result_says_why_with_the_rendezvous_code():
    unreachable = host_probe("n2", SSH_FAILED, ["ssh: connect to host n2 port 22: Connection refused"], "cannot start")
    assert unreachable == HostProbe("n2", ExitCode.RENDEZVOUS, None, "cannot start")
    bad_flag = host_probe("n2", ExitCode.USAGE, [], "ftrun probe on n2 exited with code 2: bad flag")
    assert bad_flag.exit_code == ExitCode.USAGE and bad_flag.result is None


def test_a_hosts_result_is_read_from_its_json_and_keeps_its_own_code():
    lines = ["some noise", *json.dumps({"findings": ["n2 slow"], "hosted": True}, indent=2).splitlines()]
    probe = host_probe("n1", ExitCode.DEVICE, lines, "")
    assert probe.exit_code == ExitCode.DEVICE and probe.result == {"findings": ["n2 slow"], "hosted": True}
    assert read_result(["{ not json"]) is None and read_result(["[1]"]) is None


def test_each_finding_is_said_once_whatever_the_number_of_hosts_saying_it():
    said = [HostProbe("n1", 4, {"findings": ["a", "b"]}), HostProbe("n2", 4, {"findings": ["b", "a"]}),
            HostProbe("n3", 3, None, "gone")]
    assert findings(said) == ["a", "b"]
    alone = [HostProbe("n1", 4, {"problem": "device 1 Critical: chip reset required (RestartNPU)", "error": ""})]
    assert findings(alone) == ["n1: device 1 Critical: chip reset required (RestartNPU)"]  # one host: no rendezvous
    assert findings([HostProbe("n1", 0, {"problem": "", "error": ""})]) == []


BAD = [
    ("missing-file", ["--hostfile", "/nonexistent/hosts"], "cannot read hostfile /nonexistent/hosts"),
    ("bad-line", ["--hostfile", "{hosts}"], "line 2: unexpected 'slot=2'"),
    ("with-nnodes", ["--hostfile", "{hosts}", "--nnodes", "2"], "--nnodes cannot be used with --hostfile"),
    ("bad-ssh-option", ["--hostfile", "{good}", "--ssh-option", "nonsense"], "--ssh-option must be Name=Value"),
    ("bad-timeout", ["--hostfile", "{good}", "--rdzv-timeout", "-1"], "--rdzv-timeout"),
]


@pytest.mark.parametrize("args, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_to_the_probe_from_a_head_is_one_line_before_any_ssh(args, words, tmp_path, capsys):
    (tmp_path / "hosts").write_text("n1\nn2 slot=2\n")
    (tmp_path / "good").write_text("n1\nn2\n")
    args = [a.format(hosts=tmp_path / "hosts", good=tmp_path / "good") for a in args]
    with pytest.raises(SystemExit) as ended:
        main(["probe", *args])
    stderr = capsys.readouterr().err
    assert ended.value.code == ExitCode.USAGE, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ftrun: error: ") and words in lines[0], stderr
