"""A rank's snapshots: written into its agent's shared memory, and read back at a restore.

A rank has two files, written in turn. Writing one marks it unfinished first, then copies each
array's bytes into it (one copy, straight from the array), and training goes on; a thread of
the rank then sums the file and marks it complete. Until then, and forever if the rank dies in
between, the other file holds the last good snapshot. The rank holds an exclusive lock on the file
while it writes, and the agent a shared one while it copies, so neither reads a half-written file.

What the arrays are is the :class:`ArrayKind`'s business: torch tensors for ``ftrun.elastic``
(``ftrun/elastic/arrays.py``), numpy arrays for ``ftrun.mindspore_elastic``. This module imports
neither torch nor numpy, so that a MindSpore rank (whose python has no torch) can use it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from typing import Callable

from ftrun.auth import Signer
from ftrun.contract import SNAPSHOT_TOKEN_FILE, SnapshotSettings
from ftrun.snapshots.format import (
    COMPLETE,
    HEADER_SIZE,
    WRITING,
    Header,
    SnapshotError,
    SnapshotLayout,
    SnapshotTooLarge,
    checksum,
    copy_arrays,
    lay_out,
    load_arrays,
    read_header,
    read_verified,
    size_text,
    verified,
)
from ftrun.snapshots.plan import DISK, RestorePlan, RestoreSource
from ftrun.snapshots.transfer import TransferError, get


class ArrayKind:
    """What a snapshot's arrays are, and how they reach the file and come back: numpy arrays here
    (``ftrun/elastic/arrays.py`` has torch's). A subclass whose framework reads checkpoint files
    (``--checkpoint-dir``) says how in :meth:`load_checkpoint`."""

    #: the name format.lay_out knows them by
    name = "numpy"

    def prepare(self, tensors: list) -> None:
        """Called on the training thread before any copy of a snapshot (torch's GPU copies start there)."""

    def copy(self, pages, layout: SnapshotLayout, data_offset: int, indices) -> None:
        """Copy the arrays ``indices`` of the layout into ``pages`` (a writable mapping of the file)."""
        copy_arrays(pages, layout, data_offset, indices)

    def identity(self, tensor) -> int:
        """What ``write(behind=...)`` names an array by."""
        return id(tensor)

    def load(self, header: Header, blob: bytearray) -> dict:
        """The state a verified snapshot holds."""
        return load_arrays(header, blob)

    def load_checkpoint(self, data: bytes, path: str) -> dict:
        """The state a checkpoint file the persister wrote holds (``data``: its bytes, checked)."""
        raise SnapshotError(f"checkpoint {path}: this rank cannot read checkpoint files")


log = logging.getLogger(__name__)


class SnapshotWriter:
    """This rank's snapshots, every ``every`` committed steps, into ``folder`` (its agent's)."""

    def __init__(self, folder: str, rank: int, world_size: int, sharded: bool, every: int, limit: int, copies: int,
                 arrays: ArrayKind):
        self.folder, self.rank, self.world_size, self.sharded = folder, rank, world_size, sharded
        self.every, self.limit, self.copies = every, limit, copies
        #: what the state's arrays are, and how they reach the file
        self.arrays = arrays
        self.paths = [os.path.join(folder, f"rank-{rank:05d}.{i}") for i in (0, 1)]
        steps = [_complete_step(p) for p in self.paths]
        #: the file to write next: the one with the older snapshot (or none)
        self._next = 0 if steps[0] <= steps[1] else 1
        self._pending: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._failed: BaseException | None = None
        #: the step of the first snapshot skipped for want of room, while they are being skipped
        self._no_room_since: int | None = None
        #: seconds the training loop waited for each snapshot: the copies made before write() returned,
        #: and any wait of the optimizer for the ones made behind it (the checksum never holds it up)
        self.blocked: list[float] = []

    @classmethod
    def from_settings(cls, settings: SnapshotSettings | None, rank: int, world_size: int, sharded: bool,
                      arrays: ArrayKind) -> "SnapshotWriter | None":
        """The writer ftrun's agent set up for this rank (its worker environment's); None without snapshots."""
        if settings is None:
            return None
        return cls(settings.folder, rank, world_size, sharded, settings.every, settings.limit, settings.copies, arrays)

    def resume_at(self, step: int) -> None:
        """The rank went back to ``step`` (a restore or a rollback): its snapshots of later steps belong
        to the run it abandoned and are marked unfinished; the next write keeps the one of ``step``."""
        self.wait()
        steps = [_complete_step(p) for p in self.paths]
        for path, held in zip(self.paths, steps):
            if held > step:
                fd = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    header = read_header(path)
                    os.pwrite(fd, dataclasses.replace(header, state=WRITING).pack(), 0)
                finally:
                    os.close(fd)
        self._next = 1 if steps[0] == step else 0 if steps[1] == step else self._next

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def write(self, step: int, states: dict, behind: frozenset[int] = frozenset()) -> bool:
        """Snapshot ``states`` as they are after ``step`` committed steps; False when the node's shared
        memory had no room for it (said once, and again once snapshots resume; the last one stays).

        Arrays whose ``arrays.identity()`` (torch's ``data_ptr()``) is in ``behind`` are copied by a
        thread while training goes on: the caller makes sure nothing changes them before
        :meth:`wait_copied` returns (the parameters and
        the optimizer's state, which only the optimizer's next step changes). The others (buffers,
        which the next forward changes, and everything else) are copied before this returns.
        """
        began = time.perf_counter()
        self.wait()
        layout = lay_out(states, self.arrays.name)
        self.arrays.prepare(layout.tensors)
        header = layout.header(WRITING, step, self.rank, self.world_size, self.sharded)
        if self.limit and header.total > self.limit:
            raise SnapshotTooLarge(
                f"rank {self.rank}'s snapshot takes {size_text(header.total)}, but its share of --snapshot-memory is "
                f"{size_text(self.limit)} (the node keeps {self.copies} copies of each of its ranks' snapshots); "
                "raise --snapshot-memory, or lower --snapshot-replicas")
        path = self.paths[self._next]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits while the agent copies this file (a memory copy)
            os.pwrite(fd, header.pack(), 0)  # unfinished, before anything else changes
            if os.fstat(fd).st_size != header.total and not self._allocate(fd, header.total, step):
                os.close(fd)
                return False
            pages = mmap.mmap(fd, header.total)
            pages[HEADER_SIZE:HEADER_SIZE + len(layout.meta)] = layout.meta
            later = [i for i, t in enumerate(layout.tensors) if self.arrays.identity(t) in behind]
            now = sorted(set(range(len(layout.tensors))) - set(later))
            if not later:
                _populate(pages)
            self.arrays.copy(pages, layout, header.data_offset, now)
        except BaseException:
            os.close(fd)
            raise
        self._next ^= 1
        self._copied.clear()
        self._pending = threading.Thread(target=self._commit, args=(fd, pages, header, layout, later),
                                         name="ftrun-snapshot-commit", daemon=True)
        self._pending.start()
        self.blocked.append(time.perf_counter() - began)
        if self._no_room_since is not None:
            log.warning("rank %d: snapshots resumed at step %d (skipped since step %d for want of shared memory)",
                        self.rank, step, self._no_room_since)
            self._no_room_since = None
        return True

    def _allocate(self, fd: int, size: int, step: int) -> bool:
        """Give the file ``size`` bytes with every page now (they stay the file's): shared memory running
        out is found here, not as a SIGBUS in the copy. False, the file emptied, when there is no room."""
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            return True
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM):
                raise
            os.ftruncate(fd, 0)  # what it got goes back to the others
            if self._no_room_since is None:
                self._no_room_since = step
                log.error("rank %d: no room in %s for the snapshot of step %d (%s: %s); training goes on, and the "
                          "last snapshot stays; free shared memory, or lower --snapshot-memory or --snapshot-replicas",
                          self.rank, self.folder, step, size_text(size), e.strerror)
            return False

    def wait_copied(self) -> None:
        """Until the tensors copied behind the training loop are in the file (the optimizer's step waits)."""
        if self._copied.is_set():
            return
        began = time.perf_counter()
        self._copied.wait()
        self.blocked[-1] += time.perf_counter() - began

    def _commit(self, fd: int, pages: mmap.mmap, header, layout, later: list[int]) -> None:
        try:
            with pages:
                try:
                    _populate(pages)
                    self.arrays.copy(pages, layout, header.data_offset, later)
                finally:
                    self._copied.set()
                crc = checksum(pages, HEADER_SIZE, header.total)
            done = dataclasses.replace(header, state=COMPLETE, crc=crc, written_at=time.time())
            os.pwrite(fd, done.pack(), 0)
        except BaseException as e:
            self._failed = e
        finally:
            os.close(fd)  # releases the lock

    def wait(self, timeout: float | None = None) -> bool:
        """Until the snapshot under way is complete; False if it still is not after ``timeout`` seconds."""
        if self._pending is not None:
            self._pending.join(timeout)
            if self._pending.is_alive():
                return False
            self._pending = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise SnapshotError(f"rank {self.rank}'s last snapshot could not be completed: {failed}") from failed
        return True


#: madvise's MADV_POPULATE_WRITE (Linux 5.14; Python names it from 3.13)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(pages: mmap.mmap) -> None:
    """Map every page of the file in one call before the copy, instead of one page fault per 4 kB
    (1 GiB into /dev/shm on 2 busy cores: 0.70-1.0 s copied through faults, 0.39-0.65 s populated
    first). An older kernel refuses it, and the copy faults the pages in as before."""
    try:
        pages.madvise(MADV_POPULATE_WRITE)
    except OSError:
        pass


def _complete_step(path: str) -> int:
    header = read_header(path)
    return header.step if header is not None and header.complete else -1


def own_steps(folder: str, rank: int) -> list[int]:
    """The steps of this rank's complete snapshots in its agent's folder (a replacement finds its
    predecessor's there), newest first."""
    return sorted((s for s in (_complete_step(os.path.join(folder, f"rank-{rank:05d}.{i}")) for i in (0, 1)) if s >= 0),
                  reverse=True)


def load_own(folder: str, rank: int, step: int, arrays: ArrayKind) -> dict:
    """This rank's own snapshot of ``step`` from its agent's folder, checked."""
    for i in (0, 1):
        path = os.path.join(folder, f"rank-{rank:05d}.{i}")
        if _complete_step(path) == step:
            header, blob = read_verified(path)
            if header.step == step:
                return arrays.load(header, blob)
    raise SnapshotError(f"rank {rank}'s snapshot of step {step} is gone")


def snapshot_signer(folder: str) -> Signer:
    """The job's token, which the agent left in its snapshot folder (for the plan and for peers)."""
    try:
        with open(os.path.join(folder, SNAPSHOT_TOKEN_FILE), "rb") as f:
            return Signer(f.read().strip())
    except OSError:
        return Signer()


def load_source(source: RestoreSource, step: int, folder: str, signer: Signer, arrays: ArrayKind) -> dict:
    """The registered state a restore source holds, checked: its sum, its step and its rank."""
    if source.where == DISK:
        return _load_checkpoint(source, signer, arrays)
    where = f"rank {source.rank}'s snapshot on node {source.node_rank}"
    local = os.path.realpath(source.path).startswith(os.path.realpath(folder) + os.sep) and os.path.exists(source.path)
    try:
        if local:
            header, blob = read_verified(source.path)
        else:
            header, blob = verified(get(source.address, signer, source.path), where)
    except TransferError as e:
        raise SnapshotError(f"{where}: {e}") from None
    if header.step != step:
        raise SnapshotError(f"{where} now holds step {header.step}, not {step}")
    return arrays.load(header, blob)


def sources_to_restore(plan: RestorePlan | None, rank: int, start: int, generation: int) -> list[RestoreSource]:
    """Where a rank of a restarted ``generation`` reads its state, first choice first: [] when it restores
    nothing (no plan or no step every rank holds, said in the log; or ``start``, the script's own
    checkpoint's step, is newer)."""
    if plan is None or plan.step < 0:
        log.warning("rank %d: nothing to restore for generation %d (%s)", rank, generation,
                    plan.reason if plan else "no restore plan")
        return []
    if plan.step < start:
        return []  # the script's own checkpoint is newer
    sources = plan.sources_for(rank)
    if not sources:
        log.warning("rank %d: the restore plan of generation %d has no source for it", rank, generation)
    return sources


def load_first_good(sources: list[RestoreSource], step: int, folder: str, signer: Signer,
                    report: Callable[[RestoreSource], None], arrays: ArrayKind) -> tuple[RestoreSource, dict]:
    """The first of ``sources`` whose copy passes its checks, and the state it holds. Each copy that
    fails is skipped and ``report``-ed (later plans leave it out); SnapshotError when none is left."""
    for source in sources:
        try:
            return source, load_source(source, step, folder, signer, arrays)
        except SnapshotError as e:
            log.error("rank %d: skipping a damaged copy of step %d (%s on node %d): %s", source.rank, step, source.where,
                      source.node_rank, e)
            report(source)
    raise SnapshotError(f"every copy of step {step} the restore plan names for rank {sources[0].rank} "
                        f"({len(sources)}) failed its check; the next restart leaves them out")


def _load_checkpoint(source: RestoreSource, signer: Signer, arrays: ArrayKind) -> dict:
    import zlib

    try:
        if os.path.exists(source.path):
            with open(source.path, "rb") as f:
                data = f.read()
        else:
            data = bytes(get(source.address, signer, source.path))
    except (OSError, TransferError) as e:
        raise SnapshotError(f"checkpoint {source.path}: {e}") from None
    if zlib.crc32(data) != source.crc:
        raise SnapshotError(f"checkpoint {source.path} fails its checksum (damaged)")
    return arrays.load_checkpoint(data, source.path)
