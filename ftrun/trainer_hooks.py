"""What ftrun prepares in a rank's interpreter before its script runs: the integration of the script's Trainer
(Hugging Face's, Lightning's) turned on as the script makes it, with no line added to the script.

Under ``ftrun --recovery process``, a rank forked from the node's warm interpreter and a rank in a fresh one alike
(``ftrun/agent/standby.py``) call :func:`prepare` before the script's first line. It imports nothing (neither
torch nor a framework): it watches for the frameworks' modules to be imported (or finds them imported ahead, in
the warm interpreter), and wraps two constructors on their classes, in this process alone. Nothing of torch is
patched.

* ``transformers.TrainingArguments``, as they are made, before accelerate forms torch's process group from
  ``MASTER_ADDR`` inside them: the rank joins the job (``import ftrun.elastic.hf``; ``shared.py`` says why ftrun
  must form the group; with ``deepspeed=``, the DeepSpeed integration too, which registers the engine's state),
  unless the arguments ask for what the integration does not cover (``ftrun.coverage``):
  then accelerate forms the group as under torchrun, and one line says the job runs at job level;
* ``transformers.Trainer``, as it is made: ``ftrun.elastic.hf.enable(trainer)`` (the process's first Trainer);
* ``lightning.Trainer``, as it is made, with DDP (its process group comes later, in ``fit()``): the rank joins the
  job and the Trainer gets the ``Recovery()`` callback unless it has one; with another strategy
  (``ftrun.coverage``), one line, and Lightning forms the group.

A script's own line (``enable(trainer)``, the callback) still works, and does nothing twice. ``ftrun
--no-integrations`` (the workers get ``FTRUN_INTEGRATIONS=0``; a user may set it instead) leaves every Trainer as
it is. A wrapper that fails leaves the framework as it is, with a warning: the job runs at job level.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType
from typing import Any, Callable

from ftrun.contract import WorkerEnv
from ftrun.coverage import arguments_uncovered, arguments_use_deepspeed, strategy_uncovered

log = logging.getLogger("ftrun.elastic")

#: the loaders of a module's own file (python source or bytecode)
FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)
#: the Trainers made in this process, by framework: only the first gets the integration (one job, one training)
_made: dict[str, int] = {}
#: the integration of a framework whose own loop the script writes: it must import it (no line cannot drive its steps)
INTEGRATION_OF = {"deepspeed": "ftrun.elastic.integrations.deepspeed"}
#: why the Trainer's arguments were left to accelerate ("" while none were)
_declined: list[str] = []


def prepare(environ: dict[str, str] | None = None) -> bool:
    """Under ``ftrun --recovery process`` with the integrations on: watch for the frameworks (their Trainers
    get ftrun's integration as they are made). Returns whether it did."""
    env = WorkerEnv.from_environ(os.environ if environ is None else environ)
    if env is None or env.recovery != "process" or not env.integrations:
        return False
    watched: dict[str, Callable[[ModuleType], None]] = {
        "transformers.training_args": _training_arguments, "transformers.trainer": _hf_trainer,
        "lightning.pytorch.trainer.trainer": _lightning_trainer, "deepspeed": _deepspeed}
    pending: dict[str, Callable[[ModuleType], None]] = {}
    for name, wrap in watched.items():
        if name in sys.modules:  # imported ahead by the warm interpreter
            _apply(wrap, sys.modules[name])
        else:
            pending[name] = wrap
    if pending:
        sys.meta_path.insert(0, AfterImport(pending))
    return True


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then[name](module)`` once the module ``name`` is loaded (its code ran), through the loader the
    other finders find for it. Finds nothing itself."""

    def __init__(self, then: dict[str, Callable[[ModuleType], None]]):
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        wrap = self.then.get(name)
        if wrap is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        # a file's loader is its module's alone (a zip's is shared): only there is its exec_module ours to wrap
        if spec is None or not isinstance(spec.loader, FILE_LOADERS):
            return spec
        del self.then[name]
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _apply(wrap, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _apply(wrap: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        wrap(module)
    except Exception as e:  # a framework version whose classes differ: it trains as it is, at job level
        log.warning("ftrun: %s left as it is (%s: %s): a fault restarts the job", module.__name__,
                    type(e).__name__, e)


def wrap_method(cls: type, name: str, before: Callable[[Any], None] | None = None,
                after: Callable[[Any], None] | None = None) -> None:
    """``cls.name`` calls ``before(self)`` first and ``after(self)`` once it returned."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        if before is not None:
            before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    setattr(cls, name, wrapped)


# -- DeepSpeed ----------------------------------------------------------------------------------------------


def _deepspeed(module: ModuleType) -> None:
    original = module.initialize

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        made = original(*args, **kwargs)
        engine_made()
        return made

    setattr(module, "initialize", initialize)


def engine_made() -> None:
    """A DeepSpeed engine was made: without ftrun's integration (which registers its state and drives the loop's
    steps), the job cannot repair it at process level, which one line says."""
    if INTEGRATION_OF["deepspeed"] in sys.modules or _declined:  # covered, or the Trainer's arguments said why
        return
    from ftrun.elastic.integrations import shared

    shared.say_job_level("the script's DeepSpeed engine was made without ftrun's integration (import "
                         f"{INTEGRATION_OF['deepspeed']} before deepspeed.init_distributed() and loop over its "
                         "steps(): docs/integrations.md)")


# -- Hugging Face -------------------------------------------------------------------------------------------


def _training_arguments(module: ModuleType) -> None:
    wrap_method(module.TrainingArguments, "__post_init__", before=_arguments_made)


def _hf_trainer(module: ModuleType) -> None:
    wrap_method(module.Trainer, "__init__", after=_hf_trainer_made)


def _arguments_made(args: Any) -> None:
    why = arguments_uncovered(args)
    if why:
        from ftrun.elastic.integrations import shared

        _declined.append(why)
        shared.say_job_level(f"the Hugging Face Trainer's arguments ask for {why}, which process-level repair does "
                             "not cover")
        return
    importlib.import_module("ftrun.elastic.integrations.hf")  # joins the job, unless the group was formed first
    if arguments_use_deepspeed(args):  # its engine's state registered as accelerate makes it, its shm op off
        importlib.import_module(INTEGRATION_OF["deepspeed"])


def _hf_trainer_made(trainer: Any) -> None:
    if _first("hf") and not _declined:
        from ftrun.elastic.integrations import hf

        hf.enable(trainer)


# -- Lightning ----------------------------------------------------------------------------------------------


def _lightning_trainer(module: ModuleType) -> None:
    wrap_method(module.Trainer, "__init__", after=_lightning_trainer_made)


def _lightning_trainer_made(trainer: Any) -> None:
    if not _first("lightning"):
        return
    why = strategy_uncovered(trainer.strategy)
    if why:
        from ftrun.elastic.integrations import shared

        shared.say_job_level(f"the Lightning Trainer {why}, which process-level repair does not cover")
        return
    integration = importlib.import_module("ftrun.elastic.integrations.lightning")  # joins, before fit()
    if integration.job is None:  # the script formed the process group itself
        integration.shared.refuse_too_late("ftrun.elastic.lightning", "the Trainer's process group (fit())")
        return
    recovery = integration.Recovery
    callbacks = trainer.callbacks
    if any(isinstance(callback, recovery) for callback in callbacks):
        return
    # where the script's own would be: after its callbacks, before the checkpoints (Lightning puts those last)
    from lightning.pytorch.callbacks import Checkpoint

    at = next((i for i, callback in enumerate(callbacks) if isinstance(callback, Checkpoint)), len(callbacks))
    callbacks.insert(at, recovery())


def _first(framework: str) -> bool:
    _made[framework] = _made.get(framework, 0) + 1
    return _made[framework] == 1
