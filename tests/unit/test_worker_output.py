"""What the agent's relay of a worker's output shows: on the console, in its log file, in its tail."""

from __future__ import annotations

import io
import os
import time

from ftrun.agent.output import StreamPump
from ftrun.detection.exits import classify_exit
from ftrun.detection.table import load_fault_table

# the stderr of a TCPStore client whose server was killed while it waited in store.get (torch 2.13, CPU),
# frames #3 to #8 and #19 to #20 cut out and the library folder shortened
STORE_LOST = """\
[W1127 22:14:02.451523951 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3, addr=[::ffff:127.0.0.1]:42592, remote=[::ffff:127.0.0.1]:29871): Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7f34b4d94b8d in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)
frame #1: c10::DistError::DistError(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x72 (0x7f34b4d95b62 in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)
frame #2: c10::DistNetworkError::DistNetworkError(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x72 (0x7f34b4d96022 in /venv/lib/python3.11/site-packages/torch/lib/libc10.so)
frame #9: <unknown function> + 0x3d2825 (0x7f34b37d2825 in /venv/lib/python3.11/site-packages/torch/lib/libtorch_python.so)
<omitting python frames>
frame #21: _start + 0x21 (0x555e40429081 in /venv/bin/python)

Traceback (most recent call last):
  File "/tmp/trace/client.py", line 6, in <module>
    store.get("never")
torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
"""
WARNING, *_ = STORE_LOST.splitlines()
PYTHON_EXCEPTION = STORE_LOST.splitlines()[-4:]


def relay(text: str, file_path: str | None = None, prefix: bytes = b"[rank 1]: ") -> tuple[list[str], StreamPump]:
    """``text`` through a rank's stderr pump, as its worker would write it: the console's lines and the pump."""
    read_end, write_end = os.pipe()
    console = io.BytesIO()
    pump = StreamPump(os.fdopen(read_end, "rb"), "ftrun-test-stderr", console, prefix, file_path)
    with os.fdopen(write_end, "wb") as worker:
        worker.write(text.encode())
    pump.drain(5.0)
    return console.getvalue().decode().splitlines(), pump


def test_a_lost_store_s_cpp_trace_is_one_console_line_that_names_the_log_file(tmp_path):
    log = tmp_path / "stderr.log"
    shown, _ = relay(STORE_LOST, str(log))
    assert shown == [f"[rank 1]: {WARNING}", f"[rank 1]: (C++ stack trace left out; it is in {log})", "[rank 1]: ",
                     *(f"[rank 1]: {line}" for line in PYTHON_EXCEPTION)]
    assert log.read_text() == STORE_LOST


def test_without_a_log_file_the_console_line_names_none():
    shown, _ = relay(STORE_LOST, prefix=b"")
    assert shown[1] == "(C++ stack trace left out)"


def test_each_trace_is_one_line():
    shown, _ = relay(STORE_LOST + STORE_LOST)
    assert sum("C++ stack trace left out" in line for line in shown) == 2


def test_the_line_comes_when_the_trace_starts_not_at_the_next_output():
    # a rank that survives the error may print nothing more for a while
    read_end, write_end = os.pipe()
    console = io.BytesIO()
    pump = StreamPump(os.fdopen(read_end, "rb"), "ftrun-test-stderr", console, b"[rank 1]: ", None)
    with os.fdopen(write_end, "wb") as worker:
        worker.write("\n".join(STORE_LOST.splitlines()[:4]).encode() + b"\n")
        worker.flush()
        deadline = time.monotonic() + 5.0
        while b"left out" not in console.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert console.getvalue().decode().splitlines() == [f"[rank 1]: {WARNING}", "[rank 1]: (C++ stack trace left out)"]
    pump.drain(5.0)


def test_the_tail_ends_with_the_python_exception_not_with_frames():
    _, pump = relay(STORE_LOST)
    assert list(pump.tail) == [WARNING, "", *PYTHON_EXCEPTION]
    assert pump.lines == len(STORE_LOST.splitlines())  # every line is still a sign of life


def test_a_frame_address_that_looks_like_a_device_error_code_is_no_evidence():
    # 507054 is an Ascend HBM ECC code (RestartNPU) and matches in "0x507054"; the exception is the evidence
    frame = ("frame #3: <unknown function> + 0x507054 (0x7f34a4f4888d in "
             "/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so)\n")
    _, pump = relay(STORE_LOST.replace("<omitting python frames>\n", frame))
    fault = classify_exit(1, tuple(pump.tail), "", load_fault_table())
    assert (fault.kind, fault.detail) == ("exception", "Python exception torch.distributed.DistNetworkError: Failed to "
                                          "recv, got 0 bytes. Connection was likely closed. Did the remote server "
                                          "shutdown or crash?")
