"""A tiny Lightning model for the integration tests: real Trainer, CPU, seconds.

``Tiny`` logs ``val_loss`` from a schedule (or a constant) so tests choose
which epoch is best, and can inject a NaN gradient at one training step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(
        self,
        val_losses: Sequence[float] | None = None,
        nan_grad_at: int | None = None,
        width: int = 4,
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1)
        self.val_losses = list(val_losses) if val_losses is not None else None
        self.nan_grad_at = nan_grad_at
        self.width = width

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def on_after_backward(self) -> None:
        if self.nan_grad_at is not None and self.global_step == self.nan_grad_at:
            assert self.layer.weight.grad is not None
            self.layer.weight.grad.fill_(math.nan)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """After the ckptdb callback saw the NaN: keep the weights finite, so that
        training really goes on (a NaN applied would poison every later step)."""
        if self.nan_grad_at is not None and self.global_step == self.nan_grad_at:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        if self.val_losses is not None:
            loss = torch.tensor(self.val_losses[self.current_epoch % len(self.val_losses)])
        self.log("val_loss", loss)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        return _loader(self.width)

    def val_dataloader(self) -> DataLoader[Any]:
        return _loader(self.width)


def _loader(width: int, n: int = 8) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


def trainer(tmp: Any, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer (no logger, no progress bar) with ``callbacks``."""
    kwargs.setdefault("max_epochs", 3)
    kwargs.setdefault("devices", 1)
    return pl.Trainer(
        default_root_dir=tmp,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        **kwargs,
    )
