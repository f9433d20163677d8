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
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from helpers import LedgerClient, flip_byte, remove_copy_while_downloaded

import ckptdb.errors
from ckptdb import CheckpointManager, Keep, Replicator, RunReader, Sharded
from ckptdb.errors import (
    CheckpointLostError,
    CorruptCheckpointError,
    InvalidArgumentError,
    RunDirectoryError,
)
from ckptdb.protocol import restore as restoring

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=3), "sh": Keep(last=2)}


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


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


def machine_lost(
    tmp_path: Path, pg_url: str, url: str, client: Any
) -> tuple[Path, dict[str, Any], str]:
    """Steps 10 and 20 of ``model``, ``sh`` (both copied to ``url``) and ``rng`` (local-only)
    saved with the ledger on PostgreSQL, then the run directory deleted (the machine
    is gone): the root, the streams, and the key of the copy of ``sh`` 20's file."""
    root = tmp_path / "run"
    streams = {**STREAMS, "rng": Keep(last=1)}  # rng: local-only, never copied
    with CheckpointManager(root, db_url=pg_url, streams=streams) as mgr:
        for step in (10, 20):
            mgr.save(step, model=state(step), sh=Sharded(sharded(step)), rng=state(-step))
    with Replicator(root, url, db_url=pg_url, streams=["model", "sh"]) as replicator:
        replicator.replicate()
    shutil.rmtree(root)
    sh_key = next(k for k in s3lib.keys_under(client, url) if "/sh/step-000000020" in k)
    return root, streams, sh_key


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
    s3lib.delete_objects_under(client, s3_url)  # the copies are gone too
    (root / "checkpoints" / "model" / "step-000000030.pt").unlink()

    reopened = open_manager(streams=STREAMS, remote=s3_url)
    assert reopened.restored_at_open == []
    assert reopened.latest("model").step == 20  # type: ignore[union-attr]
    ((_, failed),) = events(db, "restore_failed")
    assert failed["remote"] == s3_url and "ObjectStoreError" in failed["error"]
    assert not list(root.rglob(".*.tmp-*"))


def test_a_missing_newest_file_is_restored_at_open(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    mgr.close()
    newest = root / "checkpoints" / "model" / "step-000000030.pt"
    newest.unlink()
    reopened = open_manager(streams=STREAMS, remote=s3_url)
    assert [(c.stream, c.step) for c in reopened.restored_at_open] == [("model", 30)]
    assert reopened.latest("model").step == 30  # type: ignore[union-attr]
    assert events(db, "save_dir_recreated") == []  # the save directory was there
    assert [a.kind for a in reopened.last_reconcile.actions] == []  # nothing left to repair


def test_a_first_open_with_remote_is_no_new_machine(
    open_manager: Callable[..., CheckpointManager], root: Path, db: LedgerClient, s3_url: str
) -> None:
    mgr = open_manager(streams=STREAMS, remote=s3_url)  # no save directory yet: a new run
    assert mgr.restored_at_open == []
    mgr.save(1, model=state(1))
    assert events(db, "save_dir_recreated") == [] and events(db, "restore_failed") == []


@pytest.mark.postgres
def test_a_new_machine_whose_copies_cannot_be_read_is_refused_with_nothing_marked(
    tmp_path: Path, pg_url: str, s3_url: str, client: Any
) -> None:
    """A wrong prefix, bad credentials, an outage: the open must not take an empty disk
    for the truth and mark every checkpoint lost (training would start over)."""
    root = tmp_path / "run"
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        for step in (10, 20):
            mgr.save(step, model=state(step), sh=Sharded(sharded(step)))
    with Replicator(root, s3_url, db_url=pg_url) as replicator:
        replicator.replicate()
    sh_copy = next(k for k in s3lib.keys_under(client, s3_url) if "/sh/step-000000020" in k)
    client.delete_object(Bucket=s3lib.BUCKET, Key=sh_copy)  # one copy cannot be had
    shutil.rmtree(root)

    with pytest.raises(RunDirectoryError, match=r"restoring from .* failed") as refused:
        CheckpointManager(root, db_url=pg_url, streams=STREAMS, remote=s3_url)
    assert "nothing was marked lost" in str(refused.value)
    db = LedgerClient(root, pg_url)
    try:
        states = db.rows("SELECT stream, step, state FROM checkpoints ORDER BY stream, step")
        assert all(state == "committed" for _, _, state in states)  # model 20 recommitted too
        (failed,) = events(db, "restore_failed")
        assert failed[0] == 20 and "ObjectStoreError" in failed[1]["error"]
    finally:
        db.close()
    assert (root / "checkpoints" / "model" / "step-000000020.pt").exists()  # kept: it is whole


@pytest.mark.postgres
@pytest.mark.parametrize("cut", ["crash", "failure"])
def test_a_new_machine_whose_restore_was_cut_short_resumes_it_at_the_next_open(
    tmp_path: Path,
    pg_url: str,
    s3_url: str,
    client: Any,
    monkeypatch: pytest.MonkeyPatch,
    cut: str,
) -> None:
    """A restore on a new machine that stopped halfway (the process died after one
    stream's copy was placed, or one copy could not be read) left the save directory
    with some stream directories and not others: the next open must finish the new
    machine's restore, not take it for an unmounted filesystem and refuse for good."""
    root, streams, sh_key = machine_lost(tmp_path, pg_url, s3_url, client)
    sh_bytes = client.get_object(Bucket=s3lib.BUCKET, Key=sh_key)["Body"].read()

    with monkeypatch.context() as mp:
        if cut == "crash":  # the process dies once the first stream's copy is placed
            real = restoring._recommit

            def recommit(*args: Any) -> Any:
                real(*args)
                raise KeyboardInterrupt("killed")

            mp.setattr(restoring, "_recommit", recommit)
            expected: type[BaseException] = KeyboardInterrupt
        else:  # one copy cannot be read this time
            client.delete_object(Bucket=s3lib.BUCKET, Key=sh_key)
            expected = RunDirectoryError
        with pytest.raises(expected):
            CheckpointManager(root, db_url=pg_url, streams=streams, remote=s3_url)
    assert (root / "checkpoints").is_dir()
    assert not (root / "checkpoints" / "rng").exists()  # not made before every copy is back
    client.put_object(Bucket=s3lib.BUCKET, Key=sh_key, Body=sh_bytes)

    with CheckpointManager(root, db_url=pg_url, streams=streams, remote=s3_url) as mgr:
        assert mgr.latest("model").step == 20  # type: ignore[union-attr]
        into = zeroed()
        mgr.load(stream="sh", into=into)
        assert torch.equal(into["a"], sharded(20)["a"]) and into["n"] == 20
        assert mgr.latest("rng") is None
        assert mgr.check(load=True) == []
    db = LedgerClient(root, pg_url)
    try:
        assert len(events(db, "save_dir_recreating")) == 1  # begun once, finished once
        assert len(events(db, "save_dir_recreated")) == 1
    finally:
        db.close()


def test_an_empty_mount_point_is_refused_as_without_remote(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    """The save directory there but empty (a filesystem not mounted on it): nothing is
    restored into it and nothing is marked; the open is refused as it always is."""
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    mgr.close()
    shutil.rmtree(root / "checkpoints")
    (root / "checkpoints").mkdir()
    with pytest.raises(RunDirectoryError, match="mounted"):
        open_manager(streams=STREAMS, remote=s3_url)
    assert list((root / "checkpoints").iterdir()) == []
    assert events(db, "restored_from_replica") == []
    assert ("lost",) not in db.rows("SELECT state FROM checkpoints")


def test_a_corrupt_row_whose_bad_file_is_still_here_is_hashed_at_open(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    """Its size is right: only its hash tells, and a row already marked corrupt is never
    committed again on its size alone."""
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    newest = mgr.latest("model")
    assert newest is not None
    mgr.close()
    whole = newest.path.read_bytes()
    flip_byte(newest.path)
    db.execute("UPDATE checkpoints SET state = 'corrupt' WHERE id = ?", newest.id)
    reopened = open_manager(streams=STREAMS, remote=s3_url)
    assert [c.step for c in reopened.restored_at_open] == [30]
    assert newest.path.read_bytes() == whole  # downloaded at the open, not recommitted as is
    assert torch.equal(reopened.load()["w"], state(30)["w"])
    assert reopened.check(load=True) == []


def test_copies_under_another_destination_are_not_restored_from(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    s3_url: str,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    elsewhere = s3lib.unique_prefix()
    mgr.save(40, model=state(40))
    with Replicator(root, elsewhere, db_url=db_url, streams=["model"]) as replicator:
        assert [r.step for r in replicator.replicate()] == [20, 30, 40]  # all, under it
    mgr.close()
    (root / "checkpoints" / "model" / "step-000000040.pt").unlink()
    (root / "checkpoints" / "model" / "step-000000030.pt").unlink()
    reopened = open_manager(streams=STREAMS, remote=s3_url)  # 40's copy is not under it
    assert [c.step for c in reopened.restored_at_open] == [30]
    assert reopened.latest("model").step == 30  # type: ignore[union-attr]


def test_an_abandoned_timeline_is_not_revived_at_open(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)  # model 10, 20, 30 copied
    old = mgr.latest("model")
    assert old is not None
    mgr.close()
    db.execute("UPDATE checkpoints SET state = 'lost' WHERE id = ?", old.id)
    old.path.unlink()
    again = open_manager(streams=STREAMS)  # (with remote=, its open would restore it)
    resaved = again.save(30, model=state(33))["model"]  # a newer step 30: the old one is past
    again.close()
    reopened = open_manager(streams=STREAMS, remote=s3_url)
    assert reopened.restored_at_open == []
    assert reopened.latest("model") == resaved
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old.id) == [("lost",)]


def test_a_copy_that_does_not_match_is_marked_failed_and_not_offered_again(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    newest = mgr.latest("model")
    assert newest is not None
    (key,) = [k for k in s3lib.keys_under(client, s3_url) if "/model/step-000000030" in k]
    client.put_object(Bucket=s3lib.BUCKET, Key=key, Body=b"x" * newest.size)  # tampered
    newest.path.unlink()
    with pytest.raises(CheckpointLostError) as caught:
        mgr.load()
    (note,) = caught.value.__notes__
    assert "CorruptCheckpointError" in note
    (copy,) = db.rows("SELECT state, error FROM replicas WHERE checkpoint_id = ?", newest.id)
    assert copy[0] == "failed" and "read back and refused" in copy[1]
    assert mgr.restore(s3_url) == []  # never offered again


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
    s3lib.delete_objects_under(client, s3_url)
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


# ------------------------------------------------------------- the framework integrations


def test_accelerate_resumes_from_the_copy_of_a_corrupt_newest_checkpoint(
    tmp_path: Path, s3_url: str
) -> None:
    from acceleratelib import Loop

    from ckptdb.integrations.accelerate import Checkpoints

    root = tmp_path / "run"
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(3, ckpts.save)
    with Replicator(root, s3_url) as replicator:
        assert len(replicator.replicate()) == 3
    flip_byte(root / "checkpoints" / "checkpoint_3" / "optimizer.bin")  # same size

    again = Loop(seed=1)
    with Checkpoints(again.accelerator, root, remote=s3_url) as ckpts:
        assert ckpts.resume() == 3  # not 2: the copy of checkpoint_3 was brought back
        assert ckpts.latest() == ckpts.resumed
    quarantined = [p.name for p in (root / "ckptdb.quarantine").glob("*/checkpoint_3*")]
    assert quarantined == ["checkpoint_3"]
    with pytest.raises(InvalidArgumentError, match="remote must be an object-storage URL"):
        Checkpoints(again.accelerator, tmp_path / "other", remote="nope")


def test_the_hf_trainer_resumes_from_the_copy_of_a_corrupt_newest_checkpoint(
    tmp_path: Path, s3_url: str
) -> None:
    from hflib import dataset, tiny_model, training_args

    from ckptdb.integrations.transformers import STREAM, Trainer
    from ckptdb.reader import RunReader

    out = tmp_path / "out"
    Trainer(model=tiny_model(), args=training_args(out), train_dataset=dataset()).train()
    with Replicator(out, s3_url) as replicator:
        assert len(replicator.replicate()) == 3  # checkpoint-4, -8, -12
    weights_file = out / "checkpoint-12" / "model.safetensors"
    whole = weights_file.read_bytes()
    flip_byte(weights_file, len(whole) - 1)

    t = Trainer(
        model=tiny_model(),
        args=training_args(out, max_steps=16),
        train_dataset=dataset(),
        remote=s3_url,
    )
    t.train(resume_from_checkpoint=True)
    with RunReader(out) as reader:
        attempt = reader.attempts()[-1]
        source = next(c for c in reader.checkpoints(STREAM) if c.id == attempt.resumed_from_id)
    assert source.step == 12  # not 8: the copy of checkpoint-12 was brought back
    assert t.state.global_step == 16
    with pytest.raises(InvalidArgumentError, match="remote must be an object-storage URL"):
        Trainer(model=tiny_model(), args=training_args(out), remote="nope")


def test_restore_tries_every_checkpoint_and_raises_the_first_failure(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    s3_url: str,
    client: Any,
) -> None:
    mgr = replicated_run(open_manager, root, s3_url, db_url)
    # the model's copies cannot be had; the sharded ones can
    s3lib.delete_objects_under(client, s3_url, containing="/model/")
    model, sh = mgr.latest("model"), mgr.latest("sh")
    assert model is not None and sh is not None
    model.path.unlink()
    shutil.rmtree(sh.path)
    with pytest.raises(ckptdb.errors.ObjectStoreError) as caught:
        mgr.restore(s3_url)
    assert caught.value.__notes__ == [f"restored all the same: {sh.path}"]
    into = zeroed()
    mgr.load(stream="sh", into=into)
    assert into["n"] == 30


@pytest.mark.timeout(300)  # 80 s beside a second copy of the suite (2026-12-07)
def test_deepmd_restarts_from_the_copy_of_a_corrupt_newest_checkpoint(
    tmp_path: Path, s3_url: str
) -> None:
    from deepmdlib import dp, make_run_dir, output

    from ckptdb.reader import RunReader

    root = make_run_dir(tmp_path / "run", numb_steps=40)
    first = dp(root, "--pt", "train", "input.json")
    assert first.returncode == 0, output(first)
    with Replicator(root, s3_url) as replicator:
        replicator.replicate()
    newest = root / "model.ckpt-40.pt"
    whole = newest.read_bytes()
    flip_byte(newest)

    config = json.loads((root / "input.json").read_text())
    config["training"]["numb_steps"] = 60
    (root / "input.json").write_text(json.dumps(config))
    again = dp(
        root, "--pt", "train", "input.json", "--restart", "latest", "--ckptdb-remote", s3_url
    )
    assert again.returncode == 0, output(again)
    with RunReader(root) as reader:
        resumed = [e.step for e in reader.events(limit=1000) if e.kind == "resumed"]
        restored = [e.step for e in reader.events(limit=1000) if e.kind == "restored_from_replica"]
    assert resumed == [40] and restored == [40]  # not 20: the copy of 40 was brought back
    quarantined = next((root / "ckptdb.quarantine").rglob("model.ckpt-40.pt"))
    assert quarantined.read_bytes() != whole

    bad = dp(root, "--pt", "train", "input.json", "--ckptdb-remote", "not-a-bucket")
    assert bad.returncode == 1 and "remote must be an object-storage URL" in bad.stderr


@pytest.mark.parametrize("loss", ["corrupt newest", "machine"])
def test_lightning_fit_last_resumes_from_the_copy_of_the_newest_checkpoint(
    tmp_path: Path, s3_url: str, loss: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real ``lightning.Trainer``: ``fit(ckpt_path="last")`` with ``remote=`` resumes
    from the newest checkpoint (step 8), brought back from its copy, where without
    ``remote=`` it would skip a corrupt one (step 4) or find none at all."""
    from lightninglib import Tiny, trainer

    from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger

    d = tmp_path / "ckpts"
    ledger = default_ledger(d)  # beside the checkpoints: here the ledger outlives them
    trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_epochs=2).fit(Tiny())
    with Replicator(ledger, s3_url) as replicator:
        assert len(replicator.replicate()) == 2  # epoch=0-step=4, epoch=1-step=8
    newest = d / "epoch=1-step=8.ckpt"
    whole = newest.read_bytes()
    if loss == "machine":
        shutil.rmtree(d)
    else:
        flip_byte(newest, 100)

    callback = ModelCheckpoint(dirpath=d, save_top_k=-1, remote=s3_url)
    if loss == "corrupt newest":  # two processes resolve "last" before they can agree
        from lightning.pytorch.trainer.states import TrainerFn

        ddp = trainer(tmp_path, [callback], devices=2, strategy="ddp")
        ddp.state.fn = TrainerFn.FITTING  # as fit() sets it before resolving "last"
        with caplog.at_level(logging.WARNING, logger="ckptdb"):
            assert callback._find_last_checkpoints(ddp) == {str(d / "epoch=0-step=4.ckpt")}
        assert "nothing was restored" in caplog.text and "ckptdb restore" in caplog.text
        assert newest.read_bytes() != whole  # left as it was
        attempts = RunReader(ledger).attempts()
        validating = trainer(tmp_path, [ModelCheckpoint(dirpath=d, remote=s3_url)])
        validating.validate(Tiny(), ckpt_path="last")  # reads only: nothing opened, restored
        assert validating.ckpt_path == str(d / "epoch=0-step=4.ckpt")
        assert len(RunReader(ledger).attempts()) == len(attempts)
        assert newest.read_bytes() != whole
    t = trainer(tmp_path, [callback], max_epochs=3)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(newest)
    assert t.global_step == 12  # resumed at 8, one more epoch
    with CheckpointManager(ledger) as mgr:
        kept = [8, 12] if loss == "machine" else [4, 8, 12]  # a new machine: the newest back
        assert [c.step for c in mgr.checkpoints("checkpoints")] == kept
        assert mgr.check(load=True) == []
    assert newest.read_bytes() == whole
    with pytest.raises(InvalidArgumentError, match="remote must be an object-storage URL"):
        ModelCheckpoint(dirpath=d, remote="nope")
    with pytest.raises(InvalidArgumentError, match="remote_options= goes with remote="):
        ModelCheckpoint(dirpath=d, remote_options={"region": "x"})


@pytest.mark.postgres
def test_a_restore_finished_by_hand_is_over_and_a_later_unmounted_disk_refused(
    tmp_path: Path, pg_url: str, s3_url: str, client: Any
) -> None:
    """A new machine's restore cut short, then finished the way the refusal says (the
    directories made, an open without ``remote=``): that open ends it, so a disk not
    mounted later is refused as always, never taken for the restore and marked lost."""
    root, streams, sh_key = machine_lost(tmp_path, pg_url, s3_url, client)
    client.delete_object(Bucket=s3lib.BUCKET, Key=sh_key)
    with pytest.raises(RunDirectoryError, match="restoring from"):
        CheckpointManager(root, db_url=pg_url, streams=streams, remote=s3_url)
    (root / "checkpoints" / "rng").mkdir()  # as the refusal says; sh 20 given up
    with CheckpointManager(root, db_url=pg_url, streams=streams) as mgr:
        mgr.save(30, model=state(30), rng=state(-30))
    db = LedgerClient(root, pg_url)
    try:
        ((_, ended),) = events(db, "save_dir_recreated")
        assert ended["remote"] is None  # ended by a reconcile that found every directory

        save_dir = root / "checkpoints"  # later: the disk is not mounted, its mount point is
        shutil.move(save_dir, tmp_path / "elsewhere")
        save_dir.mkdir()
        with pytest.raises(RunDirectoryError, match="mounted"):
            CheckpointManager(root, db_url=pg_url, streams=streams, remote=s3_url)
        assert ("lost",) not in db.rows("SELECT state FROM checkpoints WHERE step = 30")
    finally:
        db.close()


@pytest.mark.postgres
def test_a_new_machine_whose_newest_copy_goes_meanwhile_is_refused_then_takes_the_older(
    tmp_path: Path, pg_url: str, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remote window removes the newest copy while a new machine restores it: the open
    is refused with nothing marked (an empty disk is not the truth), and the next open
    restores the newest copy left."""
    root = tmp_path / "run"
    with CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=2)}) as mgr:
        for step in (10, 20):
            mgr.save(step, model=state(step))
    with Replicator(root, s3_url, db_url=pg_url) as replicator:
        replicator.replicate()
    shutil.rmtree(root)
    db = LedgerClient(root, pg_url)
    try:
        with monkeypatch.context() as mp:
            remove_copy_while_downloaded(mp, db, 20)
            with pytest.raises(RunDirectoryError, match="removed by the remote tier's"):
                CheckpointManager(root, db_url=pg_url, remote=s3_url)
        assert db.rows("SELECT state FROM checkpoints ORDER BY step") == [("committed",)] * 2
        with CheckpointManager(root, db_url=pg_url, remote=s3_url) as mgr:
            assert [c.step for c in mgr.restored_at_open] == [10]
            assert torch.equal(mgr.load()["w"], state(10)["w"])
    finally:
        db.close()
