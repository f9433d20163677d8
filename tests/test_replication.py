"""Replication to a second tier (SeaweedFS, a real S3 server) and restoring from it.

A :class:`ckptdb.Replicator` copies each committed checkpoint of a run whose
payloads are local; the ledger's ``replicas`` rows are checked against what
is really in the bucket (every key, every byte), a replicator is SIGKILLed in
the middle of a multipart upload and a new one cleans up and copies again,
and a run whose machine is gone (the whole local directory deleted, the
ledger on PostgreSQL) resumes bit-identical from the newest copy.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from click.testing import CliRunner
from helpers import LedgerClient, flip_byte

import ckptdb.replication
from ckptdb import (
    Checkpoint,
    CheckpointManager,
    External,
    Keep,
    Replica,
    Replicator,
    RunReader,
    Sharded,
)
from ckptdb.cli import main
from ckptdb.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    LedgerLockedError,
    ObjectStoreError,
)
from ckptdb.ledger import replicas as ledger_replicas

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=3), "sh": Keep(last=2)}


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def state(step: int, megabytes: float = 0.01) -> dict[str, Any]:
    """A state dict whose bytes depend on ``step`` (``megabytes`` of float32)."""
    n = max(1, int(megabytes * (1 << 20) / 4))
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=generator), "step": step}


def sharded(step: int) -> dict[str, Any]:
    return {"a": torch.full((3, 2), float(step)), "b": torch.arange(4) * step, "n": step}


def zeroed_sharded() -> dict[str, Any]:
    """A load target of :func:`sharded`'s structure, every value zeroed."""
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sharded(1).items()
    }


def object_bytes(client: Any, url: str) -> bytes:
    bucket, key = url.removeprefix("s3://").split("/", 1)
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def saved_and_copied(
    open_manager: Callable[..., CheckpointManager], root: Path, url: str, db_url: str | None
) -> tuple[CheckpointManager, Checkpoint, Replica]:
    """A run with one checkpoint (step 1), copied to ``url``."""
    mgr = open_manager(streams={"model": Keep(last=3)})
    saved = mgr.save(1, model=state(1))["model"]
    with Replicator(root, url, db_url=db_url) as replicator:
        (copy,) = replicator.replicate()
    return mgr, saved, copy


def save_three(mgr: CheckpointManager) -> dict[int, dict[str, Any]]:
    saved = {}
    for step in (10, 20, 30):
        saved[step] = state(step)
        mgr.save(step, model=saved[step], sh=Sharded(sharded(step)))
    return saved


# ---------------------------------------------------------------------- copying


def test_a_pass_copies_each_committed_checkpoint_once_and_whole(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    mgr = open_manager(streams=STREAMS)
    save_three(mgr)
    committed = {c.id: c for c in mgr.checkpoints()}

    with Replicator(root, s3_url, db_url=db_url) as replicator:
        done = replicator.replicate()
        assert replicator.replicate() == []  # nothing left: never copied twice
        listed = replicator.replicas()

    assert sorted(r.checkpoint_id for r in done) == sorted(committed)
    assert [r.state for r in done] == ["replicated"] * len(committed) and listed == done
    keys = s3lib.keys_under(client, s3_url)
    for r in done:
        checkpoint = committed[r.checkpoint_id]
        assert (r.size, r.hash) == (checkpoint.size, checkpoint.hash)
        under = [k for k in keys if f"s3://{s3lib.BUCKET}/{k}".startswith(r.location + "/")]
        if checkpoint.path.is_dir():  # one object per file of the DCP directory
            local = sorted(p.name for p in checkpoint.path.iterdir())
            assert sorted(k.rsplit("/", 1)[1] for k in under) == local
            for name in local:
                got = object_bytes(client, f"{r.location}/{name}")
                assert got == (checkpoint.path / name).read_bytes()
        else:
            assert len(under) == 1
            assert object_bytes(client, f"{r.location}/{checkpoint.path.name}") == (
                checkpoint.path.read_bytes()
            )
    assert len(keys) == sum(
        len(list(c.path.iterdir())) if c.path.is_dir() else 1 for c in committed.values()
    )
    assert s3lib.uploads_under(client, s3_url) == []
    rows = db.rows("SELECT state, COUNT(*) FROM replicas GROUP BY state")
    assert rows == [("replicated", len(committed))]


def test_one_replicator_per_run_and_the_remote_must_be_object_storage(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    tmp_path: Path,
    s3_url: str,
) -> None:
    open_manager(streams=STREAMS).save(1, model=state(1))
    with (
        Replicator(root, s3_url, db_url=db_url),
        pytest.raises(LedgerLockedError, match="another replicator"),
    ):
        Replicator(root, s3_url, db_url=db_url)
    for bad, said in (
        (str(tmp_path / "elsewhere"), "object-storage URL"),
        (42, "object-storage URL"),
        ("s3://", "not a valid bucket name"),
    ):
        with pytest.raises(InvalidArgumentError, match=said):
            Replicator(root, bad, db_url=db_url)  # type: ignore[arg-type]
    with Replicator(root, s3_url, db_url=db_url) as again:  # the lock was released
        assert [r.state for r in again.replicate()] == ["replicated"]
    on_s3 = open_manager(tmp_path / "on-s3", save_dir=s3_url + "-run", streams=STREAMS)
    on_s3.save(1, model=state(1))
    with pytest.raises(InvalidArgumentError, match="on object storage already"):
        Replicator(tmp_path / "on-s3", s3_url, db_url=db_url)


def test_a_local_copy_that_no_longer_matches_its_row_is_never_replicated(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    client: Any,
) -> None:
    mgr = open_manager(streams=STREAMS)
    bad = mgr.save(1, model=state(1))["model"]
    good = mgr.save(2, model=state(2))["model"]
    flip_byte(bad.path)

    with Replicator(root, s3_url, db_url=db_url) as replicator:
        first = replicator.replicate()
        for _ in range(ckptdb.replication.MAX_FAILURES + 1):
            replicator.replicate()  # retried, at most MAX_FAILURES times in all
        copies = replicator.replicas()

    assert [(r.step, r.state) for r in first] == [(1, "failed"), (2, "replicated")]
    assert "does not match its ledger row" in (first[0].error or "")
    failed = [r for r in copies if r.step == 1]
    assert [r.state for r in failed] == ["failed"] * ckptdb.replication.MAX_FAILURES
    keys = s3lib.keys_under(client, s3_url)
    assert all(good.path.name in k for k in keys) and len(keys) == 1  # nothing of step 1 left
    assert s3lib.uploads_under(client, s3_url) == []


# ------------------------------------------------------------- killed mid-upload

BIG_MB = 12  # three 5 MiB parts: a multipart upload


def _replicate_until_killed(root: str, url: str, db_url: str, marker: str) -> None:
    """A replicator whose upload stops after its first part (for the parent to kill it)."""
    original = ckptdb.replication.Replicator._upload_file

    def slow(self: Replicator, path: Path, rel: str) -> Any:
        return self._remote.write_object(
            rel, s3lib.stalled_after_first_part(path, rel, Path(marker))
        )

    ckptdb.replication.Replicator._upload_file = slow  # type: ignore[method-assign]
    try:
        options = {"part_size": 5 << 20}
        with Replicator(root, url, db_url=db_url, storage_options=options) as replicator:
            replicator.replicate()
    finally:
        ckptdb.replication.Replicator._upload_file = original  # type: ignore[method-assign]


@pytest.mark.postgres
def test_a_replicator_killed_mid_upload_is_redone_never_duplicated(
    tmp_path: Path, pg_url: str, s3_url: str, client: Any
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        saved = mgr.save(1, model=state(1, BIG_MB))["model"]
    marker = tmp_path / "uploading"
    child = multiprocessing.get_context("fork").Process(
        target=_replicate_until_killed, args=(str(root), s3_url, pg_url, str(marker))
    )
    child.start()
    try:
        s3lib.wait_for_marker(marker, child)
        assert s3lib.uploads_under(client, s3_url) != []  # a part is up, nothing completed
        os.kill(child.pid or 0, signal.SIGKILL)
    finally:
        child.join(10)
    ledger = LedgerClient(root, pg_url)
    try:
        assert ledger.rows("SELECT state FROM replicas") == [("uploading",)]  # never "replicated"
        assert s3lib.keys_under(client, s3_url) == []

        with Replicator(root, s3_url, db_url=pg_url) as replicator:
            assert [(r.state, r.error) for r in replicator.swept] == [
                ("failed", ledger_replicas.INTERRUPTED)
            ]
            assert s3lib.uploads_under(client, s3_url) == []  # the dead upload aborted
            again = replicator.replicate()
        assert [(r.checkpoint_id, r.state) for r in again] == [(saved.id, "replicated")]
        assert ledger.rows("SELECT state FROM replicas ORDER BY id") == [
            ("failed",),
            ("replicated",),
        ]
        keys = s3lib.keys_under(client, s3_url)
        assert len(keys) == 1 and f"{s3lib.BUCKET}/{keys[0]}".startswith(
            again[0].location.removeprefix("s3://")
        )
        assert object_bytes(client, f"s3://{s3lib.BUCKET}/{keys[0]}") == saved.path.read_bytes()
    finally:
        ledger.close()


# ------------------------------------------------------------------- restoring


@pytest.mark.postgres
def test_a_lost_machine_resumes_from_the_newest_copy_bit_identical(
    tmp_path: Path, pg_url: str, s3_url: str
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        saved = save_three(mgr)
    with Replicator(root, s3_url, db_url=pg_url) as replicator:
        assert len(replicator.replicate()) == 5  # model 10, 20, 30; sh 20, 30
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        mgr.save(40, model=state(40))  # never copied: lost with the machine

    shutil.rmtree(root)  # the machine is gone; the ledger (PostgreSQL) and the copies stay

    with CheckpointManager(root, db_url=pg_url, maintenance=True) as mgr:
        restored = mgr.restore(s3_url)
    assert sorted((c.stream, c.step) for c in restored) == [("model", 30), ("sh", 30)]
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        lost = sorted(a.path for a in mgr.last_reconcile.actions if a.kind == "lost")
        # reconcile: what was not restored is lost here (its copies stay)
        assert lost == [
            "model/step-000000020.pt",
            "model/step-000000040.pt",
            "sh/step-000000020.dcp",
        ]
        latest = mgr.latest("model")
        assert latest is not None and latest.step == 30
        got = mgr.load("latest")
        assert torch.equal(got["w"], saved[30]["w"]) and got["step"] == 30
        into = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0
            for k, v in sharded(1).items()
        }
        mgr.load("latest", stream="sh", into=into)
        assert torch.equal(into["a"], sharded(30)["a"]) and into["n"] == 30
        assert mgr.check(load=True) == []
        # the lost ones that have a copy come back on request; step 40 never had one
        again = mgr.restore(s3_url, every=True)
        assert sorted((c.stream, c.step) for c in again) == [("model", 20), ("sh", 20)]
        assert sorted(c.step for c in mgr.checkpoints("model")) == [20, 30]
        assert torch.equal(mgr.load(20)["w"], saved[20]["w"])
    ledger = LedgerClient(root, pg_url)
    try:
        events = ledger.rows(
            "SELECT step, detail FROM events WHERE kind = 'restored_from_replica' ORDER BY step"
        )
        assert [s for s, _ in events] == [20, 20, 30, 30]
        assert all(json.loads(d)["from"].startswith(s3_url) for _, d in events)
    finally:
        ledger.close()


def test_a_corrupt_local_copy_is_brought_back_from_its_copy(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    db: LedgerClient,
) -> None:
    mgr = open_manager(streams=STREAMS)
    saved = save_three(mgr)
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        replicator.replicate()
    newest = mgr.latest("model")
    assert newest is not None
    flip_byte(newest.path)
    with pytest.raises(CorruptCheckpointError):
        mgr.load("latest")  # marked corrupt; latest falls back to step 20
    shard = next(p for p in mgr.latest("sh").path.iterdir() if p.suffix == ".distcp")
    shard.unlink()  # and a shard file of the newest sharded checkpoint is gone

    restored = mgr.restore(s3_url)

    assert sorted((c.stream, c.step) for c in restored) == [("model", 30), ("sh", 30)]
    assert mgr.latest("model").step == 30
    assert torch.equal(mgr.load("latest")["w"], saved[30]["w"])
    into = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sharded(1).items()
    }
    mgr.load("latest", stream="sh", into=into)
    assert torch.equal(into["b"], sharded(30)["b"])
    quarantined = list((root / "ckptdb.quarantine" / "model").iterdir())
    assert [p.name for p in quarantined] == [newest.path.name]  # kept aside, never deleted
    assert mgr.restore(s3_url) == []  # whole now: nothing to do
    assert mgr.check(load=True) == [] and not list(root.rglob(".*.tmp-*"))


def test_a_copy_that_does_not_match_is_refused_and_nothing_changes(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    client: Any,
    db: LedgerClient,
) -> None:
    mgr, saved, copy = saved_and_copied(open_manager, root, s3_url, db_url)
    bucket, key = f"{copy.location}/{saved.path.name}".removeprefix("s3://").split("/", 1)
    client.put_object(Bucket=bucket, Key=key, Body=b"not the checkpoint")
    saved.path.unlink()
    before = db.rows("SELECT id, state FROM checkpoints")

    with pytest.raises(CorruptCheckpointError, match="is not the file its copy recorded"):
        mgr.restore(s3_url)

    assert db.rows("SELECT id, state FROM checkpoints") == before
    assert not saved.path.exists() and not list(root.rglob(".*.tmp-*"))


# ------------------------------------------------------------ in-process, CLI


def test_a_replicator_thread_beside_the_training_loop(
    open_manager: Callable[..., CheckpointManager], db_url: str | None, root: Path, s3_url: str
) -> None:
    """In the trainer's process: saves never wait for it; retention may evict a checkpoint
    before its turn (never while it is copied: the copy pins it)."""
    mgr = open_manager(streams={"model": Keep(last=2)})
    with Replicator(root, s3_url, db_url=db_url).start(poll=0.05) as replicator:
        for step in range(1, 6):
            mgr.save(step, model=state(step))
        deadline = time.monotonic() + 30
        while 5 not in {r.step for r in replicator.replicas() if r.state == "replicated"}:
            assert time.monotonic() < deadline, replicator.replicas()
            time.sleep(0.05)
    with RunReader(root, db_url=db_url) as reader:
        copies = reader.replicas()
    assert {r.state for r in copies} == {"replicated"}  # nothing failed, nothing half-done
    assert len({r.checkpoint_id for r in copies}) == len(copies)  # one copy each


@pytest.fixture
def stopped_thread(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Replicator:
    """A started replicator whose thread has already stopped on a pass's error."""
    open_manager(streams={"model": Keep(last=2)}).save(1, model=state(1))

    def broken(self: Replicator) -> None:
        raise RuntimeError("the ledger went away")

    monkeypatch.setattr(Replicator, "replicate", broken)
    replicator = Replicator(root, s3_url, db_url=db_url).start(poll=0.01)
    assert replicator._thread is not None
    replicator._thread.join(10)
    return replicator


def test_a_failing_thread_raises_its_error_at_close(stopped_thread: Replicator) -> None:
    replicator = stopped_thread
    with pytest.raises(RuntimeError, match="the ledger went away"):
        replicator.close()


def test_the_commands_replicate_restore_status_and_latest_remote(
    open_manager: Callable[..., CheckpointManager], db_url: str | None, root: Path, s3_url: str
) -> None:
    mgr = open_manager(streams=STREAMS)
    save_three(mgr)
    mgr.close()
    runner = CliRunner()
    url = ["--db-url", db_url] if db_url else []

    replicated = runner.invoke(main, ["replicate", str(root), "--to", s3_url, *url])
    assert replicated.exit_code == 0, replicated.output
    lines = [line.split() for line in replicated.output.splitlines()[1:]]
    assert sorted((s, int(step), st) for s, step, st, _ in lines) == [
        ("model", 10, "replicated"),
        ("model", 20, "replicated"),
        ("model", 30, "replicated"),
        ("sh", 20, "replicated"),
        ("sh", 30, "replicated"),
    ]
    remote = runner.invoke(main, ["latest", str(root), "--tier", "remote", *url])
    assert remote.exit_code == 0 and remote.output.strip().startswith(s3_url + "/model/")
    assert "step-000000030" in remote.output
    status = runner.invoke(main, ["status", str(root), "--json", *url])
    assert json.loads(status.output)["replicas"] == {
        "remote": {"states": {"replicated": 5}, "newest": {"model": 30, "sh": 30}}
    }
    assert (
        "copies on remote: 5 replicated" in runner.invoke(main, ["status", str(root), *url]).output
    )

    (root / "checkpoints" / "model" / "step-000000030.pt").unlink()
    restored = runner.invoke(main, ["restore", str(root), "--from", s3_url, "--json", *url])
    assert restored.exit_code == 0, restored.output
    assert [(c["stream"], c["step"]) for c in json.loads(restored.output)] == [("model", 30)]
    bad = runner.invoke(main, ["replicate", str(root), "--to", str(root / "x"), *url])
    assert bad.exit_code == 1 and "object-storage URL" in bad.output


# ------------------------------------------------- review: edges of copy and restore


def test_a_framework_named_checkpoint_is_restored_into_its_own_directories(
    open_manager: Callable[..., CheckpointManager], db_url: str | None, root: Path, s3_url: str
) -> None:
    """An External name with directories of its own (the disk of a new machine has none)."""
    mgr = open_manager(streams={"model": Keep(last=3)})
    want = state(7)
    saved = mgr.save(7, model=External(lambda p: torch.save(want, p), name="out/deep/ck-7.ckpt"))
    path = saved["model"].path
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        assert [r.state for r in replicator.replicate()] == ["replicated"]
    shutil.rmtree(root / "checkpoints" / "out")

    assert [c.step for c in mgr.restore(s3_url)] == [7]

    assert torch.equal(torch.load(path, weights_only=True)["w"], want["w"])
    assert mgr.check(load=True) == [] and mgr.reconcile(dry_run=True).actions == []


def test_a_whole_local_copy_of_a_lost_row_is_committed_again_without_a_download(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    client: Any,
    db: LedgerClient,
) -> None:
    """A crash after restore put the file in place, before its row was committed again."""
    mgr, saved, _ = saved_and_copied(open_manager, root, s3_url, db_url)
    db.execute("UPDATE checkpoints SET state = 'lost' WHERE id = ?", saved.id)
    s3lib.delete_objects_under(client, s3_url)  # a download would fail now

    assert [c.step for c in mgr.restore(s3_url)] == [1]

    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", saved.id) == [("committed",)]
    assert not (root / "ckptdb.quarantine").exists()


def test_a_copy_that_cannot_be_read_is_the_stores_error_not_the_disks(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    client: Any,
) -> None:
    mgr, saved, _ = saved_and_copied(open_manager, root, s3_url, db_url)
    s3lib.delete_objects_under(client, s3_url)
    saved.path.unlink()

    with pytest.raises(ObjectStoreError, match="GetObject"):
        mgr.restore(s3_url)
    assert not saved.path.exists() and not list(root.rglob(".*.tmp-*"))


def test_follow_stops_after_the_copy_in_progress(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=5)})
    for step in range(1, 4):
        mgr.save(step, model=state(step))
    stop = threading.Event()
    real = Replicator._upload_file

    def then_stop(self: Replicator, path: Path, rel: str) -> Any:
        stop.set()  # asked to stop while the first copy runs
        return real(self, path, rel)

    monkeypatch.setattr(Replicator, "_upload_file", then_stop)
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        replicator.follow(poll=0.01, stop=stop)
        copies = replicator.replicas()
        with pytest.raises(InvalidArgumentError, match="poll must be a positive number"):
            replicator.follow(poll=0)
    assert [(r.step, r.state) for r in copies] == [(1, "replicated")]  # finished, then stopped


def test_leaving_the_block_by_an_error_raises_that_error(stopped_thread: Replicator) -> None:
    with pytest.raises(ValueError, match="the training step failed") as caught, stopped_thread:
        raise ValueError("the training step failed")
    notes = getattr(caught.value, "__notes__", [])
    assert notes == ["the replicator's thread had stopped: RuntimeError: the ledger went away"]


def test_retention_never_removes_a_file_while_it_is_copied(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy pins its checkpoint: a save that evicts it mid-copy leaves the file (row
    ``deleting``) until the copy is done; the copy is whole, and the file goes after."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1))["model"]
    first_bytes = first.path.read_bytes()
    real = Replicator._upload_file

    def evicted_meanwhile(self: Replicator, path: Path, rel: str) -> Any:
        mgr.save(2, model=state(2))  # Keep(last=1): step 1 is evicted now, mid-copy
        assert path.exists()  # pinned: its file stays
        return real(self, path, rel)

    monkeypatch.setattr(Replicator, "_upload_file", evicted_meanwhile)
    with Replicator(root, s3_url, db_url=db_url, streams=["model"]) as replicator:
        (copy,) = replicator.replicate()
    assert (copy.step, copy.state) == (1, "replicated")
    assert object_bytes(client, f"{copy.location}/{first.path.name}") == first_bytes
    mgr.gc()  # the pin is released: the evicted file goes now
    assert not first.path.exists()


def test_a_copy_whose_objects_cannot_be_removed_says_where_they_are(
    open_manager: Callable[..., CheckpointManager],
    db_url: str | None,
    root: Path,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    flip_byte(mgr.save(1, model=state(1))["model"].path)

    def refused(self: Any, rel: str) -> bool:
        raise ObjectStoreError("DeleteObjects refused: AccessDenied")

    with Replicator(root, s3_url, db_url=db_url) as replicator:
        monkeypatch.setattr(type(replicator._remote), "remove_tree", refused)
        (copy,) = replicator.replicate()
        # the failed copy's sweep fails too, pass after pass: said once, after its reason
        monkeypatch.setattr(ckptdb.replication, "SWEEP_EVERY_S", 0.0)
        replicator._remote.list_under = lambda rel: ["left"]  # type: ignore[method-assign]
        replicator.replicate()
        replicator.replicate()
        row = replicator.replicas()[0]  # the first copy (the passes tried again)
    assert row.error is not None and row.error.startswith(copy.error or "?")
    assert row.error.count("sweeping it failed") == 1 and row.error.endswith("AccessDenied")
    assert copy.state == "failed" and copy.error is not None
    assert "does not match its ledger row" in copy.error  # the copy's own failure first
    assert f"removing the partial copy at {copy.location} failed too" in copy.error
    assert "AccessDenied" in copy.error


def test_only_the_streams_asked_for_are_copied_and_the_command_fails_on_a_failed_copy(
    open_manager: Callable[..., CheckpointManager], db_url: str | None, root: Path, s3_url: str
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1), sh=Sharded(sharded(1)))
    with Replicator(root, s3_url, db_url=db_url, streams=["sh"]) as replicator:
        assert [(r.stream, r.state) for r in replicator.replicate()] == [("sh", "replicated")]
    flip_byte(mgr.latest("model").path)
    url = ["--db-url", db_url] if db_url else []

    failed = CliRunner().invoke(main, ["replicate", str(root), "--to", s3_url, *url])

    assert failed.exit_code == 1, failed.output
    assert [line.split()[:3] for line in failed.output.splitlines()[1:]] == [
        ["model", "1", "failed"]
    ]


# ------------------------------------------------------------------- late objects of failed copies


def failed_copy_landing_late(root: Path, url: str, client: Any) -> Replica:
    """A run whose one copy failed (its upload refused), then an object of it landed at
    the server anyway (as a PUT the server completes after the client gave up does)."""
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=state(1))

    def refused(self: Replicator, path: Path, rel: str) -> Any:
        raise ConnectionError("timed out")

    original = Replicator._upload_file
    Replicator._upload_file = refused  # type: ignore[method-assign]
    try:
        with Replicator(root, url) as replicator:
            (failed,) = replicator.replicate()
    finally:
        Replicator._upload_file = original  # type: ignore[method-assign]
    assert failed.state == "failed"
    bucket, key = failed.location.removeprefix("s3://").split("/", 1)
    client.put_object(Bucket=bucket, Key=f"{key}/step-000000001.pt", Body=b"late")
    return failed


def test_a_failed_copy_whose_object_lands_late_is_reported_then_swept(
    tmp_path: Path, s3_url: str, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    failed = failed_copy_landing_late(root, s3_url, client)
    late = [k for k in s3lib.keys_under(client, s3_url) if f"r{failed.id}/" in k]
    assert len(late) == 1
    with CheckpointManager(root, remote=s3_url, maintenance=True) as mgr:
        (problem,) = mgr.check()
    assert f"failed copy {failed.id} left 1 object(s) at {failed.location}" in problem
    result = CliRunner().invoke(main, ["check", str(root), "--remote", s3_url])
    assert result.exit_code == 1 and f"failed copy {failed.id}" in result.output
    with CheckpointManager(root, maintenance=True) as mgr:
        assert mgr.check() == []  # without remote=: the bucket is not looked at

    with Replicator(root, s3_url) as replicator:  # the sweep at its start removes it
        assert [r.id for r in replicator.leftovers] == [failed.id]
        assert not [k for k in s3lib.keys_under(client, s3_url) if f"r{failed.id}/" in k]
        # another late object within the window: swept by a pass once the next sweep is due
        client.put_object(Bucket=s3lib.BUCKET, Key=late[0], Body=b"later")
        replicator.replicate()
        assert replicator.leftovers == []  # swept a moment ago: not yet due
        monkeypatch.setattr(ckptdb.replication, "SWEEP_EVERY_S", 0.0)
        replicator.replicate()
        assert [r.id for r in replicator.leftovers] == [failed.id]
    with CheckpointManager(root, remote=s3_url, maintenance=True) as mgr:
        assert mgr.check() == []


def test_a_failed_copy_is_swept_no_more_once_its_window_closed(
    tmp_path: Path, s3_url: str, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failing pass swept the copy's prefix once, when it failed; with a window of
    0 s nothing can land after that, so the late object is never swept: check says so."""
    root = tmp_path / "run"
    failed = failed_copy_landing_late(root, s3_url, client)
    monkeypatch.setattr(ckptdb.replication, "LATE_LANDING_S", 0.0)
    with Replicator(root, s3_url) as replicator:
        assert replicator.leftovers == []
        monkeypatch.setattr(ckptdb.replication, "SWEEP_EVERY_S", 0.0)
        replicator.replicate()
        assert replicator.leftovers == []
    assert [k for k in s3lib.keys_under(client, s3_url) if f"r{failed.id}/" in k]
    with CheckpointManager(root, remote=s3_url, maintenance=True) as mgr:
        (problem,) = mgr.check()  # what no sweep will remove is reported
    assert f"failed copy {failed.id}" in problem
