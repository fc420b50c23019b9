"""A PyTorch Lightning job (DDP) with ftrun's callback, and the same script under torchrun.

    torchrun --standalone --nproc-per-node 4 scripts/examples/train_lightning.py --ckpt-dir /tmp/pl
    ftrun --standalone --nproc-per-node 4 --recovery process scripts/examples/train_lightning.py --ckpt-dir /tmp/pl

What it does: an MLP (4 layers of 512, dropout) learns to tell 16 noisy clusters apart in data made here. Every
--ckpt-every steps a ModelCheckpoint saves ``last.ckpt`` in --ckpt-dir, and on start the script resumes from it
(``fit(ckpt_path=...)``): under torchrun a restarted job redoes the steps since it. Under ``ftrun --recovery
process`` a lost rank is replaced alone, with the state of its peers, and no step is redone
(``ftrun.elastic.lightning.Recovery()``: docs/integrations.md).

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

import lightning
import torch

import ftrun.elastic.lightning  # under ftrun this joins the job: before fit(), which forms the process group

WIDTH, CLASSES = 512, 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="folder for last.ckpt")
    parser.add_argument("--ckpt-every", type=int, default=10, help="save every K steps (default 10)")
    parser.add_argument("--progress", type=Path, help="append one line per finished step to this file")
    parser.add_argument("--kill-rank", type=int, help="rank that SIGKILLs itself (with --kill-at-step)")
    parser.add_argument("--kill-at-step", type=int, help="step after which --kill-rank SIGKILLs itself")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after every step")
    return parser.parse_args()


class Classifier(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        layers = [layer for _ in range(4) for layer in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                                          torch.nn.Dropout(0.1))]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return torch.nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Progress(lightning.Callback):
    """One line per finished step, and the benchmark's fault."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.file = open(args.progress or os.devnull, "a")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.file.write(f"{time.time():.6f} {self.rank} {step} {os.getpid()} {self.restarts}\n")
        self.file.flush()  # the line is out before a kill below, and readable while the job runs
        if (self.rank == self.args.kill_rank and step == self.args.kill_at_step and self.restarts == 0
                and os.environ.get("FTRUN_REPLACEMENT", "0") != "1"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)


def main() -> None:
    args = parse_args()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    lightning.seed_everything(0, verbose=False)
    centers = torch.randn(CLASSES, WIDTH, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, CLASSES, (8192,), generator=torch.Generator().manual_seed(2))
    inputs = centers[labels] + torch.randn(8192, WIDTH, generator=torch.Generator().manual_seed(3))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=32, shuffle=True)
    saving = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every,
                                                         save_last=True, save_top_k=0)
    trainer = lightning.Trainer(
        accelerator="cpu", strategy="ddp", devices=local, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        max_steps=args.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Progress(args), saving, ftrun.elastic.lightning.Recovery()])  # the callback: nothing outside ftrun
    last = args.ckpt_dir / "last.ckpt"
    trainer.fit(Classifier(), data, ckpt_path=str(last) if last.exists() else None)


if __name__ == "__main__":
    main()
