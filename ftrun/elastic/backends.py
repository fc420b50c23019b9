"""The seam between the repair and each communication backend.

A repair has to release ranks blocked in a collective and tear the old group
down before the next generation's group forms. How depends on the backend:

* gloo (CPU): a peer's death breaks its sockets, so collectives waiting on it raise.
  A rank waiting on a healthy peer is released by shutting its own group sockets
  down (gloo closes them only when the last reference to the group goes, which
  C++ may hold on to), then the real groups are dropped.
* nccl (CUDA): each communicator must be aborted (``ProcessGroup.abort``) or the
  kernels stay queued; then the real groups are dropped.
* hccl (Ascend, torch_npu): each real group's watchdog is paused, the device's tasks are
  stopped (``torch_npu.npu.stop_device``), the device restarted (``restart_device``), the
  watchdogs cleared and resumed, then the real groups are dropped.

Each backend also makes the real groups (``connect``) that ftrun's reconfigurable groups
(``ftrun/elastic/groups.py``) hand their collectives to: a ``ProcessGroup`` with the backend's
own implementation registered for its device, as ``init_process_group`` builds one.

Heavy imports (torch_npu) happen only inside the backend that needs them.
"""

from __future__ import annotations

import datetime
import enum
import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)


class Memory(enum.Enum):
    """What a fault did to this rank's device memory, as the device tells it after the release (Ascend's
    check of an on-chip memory UCE; ``torch_npu.npu.check_uce_in_memory``)."""

    #: untouched, or only memory a step uses for a while (its activations): the step is redone anyway
    INTACT = "intact"
    #: memory that holds the training state: this rank takes a healthy replica's state in the rollback
    STATE_LOST = "state lost"
    #: memory torch does not manage: nothing in place can vouch for it, the process is replaced
    UNKNOWN = "unknown"


class DeviceNotStopped(RuntimeError):
    """The device's tasks could not be stopped for a repair (Ascend's ``stop_device`` failed): whatever
    this rank waits in may never end, and nothing in the process can make the device usable again."""


class CommBackend:
    """gloo: nothing to abort, dropping the real groups is enough.

    gloo carries CUDA tensors too (through host memory), as ``init_process_group("gloo")`` does: where
    CUDA is present the real group serves both device types, so a model on a GPU trains over gloo.
    """

    name = "gloo"
    #: the torch device type whose tensors the real groups carry
    device_type = "cpu"
    #: a guarded collective's wait goes in slices, to give up a work that a cut link left waiting (gloo's
    #: waits out its timeout). Not NCCL's or HCCL's: their wait with a timeout holds the CPU until the
    #: kernel ends, where a plain one only orders the streams; an abort of the communicator frees them
    sliced_waits = True

    def __init__(self, dist=None, local_rank: int = 0):
        if dist is None:
            import torch.distributed as dist
        self.dist = dist
        self.local_rank = local_rank
        #: every real group's connections to its peers: what interrupt() cuts
        self._group_fds: set[int] = set()
        #: the real groups connected since the last release
        self._live: list = []
        #: what the last fault did to the device's memory, known after release()
        self.memory = Memory.INTACT

    def device(self):
        import torch

        return torch.device("cpu")

    def devices(self) -> tuple[str, ...]:
        """The device types the ftrun backend serves (CPU tensors always: scripts gather objects on it)."""
        return tuple(dict.fromkeys((self.device_type, "cpu", *self._extra_devices())))

    def _extra_devices(self) -> tuple[str, ...]:
        """Device types the real group also carries beyond its own (gloo: CUDA's, where CUDA is present)."""
        return ("cuda",) if _cuda_present() else ()

    def connect(self, store, rank: int, size: int, timeout: float, global_ranks: tuple[int, ...], name: str):
        """A real group of this backend over ``store`` (a generation's and a group's own prefix), for the
        members ``global_ranks`` and named ``name``, which no other group of any generation shares."""
        before = _socket_fds()
        real = self._real_group(store, rank, size, datetime.timedelta(seconds=timeout), global_ranks, name)
        self._group_fds |= _socket_fds() - before
        self._live.append(real)
        return real

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: tuple[int, ...],
                    name: str):
        import torch

        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.GLOO
        group._set_default_backend(kind)
        gloo = self.dist.ProcessGroupGloo(store, rank, size, timeout)
        for device_type in ("cpu", *self._extra_devices()):
            group._register_backend(torch.device(device_type), kind, gloo)
        return group

    def interrupt(self) -> None:
        """Release this rank's main thread from a collective that waits on a healthy peer.

        Called from another thread once a repair is announced. The collective then raises,
        and the step's ``with`` block hands the rank over to the repair.
        """
        for fd in self._group_fds:
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # gloo aborts if its listener goes
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        self._group_fds = set()

    def release(self, groups: list) -> None:
        """Unblock this rank's collectives in ``groups`` (the real groups a repair drops).

        gloo closes a group's sockets, which releases peers blocked on this rank, once the last
        reference to it goes: the caller drops them (``GroupSet.release``).
        """
        self._group_fds = set()
        self._live = []


class NcclBackend(CommBackend):
    name = "nccl"
    device_type = "cuda"
    sliced_waits = False

    def _extra_devices(self) -> tuple[str, ...]:
        return ()

    def device(self):
        import torch

        return torch.device("cuda", self.local_rank)

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: tuple[int, ...],
                    name: str):
        import torch

        options = self.dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.NCCL
        group._set_default_backend(kind)
        group._register_backend(torch.device("cuda"), kind, self.dist.ProcessGroupNCCL(store, rank, size, options))
        return group

    def interrupt(self) -> None:
        _abort_all(self._live)  # aborting a communicator releases the kernels waiting in it

    def release(self, groups: list) -> None:
        _abort_all(groups)
        self._live = []


#: the longest a repair waits for its NCCL communicators to abort
ABORT_DEADLINE = 60.0


def _abort_all(groups: list) -> None:
    """Abort every group's communicators at once: one abort takes about a second whatever the
    communicator's size (1.05 s on an H100 and an H200, torch 2.11, NCCL 2.28, with or without torch's
    NCCL monitoring), so one after another a repair would wait a second for each group of the mesh."""
    threads = [threading.Thread(target=_abort, args=(group,), name=f"ftrun-nccl-abort-{i}", daemon=True)
               for i, group in enumerate(groups)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + ABORT_DEADLINE
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
    if stuck:
        log.warning("%d NCCL communicators still aborting after %gs; the repair goes on without them", stuck, ABORT_DEADLINE)


def _abort(group) -> None:
    try:
        group.abort()
    except Exception as e:  # a communicator already aborted, or broken by the fault
        log.debug("aborting an NCCL communicator: %s", e)



#: torch_npu's watchdog states (``set_watchdog_status``): a paused watchdog looks at nothing
WATCHDOG_RUN, WATCHDOG_STOP = 1, 2


class HcclBackend(CommBackend):
    """torch_npu's HCCL groups, each with a watchdog thread of its own.

    torch_npu's ``stop_device``/``restart_device`` pause and resume only the watchdogs of groups in
    torch's group map, where ftrun's real groups are not: the backend pauses its own around the device's
    stop (a running watchdog that meets the stopped tasks sets a process-wide flag that fails the next
    generation's first collective with "FORCE STOP."), then clears their work and resumes them, which
    clears that flag. Each real group is given its members' global ranks and a name of its own: with
    none, torch_npu takes a group for the world and, where RANK_TABLE_FILE is set, builds it as the
    table's whole world at the group's own rank.
    """

    name = "hccl"
    device_type = "npu"
    sliced_waits = False

    def _extra_devices(self) -> tuple[str, ...]:
        return ()

    def device(self):
        import torch

        return torch.device("npu", self.local_rank)

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: tuple[int, ...],
                    name: str):
        import torch
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        options.global_ranks_in_group = list(global_ranks)
        options.group_id = name
        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.CUSTOM
        group._set_default_backend(kind)
        group._register_backend(torch.device("npu"), kind, ProcessGroupHCCL(store, rank, size, options))
        return group

    def interrupt(self) -> None:
        import torch_npu

        _set_watchdogs(self._live, WATCHDOG_STOP)
        self._stop_device(torch_npu)  # aborts the device's tasks: the collective waited in returns

    def release(self, groups: list) -> None:
        import torch_npu

        # the device's tasks stop and its resources are rebuilt once for every group on it; in between, the
        # device says whether an on-chip memory fault (UCE) hit memory the training state lives in
        _set_watchdogs(groups, WATCHDOG_STOP)
        self._stop_device(torch_npu)
        self.memory = _uce_memory(torch_npu, self.local_rank)
        torch_npu.npu.restart_device(self.local_rank, rebuild_all_resources=False)
        _set_watchdogs(groups, WATCHDOG_RUN)
        self._live = []

    def _stop_device(self, torch_npu) -> None:
        result = torch_npu.npu.stop_device(self.local_rank)
        if result != 0:  # 1: the device's tasks were not aborted (aclrtDeviceTaskAbort failed)
            raise DeviceNotStopped(f"the device's tasks could not be stopped (torch_npu.npu.stop_device("
                                   f"{self.local_rank}) returned {result})")


def _set_watchdogs(groups: list, status: int) -> None:
    """Pause or resume the HCCL watchdog of each real group. A resumed one first forgets the works the
    stop aborted: it would query them and meet the stop's FORCE STOP again."""
    import torch

    for group in groups:
        hccl = group._get_backend(torch.device("npu"))
        if status == WATCHDOG_RUN:
            hccl.clear_workmeta_list()
        hccl.set_watchdog_status(status)


#: check_uce_in_memory's answers: 0 no UCE, 1 in memory torch_npu does not manage, 2 in its temporary
#: memory, 3 in its resident memory (torch_npu's API reference, "check_uce_in_memory")
UCE_MEMORY = {0: Memory.INTACT, 1: Memory.UNKNOWN, 2: Memory.INTACT, 3: Memory.STATE_LOST}


def _uce_memory(torch_npu, device: int) -> Memory:
    check = getattr(torch_npu.npu, "check_uce_in_memory", None)
    if check is None:  # a torch_npu without it: no UCE can be told apart, as before it existed
        return Memory.INTACT
    try:
        return UCE_MEMORY.get(int(check(device)), Memory.UNKNOWN)
    except Exception as e:  # PYTORCH_NO_NPU_MEMORY_CACHING=1 turns the check off
        log.warning("the device's memory could not be checked for a UCE (%s): its state is taken from a replica", e)
        return Memory.STATE_LOST


BACKENDS = {cls.name: cls for cls in (CommBackend, NcclBackend, HcclBackend)}


def make_comm_backend(name: str | None, local_rank: int = 0, dist=None) -> CommBackend:
    """The backend by torch's name; ``None`` picks nccl with CUDA, hccl with torch_npu, else gloo."""
    if name is None:
        name = _default_backend_name()
    try:
        return BACKENDS[name](dist=dist, local_rank=local_rank)
    except KeyError:
        raise ValueError(f"unknown backend '{name}': choose one of {', '.join(BACKENDS)}") from None


def _default_backend_name() -> str:
    import torch

    if hasattr(torch, "npu") and torch.npu.is_available():
        return "hccl"
    if torch.cuda.is_available():
        return "nccl"
    return "gloo"


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds
