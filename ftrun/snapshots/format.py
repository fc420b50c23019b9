"""A snapshot's bytes: a header, the state's structure, then every tensor's bytes, in one file.

::

    [header, HEADER_SIZE bytes][structure (pickle)][padding to ALIGN][tensor bytes, each ALIGN-aligned]

The header says whether the file is complete, which step and rank it holds, and a CRC-32 of
everything after the header. A writer marks the file WRITING before it touches the rest and
COMPLETE (with the CRC) after, so a file a crash left half written is never taken for a snapshot,
and a file damaged later fails its checksum. The structure is the state with every tensor replaced
by a reference; it is read back with an unpickler that builds nothing but Python's plain containers
and scalars, so a snapshot file cannot run code.

The arrays are torch tensors (``ftrun.elastic``) or numpy arrays (``ftrun.mindspore_elastic``: a
MindSpore rank's parameters as ``asnumpy()`` gives them); both record a dtype by the name the two
libraries share (``float32``, ``int64``, ``bool``...), so either reads the other's file. Torch and numpy
are imported only by the functions that build or load them: the agent reads headers, checks sums and
moves bytes without either.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

MAGIC = b"FTRSNAP1"
#: magic, state, step, rank, world size, flags, structure length, data length, crc32, written at (unix time)
_HEADER = struct.Struct("<8sIqiiIQQId")
HEADER_SIZE = 4096
ALIGN = 64
WRITING, COMPLETE = 0, 1
_SHARDED = 1
#: how much a reader moves at a time when it copies or checks a file
CHUNK = 8 << 20


class SnapshotError(Exception):
    """A snapshot that cannot be used: incomplete, damaged, or not a snapshot at all."""


class SnapshotTooLarge(SnapshotError):
    """A rank's state does not fit in its share of --snapshot-memory."""


@dataclass(frozen=True)
class Header:
    state: int
    step: int
    rank: int
    world_size: int
    sharded: bool
    meta_len: int
    data_len: int
    crc: int
    written_at: float = 0.0

    @property
    def data_offset(self) -> int:
        return _aligned(HEADER_SIZE + self.meta_len)

    @property
    def total(self) -> int:
        """The file's length."""
        return self.data_offset + self.data_len

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, self.state, self.step, self.rank, self.world_size,
                            _SHARDED if self.sharded else 0, self.meta_len, self.data_len, self.crc, self.written_at)

    @classmethod
    def unpack(cls, raw: bytes) -> "Header | None":
        """The header at the start of ``raw``; None when it is not a snapshot's."""
        if len(raw) < _HEADER.size:
            return None
        magic, state, step, rank, world, flags, meta_len, data_len, crc, written = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            return None
        return cls(state, step, rank, world, bool(flags & _SHARDED), meta_len, data_len, crc, written)


def size_text(nbytes: float) -> str:
    """``nbytes`` for a person: 512 B, 16.0 MiB, 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def read_header(path: str) -> Header | None:
    """The header of the snapshot file at ``path``; None when it is missing or not a snapshot."""
    try:
        with open(path, "rb") as f:
            return Header.unpack(f.read(_HEADER.size))
    except OSError:
        return None


def checksum(buffer, start: int = HEADER_SIZE, end: int | None = None) -> int:
    """CRC-32 of ``buffer[start:end]`` in chunks (zlib lets other threads run meanwhile)."""
    view = memoryview(buffer)
    end = len(view) if end is None else end
    crc = 0
    for offset in range(start, end, CHUNK):
        crc = zlib.crc32(view[offset:min(offset + CHUNK, end)], crc)
    return crc


def read_verified(path: str) -> tuple[Header, bytearray]:
    """The whole file at ``path`` if it is a complete snapshot whose checksum holds."""
    try:
        with open(path, "rb") as f:
            return verified(read_whole(f), path)
    except OSError as e:
        raise SnapshotError(f"{path}: {e.strerror}") from None


def read_whole(f) -> bytearray:
    """An open file's bytes, read straight into one buffer (snapshots are large: no second copy)."""
    blob = bytearray(os.fstat(f.fileno()).st_size)
    view, done = memoryview(blob), 0
    while done < len(blob):
        got = f.readinto(view[done:])
        if not got:
            return blob[:done]  # it shrank meanwhile: what there is (the checksum says if it will do)
        done += got
    return blob


def verified(blob: bytearray, where: str) -> tuple[Header, bytearray]:
    """``blob``'s header, once the blob proves to be a complete snapshot whose checksum holds."""
    header = Header.unpack(bytes(blob[:_HEADER.size]))
    if header is None:
        raise SnapshotError(f"{where}: not a snapshot")
    if not header.complete:
        raise SnapshotError(f"{where}: a snapshot of step {header.step} that was never finished")
    if len(blob) < header.total:
        raise SnapshotError(f"{where}: cut short ({len(blob)} of {header.total} bytes)")
    if checksum(blob, HEADER_SIZE, header.total) != header.crc:
        raise SnapshotError(f"{where}: the snapshot of step {header.step} fails its checksum (damaged)")
    return header, blob


# -- the state's structure --------------------------------------------------------------------------


class TensorRef:
    """Where a tensor was in the state: the index of its bytes in the file."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return TensorRef, (self.index,)


#: what a snapshot's structure may be built from
_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"), ("builtins", "slice"),
    ("collections", "OrderedDict"), (__name__, "TensorRef"),
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise SnapshotError(f"a snapshot's state may hold tensors and Python's plain types, not {module}.{name}")
        return TensorRef if name == "TensorRef" else super().find_class(module, name)


def plain_loads(raw) -> Any:
    return _PlainUnpickler(io.BytesIO(raw)).load()


def _strip(value, tensors: list, take: Callable[[Any], Any]):
    """``value`` with every array replaced by a TensorRef (the arrays collected in order): ``take(v)``
    is the array to keep for ``v``, or None when ``v`` is none."""
    array = take(value)
    if array is not None:
        tensors.append(array)
        return TensorRef(len(tensors) - 1)
    if isinstance(value, collections.OrderedDict):
        return collections.OrderedDict((k, _strip(v, tensors, take)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _strip(v, tensors, take) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v, tensors, take) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_strip(v, tensors, take) for v in value)
    return value


def _torch_tensor(value):
    import torch

    return value.detach() if isinstance(value, torch.Tensor) else None


def _numpy_array(value):
    import numpy as np

    if not isinstance(value, np.ndarray):
        return None
    return value if value.flags.c_contiguous else value.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


def _fill(value, tensors: list):
    if isinstance(value, TensorRef):
        return tensors[value.index]
    if isinstance(value, collections.OrderedDict):
        return collections.OrderedDict((k, _fill(v, tensors)) for k, v in value.items())
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_fill(v, tensors) for v in value)
    return value


@dataclass
class SnapshotLayout:
    """A state laid out for a snapshot file: its structure, its tensors and where each one goes."""

    meta: bytes
    tensors: list
    offsets: list[int]
    data_len: int

    def header(self, state: int, step: int, rank: int, world_size: int, sharded: bool, crc: int = 0,
               written_at: float = 0.0) -> Header:
        return Header(state, step, rank, world_size, sharded, len(self.meta), self.data_len, crc, written_at)


def lay_out(states: dict, arrays: str = "torch") -> SnapshotLayout:
    """Split ``states`` into its structure and its arrays (``arrays``: "torch" tensors or "numpy"
    arrays), and place the arrays in the file."""
    tensors: list = []
    skeleton = _strip(states, tensors, _numpy_array if arrays == "numpy" else _torch_tensor)
    specs, offsets, offset = [], [], 0
    for tensor in tensors:
        if arrays == "numpy":
            dtype, nbytes = tensor.dtype.name, tensor.nbytes
        else:
            dtype, nbytes = str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()
        specs.append((dtype, tuple(tensor.shape), offset, nbytes))
        offsets.append(offset)
        offset = _aligned(offset + nbytes)
    try:
        meta = pickle.dumps((skeleton, specs), protocol=pickle.HIGHEST_PROTOCOL)
        plain_loads(meta)  # what cannot be read back is refused now, not at the restore
    except (SnapshotError, pickle.PicklingError, AttributeError, TypeError) as e:
        raise SnapshotError(f"cannot snapshot the registered state: {e}") from None
    return SnapshotLayout(meta, tensors, offsets, offset)


def copy_tensors(target, layout: SnapshotLayout, data_offset: int, indices, staging=None) -> None:
    """Copy the tensors ``indices`` of the layout into ``target`` (a writable mapping of the file): one
    copy each, straight from the tensor's memory into the file's pages; GPU tensors through
    ``staging`` (a :class:`~ftrun.snapshots.staging.DeviceStaging` whose ``mark_ready`` was called)
    where one is given, else from their device straight."""
    import torch

    pages = torch.frombuffer(target, dtype=torch.uint8)
    staged = []
    for index in indices:
        tensor = layout.tensors[index]
        if tensor.numel() == 0:
            continue
        start = data_offset + layout.offsets[index]
        into = pages[start:start + tensor.numel() * tensor.element_size()]
        if staging is not None and staging.takes(tensor):
            staged.append((into, tensor))
        else:
            into.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    if staged:
        staging.copy(staged)
    del pages, staged  # the mapping can close once no tensor views it


def copy_arrays(target, layout: SnapshotLayout, data_offset: int, indices) -> None:
    """Copy the numpy arrays ``indices`` of the layout (``lay_out(..., "numpy")``) into ``target``, a
    writable mapping of the file: one copy each."""
    import numpy as np

    pages = np.frombuffer(target, dtype=np.uint8)
    for index in indices:
        array, offset = layout.tensors[index], layout.offsets[index]
        if array.nbytes:
            start = data_offset + offset
            pages[start:start + array.nbytes].view(array.dtype).reshape(array.shape)[...] = array
    del pages  # the mapping can close once no array views it


def load_arrays(header: Header, blob: bytearray) -> dict:
    """The state a verified snapshot holds, its arrays numpy views of ``blob`` (no copy)."""
    import numpy as np

    skeleton, specs = plain_loads(memoryview(blob)[HEADER_SIZE:HEADER_SIZE + header.meta_len])
    arrays = [np.frombuffer(blob, dtype=np.uint8, count=nbytes, offset=header.data_offset + offset).view(dtype)
              .reshape(shape) if nbytes else np.empty(shape, dtype=dtype) for dtype, shape, offset, nbytes in specs]
    return _fill(skeleton, arrays)


def load_states(header: Header, blob: bytearray) -> dict:
    """The state a verified snapshot holds, its tensors viewing ``blob`` (no copy)."""
    import torch

    skeleton, specs = plain_loads(memoryview(blob)[HEADER_SIZE:HEADER_SIZE + header.meta_len])
    tensors = []
    for dtype_name, shape, offset, nbytes in specs:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=header.data_offset + offset)
        tensors.append(raw.view(dtype).reshape(shape))
    return _fill(skeleton, tensors)
