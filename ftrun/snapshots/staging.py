"""Copying a snapshot's GPU tensors into its file's pages beside training, not in its way.

A plain ``pages.copy_(cuda_tensor)`` from the snapshot's thread copies on the default stream: it
waits for every kernel queued before it, and the training kernels queued after it wait for the
copy. Here the copy runs on a CUDA stream of its own, which starts from an event recorded on the
training stream when the snapshot was asked for (so it copies the tensors as that step left them)
and goes on beside the training stream's kernels.

Two ways to reach the pages, measured against each other by ``scripts/bench_checkpoint.py --device
cuda`` (3 GiB of model and Adam state, what a snapshot blocked the loop, on an H200):
  * straight into the (pageable) pages, the driver staging the bytes: 337 ms; the default.
  * through two pinned host buffers in turn (``pinned=True``), each chunk's transfer overlapping the
    host's copy of the one before into the pages: 443 ms, the host's second copy the bottleneck. On
    an H100 before the pages were populated ahead of the copy it was the quicker (276 against 409 ms
    for the plain copy), hence kept, and benchmarked beside the default.
The plain copy on the default stream blocked 239 ms there, but holds the next step's kernels back
for as long: ``bench_checkpoint.py`` reports what each way adds to the step after it.

Only CUDA tensors go this way; every other tensor is copied as before.
"""

from __future__ import annotations

import torch

#: bytes of one pinned buffer; two of them take turns
CHUNK_BYTES = 64 * 2**20


class DeviceStaging:
    """One rank's stream (and, ``pinned``, two pinned buffers) for copying GPU tensors into snapshot files."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, pinned: bool = False):
        self.chunk_bytes = chunk_bytes
        self.pinned = pinned
        self._stream: torch.cuda.Stream | None = None
        self._buffers: list[torch.Tensor] = []
        self._filled: list[torch.cuda.Event] = []
        #: recorded on the training stream when the snapshot was asked for
        self._ready: torch.cuda.Event | None = None

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and tensor.is_contiguous()

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
