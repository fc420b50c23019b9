"""Copying a snapshot's GPU tensors into its file's pages.

Three ways, measured against each other by ``scripts/bench_checkpoint.py --device cuda`` on an H200
(3 GiB of model and Adam state; 0.19 GiB in brackets), by what a snapshot adds to the step after it
(the call, the wait before that step's optimizer, and the step's own kernels held back):
  * a plain copy from the snapshot's thread, on the training's (default) stream: 483 ms (40 ms). It
    waits for the kernels queued before it, and the next step's kernels wait for it; it is the default.
  * on a CUDA stream of its own (``own_stream=True``), which starts from an event recorded on the
    training stream when the snapshot was asked for and goes on beside the training kernels: 756 ms
    (47 ms). The copy and the kernels share the GPU's memory bandwidth and the host's cores, and the
    copy is no shorter for running beside them.
  * through two pinned host buffers in turn on that stream (``pinned=True``), each chunk's transfer
    overlapping the host's copy of the one before into the pages: 501 ms (35 ms); the host's second
    copy costs what the pinned transfer saves.
Each way's snapshot is read back and compared bit for bit by the benchmark.
"""

from __future__ import annotations

import torch

#: bytes of one pinned buffer; two of them take turns
CHUNK_BYTES = 64 * 2**20


class DeviceStaging:
    """How one rank copies GPU tensors into snapshot files: plainly on the training's stream (the default),
    or on a stream of its own (``own_stream``), through two pinned buffers (``pinned``)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pinned: bool = False, own_stream: bool = False):
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned
        #: copy on a CUDA stream of its own (pinned buffers need one); else plainly, on the training's stream
        self.own_stream = own_stream or pinned
        self._stream: torch.cuda.Stream | None = None
        self._buffers: list[torch.Tensor] = []
        self._filled: list[torch.cuda.Event] = []
        #: recorded on the training stream when the snapshot was asked for
        self._ready: torch.cuda.Event | None = None

    def takes(self, tensor: torch.Tensor) -> bool:
        return self.own_stream and tensor.is_cuda and tensor.is_contiguous()

    def mark_ready(self, tensors) -> None:
        """Remember where the training stream is now: the copies start from there (call it on the
        thread that trains, before any copy of this snapshot)."""
        device = next((t.device for t in tensors if self.takes(t)), None)
        if device is None:
            self._ready = None
            return
        self._setup(device)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(device))

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each GPU tensor into its target (a uint8 view of the file's pages of its size);
        returns once every byte is in the pages."""
        assert self._stream is not None and self._ready is not None, "mark_ready() first"
        pending: tuple[int, torch.Tensor, int] | None = None  # (buffer, target, bytes) still to drain
        turn = 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            if not self.pinned:
                for target, tensor in pairs:
                    target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
                return
            for target, tensor in pairs:
                flat = tensor.detach().reshape(-1).view(torch.uint8)
                for start in range(0, flat.numel(), self.chunk_bytes):
                    piece = flat[start:start + self.chunk_bytes]
                    buffer = self._buffers[turn]
                    buffer[:piece.numel()].copy_(piece, non_blocking=True)
                    self._filled[turn].record(self._stream)
                    if pending is not None:
                        self._drain(*pending)
                    pending = (turn, target[start:start + piece.numel()], piece.numel())
                    turn ^= 1
            if pending is not None:
                self._drain(*pending)

    def _drain(self, turn: int, target: torch.Tensor, nbytes: int) -> None:
        self._filled[turn].synchronize()
        target.copy_(self._buffers[turn][:nbytes])

    def _setup(self, device: torch.device) -> None:
        if self._stream is not None and self._stream.device == device:
            return
        self._stream = torch.cuda.Stream(device)
        if not self.pinned:
            return
        self._buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._filled = [torch.cuda.Event() for _ in range(2)]
