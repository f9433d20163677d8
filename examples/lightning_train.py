"""Train with PyTorch Lightning, checkpointing through ckptdb.

    pip install 'ckptdb[lightning]'
    python examples/lightning_train.py runs/lightning            # trains 6 epochs
    python examples/lightning_train.py runs/lightning --die-at-step 70   # preempted...
    python examples/lightning_train.py runs/lightning            # ...resumes and finishes

The only change from a stock Lightning script is the import of
``ModelCheckpoint``. Checkpoints land in ``<run>/checkpoints`` under
Lightning's names, the ledger in ``<run>/.checkpoints.ckptdb``;
``fit(ckpt_path="last")`` resumes from the newest *committed* checkpoint, so
a run killed in the middle of a save resumes from the one before it. A
resumed run ends with exactly the weights of an uninterrupted one. At the end
the script prints the best checkpoint and the final weights' checksum.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckptdb.integrations.lightning import ModelCheckpoint


class Regressor(pl.LightningModule):
    """Learns a fixed teacher network; logs ``val_loss`` on a held-out set."""

    def __init__(self, die_at_step: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.die_at_step = die_at_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.die_at_step is not None and self.global_step == self.die_at_step:
            os._exit(17)  # preempted: no clean-up, no flush, like a SIGKILL
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data() -> tuple[DataLoader[Any], DataLoader[Any]]:
    gen = torch.Generator().manual_seed(1234)  # the same task (and batches) on every run
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        x = torch.randn(768, 8, generator=gen)
        y = teacher(x) + 0.1 * torch.randn(768, 1, generator=gen)
    train = TensorDataset(x[:512], y[:512])
    val = TensorDataset(x[512:], y[512:])
    return DataLoader(train, batch_size=32), DataLoader(val, batch_size=128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="the run directory")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--die-at-step", type=int, default=None)
    args = parser.parse_args()

    checkpoint = ModelCheckpoint(
        dirpath=os.path.join(args.run, "checkpoints"),
        monitor="val_loss",
        save_top_k=2,
        save_last=True,
    )
    trainer = pl.Trainer(
        default_root_dir=args.run,
        max_epochs=args.epochs,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
    )
    model = Regressor(die_at_step=args.die_at_step)
    train, val = data()
    trainer.fit(model, train, val, ckpt_path="last")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    print(f"best: {checkpoint.best_model_path} (val_loss {float(checkpoint.best_model_score):.5f})")
    print(f"final step {trainer.global_step}, weights checksum {weights.double().sum():.12f}")


if __name__ == "__main__":
    main()
