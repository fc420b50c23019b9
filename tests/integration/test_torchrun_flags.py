"""torchrun 2.13's flags that change what workers see, in one small job: --numa-binding (against a
stand-in npu-smi topology), --virtual-local-rank, --duplicate-stdout-filters and --signals-to-handle."""

from __future__ import annotations

import json
import re
import os
import signal
import sys

import pytest

from tests.conftest import ROOT, Launcher, wait_for

pytestmark = pytest.mark.integration
FAKES = ROOT / "tests" / "fakes"

#: prints what it was given, one line kept by the filter and one not, then waits for SIGUSR1
WORKER = """\
import json, os, signal, sys, time
rank = os.environ["RANK"]
seen = {"cpus": sorted(os.sched_getaffinity(0)), "local_rank": os.environ["LOCAL_RANK"],
        "visible": os.environ.get("ASCEND_RT_VISIBLE_DEVICES"), "index": os.environ.get("FTRUN_DEVICE_INDEX")}
print("KEEP " + json.dumps(seen), flush=True)
print("drop this line", flush=True)

def on_usr1(signum, frame):
    print(f"rank {rank} got SIGUSR1", flush=True)
    sys.exit(0)

signal.signal(signal.SIGUSR1, on_usr1)
time.sleep(120)
"""


def test_numa_binding_virtual_local_rank_filters_and_a_forwarded_signal(launcher: Launcher, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell the devices' CPUs apart")
    # the stand-in topology: NPU 0 near the first CPU this test may use, NPU 1 near the others
    near = {0: cpus[:1], 1: cpus[1:]}
    state = tmp_path / "npu-smi.json"
    state.write_text(json.dumps({"board": "A2", "mode": "normal", "npus": [
        {"id": i, "name": "910B2", "cpu_affinity": ",".join(map(str, near[i])),
         "chips": [{"id": 0, "logic_id": i, "health": "OK", "codes": [], "info": []}]} for i in (0, 1)]}))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = launcher.env(NPU_SMI_STATE=str(state))
    env["PATH"] = os.pathsep.join([str(FAKES), os.path.dirname(sys.executable), env["PATH"]])
    logs = tmp_path / "logs"
    node = launcher.start(["--standalone", "--nproc-per-node", "2", "--run-id", "flags", "--device", "npu",
                           "--numa-binding", "node", "--virtual-local-rank", "--warm-standby", "1",
                           "--signals-to-handle", "SIGTERM,SIGINT,SIGUSR1", "--log-dir", str(logs),
                           "--duplicate-stdout-filters", "KEEP", "--monitor-interval", "0.05", str(script)], env=env)
    filtered = logs / "flags" / "node0" / "attempt_0" / "filtered_stdout.log"
    wait_for(lambda: filtered.exists() and filtered.read_text().count("KEEP") == 2, timeout=120,
             what=f"both ranks' lines in {filtered}")
    node.proc.send_signal(signal.SIGUSR1)
    code = launcher.wait([node])[0]

    assert code == 143, node.output  # stopped by a signal other than SIGINT: TERMINATED
    lines = filtered.read_text().splitlines()
    assert all(line.startswith(("[rank 0]: KEEP ", "[rank 1]: KEEP ")) for line in lines), lines
    seen = {int(line[6]): json.loads(line.split("KEEP ", 1)[1]) for line in lines}
    for rank in (0, 1):
        assert seen[rank] == {"cpus": near[rank], "local_rank": "0", "visible": str(rank), "index": "0"}
        assert f"rank {rank} got SIGUSR1" in node.output


#: prints its MASTER_PORT, then waits for the test to look at the job's sockets
WAITER = """\
import os, time
print("MASTER_PORT=" + os.environ["MASTER_PORT"], flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["GO_FILE"]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def four_free_ports() -> range:
    import random
    import socket

    for _ in range(100):
        low = random.randrange(20000, 60000)
        try:
            for port in range(low, low + 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return range(low, low + 4)
    pytest.skip("no four free ports in a row")


def listening_ports(pid: int) -> set[int]:
    import psutil

    found = set()
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            found |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return found


def test_static_rendezvous_gives_workers_the_master_port_and_ftrun_listens_only_in_the_range(launcher, tmp_path):
    from tests.conftest import free_port

    master_port, ports = free_port(), four_free_ports()
    script, go = tmp_path / "waiter.py", tmp_path / "go"
    script.write_text(WAITER)
    node = launcher.start(["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                           "--worker-port-range", f"{ports.start}-{ports.stop - 1}", "--snapshot-every", "5",
                           "--snapshot-memory", "64M", "--warm-standby", "1", "--status", "off", str(script)],
                          env=launcher.env(GO_FILE=str(go)))
    wait_for(lambda: node.output.count("MASTER_PORT=") == 2, timeout=120, what="both workers' MASTER_PORT")
    listening = listening_ports(node.proc.pid)
    go.write_text("")
    assert launcher.wait([node]) == [0], node.output

    assert node.output.count(f"MASTER_PORT={master_port}\n") == 2, node.output
    assert master_port in listening  # each generation's worker store
    assert len(listening & set(ports)) == 2, listening  # the control store and the snapshot server
    assert listening <= {master_port, *ports}, listening


def test_torchrun_log_layout_writes_torchrun_s_folders_and_prefixes(launcher, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'], flush=True)\n")
    logs = tmp_path / "logs"
    node = launcher.start(["--standalone", "--nproc-per-node", "2", "--run-id", "shapes", "--log-dir", str(logs),
                           "--log-layout", "torchrun", "--tee", "3", "--local-ranks-filter", "1", "--role", "trainer",
                           "--warm-standby", "0", "--status", "off", str(script)])
    assert launcher.wait([node]) == [0], node.output

    runs = [p.name for p in logs.iterdir()]  # one folder per run, as torchrun's, and nothing beside it
    assert len(runs) == 1 and re.fullmatch(r"shapes_\w{8}", runs[0]), runs
    events = logs / runs[0] / "events.jsonl"  # the event log in it, beside attempt_0/
    assert "job_finished" in [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert sorted(p.name for p in (logs / runs[0]).iterdir()) == ["attempt_0", "events.jsonl", "ranktable.json"]
    for local_rank in (0, 1):
        folder = logs / runs[0] / "attempt_0" / str(local_rank)
        assert (folder / "stdout.log").read_text() == f"hello from {local_rank}\n"
        assert (folder / "stderr.log").exists()
    assert "[trainer1]:hello from 1\n" in node.output
    assert "hello from 0" not in node.output  # --local-ranks-filter 1
