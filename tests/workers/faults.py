"""Fault injection shared by the test workers: FAULT=rank:step:kind[,rank:step:kind...]."""

import ctypes
import os
import signal
import sys
import time


def due(rank: int, step: int) -> str:
    """The kind of fault this rank must suffer at this step, or ""."""
    for spec in filter(None, os.environ.get("FAULT", "").split(",")):
        fault_rank, fault_step, kind = spec.split(":")
        if int(fault_rank) == rank and int(fault_step) == step:
            return kind
    return ""


def ignore_stops() -> None:
    """From now on this rank goes on to its fault whatever a peer's fault makes its agent do: ranks due to
    fail at the same step fail together, however late one of them gets there (on a loaded machine, a
    peer's failure reached this rank's agent and stopped it before it came to its own at times)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def fire_together(rank: int, step: int, kind: str) -> None:
    """``trigger``, so that ranks due to fail at the same step all fail of their own faults and have them
    reported: each says it fires (OUT_DIR/firing-rank<r>-step<s>, holding its pid), and a SIGKILL waits
    (up to 10 s) until the other kinds' processes are gone, reaped by their agents, which report them
    as they reap them. A peer's death brings its agent's STOP, during which an agent reports a rank
    killed by SIGKILL but not one that died of another fault of its own: a rank that said it fired
    could still be dying when the STOP came (a segfault's dump takes a while on a loaded machine)."""
    out_dir = os.environ["OUT_DIR"]
    specs = [spec.split(":") for spec in filter(None, os.environ.get("FAULT", "").split(","))]
    others = [int(r) for r, s, k in specs if int(s) == step and int(r) != rank and k != "sigkill"]
    if kind == "sigkill":
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_reaped(out_dir, other, step) for other in others):
            time.sleep(0.005)
    with open(os.path.join(out_dir, f"firing-rank{rank}-step{step}"), "w") as f:
        f.write(str(os.getpid()))
    trigger(kind, step)


def _reaped(out_dir: str, rank: int, step: int) -> bool:
    """Whether ``rank`` said it fires at ``step`` and its process is gone (its agent reaped it)."""
    try:
        with open(os.path.join(out_dir, f"firing-rank{rank}-step{step}")) as f:
            pid = f.read()
    except FileNotFoundError:
        return False
    return bool(pid) and not os.path.exists(f"/proc/{pid}")


def claim(rank: int, step: int, kind: str) -> bool:
    """FAULT_ONCE=1: True the first time this rank's fault at this step is due in the whole job (in
    any generation, in any process), recorded as OUT_DIR/fault-fired-rank<r>-step<s> holding the kind;
    a job-level restart that runs the step again does not fire it again."""
    path = os.path.join(os.environ["OUT_DIR"], f"fault-fired-rank{rank}-step{step}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(kind)
    return True


def trigger(kind: str, step: int) -> None:
    """sigkill, exit1, segv, sigstop (a hang), ecc (dies printing torch_npu's HBM ECC error), or raise
    (a Python exception, recorded by torch's @record)."""
    print(f"injecting {kind} at step {step}", file=sys.stderr, flush=True)
    if kind == "sigstop":
        out_dir = os.environ.get("OUT_DIR")
        if out_dir:  # when it stopped, for the detection latency
            with open(os.path.join(out_dir, f"stopped-{os.getpid()}"), "w") as f:
                f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "ecc":
        print("RuntimeError: ACL stream synchronize failed, error code is 507054\n"
              "[ERROR] HBM MULTI BIT ECC ERROR happened on device", file=sys.stderr, flush=True)
        os._exit(1)
    elif kind == "exit1":
        sys.stderr.flush()
        os._exit(1)
    elif kind == "segv":
        ctypes.string_at(0)
    elif kind == "raise":
        raise ValueError(f"injected failure at step {step}")
