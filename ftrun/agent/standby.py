"""What the node's warm interpreter (``forkserver.py``) imports ahead, and how a rank forked from it runs its script.

Importing torch costs seconds; a rank forked from an interpreter that did it skips that. The rank takes on its
argv, environment and working directory, and runs the script as ``python -u SCRIPT`` or ``python -u -m MODULE``
would. A script that names ftrun's integration of a framework (``ftrun.elastic.hf``, ``ftrun.elastic.lightning``)
has that framework imported ahead too, and so has a script as written for torchrun whose text names a Trainer
(transformers' and Trainer, or lightning). Under ``--recovery process`` the script's Trainer gets ftrun's
integration as it is made (``ftrun/trainer_hooks.py``, prepared before the script runs), whether the rank is
forked or, with ``--warm-standby 0``, runs in a fresh interpreter (``python -u -m ftrun.agent.standby SCRIPT``).
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys

from ftrun import trainer_hooks

#: what a script that names one of these (its integration in ftrun.elastic) imports besides torch: modules
#: whose import costs seconds more (transformers' Trainer loads most of the library, and accelerate)
#: deepspeed.initialize imports ZeRO's optimizers, and Muon's, which loads torch's inductor (seconds of CPU): a
#: replacement that imports them itself keeps its peers waiting
DEEPSPEED_IMPORTS = ("deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
                     "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.muon.muon_optimizer")
FRAMEWORK_IMPORTS = {"ftrun.elastic.hf": ("transformers.trainer",), "ftrun.elastic.lightning": ("lightning.pytorch",),
                     "ftrun.elastic.integrations.hf": ("transformers.trainer",),
                     "ftrun.elastic.integrations.lightning": ("lightning.pytorch",),
                     "ftrun.elastic.integrations.deepspeed": DEEPSPEED_IMPORTS}
#: the same for a script as written for torchrun, whose text names every word of one of these: the Trainers that
#: ftrun's integrations are turned on for as they are made (ftrun/trainer_hooks.py); the Hugging Face Trainer's
#: ``deepspeed=`` engine too
TRAINER_IMPORTS = {("transformers", "Trainer"): ("transformers.trainer",), ("lightning",): ("lightning.pytorch",),
                   ("transformers", "Trainer", "deepspeed"): DEEPSPEED_IMPORTS}
#: words whose presence in a script's text says it imports torch, itself or through a framework on it
TORCH_WORDS = ("torch", "ftrun.elastic", "transformers", "lightning", "accelerate", "deepspeed")


def warm_up(script: str | None = None) -> None:
    """Pay, before any rank is assigned, for what every training script pays in its first second, and
    for the framework ``script`` trains with, when it names ftrun's integration of one."""
    import torch
    import torch.distributed  # noqa: F401

    import ftrun.elastic  # noqa: F401

    for module in framework_imports(script):
        try:
            importlib.import_module(module)
        except ImportError:  # the script will say so itself, in the rank that runs it
            pass

    # the first optimizer loads torch's compiler stack (close to a second here); a tiny step
    # also readies autograd
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    param.sum().backward()
    optimizer.step()


def framework_imports(script: str | None) -> tuple[str, ...]:
    """The modules to import ahead for ``script`` (a path; None for a module run with -m): those of the
    integrations its text names."""
    text = _text(script)
    named = [modules for name, modules in FRAMEWORK_IMPORTS.items() if name in text]
    named += [modules for words, modules in TRAINER_IMPORTS.items() if all(word in text for word in words)]
    return tuple(dict.fromkeys(module for modules in named for module in modules))


def names_a_trainer(script: str) -> bool:
    """Whether ``script``'s text names a Trainer whose integration ftrun turns on as it is made."""
    text = _text(script)
    return any(all(word in text for word in words) for words in TRAINER_IMPORTS)


def names_torch(script: str | None) -> bool:
    """Whether ``script`` (a path; None for a module run with -m, which is taken to) may import torch: its text
    names torch or a framework built on it. A script that names none (a plain Python one) gains nothing from a
    warm interpreter, and its ranks would wait for its import. A script that imports torch only through a
    module of its own is started fresh: correct, only not warm."""
    if script is None:
        return True
    text = _text(script)
    return any(word in text for word in TORCH_WORDS)


def _text(script: str | None) -> str:
    try:
        with open(script or "", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def run(assignment: dict) -> None:
    """Run the rank's script as ``python -u SCRIPT`` (or ``-m MODULE``) would, in this interpreter, once it is
    prepared: under ``--recovery process`` the script's Trainer gets ftrun's integration as it is made."""
    os.environ.clear()
    os.environ.update(assignment["env"])
    os.chdir(assignment["cwd"])
    trainer_hooks.prepare()
    argv = assignment["argv"]  # [python, -u, SCRIPT, args...] or [python, -u, -m, MODULE, args...]
    if argv[2] == "-m":
        sys.argv = [argv[3], *argv[4:]]
        runpy.run_module(argv[3], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[2:]
        # python SCRIPT puts the script's folder first where python -m put the working directory
        sys.path[0] = os.path.dirname(os.path.abspath(argv[2]))
        runpy.run_path(argv[2], run_name="__main__")


def can_run(argv: list[str] | tuple[str, ...]) -> bool:
    """Whether a worker command is one a warm interpreter can fork (python -u SCRIPT / -m MODULE)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u" and argv[2] != "-c"


def prepared(argv: list[str]) -> list[str]:
    """A fresh interpreter's command for a rank of a script that names a Trainer (``python -u SCRIPT``): the same
    script run by :func:`main`, prepared as a forked rank is. Any other command is left as it is."""
    if not can_run(argv) or argv[2] == "-m" or not names_a_trainer(argv[2]):
        return argv
    return [argv[0], "-u", "-m", __name__, *argv[2:]]


def main() -> None:
    """``python -u -m ftrun.agent.standby SCRIPT [args...]``: run SCRIPT as ``python -u SCRIPT [args...]`` would,
    prepared (:func:`run`)."""
    run({"env": dict(os.environ), "cwd": os.getcwd(), "argv": [sys.executable, "-u", *sys.argv[1:]]})


if __name__ == "__main__":
    main()

