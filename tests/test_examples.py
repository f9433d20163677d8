"""The single-process example, run as the README tells a newcomer to run it.

It must learn: the validation loss falls over the run, and the top-K "best"
stream follows it (its best checkpoint is not simply the first one saved).
The torchrun example is run end to end in test_distributed.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
