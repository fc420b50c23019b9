"""A Hugging Face Trainer job (transformers + accelerate, DDP on CPU/gloo) with ftrun.elastic.hf's one line where
users put it, after the Trainer is made (the import with it); with PLAIN=1, as written for torchrun, without it.

A GPT-2-shaped model from a config (2 layers, width 32, dropout on: the RNG state matters), data made here,
no hub download. STEPS optimizer steps of GRAD_ACCUM micro-batches each, logging every 2 steps, a checkpoint
every SAVE_STEPS into OUT_DIR/checkpoints. RESUME=path resumes from that checkpoint
(``train(resume_from_checkpoint=...)``). Faults as in elastic_train.py: FAULT=rank:step:kind, fired as the
step begins in original ranks only. STEP_SLEEP (default 0.05) seconds at the end of each step. ZERO=stage trains
through DeepSpeed instead of DDP (hf_zero.py: the Trainer's config for it, ZeRO at that stage, on gloo).

Writes OUT_DIR/pid-start-rank<r>-<pid> at start, appends each finished step to OUT_DIR/commits-rank<r>, and
writes OUT_DIR/rank<r>.json at the end: the final global step, the pid, whether it is a replacement, the
logged losses and a digest of the model's parameters and the optimizer's and the LR scheduler's state.
"""

import json
import os
import time

import faults
import hf_zero
import teardown
import torch
from digests import digest
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

VOCAB, LENGTH = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Sequences of a fixed pattern with noise: something a small model can learn."""

    def __init__(self, count: int):
        generator = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class Faults(TrainerCallback):
    def __init__(self, out_dir: str, rank: int):
        self.out_dir, self.rank = out_dir, rank

    def on_step_begin(self, args, state, control, **kwargs):
        kind = faults.due(self.rank, state.global_step)
        if kind and os.environ.get("FTRUN_REPLACEMENT") != "1":
            faults.trigger(kind, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        with open(os.path.join(self.out_dir, f"commits-rank{self.rank}"), "a") as f:
            f.write(f"{state.global_step - 1}\n")
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"pid-start-rank{rank}-{os.getpid()}"), "w"):
        pass
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "checkpoints"), max_steps=int(os.environ.get("STEPS", "10")),
        per_device_train_batch_size=4, gradient_accumulation_steps=int(os.environ.get("GRAD_ACCUM", "2")),
        learning_rate=1e-3, warmup_steps=2, logging_steps=2, save_steps=int(os.environ.get("SAVE_STEPS", "4")),
        report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **hf_zero.arguments())
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(256), callbacks=[Faults(out_dir, rank)])
    if os.environ.get("PLAIN") != "1":
        import ftrun.elastic.hf

        ftrun.elastic.hf.enable(trainer)
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") or None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result = {"step": trainer.state.global_step, "rank": rank, "pid": os.getpid(), "losses": losses,
              "replacement": os.environ.get("FTRUN_REPLACEMENT"),
              "digest": digest(trainer.model.state_dict(), trainer.optimizer.state_dict(),
                               trainer.lr_scheduler.state_dict())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    teardown.leave()
