"""The Lightning integration, with a real ``lightning.Trainer`` on the CPU.

Our own tests for the scenarios Lightning's ModelCheckpoint tests describe
(top-k with and without ``save_last``, ``save_top_k`` 0/-1/k, a NaN first
score, every-n triggers, resuming, ``last``/``"link"``, version suffixes,
state round trip, pickling, an unknown monitor), and for what the ledger
adds: visibility at commit, the ledger's location, the guard, metrics,
shared ledgers and crashes. Deliberate differences from Lightning are
listed in docs/lightning.md.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from crashlib import fork_running, tail, wait_child
from helpers import LedgerClient
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightninglib import Tiny, trainer

from ckptdb import CheckpointManager, faults
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    LedgerLockedError,
    NonFiniteGradientError,
    PublishError,
    RunDirectoryError,
    UnsupportedVersionError,
)
from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger, newest_committed
from ckptdb.integrations.lightning.compat import LAST_ONLY_AFTER_A_SAVE, TAKES_SAVE_ON_EXCEPTION
from ckptdb.reader import RunReader

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(180),
]


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def ledger_of(dirpath: Path) -> LedgerClient:
    return LedgerClient(default_ledger(dirpath))


def committed(dirpath: Path) -> list[tuple[str, int, str]]:
    return [
        (stream, step, path)
        for stream, step, path in ledger_of(dirpath).rows(
            "SELECT stream, step, path FROM checkpoints WHERE state = 'committed' ORDER BY id"
        )
    ]


def check_clean(dirpath: Path) -> None:
    with CheckpointManager(default_ledger(dirpath), maintenance=True) as mgr:
        assert mgr.check() == []


# --------------------------------------------------------------------- top-k


def test_top_k_with_save_last_names_committed_checkpoints_only(tmp_path: Path) -> None:
    """Lightning 2.6 writes ``last`` only at a step something was saved at; before 2.6,
    at every epoch end (its own ``last.ckpt`` then holds epoch 3, which ckptdb commits
    as ``last-step=16.ckpt`` in the ``last`` stream, ``last.ckpt`` linked to it)."""
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=2, save_last=True)
    trainer(tmp_path, [cb], max_epochs=4).fit(Tiny(val_losses=[3, 1, 2, 4]))
    last_of_epoch_3 = [] if LAST_ONLY_AFTER_A_SAVE else ["last-step=16.ckpt"]
    assert files(d) == [
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        *last_of_epoch_3,
        "last.ckpt",
    ]
    assert cb.best_model_path == str(d / "epoch=1-step=8.ckpt")
    assert float(cb.best_model_score) == 1.0  # type: ignore[arg-type]
    assert {Path(p).name: float(v) for p, v in cb.best_k_models.items()} == {
        "epoch=1-step=8.ckpt": 1.0,
        "epoch=2-step=12.ckpt": 2.0,
    }
    assert cb.kth_best_model_path == str(d / "epoch=2-step=12.ckpt")
    assert cb.last_model_path == str(d / "last.ckpt")
    # last is a hard link to the newest committed checkpoint (epoch 3 was not admitted)
    assert not (d / "last.ckpt").is_symlink()
    newest = "epoch=2-step=12.ckpt" if LAST_ONLY_AFTER_A_SAVE else "last-step=16.ckpt"
    assert os.path.samefile(d / "last.ckpt", d / newest)
    assert [p for _, _, p in committed(d)] == [
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        *last_of_epoch_3,
    ]
    check_clean(d)


# ------------------------------------------------- side by side with Lightning's own


def stock_and_ours(tmp_path: Path, model: Any, **options: Any) -> tuple[Any, Any]:
    """The same fit with Lightning's ``ModelCheckpoint`` and with ckptdb's, each in a
    root of its own; ``dirpath`` (if given) is relative to that root."""
    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    fitting = ("max_epochs", "limit_train_batches", "val_check_interval", "check_val_every_n_epoch")
    fit_options = {k: options.pop(k) for k in fitting if k in options}
    done = []
    for kind, cls in (("stock", Stock), ("ours", ModelCheckpoint)):
        root = tmp_path / kind
        kwargs = dict(options)
        if "dirpath" in kwargs:
            kwargs["dirpath"] = root / kwargs["dirpath"]
        cb = cls(**kwargs)
        trainer(root, [cb], **fit_options).fit(model())
        done.append(cb)
    return done[0], done[1]


def top_k_names(cb: Any) -> tuple[str, list[str], str]:
    return (
        Path(cb.best_model_path).name,
        sorted(Path(p).name for p in cb.best_k_models),
        Path(cb.kth_best_model_path).name,
    )


def checkpoint_files(directory: Path) -> list[str]:
    """The checkpoint files a user sees (``last`` aliases and their backing files aside)."""
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(("last", ".")))


@pytest.mark.parametrize(
    "options",
    [
        {"monitor": "val_loss", "save_top_k": 2},
        {"monitor": "val_loss", "save_top_k": -1, "filename": "{epoch}-{val_loss:.2f}"},
        {"monitor": "val_loss", "mode": "max", "save_top_k": 1, "every_n_epochs": 2},
        {"monitor": None, "save_top_k": 1},
        {"monitor": None, "save_top_k": -1, "every_n_train_steps": 3},
        {"monitor": "val_loss", "save_top_k": 2, "save_last": "link"},
        {"monitor": "step", "mode": "max", "save_top_k": -1, "val_check_interval": 0.5},
        {"monitor": "val_loss", "save_top_k": 2, "check_val_every_n_epoch": 2},
        {"monitor": None, "save_top_k": -1, "train_time_interval": timedelta(microseconds=1)},
    ],
    ids=[
        "top2",
        "template",
        "max-every-2-epochs",
        "no-monitor",
        "every-3-steps",
        "last-link",
        "twice-an-epoch",
        "validated-every-2-epochs",
        "train-time-interval",
    ],
)
def test_the_same_checkpoints_and_top_k_as_lightnings_own(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """Where no deliberate difference applies, the files written and the top-k
    bookkeeping are Lightning's, name for name."""
    stock, ours = stock_and_ours(
        tmp_path,
        lambda: Tiny(val_losses=[3, 1, 2, 0.5, 4]),
        dirpath="ckpts",
        max_epochs=5,
        **options,
    )
    assert top_k_names(ours) == top_k_names(stock)
    assert checkpoint_files(tmp_path / "ours" / "ckpts") == checkpoint_files(
        tmp_path / "stock" / "ckpts"
    )
    assert ours.current_score == stock.current_score
    check_clean(tmp_path / "ours" / "ckpts")


def test_without_dirpath_the_checkpoints_go_where_lightning_puts_them(tmp_path: Path) -> None:
    """``dirpath=None`` and no logger: ``<default_root_dir>/checkpoints``, as Lightning,
    with the ledger beside it."""
    stock, ours = stock_and_ours(tmp_path, Tiny, max_epochs=2)
    assert Path(ours.dirpath) == (tmp_path / "ours" / "checkpoints").resolve()
    assert Path(stock.dirpath).relative_to(tmp_path / "stock") == Path("checkpoints")
    assert files(tmp_path / "ours" / "checkpoints") == files(tmp_path / "stock" / "checkpoints")
    assert default_ledger(ours.dirpath).is_dir()
    check_clean(Path(ours.dirpath))


def test_save_weights_only_writes_what_lightning_writes(tmp_path: Path) -> None:
    stock_and_ours(tmp_path, Tiny, dirpath="ckpts", save_weights_only=True, max_epochs=1)
    [name] = files(tmp_path / "ours" / "ckpts")
    mine = torch.load(tmp_path / "ours" / "ckpts" / name, weights_only=False)
    theirs = torch.load(tmp_path / "stock" / "ckpts" / name, weights_only=False)
    assert "optimizer_states" not in mine and set(mine) == set(theirs)


def test_an_error_in_another_callback_at_the_end_still_leaves_a_loadable_checkpoint(
    tmp_path: Path,
) -> None:
    """``save_on_exception`` and a callback that raises in ``on_train_end``: as with
    Lightning's own callback, a checkpoint of the last step that loads, with weights."""

    class Fails(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            raise RuntimeError("a callback failed")

    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    found = []
    kinds = (("stock", Stock), ("ours", ModelCheckpoint))
    if not TAKES_SAVE_ON_EXCEPTION:  # before Lightning 2.5.3: what 2.5.3 saves (its name
        # formats the epoch as that release counts it at on_train_end)
        found.append((None, 16, sorted(Tiny().state_dict())))
        kinds = kinds[1:]
    for kind, cls in kinds:
        d = tmp_path / kind / "ckpts"
        cb = cls(dirpath=d, every_n_epochs=7, save_on_exception=True)
        with pytest.raises(RuntimeError, match="a callback failed"):
            trainer(tmp_path / kind, [cb, Fails()], max_epochs=4).fit(Tiny())
        [name] = files(d)
        state = torch.load(d / name, weights_only=False)
        found.append((name, state["global_step"], sorted(state["state_dict"])))
    (stock_name, *stock_rest), (name, *rest) = found
    assert rest == stock_rest and name == (stock_name or name)
    assert committed(tmp_path / "ours" / "ckpts") == [("checkpoints.last", 16, name)]


def test_the_same_trainer_fitted_twice_names_its_files_as_lightning_does(
    tmp_path: Path,
) -> None:
    """A fixed ``filename`` and ``STARTING_VERSION``, one Trainer fitted twice (2, then 4
    epochs), every checkpoint kept by its monitor: the same versioned names and top-k as
    Lightning's own."""
    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    found = []
    for kind, cls in (("stock", Stock), ("ours", ModelCheckpoint)):
        cls_versioned = type(f"{kind}Versioned", (cls,), {"STARTING_VERSION": 9})
        d = tmp_path / kind / "ckpts"
        cb = cls_versioned(dirpath=d, filename="test", monitor="epoch", mode="max", save_top_k=-1)
        t = trainer(tmp_path / kind, [cb], max_epochs=2)
        t.fit(Tiny())
        t.fit_loop.max_epochs = 4
        t.fit(Tiny())
        found.append((files(d), sorted(Path(p).name for p in cb.best_k_models)))
    assert found[1] == found[0]
    assert len(found[1][0]) == 4 and "test.ckpt" in found[1][0]  # one per epoch, versioned
    check_clean(tmp_path / "ours" / "ckpts")


def test_resuming_into_another_dirpath_leaves_the_old_files_as_they_are(tmp_path: Path) -> None:
    """Fit into ``a/``, then a new run into ``b/`` from ``a/``'s last checkpoint (a warm
    start from another run's file): ``a/`` stays as it was, ``b/`` gets the new ones."""
    a, b = tmp_path / "a", tmp_path / "b"
    first = ModelCheckpoint(dirpath=a, save_top_k=-1, save_last=True)
    trainer(tmp_path / "one", [first], max_epochs=2).fit(Tiny())
    before = {name: (a / name).read_bytes() for name in files(a)}
    second = ModelCheckpoint(dirpath=b, save_top_k=1)
    trainer(tmp_path / "two", [second], max_epochs=4).fit(Tiny(), ckpt_path=str(a / "last.ckpt"))
    assert {name: (a / name).read_bytes() for name in files(a)} == before
    assert files(b) == ["epoch=3-step=16.ckpt"]
    check_clean(a)
    check_clean(b)


def test_fast_dev_run_saves_nothing_not_even_on_an_exception(tmp_path: Path) -> None:
    """Lightning checkpoints nothing under ``fast_dev_run``, and no exception checkpoint
    either; the ledger commits nothing."""

    class Boom(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("the training's own error")

    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_on_exception=True, save_last=True)
    with pytest.raises(RuntimeError, match="the training's own error"):
        trainer(tmp_path, [cb], fast_dev_run=True).fit(Boom())
    assert not d.exists() or files(d) == []
    ledger = default_ledger(d)
    assert not (ledger / "ckptdb.sqlite").exists() or committed(d) == []


def test_without_save_last_there_is_no_alias(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[2, 1, 3]))
    assert files(d) == ["epoch=1-step=8.ckpt"]
    assert cb.last_model_path == ""


def test_save_top_k_zero_keeps_only_last(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=0, save_last=True)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny())
    # Lightning writes last.ckpt once, at the end; ours is an alias of a committed row
    assert files(d) == ["last-step=8.ckpt", "last.ckpt"]
    assert os.path.samefile(d / "last.ckpt", d / "last-step=8.ckpt")
    assert cb.best_model_path == "" and cb.best_model_score is None and cb.best_k_models == {}
    assert [s for s, _, _ in committed(d)] == ["checkpoints.last"]


def test_save_top_k_minus_one_keeps_everything_ranked(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, filename="{epoch}", monitor="val_loss", save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[2, 1, 3]))
    assert files(d) == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    assert cb.best_model_path == str(d / "epoch=1.ckpt")
    assert cb.kth_best_model_path == str(d / "epoch=2.ckpt")
    assert len(cb.best_k_models) == 3
    with RunReader(default_ledger(d)) as reader:
        assert reader.policies["val_loss"].describe() == "all by val_loss (min)"


@pytest.mark.parametrize("top_k, kept", [(1, ["epoch=2-step=12.ckpt"]), (-1, None)])
def test_without_a_monitor_the_newest_are_kept(
    tmp_path: Path, top_k: int, kept: list[str] | None
) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=top_k)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny())
    everything = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
    assert files(d) == (kept or everything)
    assert cb.best_model_path == str(d / "epoch=2-step=12.ckpt")
    assert cb.best_k_models == {}


@pytest.mark.parametrize(
    "mode, losses, best", [("min", [math.nan, 8, 7, 5], 5.0), ("max", [math.nan, 5, 7, 8], 8.0)]
)
def test_a_nan_first_score_ranks_worst(
    tmp_path: Path, mode: str, losses: list[float], best: float
) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", mode=mode, save_top_k=1)
    trainer(tmp_path, [cb], max_epochs=4).fit(Tiny(val_losses=losses))
    assert float(cb.best_model_score) == best  # type: ignore[arg-type]
    assert files(d) == ["epoch=3-step=16.ckpt"]
    stored = ledger_of(d).rows("SELECT metric, state FROM checkpoints ORDER BY id")
    assert len(stored) == 4 and math.isfinite(stored[0][0])  # NaN ranked as the worst float


def test_a_nan_score_alone_is_best_as_infinity(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1)
    trainer(tmp_path, [cb], max_epochs=1).fit(Tiny(val_losses=[math.nan]))
    assert cb.best_model_score is not None and math.isinf(float(cb.best_model_score))
    assert cb.current_score is not None and math.isinf(float(cb.current_score))


# ----------------------------------------------------------------- triggers


def test_every_n_train_steps(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny())
    assert files(d) == ["step=12.ckpt", "step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]


@pytest.mark.parametrize("n", [0, 2])
def test_every_n_epochs(tmp_path: Path, n: int) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, filename="{epoch}", every_n_epochs=n, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=4).fit(Tiny())
    expected = [f"epoch={e}.ckpt" for e in range(4) if n and (e + 1) % n == 0]
    assert (files(d) if d.exists() else []) == expected


# ------------------------------------------------------------------- resume


def test_fit_last_resumes_from_the_newest_committed_and_keeps_that_file(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    first = ModelCheckpoint(
        dirpath=d, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
    )
    trainer(tmp_path, [first], max_steps=4).fit(Tiny())
    assert files(d) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    second = ModelCheckpoint(
        dirpath=d, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2
    )
    t = trainer(tmp_path, [second], max_steps=8)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(d / "epoch=0-step=4.ckpt")
    resumed = ledger_of(d).rows(
        "SELECT a.resumed_from_id, c.step FROM attempts a JOIN checkpoints c "
        "ON c.id = a.resumed_from_id"
    )
    assert [step for _, step in resumed] == [4]  # recorded as Lightning loaded it
    assert ledger_of(d).rows("SELECT step FROM events WHERE kind = 'resumed'") == [(4,)]
    # step=4 is evicted from the top-2 but stays on disk: the run resumed from it
    assert files(d) == ["epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt"]
    assert set(second.best_k_models) == {
        str(d / "epoch=1-step=6.ckpt"),
        str(d / "epoch=1-step=8.ckpt"),
    }
    check_clean(d)


def test_fit_last_ignores_a_newer_file_that_never_committed(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny())
    time.sleep(0.01)
    torch.save({"not": "a checkpoint"}, d / "last-v1.ckpt")  # newest by mtime, no row
    torch.save({"not": "a checkpoint"}, d / "epoch=9-step=99.ckpt")
    assert newest_committed(default_ledger(d)).path == d / "epoch=1-step=8.ckpt"  # type: ignore[union-attr]
    t = trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True)], max_epochs=3)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(d / "epoch=1-step=8.ckpt")
    assert (d / "epoch=9-step=99.ckpt").exists()  # not ours: left alone


def test_fit_last_skips_a_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny())
    with open(d / "epoch=1-step=8.ckpt", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    t = trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_epochs=3)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(d / "epoch=0-step=4.ckpt")


def test_restored_state_never_names_a_path_the_ledger_no_longer_has(tmp_path: Path) -> None:
    """Resuming from an older checkpoint: the top-k saved inside it names a file that a
    later checkpoint evicted; after the restore the callback holds the ledger's top-k."""
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, filename="{epoch}", monitor="val_loss", save_top_k=2)
    trainer(tmp_path, [cb], max_epochs=5).fit(Tiny(val_losses=[3, 2, 1, 0.5, 0.4]))
    assert files(d) == ["epoch=3.ckpt", "epoch=4.ckpt"]
    inside = torch.load(d / "epoch=3.ckpt", weights_only=False)["callbacks"][cb.state_key]
    assert set(inside["best_k_models"]) == {str(d / "epoch=2.ckpt"), str(d / "epoch=3.ckpt")}
    seen: dict[str, Any] = {}

    class Spy(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["best_k"] = sorted(again.best_k_models)
            seen["best"] = again.best_model_path
            seen["kth"] = again.kth_best_model_path

    again = ModelCheckpoint(dirpath=d, filename="{epoch}", monitor="val_loss", save_top_k=2)
    t = trainer(tmp_path, [again, Spy()], max_epochs=5)
    t.fit(Tiny(val_losses=[9]), ckpt_path=str(d / "epoch=3.ckpt"))
    assert seen["best_k"] == [str(d / "epoch=3.ckpt"), str(d / "epoch=4.ckpt")]
    assert seen["best"] == str(d / "epoch=4.ckpt") and seen["kth"] == str(d / "epoch=3.ckpt")


def test_the_state_saved_inside_a_checkpoint_names_that_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    top = ModelCheckpoint(dirpath=d, filename="top-{epoch}", monitor="val_loss", save_top_k=1)
    every = ModelCheckpoint(dirpath=d, filename="every-{epoch}", save_top_k=-1, stream="every")
    trainer(tmp_path, [top, every], max_epochs=2).fit(Tiny(val_losses=[2, 1]))
    inside = torch.load(d / "top-epoch=1.ckpt", weights_only=False)["callbacks"][top.state_key]
    assert inside["best_model_path"] == str(d / "top-epoch=1.ckpt")
    assert list(inside["best_k_models"]) == [str(d / "top-epoch=1.ckpt")]
    inside = torch.load(d / "every-epoch=1.ckpt", weights_only=False)["callbacks"][every.state_key]
    assert inside["best_model_path"] == str(d / "every-epoch=1.ckpt")


# --------------------------------------------------------------------- last


def test_save_last_link_aliases_the_newest_top_k_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1, save_last="link")
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[1, 2, 3]))
    # epochs 1 and 2 were not admitted: last names epoch 0, and no extra file was written
    assert files(d) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert os.path.samefile(d / "last.ckpt", d / "epoch=0-step=4.ckpt")
    assert not (d / "last.ckpt").is_symlink()


def test_the_alias_outlives_the_eviction_of_its_target(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=1, save_last=True)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny(val_losses=[2, 1]))
    loaded = torch.load(d / "last.ckpt", weights_only=False)
    assert loaded["global_step"] == 8
    assert files(d) == ["epoch=1-step=8.ckpt", "last.ckpt"]


def test_a_custom_last_name_and_its_previous_alias(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ModelCheckpoint, "CHECKPOINT_NAME_LAST", "last-{epoch}")
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny())
    assert files(d) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last-epoch=2.ckpt",
    ]
    assert cb.last_model_path == str(d / "last-epoch=2.ckpt")


@pytest.mark.parametrize("save_last, top_k", [(True, 0), ("link", 1)])
def test_a_rerun_never_aliases_last_to_the_earlier_runs_checkpoint(
    tmp_path: Path, save_last: Any, top_k: int
) -> None:
    """A fresh fit in the same dirpath: ``last`` names this run's final state."""
    d = tmp_path / "ckpts"
    for losses in ([1.0], [5.0]):  # the rerun's score never enters the top-1
        cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=top_k, save_last=save_last)
        model = Tiny(val_losses=losses)
        trainer(tmp_path, [cb], max_epochs=1).fit(model)
    assert Path(cb.last_model_path).name == "last-v1.ckpt"
    saved = torch.load(cb.last_model_path, weights_only=False)["state_dict"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(saved[name], tensor), name


def test_version_suffixes_after_a_rerun(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    for _ in range(2):
        cb = ModelCheckpoint(dirpath=d, filename="{epoch}", save_top_k=-1)
        trainer(tmp_path, [cb], max_epochs=2).fit(Tiny())
    assert files(d) == ["epoch=0-v1.ckpt", "epoch=0.ckpt", "epoch=1-v1.ckpt", "epoch=1.ckpt"]
    assert cb.best_model_path == str(d / "epoch=1-v1.ckpt")
    check_clean(d)


# ------------------------------------------------------- the callback itself


def test_state_dict_round_trip_and_state_key(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=2, save_last=True)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[3, 1, 2]))
    state = cb.state_dict()
    fresh = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=2, save_last=True)
    fresh.load_state_dict(state)  # no ledger open: Lightning's own restore
    for key in ("best_model_path", "best_model_score", "best_k_models", "last_model_path"):
        assert fresh.state_dict()[key] == state[key]
    assert cb.state_key.startswith("ModelCheckpoint{'monitor': 'val_loss'")


def test_nothing_on_disk_in_init_and_the_callback_pickles(tmp_path: Path) -> None:
    cb = ModelCheckpoint(
        dirpath=tmp_path / "ckpts", monitor="val_loss", ledger=tmp_path / "ledger", guard="raise"
    )
    assert files(tmp_path) == []
    assert vars(pickle.loads(pickle.dumps(cb))) == vars(cb)


def test_the_signature_keeps_lightnings_arguments_plus_ours() -> None:
    import inspect

    from lightning.pytorch.callbacks import ModelCheckpoint as Stock

    ours = inspect.signature(ModelCheckpoint).parameters
    stock = inspect.signature(Stock).parameters
    if TAKES_SAVE_ON_EXCEPTION:
        assert list(ours)[: len(stock)] == list(stock)
        positional = ModelCheckpoint(None, None, "val_loss", False, True, 1, True)
        assert positional.save_on_exception and not positional.save_weights_only
    else:  # before 2.5.3: save_on_exception (2.5.3's) sits where 2.5.3 puts it
        assert [name for name in ours if name not in stock][:1] == ["save_on_exception"]
        assert [name for name in ours if name in stock] == list(stock)
        with pytest.raises(ArgumentTypeError, match="seventh argument is save_weights_only"):
            ModelCheckpoint(None, None, "val_loss", False, True, 1, True)
    assert "save_on_exception" in ours  # Lightning 2.5.3's, on every supported release
    assert ours["save_last"].annotation == stock["save_last"].annotation
    assert {"ledger", "db_url", "guard", "stream"} <= set(ours)


@pytest.mark.parametrize("version", ["2.3.3", "2.7.0", "3.0.0", "nightly"])
def test_a_lightning_outside_the_tested_range_is_refused_in_one_line(version: str) -> None:
    from ckptdb.integrations.lightning.compat import check_version

    with pytest.raises(UnsupportedVersionError, match=r">=2\.4,<2\.7") as caught:
        check_version(version)
    assert version in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, RuntimeError)


@pytest.mark.parametrize("version", ["2.4.0", "2.5.6", "2.6.0rc1", "2.6.6"])
def test_every_lightning_in_the_tested_range_is_accepted(version: str) -> None:
    from ckptdb.integrations.lightning.compat import check_version

    assert check_version(version) == version


def test_an_unknown_monitor_is_reported_as_lightning_reports_it(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="nope")
    with pytest.raises(MisconfigurationException, match="could not find the monitored key"):
        trainer(tmp_path, [cb], max_epochs=1).fit(Tiny())
    assert not d.exists() or files(d) == []


def test_bad_callback_arguments_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        ModelCheckpoint(guard="maybe")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ModelCheckpoint(stream="no spaces")


# ------------------------------------------------------------------ the ledger


def test_the_default_ledger_is_outside_dirpath_and_unique_to_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        trainer(tmp_path, [ModelCheckpoint(dirpath=d)], max_epochs=1).fit(Tiny())
    assert default_ledger(a) == tmp_path / ".a.ckptdb" != default_ledger(b)
    assert files(a) == ["epoch=0-step=4.ckpt"]  # checkpoints only
    assert (tmp_path / ".a.ckptdb" / "ckptdb.sqlite").exists()
    assert committed(a) == [("checkpoints", 4, "epoch=0-step=4.ckpt")]
    assert committed(b) == [("checkpoints", 4, "epoch=0-step=4.ckpt")]


def test_a_ledger_that_cannot_hold_a_run_fails_before_training(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    steps: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            steps.append(trainer.global_step)

    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", ledger=tmp_path / "a-file")
    with pytest.raises(RunDirectoryError):
        trainer(tmp_path, [cb, Count()], max_epochs=1).fit(Tiny())
    assert steps == []


def test_a_dirpath_shared_by_two_trainers_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    ready, release = tmp_path / "ready", tmp_path / "release"
    pid = os.fork()
    if pid == 0:  # another trainer's process holding the run
        code = 1
        try:
            with CheckpointManager(default_ledger(d), save_dir=d):
                ready.touch()
                deadline = time.monotonic() + 60
                while not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            code = 0
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline, "the holder never opened the run"
            time.sleep(0.01)
        with pytest.raises(LedgerLockedError, match=f"pid {pid}"):
            trainer(tmp_path, [ModelCheckpoint(dirpath=d)], max_epochs=1).fit(Tiny())
    finally:
        release.touch()
        assert wait_child(pid, timeout=30) == 0


def test_validate_never_takes_the_writer_lock(tmp_path: Path) -> None:
    """Validation or testing in another process while a run trains into dirpath."""
    d = tmp_path / "ckpts"
    trainer(tmp_path, [ModelCheckpoint(dirpath=d)], max_epochs=1).fit(Tiny())
    with CheckpointManager(default_ledger(d), save_dir=d):  # the training run holds the lock
        cb = ModelCheckpoint(dirpath=d)
        t = trainer(tmp_path, [cb], max_epochs=1)
        t.validate(Tiny(), ckpt_path=str(d / "epoch=0-step=4.ckpt"))
        t.test(Tiny(), dataloaders=Tiny().val_dataloader(), ckpt_path="last")
    fresh = tmp_path / "fresh"
    trainer(tmp_path, [ModelCheckpoint(dirpath=fresh)]).validate(Tiny())
    assert not default_ledger(fresh).exists()  # nothing created for a validation


def test_metrics_are_stored_with_each_checkpoint_and_as_history(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=3)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[3, 2, 1]))
    with RunReader(default_ledger(d)) as reader:
        assert [v for _, v, _ in reader.metric_history("val_loss")] == [3.0, 2.0, 1.0]
        assert "train_loss" in reader.metric_names()
        assert reader.best("val_loss")[0].metrics["val_loss"] == 1.0


def test_two_callbacks_share_one_ledger_as_separate_streams(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    best = ModelCheckpoint(dirpath=d, filename="best-{epoch}", monitor="val_loss")
    every = ModelCheckpoint(
        dirpath=d, filename="{step}", every_n_train_steps=4, save_top_k=-1, stream="every"
    )
    trainer(tmp_path, [best, every], max_epochs=2).fit(Tiny(val_losses=[1, 2]))
    assert files(d) == ["best-epoch=0.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert {s for s, _, _ in committed(d)} == {"val_loss", "every"}
    check_clean(d)


def test_two_callbacks_on_one_stream_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    one, two = ModelCheckpoint(dirpath=d), ModelCheckpoint(dirpath=d, every_n_train_steps=2)
    with pytest.raises(InvalidArgumentError, match="pass stream="):
        trainer(tmp_path, [one, two], max_epochs=1).fit(Tiny())


# ------------------------------------------------------------------ the guard


def test_a_nan_gradient_refuses_the_next_checkpoint_and_training_goes_on(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(nan_grad_at=5))
    # epoch 1 (steps 4-7) saw the NaN: its checkpoint (and its last) is refused;
    # the model zeroes the NaN after the guard saw it, so training goes on finite
    assert [step for _, step, _ in committed(d)] == [4, 12]
    events = ledger_of(d).rows("SELECT kind, step FROM events WHERE kind = 'guard_tripped'")
    assert events == [("guard_tripped", 8)]


def test_guard_raise_stops_training(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, guard="raise")
    with pytest.raises(NonFiniteGradientError):
        trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(nan_grad_at=1))
    assert committed(d) == []


def test_guard_false_publishes_regardless(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, guard=False)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny(nan_grad_at=1))
    assert [step for _, step, _ in committed(d)] == [4, 8]


def test_a_step_the_grad_scaler_skipped_does_not_trip_the_guard(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    model = Tiny(nan_grad_at=1)  # the scaler finds the NaN and skips the step
    model.on_before_optimizer_step = lambda optimizer: None  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler("cpu")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    t = trainer(tmp_path, [cb], max_epochs=2, plugins=[plugin])
    t.fit(model)
    assert scaler.get_scale() < 65536.0  # the scaler did skip a step (and backed off)
    assert [step for _, step, _ in committed(d)] == [4, 8]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert ledger_of(d).rows("SELECT kind FROM events WHERE kind = 'guard_tripped'") == []


# ------------------------------------------------------------------ crashes


def _train_forever(d: Path, log: Path) -> None:
    """Child: resume from "last" and train until killed."""
    import logging

    logging.disable(logging.WARNING)
    cb = ModelCheckpoint(
        dirpath=d, monitor="step", mode="max", every_n_train_steps=1, save_top_k=3, save_last=True
    )
    t = trainer(d.parent, [cb], max_epochs=10_000, limit_val_batches=0)
    t.fit(Tiny(width=64), ckpt_path="last")


@pytest.mark.timeout(300)
def test_sigkill_at_random_points_always_resumes_from_a_committed_checkpoint(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ckpts"
    rng = __import__("random").Random(7)
    resumed_steps: list[int] = []
    for _ in range(6):
        log = tmp_path / "child.log"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _train_forever(d, log)
                code = 0
            except BaseException:
                log.write_text(traceback.format_exc())
            finally:
                os._exit(code)
        time.sleep(rng.uniform(2.0, 4.0))
        os.kill(pid, signal.SIGKILL)
        assert wait_child(pid, timeout=30) == -signal.SIGKILL, tail(log)
        newest = newest_committed(default_ledger(d))
        assert newest is not None
        loaded = torch.load(newest.path, weights_only=False)  # whole: it loads
        assert loaded["global_step"] == newest.step
        resumed_steps.append(newest.step)
        with CheckpointManager(default_ledger(d), save_dir=d) as mgr:
            assert mgr.check() == []  # after the open's reconcile: nothing partial is left
            assert not [n for n in files(d) if ".ckptdb-tmp-" in n]
        if (d / "last.ckpt").exists():  # an alias is swapped in whole, or not at all
            assert torch.load(d / "last.ckpt", weights_only=False)["global_step"] > 0
        assert len([n for n in files(d) if ".ckptdb-alias" in n]) <= 1
    assert resumed_steps == sorted(resumed_steps) and resumed_steps[-1] > resumed_steps[0]


# -------------------------------------------------------------------- DDP


class RankReport(pl.Callback):
    """Each rank writes what its ckptdb callback believes, to compare across ranks."""

    def __init__(self, out: Path, cb: ModelCheckpoint) -> None:
        self.out, self.cb = out, cb

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {
            "best": self.cb.best_model_path,
            "best_k": sorted(self.cb.best_k_models),
            "last_saved": self.cb._last_global_step_saved,
            "steps": trainer.global_step,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(state))


class NaNOnRank(Tiny):
    """A NaN gradient on one rank only, after DDP's all-reduce (then zeroed)."""

    def __init__(self, rank: int, step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_rank, self.bad_step = rank, step

    def on_after_backward(self) -> None:
        if self.global_rank == self.bad_rank and self.global_step == self.bad_step:
            assert self.layer.weight.grad is not None
            self.layer.weight.grad.fill_(math.nan)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.global_step == self.bad_step:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0)


def ddp_fit(
    tmp_path: Path, model: Tiny, epochs: int = 3, resume: str | None = None, **kwargs: Any
) -> tuple[Path, list[dict[str, Any]]]:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, **kwargs)
    t = trainer(
        tmp_path, [cb, RankReport(tmp_path, cb)], max_epochs=epochs, strategy="ddp_fork", devices=2
    )
    t.fit(model, ckpt_path=resume)
    return d, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ddp_two_ranks_commit_one_row_per_checkpoint(tmp_path: Path) -> None:
    d, ranks = ddp_fit(tmp_path, Tiny(val_losses=[3, 1, 2]), monitor="val_loss", save_top_k=2)
    assert files(d) == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"]
    assert [step for _, step, _ in committed(d)] == [4, 6]  # epoch 0 evicted after commit
    assert ranks[0] == ranks[1]  # every rank holds the ledger's top-k
    assert ranks[0]["best"] == str(d / "epoch=1-step=4.ckpt")
    check_clean(d)
    # resume on both ranks from the ledger's newest (every rank asks before the group exists)
    _, ranks = ddp_fit(
        tmp_path,
        Tiny(val_losses=[3, 1, 2, 0.5]),
        4,
        "last",
        monitor="val_loss",
        save_top_k=2,
        save_last=True,
    )
    assert ranks[0] == ranks[1] and ranks[0]["steps"] == 8
    assert files(d) == [
        "epoch=1-step=4.ckpt",
        "epoch=2-step=6.ckpt",
        "epoch=3-step=8.ckpt",
        "last.ckpt",
    ]
    assert ranks[0]["best_k"] == [str(d / "epoch=1-step=4.ckpt"), str(d / "epoch=3-step=8.ckpt")]
    check_clean(d)


def test_ddp_a_nan_gradient_on_one_rank_refuses_the_checkpoint_on_every_rank(
    tmp_path: Path,
) -> None:
    d, ranks = ddp_fit(tmp_path, NaNOnRank(rank=1, step=3), save_top_k=-1, save_last=True)
    assert [step for _, step, _ in committed(d)] == [2, 6]  # step 4 refused
    assert files(d) == ["epoch=0-step=2.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    assert ranks[0] == ranks[1] and ranks[0]["steps"] == 6
    detail = ledger_of(d).rows("SELECT step, detail FROM events WHERE kind = 'guard_tripped'")
    assert len(detail) == 1 and detail[0][0] == 4 and json.loads(detail[0][1])["ranks"] == [1]


MODEL_PARALLEL_SCRIPT = """
import sys
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy
from lightninglib import Tiny, trainer
from torch.distributed.fsdp import fully_shard

from ckptdb.integrations.lightning import ModelCheckpoint


class FullyShardedTiny(Tiny):
    def configure_model(self):
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])


d, epochs = Path(sys.argv[1]), int(sys.argv[2])
cb = ModelCheckpoint(dirpath=d / "ckpts", monitor="step", mode="max", save_top_k=1, save_last=True)
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
t = trainer(d, [cb], max_epochs=epochs, strategy=strategy, devices=2)
t.fit(FullyShardedTiny(), ckpt_path=sys.argv[3] if len(sys.argv) > 3 else None)
"""


@pytest.mark.timeout(300)  # 86 s beside a second copy of the suite (2026-12-07)
def test_model_parallel_directory_checkpoints_commit_as_one_row_and_resume(
    tmp_path: Path,
) -> None:
    """FSDP2 (``fully_shard``) under Lightning's ModelParallelStrategy: every rank
    writes its shards into a checkpoint *directory*, bypassing the CheckpointIO.
    Lightning launches the ranks by re-running the script, hence a subprocess."""
    script = tmp_path / "train_sharded.py"
    script.write_text(MODEL_PARALLEL_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}

    def fit(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]

    d = tmp_path / "ckpts"
    fit("2")
    assert files(d) == ["epoch=1-step=4.ckpt", "last.ckpt"]  # step 2 evicted after commit
    assert (d / "epoch=1-step=4.ckpt" / ".metadata").is_file()  # a DCP directory
    shard = next(p.name for p in (d / "last.ckpt").iterdir() if p.suffix == ".distcp")
    assert os.path.samefile(d / "last.ckpt" / shard, d / "epoch=1-step=4.ckpt" / shard)
    fit("3", "last")
    assert [step for _, step, _ in committed(d)] == [6]
    # step 4 left the top-1 but stays on disk: the run resumed from it
    assert files(d) == ["epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt", "last.ckpt"]
    check_clean(d)


@pytest.mark.parametrize("counter", [True, False])
def test_a_fixed_filename_is_never_written_over(tmp_path: Path, counter: bool) -> None:
    d = tmp_path / "ckpts"
    seen: list[list[str]] = []

    class Listing(pl.Callback):
        def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            seen.append(files(d) if d.exists() else [])

    cb = ModelCheckpoint(dirpath=d, filename="model", enable_version_counter=counter)
    trainer(tmp_path, [cb, Listing()], max_epochs=3).fit(Tiny())
    # one file at a time (the older goes after the newer commits), never rewritten in place
    assert seen == [[], ["model.ckpt"], ["model-v1.ckpt"]]
    assert files(d) == ["model.ckpt"]
    assert cb.best_model_path == str(d / "model.ckpt")
    check_clean(d)


def test_a_guard_trip_refuses_every_callbacks_checkpoint_at_that_step(tmp_path: Path) -> None:
    """The guard is read (and reset) by the first save at a step; the other
    callbacks' saves at that step are refused too."""
    d = tmp_path / "ckpts"
    top = ModelCheckpoint(dirpath=d, filename="top-{epoch}", monitor="val_loss", save_top_k=-1)
    every = ModelCheckpoint(dirpath=d, filename="every-{epoch}", save_top_k=-1, stream="every")
    trainer(tmp_path, [top, every], max_epochs=3).fit(Tiny(val_losses=[3, 2, 1], nan_grad_at=5))
    assert sorted((s, step) for s, step, _ in committed(d)) == [
        ("every", 4),
        ("every", 12),
        ("val_loss", 4),
        ("val_loss", 12),
    ]


# ------------------------------------------------------------------ write path


def test_a_custom_checkpoint_io_is_used_and_sealed_by_ckptdb(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    calls: list[str] = []

    class Recording(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            calls.append(Path(path).name)
            super().save_checkpoint(checkpoint, path, storage_options)

    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=2, plugins=[Recording()]).fit(Tiny())
    assert calls == [".epoch=0-step=4.ckpt.ckptdb-tmp-1", ".epoch=1-step=8.ckpt.ckptdb-tmp-2"]
    assert files(d) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    check_clean(d)  # sizes and hashes measured after the IO wrote


def test_a_failed_write_stops_fit_and_the_next_run_resumes_from_the_last_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ckpts"
    real_save = torch.save
    saves: list[int] = []

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        saves.append(1)
        if len(saves) == 2 and not isinstance(f, (str, os.PathLike)):
            f.write(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    with pytest.raises(PublishError) as caught:
        trainer(tmp_path, [cb], max_epochs=3).fit(Tiny())
    assert caught.value.phase == "write" and isinstance(caught.value.__cause__, OSError)
    monkeypatch.setattr(torch, "save", real_save)
    assert files(d) == ["epoch=0-step=4.ckpt"]  # nothing partial, under any name
    states = ledger_of(d).rows("SELECT state FROM checkpoints ORDER BY id")
    assert states == [("committed",), ("aborted",)]
    t = trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_epochs=3)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(d / "epoch=0-step=4.ckpt")
    check_clean(d)


# ---------------------------------------------------------------- failure paths


def test_a_refused_checkpoint_leaves_no_phantom_in_the_callback(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=2)
    trainer(tmp_path, [cb], max_epochs=3).fit(Tiny(val_losses=[3, 2, 1], nan_grad_at=9))
    assert [step for _, step, _ in committed(d)] == [4, 8]  # epoch 2 refused
    assert sorted(cb.best_k_models) == [
        str(d / "epoch=0-step=4.ckpt"),
        str(d / "epoch=1-step=8.ckpt"),
    ]
    assert cb.best_model_path == str(d / "epoch=1-step=8.ckpt")
    assert all(Path(p).exists() for p in [*cb.best_k_models, cb.best_model_path])


def test_a_refused_last_keeps_last_model_path(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=0, save_last=True)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny(nan_grad_at=7))  # refused: epoch 1's
    if LAST_ONLY_AFTER_A_SAVE:  # Lightning 2.6: the end of training is the only save
        assert committed(d) == [] and cb.last_model_path == ""
    else:  # before: a last at every epoch end, epoch 0's committed and still named
        assert committed(d) == [("checkpoints.last", 4, "last-step=4.ckpt")]
        assert cb.last_model_path == str(d / "last.ckpt")
        assert os.path.samefile(d / "last.ckpt", d / "last-step=4.ckpt")


def test_save_on_exception_saves_under_a_free_name_and_keeps_the_error(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"

    class Boom(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 6:
                raise RuntimeError("the training's own error")
            return super().training_step(batch, batch_idx)

    cb = ModelCheckpoint(dirpath=d, filename="model", save_on_exception=True)
    with pytest.raises(RuntimeError, match="the training's own error"):
        trainer(tmp_path, [cb], max_epochs=3).fit(Boom())
    assert files(d) == ["model-v1.ckpt", "model.ckpt"]  # epoch 0's, and the exception's
    assert [(s, step) for s, step, _ in committed(d)] == [
        ("checkpoints", 4),
        ("checkpoints.last", 6),
    ]
    with CheckpointManager(default_ledger(d), save_dir=d) as mgr:  # the ledger was released
        assert mgr.check() == []


def test_a_failed_exception_checkpoint_is_noted_on_the_training_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "ckpts"

    class Boom(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 2:

                def broken(*args: Any, **kwargs: Any) -> None:
                    raise OSError(28, "No space left on device")

                monkeypatch.setattr(torch, "save", broken)
                raise RuntimeError("the training's own error")
            return super().training_step(batch, batch_idx)

    cb = ModelCheckpoint(dirpath=d, save_on_exception=True)
    with pytest.raises(RuntimeError, match="the training's own error") as caught:
        trainer(tmp_path, [cb], max_epochs=3).fit(Boom())
    assert any("the checkpoint on this exception failed" in n for n in caught.value.__notes__)
    monkeypatch.undo()
    states = ledger_of(d).rows("SELECT state FROM checkpoints ORDER BY id")
    assert states == [("aborted",)]


@pytest.mark.parametrize("url", ["file:///tmp/c", "memory://c", "s3://bucket/c"])
def test_a_url_dirpath_is_refused_at_construction(url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="plain path"):
        ModelCheckpoint(dirpath=url)


def test_callbacks_sharing_a_ledger_must_agree_on_the_guard(tmp_path: Path) -> None:
    callbacks = [
        ModelCheckpoint(dirpath=tmp_path / "c", guard=True),
        ModelCheckpoint(dirpath=tmp_path / "c", guard=False, every_n_train_steps=2, stream="o"),
    ]
    with pytest.raises(InvalidArgumentError, match="must agree on guard"):
        trainer(tmp_path, callbacks, max_epochs=1).fit(Tiny())
    assert not (tmp_path / "c").exists()


def test_async_checkpoint_io_is_refused_before_training(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    cb = ModelCheckpoint(dirpath=tmp_path / "c")
    with pytest.raises(InvalidArgumentError, match="AsyncCheckpointIO"):
        trainer(tmp_path, [cb], max_epochs=1, plugins=[AsyncCheckpointIO()]).fit(Tiny())
    assert not (tmp_path / "c").exists()


def test_a_stream_name_too_long_for_its_last_stream_is_refused() -> None:
    ModelCheckpoint(stream="s" * 59)
    with pytest.raises(InvalidArgumentError, match="too long"):
        ModelCheckpoint(stream="s" * 60)


class FailingIO(TorchCheckpointIO):
    """A CheckpointIO that fails on its second save (on rank 0, the only writer)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
        self.calls += 1
        if self.calls == 2:
            raise OSError(5, "the storage went away")
        super().save_checkpoint(checkpoint, path, storage_options)


@pytest.mark.timeout(120)
def test_ddp_a_checkpoint_io_failing_on_rank_0_fails_every_rank_without_a_hang(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    t = trainer(tmp_path, [cb], max_epochs=3, strategy="ddp_fork", devices=2, plugins=[FailingIO()])
    with pytest.raises(Exception, match=r"PublishError|the storage went away"):
        t.fit(Tiny())
    assert ledger_of(d).rows("SELECT step, state FROM checkpoints ORDER BY id") == [
        (2, "committed"),
        (4, "aborted"),
    ]
    assert files(d) == ["epoch=0-step=2.ckpt"]


CRASH_POINTS = [
    "after_intent",
    "mid_write",
    "after_fsync",
    "after_replace",
    "after_fsync_dir",
    "in_commit",
    "after_commit",
    "mid_cleanup",
]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_each_point_of_the_third_save_resumes_from_a_committed_checkpoint(
    tmp_path: Path, point: str
) -> None:
    """Deterministic kills inside a Lightning save, at every fault point of the protocol."""
    d = tmp_path / "ckpts"
    log = tmp_path / "child.log"

    def body() -> int:
        saves = {"n": 0}
        save = CheckpointManager.save

        def counted(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
            saves["n"] += 1
            return save(self, *args, **kwargs)

        def crash(name: str) -> None:
            if name == point and saves["n"] == 3:
                os._exit(9)

        CheckpointManager.save = counted  # type: ignore[method-assign]  # (a forked child)
        faults.set_hook(crash)
        cb = ModelCheckpoint(dirpath=d, save_top_k=1, save_last=True)
        trainer(tmp_path, [cb], max_epochs=5).fit(Tiny())
        return 0

    pid = fork_running(tmp_path, log, body)
    assert wait_child(pid, timeout=120) == 9, tail(log)
    committed_before = point in ("after_commit", "mid_cleanup")
    newest = newest_committed(default_ledger(d))
    assert newest is not None and newest.step == (12 if committed_before else 8)
    t = trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=1, save_last=True)], max_epochs=5)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(newest.path) and t.global_step == 20
    assert [step for _, step, _ in committed(d)] == [20]
    leftovers = [n for n in files(d) if ".ckptdb-" in n]
    assert leftovers == []
    assert os.path.samefile(d / "last.ckpt", d / "epoch=4-step=20.ckpt")
    check_clean(d)


def test_a_ledger_given_as_an_object_store_url_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run root holds the ledger and its lock: ``ledger="s3://..."`` is refused with
    what to do (as every integration refuses it) instead of a local ./s3:/... tree."""
    monkeypatch.chdir(tmp_path)
    for ledger in ("s3://bucket/run", Path("s3://bucket/run")):
        with pytest.raises(InvalidArgumentError, match="save_dir='s3://"):
            ModelCheckpoint(dirpath=tmp_path / "ckpts", ledger=ledger)
    assert list(tmp_path.iterdir()) == []


def test_a_name_a_lost_checkpoint_still_holds_gets_a_version(tmp_path: Path) -> None:
    """A checkpoint whose file vanished is marked lost at the next open, and its row still
    owns its name: a rerun that would write that name again writes ``-v1`` (as for a name
    taken on disk) instead of failing the save."""
    d = tmp_path / "ckpts"
    trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_epochs=1).fit(Tiny())
    (first,) = files(d)
    os.unlink(d / first)
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=1).fit(Tiny())
    stem, suffix = os.path.splitext(first)
    assert files(d) == [f"{stem}-v1{suffix}"]
    states = ledger_of(d).rows("SELECT path, state FROM checkpoints ORDER BY id")
    assert [(os.path.basename(p), s) for p, s in states] == [
        (first, "lost"),
        (f"{stem}-v1{suffix}", "committed"),
    ]
