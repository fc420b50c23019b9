"""The persister: writes snapshots to --checkpoint-dir as torch.save files (or, for a MindSpore job, as
``.ckpt`` files), off the agent's threads.

Runs as ``python -m ftrun.snapshots.persist`` beside each agent that has a --checkpoint-dir. It imports
torch (the agent does not) at its first request, so that it costs the job nothing at its start. For a
MindSpore job it runs as ``python -m ftrun.snapshots.persist mindspore`` with the workers' python, which
has mindspore (and no torch): the ranks' snapshots hold numpy arrays by parameter name, and
``mindspore.save_checkpoint`` writes them, so that ``mindspore.load_checkpoint`` reads the files as it
reads any other (the agent's python need not have mindspore, and the ranks' training loop does not wait
for the disk). Requests come as JSON lines on stdin::

    {"source": SNAPSHOT FILE, "step": S, "rank": R, "folder": DIR, "keep": N}

and each gets a JSON line back on stdout: what was written (``path``, ``nbytes``, ``crc``), or ``error``.

The layout, which ``torch.load`` reads without ftrun::

    DIR/step-00000120/rank-00003.pt     torch.save({name: state_dict, ...}) of rank 3 at step 120
                                        (MindSpore: rank-00003.ckpt, its parameters by name)
    DIR/step-00000120/rank-00003.json   its step, rank, world size, size and CRC-32 (written last)
    DIR/step-00000120/manifest.json     every rank's file, written once all are there

Each file is written to a temporary name, flushed to disk (fsync) and renamed into place, and the
folder is synced after: a crash leaves the previous files, never a torn one. Whichever persister
writes a step's last rank file writes its manifest (on a folder every node shares, that is one
checkpoint; on node-local folders each node keeps its own ranks' files and no manifest). Then only
the newest ``keep`` steps with a manifest are kept.
"""

from __future__ import annotations

import glob
import io
import json
import os
import queue
import shutil
import sys
import threading
import zlib

from ftrun.snapshots.format import load_arrays, load_states, read_verified

#: what a persister writes: torch.save files, or MindSpore's .ckpt files (the first argument)
FORMATS = {"torch": ".pt", "mindspore": ".ckpt"}


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def write_atomically(path: str, data, durable: bool = True) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the whole new one;
    ``durable``: flushed to disk too (not for files in shared memory, which a power cut loses anyway)."""
    tmp = f"{path}.{os.getpid()}.tmp"  # several nodes' persisters may write one manifest
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.write(fd, view[done:])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        sync_folder(os.path.dirname(path))


def sync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def persist(request: dict, copy=None, kind: str = "torch") -> dict:
    """Write the snapshot a request names; ``copy``: its (header, bytes), read when the request came;
    ``kind``: the file's format (one of FORMATS)."""
    header, blob = copy or read_verified(request["source"])
    if header.step != request["step"] or header.rank != request["rank"]:
        raise ValueError(f"{request['source']} moved on to step {header.step} before it was read")
    folder = step_folder(request["folder"], header.step)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, shard_name(header.rank) + FORMATS[kind])
    data: bytes | memoryview
    if kind == "mindspore":
        data = write_mindspore_checkpoint(load_arrays(header, blob), path)
    else:
        import torch

        buffer = io.BytesIO()
        torch.save(load_states(header, blob), buffer)
        data = buffer.getbuffer()
        write_atomically(path, data)
    record = {"step": header.step, "rank": header.rank, "world_size": header.world_size, "sharded": header.sharded,
              "path": path, "nbytes": len(data), "crc": zlib.crc32(data)}
    write_atomically(os.path.join(folder, shard_name(header.rank) + ".json"), json.dumps(record).encode())
    record["manifest"] = write_manifest(folder, header.step, header.world_size)
    if record["manifest"]:
        prune(request["folder"], int(request.get("keep") or 0))
    return record


MANIFEST = "manifest.json"


def write_manifest(folder: str, step: int, world_size: int) -> bool:
    """The step's manifest, once every rank's file is in ``folder``; True when it is there."""
    ranks = []
    for rank in range(world_size):
        try:
            with open(os.path.join(folder, shard_name(rank) + ".json")) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return False
        ranks.append({"rank": rank, "path": os.path.join(os.path.basename(folder), os.path.basename(record["path"])),
                      "nbytes": record["nbytes"], "crc32": record["crc"], "sharded": record["sharded"]})
    manifest = {"step": step, "world_size": world_size, "ranks": ranks,
                "format": "mindspore.ckpt" if ranks[0]["path"].endswith(".ckpt") else "torch.save"}
    write_atomically(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
    return True


def write_mindspore_checkpoint(state: dict, path: str) -> bytes:
    """Write a MindSpore rank's snapshot state (parameter name -> numpy array) to ``path`` with
    ``mindspore.save_checkpoint``, as atomically as ``write_atomically``; the file's bytes."""
    import mindspore
    import numpy as np

    tmp = f"{path}.{os.getpid()}.tmp.ckpt"
    mindspore.save_checkpoint([{"name": name, "data": mindspore.Tensor(array)} for name, array in state.items()
                               if isinstance(array, np.ndarray)], tmp)
    with open(tmp, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    sync_folder(os.path.dirname(path))
    return data


def prune(root: str, keep: int) -> None:
    """Remove every step older than the newest ``keep`` steps that have a manifest."""
    if keep <= 0:
        return
    complete = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(root, "step-*", MANIFEST)))
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for folder in glob.glob(os.path.join(root, "step-*")):
        if folder < oldest_kept:
            shutil.rmtree(folder, ignore_errors=True)


#: requests read (their snapshot copied) ahead of the one being written
BACKLOG = 8


def main() -> None:
    """Copy each request's snapshot as it comes (the agent may replace the file soon after), and write
    the copies in a thread, in order. torch (or mindspore) is imported by the first write, not at the
    job's start."""
    kind = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if kind not in FORMATS:
        sys.exit(f"ftrun.snapshots.persist: unknown format {kind!r} (one of {', '.join(FORMATS)})")
    pending: queue.Queue = queue.Queue(BACKLOG)
    lock = threading.Lock()

    def say(reply: dict) -> None:
        with lock:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    def write() -> None:
        while (item := pending.get()) is not None:
            request, copy = item
            try:
                say(persist(request, copy, kind))
            except Exception as e:
                say({**request, "error": f"{type(e).__name__}: {e}"})

    writer = threading.Thread(target=write, name="ftrun-persist-writer")
    writer.start()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            pending.put((request, read_verified(request["source"])))
        except Exception as e:
            say({**request, "error": f"{type(e).__name__}: {e}"})
    pending.put(None)
    writer.join()


if __name__ == "__main__":
    main()
