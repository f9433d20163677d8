"""The Lightning case: ckptdb's ModelCheckpoint beside Lightning's stock one.

Every contender is a real ``lightning.Trainer`` fit in which each epoch ends
with one checkpoint (``save_top_k=1`` without a monitor: every save also
evicts the previous one). What is timed is the callback's own save call, as
the training loop waits for it: Lightning's checkpoint dump, the write, and
for ckptdb the fsyncs, the hash, the rename, the commit and the eviction.
The contenders:

- **durable publish (hand-written)**: Lightning's decisions and dump, then
  the file written as it should be: temp file, fsync, rename, directory
  fsync (the baseline);
- **Lightning ModelCheckpoint (TorchCheckpointIO)**: stock, which does not
  fsync;
- **ckptdb ModelCheckpoint**: ours.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .cases import durable_publish
from .harness import Comparison, compare


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Lightning's info lines and warnings off while contenders run."""
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        quiet.setLevel(level)


def _quiet_trainer(where: Path, callback: Any, epochs: int) -> Any:
    """A CPU Trainer with ``callback`` and nothing else (no logger, no progress bar)."""
    import lightning.pytorch as pl

    return pl.Trainer(
        default_root_dir=where,
        callbacks=[callback],
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )


def lightning_checkpoint(work: Path, megabytes: float, reps: int, epochs: int = 4) -> Comparison:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    from ckptdb.integrations.lightning import ModelCheckpoint as Ours

    width = max(8, int((megabytes * 2**20 / 4) ** 0.5))

    class Wide(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(width, width, bias=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(TensorDataset(torch.randn(1, width)), batch_size=1)

    class DurableStock(Stock):
        """Lightning's decisions; the file written durably by hand."""

        def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only)
            Path(filepath).parent.mkdir(parents=True, exist_ok=True)
            durable_publish(checkpoint, Path(filepath))
            self._last_global_step_saved = trainer.global_step
            self._last_checkpoint_saved = filepath

    counter = iter(range(10**9))

    def contender(make: Callable[[Path], Any]) -> Callable[[], float]:
        def run() -> float:
            where = work / str(next(counter))
            callback = make(where / "checkpoints")
            spent: list[float] = []
            save = callback._save_topk_checkpoint

            def timed(*args: Any) -> None:
                start = time.perf_counter()
                save(*args)
                spent.append(time.perf_counter() - start)

            callback._save_topk_checkpoint = timed
            _quiet_trainer(where, callback, epochs).fit(Wide())
            shutil.rmtree(where)
            return sum(spent) / len(spent)

        return run

    contenders = {
        "durable publish (hand-written)": contender(lambda d: DurableStock(dirpath=d)),
        "Lightning ModelCheckpoint (TorchCheckpointIO)": contender(lambda d: Stock(dirpath=d)),
        "ckptdb ModelCheckpoint": contender(lambda d: Ours(dirpath=d)),
    }
    try:
        with _silenced():
            result = compare(
                f"Lightning checkpoint {megabytes:g} MB",
                contenders,
                baseline="durable publish (hand-written)",
                reps=reps,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.notes["target"] = "ckptdb ModelCheckpoint <= Lightning ModelCheckpoint"
    result.notes["per"] = "one save_top_k=1 checkpoint (write + eviction of the previous one)"
    return result


def lightning_guard(work: Path, reps: int, steps: int) -> Comparison:
    """What feeding the guard costs a training step (the callback saves nothing here).

    The same fit of ``steps`` optimizer steps on a small MLP (CPU, 1 thread)
    with Lightning's stock callback, and with ckptdb's with the guard on
    (every step's gradients go through ``NonFiniteGradGuard.observe``) and off.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    from ckptdb.integrations.lightning import ModelCheckpoint as Ours

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 128))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(TensorDataset(torch.randn(steps * 32, 256)), batch_size=32)

    counter = iter(range(10**9))

    def contender(make: Callable[[Path], Any]) -> Callable[[], None]:
        def run() -> None:
            where = work / str(next(counter))
            _quiet_trainer(where, make(where / "checkpoints"), 1).fit(MLP())
            shutil.rmtree(where, ignore_errors=True)  # the stock callback made nothing

        return run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _silenced():
            result = compare(
                f"Lightning fit, {steps} steps (small MLP, CPU, 1 thread)",
                {
                    "Lightning ModelCheckpoint": contender(
                        lambda d: Stock(dirpath=d, save_top_k=0)
                    ),
                    "ckptdb ModelCheckpoint, guard=False": contender(
                        lambda d: Ours(dirpath=d, save_top_k=0, guard=False)
                    ),
                    "ckptdb ModelCheckpoint, guard=True": contender(
                        lambda d: Ours(dirpath=d, save_top_k=0)
                    ),
                },
                baseline="Lightning ModelCheckpoint",
                reps=reps,
            )
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    result.notes["what"] = "the guard's per-step cost; no checkpoint is written"
    return result
