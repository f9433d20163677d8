"""The default SQLite ledger survives losing its machine (SeaweedFS, a real S3 server).

A replicator copies the ledger beside the checkpoints' copies
(:mod:`ckptdb.ledgercopy`); a new, empty machine comes back from the URL alone
(``ckptdb restore URL DIR``, :func:`ckptdb.restore_run`, or an open with
``remote=`` on a directory without a ledger). The ledger copies are checked
against the bucket itself: a replicator SIGKILLed mid-upload, a zombie
replicator on the old machine, a damaged copy, and bad input.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from click.testing import CliRunner

from ckptdb import CheckpointManager, Keep, Replicator, RunReader, restore_run
from ckptdb.cli import main
from ckptdb.errors import (
    CorruptLedgerReplicaError,
    InvalidArgumentError,
    LedgerReplicaNotFoundError,
    RestoreTargetError,
)
from ckptdb.ledgercopy import PREFIX, STATE_NAME, iter_copies
from ckptdb.storage.remote import remote_store

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=3)}


def state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, generator=generator), "step": step}


def ledger_keys(client: Any, url: str) -> list[str]:
    return [k for k in s3lib.keys_under(client, url, ledger=True) if f"/{PREFIX}/" in k]


def train(root: Path, steps: range, **kwargs: Any) -> None:
    with CheckpointManager(root, streams=STREAMS, **kwargs) as mgr:
        for step in steps:
            mgr.log_metrics(step, {"lr": 0.1 * step})
            mgr.save(step, model=state(step), metrics={"loss": 1.0 / step})


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


# ---------------------------------------------------------------------- the whole story


def test_a_lost_machine_comes_back_from_the_url_alone(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    """10 boundaries replicated with their ledger; the machine is lost (its directory
    deleted); a new empty directory is restored from the URL, resumes from the newest
    copied checkpoint bit-identical, trains on, and its history is there."""
    root = tmp_path / "exp1"
    with Replicator(root_with_run(root), s3_url) as replicator:
        with CheckpointManager(root, streams=STREAMS) as mgr:
            for step in range(1, 11):
                mgr.log_metrics(step, {"lr": 0.1 * step})
                mgr.save(step, model=state(step), metrics={"loss": 1.0 / step})
                replicator.replicate()
    assert replicator.ledger_copy is not None
    assert ledger_keys(client, s3_url)  # the ledger went beside the copies
    shutil.rmtree(root)  # the machine is gone: only the bucket is left

    new = tmp_path / "elsewhere" / "exp1"
    outcome = restore_run(s3_url, new)
    assert [(c.stream, c.step) for c in outcome.restored] == [("model", 10)]
    assert outcome.ledger.run == "exp1" and outcome.ledger.damaged == ()
    with CheckpointManager(new, remote=s3_url) as mgr:
        latest = mgr.latest("model")
        assert latest is not None and latest.step == 10
        got = mgr.load("latest")
        assert torch.equal(got["w"], state(10)["w"]) and got["step"] == 10
        mgr.save(11, model=state(11), metrics={"loss": 1 / 11})
        assert mgr.check(load=True) == []
    result = CliRunner().invoke(main, ["history", str(new), "--metric", "lr", "--json"])
    assert result.exit_code == 0, result.output
    points = [(p["step"], p["value"]) for p in json.loads(result.output)]
    assert points == [(step, pytest.approx(0.1 * step)) for step in range(1, 11)]
    kinds = [e.kind for e in RunReader(new).events(limit=1000)]
    assert "ledger_restored" in kinds


def root_with_run(root: Path) -> Path:
    """An empty run at ``root`` (a replicator needs the run to exist)."""
    CheckpointManager(root, streams=STREAMS).close()
    return root
