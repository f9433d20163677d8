"""Retention per tier: local files wait for their copy, and the remote tier keeps its own window.

Against SeaweedFS (a real S3 server) and both ledgers. A run with a
registered replicator keeps an evicted checkpoint's local file until its copy
is whole (through a commit, a reopen's reconcile, ``gc``, a failed copy), a
stream the replicator does not copy is local-only, and ``keep=`` removes the
remote copies its window drops (the best one stays after it left the local
window), each removal recorded before its objects go.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from click.testing import CliRunner
from helpers import LedgerClient, flip_byte, migrate_to, remove_copy_while_downloaded

import ckptdb.ledger.tiers
import ckptdb.replication
import ckptdb.storage.s3
from ckptdb import CheckpointManager, Keep, Replicator, RunReader, TopK
from ckptdb.cli import main
from ckptdb.cli.tiers import parse_keep
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    LedgerLockedError,
    ObjectStoreError,
    UnknownStreamError,
)
from ckptdb.ledger.engine import default_sqlite_url

pytestmark = pytest.mark.timeout(120)

HOLDER = "ckptdb.replication:remote"


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    return backend


def state(step: int) -> dict[str, Any]:
    return {"w": torch.randn(512, generator=torch.Generator().manual_seed(step)), "step": step}


def on_disk(mgr: CheckpointManager, stream: str = "model") -> list[int]:
    """The steps whose files are in the stream's directory."""
    names = sorted(p.name for p in (mgr.save_dir / stream).glob("step-*.pt"))
    return [int(name.split("-")[1].split(".")[0]) for name in names]


def states(db: LedgerClient, stream: str = "model") -> dict[int, str]:
    found = db.rows("SELECT step, state FROM checkpoints WHERE stream = ? ORDER BY step", stream)
    return {int(step): str(s) for step, s in found}


def live_holds(db: LedgerClient) -> list[int]:
    """Steps whose checkpoints the replication holds (live pins of its holder)."""
    found = db.rows(
        "SELECT c.step FROM pins p JOIN checkpoints c ON c.id = p.checkpoint_id"
        " WHERE p.holder = ? AND p.released_at IS NULL ORDER BY c.step",
        HOLDER,
    )
    return [int(step) for (step,) in found]


def copy_bytes(client: Any, url: str, replica_id: int) -> bytes:
    """The bytes of a one-file copy (the object under its replica's prefix)."""
    (key,) = [k for k in s3lib.keys_under(client, url) if f".r{replica_id}/" in k]
    return bytes(client.get_object(Bucket=s3lib.BUCKET, Key=key)["Body"].read())


def two_copied(
    open_manager: Callable[..., CheckpointManager], root: Path, url: str, db_url: str | None
) -> CheckpointManager:
    """A run (``model``, keep last 3) with steps 1 and 2 saved and copied to ``url``;
    its manager stays open."""
    mgr = open_manager(streams={"model": Keep(last=3)})
    with Replicator(root, url, db_url=db_url) as replicator:
        for step in (1, 2):
            mgr.save(step, model=state(step))
        replicator.replicate()
    return mgr


def release_then_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[threading.Event, threading.Event]:
    """The tier's holds released as always, then ``released`` set and the releasing
    transaction kept open until ``saved`` is set (at most 5 s): a commit runs beside it."""
    released, saved = threading.Event(), threading.Event()
    release = ckptdb.ledger.tiers.release

    def releasing(session: Any, ids: Any, tier: str) -> None:
        release(session, ids, tier)
        released.set()
        saved.wait(5)

    monkeypatch.setattr(ckptdb.ledger.tiers, "release", releasing)
    return released, saved


def json_objects(text: str) -> list[Any]:
    """The JSON documents printed one after another (``--json`` prints one per copy)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while at < len(text):
        value, at = decoder.raw_decode(text, at)
        found.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return found


def cli(*args: str, db_url: str | None) -> Any:
    url = ["--db-url", db_url] if db_url else []
    return CliRunner().invoke(main, [*args, *url])


# ------------------------------------------------------------- local waits for remote


def test_an_evicted_checkpoint_keeps_its_file_until_its_copy_is_whole(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=2)})
    mgr.save(1, model=state(1))
    with Replicator(root, s3_url, db_url=db_url) as replicator:  # registered; copies nothing yet
        for step in (2, 3, 4, 5):
            mgr.save(step, model=state(step))

        # retention decided: the stream holds 4 and 5; the files of 1-3 wait for their copy
        assert [c.step for c in mgr.checkpoints("model")] == [4, 5]
        assert on_disk(mgr) == [1, 2, 3, 4, 5]
        assert states(db) == {
            1: "deleting",
            2: "deleting",
            3: "deleting",
            4: "committed",
            5: "committed",
        }
        assert live_holds(db) == [1, 2, 3]
        held = {s: (mgr.save_dir / "model" / f"step-{s:09d}.pt").read_bytes() for s in (1, 2, 3)}

        done = replicator.replicate()

    assert sorted((r.step, r.state) for r in done) == [(s, "replicated") for s in (1, 2, 3, 4, 5)]
    for r in done:
        if r.step in held:  # the copy of an evicted checkpoint is of its bytes
            assert copy_bytes(client, s3_url, r.id) == held[r.step]
    assert live_holds(db) == []
    assert on_disk(mgr) == [1, 2, 3, 4, 5]  # released: the writer removes them at its next commit
    mgr.save(6, model=state(6))
    assert on_disk(mgr) == [5, 6]  # step 4 was copied before its eviction: no wait at all
    assert states(db) == {
        1: "deleted",
        2: "deleted",
        3: "deleted",
        4: "deleted",
        5: "committed",
        6: "committed",
    }


def test_a_stream_the_replicator_does_not_copy_is_local_only(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1), "ema": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url, streams=["model"]):
        for step in (1, 2, 3):
            mgr.save(step, model=state(step), ema=state(step))
    assert on_disk(mgr, "ema") == [3]  # evicted and removed at once, as without a replicator
    assert on_disk(mgr, "model") == [1, 2, 3] and live_holds(db) == [1, 2]

    # registering again without "model" lets its files go: it is local-only from now on
    with Replicator(root, s3_url, db_url=db_url, streams=["ema"]):
        assert live_holds(db) == []
    mgr.save(4, model=state(4), ema=state(4))
    assert on_disk(mgr, "model") == [4]


def test_a_held_file_survives_reopen_and_gc_until_its_copy_is_made(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url):
        mgr.save(1, model=state(1))
        mgr.save(2, model=state(2))
    mgr.close()
    reopened = open_manager(streams={"model": Keep(last=1)})  # its reconcile keeps the file
    assert on_disk(reopened) == [1, 2] and states(db)[1] == "deleting"
    reopened.close()
    gc = cli("gc", str(root), db_url=db_url)
    assert gc.exit_code == 0, gc.output
    assert on_disk(reopened) == [1, 2]
    waiting = cli("status", str(root), "--json", db_url=db_url)
    (tier,) = json.loads(waiting.output)["tiers"]
    assert (tier["tier"], tier["location"], tier["waiting"]) == ("remote", s3_url, 1)
    assert (
        tier["waiting_bytes"] == (reopened.save_dir / "model" / "step-000000001.pt").stat().st_size
    )
    assert "1 evicted local file(s)" in cli("status", str(root), db_url=db_url).output

    with Replicator(root, s3_url, db_url=db_url) as replicator:
        replicator.replicate()
    gc = cli("gc", str(root), db_url=db_url)  # the writer that removes what no longer waits
    assert gc.exit_code == 0, gc.output
    assert on_disk(reopened) == [2] and states(db)[1] == "deleted"


def test_a_checkpoint_whose_copies_fail_keeps_its_file_and_retry_failed_tries_again(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store failing (an outage, a credential revoked): the evicted file waits."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        mgr.save(1, model=state(1))
        mgr.save(2, model=state(2))
        remote = replicator._remote
        write = remote.write_object

        def outage(rel: str, serialize: Any) -> Any:
            if "/step-000000001." in rel:  # step 1's copies fail at the store
                raise ObjectStoreError("injected: the store did not answer")
            return write(rel, serialize)

        monkeypatch.setattr(remote, "write_object", outage)
        for _ in range(ckptdb.replication.MAX_FAILURES + 1):
            replicator.replicate()
        mgr.save(3, model=state(3))
        assert on_disk(mgr) == [1, 3]  # 2 was copied and went; 1 still waits
        assert live_holds(db) == [1]
        tries = db.rows("SELECT COUNT(*) FROM replicas WHERE state = 'failed'")
        assert tries == [(ckptdb.replication.MAX_FAILURES,)]
        assert [r.step for r in replicator.replicate()] == [3]  # 1's tries are used up
        assert db.rows("SELECT COUNT(*) FROM events WHERE kind = 'copy_impossible'") == [(0,)]

        monkeypatch.setattr(remote, "write_object", write)  # the store is back
        (again,) = replicator.replicate(retry_failed=True)
    assert (again.step, again.state) == (1, "replicated")
    mgr.save(4, model=state(4))
    assert on_disk(mgr) == [4]


@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_an_evicted_checkpoint_whose_local_copy_is_bad_no_longer_waits(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    damage: str,
) -> None:
    """Its local copy gone, or not the bytes its row records: no copy can ever be made,
    so holding the evicted file would only keep it (and ``status``'s waiting count)
    forever; the failed copy releases it, and retention removes it as without a tier."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        first = mgr.save(1, model=state(1))["model"]
        mgr.save(2, model=state(2))  # evicts 1 before its copy: its file waits
        assert live_holds(db) == [1]
        if damage == "flipped":
            flip_byte(first.path)
        else:
            first.path.unlink()
        done = replicator.replicate()
        assert sorted((r.step, r.state) for r in done) == [(1, "failed"), (2, "replicated")]
        assert live_holds(db) == []
    found = db.rows("SELECT step, detail FROM events WHERE kind = 'copy_impossible'")
    ((step, detail),) = [(s, json.loads(d)) for s, d in found]
    why = "CorruptCheckpointError" if damage == "flipped" else "FileNotFoundError"
    assert step == 1 and why in detail["error"] and detail["path"] == str(first.path)
    mgr.save(3, model=state(3))
    assert on_disk(mgr) == [3]
    assert states(db)[1] == "deleted"
    whole = "SELECT c.step FROM replicas r JOIN checkpoints c ON c.id = r.checkpoint_id"
    assert db.rows(whole + " WHERE r.state = 'replicated'") == [(2,)]


def test_an_evicted_file_whose_directory_is_not_there_keeps_waiting(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    """The stream's directory gone for a while (a disk not mounted yet): the file says
    nothing about the checkpoint then, so it keeps waiting and is copied once it is back."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url) as replicator:
        mgr.save(1, model=state(1))
        mgr.save(2, model=state(2))
        stream_dir = root / "checkpoints" / "model"
        stream_dir.rename(root / "away")
        replicator.replicate()
        assert live_holds(db) == [1]
        assert db.rows("SELECT COUNT(*) FROM events WHERE kind = 'copy_impossible'") == [(0,)]
        (root / "away").rename(stream_dir)
        assert sorted(r.step for r in replicator.replicate()) == [1, 2]
        assert live_holds(db) == []
    mgr.save(3, model=state(3))
    assert on_disk(mgr) == [3]


def test_destinations_that_differ_only_in_case_are_two(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    """Object keys are case-sensitive: a copy under ``.../Run`` is no copy under ``.../run``
    (SQLite's LIKE would say it is)."""
    upper = s3_url + "/Run"
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, upper, db_url=db_url) as replicator:
        mgr.save(1, model=state(1))
        replicator.replicate()
    with Replicator(root, s3_url + "/run", db_url=db_url) as replicator:
        (copied,) = replicator.replicate()
        assert copied.step == 1 and copied.location.startswith(s3_url + "/run/")
        mgr.save(2, model=state(2))  # evicts 1: copied under both now, it goes
        assert live_holds(db) == [] and on_disk(mgr) == [2]


def test_detach_releases_every_hold(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url):
        for step in (1, 2, 3):
            mgr.save(step, model=state(step))
    assert on_disk(mgr) == [1, 2, 3]
    detached = cli("replicate", str(root), "--detach", db_url=db_url)
    assert detached.exit_code == 0, detached.output
    assert "detached: 2 local file(s)" in detached.output
    assert db.rows("SELECT COUNT(*) FROM tiers") == [(0,)] and live_holds(db) == []
    mgr.save(4, model=state(4))
    assert on_disk(mgr) == [4]
    for step in (5, 6):  # nothing registered: evictions remove at once again
        mgr.save(step, model=state(step))
    assert on_disk(mgr) == [6]


# ------------------------------------------------------------- the remote tier's window


def test_the_remote_window_keeps_the_best_after_it_left_the_local_one(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    losses = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.5, 7: 0.4, 8: 0.3}
    mgr = open_manager(streams={"model": Keep(last=2)})
    keep = {"model": TopK(1, "loss", last=3)}  # the best, and the newest: 3 in all
    saved = {}
    with Replicator(root, s3_url, db_url=db_url, keep=keep) as replicator:
        for step, loss in losses.items():
            saved[step] = mgr.save(step, metrics={"loss": loss}, model=state(step))["model"]
            data = saved[step].path.read_bytes()
            replicator.replicate()
            if step == 2:
                best = data
        copies = replicator.replicas()

    assert on_disk(mgr) == [7, 8]  # the local window: the best is gone from the disk
    whole = sorted(r.step for r in copies if r.state == "replicated")
    assert whole == [2, 7, 8]
    assert sorted(r.step for r in copies if r.state == "deleted") == [1, 3, 4, 5, 6]
    keys = s3lib.keys_under(client, s3_url)
    assert len(keys) == 3 and all(
        any(f".r{r.id}/" in k for k in keys) for r in copies if r.step in whole
    )
    (kept,) = [r for r in copies if r.step == 2]
    assert copy_bytes(client, s3_url, kept.id) == best and kept.hash == saved[2].hash
    remote = cli("latest", str(root), "--tier", "remote", db_url=db_url)
    assert remote.output.strip().startswith(s3_url) and "step-000000008" in remote.output


def test_a_copy_removal_cut_short_is_finished_by_the_next_pass(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    with Replicator(root, s3_url, db_url=db_url, keep={"model": Keep(last=1)}) as replicator:
        mgr.save(1, model=state(1))
        replicator.replicate()
        mgr.save(2, model=state(2))
        remove = replicator._remote.remove_tree

        def refused(prefix: str) -> None:
            raise ckptdb.errors.ObjectStoreError(f"DeleteObjects refused under {prefix}")

        monkeypatch.setattr(replicator._remote, "remove_tree", refused)
        (copied,) = replicator.replicate()
        assert copied.step == 2 and replicator.expired == []
        (doomed,) = [r for r in replicator.replicas() if r.step == 1]
        assert doomed.state == "deleting" and "DeleteObjects refused" in (doomed.error or "")
        assert len(s3lib.keys_under(client, s3_url)) == 2  # recorded first, objects still there

        # a copy on its way out is never restored from
        (mgr.save_dir / "model" / "step-000000001.pt").unlink()
        assert mgr.restore(s3_url, every=True) == []
        assert mgr.latest("model") is not None and mgr.latest("model").step == 2

        monkeypatch.setattr(replicator._remote, "remove_tree", remove)
        assert replicator.replicate() == []
        assert [r.step for r in replicator.expired] == [1]
    assert len(s3lib.keys_under(client, s3_url)) == 1
    rows = db.rows("SELECT state, error FROM replicas ORDER BY id")
    assert rows == [("deleted", None), ("replicated", None)]


def test_a_replicator_that_died_mid_removal_is_finished_by_the_next_one(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    two_copied(open_manager, root, s3_url, db_url)
    # what a replicator leaves if it dies between recording a removal and making it
    db.execute("UPDATE replicas SET state = 'deleting' WHERE id = (SELECT MIN(id) FROM replicas)")
    with Replicator(root, s3_url, db_url=db_url) as replicator:  # keeps every copy itself
        assert replicator.replicate() == []
        assert [r.step for r in replicator.expired] == [1]
    assert len(s3lib.keys_under(client, s3_url)) == 1
    assert db.rows("SELECT state FROM replicas ORDER BY id") == [("deleted",), ("replicated",)]


# ------------------------------------------------------------- bad input


def test_keep_must_be_a_policy_of_a_copied_stream_of_the_run(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    open_manager(streams={"model": Keep(last=3), "ema": Keep(last=1)})
    with pytest.raises(UnknownStreamError, match="'nope', which the run does not have"):
        Replicator(root, s3_url, db_url=db_url, keep={"nope": Keep(last=1)})
    with pytest.raises(InvalidArgumentError, match="'ema', which this replicator does not copy"):
        Replicator(root, s3_url, db_url=db_url, streams=["model"], keep={"ema": Keep(last=1)})
    with pytest.raises(ArgumentTypeError, match="must be Keep or TopK"):
        Replicator(root, s3_url, db_url=db_url, keep={"model": 3})  # type: ignore[dict-item]
    with pytest.raises(ArgumentTypeError, match="keep must be a dict"):
        Replicator(root, s3_url, db_url=db_url, keep=[Keep(last=1)])  # type: ignore[arg-type]
    assert db.rows("SELECT COUNT(*) FROM tiers") == [(0,)]  # nothing registered
    with Replicator(root, s3_url, db_url=db_url):  # and the lock was released each time
        pass


@pytest.mark.parametrize(
    ("spec", "policy"),
    [
        ("model:last=10", Keep(last=10)),
        ("model:last=2,every=100", Keep(last=2, every=100)),
        ("best:best=3,metric=val_loss", TopK(3, "val_loss")),
        ("best:best=1,metric=acc,mode=max,last=5", TopK(1, "acc", "max", last=5)),
    ],
)
def test_keep_specs_read_as_policies(spec: str, policy: Any) -> None:
    assert parse_keep(spec) == (spec.split(":")[0], policy)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("model", "expected STREAM:RULE=VALUE"),
        ("model:", "expected STREAM:RULE=VALUE"),
        ("model:last", "expected STREAM:RULE=VALUE"),
        ("model:size=3", "unknown rule 'size'"),
        ("model:last=ten", "last must be a positive int"),
        ("model:last=0", "must be >= 1"),
        ("model:best=3", "best=K needs metric=NAME"),
        ("model:best=3,metric=loss,every=2", "best=K needs metric=NAME"),
        ("model:best=3,metric=loss,mode=up", "mode must be min or max"),
        ("model:last=3,mode=max", "mode goes with best=K"),
        ("model:every=100", "every=N goes with last=N"),
        ("model:last=3,last=1", "a rule is given twice"),
        ("model:last=\u00b2", "last must be a positive int"),
    ],
)
def test_a_bad_keep_spec_is_one_line_and_registers_nothing(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    spec: str,
    says: str,
) -> None:
    open_manager(streams={"model": Keep(last=3)}).close()
    result = cli("replicate", str(root), "--to", s3_url, "--keep", spec, db_url=db_url)
    assert result.exit_code == 1 and says in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert db.rows("SELECT COUNT(*) FROM tiers") == [(0,)]


def test_the_command_applies_keep_and_shows_it(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    s3_url: str,
    client: Any,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    mgr.close()
    done = cli(
        "replicate", str(root), "--to", s3_url, "--keep", "model:last=1", "--json", db_url=db_url
    )
    assert done.exit_code == 0, done.output
    shown = json_objects(done.output)
    assert [(r["step"], r["state"]) for r in shown] == [
        (1, "replicated"),
        (2, "replicated"),
        (3, "replicated"),
        (1, "deleted"),
        (2, "deleted"),
    ]
    assert len(s3lib.keys_under(client, s3_url)) == 1
    listed = json.loads(cli("list", str(root), "--all", "--json", db_url=db_url).output)
    assert [(c["step"], c["state"], c["remote"]) for c in listed] == [
        (1, "committed", "deleted"),
        (2, "committed", "deleted"),
        (3, "committed", "replicated"),
    ]
    table = cli("list", str(root), db_url=db_url).output.splitlines()
    assert table[0].split()[:4] == ["stream", "step", "state", "remote"]
    assert [line.split()[3] for line in table[1:]] == ["deleted", "deleted", "replicated"]
    status = cli("status", str(root), db_url=db_url).output
    assert f"tier remote: {s3_url} (every stream; keeps model: keep last 1)" in status
    with RunReader(root, db_url=db_url) as reader:
        (tier,) = reader.tiers()
    assert tier.policies["model"] == Keep(last=1).to_record() and tier.streams is None
    missing = cli("replicate", str(root), db_url=db_url)
    assert missing.exit_code == 2 and "--to is required" in missing.output


def test_downgrading_drops_the_registration_and_releases_its_holds(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    with Replicator(root, s3_url, db_url=db_url, keep={"model": Keep(last=5)}):
        for step in (1, 2, 3):
            mgr.save(step, model=state(step))
    mgr.close()
    assert live_holds(db) == [1, 2]
    url = db_url or default_sqlite_url(root)

    migrate_to(url, "0006", down=True)
    assert db.rows("SELECT COUNT(*) FROM pins WHERE released_at IS NULL") == [(0,)]
    with pytest.raises(Exception, match="tiers"):
        db.rows("SELECT COUNT(*) FROM tiers")
    later = open_manager(streams={"model": Keep(last=1)})  # upgrades to the head again
    assert on_disk(later) == [3]  # its reconcile removed what no longer waits
    with Replicator(root, s3_url, db_url=db_url):
        later.save(4, model=state(4))
    assert live_holds(db) == [3]


@pytest.mark.postgres
def test_a_copy_finished_while_a_commit_evicts_it_leaves_no_hold_behind(
    tmp_path: Path, pg_url: str, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interleaving READ COMMITTED allows without the row lock: the copy's
    transaction releases the holds (seeing none), the commit, not seeing the copy,
    adds one, and commits first; the hold would then wait forever."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=1)})
    db = LedgerClient(root, pg_url)
    try:
        mgr.save(1, model=state(1))
        with Replicator(root, s3_url, db_url=pg_url) as replicator:
            released, saved = release_then_wait(monkeypatch)
            copying = threading.Thread(target=replicator.replicate)
            copying.start()
            assert released.wait(30), "the copy never finished"
            mgr.save(2, model=state(2))  # evicts step 1 (waits for the copy's row lock)
            saved.set()
            copying.join(30)
            assert not copying.is_alive()
        mgr.save(3, model=state(3))
        assert live_holds(db) == [2]  # step 2 waits for its copy; step 1's is made
        assert on_disk(mgr) == [2, 3]
    finally:
        mgr.close()
        db.close()


# ------------------------------------------------------------- review: edges of the windows


def test_the_remote_window_follows_the_timeline_after_a_resume(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    """Resumed from step 3: the copies of the abandoned steps 4 and 5 go, and the new
    step 3 (the one ``latest`` names) stays, restorable, as the stream's own window does."""
    mgr = open_manager(streams={"model": Keep(last=3)})
    with Replicator(root, s3_url, db_url=db_url, keep={"model": Keep(last=4)}) as replicator:
        for step in (1, 2, 3, 4, 5):
            mgr.save(step, model=state(step))
        replicator.replicate()
        resumed = mgr.save(3, model=state(33))["model"]
        replicator.replicate()
        copies = replicator.replicas()
    whole = sorted((r.step, r.checkpoint_id) for r in copies if r.state == "replicated")
    assert whole == [
        (2, db.rows("SELECT id FROM checkpoints WHERE step = 2")[0][0]),
        (3, resumed.id),
    ]
    assert len(s3lib.keys_under(client, s3_url)) == 2
    resumed.path.unlink()
    (back,) = mgr.restore(s3_url)
    assert back.id == resumed.id and back.path.read_bytes() == copy_bytes(
        client, s3_url, next(r.id for r in copies if r.checkpoint_id == resumed.id)
    )


def test_a_ranked_remote_window_never_judges_copies_saved_without_its_metric(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    s3_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    keep = {"model": TopK(1, "loss")}  # the saves below log "val_loss", not "loss"
    with Replicator(root, s3_url, db_url=db_url, keep=keep) as replicator:
        for step in (1, 2, 3):
            mgr.save(step, metrics={"val_loss": 1.0 / step}, model=state(step))
            replicator.replicate()
        copies = replicator.replicas()
    assert [r.state for r in copies] == ["replicated"] * 3  # none removed
    said = [r.message for r in caplog.records if "saved without 'loss'" in r.message]
    assert len(said) == 1  # said once, not at every pass


def test_copies_under_another_destination_are_neither_judged_nor_removed(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    mgr = two_copied(open_manager, root, s3_url, db_url)
    elsewhere = s3lib.unique_prefix()
    with Replicator(root, elsewhere, db_url=db_url, keep={"model": Keep(last=1)}) as replicator:
        mgr.save(3, model=state(3))
        copied = replicator.replicate()  # the new destination gets every checkpoint
        assert [c.step for c in copied] == [1, 2, 3]
        assert all(c.location.startswith(elsewhere + "/") for c in copied)
        # its window judges its own copies only: 1 and 2 go there, not at s3_url
        assert sorted(c.step for c in replicator.expired) == [1, 2]
    found = db.rows("SELECT location, state FROM replicas ORDER BY id")
    assert [st for loc, st in found if loc.startswith(s3_url + "/")] == ["replicated"] * 2
    assert [st for loc, st in found if loc.startswith(elsewhere + "/")] == [
        "deleted",
        "deleted",
        "replicated",
    ]
    assert len(s3lib.keys_under(client, s3_url)) == 2
    assert len(s3lib.keys_under(client, elsewhere)) == 1


def test_a_new_destination_is_what_evicted_files_wait_for_and_loads_fall_back_to(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    client: Any,
) -> None:
    """``--to`` changed (the old bucket is going away): a copy under the old destination
    no longer lets an evicted file go, and each destination's copies serve the loads
    whose ``remote=`` names it."""
    mgr = open_manager(streams={"model": Keep(last=2)})
    with Replicator(root, s3_url, db_url=db_url) as first:
        for step in (1, 2):
            mgr.save(step, model=state(step))
        first.replicate()
    moved = s3lib.unique_prefix()
    with Replicator(root, moved, db_url=db_url) as replicator:
        mgr.save(3, model=state(3))  # evicts 1: copied to s3_url only, so its file waits
        assert on_disk(mgr) == [1, 2, 3] and live_holds(db) == [1]
        assert [c.step for c in replicator.replicate()] == [1, 2, 3]
        assert live_holds(db) == []
    mgr.save(4, model=state(4))
    assert on_disk(mgr) == [3, 4]
    assert sum("/step-000000001." in k for k in s3lib.keys_under(client, moved)) == 1
    with Replicator(root, s3_url, db_url=db_url) as back:  # and back again
        assert [c.step for c in back.replicate()] == [3, 4]
    mgr.close()  # step 3 is copied under both now, the newer copy under s3_url

    flip_byte(root / "checkpoints" / "model" / "step-000000003.pt")
    reopened = open_manager(streams={"model": Keep(last=2)}, remote=moved)
    assert torch.equal(reopened.load(3)["w"], state(3)["w"])  # from its copy under moved
    found = db.rows("SELECT detail FROM events WHERE kind = 'restored_from_replica'")
    assert [json.loads(d)["from"].startswith(moved + "/") for (d,) in found] == [True]


def test_a_copy_the_window_removes_during_a_restore_is_skipped(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = two_copied(open_manager, root, s3_url, db_url)
    saved = {c.step: c for c in mgr.checkpoints("model")}
    for checkpoint in saved.values():
        checkpoint.path.unlink()
    remove_copy_while_downloaded(monkeypatch, db, 2)
    restored = mgr.restore(s3_url, every=True)
    assert [c.step for c in restored] == [1]  # step 2 skipped, step 1 restored all the same
    assert saved[1].path.exists() and not saved[2].path.exists()
    assert not list(root.rglob(".*.tmp-*"))


def test_detach_is_refused_while_a_replicator_runs(
    open_manager: Callable[..., CheckpointManager],
    root: Path,
    db_url: str | None,
    db: LedgerClient,
    s3_url: str,
) -> None:
    open_manager(streams={"model": Keep(last=1)}).close()
    with Replicator(root, s3_url, db_url=db_url):
        with pytest.raises(LedgerLockedError, match="stop it before detaching"):
            ckptdb.replication.detach(root, db_url=db_url)
        refused = cli("replicate", str(root), "--detach", db_url=db_url)
        assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert db.rows("SELECT COUNT(*) FROM tiers") == [(1,)]
    mixed = cli("replicate", str(root), "--detach", "--to", s3_url, db_url=db_url)
    assert mixed.exit_code == 2 and "--detach takes none of --to" in mixed.output
    assert db.rows("SELECT COUNT(*) FROM tiers") == [(1,)]


@pytest.mark.postgres
def test_a_detach_while_a_commit_evicts_leaves_no_hold_behind(
    tmp_path: Path, pg_url: str, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the tier row's locks: the commit reads the registration, the detach
    releases the holds it sees and commits, then the commit adds a hold nobody releases."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=1)})
    db = LedgerClient(root, pg_url)
    try:
        with Replicator(root, s3_url, db_url=pg_url):
            mgr.save(1, model=state(1))
            mgr.save(2, model=state(2))
        assert live_holds(db) == [1]
        released, saved = release_then_wait(monkeypatch)
        detaching = threading.Thread(
            target=ckptdb.replication.detach, args=(root,), kwargs={"db_url": pg_url}
        )
        detaching.start()
        assert released.wait(30), "the detach never ran"
        mgr.save(3, model=state(3))  # evicts step 2 (waits for the detach's row lock)
        saved.set()
        detaching.join(30)
        assert not detaching.is_alive()
        assert live_holds(db) == []
        mgr.save(4, model=state(4))
        assert on_disk(mgr) == [4]
    finally:
        mgr.close()
        db.close()


@pytest.mark.postgres
def test_one_replicator_per_run_across_machines(
    tmp_path: Path, pg_url: str, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock file in the run's root covers one machine; on a PostgreSQL ledger a
    replicator (or a detach) on another machine meets the run's advisory lock."""
    root = tmp_path / "run"
    CheckpointManager(root, db_url=pg_url, streams={"model": Keep(last=1)}).close()
    with Replicator(root, s3_url, db_url=pg_url):
        # another machine: a lock file of its own (another disk), the same ledger
        monkeypatch.setattr(ckptdb.replication, "LOCK_NAME", ".ckptdb.replicator.elsewhere")
        with pytest.raises(LedgerLockedError, match="has a replicator already"):
            Replicator(root, s3_url, db_url=pg_url)
        with pytest.raises(LedgerLockedError, match="has a replicator already"):
            ckptdb.replication.detach(root, db_url=pg_url)
    with Replicator(root, s3_url, db_url=pg_url):  # released at close, on both machines
        pass
    assert ckptdb.replication.detach(root, db_url=pg_url) == 0
