"""Test-only ``dp``: ckptdb's DeePMD-kit entry point with faults injected from the environment.

- ``CKPTDB_TEST_NAN_STEP=k``: at the k-th optimizer step (0-based) one gradient
  is NaN when ckptdb's guard looks at it (and DeePMD's own guard is fed a NaN
  norm, as its clipping would), and the true gradient is put back before the
  step, so the weights stay finite: the run shows the refusal and then goes
  on to publish the next checkpoint.
- ``CKPTDB_TEST_KILL_AT=point:n``: SIGKILL at the n-th visit of ckptdb's fault
  point ``point`` (:mod:`ckptdb.faults`), i.e. in the middle of a boundary.

Nothing of this is in the library.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch

from ckptdb import faults
from ckptdb.integrations.deepmd import train


def _nan_at(step: int) -> None:
    observe = train.LedgerTrainer._observe
    seen = [0]

    def poisoned(self: Any, optimizer: Any, args: Any, kwargs: Any) -> None:
        if seen[0] == step:
            grads = (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            param = next(grads)
            true = param.grad.clone()
            param.grad.view(-1)[0] = float("nan")
            self.nonfinite_grad_guard.update(torch.tensor(float("nan")))
            observe(self, optimizer, args, kwargs)
            param.grad.copy_(true)
            print(f"TEST: NaN gradient at optimizer step {step}", file=sys.stderr, flush=True)
        else:
            observe(self, optimizer, args, kwargs)
        seen[0] += 1

    train.LedgerTrainer._observe = poisoned  # type: ignore[method-assign]


def _kill_at(point: str, visit: int) -> None:
    seen = [0]

    def hook(name: str) -> None:
        if name == point:
            seen[0] += 1
            if seen[0] == visit:
                print(f"TEST: SIGKILL at {point} #{visit}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    faults.set_hook(hook)


if __name__ == "__main__":
    if "CKPTDB_TEST_NAN_STEP" in os.environ:
        _nan_at(int(os.environ["CKPTDB_TEST_NAN_STEP"]))
    if "CKPTDB_TEST_KILL_AT" in os.environ:
        point, visit = os.environ["CKPTDB_TEST_KILL_AT"].rsplit(":", 1)
        _kill_at(point, int(visit))
    train.main(sys.argv[1:])
