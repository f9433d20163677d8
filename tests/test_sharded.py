"""Sharded (torch.distributed.checkpoint) checkpoints in a single process.

A payload wrapped in :class:`ckptdb.Sharded` is saved by DCP as a directory
``<save_dir>/<stream>/step-<step:09d>.dcp`` through the same protocol as a file
(intent, write into ``.step-...dcp.tmp-<row id>``, fsync, hash, rename, commit)
and loads in place with ``load(..., into=state_dict)``. These tests check the
round trip, refused input, corruption found at load/reconcile/check, reconcile
of leftovers on disk, crash consistency at every phase, retention, and that
links inside a checkpoint directory are never followed. (Several ranks:
tests/test_distributed.py.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from crashlib import CRASH_EXIT, fork_running, tail, wait_child
from helpers import LedgerClient, flip_byte, state, tree

import ckptdb
from ckptdb import CheckpointManager, Keep, Sharded, faults
from ckptdb.errors import (
    ArgumentTypeError,
    CkptDBError,
    CorruptCheckpointError,
    InvalidArgumentError,
    PublishError,
)
from ckptdb.storage import hash_checkpoint

QUARANTINE = "ckptdb.quarantine"
STREAMS = {"model": Keep(last=3), "ema": Keep(last=3)}
Opener = Callable[..., CheckpointManager]


# --------------------------------------------------------------------------- helpers


def sd(value: float) -> dict[str, Any]:
    """A state dict with several tensors (one 2-D, one int) and a non-tensor value."""
    return {
        "w": torch.full((8,), float(value)),
        "b": torch.tensor([float(value), -float(value)]),
        "m": torch.arange(6, dtype=torch.float32).reshape(2, 3) * value,
        "n": torch.tensor([int(value)] * 3, dtype=torch.int64),
        "epoch": int(value) + 1000,
    }


def zeroed() -> dict[str, Any]:
    """A state dict of the same structure as :func:`sd`, every value zeroed."""
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd(1).items()}


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor), key
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def dcp(save_dir: Path, step: int, stream: str = "model") -> Path:
    return save_dir / stream / f"step-{step:09d}.dcp"


def regular_files(directory: Path) -> dict[str, Path]:
    """Every regular file under ``directory`` by relative posix name (walked with os.walk)."""
    found: dict[str, Path] = {}
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            path = Path(dirpath) / name
            found[path.relative_to(directory).as_posix()] = path
    return found


def independent_size_and_hash(directory: Path) -> tuple[int, str]:
    """The documented directory digest, recomputed here from the bytes on disk:
    xxh3_128 over sorted ``name\\0size\\0xxh3_128(content)\\n`` lines."""
    digest = xxhash.xxh3_128()
    total = 0
    for name, path in sorted(regular_files(directory).items()):
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0{xxhash.xxh3_128(data).hexdigest()}\n".encode())
        total += len(data)
    return total, digest.hexdigest()


def shard_file(directory: Path) -> Path:
    """The (single-process) data file of a DCP checkpoint, not its ``.metadata``."""
    shards = sorted(directory.glob("*.distcp"))
    assert len(shards) == 1, shards
    return shards[0]


def ledger_snapshot(db: LedgerClient) -> dict[str, list[tuple[Any, ...]]]:
    return {
        table: db.rows(f"SELECT * FROM {table} ORDER BY 1")  # fixed table names
        for table in ("checkpoints", "pointers", "events", "metrics")
    }


def row(db: LedgerClient, ident: int) -> tuple[Any, ...]:
    """(path, state, tmp_path, size, hash) of one checkpoint row."""
    found = db.rows("SELECT path, state, tmp_path, size, hash FROM checkpoints WHERE id = ?", ident)
    assert len(found) == 1, found
    return found[0]


def state_of(db: LedgerClient, ident: int) -> str:
    return str(row(db, ident)[1])


def temps(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.rglob(".*.tmp-*"))


def actions(report: ckptdb.ReconcileReport) -> list[tuple[str, str]]:
    return [(a.kind, a.path) for a in report.actions]


def assert_consistent(mgr: CheckpointManager) -> None:
    assert mgr.check(load=True) == []
    assert mgr.reconcile(dry_run=True).actions == []


# ------------------------------------------------------------------ round trip


def test_round_trip_loads_in_place_and_records_the_directory(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    original = sd(5)

    saved = mgr.save(5, model=Sharded(original))["model"]

    directory = dcp(save_dir, 5)
    assert saved.path == directory and directory.is_dir() and not directory.is_symlink()
    assert ".metadata" in regular_files(directory)
    path, st, tmp_path, size, digest = row(db, saved.id)
    assert path == "model/step-000000005.dcp"
    assert (st, tmp_path) == ("committed", None)
    expected_size, expected_hash = independent_size_and_hash(directory)
    assert size == expected_size == sum(p.stat().st_size for p in regular_files(directory).values())
    assert digest == hash_checkpoint(directory).hash == expected_hash
    assert (saved.size, saved.hash) == (size, digest)
    assert temps(save_dir) == []
    assert mgr.latest("model") == saved

    into = zeroed()
    tensors_before = {k: v for k, v in into.items() if isinstance(v, torch.Tensor)}
    loaded = mgr.load("latest", stream="model", into=into)

    assert loaded is into
    assert_same_state(into, original)
    for key, tensor in tensors_before.items():  # filled in place, not replaced
        assert into[key] is tensor, key
    assert mgr.load(5, stream="model", into=zeroed())["epoch"] == original["epoch"]
    assert_consistent(mgr)


def test_sharded_and_plain_streams_commit_in_one_boundary(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    plain = state(3.0)

    out = mgr.save(3, model=Sharded(sd(3)), ema=plain)

    assert set(out) == {"model", "ema"}
    assert row(db, out["model"].id)[:3] == ("model/step-000000003.dcp", "committed", None)
    assert row(db, out["ema"].id)[:3] == ("ema/step-000000003.pt", "committed", None)
    assert out["model"].committed_at == out["ema"].committed_at  # one commit
    assert (save_dir / "ema" / "step-000000003.pt").is_file()
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(3))
    assert_same_state(mgr.load("latest", stream="ema"), plain)
    assert temps(save_dir) == []
    assert_consistent(mgr)


def test_resave_of_a_step_gets_a_versioned_directory(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    first = mgr.save(4, model=Sharded(sd(1)))["model"]
    second = mgr.save(4, model=Sharded(sd(2)))["model"]

    # the name was taken by a live row at intent; the re-save then replaced it
    assert first.path == dcp(save_dir, 4)
    assert second.path == save_dir / "model" / f"step-000000004.v{second.id}.dcp"
    assert second.path.is_dir() and not first.path.exists()
    assert state_of(db, first.id) == "deleted"
    assert row(db, second.id)[:3] == (f"model/step-000000004.v{second.id}.dcp", "committed", None)
    assert_same_state(mgr.load(4, stream="model", into=zeroed()), sd(2))
    assert temps(save_dir) == []
    assert_consistent(mgr)


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [[1, 2], None, "model", torch.ones(2), (("w", 1),)])
def test_sharded_of_a_non_dict_is_refused_and_nothing_changes(
    open_manager: Opener, db: LedgerClient, root: Path, bad: object
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded(sd(1)))
    before = (ledger_snapshot(db), tree(root / "checkpoints"))

    with pytest.raises(ArgumentTypeError) as info:
        mgr.save(2, model=Sharded(bad))  # type: ignore[arg-type]

    assert isinstance(info.value, CkptDBError) and isinstance(info.value, TypeError)
    assert "dict" in str(info.value)
    assert (ledger_snapshot(db), tree(root / "checkpoints")) == before
    assert_consistent(mgr)


def test_loading_a_sharded_checkpoint_without_into_is_refused(
    open_manager: Opener, db: LedgerClient, root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    saved = mgr.save(1, model=Sharded(sd(1)))["model"]
    before = (ledger_snapshot(db), tree(root / "checkpoints"))

    for which in ("latest", 1, saved, saved.path):
        with pytest.raises(InvalidArgumentError, match="into="):
            mgr.load(which, stream="model")
    with pytest.raises(InvalidArgumentError, match="into="):
        mgr.load("latest", stream="model", into=[torch.zeros(8)])  # type: ignore[arg-type]

    assert (ledger_snapshot(db), tree(root / "checkpoints")) == before


def test_into_for_a_file_checkpoint_is_refused(
    open_manager: Opener, db: LedgerClient, root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    before = (ledger_snapshot(db), tree(root / "checkpoints"))
    into = state(0.0)

    with pytest.raises(InvalidArgumentError, match="into="):
        mgr.load("latest", stream="model", into=into)

    assert_same_state(into, state(0.0))  # not loaded into either
    assert (ledger_snapshot(db), tree(root / "checkpoints")) == before


# ------------------------------------------------------------------ corruption


def test_flipped_byte_in_a_shard_is_caught_before_loading(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=Sharded(sd(1)))["model"]
    newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    shard = shard_file(newer.path)
    size = shard.stat().st_size
    flip_byte(shard)
    assert shard.stat().st_size == size

    problems = mgr.check()  # before any repair
    assert len(problems) == 1 and problems[0].startswith("model/step-000000002.dcp: size/hash")

    into = zeroed()
    with pytest.raises(CorruptCheckpointError, match=r"step-000000002\.dcp"):
        mgr.load("latest", stream="model", into=into)

    assert_same_state(into, zeroed())  # refused before DCP read anything
    assert state_of(db, newer.id) == "corrupt"
    assert state_of(db, older.id) == "committed"
    assert mgr.latest("model") == older
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(1))
    assert newer.path.is_dir()  # kept for inspection, owned by its corrupt row
    assert_consistent(mgr)


def test_verifying_reconcile_finds_a_flipped_byte(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    with CheckpointManager(save_dir.parent, streams=STREAMS) as mgr:
        older = mgr.save(1, model=Sharded(sd(1)))["model"]
        newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    flip_byte(shard_file(newer.path), offset=0)

    mgr = open_manager(streams=STREAMS)
    assert mgr.last_reconcile.actions == []  # same size: only a re-hash can tell
    report = mgr.reconcile(verify=True)

    assert ("corrupt", "model/step-000000002.dcp") in actions(report)
    assert ("repointed", "latest:model") in actions(report)
    assert state_of(db, newer.id) == "corrupt"
    assert mgr.latest("model") == older
    assert mgr.reconcile(verify=True).actions == []
    assert_consistent(mgr)


def test_missing_shard_file_is_a_size_mismatch(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    with CheckpointManager(save_dir.parent, streams=STREAMS) as mgr:
        older = mgr.save(1, model=Sharded(sd(1)))["model"]
        newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    shard_file(newer.path).unlink()

    with CheckpointManager(save_dir.parent, streams=STREAMS, maintenance=True) as mgr:
        problems = mgr.check()
    assert any(p.startswith("model/step-000000002.dcp: size/hash") for p in problems), problems

    mgr = open_manager(streams=STREAMS)  # reconcile at open, without verify

    found = [a for a in mgr.last_reconcile.actions if a.kind == "corrupt"]
    assert [a.path for a in found] == ["model/step-000000002.dcp"]
    assert "size" in found[0].detail
    assert state_of(db, newer.id) == "corrupt"
    assert mgr.latest("model") == older
    assert_consistent(mgr)


def test_removed_directory_is_lost(open_manager: Opener, db: LedgerClient, save_dir: Path) -> None:
    with CheckpointManager(save_dir.parent, streams=STREAMS) as mgr:
        older = mgr.save(1, model=Sharded(sd(1)))["model"]
        newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    for path in regular_files(newer.path).values():
        path.unlink()
    newer.path.rmdir()

    with CheckpointManager(save_dir.parent, streams=STREAMS, maintenance=True) as mgr:
        problems = mgr.check()
    assert any(
        p.startswith("model/step-000000002.dcp: committed but unreadable") for p in problems
    ), problems

    mgr = open_manager(streams=STREAMS)

    assert ("lost", "model/step-000000002.dcp") in actions(mgr.last_reconcile)
    assert state_of(db, newer.id) == "lost"
    assert mgr.latest("model") == older
    assert_consistent(mgr)


def test_directory_removed_under_a_live_manager_is_lost_at_load(
    open_manager: Opener, db: LedgerClient
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=Sharded(sd(1)))["model"]
    newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    for path in regular_files(newer.path).values():
        path.unlink()
    newer.path.rmdir()

    with pytest.raises(ckptdb.errors.CheckpointLostError):
        mgr.load("latest", stream="model", into=zeroed())

    assert state_of(db, newer.id) == "lost"
    assert mgr.latest("model") == older


# ------------------------------------------------------------ leftovers on disk


def test_orphan_temp_dir_is_removed_and_orphan_checkpoint_dir_quarantined(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=Sharded(sd(1)))
    temp = save_dir / "model" / ".step-000000009.dcp.tmp-999"
    temp.mkdir()
    (temp / "__0_0.distcp").write_bytes(b"partial shard")
    orphan = save_dir / "model" / "step-000000009.dcp"
    (orphan / "sub").mkdir(parents=True)
    (orphan / ".metadata").write_bytes(b"meta")
    (orphan / "sub" / "__0_0.distcp").write_bytes(b"shard")
    orphan_tree = tree(orphan)

    with CheckpointManager(root, streams=STREAMS, maintenance=True) as mgr:
        problems = mgr.check()
    assert "model/.step-000000009.dcp.tmp-999: temporary file left behind" in problems
    assert "model/step-000000009.dcp: checkpoint file without a ledger row" in problems

    mgr = open_manager(streams=STREAMS)

    assert sorted(actions(mgr.last_reconcile)) == [
        ("quarantined", "model/step-000000009.dcp"),
        ("removed_temp", "model/.step-000000009.dcp.tmp-999"),
    ]
    assert not temp.exists() and not orphan.exists()
    moved = root / QUARANTINE / "model" / "step-000000009.dcp"
    assert moved.is_dir() and tree(moved) == orphan_tree
    assert sorted(p.name for p in (save_dir / "model").iterdir()) == ["step-000000001.dcp"]
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(1))
    assert_consistent(mgr)


def test_names_of_the_wrong_kind_are_not_ours(
    open_manager: Opener, root: Path, save_dir: Path, tmp_path: Path
) -> None:
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=Sharded(sd(1)))
        mgr.save(1, ema=state(1.0))
    stream = save_dir / "model"
    (stream / "step-000000009.dcp").write_bytes(b"a user's file")  # a file, not a dir
    (stream / "step-000000009.pt").mkdir()  # a dir, not a file
    (stream / "step-000000009.pt" / "data").write_bytes(b"a user's dir")
    (stream / ".step-000000009.dcp.tmp-999").write_bytes(b"a file named like a temp dir")
    (stream / ".step-000000009.pt.tmp-999").mkdir()  # a dir named like a temp file
    (stream / ".step-000000009.pt.tmp-999" / "x").write_bytes(b"x")
    outside = tmp_path / "elsewhere.dcp"
    outside.mkdir()
    (outside / ".metadata").write_bytes(b"not ours")
    (save_dir / "ema" / "step-000000008.dcp").symlink_to(outside, target_is_directory=True)
    before = tree(save_dir)
    outside_before = tree(outside)

    mgr = open_manager(streams=STREAMS)

    assert mgr.last_reconcile.actions == []
    assert mgr.reconcile(verify=True).actions == []
    assert mgr.check(load=True) == []
    assert tree(save_dir) == before
    assert tree(outside) == outside_before
    assert not (root / QUARANTINE).exists()


# ---------------------------------------------------------- crash consistency


CRASH_POINTS = ("mid_shard_write", "after_intent", "after_fsync", "after_replace", "in_commit")


def crash_child(root: Path, point: str, log: Path) -> int:
    """Fork a child that opens the run and saves step 2 sharded (plus a plain ema)
    and dies by ``os._exit(CRASH_EXIT)`` at ``point``; returns its exit status."""

    def body() -> int:
        def hook(name: str) -> None:
            if name == point:
                os._exit(CRASH_EXIT)

        faults.set_hook(hook)
        with CheckpointManager(root, streams=STREAMS) as mgr:
            mgr.save(2, model=Sharded(sd(2)), ema=state(2.0))
        return 0

    return wait_child(fork_running(root, log, body), timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_before_commit_rolls_back_at_reopen(
    open_manager: Opener, db: LedgerClient, root: Path, save_dir: Path, tmp_path: Path, point: str
) -> None:
    with CheckpointManager(root, streams=STREAMS) as mgr:
        older = mgr.save(1, model=Sharded(sd(1)))["model"]
    log = tmp_path / "child.log"

    code = crash_child(root, point, log)

    assert code == CRASH_EXIT, f"child exited {code}, not at {point}:\n{tail(log)}"
    (pending,) = db.rows(
        "SELECT id, path, tmp_path FROM checkpoints WHERE stream = 'model' AND step = 2"
    )
    ident, path, tmp_path = pending
    assert row(db, ident)[1] == "pending"
    assert path == "model/step-000000002.dcp"
    assert tmp_path == f"model/.step-000000002.dcp.tmp-{ident}"
    if point in ("after_replace", "in_commit"):
        assert (save_dir / path).is_dir() and not (save_dir / tmp_path).exists()
    else:
        assert (save_dir / tmp_path).is_dir() and not (save_dir / path).exists()

    mgr = open_manager(streams=STREAMS)

    assert ("rolled_back", path) in actions(mgr.last_reconcile)
    assert state_of(db, ident) == "aborted"
    assert db.rows("SELECT COUNT(*) FROM checkpoints WHERE committed_at IS NOT NULL") == [(1,)]
    assert not (save_dir / path).exists() and not (save_dir / tmp_path).exists()
    assert temps(save_dir) == []
    assert sorted(p.name for p in (save_dir / "model").iterdir()) == ["step-000000001.dcp"]
    assert mgr.check() == []
    assert mgr.latest("model") == older
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(1))
    assert_consistent(mgr)
    # and the run goes on: the same step publishes under its plain name
    again = mgr.save(2, model=Sharded(sd(2)))["model"]
    assert again.path == dcp(save_dir, 2)
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(2))


def test_crash_after_commit_keeps_the_checkpoint(
    open_manager: Opener, db: LedgerClient, root: Path, save_dir: Path, tmp_path: Path
) -> None:
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=Sharded(sd(1)))
    log = tmp_path / "child.log"

    code = crash_child(root, "after_commit", log)

    assert code == CRASH_EXIT, f"child exited {code}:\n{tail(log)}"
    mgr = open_manager(streams=STREAMS)
    latest = mgr.latest("model")
    assert latest is not None and latest.step == 2 and latest.path == dcp(save_dir, 2)
    assert row(db, latest.id)[1:3] == ("committed", None)
    assert_same_state(mgr.load("latest", stream="model", into=zeroed()), sd(2))
    assert temps(save_dir) == []
    assert_consistent(mgr)


def raise_at_mid_shard_write(name: str) -> None:
    if name == "mid_shard_write":
        raise OSError(28, "No space left on device (injected)")


def test_write_error_inside_dcp_rolls_back(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=Sharded(sd(1)))["model"]
    previous = faults.set_hook(raise_at_mid_shard_write)
    try:
        with pytest.raises(PublishError):
            mgr.save(2, model=Sharded(sd(2)), ema=state(2.0))
    finally:
        faults.set_hook(previous)

    failed = db.rows("SELECT id, state, error FROM checkpoints WHERE step = 2 ORDER BY id")
    assert [r[1] for r in failed] == ["aborted", "aborted"]
    assert all(r[2] and r[2].startswith("write failed") for r in failed), failed
    assert temps(save_dir) == []
    assert not dcp(save_dir, 2).exists()
    assert not (save_dir / "ema").exists() or list((save_dir / "ema").iterdir()) == []
    assert mgr.latest("model") == older
    assert mgr.latest("ema") is None
    assert_consistent(mgr)
    # the manager is still usable
    assert mgr.save(2, model=Sharded(sd(2)))["model"].path == dcp(save_dir, 2)


def test_write_error_inside_dcp_is_a_publish_error(open_manager: Opener) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded(sd(1)))
    previous = faults.set_hook(raise_at_mid_shard_write)
    try:
        with pytest.raises(PublishError) as info:
            mgr.save(2, model=Sharded(sd(2)))
    finally:
        faults.set_hook(previous)
    assert info.value.phase == "write"
    assert info.value.step == 2


# ------------------------------------------------------------------- retention


def test_retention_removes_the_evicted_directory(
    open_manager: Opener, db: LedgerClient, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=Sharded(sd(1)))["model"]
    assert first.path.is_dir()

    second = mgr.save(2, model=Sharded(sd(2)))["model"]

    assert not first.path.exists()
    assert state_of(db, first.id) == "deleted"
    assert state_of(db, second.id) == "committed"
    assert sorted(p.name for p in (save_dir / "model").iterdir()) == ["step-000000002.dcp"]
    assert mgr.latest("model") == second
    assert_consistent(mgr)


# ------------------------------------------------------------------ check(load)


def test_check_load_passes_on_a_healthy_sharded_checkpoint(open_manager: Opener) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded(sd(1)), ema=state(1.0))
    mgr.save(2, model=Sharded(sd(2)))

    assert mgr.check(load=True) == []


def test_check_reports_a_flipped_byte_in_the_metadata(open_manager: Opener) -> None:
    mgr = open_manager(streams=STREAMS)
    saved = mgr.save(1, model=Sharded(sd(1)))["model"]
    flip_byte(saved.path / ".metadata")

    for load in (False, True):
        problems = mgr.check(load=load)
        assert len(problems) == 1, problems
        assert problems[0].startswith("model/step-000000001.dcp: size/hash")


def test_check_load_reports_metadata_that_does_not_load(
    open_manager: Opener, db: LedgerClient, root: Path
) -> None:
    """Metadata garbled before its hash was taken: only loading it can tell."""
    with CheckpointManager(root, streams=STREAMS) as mgr:
        saved = mgr.save(1, model=Sharded(sd(1)))["model"]
    (saved.path / ".metadata").write_bytes(b"\x00 definitely not a DCP metadata pickle")
    info = hash_checkpoint(saved.path)
    assert (info.size, info.hash) == independent_size_and_hash(saved.path)
    db.execute(
        "UPDATE checkpoints SET size = ?, hash = ? WHERE id = ?", info.size, info.hash, saved.id
    )

    mgr = open_manager(streams=STREAMS)

    assert mgr.check() == []
    problems = mgr.check(load=True)
    assert len(problems) == 1, problems
    assert problems[0].startswith("model/step-000000001.dcp: does not load")


# ------------------------------------------------------------- links inside


def link_instead_of_shard(directory: Path, outside: Path) -> Path:
    """Replace the shard file with a link to an identical copy outside the run: a
    reader that followed links would find the same bytes, size and hash."""
    shard = shard_file(directory)
    copy = outside / shard.name
    copy.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(copy)
    return copy


@pytest.mark.parametrize("how", ["replaces_a_shard", "added_beside"])
def test_link_inside_a_checkpoint_is_flagged_not_followed(
    open_manager: Opener, db: LedgerClient, root: Path, tmp_path: Path, how: str
) -> None:
    with CheckpointManager(root, streams=STREAMS) as mgr:
        older = mgr.save(1, model=Sharded(sd(1)))["model"]
        newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    outside = tmp_path / "outside"
    outside.mkdir()
    if how == "replaces_a_shard":
        target = link_instead_of_shard(newer.path, outside)
    else:
        target = outside / "secret.bin"
        target.write_bytes(b"outside the run")
        (newer.path / "extra.distcp").symlink_to(target)
    outside_before = tree(outside)
    inside_before = tree(newer.path)

    with CheckpointManager(root, streams=STREAMS, maintenance=True) as mgr:
        report = mgr.reconcile(verify=True)

    flagged = [a for a in report.actions if a.path == "model/step-000000002.dcp"]
    assert [a.kind for a in flagged] in (["lost"], ["corrupt"]), report.actions
    assert state_of(db, newer.id) == flagged[0].kind
    assert state_of(db, older.id) == "committed"
    assert tree(outside) == outside_before  # target untouched
    assert tree(newer.path) == inside_before  # the link neither followed nor removed

    mgr = open_manager(streams=STREAMS)
    assert mgr.latest("model") == older
    assert mgr.reconcile(verify=True).actions == []
    assert_consistent(mgr)


def test_link_inside_a_checkpoint_is_refused_at_load(
    open_manager: Opener, db: LedgerClient, tmp_path: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=Sharded(sd(1)))
    newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    outside = tmp_path / "outside"
    outside.mkdir()
    link_instead_of_shard(newer.path, outside)
    into = zeroed()

    assert mgr.check() != []  # the checker flags it
    with pytest.raises(CorruptCheckpointError):
        mgr.load("latest", stream="model", into=into)

    assert_same_state(into, zeroed())


def test_link_inside_a_checkpoint_marks_it_bad_at_load(
    open_manager: Opener, db: LedgerClient, tmp_path: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    older = mgr.save(1, model=Sharded(sd(1)))["model"]
    newer = mgr.save(2, model=Sharded(sd(2)))["model"]
    outside = tmp_path / "outside"
    outside.mkdir()
    link_instead_of_shard(newer.path, outside)

    with pytest.raises(CkptDBError):
        mgr.load("latest", stream="model", into=zeroed())

    assert state_of(db, newer.id) in ("lost", "corrupt")
    assert mgr.latest("model") == older
