"""Preemption through the ckptdb ``ModelCheckpoint``, with a real ``lightning.Trainer``.

A real SIGTERM (sent by the process to itself from a callback, at a chosen
step and rank) reaches ckptdb's handler, not Lightning's; every rank
checkpoints the agreed step, ``fit`` ends with :class:`~ckptdb.Preempted`
(exit status 143), and ``fit(ckpt_path="last")`` resumes from that step.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.multiprocessing
from helpers import LedgerClient
from lightninglib import Tiny, trainer

from ckptdb import OnPreemption, Preempted
from ckptdb.errors import ArgumentTypeError, InvalidArgumentError
from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger
from ckptdb.reader import RunReader

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(180),
]


class SignalAt(pl.Callback):
    """Sends ``sig`` to this process at the end of ``step``'s batch, on ``rank`` only.

    Lightning runs the ckptdb callback after this one, so in one process the
    agreed step is ``step`` itself."""

    def __init__(self, step: int, rank: int = 0, sig: int = signal.SIGTERM, times: int = 1):
        self.step, self.rank, self.sig, self.times = step, rank, sig, times

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


class Report(pl.Callback):
    """What each rank saw: where training started and how it ended."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, start=trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._write(trainer, reached=trainer.global_step)  # before the ckptdb callback's check

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            saved = [str(c.path) for c in exception.saved]
            self._write(trainer, step=exception.step, code=exception.code, saved=saved)
        else:
            self._write(trainer, error=repr(exception))

    def _write(self, trainer: pl.Trainer, **found: Any) -> None:
        path = self.out / f"rank{trainer.global_rank}.json"
        seen = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**seen, **found}))

    def of(self, rank: int) -> dict[str, Any]:
        return dict(json.loads((self.out / f"rank{rank}.json").read_text()))


def ledger(d: Path) -> LedgerClient:
    return LedgerClient(default_ledger(d))


def events(d: Path, kind: str) -> list[tuple[int, dict[str, Any]]]:
    found = ledger(d).rows("SELECT step, detail FROM events WHERE kind = ? ORDER BY id", kind)
    return [(step, json.loads(detail)) for step, detail in found]


def test_a_sigterm_checkpoints_that_step_ends_fit_143_and_last_resumes_from_it(
    tmp_path: Path,
) -> None:
    d, report = tmp_path / "ckpts", Report(tmp_path)
    before = signal.getsignal(signal.SIGTERM)
    cb = ModelCheckpoint(dirpath=d, save_last=True, preemption=True)
    with pytest.raises(Preempted) as stopped:
        trainer(tmp_path, [SignalAt(5), report, cb], max_epochs=4).fit(Tiny())
    assert stopped.value.code == 143 and stopped.value.step == 5
    assert signal.getsignal(signal.SIGTERM) == before  # ckptdb's and Lightning's handlers gone
    # epoch 0's checkpoint (step 4, the every-epoch save), then the preemption's, in "last"
    assert ledger(d).rows(
        "SELECT stream, step, path FROM checkpoints WHERE state = 'committed' ORDER BY id"
    ) == [
        ("checkpoints", 4, "epoch=0-step=4.ckpt"),
        ("checkpoints.last", 5, "epoch=1-step=5.ckpt"),
    ]
    assert [str(c) for c in stopped.value.saved] and stopped.value.saved[0].step == 5
    assert os.path.samefile(d / "last.ckpt", d / "epoch=1-step=5.ckpt")
    assert ledger(d).rows("SELECT end_state FROM attempts") == [("preempted",)]
    assert events(d, "preemption_saved") == [(5, {"saved": True})]

    resumed = Report(tmp_path / "again")
    resumed.out.mkdir()
    cb = ModelCheckpoint(dirpath=d, save_last=True, preemption=True)
    trainer(tmp_path, [resumed, cb], max_epochs=4).fit(Tiny(), ckpt_path="last")
    assert resumed.of(0)["start"] == 5  # nothing lost but the steps after the signal
    # Lightning put its handlers back first, then the ledger closed: none is left behind
    assert signal.getsignal(signal.SIGTERM) == before
    (summary,) = RunReader(default_ledger(d)).preemptions()
    assert summary["step"] == 5 and summary["resumed_from"] == 5 and summary["lost"] == 0
    assert ledger(d).rows("SELECT end_state FROM attempts ORDER BY id") == [
        ("preempted",),
        ("closed",),
    ]


def test_with_save_last_link_last_names_the_preemption_checkpoint(tmp_path: Path) -> None:
    """``"link"`` makes last the newest top-k checkpoint; after a preemption it is the
    preemption checkpoint, newer than any top-k one: a tool that opens last.ckpt
    loses nothing either."""
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_last="link", preemption=True)
    with pytest.raises(Preempted):
        trainer(tmp_path, [SignalAt(5), cb]).fit(Tiny())
    assert os.path.samefile(d / "last.ckpt", d / "epoch=1-step=5.ckpt")
    assert cb.last_model_path == str(d / "last.ckpt")


def test_a_signal_on_a_step_already_checkpointed_writes_no_second_checkpoint(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, every_n_train_steps=3, save_top_k=-1, preemption=True)
    with pytest.raises(Preempted) as stopped:
        trainer(tmp_path, [SignalAt(6), cb]).fit(Tiny())
    assert [c.step for c in stopped.value.saved] == [6]
    assert ledger(d).rows("SELECT stream, step FROM checkpoints ORDER BY id") == [
        ("checkpoints", 3),
        ("checkpoints", 6),
    ]
    assert events(d, "preemption_saved") == [(6, {"saved": True})]


def test_a_guard_trip_before_the_signal_refuses_the_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_last=True, preemption=OnPreemption(grace=30))
    with pytest.raises(Preempted) as stopped:
        trainer(tmp_path, [SignalAt(6), cb]).fit(Tiny(nan_grad_at=5))
    assert stopped.value.code == 143 and stopped.value.saved == []
    # the last good checkpoint stands: epoch 0's, and last names it
    assert ledger(d).rows("SELECT step FROM checkpoints WHERE state = 'committed'") == [(4,)]
    assert os.path.samefile(d / "last.ckpt", d / "epoch=0-step=4.ckpt")
    ((step, why),) = events(d, "preemption_saved")
    assert step == 6 and why["saved"] is False and "guard" in why["why"]
    assert [s for s, _ in events(d, "guard_tripped")] == [6]
    assert ledger(d).rows("SELECT end_state FROM attempts") == [("preempted",)]


def test_a_second_signal_inside_the_preemption_save_interrupts_nothing(tmp_path: Path) -> None:
    d = tmp_path / "ckpts"
    cb = ModelCheckpoint(dirpath=d, save_top_k=0, save_last=True, preemption=True)
    with pytest.raises(Preempted) as stopped:
        trainer(tmp_path, [SignalAt(2, times=3), cb]).fit(Tiny())
    assert [c.step for c in stopped.value.saved] == [2]
    assert ledger(d).rows("SELECT step, state FROM checkpoints") == [(2, "committed")]
    ((_, told),) = events(d, "preempted")
    assert told == {"signal": "SIGTERM", "ranks": [0]}


def test_ddp_a_signal_on_rank_1_only_stops_both_ranks_at_one_checkpointed_step(
    tmp_path: Path,
) -> None:
    d, report = tmp_path / "ckpts", Report(tmp_path)
    cb = ModelCheckpoint(dirpath=d, save_top_k=-1, save_last=True, preemption=True)
    t = trainer(
        tmp_path,
        [SignalAt(2, rank=1), report, cb],
        max_epochs=5,
        strategy="ddp_fork",
        devices=2,
    )
    with pytest.raises(torch.multiprocessing.ProcessExitedException) as ended:
        t.fit(Tiny())
    assert ended.value.exit_code == 143  # each rank exits as the signal would have
    # the agreement is read one step after it was launched: every rank stops at step 3,
    # mid-epoch (Lightning's fork launcher runs no on_exception hook in its ranks)
    assert report.of(0)["reached"] == report.of(1)["reached"] == 3
    assert ledger(d).rows("SELECT stream, step, state FROM checkpoints ORDER BY id") == [
        ("checkpoints", 2, "committed"),  # epoch 0's
        ("checkpoints.last", 3, "committed"),  # one row: the two ranks agreed
    ]
    assert events(d, "preemption_saved") == [(3, {"saved": True})]
    ((step, told),) = events(d, "preempted")
    assert step == 3 and told == {"signal": "SIGTERM", "ranks": [1]}


def test_bad_preemption_arguments_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ArgumentTypeError, match="preemption must be"):
        ModelCheckpoint(dirpath=tmp_path, preemption="SIGTERM")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="grace"):
        OnPreemption(grace=-1)
    twice = [
        ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", preemption=True),
        ModelCheckpoint(dirpath=tmp_path, stream="other", preemption=True),
    ]
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(InvalidArgumentError, match="both ask for preemption"):
        trainer(tmp_path, twice).fit(Tiny())
    assert signal.getsignal(signal.SIGTERM) == before
    assert os.listdir(tmp_path) == [] or not (tmp_path / "ckpts").exists()
