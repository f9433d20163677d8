"""Data-parallel training with ckptdb under torchrun (CPU and gloo here; NCCL alike).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_train.py runs/ddp

Every rank opens the manager and calls ``save``/``latest``/``load`` together;
only rank 0 touches the ledger. The replicated model goes in plain streams
(the chief writes it once); each rank's own state (here its RNG, in a real
job a sharded optimizer or data-loader position) goes in a ``Sharded`` stream
that every rank writes through torch.distributed.checkpoint. Run it twice:
the second run resumes every rank from the latest boundary.

The model learns a fixed random "teacher" network from noisy samples (each
rank draws its own); a held-out validation set from the same distribution,
evaluated by every rank on its share, scores each boundary for the "best"
stream.
"""

from __future__ import annotations

import argparse
import datetime as dt

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, Sharded, TopK

NOISE = 0.1


def teacher_task(n_val: int = 256) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The network to learn, and a held-out validation set: the same on every rank and run."""
    gen = torch.Generator().manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        x_val = torch.randn(n_val, 8, generator=gen)
        y_val = teacher(x_val) + NOISE * torch.randn(n_val, 1, generator=gen)
    return teacher, x_val, y_val


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()

    # A short collective timeout: a rank that dies makes the others fail fast.
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    teacher, x_val, y_val = teacher_task()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = NonFiniteGradGuard(model.module)
    streams = {"model": Keep(last=2), "best": TopK(1, "val_loss"), "ranks": Keep(last=2)}
    torch.manual_seed(1 + rank)  # each rank draws its own data

    with CheckpointManager(args.root, streams=streams, guard=guard) as mgr:
        start = 0
        if mgr.latest("model") is not None:  # every rank gets the chief's answer
            state = mgr.load("latest")  # the chief verifies size and hash, every rank loads
            model.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"] + 1
            mine = {f"rng/{rank}": torch.get_rng_state()}  # filled in place
            mgr.load(state["step"], stream="ranks", into=mine)
            torch.set_rng_state(mine[f"rng/{rank}"])
        for step in range(start, args.steps):
            x = torch.randn(64, 8)
            with torch.no_grad():
                y = teacher(x) + NOISE * torch.randn(64, 1)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            guard.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            if (step + 1) % args.every == 0:
                with torch.no_grad():  # each rank scores its share of the validation set
                    mine = slice(rank, None, world)
                    val = nn.functional.mse_loss(
                        model.module(x_val[mine]), y_val[mine], reduction="sum"
                    )
                dist.all_reduce(val)
                mgr.save(  # collective: publishes on every rank or on none
                    step,
                    metrics={"val_loss": val.item() / len(x_val)},
                    model={
                        "model": model.module.state_dict(),
                        "optim": opt.state_dict(),
                        "step": step,
                    },
                    best=model.module.state_dict(),
                    ranks=Sharded({f"rng/{rank}": torch.get_rng_state()}),
                )
        latest = mgr.latest("model")
        if rank == 0 and latest is not None:
            print(f"latest: step {latest.step} at {latest.path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
