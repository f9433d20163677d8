"""A tiny Accelerate training loop for the integration tests: real Accelerator, CPU, seconds.

Every batch is drawn from the global torch RNG and the model has dropout, so a
resume that did not restore the RNG (or the optimizer, or the scheduler)
ends with different weights than an uninterrupted run. ``Loop`` trains step
by step; the rank functions run under :func:`distlib.run_ranks` (forked
ranks of a gloo group, which Accelerate adopts as its own).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from ckptdb import faults
from ckptdb.integrations.accelerate import Checkpoints

WIDTH = 4


@dataclass
class Loop:
    """Model, optimizer and scheduler prepared by ``accelerator``, and one training step.

    ``seed`` decides the initial weights and the batches: a loop that resumes
    is built with another seed, so only what ``load_state`` restores can make
    it match the uninterrupted run.
    """

    seed: int = 0
    accelerator: Accelerator = field(default_factory=lambda: Accelerator(cpu=True))
    nan_at: int | None = None  # a NaN gradient at this step (this rank), seen by the guard only

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        model = nn.Sequential(nn.Linear(WIDTH, 8), nn.Dropout(0.25), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            model, optimizer, scheduler
        )
        self.done = 0
        self._true_grads: list[torch.Tensor] = []
        self.optimizer.optimizer.register_step_pre_hook(self._restore_grads)

    def step(self) -> None:
        """One optimizer step on a batch drawn from the global RNG."""
        self.done += 1
        x = torch.randn(8, WIDTH)
        loss = nn.functional.mse_loss(self.model(x), x.sum(1, keepdim=True))
        self.accelerator.backward(loss)
        if self.done == self.nan_at:
            self._poison()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def train(self, until: int, save: Callable[[int], Any] | None = None) -> list[Any]:
        """Steps up to ``until``; ``save(step)`` after each, its results returned."""
        saved = []
        while self.done < until:
            self.step()
            if save is not None:
                saved.append(save(self.done))
        return saved

    def _poison(self) -> None:
        """NaN gradients that the guard's hook sees (it runs first); the test's own
        pre-hook puts the true ones back, so training goes on exactly as without."""
        self._true_grads = []
        for p in self.model.parameters():
            assert p.grad is not None
            self._true_grads.append(p.grad.clone())
            p.grad.fill_(math.nan)

    def _restore_grads(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._true_grads:
            return
        for p, g in zip(self.model.parameters(), self._true_grads, strict=True):
            assert p.grad is not None
            p.grad.copy_(g)
        self._true_grads = []

    def weights(self) -> dict[str, torch.Tensor]:
        model = self.accelerator.unwrap_model(self.model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def everything(self) -> dict[str, Any]:
        """Weights, optimizer and scheduler state: what must match bit for bit."""
        return {
            "weights": self.weights(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }


def reference(steps: int) -> dict[str, Any]:
    """The state after ``steps`` uninterrupted steps, never checkpointed."""
    loop = Loop(seed=0)
    loop.train(steps)
    return loop.everything()


def same(a: Any, b: Any) -> bool:
    """Deep, exact equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# --------------------------------------------------------------------- crashes


def crash_at(point: str, step: int, root: Path, total: int) -> int:
    """Child: train ``total`` steps, saving after each; SIGKILL inside the save of ``step``.

    ``point`` is one of ckptdb's fault points, or ``"mid_write"``: the kill
    comes while Accelerate writes the checkpoint (after the model file, with
    ``optimizer.bin`` half written), leaving a partial directory behind.
    """
    armed = {"on": False}

    def die(name: str) -> None:
        if armed["on"] and name == point:
            os.kill(os.getpid(), signal.SIGKILL)

    real_save = torch.save

    def half_written(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        if armed["on"] and str(f).endswith("optimizer.bin"):
            Path(f).write_bytes(Path(f).read_bytes()[:100])
            os.kill(os.getpid(), signal.SIGKILL)

    faults.set_hook(die)
    if point == "mid_write":
        torch.save = half_written  # a forked child: nothing else sees it
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root, keep_last=3) as ckpts:

        def save(done: int) -> Any:
            armed["on"] = done == step
            return ckpts.save(done)

        loop.train(total, save)
    return 0


# ------------------------------------------------------------------ two ranks


def join_accelerate(rank: int, world: int) -> Loop:
    """This rank's Loop on the gloo group distlib made (Accelerate adopts it)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    AcceleratorState._reset_state(True)  # the state forked from the test process is 1-rank
    GradientState._reset_state()
    return Loop(seed=0, accelerator=Accelerator(cpu=True))


def two_ranks_train(rank: int, world: int, root: str, slow: float) -> dict[str, Any]:
    """Rank: save at 2 (rank 1 writes its RNG file ``slow`` s late), a NaN gradient on
    rank 1 at step 3 (its save refused), save at 4, train on to 6."""
    loop = join_accelerate(rank, world)
    torch.manual_seed(rank)  # each rank its own batches: its RNG file matters
    loop.nan_at = 3 if rank == 1 else None
    real_save = torch.save

    def late(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).endswith(f"random_states_{rank}.pkl") and rank == 1:
            time.sleep(slow)
        real_save(obj, f, *args, **kwargs)

    torch.save = late
    with Checkpoints(loop.accelerator, root, keep_last=2) as ckpts:
        assert ckpts.resume() is None
        saved = loop.train(4, lambda done: ckpts.save(done) if done >= 2 else None)
        loop.train(6)
    return {
        "saved": [c.step if c is not None else None for c in saved],
        "state": loop.everything(),
    }


def two_ranks_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank: a fresh loop (other weights, other RNG) resumes, then trains to 6."""
    loop = join_accelerate(rank, world)
    torch.manual_seed(100 + rank)
    with Checkpoints(loop.accelerator, root, keep_last=2) as ckpts:
        resumed = ckpts.resume()
        assert resumed is not None
        loop.done = resumed
        loop.train(6)
    return {"resumed": resumed, "state": loop.everything()}


def two_ranks_disagree(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank: a save whose step only rank 1 gets wrong, then a resume whose load fails on
    rank 1 only. Every rank must raise (none waits in a collective), then close."""
    loop = join_accelerate(rank, world)
    outcome: dict[str, Any] = {}
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(1, ckpts.save)
        for call, run in (
            ("save", lambda: ckpts.save(-1 if rank == 1 else 2)),
            ("resume", ckpts.resume),
        ):
            if call == "resume" and rank == 1:
                loop.accelerator.load_state = _broken_load  # type: ignore[method-assign]
            try:
                run()
            except Exception as exc:
                outcome[call] = (type(exc).__name__, getattr(exc, "ranks", None))
        outcome["committed"] = [c.step for c in ckpts.manager.checkpoints()]
    return outcome


def _broken_load(*args: Any, **kwargs: Any) -> None:
    raise OSError(5, "this rank cannot read the checkpoint")
