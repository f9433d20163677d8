"""``CheckpointManager(remote=...)``: resuming from the newest checkpoint a run can reach.

Against SeaweedFS (a real S3 server). A manager that knows where its run's
copies are opens on a machine whose disk lost the run (the ledger on
PostgreSQL) and resumes from the newest copies, bit-identical; a load whose
local copy is missing or corrupt downloads and verifies the copy instead of
falling back to an older checkpoint; what cannot be restored keeps the load's
own error, with the reason noted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from helpers import LedgerClient, flip_byte

from ckptdb import CheckpointManager, Keep, Replicator, Sharded
from ckptdb.errors import (
    CheckpointLostError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RunDirectoryError,
)

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=3), "sh": Keep(last=2)}


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


@pytest.fixture
def client(s3_env: s3lib.S3Server) -> Any:
    return s3_env.client()


def state(step: int) -> dict[str, Any]:
    return {"w": torch.randn(256, generator=torch.Generator().manual_seed(step)), "step": step}


def sharded(step: int) -> dict[str, Any]:
    return {"a": torch.full((3, 2), float(step)), "n": step}


def zeroed() -> dict[str, Any]:
    return {"a": torch.zeros(3, 2), "n": 0}


def replicated_run(
    open_manager: Callable[..., CheckpointManager], root: Path, url: str, db_url: str | None
) -> CheckpointManager:
    """Steps 10-30 of both streams saved and copied (the manager stays open, with
    ``remote=``)."""
    mgr = open_manager(streams=STREAMS, remote=url)
    for step in (10, 20, 30):
        mgr.save(step, model=state(step), sh=Sharded(sharded(step)))
    with Replicator(root, url, db_url=db_url) as replicator:
        replicator.replicate()
    return mgr


def events(db: LedgerClient, kind: str) -> list[tuple[int | None, dict[str, Any]]]:
    found = db.rows("SELECT step, detail FROM events WHERE kind = ? ORDER BY id", kind)
    return [(step, json.loads(detail) if detail else {}) for step, detail in found]


# ------------------------------------------------------------- a new machine


@pytest.mark.postgres
def test_a_new_machine_opens_and_resumes_from_the_newest_copy(
    tmp_path: Path, pg_url: str, s3_url: str
) -> None:
    root = tmp_path / "run"
    streams = {**STREAMS, "rng": Keep(last=1)}  # rng: local-only, never copied
    with CheckpointManager(root, db_url=pg_url, streams=streams) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, model=state(step), sh=Sharded(sharded(step)), rng=state(-step))
    with Replicator(root, s3_url, db_url=pg_url, streams=["model", "sh"]) as replicator:
        replicator.replicate()
    with CheckpointManager(root, db_url=pg_url, streams=streams) as mgr:
        mgr.save(40, model=state(40))  # never copied: lost with the machine
    shutil.rmtree(root)  # the machine is gone; the ledger (PostgreSQL) and the copies stay

    with pytest.raises(RunDirectoryError, match="is its filesystem mounted"):
        CheckpointManager(root, db_url=pg_url, streams=streams)  # without remote=: refused

    with CheckpointManager(root, db_url=pg_url, streams=streams, remote=s3_url) as mgr:
        assert sorted((c.stream, c.step) for c in mgr.restored_at_open) == [
            ("model", 30),
            ("sh", 30),
        ]
        lost = sorted(a.path for a in mgr.last_reconcile.actions if a.kind == "lost")
        assert lost == [
            "model/step-000000020.pt",
            "model/step-000000040.pt",
            "rng/step-000000030.pt",
            "sh/step-000000020.dcp",
        ]
        assert mgr.latest("rng") is None
        got = mgr.load()
        assert torch.equal(got["w"], state(30)["w"]) and got["step"] == 30
        into = zeroed()
        mgr.load(stream="sh", into=into)
        assert torch.equal(into["a"], sharded(30)["a"]) and into["n"] == 30
        assert mgr.check(load=True) == []
        mgr.save(50, model=state(50), rng=state(-50))  # training goes on
    db = LedgerClient(root, pg_url)
    try:
        (recreated,) = events(db, "save_dir_recreated")
        assert recreated[1]["remote"] == s3_url
        assert [step for step, _ in events(db, "restored_from_replica")] == [30, 30]
    finally:
        db.close()
    with CheckpointManager(root, db_url=pg_url, streams=streams) as mgr:  # a normal open now
        assert mgr.latest("model").step == 50  # type: ignore[union-attr]


def test_a_remote_that_cannot_be_read_at_open_resumes_from_what_is_here(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    mgr.close()
    for key in s3lib.keys_under(client, s3_url):  # the copies are gone too
        client.delete_object(Bucket=s3lib.BUCKET, Key=key)
    (root / "checkpoints" / "model" / "step-000000030.pt").unlink()

    reopened = open_manager(streams=STREAMS, remote=s3_url)
    assert reopened.restored_at_open == []
    assert reopened.latest("model").step == 20  # type: ignore[union-attr]
    ((_, failed),) = events(db, "restore_failed")
    assert failed["remote"] == s3_url and "ObjectStoreError" in failed["error"]
    assert not list(root.rglob(".*.tmp-*"))


# ------------------------------------------------------------- a load falls back to the copy


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_a_bad_newest_local_copy_loads_from_its_copy(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    damage: str,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    newest = mgr.latest("model")
    shard = next(p for p in sorted(mgr.latest("sh").path.iterdir()) if p.suffix == ".distcp")  # type: ignore[union-attr]
    assert newest is not None
    if damage == "flipped":
        flip_byte(newest.path)
        flip_byte(shard)
    else:
        newest.path.unlink()
        shard.unlink()

    got = mgr.load()
    assert torch.equal(got["w"], state(30)["w"]) and got["step"] == 30
    into = zeroed()
    mgr.load(stream="sh", into=into)
    assert torch.equal(into["a"], sharded(30)["a"]) and into["n"] == 30
    assert mgr.latest("model") == newest and mgr.check(load=True) == []
    # a missing file is lost, a directory missing a file corrupt; each marked, then restored
    marked = {kind: [s for s, _ in events(db, kind)] for kind in ("lost", "corrupt")}
    assert marked == (
        {"lost": [], "corrupt": [30, 30]}
        if damage == "flipped"
        else {"lost": [30], "corrupt": [30]}
    )
    assert [step for step, _ in events(db, "restored_from_replica")] == [30, 30]
    quarantined = sorted(p.name for p in (root / "ckptdb.quarantine").glob("*/step-*"))
    kept_aside = ["step-000000030.pt"] if damage == "flipped" else []
    assert quarantined == ["step-000000030.dcp", *kept_aside]


def test_verify_falls_back_to_the_copy_too(
    open_manager: Callable[..., CheckpointManager], root: Path, db_url: str | None, s3_url: str
) -> None:
    """What the framework integrations call before they read a checkpoint themselves."""
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    newest = mgr.latest("model")
    assert newest is not None
    flip_byte(newest.path)
    assert mgr.verify() == newest
    assert torch.equal(torch.load(newest.path)["w"], state(30)["w"])


def test_a_bad_local_copy_without_a_copy_fails_as_before_saying_why(
    open_manager: Callable[..., CheckpointManager], root: Path, db_url: str | None, s3_url: str
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    uncopied = mgr.save(40, model=state(40))["model"]
    flip_byte(uncopied.path)
    with pytest.raises(CorruptCheckpointError) as caught:
        mgr.load()
    assert "it has no whole copy on the remote tier" in caught.value.__notes__
    assert mgr.latest("model").step == 30  # type: ignore[union-attr]


def test_a_copy_that_cannot_be_read_keeps_the_loads_error_with_the_reason(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    s3_url: str,
    client: Any,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    newest = mgr.latest("model")
    assert newest is not None
    for key in s3lib.keys_under(client, s3_url):
        client.delete_object(Bucket=s3lib.BUCKET, Key=key)
    newest.path.unlink()
    with pytest.raises(CheckpointLostError) as caught:
        mgr.load()
    (note,) = caught.value.__notes__
    assert note.startswith("restoring it from its copy failed too: ObjectStoreError")
    assert mgr.latest("model").step == 20  # type: ignore[union-attr]
    assert not list(root.rglob(".*.tmp-*"))


# ------------------------------------------------------------- bad input


def test_remote_must_be_object_storage_and_the_run_local(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    tmp_path: Path,
    db_url: str | None,
    s3_url: str,
) -> None:
    with pytest.raises(InvalidArgumentError, match="remote must be an object-storage URL"):
        open_manager(streams=STREAMS, remote=str(tmp_path / "elsewhere"))
    assert not root.exists()  # refused before anything was made
    on_s3 = tmp_path / "on-s3"
    with pytest.raises(InvalidArgumentError, match="saves on object storage already"):
        open_manager(on_s3, streams=STREAMS, save_dir=s3lib.unique_prefix(), remote=s3_url)
    open_manager(on_s3, streams=STREAMS).close()  # the refused open left its lock free
