"""Preemption through the ckptdb ``Checkpoints``, with a real ``accelerate.Accelerator``.

A real SIGTERM (the process sends it to itself at a chosen step and rank);
``stop.requested(step)`` agrees on the step across ranks and ``save(step)``
there is the preemption checkpoint; a resume restores that step bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from acceleratelib import Loop, join_accelerate, reference, same
from distlib import run_ranks
from helpers import LedgerClient

from ckptdb.integrations.accelerate import Checkpoints

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(120),
]


def train_until_preempted(
    loop: Loop, ckpts: Checkpoints, signal_at: int, rank: int = 0, signalled: int = 0
) -> tuple[int, Any, int]:
    """The documented loop: save every 4 steps; on preemption save and stop.
    (agreed step, what its save returned, exit code)."""
    stop = ckpts.preemption(grace=60)
    while loop.done < 12:
        loop.step()
        if loop.done == signal_at and rank == signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        if stop.requested(loop.done):
            return loop.done, ckpts.save(loop.done), stop.exit_code
        if loop.done % 4 == 0:
            ckpts.save(loop.done)
    raise AssertionError("never preempted")


def events(root: Path, kind: str) -> list[tuple[int, dict[str, Any]]]:
    found = LedgerClient(root).rows("SELECT step, detail FROM events WHERE kind = ?", kind)
    return [(step, json.loads(detail)) for step, detail in found]


def attempts(root: Path) -> list[str]:
    return [s for (s,) in LedgerClient(root).rows("SELECT end_state FROM attempts ORDER BY id")]


def test_a_sigterm_checkpoints_that_step_and_the_resume_matches_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    root, before = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root, keep_last=None) as ckpts:
        step, saved, code = train_until_preempted(loop, ckpts, signal_at=6)
    assert (step, saved.step, code) == (6, 6, 143)
    assert signal.getsignal(signal.SIGTERM) == before  # restored when the ledger closed
    assert attempts(root) == ["preempted"]
    assert events(root, "preemption_saved") == [(6, {"saved": True})]

    again = Loop(seed=1)  # other weights and batches: only load_state can make it match
    with Checkpoints(again.accelerator, root, keep_last=None) as ckpts:
        assert ckpts.resume() == 6
    assert same(again.everything(), reference(6))
    (summary,) = LedgerClient(root).rows("SELECT COUNT(*) FROM events WHERE kind = 'resumed'")
    assert summary == (1,)


def test_a_guard_trip_before_the_signal_refuses_the_preemption_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0, nan_at=5)
    with Checkpoints(loop.accelerator, root, keep_last=None) as ckpts:
        step, saved, code = train_until_preempted(loop, ckpts, signal_at=6)
        assert (step, saved, code) == (6, None, 143)
        assert ckpts.latest() is not None and ckpts.latest().step == 4  # the last good one
    ((at, why),) = events(root, "preemption_saved")
    assert at == 6 and why["saved"] is False and "guard" in why["why"]
    assert sorted(os.listdir(root / "checkpoints")) == ["checkpoint_4"]
    assert attempts(root) == ["preempted"]


def preempted_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    loop = join_accelerate(rank, world)
    with Checkpoints(loop.accelerator, root, keep_last=None) as ckpts:
        step, saved, code = train_until_preempted(loop, ckpts, signal_at=5, rank=rank, signalled=1)
    return {"step": step, "saved": saved.step if saved is not None else None, "code": code}


@pytest.mark.timeout(90)
def test_two_gloo_ranks_a_signal_on_rank_1_only_checkpoints_one_agreed_step(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    ranks = run_ranks(preempted_rank, 2, tmp_path, str(root), timeout=60)
    assert [o.error for o in ranks] == [None, None], [o.trace for o in ranks]
    # every rank stopped at the same step and saved it; rank 0, never signalled, exits 143 too
    assert [o.value for o in ranks] == [{"step": 6, "saved": 6, "code": 143}] * 2
    found = LedgerClient(root).rows("SELECT step, state FROM checkpoints ORDER BY id")
    assert found == [(4, "committed"), (6, "committed")]  # signalled at 5, agreed at 6
    assert events(root, "preempted") == [(6, {"signal": "SIGTERM", "ranks": [1]})]
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= set(
        os.listdir(root / "checkpoints" / "checkpoint_6")
    )
    assert attempts(root) == ["preempted"]
