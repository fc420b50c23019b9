"""A Lightning script as its users write it (DDP on CPU/gloo), with ftrun's lines only when INTEGRATION=1 (under
``ftrun --recovery process`` it gets ftrun's integration without them, unless ``--no-integrations``).

An MLP with LayerNorm learns random data made here: AdamW, a StepLR stepped every optimizer step, a shuffled
DataLoader with a ``torch.Generator`` of its own, ``deterministic=True``, a ModelCheckpoint every SAVE_STEPS
(default 10) steps into OUT_DIR/checkpoints. STEPS (default 20) optimizer steps of 8 samples a rank, across
epochs. With INTEGRATION=1 the script imports ``ftrun.elastic.lightning`` and adds its ``Recovery()`` callback,
and nothing else changes: the final state must be the same bit for bit either way.

Writes OUT_DIR/rank<r>.json at the end: the final global step, whether the Trainer had ftrun's callback, and a
digest of the model's parameters and the optimizer's and the scheduler's state.
"""

import json
import os

import lightning
import teardown
import torch
from digests import digest

INTEGRATION = os.environ.get("INTEGRATION") == "1"
if INTEGRATION:
    import ftrun.elastic.lightning  # before fit(): under ftrun it joins the job here


class Model(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    out_dir = os.environ["OUT_DIR"]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(192, 16), torch.randint(0, 4, (192,)))
    model = Model()
    saving = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=os.path.join(out_dir, "checkpoints"), every_n_train_steps=int(os.environ.get("SAVE_STEPS", "10")),
        save_top_k=-1)
    callbacks: list = [saving]
    if INTEGRATION:
        callbacks.append(ftrun.elastic.lightning.Recovery())
    trainer = lightning.Trainer(
        accelerator="cpu", strategy="ddp", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
        max_steps=int(os.environ.get("STEPS", "20")), deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    trainer.fit(model, loader)
    optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    result = {"step": trainer.global_step, "rank": rank,
              "recovery": any(type(callback).__name__ == "Recovery" for callback in trainer.callbacks),
              "digest": digest(model.state_dict(), optimizer.state_dict(), scheduler.state_dict())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    teardown.leave()
