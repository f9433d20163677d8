"""Preemption through the ckptdb ``Trainer``, with a real ``transformers.Trainer``.

A real SIGTERM (the process sends it to itself from a callback at a chosen
step and rank) becomes the agreed step's ``checkpoint-<step>``, committed
through the ledger; ``train`` ends with :class:`~ckptdb.Preempted`, and
``train(resume_from_checkpoint=True)`` continues from that step. The
Trainer's own ``enable_jit_checkpoint`` goes the same way.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import transformers
from helpers import LedgerClient
from hflib import (
    HAS_JIT_CHECKPOINT,
    Definite,
    NaNAt,
    dataset,
    tiny_model,
    torchrun,
    training_args,
)

from ckptdb import OnPreemption, Preempted, RunReader
from ckptdb.errors import ArgumentTypeError, InvalidArgumentError
from ckptdb.integrations.transformers import STREAM, Trainer

pytestmark = [pytest.mark.timeout(240)]


class SignalAt(transformers.TrainerCallback):  # type: ignore[misc]
    """SIGTERM to this process at the end of ``step`` (before the ckptdb callback's
    check: the Trainer runs the user's callbacks first)."""

    def __init__(self, step: int, times: int = 1) -> None:
        self.step, self.times = step, times

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGTERM)


class StartedAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.step: int | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.step is None:
            self.step = state.global_step


def committed(out: Path) -> list[tuple[int, str]]:
    with RunReader(out) as reader:
        return [(c.step, c.path.name) for c in reader.checkpoints(STREAM)]


def events(out: Path, kind: str) -> list[tuple[int, dict[str, Any]]]:
    found = LedgerClient(out).rows("SELECT step, detail FROM events WHERE kind = ?", kind)
    return [(step, json.loads(detail)) for step, detail in found]


def attempts(out: Path) -> list[str]:
    return [s for (s,) in LedgerClient(out).rows("SELECT end_state FROM attempts ORDER BY id")]


def test_a_sigterm_checkpoints_that_step_ends_train_143_and_resume_continues_from_it(
    tmp_path: Path,
) -> None:
    out, before = tmp_path / "out", signal.getsignal(signal.SIGTERM)
    t = Trainer(
        model=tiny_model(),
        args=training_args(out),
        train_dataset=dataset(),
        callbacks=[SignalAt(6, times=2)],  # the second one interrupts nothing
        preemption=OnPreemption(grace=60),
    )
    with pytest.raises(Preempted) as stopped:
        t.train()
    assert stopped.value.code == 143 and stopped.value.step == 6
    assert [c.path.name for c in stopped.value.saved] == ["checkpoint-6"]
    assert signal.getsignal(signal.SIGTERM) == before
    assert committed(out) == [(4, "checkpoint-4"), (6, "checkpoint-6")]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-4", "checkpoint-6"]
    assert (out / "checkpoint-6" / "trainer_state.json").is_file()
    assert attempts(out) == ["preempted"]
    assert events(out, "preempted") == [(6, {"signal": "SIGTERM", "ranks": [0]})]

    started = StartedAt()
    again = Trainer(
        model=tiny_model(), args=training_args(out), train_dataset=dataset(), callbacks=[started]
    )
    again.train(resume_from_checkpoint=True)
    assert started.step == 6 and again.state.global_step == 12
    (summary,) = RunReader(out).preemptions()
    assert summary["resumed_from"] == 6 and summary["lost"] == 0


@pytest.mark.skipif(not HAS_JIT_CHECKPOINT, reason="enable_jit_checkpoint came in transformers 5")
def test_enable_jit_checkpoint_goes_through_the_ledger_with_the_trainers_handler_gone(
    tmp_path: Path,
) -> None:
    out, before = tmp_path / "out", signal.getsignal(signal.SIGTERM)
    args = training_args(out, enable_jit_checkpoint=True)
    t = Trainer(model=tiny_model(), args=args, train_dataset=dataset(), callbacks=[SignalAt(3)])
    names = [type(c).__name__ for c in t.callback_handler.callbacks]
    assert "JITCheckpointCallback" not in names
    assert signal.getsignal(signal.SIGTERM) == before  # its handler taken out with it
    with pytest.raises(Preempted) as stopped:
        t.train()
    assert stopped.value.code == 143
    # at once (no three-second wait), at the step, with no sentinel file
    assert committed(out) == [(3, "checkpoint-3")]
    assert not [p for p in (out / "checkpoint-3").iterdir() if "incomplete" in p.name]


def test_a_guard_trip_before_the_signal_refuses_the_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    out, ref = tmp_path / "out", []
    t = Trainer(
        model=tiny_model(),
        args=training_args(out),
        train_dataset=dataset(),
        callbacks=[NaNAt(ref, step=5), SignalAt(6)],
        preemption=True,
    )
    ref.append(t)
    t.add_callback(Definite(ref))
    with pytest.raises(Preempted) as stopped:
        t.train()
    assert stopped.value.code == 143 and stopped.value.saved == []
    assert committed(out) == [(4, "checkpoint-4")]  # the last good one stands
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-4"]
    ((step, why),) = events(out, "preemption_saved")
    assert step == 6 and why["saved"] is False and "guard" in why["why"]
    assert attempts(out) == ["preempted"]


def test_bad_preemption_argument_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(ArgumentTypeError, match="preemption must be"):
        Trainer(model=tiny_model(), args=training_args(out), train_dataset=dataset(), preemption=15)
    assert not out.exists() or not any(out.iterdir())
    if not HAS_JIT_CHECKPOINT:  # transformers 4.57: nothing to contradict
        return
    args = training_args(out, enable_jit_checkpoint=True)
    with pytest.raises(InvalidArgumentError, match="turns it off"):
        Trainer(model=tiny_model(), args=args, train_dataset=dataset(), preemption=False)


@pytest.mark.timeout(300)
def test_two_ranks_a_signal_on_rank_1_only_checkpoints_one_agreed_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = torchrun(out, "--preempt-step", "5", "--preempt-rank", "1")
    # the agreement is read one step after it was launched: both ranks stop at step 6
    assert [(r["error"], r["code"], r["step"]) for r in results] == [("Preempted", 143, 6)] * 2
    assert [r["saved"] for r in results] == [["checkpoint-6"]] * 2
    assert committed(out) == [(4, "checkpoint-4"), (6, "checkpoint-6")]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in (out / "checkpoint-6").iterdir()
    }
    assert events(out, "preempted") == [(6, {"signal": "SIGTERM", "ranks": [1]})]
    assert attempts(out) == ["preempted"]
