"""The examples, run as the README tells a newcomer to run them.

The single-process loop must learn: the validation loss falls over the run,
and the top-K "best" stream follows it (its best checkpoint is not simply the
first one saved). The Lightning example, preempted and resumed, must end
exactly where an uninterrupted run ends. The torchrun example is run end to
end in test_distributed.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptdb.reader import RunReader

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_train_example_learns_and_its_best_checkpoint_moves(tmp_path: Path) -> None:
    root = tmp_path / "example"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "train.py"), str(root)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with RunReader(root) as reader:
        val_loss = [(step, value) for step, value, _attempt in reader.metric_history("val_loss")]
        best = reader.best("best")
    assert len(val_loss) >= 3, val_loss
    (first_step, first), (_, last) = val_loss[0], val_loss[-1]
    assert last < first, val_loss  # it learns
    assert best, "no best checkpoint"
    assert best[0].step != first_step, (best, val_loss)  # the best is not just the first save
    assert (best[0].step, best[0].metric) == min(val_loss, key=lambda sv: sv[1])


def _lightning_example(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), str(run), *args],
        capture_output=True,
        text=True,
        cwd=run.parent,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(240)  # 72 s beside a second copy of the suite (2026-12-07)
def test_lightning_example_resumed_after_preemption_ends_where_an_uninterrupted_run_ends(
    tmp_path: Path,
) -> None:
    whole = _lightning_example(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    died = _lightning_example(tmp_path / "resumed", "--die-at-step", "70")
    assert died.returncode == 17, died.stderr[-3000:]  # preempted in epoch 4
    resumed = _lightning_example(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "epoch=3-step=64.ckpt" in resumed.stderr  # the newest committed checkpoint
    final = [line for line in whole.stdout.splitlines() if line.startswith("final")]
    assert final and final == [s for s in resumed.stdout.splitlines() if s.startswith("final")]
    a = torch.load(tmp_path / "whole/checkpoints/last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 96
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
