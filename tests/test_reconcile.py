"""Reconciliation (ckptdb.protocol.reconcile): at open and on demand.

Every test damages a run the way a crash, an operator or a full disk would,
then checks what reconcile repairs, what it refuses to touch, what it
reports, and that a second run has nothing left to do.

Every test runs on both ledgers: the run's SQLite file and a PostgreSQL schema of
its own (``db_url`` below follows ``backend``; see conftest). The ledger is read
and damaged with plain SQL through the ``db`` fixture. Cases that differ only in a
file name or a path (what reconcile sees on disk, never in the ledger) run once on
PostgreSQL: ``on_both_backends``.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    LedgerClient,
    await_sessions_gone,
    files,
    flip_byte,
    on_both_backends,
    state,
    tree,
)

import ckptdb
from ckptdb import CheckpointManager, External, Keep
from ckptdb.errors import (
    CheckpointNotFoundError,
    LedgerLockedError,
    ObjectStoreError,
    RunDirectoryError,
)
from ckptdb.protocol.reconcile import Reconciler
from ckptdb.storage.local import LocalStore

QUARANTINE = "ckptdb.quarantine"


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    """Runs opened here (``open_manager``, ``db``, ``three``) use both ledgers in turn."""
    return backend


def row_id(db: LedgerClient, step: int, stream: str = "model") -> int:
    found = db.rows(
        "SELECT id FROM checkpoints WHERE stream = ? AND step = ? AND state = 'committed'",
        stream,
        step,
    )
    assert len(found) == 1, found
    return int(found[0][0])


def row_state(db: LedgerClient, ident: int) -> str:
    return str(db.rows("SELECT state FROM checkpoints WHERE id = ?", ident)[0][0])


def ckpt(save_dir: Path, step: int, stream: str = "model") -> Path:
    return save_dir / stream / f"step-{step:09d}.pt"


def ledger_snapshot(db: LedgerClient) -> dict[str, list[tuple[Any, ...]]]:
    return {
        "checkpoints": db.rows(
            "SELECT id, stream, step, state, path, tmp_path, size, hash, error, deleted_at "
            "FROM checkpoints ORDER BY id",
        ),
        "pointers": db.rows("SELECT name, checkpoint_id FROM pointers ORDER BY name"),
        "events": db.rows("SELECT id, kind, checkpoint_id, detail FROM events ORDER BY id"),
    }


def reconcile_events(
    db: LedgerClient, attempt_id: int
) -> list[tuple[str, int | None, dict[str, Any]]]:
    """(kind, checkpoint_id, detail) of the events a reconcile of this attempt recorded."""
    out = []
    for kind, checkpoint_id, detail in db.rows(
        "SELECT kind, checkpoint_id, detail FROM events WHERE attempt_id = ? ORDER BY id",
        attempt_id,
    ):
        data = json.loads(detail) if detail else {}
        if data.get("reconcile"):
            out.append((kind, checkpoint_id, data))
    return out


def kinds(report: Any) -> Counter[str]:
    return Counter(a.kind for a in report.actions)


def assert_report_consistent(report: Any) -> None:
    """counts, failures and str() all agree with the list of actions."""
    assert report.counts == dict(Counter(a.kind for a in report.actions))
    assert sum(report.counts.values()) == len(report.actions)
    assert report.failures == [a for a in report.actions if a.kind == "failed"]
    text = str(report)
    if not report.actions:
        assert "nothing to do" in text
        return
    assert "nothing to do" not in text
    for kind, n in report.counts.items():
        assert f"{n} {kind}" in text.splitlines()[0]
    for action in report.actions:
        assert action.path in text
    assert len(text.splitlines()) == 1 + len(report.actions)


def assert_nothing_to_do(mgr: CheckpointManager, db: LedgerClient, *dirs: Path) -> None:
    """A further reconcile reports nothing and changes no row and no file."""
    before_ledger = ledger_snapshot(db)
    before_files = [tree(d) for d in dirs]
    again = mgr.reconcile(verify=True)
    assert again.actions == [], str(again)
    assert again.counts == {}
    assert "nothing to do" in str(again)
    assert ledger_snapshot(db) == before_ledger
    assert [tree(d) for d in dirs] == before_files


def assert_latest_is(mgr: CheckpointManager, step: int, stream: str = "model") -> None:
    """``latest`` of ``stream`` is ``step``, and it loads as saved."""
    latest = mgr.latest(stream)
    assert latest is not None and latest.step == step
    assert torch.equal(mgr.load("latest", stream=stream)["w"], state(step)["w"])


@pytest.fixture
def three(root: Path, save_dir: Path, db_url: str | None) -> Path:
    """A closed run whose model stream holds steps 1, 2 and 3 (latest: 3)."""
    with CheckpointManager(root, db_url=db_url) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, model=state(step))
    return root


# ------------------------------------------------------------------ damage scenarios
# Each takes (db, save_dir) and returns the action kinds reconcile must report.


def damage_pending_after_replace(db: LedgerClient, save_dir: Path) -> Counter[str]:
    """The latest row is still 'pending' with its final and temp file on disk."""
    ident = row_id(db, 3)
    tmp = f"model/.step-000000003.pt.tmp-{ident}"
    (save_dir / tmp).write_bytes(b"half a checkpoint")
    db.execute("UPDATE checkpoints SET state = 'pending', tmp_path = ? WHERE id = ?", tmp, ident)
    return Counter({"rolled_back": 1, "repointed": 1})


def damage_deleting(db: LedgerClient, save_dir: Path) -> Counter[str]:
    db.execute("UPDATE checkpoints SET state = 'deleting' WHERE id = ?", row_id(db, 1))
    return Counter({"deleted": 1})


def damage_lost_latest(db: LedgerClient, save_dir: Path) -> Counter[str]:
    ckpt(save_dir, 3).unlink()
    return Counter({"lost": 1, "repointed": 1})


def damage_lost_old(db: LedgerClient, save_dir: Path) -> Counter[str]:
    ckpt(save_dir, 1).unlink()
    return Counter({"lost": 1})


def damage_truncated_latest(db: LedgerClient, save_dir: Path) -> Counter[str]:
    path = ckpt(save_dir, 3)
    path.write_bytes(path.read_bytes()[:100])
    return Counter({"corrupt": 1, "repointed": 1})


def damage_orphan_temp(db: LedgerClient, save_dir: Path) -> Counter[str]:
    (save_dir / "model" / ".step-000000005.pt.tmp-999").write_bytes(b"partial")
    return Counter({"removed_temp": 1})


def damage_unknown_checkpoint(db: LedgerClient, save_dir: Path) -> Counter[str]:
    (save_dir / "model" / "step-000000077.pt").write_bytes(b"somebody's checkpoint")
    return Counter({"quarantined": 1})


def damage_everything(db: LedgerClient, save_dir: Path) -> Counter[str]:
    expected: Counter[str] = Counter()
    for damage in (
        damage_pending_after_replace,
        damage_orphan_temp,
        damage_unknown_checkpoint,
    ):
        expected += damage(db, save_dir)
    ckpt(save_dir, 2).write_bytes(b"")  # now corrupt; the pointer falls back to step 1
    expected["corrupt"] += 1
    return expected


SCENARIOS = {
    "pending": damage_pending_after_replace,
    "deleting": damage_deleting,
    "lost_latest": damage_lost_latest,
    "lost_old": damage_lost_old,
    "truncated_latest": damage_truncated_latest,
    "orphan_temp": damage_orphan_temp,
    "unknown_checkpoint": damage_unknown_checkpoint,
    "everything": damage_everything,
}


# ------------------------------------------------------------- scenarios, generic checks


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reconcile_at_open_repairs_reports_records_and_is_idempotent(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    scenario: str,
    db: LedgerClient,
) -> None:
    root = three
    expected = SCENARIOS[scenario](db, save_dir)

    mgr = open_manager()
    report = mgr.last_reconcile

    assert kinds(report) == expected, str(report)
    assert report.failures == []
    assert not report.dry_run
    assert_report_consistent(report)
    # every action is an event of the same kind, recorded by this attempt
    recorded = reconcile_events(db, mgr.attempt_id)
    assert Counter(kind for kind, _, _ in recorded) == expected
    assert sorted((k, d["path"]) for k, _, d in recorded) == sorted(
        (a.kind, a.path) for a in report.actions
    )
    # the disk now agrees with the ledger: no temp files, live rows' files exist
    assert not [f for f in files(save_dir) if ".tmp-" in f]
    live = db.rows("SELECT path FROM checkpoints WHERE state IN ('committed', 'pending')")
    assert all((save_dir / p).is_file() for (p,) in live)
    assert not db.rows("SELECT id FROM checkpoints WHERE state IN ('pending', 'deleting')")
    # the latest pointer names a healthy checkpoint that loads
    latest = mgr.latest()
    assert latest is not None and latest.state == "committed"
    assert torch.equal(mgr.load("latest")["w"], state(latest.step)["w"])
    assert_nothing_to_do(mgr, db, root, save_dir)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reconcile_on_demand_matches_the_scenario(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    scenario: str,
    db: LedgerClient,
) -> None:
    mgr = open_manager()
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    expected = SCENARIOS[scenario](db, save_dir)
    events_before = len(reconcile_events(db, mgr.attempt_id))

    report = mgr.reconcile()

    assert kinds(report) == expected, str(report)
    assert_report_consistent(report)
    assert len(reconcile_events(db, mgr.attempt_id)) == events_before + len(report.actions)
    assert_nothing_to_do(mgr, db, root, save_dir)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dry_run_lists_the_actions_but_changes_nothing(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    scenario: str,
    db: LedgerClient,
) -> None:
    mgr = open_manager()
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    expected = SCENARIOS[scenario](db, save_dir)
    ledger_before, files_before = ledger_snapshot(db), tree(root)

    preview = mgr.reconcile(dry_run=True)

    assert preview.dry_run
    assert kinds(preview) == expected, str(preview)
    assert_report_consistent(preview)
    assert "dry run" in str(preview)
    assert ledger_snapshot(db) == ledger_before  # no row, pointer or event changed
    assert tree(root) == files_before  # no file removed, moved or created
    # a second dry run says the same; the real run then does what was announced
    assert [(a.kind, a.path) for a in mgr.reconcile(dry_run=True).actions] == [
        (a.kind, a.path) for a in preview.actions
    ]
    real = mgr.reconcile()
    assert sorted((a.kind, a.path) for a in real.actions) == sorted(
        (a.kind, a.path) for a in preview.actions
    )
    assert mgr.reconcile(dry_run=True).actions == []


def test_clean_run_has_nothing_to_do(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    mgr = open_manager()
    assert mgr.last_reconcile.actions == []
    assert "nothing to do" in str(mgr.last_reconcile)
    assert reconcile_events(db, mgr.attempt_id) == []
    assert mgr.reconcile(dry_run=True).actions == []
    assert_nothing_to_do(mgr, db, three, save_dir)


# ------------------------------------------------------------------------ real crashes

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    import ckptdb.protocol.boundary
    from ckptdb import CheckpointManager
    from helpers import child_app_name

    root, mode, db_url = sys.argv[1], sys.argv[2], sys.argv[3] or None
    os.environ["PGAPPNAME"] = child_app_name(os.getpid())  # see helpers.await_sessions_gone
    mgr = CheckpointManager(root, db_url=db_url)
    real_save = torch.save

    class DieMidWrite:
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, data):
            written = self.f.write(data)
            self.n += written
            if self.n >= 4096:
                os._exit(1)  # power cut: part of the file is on disk
            return written
        def flush(self):
            self.f.flush()

    if mode == "write":
        torch.save = lambda obj, f, *a, **k: real_save(obj, DieMidWrite(f), *a, **k)
    else:
        def die(*args, **kwargs):
            os._exit(1)  # after os.replace + directory fsync, before the commit
        ckptdb.protocol.boundary.Publisher._commit = die
    mgr.save(2, model={"w": torch.arange(200_000, dtype=torch.float32)})
    os._exit(7)  # not reached
    """
)


def run_child(root: Path, mode: str, db_url: str | None) -> tuple[int, int, str]:
    """Run CHILD; returns (pid, exit status, stderr) once its sessions are gone."""
    repo = Path(ckptdb.__file__).resolve().parent.parent
    path = [str(repo), str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, db_url or ""],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            _, err = child.communicate(timeout=50)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    await_sessions_gone(db_url, child.pid)
    return child.pid, child.returncode, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["write", "after_replace"])
def test_process_killed_mid_publication_is_rolled_back_at_reopen(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    mode: str,
    db: LedgerClient,
) -> None:
    with CheckpointManager(root, db_url=db.db_url) as mgr:
        mgr.save(1, model=state(1))
        first = mgr.latest()
    assert first is not None

    pid, status, err = run_child(root, mode, db.db_url)
    assert status == 1, err

    # the crash left exactly what the protocol says it may leave
    (child_attempt,) = db.rows("SELECT id, end_state FROM attempts WHERE pid = ?", pid)
    assert child_attempt[1] == "running"
    ((ident, path, tmp_path),) = db.rows(
        "SELECT id, path, tmp_path FROM checkpoints WHERE state = 'pending'"
    )
    assert path == "model/step-000000002.pt"
    assert tmp_path == f"model/.step-000000002.pt.tmp-{ident}"
    if mode == "write":
        assert (save_dir / tmp_path).stat().st_size >= 4096
        assert not (save_dir / path).exists()
    else:
        assert not (save_dir / tmp_path).exists()
        assert (save_dir / path).stat().st_size > 0

    mgr = open_manager()

    assert [(a.kind, a.path) for a in mgr.last_reconcile.actions] == [("rolled_back", path)]
    assert row_state(db, ident) == "aborted"
    assert db.rows("SELECT end_state FROM attempts WHERE id = ?", child_attempt[0]) == [
        ("crashed",)
    ]
    assert files(save_dir) == ["model/step-000000001.pt"]
    assert not (root / QUARANTINE).exists()
    latest = mgr.latest()
    assert latest == first
    assert torch.equal(mgr.load("latest")["w"], state(1)["w"])
    assert [(k, c) for k, c, _ in reconcile_events(db, mgr.attempt_id)] == [("rolled_back", ident)]
    assert_nothing_to_do(mgr, db, root)
    # and the run goes on: step 2 can be published again under its normal name
    mgr.save(2, model=state(2))
    assert mgr.latest().path == ckpt(save_dir, 2)  # type: ignore[union-attr]


# ------------------------------------------------------------------------ deleting rows


def test_deleting_row_left_by_failed_eviction_is_finished_at_reopen(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    monkeypatch: pytest.MonkeyPatch,
    db: LedgerClient,
) -> None:
    victim = ckpt(save_dir, 1)
    real_unlink = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == victim:
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, *args, **kwargs)

    with CheckpointManager(root, streams={"model": Keep(last=1)}, db_url=db.db_url) as mgr:
        mgr.save(1, model=state(1))
        monkeypatch.setattr(os, "unlink", refuse)
        with pytest.warns(UserWarning, match="step-000000001.pt"):
            mgr.save(2, model=state(2))
        monkeypatch.undo()
    ident = db.rows("SELECT id FROM checkpoints WHERE step = 1")[0][0]
    assert row_state(db, ident) == "deleting"
    assert victim.exists()

    mgr = open_manager()

    assert [(a.kind, a.path) for a in mgr.last_reconcile.actions] == [
        ("deleted", "model/step-000000001.pt")
    ]
    assert not victim.exists()
    assert row_state(db, ident) == "deleted"
    assert db.rows("SELECT deleted_at IS NOT NULL FROM checkpoints WHERE id = ?", ident) == [(1,)]
    assert mgr.latest().step == 2  # type: ignore[union-attr]
    assert [(k, c) for k, c, _ in reconcile_events(db, mgr.attempt_id)] == [("deleted", ident)]
    assert_nothing_to_do(mgr, db, root)


def test_deleting_row_whose_file_is_already_gone_is_marked_deleted(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    ident = row_id(db, 1)
    db.execute("UPDATE checkpoints SET state = 'deleting' WHERE id = ?", ident)
    ckpt(save_dir, 1).unlink()

    mgr = open_manager()

    assert kinds(mgr.last_reconcile) == Counter({"deleted": 1})
    assert row_state(db, ident) == "deleted"
    assert_nothing_to_do(mgr, db, three)


# ------------------------------------------------------------------ lost and corrupt


DAMAGE = {
    "deleted": (lambda p: p.unlink(), "lost"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1]), "corrupt"),
    "grown": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "corrupt"),
    "emptied": (lambda p: p.write_bytes(b""), "corrupt"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_latest_falls_back_to_newest_healthy(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    damage: str,
    db: LedgerClient,
) -> None:
    hurt, expected_state = DAMAGE[damage]
    ident = row_id(db, 3)
    hurt(ckpt(save_dir, 3))

    mgr = open_manager()
    report = mgr.last_reconcile

    assert kinds(report) == Counter({expected_state: 1, "repointed": 1}), str(report)
    (repointed,) = [a for a in report.actions if a.kind == "repointed"]
    assert repointed.path == "latest:model"
    assert row_state(db, ident) == expected_state
    assert db.rows("SELECT error IS NOT NULL FROM checkpoints WHERE id = ?", ident) == [(1,)]
    event_kinds = [k for k, c, _ in reconcile_events(db, mgr.attempt_id) if c == ident]
    assert event_kinds == [expected_state]
    assert mgr.latest().step == 2  # type: ignore[union-attr]
    assert torch.equal(mgr.load("latest")["w"], state(2)["w"])
    assert [c.step for c in mgr.checkpoints()] == [1, 2]
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(3)
    assert_nothing_to_do(mgr, db, three)


def test_same_size_change_is_found_only_with_verify(
    root: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    mgr = open_manager()
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    ident = row_id(db, 3)
    flip_byte(ckpt(save_dir, 3))

    assert mgr.reconcile().actions == []  # size matches; no hashing without verify
    assert row_state(db, ident) == "committed"
    assert mgr.reconcile(verify=True, dry_run=True).counts == {"corrupt": 1, "repointed": 1}
    assert row_state(db, ident) == "committed"

    report = mgr.reconcile(verify=True)

    assert kinds(report) == Counter({"corrupt": 1, "repointed": 1})
    (corrupt,) = [a for a in report.actions if a.kind == "corrupt"]
    assert corrupt.path == "model/step-000000003.pt" and "hash" in corrupt.detail
    assert row_state(db, ident) == "corrupt"
    assert ckpt(save_dir, 3).exists()  # evidence is kept, never deleted
    assert mgr.latest().step == 2  # type: ignore[union-attr]
    assert torch.equal(mgr.load("latest")["w"], state(2)["w"])
    assert_nothing_to_do(mgr, db, root)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_no_healthy_checkpoint_left_means_no_latest(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    damage: str,
    db: LedgerClient,
) -> None:
    for step in (1, 2, 3):
        DAMAGE[damage][0](ckpt(save_dir, step))

    mgr = open_manager()

    assert mgr.last_reconcile.counts == {DAMAGE[damage][1]: 3, "repointed": 1}
    (repointed,) = [a for a in mgr.last_reconcile.actions if a.kind == "repointed"]
    assert repointed.path == "latest:model"
    assert mgr.latest() is None
    assert mgr.checkpoints() == []
    assert db.rows("SELECT * FROM pointers WHERE name = 'latest:model'") == []
    with pytest.raises(CheckpointNotFoundError):
        mgr.load("latest")
    assert_nothing_to_do(mgr, db, three)


def test_an_absent_save_directory_is_refused_not_taken_for_lost_checkpoints(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    db: LedgerClient,
) -> None:
    """The whole save directory missing (a filesystem not mounted yet, a disk moved)
    is not three lost checkpoints: marked lost, latest went to None for good, and a
    job resuming from it started again from scratch. The open is refused, naming
    the directory, with nothing marked; back in place, the run resumes as it was."""
    rows = "SELECT id, state, error FROM checkpoints ORDER BY id"
    before = db.rows(rows), db.rows("SELECT name, checkpoint_id FROM pointers")
    save_dir.rename(tmp_path / "unmounted")
    with pytest.raises(RunDirectoryError, match=r"does not exist.*3 committed") as refused:
        open_manager()
    assert isinstance(refused.value, OSError) and str(save_dir) in str(refused.value)
    assert not save_dir.exists()  # not recreated empty either
    assert (db.rows(rows), db.rows("SELECT name, checkpoint_id FROM pointers")) == before
    (tmp_path / "unmounted").rename(save_dir)
    mgr = open_manager()
    assert mgr.last_reconcile.counts == {}
    assert_latest_is(mgr, 3)


def test_an_empty_save_directory_is_refused_for_its_missing_stream_directories(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    """What an unmounted save directory that is itself a mount point looks like:
    there, and empty. Its stream's directory is what is missing."""
    before = db.rows("SELECT id, state FROM checkpoints ORDER BY id")
    shutil.rmtree(save_dir)
    save_dir.mkdir()
    with pytest.raises(RunDirectoryError, match="a stream directory that does not exist") as no:
        open_manager()
    assert f"{save_dir / 'model'} (3 committed)" in str(no.value)
    assert db.rows("SELECT id, state FROM checkpoints ORDER BY id") == before
    assert os.listdir(save_dir) == []


def take_the_stream_directory_away(save_dir: Path, away: Path, how: str) -> None:
    """The model stream's directory made absent: moved away, or replaced by a link to
    where it was moved and then a link to nowhere, or by a file."""
    (save_dir / "model").rename(away)
    if how == "dangling_link":
        (save_dir / "model").symlink_to(away.parent / "nowhere")
    elif how == "file":
        (save_dir / "model").write_bytes(b"not a directory")


@pytest.mark.parametrize(
    "gone",
    [
        "save_directory",
        "save_directory_a_file",
        "save_directory_a_dangling_link",
        "moved_away",
        "dangling_link",
        "file",
    ],
)
def test_the_directories_the_refusal_names_made_empty_say_the_checkpoints_are_gone(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    gone: str,
) -> None:
    """Following the refusal's advice to the letter marks them lost, in one step,
    whatever is in the way (a link to nowhere, a file)."""
    if gone.startswith("save_directory"):
        shutil.rmtree(save_dir)
        if gone == "save_directory_a_file":
            save_dir.write_bytes(b"not a directory")
        elif gone == "save_directory_a_dangling_link":
            save_dir.symlink_to(tmp_path / "nowhere")
    else:
        take_the_stream_directory_away(save_dir, tmp_path / "away", gone)
    with pytest.raises(RunDirectoryError, match=r"does not exist|do not exist") as no:
        open_manager()
    advice = str(no.value).split("If they are gone for good, make ", 1)[1]
    to_make = advice.split(" an empty directory (parents included; remove a link or a file")[0]
    assert to_make == str(save_dir / "model")
    for directory in [Path(d) for d in to_make.removeprefix("each of ").split(", ")]:
        for in_the_way in [*reversed(directory.parents), directory]:
            if (in_the_way.is_symlink() and not in_the_way.is_dir()) or in_the_way.is_file():
                in_the_way.unlink()  # a link to nowhere, or a file
        directory.mkdir(parents=True)
    mgr = open_manager()
    assert mgr.last_reconcile.counts == {"lost": 3, "repointed": 1}
    assert mgr.latest() is None


@pytest.mark.parametrize("how", ["moved_away", "dangling_link", "file"])
def test_an_absent_stream_directory_is_refused_not_taken_for_lost_checkpoints(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    db: LedgerClient,
    how: str,
) -> None:
    """A stream's directory missing (a link whose target is not mounted, a directory
    moved) is not its checkpoints lost: marked lost, latest went back (here to None),
    a job resuming from it started again, and its first save took the stream on
    without them for good. The open and ``reconcile`` are refused, naming the
    directory and leaving every row, file and the other streams as they were."""
    with open_manager(streams={"model": Keep(last=5), "ema": Keep(last=5)}) as mgr:
        mgr.save(4, ema=state(40))

    def checkpoints_and_pointers() -> tuple[Any, Any]:
        snapshot = ledger_snapshot(db)  # the refused open is an attempt (failed) of its own
        return snapshot["checkpoints"], snapshot["pointers"]

    before_ledger, before_files = checkpoints_and_pointers(), tree(save_dir / "ema")
    take_the_stream_directory_away(save_dir, tmp_path / "away", how)
    with pytest.raises(RunDirectoryError, match="a stream directory that does not exist") as no:
        open_manager()
    message = str(no.value)
    assert isinstance(no.value, OSError)
    assert f"{save_dir / 'model'} (3 committed)" in message
    assert str(save_dir / "ema") not in message
    assert checkpoints_and_pointers() == before_ledger and tree(save_dir / "ema") == before_files
    (save_dir / "model").unlink(missing_ok=True)
    (tmp_path / "away").rename(save_dir / "model")
    mgr = open_manager()
    assert mgr.last_reconcile.counts == {}
    assert_latest_is(mgr, 3)
    assert_nothing_to_do(mgr, db, three)


def test_two_absent_stream_directories_are_named_in_one_refusal(
    three: Path, save_dir: Path, tmp_path: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    with open_manager(streams={"model": Keep(last=5), "ema": Keep(last=5)}) as mgr:
        mgr.save(4, ema=state(40))
    for stream in ("ema", "model"):
        (save_dir / stream).rename(tmp_path / stream)
    with pytest.raises(RunDirectoryError, match="stream directories that do not exist") as no:
        open_manager()
    message = str(no.value)
    assert f"{save_dir / 'ema'} (1 committed), {save_dir / 'model'} (3 committed)" in message
    assert f"make each of {save_dir / 'ema'}, {save_dir / 'model'} an empty directory" in message


def save_framework_named(opener: Callable[..., CheckpointManager], name: str) -> None:
    """Steps 1 and 2 of a keep-all ``model`` stream, under a framework's ``name``
    (formatted with the step)."""
    mgr = opener(streams={"model": Keep(last=None)})
    for step in (1, 2):
        write = functools.partial(torch.save, state(step))
        mgr.save(step, model=External(write, name=name.format(step=step)))
    mgr.close()


@pytest.mark.parametrize(
    "name",
    ["epoch={step}-val/loss={step}.ckpt", "model-epoch={step}/last.ckpt", "run1/ckpt-{step}"],
)
def test_a_framework_named_directory_removed_with_its_checkpoints_is_lost_not_refused(
    save_dir: Path, open_manager: Callable[..., CheckpointManager], name: str
) -> None:
    """A framework's name with a directory of its own (a Lightning ``monitor`` with a
    ``/``, a name that merely starts with the stream's, a parent several names
    share) is not a stream's directory: removed by hand with its checkpoints,
    their rows are lost, and the run still opens."""
    save_framework_named(open_manager, name)
    removed = name.format(step=1).split("/")[0]
    shutil.rmtree(save_dir / removed)
    gone = [step for step in (1, 2) if name.format(step=step).startswith(f"{removed}/")]
    mgr = open_manager(streams={"model": Keep(last=None)})
    assert mgr.last_reconcile.counts == {
        "lost": len(gone),
        **({"repointed": 1} if 2 in gone else {}),
    }
    assert [c.step for c in mgr.checkpoints()] == [s for s in (1, 2) if s not in gone]


def test_a_framework_name_inside_its_streams_directory_is_refused_with_it(
    save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    save_framework_named(open_manager, "model/sub-{step}/last.ckpt")
    (save_dir / "model").rename(save_dir.parent / "away")
    with pytest.raises(RunDirectoryError, match=r"does not exist.*model \(2 committed\)"):
        open_manager(streams={"model": Keep(last=None)})


def test_a_save_directory_of_framework_names_only_is_named_itself_in_the_advice(
    save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    save_framework_named(open_manager, "epoch={step}.ckpt")
    shutil.rmtree(save_dir)
    with pytest.raises(RunDirectoryError, match="2 committed checkpoints") as no:
        open_manager(streams={"model": Keep(last=None)})
    assert f"make {save_dir} an empty directory (parents included;" in str(no.value)
    save_dir.mkdir()
    mgr = open_manager(streams={"model": Keep(last=None)})
    assert mgr.last_reconcile.counts == {"lost": 2, "repointed": 1}


def test_a_stream_directory_that_cannot_be_looked_at_is_a_typed_error_not_lost(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    db: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No permission to look (injected: the tests run as root) is neither there nor
    absent: a RunDirectoryError naming it, nothing marked."""
    before = db.rows("SELECT id, state FROM checkpoints ORDER BY id")
    real_stat, model = os.stat, str(save_dir / "model")

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == model:
            raise PermissionError(13, "Permission denied (injected)", model)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(RunDirectoryError, match=r"cannot look at the directory .*model.*denied"):
        open_manager()
    monkeypatch.undo()
    assert db.rows("SELECT id, state FROM checkpoints ORDER BY id") == before


def test_check_reports_an_absent_stream_directory_instead_of_raising(
    save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1))
    shutil.rmtree(save_dir / "model")
    problems = mgr.check()
    refused = [p for p in problems if p.startswith("reconcile would refuse: ")]
    assert len(refused) == 1 and f"{save_dir / 'model'} (1 committed)" in refused[0]
    assert any("committed but unreadable" in p for p in problems)


def lose_the_stream_directory(save_dir: Path, away: Path, opener: Callable[..., Any]) -> None:
    """Open with the model stream's directory moved away and an empty one made in its
    place on purpose (its rows become lost), then close."""
    (save_dir / "model").rename(away)
    (save_dir / "model").mkdir()
    mgr = opener()
    assert mgr.last_reconcile.counts == {"lost": 3, "repointed": 1} and mgr.latest() is None
    mgr.close()


def test_lost_checkpoints_whose_files_come_back_whole_are_restored(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    db: LedgerClient,
) -> None:
    """A stream's directory moved away and back: its rows were lost for good and latest
    stayed None, with every checkpoint on disk again."""
    lose_the_stream_directory(save_dir, tmp_path / "away", open_manager)
    (tmp_path / "away").rename(save_dir / "model")
    mgr = open_manager()
    assert mgr.last_reconcile.counts == {"restored": 3, "repointed": 1}
    assert [c.step for c in mgr.checkpoints()] == [1, 2, 3]
    assert_latest_is(mgr, 3)
    restored = "SELECT COUNT(*) FROM events WHERE kind = 'restored'"
    assert db.rows(restored) == [(3,)]
    assert db.rows("SELECT DISTINCT error FROM checkpoints") == [(None,)]
    assert_nothing_to_do(mgr, db, three)


def test_lost_checkpoints_stay_lost_once_the_stream_has_saved_since(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
) -> None:
    """The run went on without them (a save since): back, they would jump ahead of it."""
    lose_the_stream_directory(save_dir, tmp_path / "away", open_manager)
    mgr = open_manager()
    mgr.save(4, model=state(4))
    mgr.close()
    for step in (1, 2, 3):
        (tmp_path / "away" / ckpt(save_dir, step).name).rename(ckpt(save_dir, step))
    mgr = open_manager()
    assert "restored" not in mgr.last_reconcile.counts
    assert [c.step for c in mgr.checkpoints()] == [4]
    assert mgr.latest() is not None and mgr.latest().step == 4


def test_a_lost_checkpoint_back_with_other_bytes_stays_lost(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
) -> None:
    """Same size, one byte different: not the checkpoint that was committed."""
    lose_the_stream_directory(save_dir, tmp_path / "away", open_manager)
    flip_byte(tmp_path / "away" / ckpt(save_dir, 3).name)
    (tmp_path / "away").rename(save_dir / "model")
    mgr = open_manager()
    assert mgr.last_reconcile.counts == {"restored": 2, "repointed": 1}
    assert mgr.latest() is not None and mgr.latest().step == 2


def test_a_store_that_cannot_answer_leaves_lost_rows_lost_and_says_so(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Looking for a lost row's file again is not worth failing the open: an error
    there (an object store's, after retries) is reported with the path."""
    lose_the_stream_directory(save_dir, tmp_path / "away", open_manager)
    (tmp_path / "away").rename(save_dir / "model")

    def unavailable(_store: Any, rel: str) -> bool:
        raise ObjectStoreError(f"HeadObject {rel}: 503 Slow Down")

    monkeypatch.setattr(LocalStore, "exists", unavailable)
    with pytest.warns(UserWarning, match="step-000000003.pt.*503 Slow Down"):
        mgr = open_manager()
    assert mgr.last_reconcile.counts == {"failed": 3}
    assert mgr.latest() is None
    mgr.close()
    monkeypatch.undo()
    assert open_manager().last_reconcile.counts == {"restored": 3, "repointed": 1}


def test_a_dry_run_lists_the_restores_and_changes_nothing(
    three: Path,
    save_dir: Path,
    tmp_path: Path,
    open_manager: Callable[..., CheckpointManager],
    db: LedgerClient,
) -> None:
    lose_the_stream_directory(save_dir, tmp_path / "away", open_manager)
    (tmp_path / "away").rename(save_dir / "model")
    before = ledger_snapshot(db)
    mgr = open_manager(maintenance=True)
    report = mgr.reconcile(dry_run=True)
    assert report.counts == {"restored": 3, "repointed": 1}
    assert ledger_snapshot(db)["checkpoints"] == before["checkpoints"]
    assert ledger_snapshot(db)["pointers"] == before["pointers"]


def test_fallback_is_per_stream(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    streams: dict[str, Any],
    db_url: str | None,
) -> None:
    with CheckpointManager(root, streams=streams, db_url=db_url) as mgr:
        for step, loss in ((1, 0.5), (2, 0.4), (3, 0.3)):
            mgr.save(
                step,
                metrics={"val_loss": loss},
                model=state(step),
                ema=state(-step),
                best=state(step),
            )
    ckpt(save_dir, 3, "model").unlink()

    mgr = open_manager(streams=streams)

    assert kinds(mgr.last_reconcile) == Counter({"lost": 1, "repointed": 1})
    assert mgr.latest("model").step == 2  # type: ignore[union-attr]
    assert mgr.latest("ema").step == 3  # type: ignore[union-attr]
    assert [c.step for c in mgr.best("best")] == [3, 2]
    assert torch.equal(mgr.load("latest", stream="ema")["w"], state(-3)["w"])


# ------------------------------------------------------------ files that no row owns


@pytest.fixture(params=["default", "outside_root", "root_itself"])
def layout(request: pytest.FixtureRequest, tmp_path: Path, root: Path) -> dict[str, Any]:
    """Where checkpoint files go: <root>/checkpoints, another directory, or the root."""
    if request.param == "default":
        return {"save_dir": root / "checkpoints", "kwargs": {}}
    target = tmp_path / "ckpts" if request.param == "outside_root" else root
    return {"save_dir": target, "kwargs": {"save_dir": target}}


UNKNOWN = ["step-000000077.pt", "step-000000004.v7.pt", "step-1234567890.pt"]


@pytest.mark.parametrize(
    ("backend", "name"),
    on_both_backends(UNKNOWN, postgres=lambda name: name == UNKNOWN[0]),
    indirect=["backend"],
)
def test_unknown_checkpoint_is_quarantined_with_content(
    root: Path,
    layout: dict[str, Any],
    open_manager: Callable[..., CheckpointManager],
    name: str,
    db: LedgerClient,
) -> None:
    sdir = layout["save_dir"]
    with CheckpointManager(root, db_url=db.db_url, **layout["kwargs"]) as mgr:
        mgr.save(1, model=state(1))
    stray = sdir / "model" / name
    content = os.urandom(300)
    stray.write_bytes(content)

    mgr = open_manager(**layout["kwargs"])

    assert [(a.kind, a.path) for a in mgr.last_reconcile.actions] == [
        ("quarantined", f"model/{name}")
    ]
    assert not stray.exists()
    moved = root / QUARANTINE / "model" / name
    assert moved.read_bytes() == content
    assert str(moved) in mgr.last_reconcile.actions[0].detail
    assert files(sdir / "model") == ["step-000000001.pt"]
    assert_nothing_to_do(mgr, db, root, sdir)


def test_quarantine_never_overwrites_an_earlier_quarantined_file(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    stray = save_dir / "model" / "step-000000077.pt"
    stray.write_bytes(b"first")
    open_manager().close()
    stray.write_bytes(b"second")

    mgr = open_manager()

    assert kinds(mgr.last_reconcile) == Counter({"quarantined": 1})
    contents = sorted(p.read_bytes() for p in (three / QUARANTINE / "model").iterdir())
    assert contents == [b"first", b"second"]


ORPHANS = [".step-000000005.pt.tmp-999", ".step-000000004.v7.pt.tmp-12"]


@pytest.mark.parametrize(
    ("backend", "name"),
    on_both_backends(ORPHANS, postgres=lambda name: name == ORPHANS[0]),
    indirect=["backend"],
)
def test_orphan_temp_file_is_removed(
    root: Path,
    layout: dict[str, Any],
    open_manager: Callable[..., CheckpointManager],
    name: str,
    db: LedgerClient,
) -> None:
    sdir = layout["save_dir"]
    with CheckpointManager(root, db_url=db.db_url, **layout["kwargs"]) as mgr:
        mgr.save(1, model=state(1))
    (sdir / "model" / name).write_bytes(b"partial")

    mgr = open_manager(**layout["kwargs"])

    assert [(a.kind, a.path) for a in mgr.last_reconcile.actions] == [
        ("removed_temp", f"model/{name}")
    ]
    assert files(sdir / "model") == ["step-000000001.pt"]
    assert not (root / QUARANTINE).exists()
    assert_nothing_to_do(mgr, db, root, sdir)


UNTOUCHED = [
    "notes.txt",
    "step-1.pt",
    "step-000000001.pt.bak",
    "step-000000001.ptx",
    "model.pt",
    ".step-000000005.pt.tmp-",
    ".step-000000005.pt.tmp-abc",
    "step-000000009.v.pt",
]


@pytest.mark.parametrize(
    ("backend", "name"),
    on_both_backends(UNTOUCHED, postgres=lambda name: name == "step-000000001.pt.bak"),
    indirect=["backend"],
)
def test_files_not_in_our_naming_are_untouched(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager], name: str
) -> None:
    foreign = save_dir / "model" / name
    foreign.write_bytes(b"user data")
    top_level = save_dir / "README"
    top_level.write_bytes(b"top level")
    before = tree(three)

    mgr = open_manager()

    assert mgr.last_reconcile.actions == [], str(mgr.last_reconcile)
    assert foreign.read_bytes() == b"user data"
    assert top_level.read_bytes() == b"top level"
    assert not (three / QUARANTINE).exists()
    after = tree(three)
    assert {k: v for k, v in after.items() if not k.startswith("ckptdb.")} == {
        k: v for k, v in before.items() if not k.startswith("ckptdb.")
    }


def test_directories_named_like_checkpoints_are_untouched(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    weird = save_dir / "model" / "step-000000088.pt"
    weird.mkdir()
    (weird / "inside.txt").write_bytes(b"x")
    (save_dir / "model" / ".step-000000089.pt.tmp-4").mkdir()

    mgr = open_manager()

    assert mgr.last_reconcile.actions == []
    assert (weird / "inside.txt").read_bytes() == b"x"
    assert (save_dir / "model" / ".step-000000089.pt.tmp-4").is_dir()


# ----------------------------------------------------------------------------- safety


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the run that reconcile must never change."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "step-000000050.pt").write_bytes(b"precious 50")
    (path / "step-000000077.pt").write_bytes(b"precious 77")
    (path / ".step-000000005.pt.tmp-999").write_bytes(b"precious tmp")
    (path / "notes.txt").write_bytes(b"precious notes")
    return path


@pytest.mark.parametrize(
    ("backend", "link_name"),
    on_both_backends(
        ["step-000000050.pt", ".step-000000051.pt.tmp-5"],
        postgres=lambda name: name == "step-000000050.pt",
    ),
    indirect=["backend"],
)
def test_symlink_to_outside_file_is_not_followed(
    three: Path,
    save_dir: Path,
    outside: Path,
    open_manager: Callable[..., CheckpointManager],
    link_name: str,
) -> None:
    before = tree(outside)
    (save_dir / "model" / link_name).symlink_to(outside / "step-000000050.pt")

    mgr = open_manager()
    mgr.reconcile(verify=True)

    assert tree(outside) == before
    assert (outside / "step-000000050.pt").read_bytes() == b"precious 50"
    assert (
        not (three / QUARANTINE / "model" / "step-000000050.pt").is_file()
        or (three / QUARANTINE / "model" / "step-000000050.pt").is_symlink()
    )


def test_a_stream_directory_linked_to_a_sibling_inside_is_reconciled_through_its_link(
    save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    """``model`` a link to ``model_v2`` beside it: the saves go through the link (it stays
    inside), the rows name ``model/...``; the scan listed the files under ``model_v2``,
    found no rows for them and quarantined every checkpoint of the stream at reopen."""
    save_dir.mkdir(parents=True)
    (save_dir / "model_v2").mkdir()
    (save_dir / "model").symlink_to("model_v2", target_is_directory=True)
    mgr = open_manager(streams={"model": Keep(last=None)})
    for step in (1, 2):
        mgr.save(step, model=state(step))
    (save_dir / "model_v2" / ".step-000000003.pt.tmp-99").write_bytes(b"left by a crash")
    mgr.close()

    mgr = open_manager()
    assert mgr.last_reconcile.counts == {"removed_temp": 1}
    assert sorted(p.name for p in (save_dir / "model_v2").iterdir()) == [
        "step-000000001.pt",
        "step-000000002.pt",
    ]
    assert torch.equal(mgr.load("latest")["w"], state(2)["w"])
    assert db.rows("SELECT step FROM checkpoints WHERE state = 'committed' ORDER BY step") == [
        (1,),
        (2,),
    ]


def test_stream_directory_symlinked_outside_is_not_entered(
    three: Path, save_dir: Path, outside: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    before = tree(outside)
    (save_dir / "ext").symlink_to(outside, target_is_directory=True)

    mgr = open_manager()
    dry = mgr.reconcile(dry_run=True)
    real = mgr.reconcile()

    for report in (mgr.last_reconcile, dry, real):
        assert not [a for a in report.actions if "ext" in a.path], str(report)
    assert tree(outside) == before
    assert not (three / QUARANTINE).exists()


def _outside_paths(save_dir: Path, outside: Path) -> dict[str, tuple[str, Path]]:
    """name -> (path as stored in the ledger, the outside file it designates)."""
    return {
        "dotdot": (
            os.path.relpath(outside / "step-000000050.pt", save_dir),
            outside / "step-000000050.pt",
        ),
        "dotdot_literal": ("../../outside/step-000000077.pt", outside / "step-000000077.pt"),
        "absolute": (str(outside / "notes.txt"), outside / "notes.txt"),
        "through_symlinked_dir": ("linked/step-000000077.pt", outside / "step-000000077.pt"),
    }


OUTSIDE_KINDS = ["dotdot", "dotdot_literal", "absolute", "through_symlinked_dir"]
# How a path leads outside is path logic, the same whichever ledger stored it: on
# PostgreSQL one kind.
OUTSIDE_CASES = on_both_backends(OUTSIDE_KINDS, postgres=lambda where: where == "dotdot")


@pytest.mark.parametrize(("backend", "where"), OUTSIDE_CASES, indirect=["backend"])
@pytest.mark.parametrize("row_state_", ["deleting", "pending"])
def test_row_pointing_outside_is_refused(
    root: Path,
    save_dir: Path,
    outside: Path,
    open_manager: Callable[..., CheckpointManager],
    where: str,
    row_state_: str,
    db: LedgerClient,
) -> None:
    mgr = open_manager()
    for step in (1, 2):
        mgr.save(step, model=state(step))
    (save_dir / "linked").symlink_to(outside, target_is_directory=True)
    stored, target = _outside_paths(save_dir, outside)[where]
    assert (save_dir / stored).resolve() == target.resolve()  # the row really designates it
    before = tree(outside)
    ident = row_id(db, 1)
    ckpt(save_dir, 1).unlink()  # its own file is gone; only the outside one is named
    db.execute(
        "UPDATE checkpoints SET state = ?, path = ?, tmp_path = ? WHERE id = ?",
        row_state_,
        stored,
        stored if row_state_ == "pending" else None,
        ident,
    )
    ledger_before = db.rows("SELECT state, path, tmp_path FROM checkpoints WHERE id = ?", ident)

    with pytest.warns(UserWarning, match="outside|step-0000000|notes"):
        report = mgr.reconcile()

    assert tree(outside) == before
    assert target.exists()
    assert [(a.kind, a.path) for a in report.failures] == [("failed", stored)]
    assert report.counts == {"failed": 1}
    assert_report_consistent(report)
    assert db.rows("SELECT state, path, tmp_path FROM checkpoints WHERE id = ?", ident) == (
        ledger_before
    )
    assert ("failed", ident) in [(k, c) for k, c, _ in reconcile_events(db, mgr.attempt_id)]
    assert mgr.latest().step == 2  # type: ignore[union-attr]

    # at the next open the refusal holds too
    mgr.close()
    with pytest.warns(UserWarning):
        again = open_manager()
    assert again.last_reconcile.counts == {"failed": 1}
    assert tree(outside) == before


@pytest.mark.parametrize("where", ["dotdot", "dotdot_literal", "through_symlinked_dir"])
def test_a_committed_row_pointing_outside_is_not_measured_there(
    save_dir: Path,
    outside: Path,
    open_manager: Callable[..., CheckpointManager],
    where: str,
    db: LedgerClient,
) -> None:
    """Reconcile measures every committed file by its text (one confinement per
    directory, then joins): a row whose name leads out of the save directory is
    still refused, even when a file of exactly its size waits out there."""
    mgr = open_manager()
    for step in (1, 2):
        mgr.save(step, model=state(step))
    (save_dir / "linked").symlink_to(outside, target_is_directory=True)
    stored, target = _outside_paths(save_dir, outside)[where]
    ident = row_id(db, 1)
    size = target.stat().st_size
    db.execute("UPDATE checkpoints SET path = ?, size = ? WHERE id = ?", stored, size, ident)
    report = mgr.reconcile()
    assert [(a.kind, a.path) for a in report.actions if a.checkpoint_id == ident] == [
        ("lost", stored)
    ]
    assert "outside" in next(a.detail for a in report.actions if a.checkpoint_id == ident)
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", ident) == [("lost",)]
    assert target.read_bytes().startswith(b"precious")


@pytest.mark.parametrize("enabled", [True, False])
def test_reconcile_leaves_garbage_collection_as_it_found_it(
    open_manager: Callable[..., CheckpointManager], enabled: bool
) -> None:
    """A pass pauses cyclic GC (100k rows made it walk the process again and again);
    afterwards, even after a failed pass, it is on or off as it was before."""
    mgr = open_manager()
    mgr.save(1, model=state(1))
    seen: list[bool] = []
    real = mgr._ctx.store.list_ours

    def listing() -> Any:
        seen.append(gc.isenabled())
        return real()

    mgr._ctx.store.list_ours = listing  # type: ignore[method-assign]
    (gc.enable if enabled else gc.disable)()
    try:
        mgr.reconcile()
        assert seen == [False] and gc.isenabled() is enabled

        def broken() -> Any:
            raise OSError(5, "listing failed")

        mgr._ctx.store.list_ours = broken  # type: ignore[method-assign]
        with pytest.raises(OSError, match="listing failed"):
            mgr.reconcile()
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_a_committed_file_replaced_by_a_link_is_measured_through_it(
    save_dir: Path, open_manager: Callable[..., CheckpointManager], db: LedgerClient
) -> None:
    """The size check follows a link at the file's own name, as a load's read
    would (one lstat, then a stat only for a link), and a dangling link is lost."""
    mgr = open_manager()
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    copy = save_dir / "copy-of-1.bin"
    copy.write_bytes(ckpt(save_dir, 1).read_bytes())
    ckpt(save_dir, 1).unlink()
    ckpt(save_dir, 1).symlink_to(copy)
    ckpt(save_dir, 2).unlink()
    ckpt(save_dir, 2).symlink_to(save_dir / "nowhere.bin")
    report = mgr.reconcile()
    assert report.counts == {"lost": 1}
    assert db.rows("SELECT step, state FROM checkpoints ORDER BY step") == [
        (1, "committed"),
        (2, "lost"),
        (3, "committed"),
    ]


@pytest.mark.parametrize(("backend", "where"), OUTSIDE_CASES, indirect=["backend"])
def test_dry_run_does_not_promise_to_delete_outside_files(
    root: Path,
    save_dir: Path,
    outside: Path,
    open_manager: Callable[..., CheckpointManager],
    where: str,
    db: LedgerClient,
) -> None:
    """A dry run lists what the real run would do; the real run refuses outside paths."""
    mgr = open_manager()
    mgr.save(1, model=state(1))
    mgr.save(2, model=state(2))
    (save_dir / "linked").symlink_to(outside, target_is_directory=True)
    stored, _ = _outside_paths(save_dir, outside)[where]
    ckpt(save_dir, 1).unlink()
    db.execute(
        "UPDATE checkpoints SET state = 'deleting', path = ? WHERE id = ?",
        stored,
        row_id(db, 1),
    )

    preview = mgr.reconcile(dry_run=True)

    assert not [a for a in preview.actions if a.kind == "deleted"], str(preview)
    with pytest.warns(UserWarning):
        real = mgr.reconcile()
    assert [(a.kind, a.path) for a in preview.actions] == [(a.kind, a.path) for a in real.actions]


@pytest.mark.parametrize("row_state_", ["pending", "deleting", "committed"])
def test_row_file_replaced_by_symlink_never_touches_the_target(
    three: Path,
    save_dir: Path,
    outside: Path,
    open_manager: Callable[..., CheckpointManager],
    row_state_: str,
    db: LedgerClient,
) -> None:
    before = tree(outside)
    ident = row_id(db, 2)
    link = ckpt(save_dir, 2)
    link.unlink()
    link.symlink_to(outside / "step-000000050.pt")
    db.execute("UPDATE checkpoints SET state = ? WHERE id = ?", row_state_, ident)

    mgr = open_manager()
    mgr.reconcile(verify=True)

    assert tree(outside) == before
    if row_state_ != "committed":
        # removing the entry removed the link, not what it points at
        assert not link.is_symlink()
        assert row_state(db, ident) == {"pending": "aborted", "deleting": "deleted"}[row_state_]
    else:
        assert row_state(db, ident) == "corrupt"


def test_ledger_files_and_quarantine_are_never_scanned_as_streams(
    root: Path, open_manager: Callable[..., CheckpointManager], db_url: str | None
) -> None:
    """With save_dir = root, ckptdb.* entries live beside the stream directories
    (the quarantine; with a SQLite ledger its files and the lock too)."""
    with CheckpointManager(root, save_dir=root, db_url=db_url) as mgr:
        mgr.save(1, model=state(1))
    (root / "model" / "step-000000077.pt").write_bytes(b"stray")
    open_manager(save_dir=root).close()
    assert (root / QUARANTINE / "model" / "step-000000077.pt").read_bytes() == b"stray"

    mgr = open_manager(save_dir=root)

    assert mgr.last_reconcile.actions == []
    assert (root / QUARANTINE / "model" / "step-000000077.pt").read_bytes() == b"stray"
    if db_url is None:
        assert (root / "ckptdb.sqlite").exists()


# ------------------------------------------------------------------- failing repairs


@pytest.fixture
def refuse_unlink(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """refuse(path): make os.unlink of exactly that path fail with EACCES."""
    real_unlink = os.unlink
    refused: set[str] = set()

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.abspath(path) in refused:
            raise PermissionError(13, "Permission denied", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    yield lambda path: refused.add(os.path.abspath(path))
    refused.clear()


def _pending_leftover(db: LedgerClient, save_dir: Path) -> tuple[int | None, Path, str]:
    damage_pending_after_replace(db, save_dir)
    ident = db.rows("SELECT id FROM checkpoints WHERE state = 'pending'")[0][0]
    return ident, ckpt(save_dir, 3), "rolled_back"


def _pending_tmp_leftover(db: LedgerClient, save_dir: Path) -> tuple[int | None, Path, str]:
    damage_pending_after_replace(db, save_dir)
    ((ident, tmp),) = db.rows("SELECT id, tmp_path FROM checkpoints WHERE state = 'pending'")
    return ident, save_dir / tmp, "rolled_back"


def _deleting_row(db: LedgerClient, save_dir: Path) -> tuple[int | None, Path, str]:
    ident = row_id(db, 1)
    damage_deleting(db, save_dir)
    return ident, ckpt(save_dir, 1), "deleted"


def _orphan_temp(db: LedgerClient, save_dir: Path) -> tuple[int | None, Path, str]:
    damage_orphan_temp(db, save_dir)
    return None, save_dir / "model" / ".step-000000005.pt.tmp-999", "removed_temp"


UNLINK_TARGETS = {
    "pending_final": _pending_leftover,
    "pending_tmp": _pending_tmp_leftover,
    "deleting": _deleting_row,
    "orphan_temp": _orphan_temp,
}


@pytest.mark.parametrize("target", UNLINK_TARGETS)
def test_unlink_failure_is_reported_warned_recorded_and_retried(
    root: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    refuse_unlink: Callable[[Path], None],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    db: LedgerClient,
) -> None:
    mgr = open_manager()
    for step in (1, 2, 3):
        mgr.save(step, model=state(step))
    ident, path, success_kind = UNLINK_TARGETS[target](db, save_dir)
    rel = str(path.relative_to(save_dir))
    state_before = row_state(db, ident) if ident is not None else None
    refuse_unlink(path)

    with pytest.warns(UserWarning, match=path.name):
        report = mgr.reconcile()

    assert [a.path for a in report.failures] == [rel]
    assert "PermissionError" in report.failures[0].detail
    assert success_kind not in report.counts
    assert_report_consistent(report)
    assert path.exists()
    if ident is not None:
        assert row_state(db, ident) == state_before  # left for the next reconcile
    recorded = reconcile_events(db, mgr.attempt_id)
    assert ("failed", rel) in [(k, d["path"]) for k, _, d in recorded]

    monkeypatch.undo()  # the disk is writable again
    retry = mgr.reconcile()

    assert success_kind in retry.counts, str(retry)
    assert retry.failures == []
    assert not path.exists()
    if ident is not None:
        assert (
            row_state(db, ident) == {"rolled_back": "aborted", "deleted": "deleted"}[success_kind]
        )
    assert mgr.latest() is not None
    assert_nothing_to_do(mgr, db, root)


def test_unlink_failure_at_open_is_retried_at_next_open(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    refuse_unlink: Callable[[Path], None],
    monkeypatch: pytest.MonkeyPatch,
    db: LedgerClient,
) -> None:
    ident = row_id(db, 1)
    db.execute("UPDATE checkpoints SET state = 'deleting' WHERE id = ?", ident)
    refuse_unlink(ckpt(save_dir, 1))

    with pytest.warns(UserWarning, match="step-000000001.pt"):
        first = open_manager()
    assert first.last_reconcile.counts == {"failed": 1}
    assert row_state(db, ident) == "deleting"
    first.close()
    monkeypatch.undo()

    second = open_manager()

    assert second.last_reconcile.counts == {"deleted": 1}
    assert row_state(db, ident) == "deleted"
    assert not ckpt(save_dir, 1).exists()


def test_quarantine_move_failure_is_a_failed_action_and_retried(
    three: Path,
    save_dir: Path,
    open_manager: Callable[..., CheckpointManager],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = open_manager()
    stray = save_dir / "model" / "step-000000077.pt"
    stray.write_bytes(b"stray")
    real_replace = os.replace

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(src) == stray:
            raise PermissionError(13, "Permission denied", str(src))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.warns(UserWarning, match="step-000000077.pt"):
        report = mgr.reconcile()
    assert [(a.kind, a.path) for a in report.actions] == [("failed", "model/step-000000077.pt")]
    assert stray.read_bytes() == b"stray"
    monkeypatch.undo()

    retry = mgr.reconcile()

    assert kinds(retry) == Counter({"quarantined": 1})
    assert (three / QUARANTINE / "model" / "step-000000077.pt").read_bytes() == b"stray"


def test_unusable_quarantine_folder_is_a_failed_action_not_a_crash(
    three: Path, save_dir: Path, open_manager: Callable[..., CheckpointManager]
) -> None:
    """The quarantine folder cannot be created: reconcile reports it and goes on."""
    (three / QUARANTINE).write_bytes(b"a file where the folder should be")
    stray = save_dir / "model" / "step-000000077.pt"
    stray.write_bytes(b"stray")
    ckpt(save_dir, 3).unlink()  # another repair in the same reconcile

    with pytest.warns(UserWarning, match="step-000000077.pt"):
        mgr = open_manager()

    report = mgr.last_reconcile
    assert report.counts == {"failed": 1, "lost": 1, "repointed": 1}, str(report)
    assert stray.read_bytes() == b"stray"
    assert mgr.latest().step == 2  # type: ignore[union-attr]


def test_reconcile_failing_at_open_releases_the_writer_lock(
    three: Path,
    open_manager: Callable[..., CheckpointManager],
    monkeypatch: pytest.MonkeyPatch,
    db_url: str | None,
) -> None:
    def broken(self: Reconciler, **kwargs: Any) -> None:
        raise RuntimeError("reconcile blew up")

    monkeypatch.setattr(Reconciler, "run", broken)
    with pytest.raises(RuntimeError, match="blew up") as excinfo:
        CheckpointManager(three, db_url=db_url)
    monkeypatch.undo()

    # the failed manager may still be referenced (here by the traceback): the
    # lock must already be free, or the caller can never retry in this process
    try:
        mgr = open_manager()
    except LedgerLockedError as exc:  # pragma: no cover - the bug this guards against
        pytest.fail(f"failed open kept the writer lock: {exc}")
    assert excinfo.value is not None
    assert mgr.latest().step == 3  # type: ignore[union-attr]
