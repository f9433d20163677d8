"""A small training loop that publishes checkpoints through ckptdb.

    python examples/train.py runs/example

Run it twice: the second run resumes from the latest checkpoint.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, TopK


def main(root: str = "runs/example", steps: int = 200, every: int = 20) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NonFiniteGradGuard(model)
    streams = {"model": Keep(last=3), "ema": Keep(last=1), "best": TopK(3, "val_loss")}
    x, y = torch.randn(512, 8), torch.randn(512, 1)
    with CheckpointManager(root, streams=streams, guard=guard) as mgr:
        start = 0
        if mgr.latest("model") is not None:
            state = mgr.load("latest")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            start = state["step"] + 1
            print(f"resumed from step {state['step']}")
        for step in range(start, steps):
            loss = nn.functional.mse_loss(model(x[:64]), y[:64])
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
                    val = nn.functional.mse_loss(model(x[64:]), y[64:]).item()
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
