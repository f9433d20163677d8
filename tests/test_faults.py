"""The I/O fault matrix: every fault site, once (transient) and on every call.

Sites: the checkpoint file's write (ENOSPC, EIO, injected into the real file
object under ckptdb's hashing writer), the file fsync (EIO), ``os.replace``
(EACCES, EXDEV), the directory fsync (EIO, also while a stream directory is
being created), the intent and the commit transactions (a real "database is
locked" from another connection's ``BEGIN IMMEDIATE``, and an injected
``OperationalError``), the ledger right after the commit, the unlink of an
evicted file after the commit, the unlink of a rollback leftover, and faults
during reconcile and during load.

Each fault is either *transient* (the site fails once, then works) or
*persistent* (it fails on every call until the test removes it). Expected:
the documented typed error naming the phase and the path; the committed
ledger state (committed rows and latest pointers) unchanged; nothing left
behind on disk, or, when the cleanup itself fails, the leftover recorded for
reconcile; after a transient fault the next save succeeds; after a persistent
one every save fails the same way and, once the fault is gone, the next save
succeeds and ``reconcile()`` / ``check()`` are clean.

``tests/test_protocol.py`` already runs a transient fault at the first or the
second stream of a boundary for each pre-commit phase (``HashingWriter.write``,
``torch.save`` raising, a failing ``set_latest``); this file adds the
persistent mode, the real file object, real SQLite locks, the intent
transaction, post-commit faults, reconcile and load.
"""

from __future__ import annotations

import builtins
import errno
import os
import sqlite3
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
import torch
from helpers import boundary, db_locked, digest, disk, files, patch_unpickle, rows, state

import ckptdb.ledger.boundary_rows
import ckptdb.ledger.engine
import ckptdb.ledger.rows
import ckptdb.protocol.disposal
import ckptdb.storage
import ckptdb.storage.files
import ckptdb.storage.heldfile
from ckptdb import CheckpointManager, CleanupWarning, Keep, faults
from ckptdb.errors import (
    CheckpointNotFoundError,
    CkptDBError,
    CorruptCheckpointError,
    DatabaseError,
    LedgerUnavailableError,
    PublishError,
    RunDirectoryError,
)
from ckptdb.protocol.boundary import Publisher
from ckptdb.storage import CHECKPOINT_NAME, TEMP_NAME

Opener = Callable[..., CheckpointManager]

MODES = ("transient", "persistent")
PERSISTENT_TRIES = 3  # a persistent fault must fail this many saves in a row, identically
STEP = 30  # the boundary the fault hits (the warm run holds steps 10 and 20)
BOUNDARY = ("model", "ema", "best")  # payload order: the first stream's file is hit first
BUSY_TIMEOUT_MS = 25  # how long ckptdb waits on a locked ledger in these tests


# --------------------------------------------------------------------- helpers


def temp_files(directory: Path) -> list[str]:
    return [name for name in files(directory) if TEMP_NAME.fullmatch(Path(name).name)]


def committed_state(root: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The visible ledger: committed rows (with size and hash) and the latest pointers."""
    committed = rows(
        root,
        "SELECT id, stream, step, path, size, hash, metric FROM checkpoints "
        "WHERE state = 'committed' ORDER BY id",
    )
    pointers = rows(root, "SELECT name, checkpoint_id FROM pointers ORDER BY name")
    return committed, pointers


def ledger_dump(root: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table."""
    tables = [
        name
        for (name,) in rows(root, "SELECT name FROM sqlite_master WHERE type = 'table'")
        if not name.startswith("sqlite_")
    ]
    return {t: sorted(rows(root, f'SELECT * FROM "{t}"'), key=repr) for t in tables}


def checkpoint_rows(root: Path) -> list[tuple[Any, ...]]:
    return rows(root, "SELECT id, stream, step, state, path, tmp_path FROM checkpoints ORDER BY id")


def max_checkpoint_id(root: Path) -> int:
    return int(rows(root, "SELECT COALESCE(MAX(id), 0) FROM checkpoints")[0][0])


def events(root: Path, kind: str) -> list[tuple[Any, ...]]:
    return rows(
        root, "SELECT step, checkpoint_id, detail FROM events WHERE kind = ? ORDER BY id", kind
    )


def os_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def caught_cleanup_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CleanupWarning)]


def assert_clean(mgr: CheckpointManager) -> None:
    """Nothing left to repair and every invariant holds."""
    report = mgr.reconcile()
    assert report.actions == [], str(report)
    assert mgr.check() == []
    assert temp_files(mgr.save_dir) == []


class Injector:
    """Decides when a fault site fails: once (transient) or on every call (persistent)."""

    def __init__(self, mode: str) -> None:
        assert mode in MODES
        self.mode = mode
        self.active = True
        self.injected: list[BaseException] = []

    @property
    def fired(self) -> int:
        return len(self.injected)

    def due(self) -> bool:
        if not self.active:
            return False
        return self.mode == "persistent" or not self.injected

    def fire(self, exc: BaseException) -> BaseException:
        self.injected.append(exc)
        return exc

    def remove(self) -> None:
        self.active = False


class LedgerLock:
    """A second connection's write transaction on the ledger, as another writer holds it."""

    def __init__(self, root: Path) -> None:
        self.path = root / "ckptdb.sqlite"
        self.con: sqlite3.Connection | None = None

    @property
    def held(self) -> bool:
        return self.con is not None

    def acquire(self) -> None:
        if self.con is None:
            con = sqlite3.connect(self.path, isolation_level=None, timeout=5)
            con.execute("BEGIN IMMEDIATE")
            self.con = con

    def release(self) -> None:
        if self.con is not None:
            con, self.con = self.con, None
            con.execute("ROLLBACK")
            con.close()


@pytest.fixture(autouse=True)
def _short_busy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Managers opened by these tests give up on a locked ledger after a few ms."""
    monkeypatch.setattr(ckptdb.ledger.engine, "SQLITE_BUSY_TIMEOUT_MS", BUSY_TIMEOUT_MS)


@pytest.fixture
def ledger_lock(root: Path) -> Iterator[LedgerLock]:
    lock = LedgerLock(root)
    yield lock
    lock.release()


@pytest.fixture
def fault_hook() -> Iterator[Callable[[Callable[[str], None]], None]]:
    """Install a ckptdb.faults hook for the test (removed at teardown)."""
    previous = faults.set_hook(None)

    def install(hook: Callable[[str], None]) -> None:
        faults.set_hook(hook)

    yield install
    faults.set_hook(previous)


# ------------------------------------------------------------- fault installers


@dataclass
class Ctx:
    """What an installer may need besides the injector."""

    monkeypatch: pytest.MonkeyPatch
    lock: LedgerLock
    hook: Callable[[Callable[[str], None]], None]


class FaultyFile:
    """The real file under ckptdb's ``HashingWriter``; its ``write`` fails when due.

    ``after_bytes`` lets some bytes reach the disk first (a partial file), as a
    full disk does: a write that crosses ``after_bytes`` is short (only the bytes
    before it are written), and the next one fails. ``HashingWriter`` gathers a
    small file's writes into one, so the partial file comes from that short write.
    """

    def __init__(self, raw: Any, inj: Injector, code: int, after_bytes: int) -> None:
        self._raw, self._inj, self._code, self._after = raw, inj, code, after_bytes
        self.written = 0

    def write(self, data: Any) -> int:
        if self.written >= self._after and self._inj.due():
            raise self._inj.fire(os_error(self._code))
        view = memoryview(data)
        room = self._after - self.written
        if self._inj.due() and 0 < room < view.nbytes:
            view = view[:room]  # the short write of a disk about to be full
        n: int = self._raw.write(view)
        self.written += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def install_file_write(code: int, after_bytes: int) -> Callable[[Injector, Ctx], None]:
    def install(inj: Injector, ctx: Ctx) -> None:
        real = torch.save

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(f, ckptdb.storage.HashingWriter):
                f._file = FaultyFile(f._file, inj, code, after_bytes)
            real(obj, f, *args, **kwargs)

        ctx.monkeypatch.setattr(torch, "save", save)

    return install


def install_fsync(*, directories: bool) -> Callable[[Injector, Ctx], None]:
    def install(inj: Injector, ctx: Ctx) -> None:
        real = os.fsync

        def fsync(fd: int) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode) == directories and inj.due():
                raise inj.fire(os_error(errno.EIO))
            real(fd)

        ctx.monkeypatch.setattr(os, "fsync", fsync)

    return install


def install_replace(code: int) -> Callable[[Injector, Ctx], None]:
    def install(inj: Injector, ctx: Ctx) -> None:
        real = os.replace

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if TEMP_NAME.fullmatch(Path(src).name) and inj.due():
                raise inj.fire(os_error(code))
            real(src, dst, **kwargs)

        ctx.monkeypatch.setattr(os, "replace", replace)

    return install


def install_commit_locked(inj: Injector, ctx: Ctx) -> None:
    """Another connection takes the write lock just before the commit transaction.

    It lets go once ckptdb starts recording the rollback (that bookkeeping is
    a different site, see test_rollback_bookkeeping_on_a_locked_ledger...).
    """

    def hook(name: str) -> None:
        if name == "after_fsync_dir" and inj.due():
            ctx.lock.acquire()
            inj.fire(db_locked("BEGIN IMMEDIATE (commit)"))

    real = ckptdb.protocol.disposal.record_rollback

    def record_rollback(*args: Any, **kwargs: Any) -> None:
        ctx.lock.release()
        real(*args, **kwargs)

    ctx.hook(hook)
    ctx.monkeypatch.setattr(ckptdb.protocol.disposal, "record_rollback", record_rollback)


def install_commit_injected(inj: Injector, ctx: Ctx) -> None:
    """An OperationalError inside the commit transaction, after all its statements."""

    def hook(name: str) -> None:
        if name == "in_commit" and inj.due():
            raise inj.fire(db_locked("COMMIT"))

    ctx.hook(hook)


def install_intent_locked(inj: Injector, ctx: Ctx) -> None:
    """Another connection holds the write lock when the intent transaction begins
    (the harness lets go after each failed save)."""
    real = Publisher._intent

    def record_intent(self: Publisher, *args: Any, **kwargs: Any) -> Any:
        if not ctx.lock.held and inj.due():
            ctx.lock.acquire()
            inj.fire(db_locked("BEGIN IMMEDIATE (intent)"))
        return real(self, *args, **kwargs)

    ctx.monkeypatch.setattr(Publisher, "_intent", record_intent)


def install_intent_injected(inj: Injector, ctx: Ctx) -> None:
    """An OperationalError from a statement of the intent transaction."""
    real = ckptdb.ledger.boundary_rows.live_paths

    def live_paths(*args: Any, **kwargs: Any) -> set[str]:
        if inj.due():
            raise inj.fire(db_locked("SELECT path FROM checkpoints"))
        return real(*args, **kwargs)

    ctx.monkeypatch.setattr(ckptdb.ledger.boundary_rows, "live_paths", live_paths)


@dataclass(frozen=True)
class Site:
    name: str
    phase: str  # PublishError.phase
    path: str | None  # what PublishError.path names: temp | final | directory | None
    message: str  # a fragment the row error and the exception must carry
    install: Callable[[Injector, Ctx], None]
    real_lock: bool = False  # the cause is SQLite's own error, not the injected object


SITES = [
    Site(
        "write-enospc",
        "write",
        "temp",
        os.strerror(errno.ENOSPC),
        install_file_write(errno.ENOSPC, 0),
    ),
    Site("write-eio", "write", "temp", os.strerror(errno.EIO), install_file_write(errno.EIO, 0)),
    Site(
        "write-enospc-partial",  # some bytes already on disk: a partial temp file to remove
        "write",
        "temp",
        os.strerror(errno.ENOSPC),
        install_file_write(errno.ENOSPC, 1),
    ),
    Site("fsync-eio", "fsync", "temp", os.strerror(errno.EIO), install_fsync(directories=False)),
    Site(
        "replace-eacces",
        "replace",
        "final",
        os.strerror(errno.EACCES),
        install_replace(errno.EACCES),
    ),
    Site(
        "replace-exdev", "replace", "final", os.strerror(errno.EXDEV), install_replace(errno.EXDEV)
    ),
    Site(
        "fsync-dir-eio",
        "fsync_dir",
        "directory",
        os.strerror(errno.EIO),
        install_fsync(directories=True),
    ),
    Site(
        "commit-locked", "commit", None, "database is locked", install_commit_locked, real_lock=True
    ),
    Site("commit-injected", "commit", None, "database is locked", install_commit_injected),
    Site(
        "intent-locked", "intent", None, "database is locked", install_intent_locked, real_lock=True
    ),
    Site("intent-injected", "intent", None, "database is locked", install_intent_injected),
]


def error_signature(err: PublishError) -> tuple[Any, ...]:
    """What must be identical between the failures of a persistent fault."""
    path = err.path
    shown = None if path is None else (path.parent, path.name.split(".tmp-")[0])
    cause = err.__cause__
    return (err.phase, err.stream, shown, type(cause), getattr(cause, "errno", None))


# ------------------------------------------------------- pre-commit fault matrix


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("site", SITES, ids=lambda s: s.name)
def test_fault_before_commit(
    warm: CheckpointManager,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    ledger_lock: LedgerLock,
    fault_hook: Callable[[Callable[[str], None]], None],
    site: Site,
    mode: str,
) -> None:
    mgr = warm
    save_dir = mgr.save_dir
    visible_before = committed_state(root)
    disk_before = disk(save_dir)
    inj = Injector(mode)
    site.install(inj, Ctx(monkeypatch, ledger_lock, fault_hook))

    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    signatures = []
    fired_before = 0
    for attempt in range(tries):
        dump_before = ledger_dump(root)
        first_new_id = max_checkpoint_id(root) + 1
        with pytest.raises(PublishError) as info:
            mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(3.0 + attempt))
        ledger_lock.release()
        err = info.value
        assert inj.fired > fired_before, "the fault was not reached"
        fired_before = inj.fired

        # the documented typed error, naming the phase, the step and the path
        assert isinstance(err, CkptDBError) and isinstance(err, RuntimeError)
        assert (err.phase, err.step) == (site.phase, STEP)
        assert err.cleanup_failures == []
        assert site.message in str(err)
        if site.real_lock:
            assert isinstance(err.__cause__, sqlalchemy.exc.OperationalError)
            assert "database is locked" in str(err.__cause__)
        else:
            assert err.__cause__ is inj.injected[-1]
        if site.path == "temp":
            assert err.path is not None and err.stream == "model"
            assert err.path.parent == save_dir / "model"
            assert TEMP_NAME.fullmatch(err.path.name)
            assert err.path.name.startswith(f".step-{STEP:09d}.pt.tmp-")
        elif site.path == "final":
            assert err.path == save_dir / "model" / f"step-{STEP:09d}.pt"
            assert err.stream == "model"
        elif site.path == "directory":
            assert err.path == save_dir / sorted(BOUNDARY)[0]  # synced in sorted order
        else:
            assert err.path is None
        signatures.append(error_signature(err))

        # committed rows, pointers and files exactly as before; nothing left behind
        assert committed_state(root) == visible_before
        assert disk(save_dir) == disk_before
        assert temp_files(save_dir) == []
        if site.phase == "intent":  # the intent never committed: not a row, not an event
            assert ledger_dump(root) == dump_before
        else:  # the boundary's rows are aborted, with the error recorded
            attempted = rows(
                root,
                "SELECT stream, step, state, error FROM checkpoints WHERE id >= ? ORDER BY id",
                first_new_id,
            )
            assert sorted(r[0] for r in attempted) == sorted(BOUNDARY)
            for stream_name, row_step, row_state, error in attempted:
                assert (row_step, row_state) == (STEP, "aborted"), stream_name
                assert site.message in (error or ""), (stream_name, error)
            failed = events(root, "publish_failed")
            assert failed[-1][0] == STEP and site.phase in failed[-1][2]
            assert len(failed) == attempt + 1

    assert len(set(signatures)) == 1, signatures  # a persistent fault fails the same way
    if mode == "persistent":
        inj.remove()

    # the next save (the fault spent, or removed) publishes the same boundary
    result = mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(9.0))
    assert inj.fired == fired_before  # a transient fault does not come back
    assert set(result) == set(BOUNDARY)
    assert {c.state for c in result.values()} == {"committed"}
    assert rows(root, "SELECT name, checkpoint_id FROM pointers ORDER BY name") == sorted(
        (f"latest:{s}", c.id) for s, c in result.items()
    )
    assert torch.equal(mgr.load(STEP)["w"], state(9.0)["w"])
    assert_clean(mgr)


# ---------------------------------- the ledger locked outside the two transactions


@pytest.mark.parametrize("mode", MODES)
def test_ledger_locked_for_a_whole_topk_save_is_a_typed_error(
    warm: CheckpointManager, root: Path, ledger_lock: LedgerLock, mode: str
) -> None:
    """Another writer holds the ledger while a boundary with a top-K stream is saved:
    admission reads the top-K from the ledger, and a locked ledger there (whichever
    transaction reads it) surfaces as a ckptdb error, never a bare SQLAlchemy one."""
    mgr = warm
    dump_before, disk_before = ledger_dump(root), disk(mgr.save_dir)
    for _ in range(1 if mode == "transient" else PERSISTENT_TRIES):
        ledger_lock.acquire()
        try:
            with pytest.raises(Exception) as info:
                mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(3.0))
        finally:
            ledger_lock.release()
        err = info.value
        assert "database is locked" in str(err)
        assert isinstance(err, CkptDBError), f"bare {type(err).__module__}.{type(err).__name__}"
        assert isinstance(err, RuntimeError)
        # locked past the busy timeout: the ledger is unavailable for now, training goes on
        assert isinstance(err, LedgerUnavailableError) and "training can go on" in str(err)
        assert "\n" not in str(err)
        assert (ledger_dump(root), disk(mgr.save_dir)) == (dump_before, disk_before)

    result = mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(3.0))
    assert set(result) == set(BOUNDARY)
    assert_clean(mgr)


def test_a_flush_with_nothing_buffered_never_waits_for_a_locked_ledger(
    warm: CheckpointManager, root: Path, ledger_lock: LedgerLock
) -> None:
    """``flush()`` with no metric buffered has nothing to write: it opens no write
    transaction, so another writer holding the ledger can neither make it wait nor
    fail it (a transaction now takes SQLite's write lock as it begins, even one that
    runs no statement)."""
    mgr = warm
    mgr.flush()  # what the boundaries buffered goes now
    dump_before = ledger_dump(root)
    ledger_lock.acquire()
    mgr.flush()
    ledger_lock.release()
    assert ledger_dump(root) == dump_before
    mgr.log_metrics(30, {"val_loss": 3.0})
    mgr.flush()  # something to write: written as before
    assert rows(root, "SELECT step FROM metrics WHERE step = 30") == [(30,)]


@pytest.mark.parametrize("mode", MODES)
def test_ledger_locked_right_after_commit_does_not_fail_the_save(
    open_manager: Opener,
    root: Path,
    ledger_lock: LedgerLock,
    fault_hook: Callable[[Callable[[str], None]], None],
    mode: str,
) -> None:
    """The boundary committed; a ledger locked during the cleanup bookkeeping is a
    phase-6 failure: warned about and left for reconcile, never an exception."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    mgr.save(1, model=state(1.0))
    inj = Injector(mode)

    def hook(name: str) -> None:
        if name == "after_commit" and inj.due():
            ledger_lock.acquire()
            inj.fire(db_locked("BEGIN IMMEDIATE (after commit)"))

    fault_hook(hook)
    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    for step in range(2, 2 + tries):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = mgr.save(step, model=state(float(step)))
        finally:
            ledger_lock.release()
        assert inj.fired == step - 1
        assert caught_cleanup_warnings(caught), "the unrecorded cleanup was not warned about"
        assert result["model"].step == step and result["model"].state == "committed"
        assert rows(root, "SELECT step FROM checkpoints WHERE state = 'committed'") == [(step,)]
        assert rows(root, "SELECT checkpoint_id FROM pointers") == [(result["model"].id,)]
    inj.remove()
    mgr.reconcile()  # finishes the deletions the cleanup could not record
    assert files(mgr.save_dir) == [f"model/step-{1 + tries:09d}.pt"]
    assert_clean(mgr)


@pytest.mark.parametrize("mode", MODES)
def test_rollback_bookkeeping_on_a_locked_ledger_is_left_for_reconcile(
    warm: CheckpointManager,
    root: Path,
    ledger_lock: LedgerLock,
    fault_hook: Callable[[Callable[[str], None]], None],
    mode: str,
) -> None:
    """The commit fails because the ledger is locked, and it stays locked while the
    rollback is recorded: files are removed, the rows stay pending (the error is
    attached to PublishError), and reconcile finishes the rollback."""
    mgr = warm
    visible_before, disk_before = committed_state(root), disk(mgr.save_dir)
    inj = Injector(mode)

    def hook(name: str) -> None:
        if name == "after_fsync_dir" and inj.due():
            ledger_lock.acquire()
            inj.fire(db_locked("BEGIN IMMEDIATE"))

    fault_hook(hook)
    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    for attempt in range(tries):
        first_new_id = max_checkpoint_id(root) + 1
        try:
            with (
                pytest.warns(CleanupWarning, match="database is locked"),
                pytest.raises(PublishError) as info,
            ):
                mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(3.0 + attempt))
        finally:
            ledger_lock.release()
        err = info.value
        assert err.phase == "commit"
        assert "database is locked" in str(err.__cause__)
        assert len(err.cleanup_failures) == 1  # the ledger itself could not record it
        failure = err.cleanup_failures[0].error  # one line; the driver's error as its cause
        assert isinstance(failure, DatabaseError) and "\n" not in str(failure)
        assert isinstance(failure.original, sqlalchemy.exc.OperationalError)
        assert committed_state(root) == visible_before
        assert disk(mgr.save_dir) == disk_before  # the files were removed all the same
        assert rows(root, "SELECT DISTINCT state FROM checkpoints WHERE id >= ?", first_new_id) == [
            ("pending",)
        ]

    inj.remove()
    report = mgr.reconcile()
    assert report.counts == {"rolled_back": len(BOUNDARY) * tries}, str(report)
    assert rows(root, "SELECT DISTINCT state FROM checkpoints WHERE step = ?", STEP) == [
        ("aborted",)
    ]
    assert committed_state(root) == visible_before
    result = mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(9.0))
    assert set(result) == set(BOUNDARY)
    assert_clean(mgr)


# ------------------------------------------- directory fsync while creating a stream dir


@pytest.mark.parametrize("mode", MODES)
def test_directory_fsync_failing_while_a_stream_directory_is_created(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The first save of a run creates ``checkpoints/`` and ``checkpoints/model/``;
    each new entry's parent is fsynced. If that fsync fails, a directory left in
    place must still be made durable (its parent fsynced) before a later save
    commits a checkpoint inside it."""
    mgr = open_manager()
    dirs_before = {p for p in root.rglob("*") if p.is_dir()}
    inj = Injector(mode)
    synced: list[tuple[int, int]] = []  # (st_dev, st_ino) of directories fsynced successfully
    real = os.fsync

    def fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            if inj.due():
                raise inj.fire(os_error(errno.EIO))
            real(fd)
            synced.append((info.st_dev, info.st_ino))
            return
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    for attempt in range(tries):
        with pytest.raises(PublishError) as info:
            mgr.save(1, model=state(1.0))
        err = info.value
        assert inj.fired == attempt + 1
        assert err.phase in ("intent", "fsync_dir")
        assert err.__cause__ is inj.injected[-1]
        assert err.path is not None and (err.path == root or root in err.path.parents)
        assert rows(root, "SELECT COUNT(*) FROM checkpoints WHERE state = 'committed'") == [(0,)]
        assert files(mgr.save_dir) == []
    left_behind = {p for p in root.rglob("*") if p.is_dir()} - dirs_before

    inj.remove()
    synced.clear()
    ckpt = mgr.save(1, model=state(1.0))["model"]
    assert ckpt.state == "committed"
    for directory in sorted(left_behind):
        parent = os.stat(directory.parent)
        assert (parent.st_dev, parent.st_ino) in synced, (
            f"{directory} was created by a failed save whose fsync of {directory.parent} "
            "failed, and no later save fsynced it: the entry may vanish on power loss"
        )
    assert_clean(mgr)


# ---------------------------------------------------- unlink after the commit


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EIO], ids=errno.errorcode.get)
def test_unlink_of_an_evicted_file_fails_after_commit(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch, mode: str, code: int
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1), "ema": Keep(last=1)})
    mgr.save(1, model=state(1.0), ema=state(1.5))
    inj = Injector(mode)
    real = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        p = Path(path)
        if CHECKPOINT_NAME.fullmatch(p.name) and os.path.lexists(p) and inj.due():
            raise inj.fire(os_error(code))
        real(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    stuck: list[Any] = []  # checkpoints whose file could not be removed
    for step in range(2, 2 + tries):
        previous = {s: mgr.latest(s) for s in ("model", "ema")}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = mgr.save(step, model=state(float(step)), ema=state(step + 0.5))

        # the save succeeded and is what the ledger shows
        assert {s: c.step for s, c in result.items()} == {"model": step, "ema": step}
        assert rows(root, "SELECT name, checkpoint_id FROM pointers ORDER BY name") == [
            ("latest:ema", result["ema"].id),
            ("latest:model", result["model"].id),
        ]
        assert rows(root, "SELECT DISTINCT step FROM checkpoints WHERE state = 'committed'") == [
            (step,)
        ]
        failed_now = [previous["model"]] if mode == "transient" else list(previous.values())
        stuck.extend(failed_now)
        messages = caught_cleanup_warnings(caught)
        assert len(messages) == len(failed_now), messages
        for ckpt in failed_now:
            assert ckpt is not None
            assert any(str(ckpt.path) in m for m in messages)
            assert ckpt.path.exists()
            assert rows(root, "SELECT state FROM checkpoints WHERE id = ?", ckpt.id) == [
                ("deleting",)
            ]
            recorded = [d for _s, c, d in events(root, "cleanup_failed") if c == ckpt.id]
            assert len(recorded) == 1 and str(ckpt.path) in recorded[0]
        if mode == "transient":  # the other stream's eviction went through
            assert previous["ema"] is not None and not previous["ema"].path.exists()
    assert inj.fired == (1 if mode == "transient" else 2 * tries)
    assert len(events(root, "cleanup_failed")) == len(stuck)

    if mode == "transient":  # the next save evicts normally, without a warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(3, model=state(3.0), ema=state(3.5))
        assert caught_cleanup_warnings(caught) == []
        assert inj.fired == 1
    else:  # reconcile cannot finish either while the fault lasts: rows stay 'deleting'
        before = checkpoint_rows(root)
        with pytest.warns(UserWarning):
            report = mgr.reconcile()
        assert sorted(a.checkpoint_id for a in report.failures) == sorted(c.id for c in stuck)
        assert "deleted" not in report.counts
        assert checkpoint_rows(root) == before
        inj.remove()

    report = mgr.reconcile()
    assert report.counts.get("deleted") == len(stuck), str(report)
    for ckpt in stuck:
        assert not ckpt.path.exists()
        assert rows(root, "SELECT state FROM checkpoints WHERE id = ?", ckpt.id) == [("deleted",)]
    newest = mgr.latest("model")
    assert newest is not None
    assert files(mgr.save_dir) == [
        f"ema/step-{newest.step:09d}.pt",
        f"model/step-{newest.step:09d}.pt",
    ]
    assert_clean(mgr)


# ------------------------------------- rollback leftovers that cannot be removed


PRIMARY_FAULTS = {
    "write": install_file_write(errno.ENOSPC, 1),
    "fsync": install_fsync(directories=False),
    "replace": install_replace(errno.EACCES),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("primary", sorted(PRIMARY_FAULTS))
def test_rollback_leftover_that_cannot_be_removed_is_left_for_reconcile(
    warm: CheckpointManager,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    ledger_lock: LedgerLock,
    fault_hook: Callable[[Callable[[str], None]], None],
    primary: str,
    mode: str,
) -> None:
    """A persistent write/fsync/replace fault, and the rollback's unlink of the temp
    file failing once (transient) or every time (persistent)."""
    mgr = warm
    save_dir = mgr.save_dir
    visible_before, disk_before = committed_state(root), disk(save_dir)
    primary_inj = Injector("persistent")
    PRIMARY_FAULTS[primary](primary_inj, Ctx(monkeypatch, ledger_lock, fault_hook))
    cleanup = Injector(mode)
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        p = Path(path)
        if TEMP_NAME.fullmatch(p.name) and os.path.lexists(p) and cleanup.due():
            raise cleanup.fire(PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    leftovers: list[Path] = []
    for attempt in range(2):
        first_new_id = max_checkpoint_id(root) + 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(PublishError) as info:
                mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(3.0 + attempt))
        err = info.value
        assert err.phase == primary
        assert err.__cause__ is primary_inj.injected[-1]
        # the rollback meets each temp file written so far (replace: every stream's)
        written = BOUNDARY if primary == "replace" else BOUNDARY[:1]
        # transient: only the very first unlink of the test fails
        first_only = written[:1] if attempt == 0 else ()
        stuck = written if mode == "persistent" else first_only
        new_rows = rows(
            root,
            "SELECT stream, state, tmp_path, error FROM checkpoints WHERE id >= ? ORDER BY id",
            first_new_id,
        )
        by_stream = {r[0]: r for r in new_rows}
        assert sorted(by_stream) == sorted(BOUNDARY)
        stuck_paths = [save_dir / by_stream[s][2] for s in stuck]
        assert [f.path for f in err.cleanup_failures] == stuck_paths
        assert all(isinstance(f.error, PermissionError) for f in err.cleanup_failures)
        messages = caught_cleanup_warnings(caught)
        assert len(messages) == len(stuck_paths), messages
        recorded = [d or "" for *_x, d in events(root, "cleanup_failed")]
        for stream_name, row_state, _tmp, error in new_rows:
            if stream_name not in stuck:
                assert row_state == "aborted", stream_name
                continue
            leftover = save_dir / by_stream[stream_name][2]
            assert leftover.exists()
            assert str(leftover) in str(err)
            assert any(str(leftover) in m for m in messages)
            assert any(str(leftover) in d for d in recorded)
            # recorded for reconcile: the row stays pending, with the error
            assert row_state == "pending", stream_name
            assert os.strerror(primary_inj.injected[-1].errno) in (error or "")
            leftovers.append(leftover)
        assert committed_state(root) == visible_before
        assert disk(save_dir) == {
            **disk_before,
            **{str(p.relative_to(save_dir)): digest(p) for p in leftovers},
        }
    assert cleanup.fired == len(leftovers)
    assert len(leftovers) == (1 if mode == "transient" else 2 * len(written))

    if mode == "persistent":  # reconcile fails on them too, and leaves the rows alone
        pending_before = checkpoint_rows(root)
        with pytest.warns(UserWarning):
            report = mgr.reconcile()
        assert sorted(a.path for a in report.failures) == sorted(
            str(p.relative_to(save_dir)) for p in leftovers
        )
        assert checkpoint_rows(root) == pending_before
        assert all(p.exists() for p in leftovers)
        cleanup.remove()
    primary_inj.remove()

    report = mgr.reconcile()
    assert report.counts == {"rolled_back": len(leftovers)}, str(report)
    assert rows(root, "SELECT DISTINCT state FROM checkpoints WHERE step = ?", STEP) == [
        ("aborted",)
    ]
    assert disk(save_dir) == disk_before
    assert committed_state(root) == visible_before
    result = mgr.save(STEP, metrics={"val_loss": 0.5}, **boundary(9.0))
    assert set(result) == set(BOUNDARY)
    assert_clean(mgr)


# ---------------------------------------------------------- faults during reconcile


def _deleting(mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A 'deleting' row whose file is still there (its eviction's unlink failed)."""
    evicted = mgr.latest()
    assert evicted is not None
    with monkeypatch.context() as patch:
        real = os.unlink

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path) == evicted.path:
                raise PermissionError(errno.EACCES, "Permission denied")
            real(path, *args, **kwargs)

        patch.setattr(os, "unlink", unlink)
        with pytest.warns(CleanupWarning):
            mgr.save(evicted.step + 1, model=state(9.0))
    return evicted.path, "deleted"


def _pending(mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A 'pending' row whose temp file survived a failed rollback."""
    left: list[Path] = []
    with monkeypatch.context() as patch:
        real = os.unlink

        def refuse_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            f.write(b"partial bytes")
            raise os_error(errno.ENOSPC)

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if TEMP_NAME.fullmatch(Path(path).name):
                left.append(Path(path))
                raise PermissionError(errno.EACCES, "Permission denied")
            real(path, *args, **kwargs)

        patch.setattr(torch, "save", refuse_save)
        patch.setattr(os, "unlink", unlink)
        with pytest.warns(CleanupWarning), pytest.raises(PublishError):
            mgr.save(7, model=state(7.0))
    assert len(left) == 1 and left[0].exists()
    return left[0], "rolled_back"


def _orphan_temp(mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    path = mgr.save_dir / "model" / ".step-000000005.pt.tmp-999"
    path.write_bytes(b"a temp file of a crashed save")
    return path, "removed_temp"


def _orphan_checkpoint(mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    path = mgr.save_dir / "model" / "step-000000099.pt"
    path.write_bytes(b"a checkpoint no row owns")
    return path, "quarantined"


RECONCILE_TARGETS = {
    "deleting": _deleting,
    "pending": _pending,
    "orphan-temp": _orphan_temp,
    "orphan-checkpoint": _orphan_checkpoint,  # moved aside with os.replace
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("target", sorted(RECONCILE_TARGETS))
def test_fault_during_reconcile(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch, target: str, mode: str
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    mgr.save(1, model=state(1.0))
    path, success = RECONCILE_TARGETS[target](mgr, monkeypatch)
    rel = str(path.relative_to(mgr.save_dir))
    content = path.read_bytes()
    rows_before = checkpoint_rows(root)
    visible_before = committed_state(root)
    inj = Injector(mode)
    real_unlink, real_replace = os.unlink, os.replace

    def unlink(p: Any, *args: Any, **kwargs: Any) -> None:
        if Path(p) == path and inj.due():
            raise inj.fire(PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
        real_unlink(p, *args, **kwargs)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(src) == path and inj.due():
            raise inj.fire(PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
        real_replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "replace", replace)

    def failing_reconcile() -> None:
        with pytest.warns(UserWarning, match=path.name):
            report = mgr.reconcile()
        assert [a.path for a in report.failures] == [rel]
        assert "PermissionError" in report.failures[0].detail
        assert success not in report.counts
        assert checkpoint_rows(root) == rows_before  # row untouched
        assert committed_state(root) == visible_before
        assert path.read_bytes() == content

    failing_reconcile()
    if mode == "persistent":
        failing_reconcile()
        mgr.close()  # reconcile at open meets the fault as well, and open still works
        with pytest.warns(UserWarning, match=path.name):
            mgr = open_manager()
        assert [a.path for a in mgr.last_reconcile.failures] == [rel]
        assert checkpoint_rows(root) == rows_before
        failing_reconcile()
        assert inj.fired == 4
        inj.remove()
    else:
        assert inj.fired == 1

    report = mgr.reconcile()
    assert report.failures == []
    assert report.counts.get(success) == 1, str(report)
    assert not path.exists()
    if success == "quarantined":
        moved = root / "ckptdb.quarantine" / "model" / path.name
        assert moved.read_bytes() == content
    assert committed_state(root) == visible_before
    assert_clean(mgr)


def test_quarantine_across_devices_falls_back_to_a_copy(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EXDEV on every os.replace (a quarantine on another file system): reconcile
    still moves the orphan aside, by copy and delete, with its content intact."""
    mgr = open_manager(streams={"model": Keep(last=1)})
    mgr.save(1, model=state(1.0))
    path, _ = _orphan_checkpoint(mgr, monkeypatch)
    content = path.read_bytes()
    inj = Injector("persistent")
    real = os.replace

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        if inj.due():
            raise inj.fire(os_error(errno.EXDEV))
        real(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    report = mgr.reconcile()
    assert inj.fired >= 1
    assert report.failures == []
    assert report.counts == {"quarantined": 1}
    assert not path.exists()
    assert (root / "ckptdb.quarantine" / "model" / path.name).read_bytes() == content
    assert_clean(mgr)


# ---------------------------------------------------------------- faults during load


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", ["open", "verify", "unpickle"])
def test_read_error_during_load(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch, stage: str, mode: str
) -> None:
    """EIO while loading: the OSError reaches the caller (ckptdb documents no wrapper
    for it) and the ledger is unchanged: a read error is not evidence of corruption,
    so the row is neither marked corrupt nor lost, and no resume is recorded."""
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    mgr.save(2, model=state(2.0))
    save_dir = mgr.save_dir
    dump_before, disk_before = ledger_dump(root), disk(save_dir)
    inj = Injector(mode)

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        inside = Path(file).resolve().is_relative_to(save_dir)
        if inside and stage == "open" and inj.due():
            raise inj.fire(os_error(errno.EIO))
        return builtins.open(file, *args, **kwargs)

    def failing(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if inj.due():
                raise inj.fire(os_error(errno.EIO))
            return real(*args, **kwargs)

        return call

    # ckptdb.storage opens the file for the hashing read with the builtin open; a
    # module global shadows it for the test. Unpickling reads the held bytes.
    monkeypatch.setattr(ckptdb.storage.files, "open", fake_open, raising=False)
    monkeypatch.setattr(ckptdb.storage.heldfile, "open", fake_open, raising=False)
    if stage == "verify":
        monkeypatch.setattr(
            ckptdb.storage.files, "hash_checkpoint", failing(ckptdb.storage.files.hash_checkpoint)
        )
        monkeypatch.setattr(
            ckptdb.storage.heldfile, "read_hashed", failing(ckptdb.storage.heldfile.read_hashed)
        )
    elif stage == "unpickle":
        patch_unpickle(monkeypatch, failing)
    tries = 1 if mode == "transient" else PERSISTENT_TRIES
    for attempt in range(tries):
        with pytest.raises(OSError) as info:
            mgr.load()
        err = info.value
        assert inj.fired == attempt + 1
        assert err is inj.injected[-1] or err.__cause__ is inj.injected[-1]
        assert err.errno == errno.EIO
        assert not isinstance(err, (CorruptCheckpointError, CheckpointNotFoundError))
        assert (ledger_dump(root), disk(save_dir)) == (dump_before, disk_before)
    if mode == "persistent":
        inj.remove()

    assert torch.equal(mgr.load()["w"], state(2.0)["w"])
    assert inj.fired == tries
    assert rows(root, "SELECT DISTINCT state FROM checkpoints") == [("committed",)]
    assert mgr.reconcile(verify=True).actions == []
    assert mgr.check(load=True) == []


# ------------------------------------------------------------------ the root's entry


def _failing_fsync_above(monkeypatch: pytest.MonkeyPatch, root: Path, code: int) -> list[Path]:
    """The fsync of the root's parent fails with ``code``; the calls are listed."""
    from ckptdb import manager as manager_module
    from ckptdb.errors import PhaseError
    from ckptdb.storage import files as files_module

    seen: list[Path] = []

    def fsync_dir(directory: Path) -> None:
        seen.append(Path(directory))
        if Path(directory) == root.parent:
            raise PhaseError("fsync_dir", directory, OSError(code, os.strerror(code)))
        files_module.fsync_dir(directory)

    monkeypatch.setattr(manager_module, "fsync_dir", fsync_dir)
    return seen


def test_the_directories_above_a_root_are_fsynced_up_to_its_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "made" / "by" / "someone" / "run"
    os.makedirs(root)
    seen = _failing_fsync_above(monkeypatch, tmp_path / "no-such" / "x", errno.EIO)
    with CheckpointManager(root):
        pass
    device = os.stat(root).st_dev
    same = [p for p in root.parents if os.stat(p).st_dev == device]
    assert seen[:4] == [root.parent, root.parent.parent, tmp_path / "made", tmp_path]
    assert seen == same[: len(seen)] and len(seen) >= 4


@pytest.mark.parametrize("code", [errno.EACCES, errno.EINVAL])
def test_a_directory_above_the_root_that_cannot_be_fsynced_is_logged_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    """Not readable by this process, or a filesystem without directory fsync."""
    root = tmp_path / "run"
    _failing_fsync_above(monkeypatch, root, code)
    with caplog.at_level("WARNING", logger="ckptdb.manager"), CheckpointManager(root):
        pass
    assert f"cannot fsync {tmp_path}" in caplog.text


def test_an_io_error_making_the_root_durable_refuses_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    _failing_fsync_above(monkeypatch, root, errno.EIO)
    with pytest.raises(RunDirectoryError, match=f"durable in {tmp_path}"):
        CheckpointManager(root)


def test_a_crashed_writers_owner_record_is_removed_and_one_that_cannot_be_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``.ckptdb.owner.<pid>`` written but never renamed in (a crash between): the next
    writer removes it; one it may not remove costs bytes, not the open, and is said."""
    from ckptdb.ledger import lock as lock_module

    root = tmp_path / "run"
    root.mkdir()
    (root / ".ckptdb.owner.111").write_text("{}")
    with CheckpointManager(root):
        pass
    assert not (root / ".ckptdb.owner.111").exists()

    stuck = root / ".ckptdb.owner.222"
    stuck.write_text("{}")
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == stuck:
            raise PermissionError(errno.EPERM, "not yours", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(lock_module.os, "unlink", unlink)
    with caplog.at_level("WARNING", logger="ckptdb.lock"), CheckpointManager(root):
        pass
    assert stuck.exists() and f"cannot remove {stuck}" in caplog.text
