"""Process-level recovery for DeepSpeed engines (ZeRO stages 0 to 3): the import, and the loop over the job's steps.

    from ftrun.elastic.integrations.deepspeed import steps   # before deepspeed.init_distributed()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")             # takes the group the import formed
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for step in steps(total_steps, start=first):                # instead of range(first, total_steps)
        for micro in range(accumulation):
            loss = engine(batch_for(step, micro))
            engine.backward(loss)
            engine.step()

Why the import comes first: ``deepspeed.init_distributed()`` forms torch's process group from ``MASTER_ADDR``
unless one is formed already, and a replacement rank cannot form one that way while its peers train; so under
ftrun the import joins the job (``ftrun.elastic.init()``) and DeepSpeed takes the group it finds. The import
also wraps ``deepspeed.initialize``: every engine it makes has its state registered with the job
(:class:`EngineState`) with no line of the script's; the Hugging Face Trainer's ``deepspeed=`` engine, which
accelerate makes through it, too (``hf.py`` drives its steps: :func:`driven_by_trainer`). Under plain torchrun or
python the import registers nothing and ``steps()`` is ``range()``.

Where each ZeRO stage's state has a copy, which decides how a replacement gets it:

* stage 0 (plain data parallelism): every rank holds the whole state; a replacement receives it from a peer;
* stages 1 and 2: the parameters are replicated, the optimizer's state (the fp32 master partitions and the
  moments) is split over the ranks, one part each, with no copy anywhere; stage 3 splits the parameters too.
  No peer holds a lost rank's part: its source is its own snapshot (``--snapshot-every``), which its node's
  agent holds in memory and copies to peer nodes (docs/snapshots.md). A repair takes every rank back to the
  newest step all of them hold, and each loads its own. Without ``--snapshot-every`` a fault restarts the job,
  which rank 0 says in one line as training begins.

DeepSpeed's shared-memory all-reduce (``deepspeed_shm_comm``, built with a compiler on first use on CPU, and used
only by inference's tensor-parallel all-reduce) is turned off under ftrun: it would bypass the job's groups, which
a repair re-forms, and its build takes minutes. Pinned by the tests to deepspeed 0.19.8.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

import torch

from ftrun.elastic.groups import GroupFailed
from ftrun.elastic.integrations import shared
from ftrun.elastic.job import ElasticJob
from ftrun.elastic.layout import ReplicaLayout
from ftrun.elastic.saves import count_saves_of

#: the engine's counters that its own checkpoint keeps (``DeepSpeedEngine.<name>``)
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
#: DeepSpeed's op that would carry collectives around the job's groups (see the module's text)
SHM_OP = "deepspeed_shm_comm"

#: this process's job, joined at import under ftrun (shared.py says why)
job: ElasticJob | None = shared.join()
#: the engines deepspeed.initialize made in this process, in order
engines: list[Any] = []
#: steps() began (the loop goes by the job's steps); the line saying it does not was said
_looping: list[bool] = []
_said: list[bool] = []
#: the failure that stopped an engine's update in this step (without ZeRO)
_stopped: list[BaseException] = []
#: a framework's loop drives the steps (driven_by_trainer()): a stopped update raises, as a torch optimizer's does
_driven: list[bool] = []


class EngineState:
    """One engine's state as its own checkpoint holds it, this rank's part of it: the model (stages 0-2) or this
    rank's parameter partitions (stage 3), the optimizer's fp32 master partitions and its moments, the LR
    scheduler, the engine's step counters and the RNG states."""

    def __init__(self, engine):
        self.engine = engine
        self.stage = engine.zero_optimization_stage()
        #: the engine's counters and the RNG states as the current step began, or as its body finished: what a
        #: peer or a snapshot is given (None before the first step: the engine's own)
        self._counters: dict[str, int] | None = None
        self._rng: dict[str, Any] | None = None
        #: a repair loaded this rank's state (from a peer or its snapshot)
        self._loaded = False

    def begin_step(self) -> None:
        self.step_finished()

    def step_finished(self) -> None:
        """The step's body ran to its end (or the step begins): its counters and what it drew from the RNGs
        belong to the step it commits."""
        self._counters = {name: getattr(self.engine, name) for name in COUNTERS}
        self._rng = shared.rng_states()

    def after_repair(self) -> None:
        """On every rank at the end of a repair. Without ZeRO: the counters the step's micro-batches moved, their
        gradients and the RNG states as the step began, unless the repair loaded them. ZeRO-3: the order in which
        its parameters are gathered, which each rank records in its first step and checks with its peers (a
        collective), is forgotten, so that every rank records it again with the replacement."""
        if self.stage == 0:
            if not self._loaded and self._counters is not None and self._rng is not None:
                for name, value in self._counters.items():
                    setattr(self.engine, name, value)
                shared.set_rng_states(self._rng)
            self.engine.zero_grad()
        elif self.stage == 3:
            coordinator = self.engine.optimizer.parameter_offload.get_param_coordinator()
            coordinator.release_and_reset_all(self.engine.module)
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
        self._loaded = False

    @property
    def partitioned(self) -> bool:
        """The optimizer's state is split over the ranks (ZeRO 1-3): no peer holds a copy of this rank's."""
        return self.stage > 0

    def state_dict(self) -> dict:
        engine = self.engine
        counters = self._counters if self._counters is not None else {name: getattr(engine, name) for name in COUNTERS}
        state: dict[str, Any] = {"counters": dict(counters),
                                 "rng": self._rng if self._rng is not None else shared.rng_states()}
        if self.stage == 3:
            state["partitions"] = list(engine.optimizer.fp16_partitioned_groups_flat)
            state["buffers"] = dict(engine.module.named_buffers())
        else:
            state["module"] = engine.module.state_dict()
        masters = self._masters()
        if masters is not None:  # ZeRO: the optimizer's state is keyed by this rank's fp32 master partitions
            base = _base(engine.optimizer)
            state["fp32"] = masters
            state["moments"] = [dict(base.state.get(master, {})) for master in masters]
            state["hyperparameters"] = [_settings(group) for group in base.param_groups]
        elif engine.optimizer is not None:
            state["optimizer"] = _base(engine.optimizer).state_dict()
        if engine.lr_scheduler is not None:
            state["lr_scheduler"] = engine.lr_scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        engine = self.engine
        for name, value in state["counters"].items():
            setattr(engine, name, value)
        with torch.no_grad():
            if self.stage == 3:
                _copy_into(engine.optimizer.fp16_partitioned_groups_flat, state["partitions"])
                buffers = dict(engine.module.named_buffers())
                for name, value in state["buffers"].items():
                    buffers[name].copy_(value)
            else:
                engine.module.load_state_dict(state["module"])
            masters = self._masters()
            if masters is not None:
                base = _base(engine.optimizer)
                _copy_into(masters, state["fp32"])
                for master, moments in zip(masters, state["moments"]):
                    held = base.state[master]
                    for key, value in moments.items():
                        if isinstance(value, torch.Tensor) and isinstance(held.get(key), torch.Tensor):
                            held[key].copy_(value)
                        else:
                            held[key] = value.clone() if isinstance(value, torch.Tensor) else value
                for group, settings in zip(base.param_groups, state["hyperparameters"]):
                    group.update(settings)
        if "optimizer" in state:
            _base(engine.optimizer).load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        shared.set_rng_states(state["rng"])
        self._counters, self._rng, self._loaded = dict(state["counters"]), state["rng"], True

    def _masters(self) -> list[torch.Tensor] | None:
        """This rank's fp32 master partitions, which ZeRO's torch optimizer steps (None without ZeRO)."""
        optimizer = self.engine.optimizer
        if self.stage in (1, 2):
            return list(optimizer.single_partition_of_fp32_groups)
        if self.stage == 3:
            return list(optimizer.fp32_partitioned_groups_flat)
        return None


def _base(optimizer):
    """The torch optimizer that ZeRO's (or the fp16 wrapper's) steps, whose state is the moments."""
    return getattr(optimizer, "optimizer", optimizer)


def _settings(group: dict) -> dict:
    """A torch optimizer's param group without its parameters: the learning rate and the like."""
    return {key: value for key, value in group.items() if key != "params"}


def _copy_into(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if len(targets) != len(sources):
        raise ValueError(f"ftrun.elastic.integrations.deepspeed: {len(sources)} partitions for {len(targets)}")
    for target, source in zip(targets, sources):
        target.data.copy_(source)


def enable(engine) -> None:
    """Register ``engine``'s state with the job, so that a replacement gets it (the import does this for every
    engine ``deepspeed.initialize`` makes; call it for an engine made otherwise). Outside ftrun it does nothing."""
    if job is None:
        shared.refuse_too_late("ftrun.elastic.integrations.deepspeed", "deepspeed.init_distributed()")
        return
    if any(made is engine for made in engines):
        return
    engines.append(engine)
    state = EngineState(engine)
    shared.wrap(engine, "step", functools.partial(_step, state))
    count_saves_of(engine, "save_checkpoint")  # its files, the tag and the barriers between them: one save
    job.register(**{f"deepspeed_engine{len(engines) - 1}": state})
    if state.partitioned:  # no peer holds this rank's part of the optimizer (module's text)
        job.sharded = True
    else:  # stage 0: every rank a replica, whatever groups of its own DeepSpeed made (a clone of the world's)
        job._declared = ReplicaLayout.declared({"dp": job.world_size}, ("dp",))
    job.after_repair(state.after_repair)


def steps(total: int, start: int = 0) -> Iterator[int]:
    """Step numbers ``start..total-1``, each an optimizer step of the engine (its micro-batches, ``backward()``
    and ``step()``): ``range(start, total)`` outside ftrun. Under ftrun a replacement starts where its peers are,
    and after a repair the loop goes on from the consistent step (the step number is the data position)."""
    if job is None:
        yield from range(start, total)
        return
    _looping.append(True)
    step = job.start_steps(total, start)
    _say_where_the_state_comes_from()
    while step < total:
        for state in _engine_states():
            state.begin_step()
        job.begin_step()
        yield step
        stopped = _stopped.pop() if _stopped else None
        if stopped is None:
            for state in _engine_states():
                state.step_finished()
        outcome = job.end_step(stopped)
        if outcome.lost:
            raise outcome.error
        step = outcome.step
    job.link.report_progress(job.step)  # the job's summary says the step training ended at


def driven_by_trainer() -> list[EngineState]:
    """A framework's own loop (the Hugging Face Trainer's) drives the job's steps around this process's engines,
    as :func:`steps` would: call it after ``job.start_steps()``; it says where a ZeRO partition's state would come
    from, and returns the engines' states, whose ``begin_step()`` and ``step_finished()`` the loop calls."""
    _looping.append(True)
    _driven.append(True)
    _say_where_the_state_comes_from()
    return _engine_states()


def _step(state: EngineState, original, *args, **kwargs):
    """The engine's ``step()``. Training outside ``steps()`` is said once, since no repair can place it. Without
    ZeRO, a step whose gradients a failed collective left unaveraged is not applied: the rank keeps the state of
    the step's beginning, which a replacement then receives from it (under a Trainer, the failure is raised).
    ZeRO's steps run whole (their collectives answered locally once one failed), and every rank loads its snapshot."""
    assert job is not None
    if not _looping and not _said:
        _said.append(True)
        job.refuse_process_level("this DeepSpeed loop is not ftrun.elastic.integrations.deepspeed's steps(): a "
                                 "replacement could not start where its peers are")
    if _looping and not state.partitioned and state.engine.is_gradient_accumulation_boundary():
        try:
            job.state.before_update()
        except GroupFailed as error:
            if _driven:  # out of the framework's step, whose loop ends with it (hf.py repairs and reruns it)
                raise
            _stopped.append(error)
            return None
    return original(*args, **kwargs)


def _engine_states() -> list[EngineState]:
    assert job is not None
    return [state for state in job.state.objects.values() if isinstance(state, EngineState)]


def _say_where_the_state_comes_from() -> None:
    """ZeRO with no snapshots: no source for a lost rank's part of the state; rank 0 says so, once."""
    partitioned = [state.stage for state in _engine_states() if state.partitioned]
    if partitioned and job.snapshots is None:
        job.refuse_process_level(f"DeepSpeed ZeRO stage {partitioned[0]} keeps one copy of each rank's optimizer "
                                 "state (stage 3 also of its parameters), with no peer to take a lost rank's from "
                                 "(--snapshot-every 1 gives process-level repair)")


def _hook() -> None:
    """Under ftrun: every engine ``deepspeed.initialize`` makes is enabled, and the shared-memory op is off."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False  # DeepSpeed keeps the dict it probed: this entry holds
    original = deepspeed.initialize
    if getattr(original, "_ftrun", False):
        return

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        made = original(*args, **kwargs)
        enable(made[0])
        return made

    initialize._ftrun = True  # type: ignore[attr-defined]
    deepspeed.initialize = initialize


if job is not None:
    _hook()
