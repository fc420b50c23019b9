"""Process-level recovery for a PyTorch Lightning ``Trainer`` (DDP): a callback, which ``ftrun --recovery process``
adds itself as the script makes its Trainer (``ftrun/trainer_hooks.py``), or the script adds:

    import ftrun.elastic.lightning           # before trainer.fit(): under ftrun, joins the job here
    trainer = lightning.Trainer(strategy="ddp", callbacks=[ftrun.elastic.lightning.Recovery()], ...)
    trainer.fit(model, data)

The import joins the job for the reason ``shared.py`` gives (Lightning's strategy forms torch's process group
as ``fit()`` begins). Under plain torchrun or python the callback does nothing.

How Lightning's batches become the job's steps (the job's step protocol, driven from the callback):

* the training starts (``on_train_start``): ``job.start_steps()``, where a replacement receives the state;
* each optimizer step of the training epoch runs between ``job.begin_step()`` and ``job.end_step()``, and
  commits when it ends: its batch
  (Lightning's ``_TrainingEpochLoop.advance``: the fetch, the hooks, the forward and backward in the optimizer's
  closure, the optimizer's and the schedulers' steps), or with ``accumulate_grad_batches`` above 1 its
  micro-batches (the epoch loop's iterations up to the one that steps);
* the registered state is the LightningModule, the optimizers, the LR schedulers and :class:`LoopProgress` (the
  loops' progress counters, the callbacks' state and the RNG states, as the step begins);
* a fault elsewhere leaves the backward's all-reduce unaveraged: ``on_before_optimizer_step`` (after the closure,
  before the update) stops the step (``GroupFailed``); the repair puts the state back to the consistent step and
  the step runs again from its first micro-batch: the same batches (what the data fetcher took since the step
  began is given again), their counters and RNG states (the first micro-batch zeroes the gradients a healthy
  rank had accumulated);
* a replacement receives the state from a healthy replica at ``on_train_start``, and at its first batch takes
  the counters and the RNG states, skips the batches its epoch already trained on, and joins its peers' rerun.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

from ftrun.coverage import strategy_uncovered
from ftrun.elastic.integrations import shared
from ftrun.elastic.job import ElasticJob
from ftrun.elastic.saves import count_saves_of
from ftrun.errors import EXIT_STUCK

log = logging.getLogger("ftrun.elastic")

#: this process's job, joined at import under ftrun (shared.py says why)
job: ElasticJob | None = shared.join()


class LoopProgress:
    """Lightning's training progress besides the model, the optimizers and the schedulers, as a step begins:
    the fit and epoch loops' counters (the epoch, the batch in it, the optimizer's and the schedulers' steps,
    the logging step), the callbacks' state and the RNG states."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._taken: dict[str, Any] | None = None
        #: a peer's (or a snapshot's) state was loaded and not yet put into the loops
        self.loaded = False

    def capture(self) -> None:
        fit = self.trainer.fit_loop
        epoch = fit.epoch_loop
        self._taken = {
            "epoch": fit.epoch_progress.state_dict(), "batch": epoch.batch_progress.state_dict(),
            "scheduler": epoch.scheduler_progress.state_dict(),
            "optimizer": epoch.automatic_optimization.optim_progress.state_dict(),
            "batches_that_stepped": epoch._batches_that_stepped,
            "callbacks": {cb.state_key: copy.deepcopy(cb.state_dict()) for cb in self.trainer.callbacks},
            "rng": shared.rng_states(),
        }

    def state_dict(self) -> dict:
        if self._taken is None:
            self.capture()
        return copy.deepcopy(self._taken)

    def load_state_dict(self, state: dict) -> None:
        self._taken = copy.deepcopy(state)
        self.loaded = True

    @property
    def batch_in_epoch(self) -> int:
        """How many batches of its epoch the step taken had been preceded by."""
        return self._taken["batch"]["current"]["ready"]

    def put_back_epoch(self) -> None:
        """The epoch counters as they stood before the epoch began (its start counts it again)."""
        progress = self.trainer.fit_loop.epoch_progress
        progress.load_state_dict(self._taken["epoch"])
        for tracker in (progress.total, progress.current):
            tracker.ready = tracker.started = tracker.processed

    def put_back(self) -> None:
        """The batch's counters, the callbacks' state and the RNG states as taken."""
        taken, epoch = self._taken, self.trainer.fit_loop.epoch_loop
        epoch.batch_progress.load_state_dict(taken["batch"])
        epoch.scheduler_progress.load_state_dict(taken["scheduler"])
        epoch.automatic_optimization.optim_progress.load_state_dict(taken["optimizer"])
        epoch._batches_that_stepped = taken["batches_that_stepped"]
        for callback in self.trainer.callbacks:
            if callback.state_key in taken["callbacks"]:
                callback.load_state_dict(copy.deepcopy(taken["callbacks"][callback.state_key]))
        shared.set_rng_states(taken["rng"])


def uncovered(trainer, pl_module) -> str:
    """What of the fit the callback does not cover, or "" (DDP, automatic optimization)."""
    why = strategy_uncovered(trainer.strategy)
    if why:
        return why
    if not pl_module.automatic_optimization:
        return "optimizes manually (automatic_optimization is False)"
    return ""


class _Held:
    """An optimizer registered by its state alone: its step is watched by :class:`Recovery` (after Lightning's
    closure), not by a hook before the closure runs."""

    def __init__(self, held):
        self.held = held

    def state_dict(self) -> dict:
        return self.held.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.held.load_state_dict(state)


def __getattr__(name: str) -> type:
    """``Recovery``, made at its first use as a subclass of Lightning's ``Callback`` (ftrun does not depend on
    lightning; Lightning checks its callbacks' type)."""
    if name != "Recovery":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from lightning.pytorch import Callback
    except ImportError:
        from pytorch_lightning import Callback  # type: ignore[no-redef]
    made = type("Recovery", (_RecoveryHooks, Callback), {"__doc__": _RecoveryHooks.__doc__, "__module__": __name__})
    globals()["Recovery"] = made
    if job is not None:
        _answer_broadcasts_locally(job)
    return made


def _answer_broadcasts_locally(job: ElasticJob) -> None:
    """Lightning's ``DDPStrategy.broadcast(obj)`` gives a replacement rank its own ``obj`` while its setup's
    collectives are answered locally (groups.py): a broadcast of a pickled object (the log folder, as ``fit()``
    sets up) has no local answer at the level of tensors, since the receiver sizes its buffer from the first."""
    from lightning.pytorch.strategies import DDPStrategy

    original = DDPStrategy.broadcast

    def broadcast(self, obj, src: int = 0):
        if job.groups.local:
            return obj
        return original(self, obj, src)

    DDPStrategy.broadcast = broadcast  # type: ignore[method-assign]


class _RecoveryHooks:
    """A Lightning callback, ``Recovery()``: the Trainer's training survives the loss of other ranks under
    ``ftrun --recovery process`` (DDP). Outside ftrun it does nothing."""

    def __init__(self):
        if job is None:
            shared.refuse_too_late("ftrun.elastic.lightning", "the Trainer's process group (fit())")
        self.job = job
        self.progress: LoopProgress | None = None
        #: the job's steps started (the first fit() of the process)
        self._started = False
        #: a replacement's first batch: take the counters and skip to its place in the epoch
        self._joining = False

    def setup(self, trainer, pl_module, stage) -> None:
        if self.job is not None:  # torch.save writes into memory, the file is written after it: one save
            count_saves_of(trainer, "save_checkpoint")
        if self.job is not None and self.job.receives_state:
            # its peers are past the script's checkpoint (fit(ckpt_path=...)): the state comes from them
            shared.wrap(trainer._checkpoint_connector, "_restore_modules_and_callbacks",
                            lambda original, checkpoint_path=None, weights_only=None: original(None, weights_only))

    def on_train_start(self, trainer, pl_module) -> None:
        job = self.job
        if job is None or self._started:
            return
        why = uncovered(trainer, pl_module)
        if why:  # the fit trains on; a fault restarts the job
            job.refuse_process_level(f"the Lightning Trainer {why}, which process-level repair does not cover")
            self.job = None
            return
        self.progress = LoopProgress(trainer)
        objects: dict[str, Any] = {"model": pl_module}
        objects.update({f"optimizer{i}": _Held(o) for i, o in enumerate(trainer.optimizers)})
        objects.update({f"lr_scheduler{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)})
        job.register(**objects, progress=self.progress)
        shared.wrap(trainer.fit_loop.epoch_loop, "advance", self._advance)
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._started = True
        job.start_steps(int(total), start=trainer.global_step)  # a replacement receives the state here
        if self.progress.loaded:
            self.progress.put_back_epoch()
            self._joining = True
            # its peers are mid-epoch: what it does before its first batch is its own (answered locally)
            job.groups.local = job.env.replacement

    def on_train_end(self, trainer, pl_module) -> None:
        if self.job is not None:
            self.job.link.report_progress(self.job.step)  # the job's summary says the step training ended at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.job is not None and self._started:
            self.job.state.before_update()  # GroupFailed when the backward's all-reduce failed

    # -- the epoch loop's batch, wrapped ---------------------------------------------------------------------

    def _advance(self, original, data_fetcher) -> None:
        job, progress = self.job, self.progress
        assert job is not None and progress is not None
        if self._joining:
            self._joining = False
            skipped = progress.batch_in_epoch
            for _ in range(skipped):
                next(data_fetcher)
            progress.put_back()
            job.groups.local = False  # every rank is at the same place from here
        progress.capture()
        rewind = _Rewind(data_fetcher)
        step = job.step
        while True:
            job.begin_step()
            try:
                self._optimizer_step(original, data_fetcher)
            except StopIteration as stop:  # no batch left: the epoch loop's own way out, no step
                job.end_step(stop)
                raise
            except Exception as error:
                outcome = job.end_step(error)
                if outcome.lost:
                    raise
            else:
                outcome = job.end_step()
                if outcome.lost:  # a collective failed after the update, and no repair comes
                    raise outcome.error
            if outcome.repaired:  # the state is the consistent step's: the step's batches run again
                self._again(step, rewind)
                continue
            rewind.done()
            return

    def _optimizer_step(self, original, data_fetcher) -> None:
        """The batches of one optimizer step: with ``accumulate_grad_batches`` above 1, the epoch loop's
        iterations of the micro-batches before the last (their ``advance``, ``on_advance_end`` and
        ``on_iteration_done``, as its ``run`` does them), then the last's ``advance``; the loop does the last's
        ``on_advance_end`` itself."""
        assert self.progress is not None
        loop = self.progress.trainer.fit_loop.epoch_loop
        original(data_fetcher)
        while loop._should_accumulate() and not loop.done:
            loop.on_advance_end(data_fetcher)
            loop.on_iteration_done()
            original(data_fetcher)

    def _again(self, step: int, rewind: "_Rewind") -> None:
        """After a repair: the batches of ``step`` run again, from its first, with its counters and RNG states."""
        job, progress = self.job, self.progress
        assert job is not None and progress is not None
        if job.step != step:  # the job goes on elsewhere than this batch: a fresh process can join it
            log.error("rank %d: the repair resumes at step %d, this rank's batch is step %d; exiting to be "
                      "replaced", job.rank, job.step, step)
            os._exit(EXIT_STUCK)
        progress.put_back()
        rewind.rewind()


class _Rewind:
    """Lightning's data fetcher as a batch began, to take the same batch again: what it fetches from its
    iterator meanwhile is kept, and given again, in order, after a rewind. (``next()`` on the iterator, never
    ``iter()``: a CombinedLoader starts its epoch anew on that.)"""

    def __init__(self, fetcher):
        self.fetcher = fetcher
        self.source = fetcher.iterator
        #: fetched since the batch began; to give again after a rewind, before the source's next
        self.taken: list = []
        self.again: list = []
        self.held = (list(getattr(fetcher, "batches", [])), fetcher.fetched, fetcher.done)
        fetcher.iterator = self._recording()

    def _recording(self):
        while True:
            if self.again:
                item = self.again.pop(0)
            else:
                try:
                    item = next(self.source)
                except StopIteration:
                    return
            self.taken.append(item)
            yield item

    def rewind(self) -> None:
        batches, self.fetcher.fetched, self.fetcher.done = self.held
        if hasattr(self.fetcher, "batches"):
            self.fetcher.batches = list(batches)
        self.again, self.taken = self.taken + self.again, []
        self.fetcher.iterator = self._recording()

    def done(self) -> None:
        """The batch is over: the fetcher reads its iterator directly again (nothing is left to give again: a
        batch's fetch takes what it gives)."""
        if not self.again:
            self.fetcher.iterator = self.source
