"""Process groups that outlive a repair.

Every group a script makes through torch (the default group, each ``new_group``, each
``DeviceMesh`` dimension) is an :class:`ElasticGroup`: a ``torch.distributed.ProcessGroup``
written in Python that hands each collective to the real group of the current generation
(gloo, nccl or hccl, made by the backend seam). A repair drops every real group and names the next
generation; each ``ElasticGroup`` connects its new real group at its first collective after that,
under a store prefix of the new generation and of the group's own name. So the objects that
torch and the script hold (DDP's reducer, FSDP2's mesh, DTensor placements, the script's own
groups) stay the same and keep working, and no generation ever reads another's keys.

The same design as TorchFT's reconfigurable process groups (a Python ``ProcessGroup`` whose
collectives go to a real group that a reconfiguration replaces), with two differences: ftrun
plugs in as a torch backend (``init_process_group("ftrun")``), so every group torch makes on
top of the default one is reconfigurable too, and it connects lazily. The ranks of a group make
its collectives in the same order, so they connect it at the same point, and a group that a
replacement rank makes only later in its script is connected only once it is used.

A replacement rank answers the collectives of its script's setup (before its first
``job.steps()``) locally: its peers are in the middle of training, not in a constructor, and
everything those collectives would fill is replaced by the state the rollback brings.

Inside a step (``job.guard()``), a collective that fails (a peer died, or the repair watcher
released it) does not raise into the library that called it. As in TorchFT, the group records
the failure and answers that collective and every later one of the step locally, so that FSDP2's
and DDP's hooks finish their bookkeeping instead of being cut off half way (an FSDP2 root
interrupted in its final backward callback never queues it again). The step then stops at the
optimizer's step (``GroupFailed``), its state untouched, and the repair takes over.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import logging
import re
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ftrun.elastic.backends import CommBackend
from ftrun.step_times import CollectiveWait

log = logging.getLogger(__name__)

#: the torch backend name under which ftrun's groups are made
BACKEND = "ftrun"

#: every collective of torch's ProcessGroup, each handed to the current generation's real group
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall", "alltoall_base",
    "all_to_all_single", "send", "recv", "recv_anysource", "barrier", "monitored_barrier",
)

#: the collectives as torch.distributed's functions call them, where the ProcessGroup's method is named otherwise
#: (what a user reads in a stall's line: ``dist.all_reduce`` calls ``allreduce``); the rest keep their names
OP_NAMES = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
    "allgather_coalesced": "all_gather_coalesced", "allgather_into_tensor_coalesced": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor", "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
}


class GroupError(RuntimeError):
    """A group that cannot be (re)connected in this generation."""


class GroupFailed(RuntimeError):
    """A collective of this step failed: the step's results are not to be used."""


#: where in its sources a backend raised, ahead of its message ("[/.../gloo/transport/tcp/pair.cc:537] ")
_SOURCE_PLACE = re.compile(r"^\[[^\]\s]+:\d+\]\s*")


def first_line(error: BaseException) -> str:
    """A failure in one line, for a log: a collective's error can run to a page of C++ context, and
    starts with the place in gloo's sources it came from, which tells a user nothing."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return _SOURCE_PLACE.sub("", line)[:200]


class ElasticGroup(dist.ProcessGroup):
    """One process group of the script, the same object in every generation (see the module's text)."""

    def __init__(self, owner: "GroupSet", name: str, rank: int, size: int, ranks: tuple[int, ...]):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (rank, size) overload of Python groups
        self._owner = owner
        #: torch's name for the group: the same on every rank, since every rank makes every group
        self._name = name
        #: the group's members, by global rank
        self.global_ranks = ranks
        self._real: dist.ProcessGroup | None = None
        self._real_generation = -1
        self._connecting_store: dist.Store | None = None
        #: how many elements the script all-reduced over this group since GroupSet.count_reductions():
        #: the evidence that its ranks hold copies (ftrun/elastic/meshes.py)
        self.reduced = 0

    # torch reads the name through these (functional collectives and DeviceMesh resolve groups by name)
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def real(self) -> dist.ProcessGroup:
        """The current generation's real group, connected at its first use."""
        if self._real is None or self._real_generation != self._owner.generation:
            self._owner.connect(self)
        return self._real

    def drop(self) -> dist.ProcessGroup | None:
        """Forget the real group (the repair aborts and releases it); returns it."""
        real, self._real = self._real, None
        return real

    def _attach(self, real: dist.ProcessGroup, generation: int) -> None:
        self._real, self._real_generation = real, generation


def _collective(op: str) -> Callable:
    reduces = op in ("allreduce", "allreduce_coalesced")

    def run(self: ElasticGroup, *args, **options):
        # torch passes some options by name (``barrier(opts=...)``), always after the tensors
        everything = (*args, *options.values())
        if reduces and args:
            self.reduced += sum(t.numel() for t in args[0]) if isinstance(args[0], list) else args[0].numel()
        owner = self._owner
        if owner.local or owner.failure is not None:
            return answer_locally(op, self.rank(), self.size(), everything)
        if not owner.in_step:
            return getattr(self.real(), op)(*args, **options)
        try:
            work = getattr(self.real(), op)(*args, **options)
        except Exception as e:
            owner.fail(e)
            return answer_locally(op, self.rank(), self.size(), everything)
        if work is None:
            # the backend waited for it already: NCCL does for a caller that will not wait
            # (``opts.asyncOp`` False, torch 2.8 on), and torch reads None as done
            return None
        return _Guarded(work, owner, op, self.rank(), self.size(), everything, self.group_name)

    run.__name__ = op
    run.__doc__ = f"``{op}`` on the current generation's real group."
    return run


for _op in COLLECTIVES:
    setattr(ElasticGroup, _op, _collective(_op))


class GroupSet:
    """Every ElasticGroup of this process, the generation they connect in, and the repair's hooks."""

    def __init__(self, backend: CommBackend, store: dist.Store, prefix: Callable[[int], str], timeout: float):
        self.backend = backend
        self.store = store
        #: the store prefix of a generation's groups (JobKeys.process_group)
        self.prefix = prefix
        self.timeout = timeout
        self.groups: list[ElasticGroup] = []
        self.generation = -1
        #: a replacement's setup: collectives are answered locally until its first job.steps()
        self.local = False
        #: inside a step's guard: a failed collective is recorded, not raised (see the module's text)
        self.in_step = False
        #: the first failure of this generation's collectives in a step, until the repair
        self.failure: BaseException | None = None
        #: the newest generation a newer one superseded: its groups' connections give up
        self.abandoned = -1
        #: told of the first failure of a step's collectives, from whichever thread saw it (the link reports it)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()
        #: the futures of guarded collectives not yet settled, which abandon() settles locally
        self._pending: "weakref.WeakSet[_Settled]" = weakref.WeakSet()
        #: a collective of the current real groups was given up while it waited: it may never end
        self.stuck = False
        #: seconds the training thread spent blocked in guarded collectives' waits (the step clock reads it:
        #: a step's compute time is its time less these)
        self.waited = 0.0
        #: the guarded collectives waited for now (a wait, or a future handed out and not yet settled), by a
        #: token each: the heartbeat reports the oldest (a stall says which ranks wait in which collective)
        self._waits: dict[int, CollectiveWait] = {}
        self._tokens = itertools.count()

    def wait_begins(self, op: str, group: str, size: int) -> int:
        """A guarded collective is waited for from now (from any thread); the token for :meth:`wait_ends`."""
        token = next(self._tokens)
        self._waits[token] = CollectiveWait(OP_NAMES.get(op, op), group, size, time.time())
        return token

    def wait_ends(self, token: int) -> None:
        self._waits.pop(token, None)

    def waiting_now(self) -> CollectiveWait | None:
        """The collective this rank has waited in longest of those it waits in now (None: none), for the
        heartbeat (another thread than the ones that begin and end waits)."""
        while True:
            try:
                waits = list(self._waits.values())
                break
            except RuntimeError:  # changed by another thread while copied: copy again
                continue
        return min(waits, key=lambda w: w.since) if waits else None

    def create(self, options, backend_options=None) -> ElasticGroup:
        """torch's creator for the ``ftrun`` backend (``Backend.register_backend(..., extended_api=True)``)."""
        ranks = tuple(options.global_ranks_in_group or range(options.group_size))
        group = ElasticGroup(self, str(options.group_id), options.group_rank, options.group_size, ranks)
        with self._lock:
            self.groups.append(group)
        return group

    def connect(self, group: ElasticGroup) -> None:
        generation = self.generation
        if generation < 0:
            raise GroupError(f"group {group.group_name}: used before the job's first generation formed")
        if generation <= self.abandoned:
            raise GroupError(f"group {group.group_name}: generation {generation} was superseded")
        # the real group keeps the store, but only a Python reference keeps the Python half of it alive
        group._connecting_store = _Abandonable(self, generation)
        store = dist.PrefixStore(f"{self.prefix(generation)}/{group.group_name}", group._connecting_store)
        try:
            real = self.backend.connect(store, group.rank(), group.size(), self.timeout, group.global_ranks,
                                        f"{generation}_{group.group_name}")
        except Exception as e:
            raise GroupError(f"group {group.group_name} ({len(group.global_ranks)} ranks) could not connect in "
                             f"generation {generation}: {e}") from None
        group._attach(real, generation)

    def reconfigure(self, generation: int) -> None:
        """The next generation's groups: each connects at its next collective."""
        self.generation = generation
        self.failure = None
        self._waits.clear()  # an earlier generation's: given up, or settling without anyone waiting

    def fail(self, error: BaseException) -> None:
        """A collective of the step failed: the rest of the step is answered locally."""
        if self.failure is None:
            log.info("a collective failed (%s); the step goes on without communication until the repair",
                     first_line(error))
            self.failure = error
            if self.on_failure is not None:
                self.on_failure(error)

    def interrupt(self) -> None:
        """Release a collective blocked on a healthy peer (from another thread, once a repair is announced)."""
        self.backend.interrupt()

    def abandon(self, generation: int) -> None:
        """A newer generation was announced (from another thread): a group of ``generation`` or
        older that is still connecting gives up, since a peer it waits for may be dead, and so does every
        collective of theirs still waited for. A cut link can leave one that never ends: its sockets
        aborted under it, gloo's work waits out the collective timeout (seen after ``ss -K``, 300 s)."""
        self.abandoned = max(self.abandoned, generation)
        for pending in list(self._pending):
            if pending.generation <= generation:
                pending.give_up()

    def release(self) -> None:
        """Abort and drop every real group: their peers blocked on this rank are released.

        gloo closes a group's sockets (which releases the peers) only when the group object goes.
        Mostly the last reference goes with ``drop()``; queued asynchronous work in a reference
        cycle may hold one, so the younger garbage generations are collected first, and all of the
        heap (a tenth of a second or more, on the repair's critical path) only while a group lives.
        """
        dropped = [real for real in (group.drop() for group in list(self.groups)) if real is not None]
        self.backend.release(dropped)
        if self.stuck:
            # a collective given up still runs in gloo's worker thread, which the group's destructor joins:
            # it would hold this rank until the collective timeout (300 s, after a cut link); let another
            # thread wait for it (the groups of the next generation are new ones)
            self.stuck = False
            threading.Thread(target=dropped.clear, name="ftrun-group-reaper", daemon=True).start()
            return
        alive = [weakref.ref(real) for real in dropped]
        del dropped
        for generation in (0, 1, 2):
            if not any(ref() is not None for ref in alive):
                return
            gc.collect(generation)

    def count_reductions(self) -> None:
        """Count every group's all-reduced elements afresh from now on (ElasticGroup.reduced)."""
        for group in list(self.groups):
            group.reduced = 0

    def foreign_groups(self) -> list[str]:
        """Groups of this process that are not ftrun's (made with an explicit other backend): a repair
        cannot re-form them. Read from torch's group map, which has no public accessor."""
        found = []
        for group, (backend, _) in getattr(dist.distributed_c10d._world, "pg_map", {}).items():
            if not isinstance(group, ElasticGroup):
                found.append(f"{getattr(group, 'group_name', '?')} ({backend})")
        return found


_registered: GroupSet | None = None


def install(groups: GroupSet, devices: tuple[str, ...]) -> None:
    """Make ``groups`` torch's ``ftrun`` backend for ``devices`` (once per process)."""
    global _registered
    if _registered is None:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(devices))
    _registered = groups


def _create(options, backend_options=None) -> ElasticGroup:
    if _registered is None:
        raise GroupError("the ftrun backend is used outside ftrun.elastic.init()")
    return _registered.create(options, backend_options)


def init_default_group(groups: GroupSet, rank: int, world_size: int, timeout: float) -> None:
    """torch's default group, an ElasticGroup (its store is only torch's: ftrun's groups use their own)."""
    store = dist.PrefixStore("torch", groups.store)
    dist.init_process_group(BACKEND, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))


class DoneWork(dist._Work):
    """A collective answered without communication."""

    def __init__(self, result):
        super().__init__()
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class _Abandonable(dist.Store):
    """The store a real group connects through: its waits give up once the generation is superseded.

    A real group's constructor waits on the store for every peer's address. A peer that died after
    arriving in the generation never writes it, and the wait would last the whole timeout; so the
    waits poll with ``check`` (a timed-out ``wait`` would make torch log two lines each time, into
    every rank's stderr, all through a repair), and between polls the generation is checked.
    """

    #: the longest pause between two polls (they start at a millisecond and double)
    POLL = 0.02

    def __init__(self, owner: GroupSet, generation: int):
        super().__init__()
        self._owner, self._generation, self._store = owner, generation, owner.store

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or datetime.timedelta(seconds=self._owner.timeout)).total_seconds()
        pause = 0.001
        while not self._store.check(keys):
            if self._owner.abandoned >= self._generation:
                raise GroupError(f"generation {self._generation} was superseded while its groups connected")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"timed out after waiting for {', '.join(keys)} to connect a group")
            time.sleep(pause)
            pause = min(2 * pause, self.POLL)

    def set(self, key, value):
        self._store.set(key, value)

    def get(self, key):
        self._wait([key])
        return self._store.get(key)

    def add(self, key, value):
        return self._store.add(key, value)

    def compare_set(self, key, expected, desired):
        return self._store.compare_set(key, expected, desired)

    def check(self, keys):
        return self._store.check(keys)

    def delete_key(self, key):
        return self._store.delete_key(key)

    def num_keys(self):
        return self._store.num_keys()

    def wait(self, keys, timeout=None):
        self._wait(keys, timeout)

    def multi_get(self, keys):
        self._wait(keys)
        return self._store.multi_get(keys)

    def multi_set(self, keys, values):
        self._store.multi_set(keys, values)


#: how long a guarded collective's wait lasts before it looks whether its generation was given up
WAIT_SLICE = datetime.timedelta(seconds=0.05)
#: a wait's timeout that means none: torch's ``kNoTimeout``, what C++ passes when it waits on a work (DDP's
#: reducer on its unused-parameter map's allreduce, with ``find_unused_parameters=True``, as the Trainer sets
#: it), and ``Work.wait()``'s default
NO_TIMEOUT = datetime.timedelta(0)
#: point-to-point works, waited whole: a gloo send or recv whose wait with a timeout runs out closes its
#: pair ("Timed out waiting 50ms for recv operation to complete", then "Application timeout caused pair
#: closure" at the next wait), and its is_completed() stays False until a wait, so it cannot be polled
#: either. A pipeline stage's recv outlasts a slice whenever the stage before it is slow; a cut link during
#: one holds the step until the group's own timeout
WHOLE_WAITS = frozenset({"send", "recv", "recv_anysource"})


def _superseded(generation: int) -> GroupError:
    return GroupError(f"generation {generation} was superseded while a collective waited")


class _Guarded(dist._Work):
    """A real collective's work whose failure is recorded on the group set instead of raised."""

    def __init__(self, real, owner: GroupSet, op: str, rank: int, size: int, args: tuple, group: str = ""):
        super().__init__()
        self._real, self._owner = real, owner
        self._op, self._rank, self._size, self._args, self._group = op, rank, size, args, group
        #: the generation it belongs to: once a newer one is announced, nothing waits for it any more
        self._generation = owner.generation

    def wait(self, timeout=None) -> bool:
        began = time.perf_counter()
        token = self._owner.wait_begins(self._op, self._group, self._size)
        try:
            if timeout is not None and timeout != NO_TIMEOUT:
                return self._real.wait(timeout)
            sliced = self._owner.backend.sliced_waits and self._op not in WHOLE_WAITS
            return self._wait_unless_given_up() if sliced else self._real.wait()
        except Exception as e:
            self._owner.fail(e)
            return True
        finally:
            self._owner.wait_ends(token)
            self._owner.waited += time.perf_counter() - began

    def _wait_unless_given_up(self) -> bool:
        """Wait in slices (a wait returns the moment the work completes, whatever its slice), and give up
        once the generation was: the work may never end (its sockets aborted under it by a cut link)."""
        while True:
            try:
                return self._real.wait(WAIT_SLICE)
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise  # it failed ("Operation timed out!" is torch's word for the slice's end)
                if self._real.is_completed():
                    # it ended just after the slice did: its own outcome (taken for a failure, a healthy
                    # job's collective that took a little over a slice started an online repair)
                    return self._real.wait()
                if self._owner.abandoned >= self._generation:
                    self._owner.stuck = True
                    raise _superseded(self._generation) from None

    def is_completed(self) -> bool:
        try:
            return self._real.is_completed()
        except Exception:
            return True

    def is_success(self) -> bool:
        return self._owner.failure is None

    def get_future(self) -> torch.futures.Future:
        # whoever holds the future waits on it (torch's DDP reducer, in C++, at the end of the backward pass):
        # counted as waited for from now until it settles
        settled = _Settled(self._owner, self._generation,
                           lambda: answer_locally(self._op, self._rank, self._size, self._args).get_future().value(),
                           self._owner.wait_begins(self._op, self._group, self._size))
        self._owner._pending.add(settled)
        self._real.get_future().add_done_callback(settled.settle)
        return settled.future


class _Settled:
    """The future a guarded collective hands out: settled by the real one, or locally, as a failure,
    when its generation is given up first (the real one may never complete: ``GroupSet.abandon``);
    whichever comes first, once."""

    def __init__(self, owner: GroupSet, generation: int, local: Callable[[], object], token: int = -1):
        self.future: torch.futures.Future = torch.futures.Future()
        self.generation = generation
        self._owner, self._local, self._token = owner, local, token
        self._lock = threading.Lock()
        self._done = False

    def settle(self, done: torch.futures.Future) -> None:
        try:
            result = done.value()
        except Exception as e:
            self._fail(e)
            return
        with self._lock:
            if self._done:
                return
            self._done = True
        self._owner.wait_ends(self._token)
        self.future.set_result(result)

    def give_up(self) -> None:
        if self._fail(_superseded(self.generation)):
            self._owner.stuck = True

    def _fail(self, error: BaseException) -> bool:
        """Settle it locally, as a failure; False when it was settled already."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        self._owner.wait_ends(self._token)
        self._owner.fail(error)
        self.future.set_result(self._local())
        return True


def answer_locally(op: str, rank: int, size: int, args: tuple) -> dist._Work:
    """A collective as if every rank held what this one holds: gathers repeat its input, a
    reduce-scatter keeps its own part, reductions and broadcasts leave its tensors as they are,
    point-to-point and barriers return at once. What the script's setup checks (DDP compares every
    rank's parameter shapes) passes, and what it fills is replaced by the rollback's state."""
    if op in ("allgather", "allgather_coalesced"):  # (lists of outputs, inputs)
        for outputs, tensor in zip(args[0], args[1]):
            for output in outputs:
                output.copy_(tensor)
    elif op in ("_allgather_base", "all_gather_single"):  # (output, input): the inputs end to end
        _repeat(args[0], args[1], size)
    elif op in ("allgather_into_tensor_coalesced", "all_gather_single_coalesced"):
        for output, tensor in zip(args[0], args[1]):
            _repeat(output, tensor, size)
    elif op == "reduce_scatter":  # (outputs, lists of inputs)
        for output, inputs in zip(args[0], args[1]):
            output.copy_(inputs[rank])
    elif op in ("_reduce_scatter_base", "reduce_scatter_single"):  # (output, input): this rank's part
        args[0].view(-1).copy_(args[1].reshape(size, -1)[rank])
    elif op in ("reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced"):
        for output, tensor in zip(args[0], args[1]):
            output.view(-1).copy_(tensor.reshape(size, -1)[rank])
    # reductions, broadcasts, all-to-all, scatter/gather, send/recv, barriers: as they are
    return DoneWork(_outputs(op, args))


def _repeat(output: torch.Tensor, tensor: torch.Tensor, size: int) -> None:
    output.view(size, -1).copy_(tensor.reshape(1, -1).expand(size, -1))


def _outputs(op: str, args: tuple) -> list:
    """What the collective's future holds when it is done: its output tensors (DDP's reducer reads them)."""
    if op in ("barrier", "monitored_barrier") or not args:
        return []
    first = args[0]
    return [first] if isinstance(first, torch.Tensor) else list(first)
