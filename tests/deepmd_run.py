"""Test-only ``dp``: ckptdb's DeePMD-kit entry point with faults injected from the environment.

- ``CKPTDB_TEST_NAN_STEP=k``: at the k-th optimizer step (0-based) one gradient
  is NaN when ckptdb's guard looks at it (and DeePMD's own guard is fed a NaN
  norm, as its clipping would), and the true gradient is put back before the
  step, so the weights stay finite: the run shows the refusal and then goes
  on to publish the next checkpoint.
  ``CKPTDB_TEST_NAN_RANK=r`` (under torchrun): on rank r only, after DDP has
  averaged the gradients, so only that rank's guard sees it.
- ``CKPTDB_TEST_KILL_AT=point:n``: SIGKILL at the n-th visit of ckptdb's fault
  point ``point`` (:mod:`ckptdb.faults`), i.e. in the middle of a boundary.
- ``CKPTDB_TEST_FAIL_WRITE=r:n``: the n-th checkpoint write on rank r (every
  rank runs the writer of each payload; only rank 0's writes a file) raises
  ``OSError(EIO)``.
- ``CKPTDB_TEST_SIGNAL_AT=s[:r]``: SIGTERM to this process (on rank r only,
  default 0) after the optimizer step of DeePMD's step s (its display
  number), just before ckptdb's preemption check of that step.

Under torchrun each rank prints ``TEST: rank R raised TYPE: message`` for the
error it ends with, so a test can tell what every rank saw, and ``TEST: rank R
left alive: [...]``: the trainer's DDP modules and ledgers still in memory when
``dp`` has returned (or raised). A process group they hold, freed only at
interpreter exit, can abort the process there (see
:func:`ckptdb.integrations.deepmd.train.collect_process_groups`).

Nothing of this is in the library.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ckptdb import faults
from ckptdb.integrations.deepmd import session, train

RANK = int(os.environ.get("RANK", "0"))


def say(line: str) -> None:
    """One line to stderr in one write: the ranks share torchrun's pipe, and a
    print() in pieces could interleave with another rank's."""
    os.write(2, (line + "\n").encode())


def _nan_at(step: int, rank: int) -> None:
    observe = session.LedgerTraining._observe
    seen = [0]

    def poisoned(self: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
        if seen[0] == step and rank == RANK:
            grads = (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            param = next(grads)
            true = param.grad.clone()
            param.grad.view(-1)[0] = float("nan")
            self.nonfinite_grad_guard.update(torch.tensor(float("nan")))
            observe(self, optimizer, args, kwargs)
            param.grad.copy_(true)
            say(f"TEST: NaN gradient at optimizer step {step} on rank {RANK}")
        else:
            observe(self, optimizer, args, kwargs)
        seen[0] += 1

    session.LedgerTraining._observe = poisoned  # type: ignore[method-assign]


def _kill_at(point: str, visit: int) -> None:
    seen = [0]

    def hook(name: str) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == visit:
                say(f"TEST: SIGKILL at {point} #{visit}")
                os.kill(os.getpid(), signal.SIGKILL)

    faults.set_hook(hook)


def _fail_write(rank: int, visit: int) -> None:
    make_writer = session.LedgerTraining._writer
    seen = [0]

    def failing_writer(self: Any, own: Any) -> Any:
        write = make_writer(self, own)

        def maybe_fail(target: Any) -> None:
            seen[0] += 1
            if rank == RANK and seen[0] == visit:
                say(f"TEST: write #{visit} fails on rank {RANK}")
                raise OSError(errno.EIO, "injected write failure", str(target))
            write(target)

        return maybe_fail

    session.LedgerTraining._writer = failing_writer  # type: ignore[method-assign]


def _signal_at(step: int, rank: int) -> None:
    """SIGTERM after the optimizer step of DeePMD's step ``step``, counted on its own
    (a global optimizer hook from the attempt's start step), not by ckptdb's counter."""
    run = session.LedgerTraining.run
    done = [0]

    def counting_run(self: Any) -> None:
        done[0] = int(self.start_step)
        run(self)

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        done[0] += 1
        if done[0] == step and rank == RANK:
            say(f"TEST: SIGTERM at step {step} on rank {RANK}")
            os.kill(os.getpid(), signal.SIGTERM)

    session.LedgerTraining.run = counting_run  # type: ignore[method-assign]
    register_optimizer_step_post_hook(after_step)


def _say_left_alive() -> None:
    """What the trainer left in memory (no collection first: what ``main`` left)."""
    kinds = ("DistributedDataParallel", "CheckpointManager")
    alive = sorted(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in kinds)
    say(f"TEST: rank {RANK} left alive: {alive}")


if __name__ == "__main__":
    if "CKPTDB_TEST_SIGNAL_AT" in os.environ:
        at, _, on = os.environ["CKPTDB_TEST_SIGNAL_AT"].partition(":")
        _signal_at(int(at), int(on or 0))
    if "CKPTDB_TEST_NAN_STEP" in os.environ:
        nan_rank = int(os.environ.get("CKPTDB_TEST_NAN_RANK", "0"))
        _nan_at(int(os.environ["CKPTDB_TEST_NAN_STEP"]), nan_rank)
    if "CKPTDB_TEST_KILL_AT" in os.environ:
        point, visit = os.environ["CKPTDB_TEST_KILL_AT"].rsplit(":", 1)
        _kill_at(point, int(visit))
    if "CKPTDB_TEST_FAIL_WRITE" in os.environ:
        rank, visit = os.environ["CKPTDB_TEST_FAIL_WRITE"].split(":")
        _fail_write(int(rank), int(visit))
    try:
        train.main(sys.argv[1:])
    except BaseException as exc:
        if "LOCAL_RANK" in os.environ:
            shown = " ".join(str(exc).split())
            say(f"TEST: rank {RANK} raised {type(exc).__name__}: {shown}")
            _say_left_alive()
        raise
    if "LOCAL_RANK" in os.environ:
        _say_left_alive()
