"""A PyTorch Lightning job (DDP on CPU/gloo) with ftrun.elastic.lightning's callback; with PLAIN=1, as written for
torchrun, without it (and without the import).

An MLP with dropout (the RNG state matters) learns random data made here, 8 samples a batch, 4 batches an
epoch per rank (4 ranks): STEPS optimizer steps cross epochs, each of ACCUMULATE batches (default 1:
``accumulate_grad_batches``). Adam with a StepLR stepped every optimizer step. ModelCheckpoint saves every
SAVE_STEPS (default 4) optimizer steps into OUT_DIR/checkpoints, and a CSVLogger logs the loss (log_every_n_steps=1)
into OUT_DIR/logs. Faults as in elastic_train.py: FAULT=rank:step:kind, fired as the step's last batch begins (its
others are done) in original ranks only. STEP_SLEEP (default 0.05) seconds at the end of each batch.

Writes OUT_DIR/pid-start-rank<r>-<pid> at start, appends each finished step to OUT_DIR/commits-rank<r>, and
writes OUT_DIR/rank<r>.json at the end: the final global step, the pid, whether it is a replacement, a digest
of the model's parameters and the optimizer's and the scheduler's state, and one of each checkpoint's.
"""

import json
import os
import time

import faults
import lightning
import teardown
import torch
from digests import digest

PLAIN = os.environ.get("PLAIN") == "1"
if not PLAIN:
    import ftrun.elastic.lightning  # before fit(): under ftrun it joins the job here


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Faults(lightning.Callback):
    def __init__(self, out_dir: str, rank: int):
        self.out_dir, self.rank = out_dir, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kind = faults.due(self.rank, trainer.global_step)
        steps = not trainer.fit_loop.epoch_loop._should_accumulate()
        if kind and steps and os.environ.get("FTRUN_REPLACEMENT") != "1":
            faults.trigger(kind, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            with open(os.path.join(self.out_dir, f"commits-rank{self.rank}"), "a") as f:
                f.write(f"{trainer.global_step - 1}\n")
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.05")))


def saved(path: str) -> str:
    """A digest of a checkpoint's model, optimizer and scheduler state."""
    checkpoint = torch.load(path, weights_only=False)
    return digest(checkpoint["state_dict"], checkpoint["optimizer_states"], checkpoint["lr_schedulers"])


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    with open(os.path.join(out_dir, f"pid-start-rank{rank}-{os.getpid()}"), "w"):
        pass
    lightning.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8, generator=torch.Generator().manual_seed(7)),
                                          torch.randint(0, 4, (128,), generator=torch.Generator().manual_seed(8)))
    model = Model()
    checkpoints = os.path.join(out_dir, "checkpoints")
    saving = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=checkpoints, every_n_train_steps=int(os.environ.get("SAVE_STEPS", "4")), save_top_k=-1)
    trainer = lightning.Trainer(
        accelerator="cpu", strategy="ddp", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
        max_steps=int(os.environ.get("STEPS", "10")), accumulate_grad_batches=int(os.environ.get("ACCUMULATE", "1")),
        logger=lightning.pytorch.loggers.CSVLogger(out_dir, name="logs", version=0), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[Faults(out_dir, rank), saving] + ([] if PLAIN else [ftrun.elastic.lightning.Recovery()]))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    result = {"step": trainer.global_step, "rank": rank, "pid": os.getpid(),
              "replacement": os.environ.get("FTRUN_REPLACEMENT"),
              "digest": digest(model.state_dict(), optimizer.state_dict(), scheduler.state_dict()),
              "checkpoints": {name: saved(os.path.join(checkpoints, name)) for name in sorted(os.listdir(checkpoints))}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    teardown.leave()
