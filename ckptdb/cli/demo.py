"""``ckptdb demo``: a small training run that shows what ckptdb is for.

It trains an MLP on synthetic data on the CPU with three streams (``model``:
keep the last 3, ``ema``: keep the last 1, ``best``: top-3 by validation
loss), then:

1. injects a non-finite gradient once: the guard refuses that boundary and
   the loop rolls back to the latest checkpoint;
2. dies mid-save (``os._exit`` halfway through ``torch.save``, in a child
   process, as a preemption or OOM kill would);
3. restarts: opening the run reconciles (the half-written file is removed,
   the pending row rolled back) and training resumes from the latest
   checkpoint;
4. prints the status table and the SQL that answers "which checkpoint is
   best, and how many restarts did it take".
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from ..errors import CkptDBError, InvalidArgumentError, NonFiniteGradientError
from ..guard import NonFiniteGradGuard
from ..manager import CheckpointManager
from ..policies import Keep, TopK

SAVE_EVERY = 20
CRASH_EXIT = 99
BEST_SQL = """\
SELECT b.step, b.metric AS val_loss,
       (SELECT COUNT(*) FROM attempts a
         WHERE a.run_id = c.run_id AND a.kind = 'train' AND a.id < c.attempt_id) AS restarts_before,
       (SELECT restarts FROM run_restarts r WHERE r.run_id = c.run_id) AS restarts_total,
       c.path
FROM best_checkpoints b JOIN checkpoints c ON c.id = b.checkpoint_id
WHERE b.stream = 'best' AND b.rank = 1"""


def streams() -> dict[str, Any]:
    return {"model": Keep(last=3), "ema": Keep(last=1), "best": TopK(3, "val_loss")}


class Trainer:
    """The demo's model, data and loop state."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.ema = copy.deepcopy(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        teacher = torch.randn(16, 1)
        self.x = torch.randn(2048, 16)
        self.y = torch.tanh(self.x @ teacher) + 0.05 * torch.randn(2048, 1)
        self.guard = NonFiniteGradGuard(self.model)

    def state(self, step: int) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "ema": self.ema.state_dict(),
            "step": step,
        }

    def restore(self, mgr: CheckpointManager) -> int:
        """Load the latest checkpoint if there is one; returns the next step."""
        if mgr.latest("model") is None:
            return 0
        state = mgr.load("latest")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.ema.load_state_dict(state["ema"])
        return int(state["step"]) + 1

    def step(self, step: int, poison: bool) -> float:
        batch = slice((step * 64) % 1536, (step * 64) % 1536 + 64)
        loss = nn.functional.mse_loss(self.model(self.x[batch]), self.y[batch])
        self.opt.zero_grad()
        (loss * float("nan") if poison else loss).backward()  # type: ignore[no-untyped-call]
        self.guard.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.opt.step()
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.model.parameters(), strict=True):
                e.mul_(0.95).add_(p, alpha=0.05)
        return float(loss.item())

    def val_loss(self) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(self.model(self.x[1536:]), self.y[1536:]).item())


def train(
    root: Path, steps: int, *, nan_at: int | None = None, crash_at: int | None = None
) -> None:
    """The training loop; with ``crash_at`` the process dies inside that boundary's save."""
    trainer = Trainer()
    with CheckpointManager(root, streams=streams(), guard=trainer.guard) as mgr:
        if mgr.last_reconcile.actions:
            click.echo(f"restart: {mgr.last_reconcile}")
        step = trainer.restore(mgr)
        if step:
            click.echo(f"resuming from step {step - 1} (the latest committed checkpoint)")
        with click.progressbar(length=steps, label="training", file=sys.stderr) as bar:
            bar.update(step)
            while step < steps:
                poison, nan_at = step == nan_at, (None if step == nan_at else nan_at)
                mgr.log_metrics(step, {"loss": trainer.step(step, poison=poison)})
                mgr.heartbeat(step)  # the step reported: `ckptdb goodput` measures the run
                if step % SAVE_EVERY == SAVE_EVERY - 1:
                    if step == crash_at:
                        _die_inside_next_save()
                    step = _boundary(mgr, trainer, step)
                step += 1
                bar.update(1)


def _boundary(mgr: CheckpointManager, trainer: Trainer, step: int) -> int:
    """Save one boundary; on a guard trip roll back to the latest checkpoint."""
    val = trainer.val_loss()
    try:
        mgr.save(
            step,
            metrics={"val_loss": val},
            model=trainer.state(step),
            ema=trainer.ema.state_dict(),
            best=trainer.model.state_dict(),
        )
    except NonFiniteGradientError as exc:
        click.echo(f"\nguard: {exc}; rolling back to the latest checkpoint")
        return trainer.restore(mgr) - 1
    return step


def _die_inside_next_save() -> None:
    """Replace torch.save so the next save writes half a file, then the process dies."""
    real_save = torch.save

    def half_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os._exit(CRASH_EXIT)

    torch.save = half_then_die


def run_demo(directory: Path, *, steps: int = 300, fresh: bool = True) -> None:
    if steps < 4 * SAVE_EVERY:
        raise InvalidArgumentError(f"the demo needs at least {4 * SAVE_EVERY} steps")
    directory = directory.resolve()
    if fresh:
        _clear(directory)
    boundaries = steps // SAVE_EVERY
    nan_at = (boundaries // 3) * SAVE_EVERY + 5
    crash_at = (2 * boundaries // 3) * SAVE_EVERY - 1
    click.echo(
        f"ckptdb demo in {directory}: {steps} steps, a boundary every {SAVE_EVERY}; "
        f"NaN gradient at step {nan_at}, crash inside the save of step {crash_at}"
    )
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptdb.cli.demo",
            str(directory),
            str(steps),
            str(nan_at),
            str(crash_at),
        ],
        check=False,
    )
    if child.returncode != CRASH_EXIT:
        raise CkptDBError(
            f"the demo's training process exited with {child.returncode}, "
            f"not with the planned crash ({CRASH_EXIT}); its output is above"
        )
    click.echo(
        f"\nthe training process died inside torch.save at step {crash_at} "
        f"(exit status {child.returncode}); restarting\n"
    )
    train(directory, steps)


def _clear(directory: Path) -> None:
    if not directory.exists():
        return
    if any(directory.iterdir()) and not (directory / "ckptdb.sqlite").exists():
        raise InvalidArgumentError(
            f"{directory} is not empty and is not a ckptdb run; pick another directory"
        )
    shutil.rmtree(directory)


if __name__ == "__main__":
    root, total, nan_step, crash_step = sys.argv[1:5]
    train(Path(root), int(total), nan_at=int(nan_step), crash_at=int(crash_step))
