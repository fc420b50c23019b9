"""What ftrun's integrations cover of a framework's setup, told from its objects' fields and class names alone.

Asked by the hooks that prepare a rank before its script runs (``ftrun/trainer_hooks.py``, which must import
neither torch nor a framework) and by the integrations themselves (a Lightning Trainer given the callback): a
setup not covered runs at job level, said in one line with the reason these functions give.
"""

from __future__ import annotations

import os
from typing import Any


def arguments_uncovered(args: Any) -> str:
    """What ``TrainingArguments`` (as given, before their ``__post_init__``) ask for that the integration does not
    cover, or "": the Trainer's DDP (or one process) and DeepSpeed (ZeRO 0-3) are covered."""
    if args.fsdp or _env_true("ACCELERATE_USE_FSDP"):
        return "FSDP through accelerate"
    config = getattr(args, "parallelism_config", None)
    sizes = {name: getattr(config, f"{name}_size", None) or 1 for name in ("tp", "cp", "sp", "dp_shard")}
    if any(size > 1 for size in sizes.values()):
        return "accelerate's parallelism ({})".format(", ".join(f"{n} {s}" for n, s in sizes.items() if s > 1))
    return ""


def arguments_use_deepspeed(args: Any) -> bool:
    """``TrainingArguments`` that train through DeepSpeed (their ``deepspeed=`` config, or accelerate's plugin)."""
    return bool(args.deepspeed) or _env_true("ACCELERATE_USE_DEEPSPEED")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def strategy_uncovered(strategy: Any) -> str:
    """What of Lightning's ``strategy`` the integration does not cover, or "" (DDP). By class name, so that
    nothing is imported (DeepSpeed's and XLA's strategies are DDP's subclasses)."""
    kind = type(strategy)
    if any(base.__name__ == "DDPStrategy" for base in kind.__mro__) and kind.__name__ not in (
            "DeepSpeedStrategy", "XLAStrategy"):
        return ""
    return f"trains with Lightning's {kind.__name__}"
