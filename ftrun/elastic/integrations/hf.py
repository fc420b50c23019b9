"""Process-level recovery for a Hugging Face ``Trainer``: no line under ``ftrun --recovery process``, which turns
it on as the script makes its Trainer (``ftrun/trainer_hooks.py``); else one line after the Trainer is built.

    import ftrun.elastic.hf                    # before TrainingArguments: under ftrun, joins the job here
    ...
    trainer = Trainer(model=model, args=args, train_dataset=data, ...)
    ftrun.elastic.hf.enable(trainer)
    trainer.train()

Why the import does the joining: ``TrainingArguments`` forms torch's default process group (accelerate's
``PartialState``, from ``MASTER_ADDR``) as it is made. A replacement rank cannot form one that way, since its
peers are in the middle of training and not in a constructor; so under ftrun the import calls
``ftrun.elastic.init()`` first, and accelerate takes the group it finds. Under plain torchrun or python the
import and ``enable()`` do nothing.

How a Trainer's steps become ftrun's steps (the job's step protocol, driven from the Trainer's callbacks):

* the Trainer sets its step (``_init_training_state``): ``job.start_steps()``, where a replacement receives the
  state;
* each optimizer step (its micro-batches, the clip, the optimizer's and the scheduler's steps) runs between
  ``job.begin_step()`` in ``on_step_begin`` and ``job.end_step()`` in ``on_step_end``, where it commits;
* the registered state is the model, the optimizer, the LR scheduler and :class:`TrainerProgress` (the
  ``TrainerState``, the RNG states, the grad scaler and the loss summed for the next log, as of the step's
  beginning);
* a fault elsewhere stops the step at the optimizer's ``step()`` (or raises from a collective between steps:
  logging, saving); the epoch's loop (``Trainer._run_epoch``) ends with it, the repair puts the state back to
  the consistent step, and the epoch runs again from there through the Trainer's own resume path (it skips
  the data already trained on, by position), with the RNG states of that step;
* a replacement receives the state from a healthy replica as its ``train()`` sets up, ignores the script's
  ``resume_from_checkpoint`` (its peers are past it), and joins its peers' rerun of the epoch.

With ``deepspeed=`` the Trainer trains through a DeepSpeed engine, which accelerate makes in ``train()`` with
``deepspeed.initialize``: the DeepSpeed integration (``deepspeed.py``, imported with this one) registers the
engine's state as it is made (ZeRO's partitions, which the torch optimizer's ``state_dict()`` registered under DDP
would miss), so this one registers only the Trainer's progress and its LR scheduler (unless the engine steps it),
and starts the job's steps once the engine is made, where a replacement receives the state (ZeRO 1-3: every rank
loads its own snapshot). Stage 0's step whose all-reduce failed raises at the engine's ``step()``, as a torch
optimizer's does.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from typing import Any, Callable

from ftrun.elastic.ddp import pin_buckets
from ftrun.elastic.integrations import shared
from ftrun.elastic.job import ElasticJob
from ftrun.elastic.saves import count_saves_of

log = logging.getLogger("ftrun.elastic")

#: the Trainer's counters for its logs beside the loss (``Trainer._<name>``)
COUNTERS = ("total_loss_scalar", "globalstep_last_logged", "initial_global_step")
#: what the Trainer's resume path is given after a repair: its state is in memory, not in a folder
IN_MEMORY = "<ftrun.elastic: the consistent step's state, in memory>"


#: this process's job, joined at import under ftrun (shared.py says why)
job: ElasticJob | None = shared.join()


def enable(trainer) -> None:
    """Make ``trainer``'s training survive the loss of other ranks under ``ftrun --recovery process``.

    Call it once the Trainer is built and before ``train()`` (under ``--recovery process`` ftrun calls it itself
    as the Trainer is made; a second call does nothing). A Trainer the integration does not cover (DeepSpeed,
    FSDP or tensor parallelism through accelerate), or one whose process group was formed before ftrun could
    form it, trains on at job level, said in one line. Outside ftrun it does nothing."""
    if job is None:
        shared.refuse_too_late("ftrun.elastic.hf", "TrainingArguments")
        return
    if getattr(trainer, "_ftrun_elastic", None) is not None:
        return
    why = uncovered(trainer)
    if why:
        trainer._ftrun_elastic = why
        job.refuse_process_level(f"the Hugging Face Trainer {why}, which process-level repair does not cover")
        return
    trainer._ftrun_elastic = ElasticTrainer(job, trainer)


def uncovered(trainer) -> str:
    """What of ``trainer``'s setup the integration does not cover, or "" (DDP, DeepSpeed, or one process)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "shards its model with FSDP through accelerate"
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    sharded = {name: getattr(config, f"{name}_size", 1) or 1 for name in ("tp", "cp", "sp", "dp_shard")}
    if any(size > 1 for size in sharded.values()):
        return "shards its model through accelerate's parallelism ({})".format(
            ", ".join(f"{name} {size}" for name, size in sharded.items() if size > 1))
    return ""


class TrainerProgress:
    """The Trainer's state besides the model, the optimizer and the scheduler, as of the current step's
    beginning (or the end of the last one): ``TrainerState`` (the step, the epoch, the log history, the
    callbacks' state), the RNG states and the grad scaler's. A healthy rank goes back to it after a
    repair; a replacement receives it with the rest."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._state = None
        self._rng: dict[str, Any] | None = None
        self._scaler: dict | None = None
        #: the loss summed since the last log, and what the Trainer keeps beside it for its logs
        self._counters: dict[str, Any] = {}
        #: a peer's (or a snapshot's) state was loaded and not yet put into the Trainer
        self.loaded = False

    def capture(self) -> None:
        """What the Trainer holds now is what a rollback to the current step puts back."""
        state = self.trainer.state
        # log_history only grows (its entries stay as they are): a shallow copy of the list is a copy
        self._state = dataclasses.replace(state, log_history=list(state.log_history),
                                          stateful_callbacks=copy.deepcopy(state.stateful_callbacks))
        self._rng = shared.rng_states()
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        self._scaler = scaler.state_dict() if scaler is not None else None
        trainer = self.trainer
        if hasattr(trainer, "_tr_loss"):  # made as train() begins
            self._counters = {"tr_loss": trainer._tr_loss.detach().clone(), "flos": trainer.current_flos,
                              **{name: getattr(trainer, f"_{name}") for name in COUNTERS}}

    def state_dict(self) -> dict:
        if self._state is None:
            self.capture()
        return {"trainer_state": json.dumps(dataclasses.asdict(self._state)), "rng": self._rng,
                "scaler": self._scaler, "counters": self._counters}

    def load_state_dict(self, state: dict) -> None:
        self._state = type(self.trainer.state)(**json.loads(state["trainer_state"]))
        self._rng, self._scaler, self._counters = state["rng"], state["scaler"], state["counters"]
        self.loaded = True

    @property
    def global_step(self) -> int:
        return self._state.global_step

    def put_back_state(self) -> None:
        """The Trainer's ``TrainerState`` and grad scaler as captured (the RNG states wait for the step)."""
        self.trainer.state = copy.copy(self._state)
        self.trainer.state.log_history = list(self._state.log_history)
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None and self._scaler is not None:
            scaler.load_state_dict(self._scaler)

    def put_back_counters(self) -> None:
        """The loss summed since the last log and the like, as captured: a replacement takes its source's, a
        share of one logged loss (the ranks' mean) that is not quite its own."""
        counters, trainer = self._counters, self.trainer
        if counters:
            trainer._tr_loss = counters["tr_loss"].to(trainer.args.device).clone()
            trainer.current_flos = counters["flos"]
            for name in COUNTERS:
                setattr(trainer, f"_{name}", counters[name])

    def put_back_rng(self) -> None:
        if self._rng is not None:
            shared.set_rng_states(self._rng)


class _Late:
    """A registered object the Trainer makes only in ``train()`` (the optimizer, the LR scheduler): a state a
    replacement receives before then is kept, and loaded once the Trainer has made the object (after the
    scheduler, which sets the optimizer's learning rate as it is made, as the Trainer's resume does)."""

    def __init__(self, find: Callable[[], Any]):
        self.find = find
        self.pending: dict | None = None

    def state_dict(self) -> dict:
        found = self.find()
        if found is None:
            raise RuntimeError("ftrun.elastic.hf: the Trainer has no optimizer yet")
        return found.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.pending = state


class ElasticTrainer:
    """What ``enable()`` adds to one Trainer: its steps are the job's (see the module's text)."""

    def __init__(self, job: ElasticJob, trainer):
        from transformers import TrainerCallback

        self.job, self.trainer = job, trainer
        self.progress = TrainerProgress(trainer)
        self.optimizer = _Late(lambda: _inner(trainer.optimizer))
        self.scheduler = _Late(lambda: trainer.lr_scheduler)
        #: DeepSpeed's engine (accelerate makes it in train()): the deepspeed integration registers its state
        self.engines: list[Any] | None = None
        if getattr(trainer, "is_deepspeed_enabled", False):
            import ftrun.elastic.integrations.deepspeed  # noqa: F401  (wraps deepspeed.initialize before train())

            self.engines = []
            job.register(trainer=self.progress)
        else:
            job.register(model=trainer.model, optimizer=self.optimizer, lr_scheduler=self.scheduler,
                         trainer=self.progress)
        #: the job's steps started (the first train() of the process)
        self._started = False
        #: the optimizer steps of an epoch, as the Trainer counted them
        self._per_epoch = 1
        #: the place in the data to resume at, once a repair (or the state a replacement received) set it
        self._resume: int | None = None
        #: the RNG states go back as the first step after a repair begins
        self._rng_due = False
        #: the first train() of the process is the job's steps; a second one runs as the Trainer's alone
        self._active = True
        self._wrap(trainer)

        outer = self

        class StepBegins(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                outer.step_begins()

        class StepEnds(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                outer.step_ends()

        # the step begins before the script's callbacks and ends after them: theirs run inside it
        trainer.callback_handler.callbacks.insert(0, StepBegins())
        trainer.callback_handler.callbacks.append(StepEnds())

    # -- the Trainer's methods, wrapped on this instance -------------------------------------------------------

    def _wrap(self, trainer) -> None:
        for name in ("train", "_init_training_state", "_prepare_for_training", "_run_epoch", "_load_rng_state"):
            shared.wrap(trainer, name, getattr(self, name))
        # the model goes out through safetensors, not torch.save: the whole checkpoint is one save
        count_saves_of(trainer, "_save_checkpoint")

    def train(self, original, resume_from_checkpoint=None, *args, **kwargs):
        if self.job.receives_state:  # its peers are past the script's checkpoint: the state comes from them
            resume_from_checkpoint = None
        if self._started:  # a second train(): its steps are not the job's (docs/integrations.md)
            log.warning("ftrun.elastic.hf: a second train() in this process is not repaired at process level")
            self._active = False
            return original(resume_from_checkpoint, *args, **kwargs)
        result = original(resume_from_checkpoint, *args, **kwargs)
        self.job.link.report_progress(self.job.step)  # the job's summary says the step training ended at
        return result

    def _init_training_state(self, original, max_steps, num_update_steps_per_epoch, *args):
        """Where the Trainer sets its step: a replacement receives the state here, and starts at its step."""
        trained = original(max_steps, num_update_steps_per_epoch, *args)
        if not self._active:
            return trained
        self._started = True
        if self.engines is not None:  # the engine that holds the state is made next: the steps start after it
            self._per_epoch = num_update_steps_per_epoch
            return trained
        return self._start_steps(max_steps, num_update_steps_per_epoch, trained)

    def _start_steps(self, max_steps: int, num_update_steps_per_epoch: int, trained: Any) -> Any:
        # a replacement receives the state here (a job-level restart may restore a snapshot)
        self.job.start_steps(max_steps, start=self.trainer.state.global_step)
        if not self.progress.loaded:
            self.progress.capture()
            return trained
        self.progress.put_back_state()
        self.trainer._load_callback_state()
        self._resume = self.progress.global_step
        # a replacement's peers are in the middle of an epoch: the collectives of the setup that follows (DDP's
        # constructor) are its alone, until the epoch's loop, where it joins them (after a job-level restart
        # every rank is here)
        self.job.groups.local = self.job.env.replacement
        return self._resume // num_update_steps_per_epoch, 0

    def _prepare_for_training(self, original, max_steps, *args):
        model, dataloader = original(max_steps, *args)
        if not self._active:
            return model, dataloader
        trainer = self.trainer
        if self.engines is not None:
            self._deepspeed_ready(max_steps)
            return model, dataloader
        for late, made in ((self.optimizer, _inner(trainer.optimizer)), (self.scheduler, trainer.lr_scheduler)):
            if late.pending is not None:
                made.load_state_dict(late.pending)
                late.pending = None
        # the real objects from now on: the job watches the optimizer's step
        self.job.register(optimizer=_inner(trainer.optimizer), lr_scheduler=trainer.lr_scheduler)
        if pin_buckets(model):
            log.info("the Trainer's DDP: bucket layout pinned")
        return model, dataloader

    def _deepspeed_ready(self, max_steps: int) -> None:
        """DeepSpeed's engine is made (its state registered by the deepspeed integration as
        ``deepspeed.initialize`` made it, ZeRO's optimizer partitions included, which a torch optimizer's
        registration would miss): the Trainer's scheduler, unless the engine steps it, joins it, and the job's steps
        start, where a replacement receives the state."""
        from ftrun.elastic.integrations import deepspeed

        trainer = self.trainer
        engine = getattr(trainer, "model_wrapped", None)
        if engine is not None and getattr(engine, "lr_scheduler", None) is None and trainer.lr_scheduler is not None:
            self.job.register(lr_scheduler=trainer.lr_scheduler)
        self._start_steps(max_steps, self._per_epoch, None)
        self.engines = deepspeed.driven_by_trainer()

    def _run_epoch(self, original, **kwargs):
        if not self._active:
            return original(**kwargs)
        per_epoch = kwargs["num_update_steps_per_epoch"]
        while True:
            if self._resume is not None:
                epoch = self._resume // per_epoch
                if epoch > kwargs["epoch"]:  # the consistent step is past this epoch
                    return None
                if epoch < kwargs["epoch"]:
                    raise RuntimeError(f"ftrun.elastic.hf: the consistent step {self._resume} lies in epoch {epoch}, "
                                       f"before this one ({kwargs['epoch']})")
                kwargs.update(resume_from_checkpoint=IN_MEMORY, epochs_trained=kwargs["epoch"],
                              steps_trained_in_current_epoch=(self._resume % per_epoch)
                              * self.trainer.args.gradient_accumulation_steps)
                self._resume = None
                self._rng_due = True
                self.progress.put_back_counters()
                self.job.groups.local = False  # every rank is at the same place from here
            try:
                return original(**kwargs)
            except Exception as error:
                if not self._repaired(error):
                    raise

    def _load_rng_state(self, original, checkpoint):
        if checkpoint != IN_MEMORY:
            original(checkpoint)

    # -- the job's steps ---------------------------------------------------------------------------------------

    def step_begins(self) -> None:
        if not self._active:
            return
        if self._rng_due:
            self._rng_due = False
            self.progress.put_back_rng()
        self.progress.capture()
        for engine in self.engines or ():
            engine.begin_step()
        self.job.begin_step()

    def step_ends(self) -> None:
        if not self._active:
            return
        self.progress.capture()
        for engine in self.engines or ():
            engine.step_finished()
        outcome = self.job.end_step()
        if outcome.lost:  # a collective failed after the optimizer's step, and no repair comes
            raise outcome.error
        if outcome.repaired:  # ... and a repair came: the step is lost, the epoch runs again from the consistent step
            raise _StepLost()

    def _repaired(self, error: Exception) -> bool:
        """``error`` ended the epoch: when it came from a fault elsewhere, repair and say where to resume. In a
        step (between ``begin_step`` and ``end_step``) or between two (logging, saving: the last step committed),
        ``end_step`` tells which; a ``_StepLost``'s repair is done already."""
        if not isinstance(error, _StepLost) and self.job.end_step(error).lost:
            return False
        # the state is the consistent step's
        self.progress.put_back_state()
        self._resume = self.job.step
        return True


class _StepLost(Exception):
    """A step whose body finished although one of its collectives failed, repaired already: the epoch ends, and
    runs again from the consistent step."""


def _inner(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or None before train() makes it)."""
    return getattr(optimizer, "optimizer", optimizer)
