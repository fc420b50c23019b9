"""The seam between the repair and each communication backend.

A repair has to release ranks blocked in a collective and tear the old group
down before the next generation's group forms. How depends on the backend:

* gloo (CPU): a peer's death breaks its sockets, so collectives waiting on it raise.
  A rank waiting on a healthy peer is released by shutting its own group sockets
  down (gloo closes them only when the last reference to the group goes, which
  C++ may hold on to), then the group is destroyed.
* nccl (CUDA): the communicator must be aborted (``ProcessGroup.abort``) or the
  kernels stay queued; then the group is destroyed.
* hccl (Ascend, torch_npu): the device's tasks are stopped
  (``torch_npu.npu.stop_device``), the device restarted
  (``restart_device``), then the group is destroyed.

Heavy imports (torch_npu) happen only inside the backend that needs them.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

log = logging.getLogger(__name__)


class CommBackend:
    """gloo: nothing to abort, destroying the group is enough."""

    name = "gloo"

    def __init__(self, dist=None, local_rank: int = 0):
        if dist is None:
            import torch.distributed as dist
        self.dist = dist
        self.local_rank = local_rank

    def device(self):
        import torch

        return torch.device("cpu")

    def form_group(self, store, rank: int, world_size: int, timeout: float) -> None:
        before = _socket_fds()
        self.dist.init_process_group(
            self.name, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        # the group's own connections to its peers: what interrupt() cuts
        self._group_fds = _socket_fds() - before

    def interrupt(self) -> None:
        """Release this rank's main thread from a collective that waits on a healthy peer.

        Called from another thread once a repair is announced. The collective then raises,
        and the step's ``with`` block hands the rank over to the repair.
        """
        for fd in getattr(self, "_group_fds", ()):
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # gloo aborts if its listener goes
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        self._group_fds = set()

    def release(self) -> None:
        """Unblock this rank's collectives and drop the group (errors of a broken group are expected)."""
        self._abort_device()
        if self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except Exception as e:  # a group whose peer died may fail to say goodbye
                log.debug("destroying the broken group: %s", e)

    def _abort_device(self) -> None:
        pass


class NcclBackend(CommBackend):
    name = "nccl"

    def device(self):
        import torch

        return torch.device("cuda", self.local_rank)

    def interrupt(self) -> None:
        self._abort_device()  # aborting the communicator releases the kernels waiting in it

    def _abort_device(self) -> None:
        if not self.dist.is_initialized():
            return
        try:
            self.dist.group.WORLD.abort()  # NCCL: aborts the communicator, releasing queued collectives
        except Exception as e:
            log.debug("aborting the NCCL communicator: %s", e)


class HcclBackend(CommBackend):
    name = "hccl"

    def device(self):
        import torch

        return torch.device("npu", self.local_rank)

    def interrupt(self) -> None:
        import torch_npu

        torch_npu.npu.stop_device(self.local_rank)  # aborts the device's tasks; the HCCL watchdog pauses

    def _abort_device(self) -> None:
        import torch_npu

        torch_npu.npu.stop_device(self.local_rank)
        torch_npu.npu.restart_device(self.local_rank, rebuild_all_resources=False)


BACKENDS = {cls.name: cls for cls in (CommBackend, NcclBackend, HcclBackend)}


def make_backend(name: str | None, local_rank: int = 0, dist=None) -> CommBackend:
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
