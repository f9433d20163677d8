"""The interval and the heartbeat in each framework's idiom, with the real frameworks.

Lightning's ``ModelCheckpoint(train_time_interval="auto")``, the HF Trainer's
``checkpoint_interval=``, Accelerate's ``Checkpoints(interval=...).due(step)``:
each saves when the ledger says it is due, and every framework's loop reports
its steps, so ``ckptdb goodput`` measures it.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from acceleratelib import Loop
from helpers import rows
from hflib import dataset, tiny_model, training_args
from lightninglib import Tiny, trainer
from transformers import TrainerCallback

from ckptdb import RunReader
from ckptdb.errors import InvalidArgumentError
from ckptdb.integrations.accelerate import Checkpoints
from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger
from ckptdb.integrations.transformers import Trainer

pytestmark = pytest.mark.timeout(120)

BATCH_S = 0.04  # each training step of these tests takes at least this long
INTERVAL = 0.25  # seconds: about every 6 steps


def interval_events(root: Path) -> list[dict[str, Any]]:
    return [json.loads(d) for (d,) in rows(root, "SELECT detail FROM events WHERE kind='interval'")]


def committed_steps(root: Path) -> list[int]:
    found = rows(root, "SELECT step FROM checkpoints WHERE state='committed' ORDER BY step")
    return [s for (s,) in found]


def assert_paced(root: Path, last_step: int) -> None:
    """Saved on the interval, never sooner; the heartbeat reached the last step."""
    steps = committed_steps(root)
    assert len(steps) >= 2, steps
    boundaries = rows(
        root,
        "SELECT MIN(created_at), MAX(committed_at) FROM checkpoints WHERE state = 'committed'"
        " GROUP BY step ORDER BY step",
    )
    for (_, done), (began, _) in itertools.pairwise(boundaries):  # due counts from a save's end
        gap = (dt.datetime.fromisoformat(began) - dt.datetime.fromisoformat(done)).total_seconds()
        assert gap >= INTERVAL, boundaries
    events = interval_events(root)
    assert events and events[0]["seconds"] == INTERVAL
    (attempt,) = rows(root, "SELECT first_step_at, last_step, saves FROM attempts")
    assert attempt[0] is not None and attempt[1] == last_step and attempt[2] >= len(steps)
    with RunReader(root) as reader:
        report = reader.goodput()
    assert report.attempts[0].measured and report.total.saving_s > 0


class _SlowBatches(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(BATCH_S)


def test_lightning_train_time_interval_auto(tmp_path: Path) -> None:
    cb = ModelCheckpoint(
        dirpath=tmp_path / "ckpts",
        save_top_k=-1,
        train_time_interval="auto",
        min_interval=0.01,
        max_interval=INTERVAL,
    )
    trainer(tmp_path, [_SlowBatches(), cb], max_epochs=6).fit(Tiny())  # 24 steps
    assert_paced(default_ledger(tmp_path / "ckpts"), 24)


def test_lightning_without_an_interval_still_reports_its_steps(tmp_path: Path) -> None:
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_top_k=-1)
    trainer(tmp_path, [cb], max_epochs=2).fit(Tiny())
    ledger = default_ledger(tmp_path / "ckpts")
    assert committed_steps(ledger) == [4, 8]
    assert rows(ledger, "SELECT last_step, saves FROM attempts") == [(8, 2)]
    assert interval_events(ledger) == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"train_time_interval": "sometimes"}, "timedelta or 'auto'"),
        ({"train_time_interval": "auto", "every_n_train_steps": 2}, "mutually exclusive"),
        ({"train_time_interval": "auto", "min_interval": 5.0, "max_interval": 1.0}, "larger"),
    ],
)
def test_lightning_bad_interval(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ModelCheckpoint(dirpath=tmp_path / "ckpts", **options)


def test_lightning_state_key_is_the_same_on_a_due_batch(tmp_path: Path) -> None:
    """A resume finds the callback's state under the key of the batch that saved it."""
    cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", train_time_interval="auto")
    before = cb.state_key
    cb._train_time_interval = timedelta(microseconds=1)  # what a due batch sets
    assert cb.state_key == before


class _SlowSteps(TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(BATCH_S)


def test_transformers_checkpoint_interval(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = training_args(out, max_steps=24, save_strategy="no")
    hf = Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=dataset(96),
        checkpoint_interval=INTERVAL,
        callbacks=[_SlowSteps()],
    )
    hf.train()
    assert_paced(out, 24)
    assert interval_events(out)[0]["why"] == "fixed"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted(
        f"checkpoint-{s}" for s in committed_steps(out)
    )


@pytest.mark.parametrize(
    ("overrides", "options", "match"),
    [
        ({}, {"checkpoint_interval": -1}, "interval must be a positive"),
        ({}, {"min_interval": 5.0}, "go with interval="),
        (
            {"save_strategy": "best", "eval_strategy": "steps", "metric_for_best_model": "loss"},
            {"checkpoint_interval": "auto"},
            "save_strategy='best'",
        ),
    ],
)
def test_transformers_bad_interval(
    tmp_path: Path, overrides: dict[str, Any], options: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Trainer(
            model=tiny_model(),
            args=training_args(tmp_path / "out", **overrides),
            train_dataset=dataset(8),
            **options,
        )


def test_accelerate_due(tmp_path: Path) -> None:
    loop = Loop()
    with Checkpoints(
        loop.accelerator,
        tmp_path / "run",
        interval="auto",
        min_interval=0.01,
        max_interval=INTERVAL,
    ) as checkpoints:

        def maybe_save(step: int) -> Any:
            time.sleep(BATCH_S)
            return checkpoints.save(step) if checkpoints.due(step) else None

        loop.train(24, maybe_save)
    assert_paced(tmp_path / "run", 24)
    assert interval_events(tmp_path / "run")[0]["why"].startswith("no failure")


def test_accelerate_due_without_an_interval(tmp_path: Path) -> None:
    loop = Loop()
    with Checkpoints(loop.accelerator, tmp_path / "run") as checkpoints:
        with pytest.raises(InvalidArgumentError, match="interval="):
            checkpoints.due(1)
        checkpoints.heartbeat(1)
        checkpoints.save(1)
    assert rows(tmp_path / "run", "SELECT last_step, saves FROM attempts") == [(1, 1)]
