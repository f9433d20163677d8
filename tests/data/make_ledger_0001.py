"""How ``ledger-0001.sqlite`` was made: a run written by ckptdb at schema revision 0001.

Run with the code of schema 0001 (ckptdb before migration 0002 existed):
``python tests/data/make_ledger_0001.py tests/data/ledger-0001.sqlite``. It
uses the public API only, so the file holds what that release really wrote:
two attempts (the first crashed), keep and top-K streams, evictions, a
rolled-back boundary, a corrupt checkpoint, metrics and events. The
migration tests upgrade copies of it and check that nothing is lost.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

import torch

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.errors import CorruptCheckpointError, PublishError


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), value)}


def main(out: Path) -> None:
    root = Path(tempfile.mkdtemp()) / "run"
    streams = {"model": Keep(last=2), "best": TopK(2, "val_loss"), "all": Keep(last=None)}
    mgr = CheckpointManager(root, streams=streams)
    for step in range(1, 6):
        loss = [0.9, 0.5, 0.7, 0.3, 0.8][step - 1]
        mgr.log_metrics(step, {"loss": loss * 2, "lr": 0.1})
        mgr.save(
            step, metrics={"val_loss": loss}, model=state(step), best=state(step), all=state(step)
        )
    mgr.flush()
    mgr._ctx.ledger.dispose()  # simulate a crash: the attempt stays "running"
    mgr._ctx.lock.release()
    with CheckpointManager(root) as mgr:  # reconcile marks the first attempt crashed
        mgr.load("latest")

        def broken(_f: object) -> None:
            raise OSError(28, "No space left on device")

        try:
            mgr.save(6, model=_Unpicklable(broken))
        except PublishError:
            pass  # rolled back: an aborted row
        else:
            raise AssertionError("the save of step 6 should have failed")
        mgr.save(7, metrics={"val_loss": 0.1}, model=state(7), best=state(7), all=state(7))
    victim = next((root / "checkpoints" / "all").iterdir())
    victim.write_bytes(b"damaged")
    with CheckpointManager(root) as mgr:
        mgr.check()
        try:
            mgr.load(victim)
        except CorruptCheckpointError:
            pass  # marked corrupt
        else:
            raise AssertionError("the damaged checkpoint should not load")
    con = sqlite3.connect(root / "ckptdb.sqlite")
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(root / "ckptdb.sqlite", out)
    shutil.rmtree(root.parent)
    print(f"written {out} ({os.path.getsize(out)} bytes)")


class _Unpicklable:
    """A payload whose serialization fails: the boundary rolls back."""

    def __init__(self, fail: object) -> None:
        self.fail = fail

    def __reduce__(self) -> object:
        raise OSError(28, "No space left on device (while serializing)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
