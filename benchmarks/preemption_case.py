"""The preemption check's cost per step: ``stop.requested(step)`` on two gloo ranks.

Every rank calls it once per step, so its cost is paid every step of every
run, preempted or not. Three contenders, each a training-like loop of
``steps`` steps (a small matmul, one thread per rank) on two forked ranks of
a fresh gloo group, timed on rank 0 from the first step to the last:

- **no check** (the baseline): the loop alone;
- **ckptdb ``stop.requested(step)``**: the pipelined one-byte all-reduce,
  launched at one step and read at the next; and with ``every=10``, launched
  at every tenth step only;
- **a blocking all-reduce per step**: what a hand-written "gather the flag at
  every step" does (the usual fix for checks that miss the signal).

The process start, the group, the manager's opening and ``mgr.preemption()``
are outside the timed loop. In one process ``requested`` reads a flag; its
cost is given as a note (nanoseconds per call, ``timeit``).
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import socket
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

import torch

from .harness import Comparison, compare

NO_CHECK = "no check"
OURS = "ckptdb stop.requested(step)"
OURS_EVERY_10 = "ckptdb stop.requested(step), every=10"
BLOCKING = "a blocking all-reduce per step"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loop(how: str, rank: int, world: int, port: int, root: str, steps: int, out: Any) -> None:
    """One rank: join the group, run the loop ``how``, send rank 0's loop time."""
    import torch.distributed as dist

    from ckptdb import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=dt.timedelta(seconds=60),
    )
    try:
        with CheckpointManager(root) as mgr:
            stop = mgr.preemption(every=10 if how == OURS_EVERY_10 else 1)
            flag = torch.zeros(1, dtype=torch.uint8)
            a = torch.randn(256, 256) / 16
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                a = torch.tanh(a @ a)
                if how in (OURS, OURS_EVERY_10) and stop.requested(step):
                    break
                if how == BLOCKING:
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            elapsed = time.perf_counter() - start
            if rank == 0:
                out.send(elapsed)
    finally:
        dist.destroy_process_group()


def _contender(how: str, work: Path, steps: int) -> Any:
    ctx = multiprocessing.get_context("fork")

    def run() -> float:
        root = tempfile.mkdtemp(dir=work)
        port = _free_port()
        here, there = ctx.Pipe()
        ranks = [
            ctx.Process(target=_loop, args=(how, r, 2, port, root, steps, there)) for r in range(2)
        ]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(120)
        if any(p.exitcode != 0 for p in ranks) or not here.poll():
            raise RuntimeError(f"{how}: a rank failed ({[p.exitcode for p in ranks]})")
        return float(here.recv())

    return run


def _one_process_call_ns(work: Path) -> float:
    """``stop.requested(step)`` in one process (no ranks): nanoseconds per call."""
    from ckptdb import CheckpointManager

    with CheckpointManager(Path(tempfile.mkdtemp(dir=work))) as mgr:
        stop = mgr.preemption()
        calls = 200_000
        seconds = min(timeit.repeat(lambda: stop.requested(1), number=calls, repeat=3))
    return seconds / calls * 1e9


def preemption_check(work: Path, steps: int, reps: int) -> Comparison:
    work.mkdir(parents=True, exist_ok=True)
    kinds = (NO_CHECK, OURS, OURS_EVERY_10, BLOCKING)
    contenders = {how: _contender(how, work, steps) for how in kinds}
    result = compare(
        f"preemption check per step, 2 gloo ranks, {steps} steps",
        contenders,
        baseline=NO_CHECK,
        reps=reps,
    )
    medians = result.medians()
    result.notes["per_step_us"] = {
        how: (medians[how] - medians[NO_CHECK]) / steps * 1e6 for how in kinds[1:]
    }
    result.notes["loop_step_us"] = medians[NO_CHECK] / steps * 1e6
    result.notes["one_process_requested_ns"] = _one_process_call_ns(work)
    return result
