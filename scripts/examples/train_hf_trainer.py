"""A Hugging Face Trainer job (transformers + accelerate, DDP) with ftrun's one line, and the same script under torchrun.

    torchrun --standalone --nproc-per-node 4 scripts/examples/train_hf_trainer.py --ckpt-dir /tmp/hf
    ftrun --standalone --nproc-per-node 4 --recovery process scripts/examples/train_hf_trainer.py --ckpt-dir /tmp/hf

What it does: a small GPT-2-shaped model built from a config (4 layers, width 128: no download) learns
token sequences made here. Every --ckpt-every steps the Trainer saves a checkpoint (save_steps), and on start
the script resumes from the newest one in --ckpt-dir (``train(resume_from_checkpoint=...)``): under torchrun a
restarted job redoes the steps since it. Under ``ftrun --recovery process`` a lost rank is replaced alone, with
the state of its peers, and no step is redone (``ftrun.elastic.hf.enable(trainer)``: docs/integrations.md).

For demos and benchmarks, as train_ddp.py:
  --kill-rank R --kill-at-step S   rank R SIGKILLs itself after finishing step S, only in the first
                                   attempt (TORCHELASTIC_RESTART_COUNT=0) and never in a replacement
  --step-sleep SECONDS             sleep after every step
  --progress FILE                  every rank appends "<unix time> <rank> <step> <pid> <restart count>"
                                   for every finished step (steps numbered from 1)
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import ftrun.elastic.hf  # under ftrun this joins the job: before TrainingArguments, which form the process group

VOCAB, LENGTH = 256, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="the Trainer's output folder (checkpoints)")
    parser.add_argument("--ckpt-every", type=int, default=10, help="save every K steps (default 10)")
    parser.add_argument("--progress", type=Path, help="append one line per finished step to this file")
    parser.add_argument("--kill-rank", type=int, help="rank that SIGKILLs itself (with --kill-at-step)")
    parser.add_argument("--kill-at-step", type=int, help="step after which --kill-rank SIGKILLs itself")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every step")
    return parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int):
        self.rows = torch.randint(0, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class Progress(TrainerCallback):
    """One line per finished step, and the benchmark's fault."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.file = open(args.progress or os.devnull, "a")

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        self.file.write(f"{time.time():.6f} {self.rank} {step} {os.getpid()} {self.restarts}\n")
        self.file.flush()  # the line is out before a kill below, and readable while the job runs
        if (self.rank == self.args.kill_rank and step == self.args.kill_at_step and self.restarts == 0
                and os.environ.get("FTRUN_REPLACEMENT", "0") != "1"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)


def main() -> None:
    args = parse_args()
    training = TrainingArguments(
        output_dir=str(args.ckpt_dir), max_steps=args.steps, per_device_train_batch_size=8, learning_rate=1e-3,
        warmup_steps=10, logging_steps=50, save_steps=args.ckpt_every, save_total_limit=2, report_to=[], seed=0,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_num_workers=0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=128, n_layer=4, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=training, train_dataset=Tokens(4096),
                      callbacks=[Progress(args)])
    ftrun.elastic.hf.enable(trainer)  # the one line: nothing outside ftrun
    newest = get_last_checkpoint(str(args.ckpt_dir)) if args.ckpt_dir.is_dir() else None
    trainer.train(resume_from_checkpoint=newest)


if __name__ == "__main__":
    main()
