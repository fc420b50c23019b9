"""SSH mode: one ftrun on the head node starts an agent per host through a real sshd.

The hosts are 127.0.0.2, 127.0.0.3, ... (all this machine); the remote agents and
workers carry the test's mark (passed with --env), so the leftover check sees them.
Under --rdzv-backend etcd a real 3-member etcd on loopback (``tests/etcd.py``) too; a MindSpore job runs with
the interpreter tests/integration/test_mindspore.py finds (.msvenv), or skips as those tests do.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ftrun.head.session_keeper import stop_request
from tests.conftest import ELASTIC_STEPS, WORKERS, free_port, marked_processes, step_reached, unique_mark, wait_for
from tests.integration.test_layouts import start_pids
from tests.integration.test_mindspore import STEPS as MS_STEPS
from tests.integration.test_mindspore import TRAIN as MS_TRAIN
from tests.integration.test_mindspore import check_results, needs_mindspore
from tests.parts import unavailable
from tests.sshd import HOSTS, SshdUnavailable, start_sshd

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")
ELASTIC = str(WORKERS / "elastic_train.py")
#: arguments a shell would mangle or run: every one must reach the workers as it was typed
HOSTILE_ARGS = ["two words", "it's", '"quoted"', "$HOME", "$(touch pwned)", "`touch pwned`", "a;touch pwned",
                "back\\slash", "--lr=3e-4", "*", ""]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    try:
        server = start_sshd(tmp_path_factory.mktemp("sshd"))
    except SshdUnavailable as e:
        unavailable(f"SSH tests need a local sshd: {e}")
    yield server
    server.stop()


def hostfile(launcher, lines: list[str], folder=None):
    path = (folder or launcher.tmp) / "hosts"
    path.write_text("# made by the test\n" + "\n".join(lines) + "\n")
    return path


def start_head(launcher, sshd, hosts: list[str], script_args: list[str], flags: list[str] = (), env=None, cwd=None):
    path = hostfile(launcher, hosts, cwd)
    args = ["--hostfile", str(path), *sshd.client_flags(), "--env", "FTRUN_TEST_MARK", "--env", "OUT_DIR",
            "--env", "STEPS", "--env", "STEP_SLEEP", "--monitor-interval", "0.05", *flags, *script_args]
    return launcher.start(args, env=env or launcher.env(STEPS="6", STEP_SLEEP="0.05"), cwd=cwd)


def test_two_hosts_by_two_ranks_run_to_completion_with_a_log_file_per_host(launcher, sshd):
    log_dir = launcher.tmp / "logs"
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=2", f"{HOSTS[1]}:2"], [TRAIN],
                      flags=["--log-dir", str(log_dir), "--run-id", "logged"])
    assert launcher.wait() == [0], head.output
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3]
    assert {r["step"] for r in results.values()} == {6} and {r["world"] for r in results.values()} == {4}
    assert len({r["checksum"] for r in results.values()}) == 1
    output = head.output
    # node ranks follow the hostfile; the console keeps the agents' own lines, prefixed by host
    assert f"{HOSTS[0]}: ftrun: node 0 of 2, ranks 0-1 of 4" in output
    assert f"{HOSTS[1]}: ftrun: node 1 of 2, ranks 2-3 of 4" in output
    assert "finished step" not in output and "job succeeded" in output
    # what losing the head costs, and how to avoid it, said once at launch
    assert output.count("this head node holds the job: losing it") == 1 and "--rdzv-backend etcd" in output
    # and each host's whole output, worker lines labelled with their rank, is in its own file
    for host, ranks in ((HOSTS[0], (0, 1)), (HOSTS[1], (2, 3))):
        stdout = (log_dir / "logged" / f"{host}.stdout.log").read_text()
        assert all(f"[rank {rank}]: rank {rank} finished step 6" in stdout for rank in ranks)
        assert "ftrun: node " in (log_dir / "logged" / f"{host}.stderr.log").read_text()


def test_rank_killed_on_a_remote_host_is_replaced(launcher, sshd):
    env = launcher.env(STEPS="40", STEP_SLEEP="0.1")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=2", f"{HOSTS[1]} slots=2"], [ELASTIC],
                      flags=["--recovery", "process", "--max-restarts", "2"], env=env)
    wait_for(lambda: step_reached(launcher.out_dir, 2) >= 3,
             timeout=120, what="rank 2 to make progress")
    # its pid from its own file: a rank forked from the warm interpreter shows that interpreter's environment
    # in /proc (no RANK there)
    [pid] = start_pids(launcher)[2]
    victim = psutil.Process(pid)
    victim.kill()
    assert launcher.wait() == [0], head.output
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["step"] for r in results.values()} == {40}
    assert len({r["checksum"] for r in results.values()}) == 1
    assert results[2]["replacement"] == "1" and results[2]["pid"] != victim.pid
    assert results[0]["replacement"] == "0"  # the healthy ranks lived on
    assert "process-level repair into generation 1" in head.output
    assert "1 of 2 restarts used" in head.output


def test_spare_host_takes_over_as_soon_as_a_hosts_session_ends(launcher, sshd):
    env = launcher.env(STEPS="30", STEP_SLEEP="0.1")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1", f"{HOSTS[2]} slots=1 spare"],
                      [TRAIN], flags=["--max-restarts", "2", "--node-timeout", "600"], env=env)
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    agent = next(p for p in marked_processes(launcher.mark) if "--ssh-agent" in p.cmdline()
                 and p.cmdline()[p.cmdline().index("--node-rank") + 1] == "1")
    agent.kill()  # its ssh session ends: the head knows at once, long before --node-timeout
    assert launcher.wait() == [0], head.output
    results = launcher.results()
    assert sorted(results) == [0, 1] and {r["step"] for r in results.values()} == {30}
    assert len({r["checksum"] for r in results.values()}) == 1
    assert f"{HOSTS[2]}: ftrun: standing by as a spare node" in head.output
    assert f"spare {HOSTS[2]} takes the place of node 1 ({HOSTS[1]})" in head.output
    assert "nodes replaced by a spare (1)" in head.output


# fresh interpreters, as at job level by default: the ranks are found by the RANK in their /proc environ, which a
# rank forked from the warm interpreter does not show
@pytest.mark.fresh_interpreters
def test_ctrl_c_on_the_head_stops_every_host(launcher, sshd):
    env = launcher.env(STEPS="1000", STEP_SLEEP="0.1")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=2", f"{HOSTS[1]} slots=2"], [TRAIN], env=env)
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    assert len(workers(launcher.mark)) == 4
    head.proc.send_signal(signal.SIGINT)
    assert launcher.wait() == [130], head.output
    assert "SIGINT on the head node" in head.output
    # nothing of the job is left on any host (the fixture checks again, with a deadline)
    wait_for(lambda: not marked_processes(launcher.mark), timeout=30, what="every remote process to exit")


def test_head_killed_outright_leaves_no_remote_process(launcher, sshd):
    env = launcher.env(STEPS="1000", STEP_SLEEP="0.1")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=2", f"{HOSTS[1]} slots=2"], [TRAIN], env=env)
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    head.proc.kill()  # no chance to clean up: the ssh sessions close, and the agents see it
    head.proc.wait()
    wait_for(lambda: not marked_processes(launcher.mark), timeout=60, what="every remote process to exit")


def test_under_etcd_the_job_outlives_its_head_and_its_controllers_node_and_a_new_head_follows_it(
        launcher, sshd, etcd, fault_free):
    """One run, four faults: the head's ssh sessions cut (it follows the job through etcd), the head killed
    outright, a head started again for the run (it launches nothing and follows), the node of the controller
    killed (a spare takes its place where it held one)."""
    logs = launcher.tmp / "logs"
    hosts = [f"{HOSTS[0]} slots=2", f"{HOSTS[1]} slots=2", f"{HOSTS[2]} slots=2 spare"]
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--run-id", launcher.mark,
             "--node-timeout", "3", "--recovery", "process", "--max-restarts", "2", "--log-dir", str(logs)]
    env = launcher.env(STEPS=str(ELASTIC_STEPS), STEP_SLEEP="0.4")
    head = start_head(launcher, sshd, hosts, [ELASTIC], flags=flags, env=env)
    wait_for(lambda: step_reached(launcher.out_dir, 1) >= 2, timeout=120, what="training to start")
    assert "the job does not depend on this head node" in head.output
    assert "this head node holds the job" not in head.output
    assert f"{HOSTS[0]}: ftrun: node 0 of 2" in head.output  # the agents' output comes back while the head is there
    agents = detached_agents(launcher.mark)
    assert len(agents) == 3

    sessions = [p for p in psutil.Process(head.proc.pid).children() if p.name() == "ssh"]
    assert len(sessions) == 3
    for ssh in sessions:  # its sessions cut: it follows the job through etcd
        ssh.kill()
    wait_for(lambda: "every ssh session ended while the job goes on" in head.output, timeout=60,
             what="the head to follow the job without its sessions")
    assert head.output.count("its agent goes on, detached from it") == 3
    assert detached_agents(launcher.mark) == agents
    head.proc.kill()  # then the head itself, with no chance to clean up
    head.proc.wait()
    # the sessions' keepers end with their sessions; the agents, detached from them, go on
    wait_for(lambda: not [p for p in marked_processes(launcher.mark) if "--ssh-agent" in cmdline(p)], timeout=60,
             what="the session keepers to end with the head")
    went_at = step_reached(launcher.out_dir, 1)
    wait_for(lambda: step_reached(launcher.out_dir, 1) >= went_at + 2, timeout=120, what="training to go on")
    assert detached_agents(launcher.mark) == agents

    again = start_head(launcher, sshd, hosts, [ELASTIC], flags=flags, env=env)
    wait_for(lambda: "following it (nothing is launched)" in again.output and again.output, timeout=120,
             what="the second head to follow the run")
    assert detached_agents(launcher.mark) == agents  # no second job
    leader = controllers_agent(logs / launcher.mark, agents)
    held_a_node = "-1" != cmdline(leader)[cmdline(leader).index("--node-rank") + 1]
    killed_at = step_reached(launcher.out_dir, 1)
    assert killed_at < ELASTIC_STEPS - 5, f"the job reached step {killed_at} of {ELASTIC_STEPS} before the kill"
    leader.kill()  # the node of the store and the controller; its guardian takes its ranks
    assert launcher.wait([again]) == [0], again.output
    results = launcher.results()
    assert {r["step"] for r in results.values()} == {ELASTIC_STEPS}
    assert {rank: r["digest"] for rank, r in results.items()} == fault_free  # bit for bit, every rank
    assert f"run {launcher.mark} ended" in again.output
    node_logs = "".join(p.read_text() for p in (logs / launcher.mark).glob("127.0.0.*.std*.log"))
    assert "the controller moved from" in node_logs
    if held_a_node:  # the spare took its place
        assert "taking the place of node" in node_logs
    # nothing of the job is left on any host: agents, keepers, workers, standbys
    deadline = time.monotonic() + 60
    while (left := marked_processes(launcher.mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [cmdline(p)[:12] for p in left]


def test_under_etcd_ctrl_c_on_the_head_stops_the_job_on_every_host(launcher, sshd, etcd):
    env = launcher.env(STEPS="1000", STEP_SLEEP="0.1")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1"], [TRAIN], env=env,
                      flags=["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--node-timeout", "3",
                             "--log-dir", str(launcher.tmp / "logs")])
    wait_for(lambda: (launcher.out_dir / "ckpt.pt").exists(), timeout=120, what="training to start")
    head.proc.send_signal(signal.SIGINT)
    assert launcher.wait() == [130], head.output
    output = head.output
    assert "SIGINT: stopping the job" in output
    assert output.count("ftrun: the head node asks the job to stop (SIGINT)") == 2  # each host's keeper
    # the controller's agent, on a host, ended the job: its summary comes back through its session
    assert ": ftrun: reason: SIGINT on node" in output and "ftrun: job stopped (exit code 130)" in output, output
    wait_for(lambda: not marked_processes(launcher.mark), timeout=30, what="every remote process to exit")


def test_under_etcd_msrun_s_flags_from_a_head_node_restart_a_sigkilled_worker_as_the_direct_launch_does(
        launcher, sshd, etcd):
    """A MindSpore job (2 hosts x 2 workers, msrun's flags): the scheduler runs in the controller's agent, on a
    host; a worker SIGKILLed restarts the job at job level, on a fresh scheduler, and it ends as a fault-free
    run does (the same parameters, every step)."""
    python = needs_mindspore()
    logs = launcher.tmp / "logs"
    # MindSpore's workers reach a scheduler on 127.0.0.2 after more failed tries than one on 127.0.0.1 (25 s
    # in one run on the 2-core machine): a generation may take up to 120 s to form
    flags = ["--worker_num=4", "--local_worker_num=2", "--cluster_time_out=120", "--rdzv-backend", "etcd",
             "--rdzv-endpoint", etcd.endpoints, "--run-id", launcher.mark, "--node-timeout", "3", "--python", python,
             "--max-restarts", "2", "--log-dir", str(logs), "--env", "FAULT", "--env", "FAULT_RESTARTS"]
    env = launcher.env(STEPS=str(MS_STEPS), STEP_SLEEP="0.05", FAULT="3:4:sigkill", FAULT_RESTARTS="0")
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=2", f"{HOSTS[1]} slots=2"], [MS_TRAIN], flags=flags,
                      env=env)
    assert launcher.wait() == [0], head.output
    results = check_results(launcher, 4, restart="1")  # every step, the fault-free run's parameters
    assert {r["env"]["MS_TOPO_TIMEOUT"] for r in results.values()} == {"120"}
    schedulers = [json.loads((launcher.out_dir / f"scheduler{restart}.json").read_text()) for restart in (0, 1)]
    output = head.output
    assert "the job does not depend on this head node" in output
    host = schedulers[1]["env"]["MS_SCHED_HOST"]
    assert f"{host}: ftrun: hosting the control store at {host}:" in output  # the controller's agent, on a host
    for generation, seen in enumerate(schedulers):  # started by that agent, not by the head
        assert seen["env"]["MS_ROLE"] == "MS_SCHED" and seen["env"]["MS_SCHED_HOST"] == host, seen
        port = seen["env"]["MS_SCHED_PORT"]
        assert f"{host}: ftrun: MindSpore scheduler of generation {generation} at {host}:{port} (pid {seen['pid']})" \
            in output
    assert schedulers[0]["env"]["MS_SCHED_PORT"] != schedulers[1]["env"]["MS_SCHED_PORT"]  # a fresh one
    assert {r["env"]["MS_SCHED_PORT"] for r in results.values()} == {schedulers[1]["env"]["MS_SCHED_PORT"]}
    assert "rank 3 failed: killed by SIGKILL" in output, output
    assert "job succeeded" in output and "1 of 2 restarts used" in output
    wait_for(lambda: not marked_processes(launcher.mark), timeout=60, what="every remote process to exit")


def test_under_etcd_a_head_that_cannot_reach_etcd_says_so_in_one_line_before_any_ssh(launcher, ftrun_cli):
    path = hostfile(launcher, [f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1"])
    code, out, err = ftrun_cli("--hostfile", str(path), "--rdzv-backend", "etcd", "--rdzv-endpoint",
                               f"127.0.0.1:{free_port()}", "--rdzv-timeout", "1", "--run-id", "r1", TRAIN)
    assert code == 3, err
    errors = [line for line in err.splitlines() if line.startswith("ftrun: error:")]
    assert len(errors) == 1 and "cannot reach etcd at 127.0.0.1:" in errors[0], err
    assert "starting" not in err  # nothing was launched


#: a stand-in agent for the session keeper: says the token it read, then waits; a signal ends it with 7
KEEPER_AGENT = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("agent got SIGTERM", flush=True), sys.exit(7)))
print("agent read " + sys.stdin.readline().strip(), flush=True)
sys.stdin.read()  # the keeper closed it: nothing more comes
print("agent input ended", flush=True)
time.sleep(120)
"""


def start_keeper(tmp_path, mark: str) -> subprocess.Popen:
    """``ftrun.head.session_keeper.keep_session`` as a host's session runs it, the stand-in agent behind it."""
    agent = tmp_path / "agent.py"
    agent.write_text(KEEPER_AGENT)
    paths = (str(tmp_path / "h.stdout.log"), str(tmp_path / "h.stderr.log"))
    (tmp_path / "h.stdout.log").write_text("an earlier run's output\n")
    code = (f"import sys; from ftrun.head.session_keeper import keep_session; "
            f"sys.exit(keep_session([sys.executable, {str(agent)!r}], b'the-token', {paths!r}))")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, FTRUN_TEST_MARK=mark))


def test_session_keeper_copies_the_agents_output_and_passes_the_heads_stop_on(tmp_path):
    keeper = start_keeper(tmp_path, unique_mark("keeper"))
    assert keeper.stdout.readline() == b"agent read the-token\n"  # from the agent's file, on the session
    assert keeper.stdout.readline() == b"agent input ended\n"  # the token alone: its input is closed
    keeper.stdin.write(stop_request(signal.SIGTERM))
    keeper.stdin.flush()
    assert keeper.wait(timeout=60) == 7  # the agent's own exit code
    assert keeper.stdout.read() == b"agent got SIGTERM\n"
    assert "the agent runs detached" in keeper.stderr.read().decode()
    # all of it stays on the host, after what an earlier run of the same id wrote there (not sent again)
    assert (tmp_path / "h.stdout.log").read_text().count("agent") == 3
    assert (tmp_path / "h.stdout.log").read_text().startswith("an earlier run's output\n")


def test_session_keeper_ends_with_its_session_and_leaves_the_agent_running(tmp_path):
    mark = unique_mark("keeper")
    keeper = start_keeper(tmp_path, mark)
    assert keeper.stdout.readline() == b"agent read the-token\n"
    keeper.stdin.close()  # the head is gone
    assert keeper.wait(timeout=60) == 0
    agent = [p for p in marked_processes(mark) if p.pid != keeper.pid]
    try:
        assert len(agent) == 1 and agent[0].is_running()
        assert os.getsid(agent[0].pid) == agent[0].pid  # in a session of its own: no hangup of the ssh session's reaches it
    finally:
        for process in agent:
            process.kill()
            process.wait(timeout=30)


def detached_agents(mark: str) -> list[psutil.Process]:
    """The job's agents that outlive their ssh sessions, by host (not a child an agent has forked and not yet
    made a worker: its command line is the agent's until it runs the worker's)."""
    found = {p: cmdline(p) for p in marked_processes(mark)}
    agents = {p: line for p, line in found.items() if "--detached-agent" in line}
    pids = {p.pid for p in agents}
    top = [p for p in agents if parent(p) not in pids]
    return sorted(top, key=lambda p: agents[p][agents[p].index("--local-addr") + 1])


def parent(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:
        return None


def controllers_agent(run_folder, agents: list[psutil.Process]) -> psutil.Process:
    """The agent that hosts the controller now: its host's log says so last."""
    leading = [p for p in agents if "hosting the control store" in
               (run_folder / f"{cmdline(p)[cmdline(p).index('--local-addr') + 1]}.stderr.log").read_text()]
    assert len(leading) == 1, [cmdline(p) for p in agents]
    return leading[0]


def cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def test_unreachable_host_is_named_with_ssh_error(launcher, sshd):
    # 127.0.0.9 is this machine too, but the test's sshd does not listen there
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=1", "127.0.0.9 slots=1"], [TRAIN])
    assert launcher.wait() == [3], head.output
    error = [line for line in head.output.splitlines() if line.startswith("ftrun: error:")]
    assert error and "127.0.0.9" in error[0] and "Connection refused" in error[0], head.output


def test_agent_that_cannot_start_is_named_with_the_shells_error(launcher, sshd):
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1"], [TRAIN],
                      flags=["--remote-python", "/nonexistent/python3"])
    assert launcher.wait() == [3], head.output
    error = [line for line in head.output.splitlines() if line.startswith("ftrun: error:")]
    assert error and "the agent on 127.0.0." in error[0] and "/nonexistent/python3" in error[0], head.output


def test_hostile_arguments_env_and_folder_reach_the_workers_unchanged(launcher, sshd, tmp_path):
    folder = tmp_path / "dir with 'quote' $x ;"
    folder.mkdir()
    hostile = "v'a\"l $HOME `id` ;x"
    python = folder / "my python"  # --remote-python with a space: a wrapper keeps the venv
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    head = start_head(launcher, sshd, [f"{HOSTS[0]} slots=1", f"{HOSTS[1]} slots=1"], [TRAIN, *HOSTILE_ARGS],
                      flags=["--env", f"HOSTILE={hostile}", "--remote-python", str(python)], cwd=folder)
    assert launcher.wait() == [0], head.output
    results = launcher.results()
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["argv"] == HOSTILE_ARGS
        assert result["hostile"] == hostile
        assert result["cwd"] == str(folder)
    # worker output comes back to the console prefixed with host and rank
    assert f"{HOSTS[1]}: [rank 1]: rank 1 finished step 6" in head.output
    assert not list(tmp_path.rglob("pwned")) and not (launcher.tmp / "pwned").exists()


def test_dry_run_prints_one_quoted_ssh_command_per_host(launcher, ftrun_cli, tmp_path):
    path = hostfile(launcher, ["n01 slots=2", "n02:2", "n03 slots=4 spare"])
    code, out, err = ftrun_cli("--hostfile", str(path), "--exclude", "n02:0", "--env", "A=x y", "--dry-run",
                               "--rdzv-host", "head", "--max-restarts", "2", TRAIN, "it's")
    assert code == 0, err
    commands = [line for line in out.splitlines() if line.startswith("ssh ")]
    assert len(commands) == 3 and "# spare: n03, 4 ranks" in out  # the spare stands by (node rank -1)
    words = shlex.split(commands[1])
    assert words[:2] == ["ssh", "-T"] and "BatchMode=yes" in words and words[-2] == "n02"
    remote = shlex.split(words[-1])  # what the host's shell runs
    assert remote[:2] == ["cd", str(tmp_path)] and "A=x y" in remote
    assert remote[-2:] == [TRAIN, "it's"] and "--max-restarts" in remote
    flags = dict(zip(remote, remote[1:]))
    assert flags["--node-rank"] == "1" and flags["--nproc-per-node"] == "1" and flags["--devices"] == "1"
    assert flags["--rdzv-endpoint"].startswith("head:")


def test_print_hosts_shows_node_ranks_ranks_and_spares(launcher, ftrun_cli):
    path = hostfile(launcher, ["alice@n01 slots=2", "n02:4", "n03 slots=4 spare", "n04"])
    code, out, err = ftrun_cli("--hostfile", str(path), "--include", "n01@n02:1,3@n03@n04", "--nnodes", "2",
                               "--rdzv-endpoint", "127.0.0.1:29555", "--run-id", "job7", "--print-hosts")
    assert code == 0, err
    assert out.splitlines() == ["store on 127.0.0.1:29555 (this head node); run id job7",
                                "  node 0  alice@n01  2 ranks", "  node 1  n02  2 ranks on devices 1,3",
                                "  spare   n03  4 ranks", "  spare   n04  1 rank"]


def test_dry_run_without_a_hostfile_prints_this_nodes_worker_commands(ftrun_cli):
    code, out, err = ftrun_cli("--standalone", "--nproc-per-node", "2", "--dry-run", TRAIN, "a b")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# this node: 2 ranks, store localhost:") and len(lines) == 3
    for local_rank, line in enumerate(lines[1:]):
        words = shlex.split(line)
        assert words[0] == f"LOCAL_RANK={local_rank}" and words[-2:] == [TRAIN, "a b"] and "-u" in words


def workers(mark: str) -> list[psutil.Process]:
    found = []
    for proc in marked_processes(mark):
        try:
            if "RANK" in proc.environ():
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_probe_from_the_head_checks_every_host_once_and_leaves_nothing_behind(launcher, sshd):
    """``ftrun probe --hostfile``: the hosts' probe across nodes, its table said once; an unreachable host in one
    line, the others ended at once; Ctrl-C on the head ends every host's probe (and its device tool)."""
    def probe(hosts: list[str], *flags: str):
        path = hostfile(launcher, hosts)
        return launcher.start(["probe", "--hostfile", str(path), *sshd.client_flags(), "--env", "FTRUN_TEST_MARK",
                               "--rdzv-endpoint", f"{HOSTS[0]}:{free_port()}", *flags])

    fit = probe([HOSTS[0], f"{HOSTS[1]} slots=2"], "--device", "cpu")
    code = launcher.wait([fit], timeout=120)[0]
    assert fit.output.count("the job's nodes") == 1 and fit.output.count("the data network, ") == 1, fit.output
    # both "hosts" share this machine's two cores with the other tests: one's matmul may time past twice the
    # other's, a finding that is the check's to make; the head says it once and exits 4, or says all fit and exits 0
    slow = [line for line in fit.output.splitlines() if line.startswith("preflight: ") and "its matmul takes" in line]
    if code == 0:
        assert fit.output.count("preflight: every node fit") == 1 and "ms" in fit.output and not slow, fit.output
    else:
        assert code == 4 and len(slow) == 1 and "every node fit" not in fit.output, fit.output

    unreachable = probe([HOSTS[0], "127.0.0.9"], "--device", "cpu")  # no sshd listens on 127.0.0.9
    assert launcher.wait([unreachable], timeout=60) == [3], unreachable.output
    errors = [line for line in unreachable.output.splitlines() if line.startswith("ftrun: error:")]
    assert len(errors) == 1 and "cannot start ftrun probe on 127.0.0.9 over ssh" in errors[0], unreachable.output
    assert "Connection refused" in errors[0] and "Traceback" not in unreachable.output
    wait_for(lambda: not marked_processes(launcher.mark), timeout=15, what="every host's probe to end")

    hung = launcher.tmp / "npu-smi"  # a device tool that never answers: each host's probe waits in it
    hung.write_text("#!/bin/sh\nexec sleep 60\n")
    hung.chmod(0o755)
    stopped = probe([HOSTS[0], HOSTS[1]], "--device", "npu", "--npu-smi", str(hung), "--device-timeout", "60")
    wait_for(lambda: sum("sleep" in cmdline(p) for p in marked_processes(launcher.mark)) == 2, timeout=30,
             what="both hosts' probes to wait in their device tool")
    stopped.proc.send_signal(signal.SIGINT)
    assert launcher.wait([stopped], timeout=30) == [130], stopped.output
    wait_for(lambda: not marked_processes(launcher.mark), timeout=15, what="every host's probe to end")
