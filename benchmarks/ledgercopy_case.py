"""The ledger-copy case: what copying a SQLite ledger to object storage costs.

A replicator copies a run's SQLite ledger beside its checkpoints' copies
(:mod:`ckptdb.ledgercopy`), off the training loop. This case measures one copy
of a large ledger (``checkpoints`` committed rows and ``points`` metric
points, built directly in ckptdb's schema) against a local SeaweedFS, side by
side with the bare transfer of the same bytes:

- baseline **boto3 upload_file of the ledger file**: the file as it is on disk
  (after a WAL checkpoint, so it holds everything), uploaded with boto3's
  defaults. A byte copy of a live WAL database is not a consistent copy; it is
  here as the floor of moving those bytes;
- **ckptdb ledger copy**: ``VACUUM INTO`` a scratch file (a consistent, compact
  snapshot), hashed, uploaded with ``If-None-Match: *``, its manifest written,
  older snapshots pruned (one metric point is logged before each, so there is
  a change to copy);
- **ckptdb restore of the ledger**: the newest copy downloaded, checked against
  its manifest and by SQLite's ``integrity_check`` (no epoch claimed).

The notes give the ledger's size, the snapshot's, and the share of a
60-second interval one copy takes (the default ``ledger_interval`` while only
metrics change).
"""

from __future__ import annotations

import itertools
import shutil
import sqlite3
import tempfile
from pathlib import Path

import torch

from .harness import Comparison, compare
from .s3_case import _options
from .s3server import BUCKET, S3Server, running

MB = 1e6


def run(work: Path, sizes: list[tuple[int, int]], reps: int) -> list[Comparison]:
    """One comparison per (checkpoints, metric points), on a server of its own."""
    work.mkdir(parents=True, exist_ok=True)
    try:
        with running(work / "weed") as server:
            return [copy_once(server, work / f"ledger-{n}", n, points, reps) for n, points in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_ledger(root: Path, checkpoints: int, points: int) -> None:
    """A run whose ledger holds ``checkpoints`` committed rows and ``points`` metric
    points (rows only: the case copies the ledger, never the files)."""
    from ckptdb import CheckpointManager, Keep

    with CheckpointManager(root, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(0, model={"w": torch.ones(2)})
        run_id, attempt_id = mgr.run_id, mgr.attempt_id
    con = sqlite3.connect(root / "ckptdb.sqlite")
    with con:
        con.executemany(
            "INSERT INTO checkpoints (run_id, stream, step, attempt_id, path, state, size, hash,"
            " metrics, created_at, committed_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                (
                    run_id,
                    "model",
                    step,
                    attempt_id,
                    f"model/step-{step:09d}.pt",
                    "committed",
                    1 << 20,
                    f"{step:032x}",
                    '{"loss": 0.5}',
                    "2026-01-01 00:00:00",
                    "2026-01-01 00:00:00",
                )
                for step in range(1, checkpoints)
            ),
        )
        con.executemany(
            "INSERT INTO metrics (run_id, attempt_id, step, name, value, wall_time)"
            " VALUES (?,?,?,?,?,?)",
            ((run_id, attempt_id, i // 4, f"m{i % 4}", i * 0.5, 1.7e9 + i) for i in range(points)),
        )
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()


def copy_once(server: S3Server, root: Path, checkpoints: int, points: int, reps: int) -> Comparison:
    from ckptdb.ledgercopy import LedgerCopier, fetch_ledger, snapshot
    from ckptdb.storage.remote import remote_store

    make_ledger(root, checkpoints, points)
    db = root / "ckptdb.sqlite"
    url = f"s3://{BUCKET}/ledger-{checkpoints}"
    remote = remote_store(url, _options(server))
    copier = LedgerCopier(remote, root, db, token="0123456789", run_name=root.name)
    client, keys, steps = server.client(), itertools.count(), itertools.count(10**9)
    con = sqlite3.connect(db)

    def changed_then_copied() -> None:
        with con:
            con.execute(
                "INSERT INTO metrics (run_id, attempt_id, step, name, value, wall_time)"
                " VALUES (1, 1, ?, 'lr', 0.1, 0)",
                (next(steps),),
            )
        assert copier.copy(force=True) is not None

    def fetched() -> None:
        with tempfile.TemporaryDirectory() as scratch:
            fetch_ledger(remote, "0123456789", Path(scratch) / "l.sqlite", claim=False)

    def byte_upload() -> None:
        client.upload_file(str(db), BUCKET, f"plain/{checkpoints}/{next(keys)}.sqlite")

    try:
        result = compare(
            f"ledger copy: {checkpoints:,} checkpoints, {points:,} metric points",
            {
                "boto3 upload_file of the ledger file": byte_upload,
                "ckptdb ledger copy": changed_then_copied,
                "ckptdb restore of the ledger": fetched,
            },
            baseline="boto3 upload_file of the ledger file",
            reps=reps,
        )
        with tempfile.TemporaryDirectory() as scratch:
            made = snapshot(db, Path(scratch) / "s.sqlite")
    finally:
        con.close()
    copy_s = result.medians()["ckptdb ledger copy"]
    result.notes.update(
        ledger_mb=round(db.stat().st_size / MB, 1),
        snapshot_mb=round(made.size / MB, 1),
        share_of_a_60s_interval=round(copy_s / 60, 4),
    )
    return result


__all__ = ["copy_once", "make_ledger", "run"]
