"""hf_train.py's arguments for training through DeepSpeed (ZERO=stage: ZeRO at that stage), kept out of its text:
a script whose text names DeepSpeed beside the Trainer gets DeepSpeed imported ahead by its node's warm interpreter
(ftrun/agent/standby.py), which hf_train.py's DDP runs would pay for."""

import os


def arguments() -> dict:
    """``TrainingArguments``' ``deepspeed=`` for ZERO=stage, or nothing (DDP)."""
    stage = os.environ.get("ZERO")
    if not stage:
        return {}
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce builds with a compiler on CPU for minutes (ftrun turns it off itself)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "gradient_clipping": "auto", "steps_per_print": 10**6,
                          "zero_optimization": {"stage": int(stage)}}}
