"""Shared fixtures: launching ftrun agents as real processes, and checking none are left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from ftrun.contract import Endpoint
from ftrun.devices import DeviceOptions
from ftrun.devices.npu import NpuBackend

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
#: generous deadline: only there to turn a hang into a failure
JOB_DEADLINE = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ftrun_status(endpoint: str, *args: str, into: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    """``ftrun status`` of the job at ``endpoint``, its output in pipes; a watcher's in ``into``.out and
    ``into``.err instead, since nobody reads a pipe while the job runs (a full one would stop it printing)."""
    if into is None:
        streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    else:
        streams = {"stdout": open(f"{into}.out", "w"), "stderr": open(f"{into}.err", "w")}
    try:
        return subprocess.Popen([sys.executable, "-m", "ftrun", "status", "--rdzv-endpoint", endpoint, *args],
                                text=True, env=env, **streams)
    finally:
        if into is not None:
            for stream in streams.values():
                stream.close()


def marked_processes(mark: str) -> list[psutil.Process]:
    """Processes (of any parent) whose environment carries this test's mark."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FTRUN_TEST_MARK") == mark:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@dataclass
class Node:
    proc: subprocess.Popen
    log: Path
    code: int | None = None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Launcher:
    """Starts ftrun agents (one per simulated node) for one test and cleans up after it."""

    tmp: Path
    mark: str
    nodes: list[Node] = field(default_factory=list)
    #: the jobs' ranks forked from each node's warm interpreter (PET_WARM_STANDBY=1, which a test's own
    #: --warm-standby overrides), at job level too where ftrun's default starts each rank fresh, as torchrun does:
    #: one torch import per node, not one per rank and generation, half the CPU of a job-level test on 2 cores.
    #: The fresh path keeps the tests marked ``fresh_interpreters`` (torchrun's own lifecycle and exits).
    warm: bool = True

    @property
    def out_dir(self) -> Path:
        path = self.tmp / "out"
        path.mkdir(exist_ok=True)
        return path

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, FTRUN_TEST_MARK=self.mark, OUT_DIR=str(self.out_dir), PYTHONUNBUFFERED="1")
        env.pop("PET_NNODES", None)
        if self.warm:
            env.setdefault("PET_WARM_STANDBY", "1")
        env.update(extra)
        return env

    def start(self, args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Node:
        log = self.tmp / f"node{len(self.nodes)}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ftrun", *args],
                stdout=f, stderr=subprocess.STDOUT, env=env or self.env(), cwd=cwd or self.tmp,
                start_new_session=True,
            )
        node = Node(proc, log)
        self.nodes.append(node)
        return node

    def start_job(self, nnodes: int, nproc: int, script_args: list[str], *, flags: list[str] = (), env=None) -> list[Node]:
        """``nnodes`` agents on one c10d endpoint, started together."""
        endpoint = f"127.0.0.1:{free_port()}"
        common = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-endpoint", endpoint,
                  "--run-id", self.mark, "--monitor-interval", "0.05", *flags]
        return [self.start([*common, *script_args], env=env) for _ in range(nnodes)]

    def wait(self, nodes: list[Node] | None = None, timeout: float = JOB_DEADLINE) -> list[int]:
        deadline = time.monotonic() + timeout
        for node in nodes or self.nodes:
            try:
                node.code = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"ftrun did not finish within {timeout}s:\n" + "\n".join(n.output for n in self.nodes))
        return [n.code for n in (nodes or self.nodes)]

    def results(self) -> dict[int, dict]:
        return {int(p.stem[4:]): json.loads(p.read_text()) for p in self.out_dir.glob("rank*.json")}

    def output(self) -> str:
        return "\n".join(f"--- node {i} ---\n{n.output}" for i, n in enumerate(self.nodes))

    def kill_all(self) -> None:
        for proc in marked_processes(self.mark):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


class FakeClock:
    """A monotonic clock that moves only when the test moves it: what unit tests give code that times
    something, so that they depend on no wall time."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def step_reached(out_dir: Path, rank: int) -> int:
    """The steps a rank of ``tests/workers/elastic_train.py`` has finished (0 before its first): one read of
    the progress file, which the worker replaces whole after each step."""
    try:
        return int((out_dir / f"progress-rank{rank}").read_text())
    except FileNotFoundError:
        return 0


def unique_mark(name: str) -> str:
    """A process mark of this run alone: ``kill_all`` and the leftover check reach no other run's processes
    (another checkout's suite on the same machine, say), as a fixed mark would."""
    return f"{name}-{uuid.uuid4().hex}"


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


#: the job of the tests that lose a node under ``tests/workers/elastic_train.py``, and its steps
ELASTIC_NODES, ELASTIC_NPROC, ELASTIC_STEPS = 2, 2, 40


@pytest.fixture(scope="session")
def fault_free(tmp_path_factory):
    """That job under the c10d store, without a fault: every rank's digest (run once for the session: the
    etcd tests, direct and over ssh, compare with it)."""
    runner = Launcher(tmp_path_factory.mktemp("fault-free"), unique_mark("fault-free"))
    # the 4 ranks on one agent, forked from its warm interpreter, no step sleep: the digests depend on neither,
    # and the run starts faster
    runner.start_job(1, ELASTIC_NODES * ELASTIC_NPROC, [str(WORKERS / "elastic_train.py")],
                     flags=["--recovery", "process"],
                     env=runner.env(STEPS=str(ELASTIC_STEPS), STEP_SLEEP="0"))
    assert runner.wait() == [0], runner.output()
    return {rank: r["digest"] for rank, r in runner.results().items()}


@pytest.fixture
def launcher(tmp_path, request):
    """Agents started through it are checked for leftovers: no process may outlive the test."""
    runner = Launcher(tmp_path, unique_mark("test"), warm=request.node.get_closest_marker("fresh_interpreters") is None)
    yield runner
    for node in runner.nodes:
        if node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
    leftovers = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leftovers = marked_processes(runner.mark)
        if not leftovers:
            break
        time.sleep(0.1)
    runner.kill_all()
    assert not leftovers, f"processes left behind: {[p.info if hasattr(p, 'info') else p.pid for p in leftovers]}"


@pytest.fixture
def ftrun_cli(tmp_path):
    """Run ``ftrun`` to completion with a deadline: (exit code, stdout, stderr)."""

    def run(*args: str, env: dict | None = None, timeout: float = 60):
        proc = subprocess.run(
            [sys.executable, "-m", "ftrun", *args], capture_output=True, text=True, timeout=timeout,
            env=dict(os.environ, **(env or {})), cwd=tmp_path,
        )
        return proc.returncode, proc.stdout, proc.stderr

    return run


@pytest.fixture
def fake_npu(tmp_path, monkeypatch):
    """Point PATH at the stand-in npu-smi; returns a function that writes its state and builds a backend."""
    # this interpreter's folder next: its python3 answers `#!/usr/bin/env python3` without a version shim
    path = [str(ROOT / "tests" / "fakes"), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    state_file = tmp_path / "npu-smi.json"
    monkeypatch.setenv("NPU_SMI_STATE", str(state_file))

    def make(board: str, npus: list[dict], timeout: float = 5, **extra) -> NpuBackend:
        state_file.write_text(json.dumps({"board": board, "npus": npus, "mode": "normal", "version": "24.1.0",
                                          **extra}))
        return NpuBackend(DeviceOptions(timeout=timeout, hccn_tool="hccn_tool_absent_in_tests"))

    make.state_file = state_file
    return make


# -- the order in which scripts/test.sh's two workers take the files ----------------------------------------

#: The files that take longest, longest first (pytest -n 0 --durations=0, one file at a time). scripts/test.sh
#: hands whole files to 2 workers as they come free (--dist loadfile, --no-loadscope-reorder): xdist's own order,
#: by number of tests, left the slowest files (the HA file, 4 tests; the chaos run, 1) to the end, where one
#: worker ran them for minutes after the other had none left. Files not listed (seconds each, the unit tests)
#: follow in their own order and fill the gaps. The MindSpore and framework files wait, if need be, for the
#: installs that scripts/test.sh starts beside the first tests.
SLOWEST_FIRST = (
    "integration/test_high_availability.py",
    "integration/test_ssh.py",
    "chaos/test_chaos.py",
    "integration/test_layouts.py",
    "integration/test_etcd_outage.py",
    "integration/test_snapshots.py",
    "integration/test_spares.py",
    "integration/test_detection.py",
    "integration/test_dark_link.py",
    "integration/test_process_repair.py",
    "integration/test_mindspore.py",
    "integration/test_job_restart.py",
    "integration/test_frameworks.py",
    "integration/test_bad_input.py",
    "integration/test_lifecycle.py",
    "integration/test_control_plane_sim.py",
    "integration/test_top_view.py",
    "integration/test_torchrun_flags.py",
    "integration/test_status_view.py",
)


def pytest_collection_modifyitems(config, items):
    place = {name: index for index, name in enumerate(SLOWEST_FIRST)}

    def file_place(item) -> int:
        path = Path(str(item.fspath)).relative_to(ROOT / "tests").as_posix()
        return place.get(path, len(place))

    items.sort(key=file_place)  # stable: each file's tests keep their order, as do the files not listed


# The suite's in-process TCPStores (servers and clients, some left mid-handshake by the connect
# deadline tests) run threads inside libtorch; once in a while one of them meets the interpreter's
# shutdown and std::terminate turns a passed run into exit status 134. Every result is reported by
# then, so the session leaves with its own status without running that shutdown.
_exit_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _exit_status:
        config.get_terminal_writer().flush()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            stream.flush()
        os._exit(_exit_status[0])


@pytest.fixture
def etcd(tmp_path):
    """A 3-member etcd cluster of the test's own on loopback (``tests/etcd.py``)."""
    from tests.etcd import start_cluster

    cluster = start_cluster(tmp_path / "etcd")
    yield cluster
    # its data goes with the test: no graceful leave (a member whose peers are gone waited 5 s for them)
    cluster.stop(graceful=False)


# -- control stores that a test kills as a lost node would go ---------------------------------------------

#: a child process that hosts a TCPStore on loopback and prints its port
HOST_STORE = """
import sys, time
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""


class StoreHost:
    """A store hosted in a child process, started at once; its endpoint is read when first asked for, so
    that several children import torch side by side."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOST_STORE], stdout=subprocess.PIPE, text=True)
        self._endpoint: Endpoint | None = None

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            self._endpoint = Endpoint("127.0.0.1", int(self.process.stdout.readline()))
        return self._endpoint

    def kill(self) -> None:
        """As its node is lost."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def host_store():
    """Start a store in a child process (a StoreHost). Every child is killed and reaped."""
    hosts: list[StoreHost] = []

    def start() -> StoreHost:
        hosts.append(StoreHost())
        return hosts[-1]

    yield start
    for host in hosts:
        host.process.kill()
        host.process.wait()
        host.process.stdout.close()


def name_store(file: Path, endpoint: Endpoint) -> None:
    """What the agent does: the file's whole content, replaced atomically."""
    temporary = file.with_name(file.name + ".tmp")
    temporary.write_text(str(endpoint))
    os.replace(temporary, file)
