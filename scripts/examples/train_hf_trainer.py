"""A Hugging Face Trainer job (transformers + accelerate, DDP) as written for torchrun: no line of ftrun's.

    torchrun --standalone --nproc-per-node 4 scripts/examples/train_hf_trainer.py --ckpt-dir /tmp/hf
    ftrun --standalone --nproc-per-node 4 --recovery process scripts/examples/train_hf_trainer.py --ckpt-dir /tmp/hf

What it does: a small GPT-2-shaped model built from a config (4 layers, width 128: no download) learns
token sequences made here. Every --ckpt-every steps the Trainer saves a checkpoint (save_steps), and on start
the script resumes from the newest one in --ckpt-dir (``train(resume_from_checkpoint=...)``): under torchrun a
restarted job redoes the steps since it. Under ``ftrun --recovery process`` a lost rank is replaced alone, with
the state of its peers, and no step is redone: ftrun turns its integration on as the script makes its Trainer
(docs/integrations.md, "No line to add"). With --zero STAGE the Trainer trains through DeepSpeed (its
``deepspeed=`` config, ZeRO at that stage): under ftrun give it --snapshot-every 1 (no peer holds a rank's ZeRO
partition; each rank's comes from its own snapshot).

For demos and benchmarks: the options of step_log.py (--kill-rank, --kill-at-step, --step-sleep, --progress).
"""

import argparse
import os
from pathlib import Path

import step_log
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

VOCAB, LENGTH = 256, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="the Trainer's output folder (checkpoints)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="train through DeepSpeed, ZeRO at this stage")
    step_log.add_options(parser)
    return parser.parse_args()


def deepspeed_config(stage: int | None) -> dict | None:
    if stage is None:
        return None
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce, which only inference uses, builds with a compiler on CPU for minutes
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "steps_per_print": 10**9, "zero_optimization": {"stage": stage}}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int):
        self.rows = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class Progress(TrainerCallback):
    def __init__(self, args: argparse.Namespace):
        self.step_log = step_log.StepLog(args)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_log.finished(state.global_step)


def main() -> None:
    args = parse_args()
    training = TrainingArguments(
        output_dir=str(args.ckpt_dir), max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-3,
        warmup_steps=10, logging_steps=50, save_steps=args.ckpt_every, save_total_limit=2, report_to=[], seed=0,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0,
        deepspeed=deepspeed_config(args.zero))
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=128, n_layer=4, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=Tokens(4096),
                      callbacks=[Progress(args)])
    newest = get_last_checkpoint(str(args.ckpt_dir)) if args.ckpt_dir.is_dir() else None
    trainer.train(resume_from_checkpoint=newest)


if __name__ == "__main__":
    main()
