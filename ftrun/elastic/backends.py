"""The seam between the repair and each communication backend.

A repair has to release ranks blocked in a collective and tear the old group
down before the next generation's group forms. How depends on the backend:

* gloo (CPU): a peer's death breaks its sockets, so collectives waiting on it raise.
  A rank waiting on a healthy peer is released by shutting its own group sockets
  down (gloo closes them only when the last reference to the group goes, which
  C++ may hold on to), then the real groups are dropped.
* nccl (CUDA): each communicator must be aborted (``ProcessGroup.abort``) or the
  kernels stay queued; then the real groups are dropped.
* hccl (Ascend, torch_npu): the device's tasks are stopped
  (``torch_npu.npu.stop_device``), the device restarted
  (``restart_device``), then the real groups are dropped.

Each backend also makes the real groups (``connect``) that ftrun's reconfigurable groups
(``ftrun/elastic/groups.py``) hand their collectives to: a ``ProcessGroup`` with the backend's
own implementation registered for its device, as ``init_process_group`` builds one.

Heavy imports (torch_npu) happen only inside the backend that needs them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

log = logging.getLogger(__name__)


class CommBackend:
    """gloo: nothing to abort, dropping the real groups is enough."""

    name = "gloo"
    #: the torch device type whose tensors the real groups carry
    device_type = "cpu"

    def __init__(self, dist=None, local_rank: int = 0):
        if dist is None:
            import torch.distributed as dist
        self.dist = dist
        self.local_rank = local_rank
        #: every real group's connections to its peers: what interrupt() cuts
        self._group_fds: set[int] = set()
        #: the real groups connected since the last release
        self._live: list = []

    def device(self):
        import torch

        return torch.device("cpu")

    def devices(self) -> tuple[str, ...]:
        """The device types the ftrun backend serves (CPU tensors always: scripts gather objects on it)."""
        return tuple(dict.fromkeys((self.device_type, "cpu")))

    def connect(self, store, rank: int, size: int, timeout: float):
        """A real group of this backend over ``store`` (a generation's and a group's own prefix)."""
        before = _socket_fds()
        real = self._real_group(store, rank, size, datetime.timedelta(seconds=timeout))
        self._group_fds |= _socket_fds() - before
        self._live.append(real)
        return real

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta):
        import torch

        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.GLOO
        group._set_default_backend(kind)
        group._register_backend(torch.device("cpu"), kind, self.dist.ProcessGroupGloo(store, rank, size, timeout))
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

    def device(self):
        import torch

        return torch.device("cuda", self.local_rank)

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta):
        import torch

        options = self.dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.NCCL
        group._set_default_backend(kind)
        group._register_backend(torch.device("cuda"), kind, self.dist.ProcessGroupNCCL(store, rank, size, options))
        return group

    def interrupt(self) -> None:
        for group in self._live:  # aborting a communicator releases the kernels waiting in it
            self._abort(group)

    def release(self, groups: list) -> None:
        for group in groups:
            self._abort(group)
        self._live = []

    @staticmethod
    def _abort(group) -> None:
        try:
            group.abort()
        except Exception as e:  # a communicator already aborted, or broken by the fault
            log.debug("aborting an NCCL communicator: %s", e)



class HcclBackend(CommBackend):
    name = "hccl"
    device_type = "npu"

    def device(self):
        import torch

        return torch.device("npu", self.local_rank)

    def _real_group(self, store, rank: int, size: int, timeout: datetime.timedelta):
        import torch
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        group = self.dist.ProcessGroup(store, rank, size)
        kind = self.dist.ProcessGroup.BackendType.CUSTOM
        group._set_default_backend(kind)
        group._register_backend(torch.device("npu"), kind, ProcessGroupHCCL(store, rank, size, options))
        return group

    def interrupt(self) -> None:
        import torch_npu

        torch_npu.npu.stop_device(self.local_rank)  # aborts the device's tasks; the HCCL watchdog pauses

    def release(self, groups: list) -> None:
        import torch_npu

        # the device's tasks stop and its resources are rebuilt once for every group on it
        torch_npu.npu.stop_device(self.local_rank)
        torch_npu.npu.restart_device(self.local_rank, rebuild_all_resources=False)
        self._live = []


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


def _socket_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds
