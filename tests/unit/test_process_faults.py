"""Why a worker ended (pure, over its evidence), and the OOM evidence from fake cgroup files."""

from __future__ import annotations

import signal
import stat

import pytest

from ftrun.detection.exits import ProcessFault, classify_exit, is_cpp_trace_line
from ftrun.detection.oom import OomWatch
from ftrun.detection.table import FaultLevel, load_fault_table

TABLE = load_fault_table()
SIGKILL = -signal.SIGKILL

TRACEBACK = (
    "step 2 loss 0.91",
    "Traceback (most recent call last):",
    '  File "train.py", line 40, in <module>',
    "    main()",
    '  File "train.py", line 31, in main',
    '    raise ValueError(f"injected failure at step {step}")',
    "ValueError: injected failure at step 3",
)
RANK_PREFIXED = tuple(f"[rank1]: {line}" for line in TRACEBACK[1:])
CHAINED = (
    "Traceback (most recent call last):",
    '  File "train.py", line 5, in <module>',
    "KeyError: 'lr'",
    "",
    "During handling of the above exception, another exception occurred:",
    "",
    "Traceback (most recent call last):",
    '  File "train.py", line 7, in <module>',
    "    ^^^^^^^^^^",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
)
UCE = ("step 7", "[ERROR] UCE ERROR on device 1", "RuntimeError: ACL stream synchronize failed, error code:507053")


@pytest.mark.parametrize("case, args, expected", [
    ("plain exit code",
     dict(returncode=3), ProcessFault("exit", "exited with code 3")),
    ("clean exit",
     dict(returncode=0), ProcessFault("exit", "exited with code 0")),
    ("unknown status",
     dict(returncode=None), ProcessFault("exit", "ended with an unknown exit status")),
    ("a shell's report of a killed child",
     dict(returncode=137), ProcessFault("exit", "exited with code 137 (128 + SIGKILL, as a shell reports it)")),
    ("signal",
     dict(returncode=-signal.SIGSEGV), ProcessFault("signal", "killed by SIGSEGV")),
    ("signal beats exit code: SIGKILL without OOM evidence",
     dict(returncode=SIGKILL, oom=""), ProcessFault("signal", "killed by SIGKILL")),
    ("exception from the traceback beats the exit code",
     dict(returncode=1, stderr_tail=TRACEBACK),
     ProcessFault("exception", "Python exception ValueError: injected failure at step 3")),
    ("torch's [rankN]: prefixes are ignored",
     dict(returncode=1, stderr_tail=RANK_PREFIXED),
     ProcessFault("exception", "Python exception ValueError: injected failure at step 3")),
    ("the last of chained exceptions",
     dict(returncode=1, stderr_tail=CHAINED),
     ProcessFault("exception", "Python exception torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")),
    ("traceback header cut off by the tail",
     dict(returncode=1, stderr_tail=("    x = y[0]", "IndexError: list index out of range", "W1123 cleanup done")),
     ProcessFault("exception", "Python exception IndexError: list index out of range")),
    ("an exception with no message",
     dict(returncode=1, stderr_tail=("Traceback (most recent call last):", '  File "t.py", line 1', "KeyboardInterrupt")),
     ProcessFault("exception", "Python exception KeyboardInterrupt")),
    ("the recorded error beats stderr",
     dict(returncode=1, stderr_tail=TRACEBACK, error="RuntimeError: from the error file"),
     ProcessFault("exception", "Python exception RuntimeError: from the error file")),
    ("a recorded error without a type",
     dict(returncode=1, error="something went wrong"),
     ProcessFault("exception", "Python exception (no type recorded): something went wrong")),
    ("exception beats signal",
     dict(returncode=-signal.SIGABRT, stderr_tail=TRACEBACK),
     ProcessFault("exception", "Python exception ValueError: injected failure at step 3")),
    ("OOM beats exception",
     dict(returncode=SIGKILL, stderr_tail=TRACEBACK, oom="cgroup memory.events oom_kill rose from 0 to 1"),
     ProcessFault("oom", "killed by SIGKILL: the kernel's OOM killer (cgroup memory.events oom_kill rose from 0 to 1)")),
    ("OOM as a plain flag",
     dict(returncode=SIGKILL, oom=True), ProcessFault("oom", "killed by SIGKILL: the kernel's OOM killer")),
    ("OOM evidence does not explain a worker that was not SIGKILLed",
     dict(returncode=1, oom="cgroup memory.events oom_kill rose from 0 to 1"),
     ProcessFault("exit", "exited with code 1")),
    ("device error beats OOM and exception",
     dict(returncode=SIGKILL, stderr_tail=(*TRACEBACK, *UCE), oom=True),
     ProcessFault("device", "device error in its last output: UCE ERROR (RestartBusiness)",
                  FaultLevel.RESTART_BUSINESS)),
    ("device error in the recorded error",
     dict(returncode=1, error="RuntimeError: HBM MULTI BIT ECC ERROR"),
     ProcessFault("device", "device error in its last output: HBM MULTI BIT ECC ERROR (RestartNPU)",
                  FaultLevel.RESTART_NPU)),
    ("a peer's NCCL error",
     dict(returncode=1, stderr_tail=("torch.distributed.DistBackendError: NCCL error: ncclRemoteError",)),
     ProcessFault("device", "device error in its last output: ncclRemoteError (RestartRequest)",
                  FaultLevel.RESTART_REQUEST)),
    ("an informational match does not explain the death",
     dict(returncode=1, stderr_tail=("NCCL WARN socket timeout", *TRACEBACK)),
     ProcessFault("exception", "Python exception ValueError: injected failure at step 3")),
    ("a setting the rank cannot work with (ftrun.elastic's status 78)",
     dict(returncode=78, stderr_tail=("ftrun.elastic: rank 0's snapshot takes 1.0 MiB, but its share is 4.0 KiB", "")),
     ProcessFault("setting", "exited with code 78, a setting it cannot work with: ftrun.elastic: rank 0's snapshot "
                             "takes 1.0 MiB, but its share is 4.0 KiB")),
    ("hang beats everything",
     dict(returncode=SIGKILL, stderr_tail=UCE, oom=True, hung=True),
     ProcessFault("hang", "made no progress and was stopped by the agent (killed by SIGKILL)")),
])
def test_classify_exit(case, args, expected):
    args = {"stderr_tail": (), "error": "", **args}
    assert classify_exit(table=TABLE, **args) == expected


def test_long_exception_message_is_shortened():
    fault = classify_exit(1, (), "ValueError: " + "x" * 500, TABLE)
    assert len(fault.detail) == len("Python exception ValueError: ") + 200 and fault.detail.endswith("...")


# -- C++ stack traces ----------------------------------------------------------------------------------
# lines from torch 2.13's traces (tests/unit/test_worker_output.py has one whole): a TCPStore client whose
# server was killed, then the same under init_process_group with TORCH_SHOW_CPP_STACKTRACES=1


@pytest.mark.parametrize("line, expected", [
    ("Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 "
     "(most recent call first):", True),
    ("frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, "
     "std::allocator<char> >) + 0x9d (0x7f34b4d94b8d in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)", True),
    ("frame #3: <unknown function> + 0x674888d (0x7f34a4f4888d in "
     "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so)", True),
    ("<omitting python frames>", True),
    ("frame #21: _start + 0x21 (0x555e40429081 in /venv/bin/python)", True),
    ("[rank1]: C++ CapturedTraceback:", True),
    ("[rank1]: #5 c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, "
     "std::allocator<char> >) from ??:0", True),
    ("#16 cfunction_vectorcall_FASTCALL_KEYWORDS from /tmp/python-build/Python-3.11.7/Objects/methodobject.c:443", True),
    ("#25 __libc_start_main from /lib/x86_64-linux-gnu/libc.so.6:160516", True),
    ("[rank1]: Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 "
     "(most recent call first):", True),
    # what tells the user why, and look-alikes
    ("[W1127 22:14:02.451523951 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3): Failed to "
     "recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?", False),
    ("[rank1]: torch.distributed.DistNetworkError: Failed to recv, got 0 bytes.", False),
    ("[rank1]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
     "by peer [127.0.0.1]:22674.", False),
    ("Traceback (most recent call last):", False),
    ('  File "/tmp/trace/client.py", line 6, in <module>', False),
    ("Thread 0x00007f3a (most recent call first):", False),  # faulthandler's dump of a hung rank
    ("step 3: frame #12 decoded", False),
    ("#1 best checkpoint so far", False),
    ("", False),
])
def test_is_cpp_trace_line(line, expected):
    assert is_cpp_trace_line(line) is expected


# -- OomWatch ---------------------------------------------------------------------------------------


def cgroup_v2(tmp_path, oom_kill: int, path="/job.slice/agent"):
    (tmp_path / "proc_cgroup").write_text(f"0::{path}\n")
    events = tmp_path / "cg" / path.lstrip("/") / "memory.events"
    events.parent.mkdir(parents=True, exist_ok=True)
    events.write_text(f"low 0\nhigh 0\nmax 4\noom 2\noom_kill {oom_kill}\noom_group_kill 0\n")
    return events


def watch(tmp_path, dmesg=None):
    return OomWatch(str(tmp_path / "proc_cgroup"), str(tmp_path / "cg"), dmesg=dmesg)


def test_oom_counter_rise_is_evidence_once_per_kill(tmp_path):
    events = cgroup_v2(tmp_path, oom_kill=2)
    w = watch(tmp_path)
    assert w.counter_file == str(events)
    assert w.killed_by_oom(100) == ""
    events.write_text("oom 3\noom_kill 3\n")
    assert w.killed_by_oom(100) == "cgroup memory.events oom_kill rose from 2 to 3"
    assert w.killed_by_oom(101) == ""  # one kill explains one worker


def test_oom_counter_unchanged_is_no_evidence(tmp_path):
    cgroup_v2(tmp_path, oom_kill=5)
    assert watch(tmp_path).killed_by_oom(100) == ""


def test_oom_counter_at_the_namespace_root(tmp_path):
    (tmp_path / "proc_cgroup").write_text("0::/\n")
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.events").write_text("oom_kill 0\n")
    w = watch(tmp_path)
    (tmp_path / "cg" / "memory.events").write_text("oom_kill 1\n")
    assert w.killed_by_oom(7) == "cgroup memory.events oom_kill rose from 0 to 1"


def test_oom_counter_of_cgroup_v1(tmp_path):
    (tmp_path / "proc_cgroup").write_text("9:pids:/\n4:memory:/process_api/abc\n0::/\n")
    control = tmp_path / "cg" / "memory" / "process_api" / "abc" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    w = watch(tmp_path)
    assert w.counter_file == str(control)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert w.killed_by_oom(7) == "cgroup memory.oom_control oom_kill rose from 0 to 2"


def test_missing_files_are_no_evidence_and_no_error(tmp_path):
    w = watch(tmp_path)
    assert w.counter_file is None
    assert w.killed_by_oom(100) == ""


def test_counter_file_vanishing_later_is_no_evidence(tmp_path):
    events = cgroup_v2(tmp_path, oom_kill=0)
    w = watch(tmp_path)
    events.unlink()
    assert w.killed_by_oom(100) == ""


def fake_dmesg(tmp_path, text: str, code: int = 0) -> str:
    (tmp_path / "kmsg.txt").write_text(text)
    script = tmp_path / "dmesg"
    script.write_text(f'#!/bin/sh\ncat "{tmp_path}/kmsg.txt"\nexit {code}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_dmesg_names_the_killed_pid(tmp_path):
    dmesg = fake_dmesg(tmp_path, "[ 1.0] eth0 up\n[ 9.1] Out of memory: Killed process 4242 (python) "
                                 "total-vm:9000kB\n[ 9.2] Killed process 42 (other)\n")
    w = watch(tmp_path, dmesg=[dmesg])
    assert w.killed_by_oom(4242) == "dmesg: [ 9.1] Out of memory: Killed process 4242 (python) total-vm:9000kB"
    assert w.killed_by_oom(424) == ""


def test_dmesg_not_permitted_is_skipped_from_then_on(tmp_path):
    dmesg = fake_dmesg(tmp_path, "dmesg: read kernel buffer failed: Operation not permitted\n", code=1)
    w = watch(tmp_path, dmesg=[dmesg])
    assert w.killed_by_oom(1) == ""
    (tmp_path / "dmesg").unlink()  # not run again: a missing program would not matter either
    assert w.killed_by_oom(1) == ""


def test_missing_dmesg_is_no_evidence(tmp_path):
    assert watch(tmp_path, dmesg=[str(tmp_path / "no-dmesg")]).killed_by_oom(1) == ""
