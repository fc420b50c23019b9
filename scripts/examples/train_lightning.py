"""A PyTorch Lightning job (DDP) as written for torchrun: no line of ftrun's.

    torchrun --standalone --nproc-per-node 4 scripts/examples/train_lightning.py --ckpt-dir /tmp/pl
    ftrun --standalone --nproc-per-node 4 --recovery process scripts/examples/train_lightning.py --ckpt-dir /tmp/pl

What it does: an MLP (4 layers of 512, dropout) learns to tell 16 noisy clusters apart in data made here. Every
--ckpt-every steps a ModelCheckpoint saves ``last.ckpt`` in --ckpt-dir, and on start the script resumes from it
(``fit(ckpt_path=...)``): under torchrun a restarted job redoes the steps since it. Under ``ftrun --recovery
process`` a lost rank is replaced alone, with the state of its peers, and no step is redone: ftrun adds its
``Recovery()`` callback as the script makes its Trainer (docs/integrations.md, "No line to add").

For demos and benchmarks: the options of step_log.py (--kill-rank, --kill-at-step, --step-sleep, --progress).
"""

import argparse
import os
from pathlib import Path

import lightning
import step_log
import torch

WIDTH, CLASSES = 512, 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="folder for last.ckpt")
    step_log.add_options(parser)
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
    def __init__(self, args: argparse.Namespace):
        self.step_log = step_log.StepLog(args)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_log.finished(trainer.global_step)


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
        callbacks=[Progress(args), saving])
    last = args.ckpt_dir / "last.ckpt"
    trainer.fit(Classifier(), data, ckpt_path=str(last) if last.exists() else None)


if __name__ == "__main__":
    main()
