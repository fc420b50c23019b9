"""Data parallelism that survives a repair: ftrun's own wrapper, and torch's DDP made repair-proof."""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref

import torch
import torch.distributed as dist

from ftrun.elastic.shards import local_tensor as _local

log = logging.getLogger(__name__)

#: the gradient bucket size, and the first bucket's (the last layers'), as DistributedDataParallel's defaults:
#: a small first bucket starts communicating early in the backward pass
BUCKET_MB, FIRST_BUCKET_MB = 25.0, 1.0


class ElasticDDP(torch.nn.Module):
    """Data parallelism that survives a repair: gradients averaged over a group of data-parallel ranks.

    Like DistributedDataParallel, the parameters are broadcast from the group's first rank before the
    first forward, and the gradients are averaged in buckets whose all-reduce starts while the
    backward pass goes on (a bucket goes once all of its gradients are ready and every bucket before
    it went), so the network works during the backward. Unlike it:

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
        self._syncing = True
        self._start_step()
        for param in params:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args, **kwargs):
        if not self._synced:
            for tensor in (*self.module.parameters(), *self.module.buffers()):
                self._broadcast(tensor)
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

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._syncing:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._waiting[self._bucket_of[id(param)]] -= 1
        while len(self._works) < len(self._buckets) and self._waiting[len(self._works)] == 0:
            self._launch(len(self._works))

    def _launch(self, index: int) -> None:
        grads = [_local(p.grad) for p in self._buckets[index]]
        flat = self._flats[index]
        if flat is None:  # allocated once: a fresh buffer per step costs page faults
            flat = self._flats[index] = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype,
                                                    device=grads[0].device)
        torch.cat([g.reshape(-1) for g in grads], out=flat)
        self._works.append(dist.all_reduce(flat, group=self._group, async_op=True))

    def _finish(self) -> None:
        """At the end of the backward pass: the last buckets go, every bucket is waited for and
        averaged back into the gradients, and the buffers are made the group's first rank's."""
        missing = [i for i in range(len(self._works), len(self._buckets)) if self._waiting[i]]
        if missing:
            raise RuntimeError("ElasticDDP: a parameter got no gradient in this step (every parameter that "
                               "requires one must get one)")
        for index in range(len(self._works), len(self._buckets)):
            self._launch(index)
        size = dist.get_world_size(self._group)
        for work, bucket, flat in zip(self._works, self._buckets, self._flats):
            work.wait()
            flat.div_(size)
            offset = 0
            for param in bucket:
                grad = _local(param.grad)
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        for buffer in self.module.buffers():
            self._broadcast(buffer)
        self._start_step()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(_local(tensor.data), group_src=0, group=self._group)


def _lay_out(params: list[torch.Tensor], cap: int, first_cap: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters of one dtype and device, up to ``first_cap`` bytes in the first bucket and
    ``cap`` in each after it."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for param in params:
        nbytes = _local(param).numel() * param.element_size()
        last = buckets[-1] if buckets else None
        limit = first_cap if len(buckets) == 1 else cap
        if last and size + nbytes <= limit and (last[0].dtype, last[0].device) == (param.dtype, param.device):
            last.append(param)
            size += nbytes
        else:
            buckets.append([param])
            size = nbytes
    return buckets


#: every torch DistributedDataParallel made in this process since :func:`track_torch_ddp`, held weakly
_made: weakref.WeakSet = weakref.WeakSet()


def track_torch_ddp() -> None:
    """Remember every torch ``DistributedDataParallel`` made from now on (once per process), so that the
    first ``steps()`` pins the buckets of one whose inner module was registered, not the wrapper,
    without searching the whole heap for it (a tenth of a second in a replacement's startup)."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    original = ddp_class.__init__
    if getattr(original, "_ftrun_tracks", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _made.add(self)

    __init__._ftrun_tracks = True  # type: ignore[attr-defined]
    ddp_class.__init__ = __init__  # type: ignore[method-assign]


def torch_ddps() -> list[torch.nn.parallel.DistributedDataParallel]:
    """The torch DDPs made since :func:`track_torch_ddp` that are still alive."""
    return list(_made)


def pin_buckets(module: torch.nn.Module) -> bool:
    """Fix the bucket layout of a torch ``DistributedDataParallel`` now, as torch's own ``Join`` does.

    DDP lays its gradient buckets out anew after its first iteration, from the order in which rank
    0 saw gradients, and broadcasts that layout from rank 0 once. A replacement rank would do that
    alone, in the middle of the healthy ranks' training, and wait for ever. Pinned at
    ``job.register()``, or at the first ``steps()`` for a DDP whose inner module was registered, on
    every rank (the replacement too: its layout comes from the same model, in parameter order), no
    rank ever rebuilds. True when ``module`` is a DDP (pinning it again does nothing).
    """
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return False
    reducer = module.reducer
    reducer._push_all_rebuilt_params()
    reducer._rebuild_buckets()
    return True
