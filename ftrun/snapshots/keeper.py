"""The agent's side of snapshots: the node's shared memory, pinned copies, peer replicas, persistence.

The agent owns a private folder in shared memory (``/dev/shm``) for the job. Its ranks write their
snapshots there (``rank-00003.0`` and ``.1``, in turn: ``ftrun.elastic.arrays``), so a snapshot
outlives the process that wrote it. A thread of the agent then, for each rank:

* pins every snapshot whose step is a multiple of --replicate-every: a verified copy of the agent's
  own (``pin-00003.0``/``.1``), so the ranks' rolling snapshots can move on while it is sent;
* sends the pinned copy to the next --snapshot-replicas nodes in the ring (by node order), whose
  agents keep it (``replica-00003.0``/``.1``): losing a node loses no rank's state at that step;
* has every pinned copy whose step is a multiple of --checkpoint-every written to --checkpoint-dir by
  the persister (``ftrun.snapshots.persist``), a process of its own, so nothing waits on the disk.

The agent publishes what it holds (an inventory) for the controller, which chooses the restore. Its
snapshot server (``ftrun.snapshots.transfer``) takes peers' replicas and hands copies to ranks on
other nodes. The folder is removed when the agent ends; if the agent is killed, its orphan guardian
removes it.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ftrun.auth import Signer
from ftrun.contract import SNAPSHOT_TOKEN_FILE, SnapshotSettings
from ftrun.messages import to_json
from ftrun.ports import PortRange
from ftrun.snapshots.format import HEADER_SIZE, Header, SnapshotError, read_header, read_verified, read_whole, size_text, verified
from ftrun.snapshots.persist import write_atomically
from ftrun.snapshots.plan import DISK, MEMORY, PINNED, REPLICA, HeldSnapshot, RestorePlan, SnapshotInventory
from ftrun.snapshots.transfer import SnapshotServer, TransferError, put

log = logging.getLogger(__name__)
#: how often the agent's snapshot thread looks for new snapshots
TICK = 0.05
#: checks remembered before those of replaced files are forgotten
VERIFIED_KEPT = 256


@dataclass(frozen=True)
class SnapshotOptions:
    """The snapshot flags, checked (``ftrun.config``)."""

    #: --snapshot-every: a rank snapshots after every K-th step (0: no snapshots)
    every: int = 0
    #: --snapshot-replicas: how many peer nodes keep a copy of each rank's pinned snapshots
    replicas: int = 1
    #: --replicate-every: steps between pinned snapshots (those sent to peers and persisted)
    replicate_every: int = 10
    #: --snapshot-memory: bytes of shared memory the node's snapshots may take
    memory: int = 0
    #: --checkpoint-dir, --checkpoint-every, --keep-checkpoints, --save-on-failure
    checkpoint_dir: str = ""
    checkpoint_every: int = 100
    keep: int = 3
    save_on_failure: bool = False
    #: --checkpoint-interval: also persist the newest pinned snapshot once this many seconds passed (0: off)
    checkpoint_interval: float = 0.0
    #: --worker-port-range: where the snapshot server listens (None: any free port)
    ports: PortRange | None = None

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @property
    def pins(self) -> bool:
        """Pinned copies are kept when something needs them: replicas or a checkpoint folder."""
        return self.replicas > 0 or bool(self.checkpoint_dir)

    def copies(self) -> int:
        """How many copies of one rank's snapshot a node holds at most (its own two, two pinned, and
        two for each peer whose ranks it keeps replicas of)."""
        return 2 + (2 if self.pins else 0) + 2 * self.replicas

    def limit(self, nproc: int) -> int:
        """The largest snapshot one rank may write (its share of --snapshot-memory)."""
        return self.memory // (max(1, nproc) * self.copies())


def memory_root() -> str:
    """Shared memory where the system has it (``/dev/shm``), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def ring_peers(nodes: list[int], mine: int, count: int) -> list[int]:
    """The ``count`` nodes after ``mine`` in node order, wrapping around (never ``mine`` itself)."""
    if mine not in nodes:
        return []
    at = nodes.index(mine)
    return [nodes[(at + k) % len(nodes)] for k in range(1, min(count, len(nodes) - 1) + 1)]


class SnapshotKeeper:
    """One node's snapshots, for the agent (see the module's text)."""

    def __init__(self, options: SnapshotOptions, run_id: str, nproc: int, advertise: str, bind: str,
                 signer: Signer, token: bytes, spawn=None, persister: tuple[str, ...] = ()):
        self.options = options
        #: the persister's command (default: ftrun's python, writing torch.save files)
        self.persister_command = persister or (sys.executable, "-u", "-m", "ftrun.snapshots.persist")
        self.nproc = nproc
        self.folder = os.path.join(memory_root(), f"ftrun-{re.sub(r'[^A-Za-z0-9_.-]', '_', run_id)}-{os.getpid()}")
        self.signer = signer
        self._token = token
        self._advertise = advertise
        self._bind = bind
        self._spawn = spawn
        self.address = ""
        self._server: SnapshotServer | None = None
        self._lock = threading.Lock()
        #: rank -> its newest copies by kind (PINNED, REPLICA): at most two each
        self._pins: dict[int, list[HeldSnapshot]] = {}
        self._replicas: dict[int, list[HeldSnapshot]] = {}
        #: (rank, step) -> a checkpoint file this agent wrote
        self._disk: dict[tuple[int, int], HeldSnapshot] = {}
        #: (path, step, crc, mtime) -> whether the rolling snapshot verified
        self._verified: dict[tuple, bool] = {}
        #: the peers' snapshot servers: (node rank, HOST:PORT)
        self._peers: list[tuple[int, str]] = []
        self._unreachable: set[str] = set()
        #: rank -> (step, crc) of the snapshot last pinned (or found damaged)
        self._tried: dict[int, tuple[int, int]] = {}
        self._persister: subprocess.Popen | None = None
        self._persist_lock = threading.Lock()
        self._stop = threading.Event()
        #: --save-on-failure: a fault was detected; the copies aside made for the persister, by rank
        self._save_requested = threading.Event()
        self._saved: dict[int, list[HeldSnapshot]] = {}
        #: rank -> when its last pinned snapshot went to the persister (monotonic)
        self._persisted_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="ftrun-snapshots", daemon=True)

    # -- life -------------------------------------------------------------------------------------

    def start(self) -> None:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        os.chmod(self.folder, 0o700)
        write_atomically(os.path.join(self.folder, SNAPSHOT_TOKEN_FILE), self._token, durable=False)
        limit = max(self.options.limit(self.nproc), HEADER_SIZE)
        self._server = SnapshotServer(self._bind, self.signer, self._read, self._receive, limit, self.options.ports)
        self.address = f"{self._advertise}:{self._server.port}"
        if self.options.checkpoint_dir:
            os.makedirs(self.options.checkpoint_dir, mode=0o700, exist_ok=True)
            if self._spawn is not None:
                # from this thread: a child dies with the thread that started it (PR_SET_PDEATHSIG), and the
                # persister imports torch only when the first checkpoint comes
                self._persister = self._spawn(list(self.persister_command))
                threading.Thread(target=self._persisted, name="ftrun-persist-replies", daemon=True).start()
                threading.Thread(target=self._persister_errors, name="ftrun-persist-errors", daemon=True).start()
        self._thread.start()
        log.info("snapshots every %d step%s in %s (%s per rank at most), served at %s", self.options.every,
                 "s" if self.options.every != 1 else "", self.folder, size_text(self.options.limit(self.nproc)),
                 self.address)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        try:
            self._tick(replicate=False)  # the last steps' pins, for the checkpoint folder (the peers are leaving)
        except Exception:
            log.exception("the last snapshots could not be pinned")
        if self._server is not None:
            self._server.close()
        with self._persist_lock:
            persister = self._persister
        if persister is not None:
            try:
                persister.stdin.close()
            except OSError:
                pass
            try:
                persister.wait(timeout=60)  # the writes under way finish: they are fsynced renames
            except subprocess.TimeoutExpired:
                persister.kill()
                persister.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def settings(self, restore_plan: str = "") -> SnapshotSettings:
        """What a rank needs to write its snapshots here (and ``restore_plan``: the file of its
        generation's restore plan, for ranks that do not read the control store)."""
        return SnapshotSettings(self.folder, self.options.every, self.options.limit(self.nproc),
                                self.options.copies(), restore_plan)

    def leave_plan(self, generation: int, plan: RestorePlan) -> str:
        """Put the node's restore plan of ``generation`` in the folder, for ranks that cannot read the
        control store (MindSpore's python has no torch, hence no TCPStore); the file's path."""
        path = os.path.join(self.folder, f"plan-g{generation:05d}.json")
        write_atomically(path, to_json(plan).encode(), durable=False)
        return path

    def set_peers(self, peers: list[tuple[int, str]]) -> None:
        with self._lock:
            self._peers = list(peers)

    # -- what this node holds -------------------------------------------------------------------------

    def inventory(self, agent_id: str, node_rank: int, verify: bool = False) -> SnapshotInventory:
        """Every copy this node holds. ``verify``: check the sum of each copy in memory now (once the
        ranks are stopped); else those not checked yet count as good, and those that failed do not."""
        with self._lock:
            copies = [h for held in (*self._pins.values(), *self._replicas.values()) for h in held]
        held = [h for h in self._own() + copies if self._good(h, verify)]
        with self._lock:
            for key, copy in list(self._disk.items()):
                if os.path.exists(copy.path):
                    held.append(copy)
                else:
                    del self._disk[key]  # pruned (by another node's persister, on a shared folder)
        return SnapshotInventory(agent_id, node_rank, self.address, tuple(sorted(held, key=_order)))

    def _own(self) -> list[HeldSnapshot]:
        """The ranks' own complete snapshots, by their headers."""
        found = []
        for path in sorted(glob.glob(os.path.join(self.folder, "rank-*.[01]"))):
            header = read_header(path)
            if header is not None and header.complete:
                found.append(_held(header, MEMORY, path))
        return found

    def _good(self, held: HeldSnapshot, verify: bool) -> bool:
        """Whether a copy passed its check (``verify``: check it now unless it was, as it is now). Pinned
        copies and replicas were checked as they were made; a rank's own snapshots are checked once the
        rank stopped. A copy damaged later still fails the check of the rank that loads it."""
        key = _identity(held.path, held.step, held.crc)
        if key is None:
            return False
        good = self._verified.get(key)
        if good is None and verify:
            try:
                good = read_verified(held.path)[0].step == held.step
            except SnapshotError as e:
                log.error("skipping a damaged snapshot: %s", e)
                good = False
            self._verified[key] = good
        return good is not False

    def _checked(self, held: HeldSnapshot) -> HeldSnapshot:
        """A copy this agent just wrote from bytes it verified: good as it is now."""
        key = _identity(held.path, held.step, held.crc)
        if key is not None:
            self._verified[key] = True
        if len(self._verified) > VERIFIED_KEPT:  # forget the files replaced since
            self._verified = {k: v for k, v in self._verified.items() if _identity(*k[:3]) == k}
        return held

    # -- the thread: pin, replicate, persist -------------------------------------------------------------

    def _run(self) -> None:
        said = ""
        while not self._stop.wait(TICK):
            try:
                self._tick()
            except OSError as e:  # shared memory full, say: each time it changes, and try again
                if str(e) != said:
                    said = str(e)
                    log.error("cannot keep a copy of a snapshot: %s", e)
            except Exception:
                log.exception("the snapshot thread failed; snapshots are no longer pinned or replicated")
                return

    def _tick(self, replicate: bool = True) -> None:
        """Pin (then replicate and persist) each rank's newest snapshot on the --replicate-every grid that
        is still in memory and not pinned yet."""
        if self._save_requested.is_set():
            self._save_requested.clear()
            self._save()
        if not self.options.pins:
            return
        due: dict[int, HeldSnapshot] = {}
        for held in self._own():
            on_grid = held.step > 0 and held.step % self.options.replicate_every == 0
            if on_grid and held.step > getattr(due.get(held.rank), "step", -1):
                due[held.rank] = held
        for rank, held in sorted(due.items()):
            step, path, crc = held.step, held.path, held.crc
            if self._tried.get(rank) == (step, crc):
                continue
            self._tried[rank] = (step, crc)  # once: a damaged one is not read again and again
            blob = self._pin(rank, path, step)
            if blob is None:
                continue
            for node, address in list(self._peers) if replicate else ():
                self._replicate(rank, step, node, address, blob)
            if self._checkpoint_due(rank, step):
                self._persisted_at[rank] = time.monotonic()
                self.persist(self._pins[rank][0].path, rank, step)

    def _checkpoint_due(self, rank: int, step: int) -> bool:
        """Every --checkpoint-every steps, and (--checkpoint-interval) when the rank's last one is that old."""
        if not self.options.checkpoint_dir:
            return False
        if step % self.options.checkpoint_every == 0:
            return True
        interval = self.options.checkpoint_interval
        return bool(interval) and time.monotonic() - self._persisted_at.setdefault(rank, time.monotonic()) >= interval

    def _pin(self, rank: int, path: str, step: int) -> bytearray | None:
        """A verified copy of the rank's snapshot at ``step`` kept aside (None if the rank is rewriting it)."""
        copied = self._copy_aside(rank, path, step, "pin", self._pins.get(rank, []))
        if copied is None:
            return None
        header, blob, target = copied
        with self._lock:
            self._pins[rank] = _newest_two(self._pins.get(rank, []), self._checked(_held(header, PINNED, target)))
        return blob

    def _copy_aside(self, rank: int, path: str, step: int, kind: str, held: list[HeldSnapshot]):
        """Read the rank's snapshot in ``path`` (under a shared lock: not while the rank writes it), check
        it, and write it to the older of the rank's two ``kind`` files; (header, bytes, file) or None."""
        try:
            with open(path, "rb") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None  # the rank is writing this file: that step is gone
                blob = read_whole(f)
        except OSError:
            return None
        try:
            header, blob = verified(blob, path)
        except SnapshotError as e:
            log.error("not keeping rank %d's snapshot: %s", rank, e)
            return None
        if header.step != step:
            return None
        target = self._slot(held, kind, rank)
        write_atomically(target, blob, durable=False)
        return header, blob, target

    def _slot(self, held: list[HeldSnapshot], kind: str, rank: int) -> str:
        """The file of the older of a rank's two copies of ``kind`` (or a free one)."""
        paths = [os.path.join(self.folder, f"{kind}-{rank:05d}.{i}") for i in (0, 1)]
        in_use = {h.path for h in held}
        free = [p for p in paths if p not in in_use]
        if free:
            return free[0]
        return min(held, key=lambda h: h.step).path

    def _replicate(self, rank: int, step: int, node: int, address: str, blob: bytearray) -> None:
        try:
            put(address, self.signer, str(rank), blob)
            self._unreachable.discard(address)
        except TransferError as e:
            if address not in self._unreachable:
                self._unreachable.add(address)
                log.warning("cannot replicate rank %d's step %d to node %d: %s", rank, step, node, e)

    def _receive(self, name: str, blob: bytearray) -> None:
        """A peer's replica (on the server's thread): kept once it verifies."""
        rank = int(name)
        header, blob = verified(blob, f"a replica of rank {rank}")
        if header.rank != rank:
            raise SnapshotError(f"a replica sent as rank {rank} holds rank {header.rank}")
        with self._lock:
            target = self._slot(self._replicas.get(rank, []), "replica", rank)
            self._replicas[rank] = [h for h in self._replicas.get(rank, []) if h.path != target]
        write_atomically(target, blob, durable=False)
        with self._lock:
            self._replicas[rank] = _newest_two(self._replicas[rank], self._checked(_held(header, REPLICA, target)))

    def _read(self, path: str) -> bytes:
        """A file a rank on another node asked for: only this node's snapshots and checkpoint files."""
        real = os.path.realpath(path)
        roots = [self.folder] + ([os.path.realpath(self.options.checkpoint_dir)] if self.options.checkpoint_dir else [])
        if not any(real.startswith(root + os.sep) for root in roots) or os.path.basename(real) == SNAPSHOT_TOKEN_FILE:
            raise TransferError(f"{path} is not a snapshot this node serves")
        try:
            with open(real, "rb") as f:
                return f.read()
        except OSError as e:
            raise TransferError(f"{path}: {e.strerror}") from None

    # -- persistence ----------------------------------------------------------------------------------

    def persist(self, source: str, rank: int, step: int) -> None:
        """Ask the persister to write the snapshot in ``source`` (rank ``rank`` at ``step``) to disk."""
        if self._persister is None:
            return
        request = {"source": source, "rank": rank, "step": step, "folder": self.options.checkpoint_dir,
                   "keep": self.options.keep}
        with self._persist_lock:
            try:
                self._persister.stdin.write(json.dumps(request).encode() + b"\n")
                self._persister.stdin.flush()
            except (OSError, ValueError):
                log.warning("the persister is gone: step %d of rank %d is not written to disk", step, rank)

    def save_newest(self) -> None:
        """--save-on-failure: write both of every rank's snapshots to disk (a fault was detected). Both:
        a rank that died while committing its newest holds a step less than the others, and only a step
        every rank holds makes a whole checkpoint. The snapshot thread copies them aside at once (healthy
        ranks go on writing theirs after the repair), then the persister writes the copies."""
        self._save_requested.set()

    def _save(self) -> None:
        for held in sorted(self._own(), key=lambda h: (h.rank, h.step)):
            if (held.rank, held.step) in self._disk or not self._good(held, verify=False):
                continue
            saved = self._saved.get(held.rank, [])
            copied = self._copy_aside(held.rank, held.path, held.step, "saved", saved)
            if copied is not None:
                header, _, target = copied
                self._saved[held.rank] = [_held(header, PINNED, target)] + [h for h in saved if h.path != target][:1]
                log.info("saving rank %d's step %d to %s", held.rank, held.step, self.options.checkpoint_dir)
                self.persist(target, held.rank, held.step)

    def _persisted(self) -> None:
        for line in self._persister.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if "error" in reply:
                log.warning("not written to %s: rank %s step %s: %s", self.options.checkpoint_dir, reply.get("rank"),
                            reply.get("step"), reply["error"])
                continue
            held = HeldSnapshot(reply["rank"], reply["step"], reply["world_size"], reply["sharded"], DISK,
                                reply["path"], reply["nbytes"], reply["crc"])
            with self._lock:
                self._disk[(held.rank, held.step)] = held
                steps = sorted({s for r, s in self._disk if r == held.rank}, reverse=True)
                old = [self._disk.pop((held.rank, s)) for s in steps[self.options.keep:]]
            for gone in old:
                _remove_shard(gone.path)

    def _persister_errors(self) -> None:
        for line in self._persister.stderr:
            log.warning("persister: %s", line.decode(errors="replace").rstrip())


def _remove_shard(path: str) -> None:
    """A checkpoint file past --keep-checkpoints, with its record (the step's folder once empty of shards)."""
    for name in (path, os.path.splitext(path)[0] + ".json"):
        try:
            os.unlink(name)
        except OSError:
            pass
    folder = os.path.dirname(path)
    if not glob.glob(os.path.join(folder, "rank-*")):
        shutil.rmtree(folder, ignore_errors=True)


def _identity(path: str, step: int, crc: int) -> tuple | None:
    """What tells one state of a copy's file from another (None when the file is gone)."""
    try:
        return path, step, crc, os.stat(path).st_mtime_ns
    except OSError:
        return None


def _held(header: Header, where: str, path: str) -> HeldSnapshot:
    return HeldSnapshot(header.rank, header.step, header.world_size, header.sharded, where, path, header.total,
                        header.crc)


def _newest_two(held: list[HeldSnapshot], new: HeldSnapshot) -> list[HeldSnapshot]:
    """``new`` and the newest older copy: after a restore to an older step, the copies of the steps
    beyond it (the abandoned run's) go."""
    older = [h for h in held if h.path != new.path and h.step < new.step]
    return [new] + sorted(older, key=lambda h: -h.step)[:1]


def _order(held: HeldSnapshot):
    return held.rank, -held.step, held.where
