"""A small training loop that publishes checkpoints through ckptdb.

    python examples/train.py runs/example

The model learns a fixed random "teacher" network from noisy samples; a
held-out validation set from the same distribution scores every checkpoint,
so the validation loss falls and the top-K "best" stream follows it. Run it
twice: the second run resumes from the latest checkpoint.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, TopK


def make_data(n_train: int = 1024, n_val: int = 256) -> tuple[torch.Tensor, ...]:
    """Inputs and targets ``teacher(x) + noise``: a training set and a held-out validation set."""
    gen = torch.Generator().manual_seed(1234)  # the same task on every run
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        x = torch.randn(n_train + n_val, 8, generator=gen)
        y = teacher(x) + 0.1 * torch.randn(n_train + n_val, 1, generator=gen)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def main(root: str = "runs/example", steps: int = 200, every: int = 20) -> None:
    x_train, y_train, x_val, y_val = make_data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NonFiniteGradGuard(model)
    streams = {"model": Keep(last=3), "ema": Keep(last=1), "best": TopK(3, "val_loss")}
    batch = 64
    with CheckpointManager(root, streams=streams, guard=guard) as mgr:
        start = 0
        if mgr.latest("model") is not None:
            state = mgr.load("latest")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            ema.load_state_dict(mgr.load(state["step"], stream="ema"))
            start = state["step"] + 1
            print(f"resumed from step {state['step']}")
        for step in range(start, steps):
            i = step * batch % len(x_train)  # the batches follow the step: a resume sees the same
            loss = nn.functional.mse_loss(model(x_train[i : i + batch]), y_train[i : i + batch])
            opt.zero_grad()
            loss.backward()
            guard.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.mul_(0.9).add_(p, alpha=0.1)
            mgr.log_metrics(step, {"loss": loss.item()})
            if step % every == every - 1:
                with torch.no_grad():
                    val = nn.functional.mse_loss(model(x_val), y_val).item()
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                saved = mgr.save(
                    step,
                    metrics={"val_loss": val},
                    model=state,
                    ema=ema.state_dict(),
                    best=model.state_dict(),
                )
                print(f"step {step}: val_loss {val:.4f} -> {', '.join(saved)}")
        print("latest:", mgr.latest("model").path)
        print("best:", [(c.step, round(c.metric or 0, 4)) for c in mgr.best("best")])


if __name__ == "__main__":
    main(*sys.argv[1:2])
