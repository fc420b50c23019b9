"""Data parallelism that survives a repair: ftrun's own wrapper, and torch's DDP made repair-proof."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
import torch.distributed as dist

from ftrun.elastic.groups import DoneWork
from ftrun.elastic.shards import is_dtensor
from ftrun.elastic.shards import local_tensor as _local

log = logging.getLogger(__name__)

#: the gradient bucket size, and the first bucket's (the last layers'), as DistributedDataParallel's defaults:
#: a small first bucket starts communicating early in the backward pass
BUCKET_MB, FIRST_BUCKET_MB = 25.0, 1.0
NO_GRADIENT = "ElasticDDP: a parameter got no gradient in this step (every parameter that requires one must get one)"


class ElasticDDP(torch.nn.Module):
    """Data parallelism that survives a repair: gradients averaged over a group of data-parallel ranks.

    Like DistributedDataParallel, the parameters are broadcast from the group's first rank before the
    first forward, and the gradients are averaged in buckets whose all-reduce starts while the
    backward pass goes on (a bucket goes once all of its gradients are ready and every bucket before
    it went), so the network works during the backward. As DDP's ``gradient_as_bucket_view``, each
    gradient is then a view of its bucket, which holds the average: nothing is copied back. Unlike it:

    * the bucket layout is fixed when the wrapper is made (reverse parameter order, the order in
      which a backward pass usually produces gradients) and never rebuilt, so every rank, a
      replacement included, sums in the same order and a repaired run stays bit-identical to a
      fault-free one (DDP lays its buckets out anew after its first iteration, from rank 0);
    * buffers (BatchNorm's running statistics) are broadcast from the group's first rank at the end
      of each backward pass, not before each forward: every rank then commits a step holding the
      same buffers, so whichever healthy rank hands the state to a replacement, it hands the first
      rank's buffers. The next forward sees exactly what DDP's broadcast would have given it (and
      the job puts back what the forward of a step lost to a fault did to them).

    ``group`` (a ProcessGroup or a 1-D DeviceMesh) is the data-parallel group, the default group if
    None. Every parameter that requires a gradient must get one in every step. For gradient
    accumulation over several backward passes (microbatches, a pipeline schedule), run them under
    :meth:`no_sync` and call :meth:`sync_gradients` after the last.
    """

    def __init__(self, module: torch.nn.Module, group=None, bucket_mb: float = BUCKET_MB):
        super().__init__()
        self.module = module
        self._group = group.get_group() if hasattr(group, "get_group") else group
        self._synced = False
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int(bucket_mb * 2**20)
        self._buckets = _lay_out(list(reversed(params)), cap, min(cap, int(FIRST_BUCKET_MB * 2**20)))
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._flats: list[torch.Tensor | None] = [None] * len(self._buckets)
        self._views: list[dict[int, torch.Tensor] | None] = [None] * len(self._buckets)
        self._syncing = True
        self._start_step()
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if not self._synced:
            self._broadcast_all([*self.module.parameters(), *self.module.buffers()])
            self._synced = True
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this block only accumulate gradients locally (as DDP's ``no_sync``)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def sync_gradients(self) -> None:
        """Average the gradients accumulated under :meth:`no_sync` over the group now."""
        self._waiting = [0] * len(self._buckets)
        self._finish()

    def reset(self, synced: bool) -> None:
        """After a repair; ``synced``: every rank already holds the same parameters."""
        self._start_step()
        self._synced = synced

    # -- the gradients' way ------------------------------------------------------------------------------

    def _start_step(self) -> None:
        self._waiting = [len(bucket) for bucket in self._buckets]
        self._works: list = []
        self._queued = False
        #: the parameters whose gradients are in their buckets (divided) in this step
        self._taken: set[int] = set()
        self._scale = 1.0 / dist.get_world_size(self._group)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._syncing:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        index = self._bucket_of[id(param)]
        self._take(param, index)
        self._waiting[index] -= 1
        while len(self._works) < len(self._buckets) and self._waiting[len(self._works)] == 0:
            self._launch(len(self._works))

    def _take(self, param: torch.Tensor, index: int) -> None:
        """``param``'s gradient into its part of bucket ``index``, divided by the group's size on the way
        (DDP's order: the average is a sum of parts); the gradient is then that part (DDP's
        ``gradient_as_bucket_view``), so nothing is copied back and the fresh one is freed at once."""
        if id(param) in self._taken:
            return
        if param.grad is None:
            raise RuntimeError(NO_GRADIENT)
        self._taken.add(id(param))
        part = self._parts(index)[id(param)]
        grad = _local(param.grad)
        if _same_memory(grad, part):  # already the part: zero_grad() zeroed it rather than set it to None
            part.mul_(self._scale)
            return
        torch.mul(grad, self._scale, out=part)
        if not is_dtensor(param.grad):  # a DTensor's local tensor takes the average at the end
            param.grad = part

    def _launch(self, index: int) -> None:
        """Bucket ``index``'s all-reduce, once each of its gradients is in it."""
        for param in self._buckets[index]:
            self._take(param, index)  # after no_sync(), nothing was taken yet
        self._works.append(dist.all_reduce(self._flats[index], group=self._group, async_op=True))

    def _parts(self, index: int) -> dict[int, torch.Tensor]:
        """Each parameter's part of bucket ``index``'s flat buffer (by the parameter's id), shaped as it.
        The buffer is made at the first step (after the script moved the model) and kept: a fresh one
        per step costs page faults."""
        parts = self._views[index]
        if parts is None:
            locals_ = [_local(param) for param in self._buckets[index]]
            flat = self._flats[index] = torch.empty(sum(t.numel() for t in locals_), dtype=locals_[0].dtype,
                                                    device=locals_[0].device)
            parts, offset = {}, 0
            for param, local in zip(self._buckets[index], locals_):
                parts[id(param)] = flat[offset:offset + local.numel()].view_as(local)
                offset += local.numel()
            self._views[index] = parts
        return parts

    def _finish(self) -> None:
        """At the end of the backward pass: the last buckets go, every bucket is waited for (each
        gradient is its part of the bucket), and the buffers are made the group's first rank's."""
        missing = [i for i in range(len(self._works), len(self._buckets)) if self._waiting[i]]
        if missing:
            raise RuntimeError(NO_GRADIENT)
        for index in range(len(self._works), len(self._buckets)):
            self._launch(index)
        for index, work in enumerate(self._works):
            work.wait()
            for param in self._buckets[index]:
                if is_dtensor(param.grad):
                    _local(param.grad).copy_(self._parts(index)[id(param)])
        self._broadcast_all(list(self.module.buffers()))
        self._start_step()

    def _broadcast_all(self, tensors: list[torch.Tensor]) -> None:
        """The group's first rank's values of ``tensors``: one broadcast per dtype and device, each end to
        end in one buffer (as DDP's ``_sync_module_states``), not one per tensor."""
        kinds: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            local = _local(tensor.data)
            kinds.setdefault((local.dtype, local.device), []).append(local)
        for same in kinds.values():
            flat = torch.cat([t.reshape(-1) for t in same]) if len(same) > 1 else same[0].reshape(-1)
            dist.broadcast(flat, group_src=0, group=self._group)
            if flat.data_ptr() != same[0].data_ptr():
                offset = 0
                for t in same:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()


def _same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return tensor.data_ptr() == view.data_ptr() and tensor.shape == view.shape and tensor.stride() == view.stride()


def _lay_out(params: list[torch.Tensor], cap: int, first_cap: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, a bucket closed once it holds ``first_cap`` bytes
    (the first) or ``cap`` (each after it): DDP's rule, so the first bucket also takes the parameter
    that crosses its cap, and its all-reduce overlaps more of the backward pass."""
    buckets: list[list[torch.Tensor]] = []
    size, open_ = 0, False
    for param in params:
        last = buckets[-1] if buckets else None
        if not (open_ and last and (last[0].dtype, last[0].device) == (param.dtype, param.device)):
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += _local(param).numel() * param.element_size()
        open_ = size < (first_cap if len(buckets) == 1 else cap)
    return buckets


#: every torch DistributedDataParallel made in this process since :func:`track_torch_ddp`, in the order made (the
#: same on every rank, which names their bucket layouts alike), held weakly
_made: list[weakref.ref] = []


def track_torch_ddp() -> None:
    """Remember every torch ``DistributedDataParallel`` made from now on (once per process), so that the
    first ``steps()`` registers the bucket layout of each (one whose inner module was registered, not the
    wrapper, too) without searching the whole heap for it (a tenth of a second in a replacement's startup)."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    original = ddp_class.__init__
    if getattr(original, "_ftrun_tracks", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _made.append(weakref.ref(self))

    __init__._ftrun_tracks = True  # type: ignore[attr-defined]
    ddp_class.__init__ = __init__  # type: ignore[method-assign]


def torch_ddps() -> list[torch.nn.parallel.DistributedDataParallel]:
    """The torch DDPs made since :func:`track_torch_ddp` that are still alive, in the order made."""
    return [made for made in (ref() for ref in _made) if made is not None]


def pin_buckets(module: torch.nn.Module) -> bool:
    """Fix the bucket layout of a torch ``DistributedDataParallel`` now, in parameter order, as torch's own
    ``Join`` does (the Trainer's integration does, for the DDP it makes after the job's steps started).

    DDP lays its gradient buckets out anew after its first iteration, from the order in which rank
    0 saw gradients, and broadcasts that layout from rank 0 once. A replacement rank would do that
    alone, in the middle of the healthy ranks' training, and wait for ever. Pinned on every rank (the
    replacement too: its layout comes from the same model, in parameter order), no rank ever rebuilds.
    True when ``module`` is a DDP (pinning it again does nothing).
    """
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return False
    reducer = module.reducer
    reducer._push_all_rebuilt_params()
    if reducer._rebuild_buckets():
        module._has_rebuilt_buckets = True  # as DDP's own says it, once laid out
    return True


class BucketLayout:
    """A torch DDP's gradient bucket layout, as registered state: a replacement rank lays its buckets out as
    its peers did, without them.

    DDP lays its buckets out anew once, as the forward after its first iteration begins: in the order rank
    0's gradients became ready in it, broadcast from rank 0 (two broadcasts: the parameters' indices bucket
    after bucket, then each bucket's size). That layout is left to DDP, so that a fault-free run sums its
    gradients as it does under torchrun: with more than two ranks, gloo's ring all-reduce sums each part of
    a bucket starting from another rank, and another layout changes the last bits of the result. Only what
    rank 0 broadcast is kept, on the way (each forward begins with :meth:`settle`, which does DDP's layout
    for it, then nothing once done); a replacement, whose DDP is new while its peers train, is given that
    with the state and lays its buckets out by it, its broadcasts answered with what its peers received. A
    repair before that (in the first step) has every rank start the layout afresh (:meth:`settle_after_repair`).
    """

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel):
        self.ddp = ddp
        #: what rank 0 broadcast as DDP laid its buckets out (empty before it did)
        self.broadcasts: list[torch.Tensor] = []
        #: DDP keeps its first layout for good where it looks for unused parameters in a graph not static
        self._kept = ddp.find_unused_parameters and not ddp.static_graph
        original = ddp._pre_forward

        def pre_forward(*args, **kwargs):
            if torch.is_grad_enabled():  # as DDP's own
                self.settle()
            return original(*args, **kwargs)

        ddp._pre_forward = pre_forward  # type: ignore[method-assign]

    def settle(self) -> None:
        """What DDP does as a forward begins: its layout, where its first iteration is over and it has not
        laid its buckets out yet."""
        if not (self._kept or self.ddp._has_rebuilt_buckets):
            self._rebuild(_LayoutBroadcasts(self.ddp.process_group))

    def settle_after_repair(self) -> None:
        """At the end of a repair before DDP laid its buckets out (in the first step): what the healthy ranks'
        backward of the lost step noted of its gradients' order is dropped (a replacement has none), so that
        every rank runs the step again in DDP's first layout and lays its buckets out after it, together."""
        if not self.ddp._has_rebuilt_buckets:
            self.ddp.reducer._reset_state()

    def state_dict(self) -> dict:
        return {"broadcasts": list(self.broadcasts)}

    def load_state_dict(self, state: dict) -> None:
        if state["broadcasts"] and not self.ddp._has_rebuilt_buckets:
            self._rebuild(_LayoutBroadcasts(self.ddp.process_group, answers=state["broadcasts"]),
                          in_parameter_order=True)

    def _rebuild(self, through: "_LayoutBroadcasts", in_parameter_order: bool = False) -> None:
        """``_rebuild_buckets`` (it does nothing before an iteration gave it an order, unless
        ``in_parameter_order`` gives it one that has none), its broadcasts through ``through``."""
        reducer = self.ddp.reducer
        reducer._update_process_group(through)
        try:
            if in_parameter_order:
                reducer._push_all_rebuilt_params()  # nothing where an iteration gave the order
            rebuilt = reducer._rebuild_buckets()
        finally:
            reducer._update_process_group(self.ddp.process_group)
        if rebuilt:
            self.broadcasts = through.received
            self.ddp._has_rebuilt_buckets = True  # as DDP's own says it, once laid out


class _LayoutBroadcasts(dist.ProcessGroup):
    """The group a DDP's reducer lays its buckets out through: each broadcast goes to the DDP's own group and
    what it brings is kept; with ``answers``, each is answered with the next of them instead."""

    def __init__(self, group: dist.ProcessGroup, answers: list[torch.Tensor] | None = None):
        super().__init__(group.rank(), group.size())  # type: ignore[call-arg]
        self.group = group
        self.answers = list(answers) if answers is not None else None
        #: what each broadcast brought, in order
        self.received: list[torch.Tensor] = []

    def getBackendName(self) -> str:
        return "ftrun-layout"

    def broadcast(self, tensors, opts=None):
        if self.answers is None:
            work = self.group.broadcast(tensors, opts) if opts is not None else self.group.broadcast(tensors)
            work.wait()
        else:
            tensors[0].copy_(self.answers.pop(0))
            work = DoneWork(tensors)
        self.received.append(tensors[0].detach().cpu().clone())
        return work
