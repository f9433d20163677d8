"""The publication protocol (ckptdb.protocol.boundary) on one process.

Order of the phases, atomicity of a boundary across streams, every fault the
protocol must survive (each raising ``PublishError`` with its phase and leaving
the ledger and the disk as they were), cleanup failures before and after the
commit, the non-finite guard, top-K admission, the timeline rule, retention,
input validation and buffered metrics.

Every test that opens a run does so on both ledgers: the run's SQLite file and a
PostgreSQL schema of its own (``db_url`` below follows ``backend``; see conftest).
The ledger is read with plain SQL through the ``db`` fixture. Cases that differ in
what the ledger never sees (an argument refused before any ledger work, the
stream a file fault hits) run on PostgreSQL for a representative few:
``on_both_backends``.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import LedgerClient, boundary, db_locked, digest, disk, files, on_both_backends, state

import ckptdb.ledger.boundary_rows
import ckptdb.ledger.rows
import ckptdb.storage
from ckptdb import (
    Checkpoint,
    CheckpointManager,
    CleanupWarning,
    External,
    Keep,
    NonFiniteGradGuard,
    TopK,
    faults,
)
from ckptdb.errors import (
    CkptDBError,
    InvalidArgumentError,
    InvalidMetricError,
    NonFiniteGradientError,
    PublishError,
    RunDirectoryError,
    UnknownStreamError,
)

Opener = Callable[..., CheckpointManager]

COMMITTED_SQL = (
    "SELECT id, stream, step, state, path FROM checkpoints WHERE state = 'committed' ORDER BY id"
)
BOUNDARY = ("model", "ema", "best")  # payload order of a full boundary below


# --------------------------------------------------------------------- helpers


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    """Runs opened here (``open_manager``, ``db``) use both ledgers in turn."""
    return backend


def committed(db: LedgerClient) -> list[tuple[Any, ...]]:
    return db.rows(COMMITTED_SQL)


def pointers(db: LedgerClient) -> dict[str, int]:
    return dict(db.rows("SELECT name, checkpoint_id FROM pointers"))


def ledger_dump(db: LedgerClient) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, for "nothing changed" comparisons."""
    return {t: sorted(db.rows(f'SELECT * FROM "{t}"'), key=repr) for t in db.tables()}


def temp_files(directory: Path) -> list[str]:
    return [name for name in files(directory) if Path(name).name.startswith(".")]


def events(db: LedgerClient, kind: str) -> list[tuple[Any, ...]]:
    return db.rows("SELECT step, checkpoint_id, detail FROM events WHERE kind = ?", kind)


def max_checkpoint_id(db: LedgerClient) -> int:
    return db.rows("SELECT COALESCE(MAX(id), 0) FROM checkpoints")[0][0]


def spy_save(
    monkeypatch: pytest.MonkeyPatch, hook: Callable[[Any, Any], None] | None = None
) -> list[Any]:
    """Wrap ``torch.save``; returns the list of objects it was asked to save.

    ``hook(obj, file)`` runs before the real save (it may raise).
    """
    real = torch.save
    calls: list[Any] = []

    def wrapper(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(obj)
        if hook is not None:
            hook(obj, f)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", wrapper)
    return calls


# ------------------------------------------------------------------ happy path


@pytest.mark.parametrize("custom_save_dir", [False, True])
def test_save_publishes_every_stream(
    open_manager: Opener,
    streams: dict[str, Any],
    root: Path,
    db: LedgerClient,
    tmp_path: Path,
    custom_save_dir: bool,
) -> None:
    save_dir = tmp_path / "elsewhere" / "ckpts" if custom_save_dir else None
    mgr = open_manager(streams=streams, save_dir=save_dir)
    expected_dir = (save_dir or root / "checkpoints").resolve()
    assert mgr.save_dir == expected_dir

    for step, value in [(10, 3.0), (20, 2.0)]:
        result = mgr.save(step, metrics={"val_loss": value}, **boundary(value))

        assert set(result) == {"model", "ema", "best"}
        for stream, ckpt in result.items():
            assert isinstance(ckpt, Checkpoint)
            assert ckpt.stream == stream
            assert ckpt.step == step
            assert ckpt.state == "committed"
            assert ckpt.committed_at is not None
            assert ckpt.path.is_absolute()
            assert ckpt.path.parent == expected_dir / stream
            assert ckpt.path.is_file()
            assert ckpt.size == ckpt.path.stat().st_size
            assert ckpt.hash == digest(ckpt.path)
        assert result["best"].metric == value
        assert result["model"].metric is None

        ids = {s: c.id for s, c in result.items()}
        assert pointers(db) == {f"latest:{s}": i for s, i in ids.items()}
        in_ledger = db.rows(
            "SELECT stream, state, path, size, hash FROM checkpoints WHERE step = ?", step
        )
        assert sorted(in_ledger) == sorted(
            (s, "committed", f"{s}/{c.path.name}", c.size, c.hash) for s, c in result.items()
        )
        assert mgr.latest("model") == result["model"]
        assert mgr.latest("ema") == result["ema"]

    assert temp_files(expected_dir) == []
    assert sorted(files(expected_dir)) == sorted(
        f"{s}/step-{n:09d}.pt" for s in ("model", "ema", "best") for n in (10, 20)
    )
    # besides the checkpoints, only the library's own files are in the root
    outside = [n for n in files(root) if not (root / n).resolve().is_relative_to(expected_dir)]
    assert all(name.startswith("ckptdb.") for name in outside), outside
    if not db.is_sqlite:  # no ledger file, no lock file: nothing at all
        assert outside == []


def test_loaded_checkpoint_round_trips(warm: CheckpointManager) -> None:
    loaded = warm.load("latest", stream="model")
    assert torch.equal(loaded["w"], state(2.0)["w"])


# -------------------------------------------------------------- protocol order


def test_protocol_phases_happen_in_order(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1), "ema": Keep(last=1)})
    old = mgr.save(10, model=state(1.0), ema=state(1.5))
    old_paths = {c.path: c.id for c in old.values()}
    save_dir = mgr.save_dir
    payloads = {"model": state(2.0), "ema": state(2.5)}
    stream_of = {id(obj): stream for stream, obj in payloads.items()}
    trace: list[tuple[str, Any]] = []
    observed_unlinks: list[Path] = []

    def on_save(obj: Any, _f: Any) -> None:
        stream = stream_of[id(obj)]
        directory = save_dir / stream
        # the intent rows of the whole boundary are already committed as pending
        seen = db.rows("SELECT stream, state, path FROM checkpoints WHERE step = 20")
        assert sorted(seen) == [
            ("ema", "pending", "ema/step-000000020.pt"),
            ("model", "pending", "model/step-000000020.pt"),
        ]
        tmps = [name for name in os.listdir(directory) if name.startswith(".")]
        assert len(tmps) == 1, tmps  # the temp file is in the destination directory
        assert not (directory / "step-000000020.pt").exists()  # final name not there yet
        assert pointers(db)[f"latest:{stream}"] == old[stream].id
        trace.append(("save", os.stat(directory / tmps[0]).st_ino))

    spy_save(monkeypatch, on_save)

    real_fsync, real_replace, real_unlink = os.fsync, os.replace, os.unlink
    real_point_latest = ckptdb.ledger.boundary_rows.point_latest

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        trace.append(("fsync_dir" if stat.S_ISDIR(st.st_mode) else "fsync_file", st.st_ino))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        assert Path(src).parent == Path(dst).parent
        trace.append(("replace", os.stat(src).st_ino))
        real_replace(src, dst, **kwargs)

    def point_latest(*args: Any, **kwargs: Any) -> None:
        trace.append(("commit", None))
        real_point_latest(*args, **kwargs)

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        p = Path(path)
        if p in old_paths:
            trace.append(("unlink", p))
            observed_unlinks.append(p)
            # the commit that evicted it is durable before the file goes
            (row_state,) = db.rows("SELECT state FROM checkpoints WHERE id = ?", old_paths[p])[0]
            assert row_state == "deleting"
            stream = p.parent.name
            latest = pointers(db)[f"latest:{stream}"]
            assert db.rows("SELECT step, state FROM checkpoints WHERE id = ?", latest) == [
                (20, "committed")
            ]
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(ckptdb.ledger.boundary_rows, "point_latest", point_latest)

    new = mgr.save(20, **payloads)

    assert set(observed_unlinks) == set(old_paths)
    kinds = [k for k, _ in trace]
    first_commit = kinds.index("commit")
    last_commit = len(kinds) - 1 - kinds[::-1].index("commit")
    for stream in ("model", "ema"):
        ino = new[stream].path.stat().st_ino
        dir_ino = (save_dir / stream).stat().st_ino
        i_save = trace.index(("save", ino))
        i_fsync = trace.index(("fsync_file", ino))
        i_replace = trace.index(("replace", ino))
        i_dir = [i for i, t in enumerate(trace) if t == ("fsync_dir", dir_ino) and i > i_replace]
        assert trace.count(("fsync_file", ino)) == 1
        assert i_save < i_fsync < i_replace < i_dir[0] < first_commit
    for i, (kind, _) in enumerate(trace):
        if kind == "unlink":
            assert i > last_commit
    assert {p.exists() for p in old_paths} == {False}
    assert db.rows("SELECT state FROM checkpoints WHERE id IN (?, ?)", *old_paths.values()) == [
        ("deleted",),
        ("deleted",),
    ]


# -------------------------------------------------------- faults and atomicity

FAULTS = [
    "torch_save_raises",
    "write_then_enospc",
    "stream_enospc",
    "stream_eio",
    "fsync_eio",
    "replace_eacces",
    "replace_exdev",
    "fsync_dir_eio",
    "commit_locked",
    "commit_after_metrics",
]
PHASE = {
    "torch_save_raises": "write",
    "write_then_enospc": "write",
    "stream_enospc": "write",
    "stream_eio": "write",
    "fsync_eio": "fsync",
    "replace_eacces": "replace",
    "replace_exdev": "replace",
    "fsync_dir_eio": "fsync_dir",
    "commit_locked": "commit",
    "commit_after_metrics": "commit",
}


class Fault:
    """Makes the ``nth`` (0-based) occurrence of one operation fail, once."""

    def __init__(self, kind: str, nth: int) -> None:
        self.kind, self.nth = kind, nth
        self.count = 0
        self.injected: BaseException | None = None
        self.armed = True

    def due(self) -> bool:
        if not self.armed:
            return False
        self.count += 1
        return self.count == self.nth + 1

    def fire(self, exc: BaseException) -> BaseException:
        self.injected = exc
        return exc

    @property
    def message(self) -> str:
        """A fragment of the injected error that the row's error text must carry."""
        if self.kind == "torch_save_raises":
            return "serializer exploded"
        if self.kind in ("commit_locked", "commit_after_metrics"):
            return "database is locked"
        return os.strerror(self._errno)

    @property
    def _errno(self) -> int:
        return {
            "write_then_enospc": errno.ENOSPC,
            "stream_enospc": errno.ENOSPC,
            "stream_eio": errno.EIO,
            "fsync_eio": errno.EIO,
            "replace_eacces": errno.EACCES,
            "replace_exdev": errno.EXDEV,
            "fsync_dir_eio": errno.EIO,
        }[self.kind]

    def os_error(self) -> OSError:
        return OSError(self._errno, os.strerror(self._errno))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        kind = self.kind
        if kind in ("torch_save_raises", "write_then_enospc"):
            real = torch.save

            def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
                if not self.due():
                    real(obj, f, *args, **kwargs)
                    return
                if kind == "torch_save_raises":
                    raise self.fire(RuntimeError("serializer exploded"))
                real(obj, f, *args, **kwargs)
                raise self.fire(self.os_error())

            monkeypatch.setattr(torch, "save", save)
        elif kind in ("stream_enospc", "stream_eio"):
            real_write = ckptdb.storage.HashingWriter.write
            writers: list[Any] = []

            def write(writer: Any, data: Any) -> int:
                if not any(w is writer for w in writers):
                    writers.append(writer)
                    if self.armed:
                        self.count += 1
                if (
                    self.armed
                    and writers[-1] is writer
                    and self.count == self.nth + 1
                    and writer.size > 0
                ):
                    self.armed = False
                    raise self.fire(self.os_error())
                return real_write(writer, data)

            monkeypatch.setattr(ckptdb.storage.HashingWriter, "write", write)
        elif kind in ("fsync_eio", "fsync_dir_eio"):
            real_fsync = os.fsync
            want_dir = kind == "fsync_dir_eio"

            def fsync(fd: int) -> None:
                is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
                if is_dir == want_dir and self.due():
                    raise self.fire(self.os_error())
                real_fsync(fd)

            monkeypatch.setattr(os, "fsync", fsync)
        elif kind in ("replace_eacces", "replace_exdev"):
            real_replace = os.replace

            def replace(src: Any, dst: Any, **kwargs: Any) -> None:
                if self.due():
                    raise self.fire(self.os_error())
                real_replace(src, dst, **kwargs)

            monkeypatch.setattr(os, "replace", replace)
        elif kind == "commit_locked":  # a statement inside the commit transaction fails
            real_point_latest = ckptdb.ledger.boundary_rows.point_latest

            def point_latest(*args: Any, **kwargs: Any) -> None:
                if self.due():
                    raise self.fire(db_locked("UPDATE pointers"))
                real_point_latest(*args, **kwargs)

            monkeypatch.setattr(ckptdb.ledger.boundary_rows, "point_latest", point_latest)
        elif kind == "commit_after_metrics":  # the last work of the commit, metrics written
            real_insert = ckptdb.ledger.rows.insert_metric_calls

            def insert_metric_calls(*args: Any, **kwargs: Any) -> None:
                real_insert(*args, **kwargs)
                if self.due():
                    raise self.fire(db_locked("INSERT INTO metrics"))

            monkeypatch.setattr(ckptdb.ledger.rows, "insert_metric_calls", insert_metric_calls)
        else:  # pragma: no cover
            raise AssertionError(kind)


def fault_places(backend: str, kind: str) -> tuple[int, ...]:
    """Whose work the fault hits: the first or the second stream's (the commit writes
    metrics once, and every stream's latest pointer in one statement, so those faults
    have only one place to hit). On PostgreSQL only the
    last place: which stream it hits is file work, and what the ledger does (every
    stream's row aborted) is the same."""
    places = (0,) if kind in ("commit_after_metrics", "commit_locked") else (0, 1)
    return places if backend == "sqlite" else places[-1:]


FAULT_CASES = [
    pytest.param(backend, kind, nth, id=f"{backend}-{kind}-{('first', 'second')[nth]}")
    for backend in ("sqlite", "postgres")
    for kind in FAULTS
    for nth in fault_places(backend, kind)
]


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "resaved-step"])
@pytest.mark.parametrize(("backend", "kind", "nth"), FAULT_CASES, indirect=["backend"])
def test_fault_before_commit_leaves_everything_as_before(
    warm: CheckpointManager,
    root: Path,
    db: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    resave: bool,
    nth: int,
) -> None:
    mgr = warm
    save_dir = mgr.save_dir
    step = 20 if resave else 30
    committed_before = committed(db)
    pointers_before = pointers(db)
    disk_before = disk(save_dir)
    best_before = mgr.best("best")
    first_new_id = max_checkpoint_id(db) + 1
    fault = Fault(kind, nth)
    fault.install(monkeypatch)

    with pytest.raises(PublishError) as info:
        mgr.save(step, metrics={"val_loss": 0.5}, **boundary(5.0))

    err = info.value
    assert isinstance(err, CkptDBError)
    assert fault.injected is not None, "the fault was never reached"
    assert err.phase == PHASE[kind]
    assert err.__cause__ is fault.injected
    assert err.cleanup_failures == []

    # the ledger's visible state is exactly as before the boundary
    assert committed(db) == committed_before
    assert pointers(db) == pointers_before
    assert mgr.best("best") == best_before
    # no temp or final file of the failed boundary is left; old files intact
    assert disk(save_dir) == disk_before
    assert temp_files(save_dir) == []

    # the boundary's rows are aborted, with the error recorded
    attempted = db.rows(
        "SELECT stream, step, state, path, error FROM checkpoints WHERE id >= ? ORDER BY id",
        first_new_id,
    )
    assert sorted(r[0] for r in attempted) == sorted(BOUNDARY)
    for stream_name, row_step, row_state, _path, error in attempted:
        assert (row_step, row_state) == (step, "aborted"), stream_name
        assert error and fault.message in error, (stream_name, error)
    failed = events(db, "publish_failed")
    assert [e[0] for e in failed] == [step]
    assert PHASE[kind] in failed[0][2]

    # .path names the file (or directory) the failed phase was working on
    finals = {r[0]: save_dir / r[3] for r in attempted}
    phase = PHASE[kind]
    if phase in ("write", "fsync"):  # the temp file, next to its final name
        final = finals[BOUNDARY[nth]]
        assert err.path is not None
        assert err.path.parent == final.parent
        assert err.path.name.startswith("." + final.name)
    elif phase == "replace":
        assert err.path == finals[BOUNDARY[nth]]
    elif phase == "fsync_dir":  # directories are synced in sorted order
        assert err.path == save_dir / sorted(BOUNDARY)[nth]

    # the fault was transient: the very same boundary now publishes
    monkeypatch.undo()
    result = mgr.save(step, metrics={"val_loss": 0.5}, **boundary(5.0))
    assert set(result) == set(BOUNDARY)
    assert {c.state for c in result.values()} == {"committed"}
    assert pointers(db) == {f"latest:{s}": c.id for s, c in result.items()}
    assert temp_files(save_dir) == []


@pytest.mark.parametrize("failing", [1, 2], ids=["second-payload", "third-payload"])
def test_boundary_is_atomic_across_streams(
    warm: CheckpointManager, db: LedgerClient, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """The 2nd (or 3rd) payload fails to serialize: the earlier streams do not commit."""
    before = committed(db), pointers(db), disk(warm.save_dir), warm.best("best")
    payloads = boundary(7.0)
    failing_obj = payloads[BOUNDARY[failing]]

    def hook(obj: Any, _f: Any) -> None:
        if obj is failing_obj:
            raise ValueError("cannot pickle this")

    calls = spy_save(monkeypatch, hook)
    with pytest.raises(PublishError) as info:
        warm.save(30, metrics={"val_loss": 0.1}, **payloads)

    assert info.value.phase == "write"
    assert isinstance(info.value.__cause__, ValueError)
    assert len(calls) == failing + 1  # the earlier streams really were written
    assert (committed(db), pointers(db), disk(warm.save_dir), warm.best("best")) == before
    states = db.rows("SELECT state, error FROM checkpoints WHERE step = 30")
    assert len(states) == 3
    assert all(s == "aborted" and "cannot pickle this" in (e or "") for s, e in states)
    assert [e[0] for e in events(db, "publish_failed")] == [30]


def test_interrupt_during_write_rolls_back_and_propagates(
    warm: CheckpointManager, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = committed(db), pointers(db), disk(warm.save_dir)

    def hook(_obj: Any, _f: Any) -> None:
        raise KeyboardInterrupt

    spy_save(monkeypatch, hook)
    with pytest.raises(KeyboardInterrupt):
        warm.save(30, metrics={"val_loss": 0.1}, **boundary(3.0))
    assert (committed(db), pointers(db), disk(warm.save_dir)) == before
    assert {s for (s,) in db.rows("SELECT state FROM checkpoints WHERE step = 30")} == {"aborted"}


def test_fsync_error_is_never_retried_into_success(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    real_fsync = os.fsync
    file_fsyncs: list[int] = []

    def fsync(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            file_fsyncs.append(fd)
            if len(file_fsyncs) == 1:  # only the first call fails: a retry would succeed
                raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(PublishError) as info:
        mgr.save(2, model=state(2.0))
    assert info.value.phase == "fsync"
    assert len(file_fsyncs) == 1
    assert [s for (s,) in db.rows("SELECT step FROM checkpoints WHERE state='committed'")] == [1]
    assert files(mgr.save_dir) == ["model/step-000000001.pt"]


def test_rollback_never_removes_a_file_it_did_not_write(
    open_manager: Opener, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    foreign = mgr.save_dir / "model" / "step-000000002.pt"
    foreign.write_bytes(b"someone else's file")

    def hook(_obj: Any, _f: Any) -> None:
        raise RuntimeError("boom")

    spy_save(monkeypatch, hook)
    with pytest.raises(PublishError):
        mgr.save(2, model=state(2.0))
    assert foreign.read_bytes() == b"someone else's file"

    monkeypatch.undo()
    ckpt = mgr.save(2, model=state(2.0))["model"]
    assert ckpt.path != foreign
    assert foreign.read_bytes() == b"someone else's file"


@pytest.mark.parametrize("link_to", ["outside", "dangling"])
def test_a_stream_directory_swapped_for_a_link_out_is_never_written_through(
    open_manager: Opener, tmp_path: Path, db: LedgerClient, link_to: str
) -> None:
    """A link put in place of a stream's directory, to outside the save directory: the
    next save of that stream is refused at its intent (nothing is written through the
    link, nothing is recorded but the failed intent) and what was published stays."""
    mgr = open_manager(streams={"model": Keep(last=1), "ema": Keep(last=1)})
    first = mgr.save(1, model=state(1.0), ema=state(1.0))
    outside = tmp_path / "elsewhere"
    if link_to == "outside":
        outside.mkdir()
    model = mgr.save_dir / "model"
    kept = first["model"].path.read_bytes()
    model.rename(tmp_path / "moved-model")
    model.symlink_to(outside, target_is_directory=True)
    ledger = "SELECT id, stream, step, state FROM checkpoints ORDER BY id"
    before = db.rows(ledger)
    # a link to nowhere is a directory gone, which held a committed checkpoint
    refusal = "is outside" if link_to == "outside" else r"does not exist \(or is not a dir"
    with pytest.raises(PublishError, match=refusal) as raised:
        mgr.save(2, model=state(2.0), ema=state(2.0))
    assert raised.value.phase == "intent"
    assert files(outside) == []
    assert db.rows(ledger) == before  # the intent rolled back: no row, for either stream
    assert mgr.latest("ema") == first["ema"]
    model.unlink()
    (tmp_path / "moved-model").rename(model)
    assert first["model"].path.read_bytes() == kept
    assert mgr.save(3, model=state(3.0), ema=state(3.0))["model"].step == 3


@pytest.mark.parametrize("how", ["moved_away", "dangling_link"])
def test_a_stream_directory_gone_under_a_running_job_is_not_made_again(
    open_manager: Opener, tmp_path: Path, db: LedgerClient, how: str
) -> None:
    """A filesystem unmounted under the run (a stream directory moved away, or its
    link left pointing at nothing): the next save made the directory again and went
    on without the stream's checkpoints, which the next open took for lost. It is
    refused at the intent instead, naming the directory; nothing is recorded or
    created, and the save goes through once the directory is back."""
    mgr = open_manager(streams={"model": Keep(last=None), "ema": Keep(last=1)})
    for step in (1, 2):
        mgr.save(step, model=state(float(step)), ema=state(float(step)))
    model = mgr.save_dir / "model"
    model.rename(tmp_path / "away")
    if how == "dangling_link":
        model.symlink_to(tmp_path / "nowhere")
    rows = "SELECT id, stream, step, state FROM checkpoints ORDER BY id"
    before = db.rows(rows)
    with pytest.raises(PublishError) as refused:
        mgr.save(3, metrics={"loss": 3.0}, model=state(3.0), ema=state(3.0))
    assert refused.value.phase == "intent"
    assert isinstance(refused.value.__cause__, RunDirectoryError)
    assert f"{model} (2 committed)" in str(refused.value) and "Nothing was saved" in str(
        refused.value
    )
    assert db.rows(rows) == before  # no row for step 3, not even for ema
    assert model.is_symlink() if how == "dangling_link" else not os.path.lexists(model)
    model.unlink(missing_ok=True)
    (tmp_path / "away").rename(model)
    mgr.save(4, model=state(4.0), ema=state(4.0))
    assert [c.step for c in mgr.checkpoints("model")] == [1, 2, 4]
    # the refused boundary's metrics are history, as for any failed intent
    assert db.rows("SELECT step, value FROM metrics WHERE name = 'loss'") == [(3, 3.0)]


@pytest.mark.parametrize("order", ["new_stream_first", "new_stream_last"])
def test_a_save_directory_gone_under_a_running_job_is_not_made_again_by_any_stream(
    open_manager: Opener, tmp_path: Path, db: LedgerClient, order: str
) -> None:
    """Every stream is checked before any directory is made: a new stream's first save
    (whose directory may be made) beside a stream whose directory is gone made the
    save directory again before the refusal."""
    mgr = open_manager(streams={"model": Keep(last=None), "new": Keep(last=1)})
    mgr.save(1, model=state(1.0))
    save_dir = mgr.save_dir
    save_dir.rename(tmp_path / "away")
    payloads = {"new": state(2.0), "model": state(2.0)}
    if order == "new_stream_last":
        payloads = dict(reversed(payloads.items()))
    with pytest.raises(PublishError, match=r"save directory .* does not exist") as refused:
        mgr.save(2, **payloads)
    assert isinstance(refused.value.__cause__, RunDirectoryError)
    assert f"make {save_dir / 'model'} an empty directory" in str(refused.value)
    assert not os.path.lexists(save_dir)
    assert db.rows("SELECT step FROM checkpoints ORDER BY id") == [(1,)]


def test_a_save_directory_of_framework_names_gone_under_a_running_job_is_not_made_again(
    open_manager: Opener, tmp_path: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    mgr.save(1, model=External(functools.partial(torch.save, state(1.0)), name="epoch=1.ckpt"))
    save_dir = mgr.save_dir
    save_dir.rename(tmp_path / "away")
    write = functools.partial(torch.save, state(2.0))
    with pytest.raises(PublishError, match=r"save directory .* does not exist.*1 committed"):
        mgr.save(2, model=External(write, name="epoch=2.ckpt"))
    assert not os.path.lexists(save_dir)


def test_a_framework_name_inside_a_gone_streams_directory_is_refused_too(
    open_manager: Opener, tmp_path: Path, db: LedgerClient
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    for step in (1, 2):
        write = functools.partial(torch.save, state(float(step)))
        mgr.save(step, model=External(write, name=f"model/sub-{step}/last.ckpt"))
    model = mgr.save_dir / "model"
    model.rename(tmp_path / "away")
    write = functools.partial(torch.save, state(3.0))
    with pytest.raises(PublishError, match=r"model \(2 committed\)"):
        mgr.save(3, model=External(write, name="model/sub-3/last.ckpt"))
    assert not os.path.lexists(model)
    assert db.rows("SELECT step FROM checkpoints ORDER BY id") == [(1,), (2,)]


def test_a_stream_directory_that_cannot_be_looked_at_fails_the_intent_typed(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    mgr.save(1, model=state(1.0))
    real_stat, model = os.stat, str(mgr.save_dir / "model")

    def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == model:
            raise PermissionError(13, "Permission denied (injected)", model)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(PublishError, match="cannot look at the directory") as refused:
        mgr.save(2, model=state(2.0))
    monkeypatch.undo()
    assert refused.value.phase == "intent"
    assert isinstance(refused.value.__cause__, RunDirectoryError)
    assert db.rows("SELECT step FROM checkpoints ORDER BY id") == [(1,)]


def test_a_new_streams_directory_and_one_made_empty_on_purpose_are_saved_into(
    open_manager: Opener, tmp_path: Path
) -> None:
    """The refusal is for a directory that held committed checkpoints: a stream's first
    save makes its directory, and one emptied on purpose (checkpoints gone for good)
    is saved into as before."""
    mgr = open_manager(streams={"model": Keep(last=None), "ema": Keep(last=1)})
    mgr.save(1, model=state(1.0))
    mgr.save(2, ema=state(2.0))  # ema's first save: its directory is made
    model = mgr.save_dir / "model"
    model.rename(tmp_path / "away")
    model.mkdir()
    assert mgr.save(3, model=state(3.0))["model"].path.parent == model


def test_a_stream_directory_swapped_for_a_loop_of_links_is_refused_and_the_run_reopens(
    open_manager: Opener, tmp_path: Path, db: LedgerClient
) -> None:
    """A link that leads back to itself: resolving it raised a bare RuntimeError (Python
    3.11), out of save() and out of the next open's reconcile."""
    mgr = open_manager(streams={"model": Keep(last=None)})
    mgr.save(1, model=state(1.0))
    model, moved = mgr.save_dir / "model", tmp_path / "moved-model"
    model.rename(moved)
    model.symlink_to(model)  # a loop
    with pytest.raises(PublishError) as raised:
        mgr.save(2, model=state(2.0))
    assert raised.value.phase == "intent"
    mgr.close()
    rows = "SELECT step, state FROM checkpoints ORDER BY id"
    before = db.rows(rows)
    with pytest.raises(RunDirectoryError, match=r"not a directory\).*model \(1 committed\)"):
        open_manager(streams={"model": Keep(last=None)})  # reconcile meets the loop
    assert db.rows(rows) == before  # the step-1 row not taken for lost
    model.unlink()
    moved.rename(model)
    mgr = open_manager(streams={"model": Keep(last=None)})
    assert db.rows("SELECT step FROM checkpoints WHERE step = 2 AND state = 'committed'") == []
    assert mgr.save(3, model=state(3.0))["model"].path.read_bytes()


@pytest.mark.parametrize(
    ("swapped_at", "phase"),
    [("after_intent", "write"), ("after_fsync", "replace"), ("after_replace", "fsync_dir")],
)
def test_a_stream_directory_swapped_for_a_link_mid_boundary_is_never_written_through(
    open_manager: Opener,
    tmp_path: Path,
    db: LedgerClient,
    swapped_at: str,
    phase: str,
) -> None:
    """The stream's directory is checked at the intent, and again at every later step:
    swapped for a link out of the save directory after the intent (before the write),
    after the write (before the rename) or after the rename (before the directory's
    fsync), nothing is written, renamed or synced through the link and nothing commits.
    Put back, the run reopens and saves again."""
    mgr = open_manager(streams={"model": Keep(last=None), "ema": Keep(last=1)})
    first = mgr.save(1, model=state(1.0), ema=state(1.0))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    model, moved = mgr.save_dir / "model", tmp_path / "moved-model"

    def swap(name: str) -> None:
        if name == swapped_at:
            model.rename(moved)
            model.symlink_to(outside, target_is_directory=True)

    previous = faults.set_hook(swap)
    try:
        with pytest.warns(CleanupWarning), pytest.raises(PublishError) as raised:
            mgr.save(2, model=state(2.0), ema=state(2.0))
    finally:
        faults.set_hook(previous)
    assert raised.value.phase == phase
    assert raised.value.path == (model if phase == "fsync_dir" else model / raised.value.path.name)
    assert isinstance(raised.value.__cause__, InvalidArgumentError)  # refused, not failed
    assert "is outside" in str(raised.value.__cause__)
    assert files(outside) == []
    committed_rows = "SELECT stream, step FROM checkpoints WHERE state = 'committed' ORDER BY 1"
    assert db.rows(committed_rows) == [("ema", 1), ("model", 1)]
    assert mgr.latest("model") == first["model"] and mgr.latest("ema") == first["ema"]
    mgr.close()
    model.unlink()
    moved.rename(model)
    mgr = open_manager(streams={"model": Keep(last=None), "ema": Keep(last=1)})
    assert db.rows("SELECT COUNT(*) FROM checkpoints WHERE state = 'pending'") == [(0,)]
    assert mgr.save(3, model=state(3.0), ema=state(3.0))["model"].step == 3
    assert [c.step for c in mgr.checkpoints("model")] == [1, 3]


# ----------------------------------------------------- cleanup failures


def test_rollback_cleanup_failure_is_attached_and_left_for_reconcile(
    open_manager: Opener, streams: dict[str, Any], db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams=streams)
    mgr.save(10, metrics={"val_loss": 1.0}, **boundary(1.0))
    before = committed(db), pointers(db)
    real_unlink = os.unlink
    refused: list[Path] = []

    def hook(_obj: Any, f: Any) -> None:
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        p = Path(path)
        if p.name.startswith(".") and p.parent.name == "model":
            refused.append(p)
            raise PermissionError(errno.EACCES, "Permission denied")
        real_unlink(path, *args, **kwargs)

    spy_save(monkeypatch, hook)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.warns(CleanupWarning) as warned, pytest.raises(PublishError) as info:
        mgr.save(20, model=state(2.0))

    err = info.value
    assert err.phase == "write"
    assert isinstance(err.__cause__, OSError)
    assert err.__cause__.errno == errno.ENOSPC
    assert len(refused) == 1
    leftover = refused[0]
    assert leftover.exists()
    assert [f.path for f in err.cleanup_failures] == [leftover]
    assert isinstance(err.cleanup_failures[0].error, PermissionError)
    assert str(leftover) in str(err)
    assert any(str(leftover) in str(w.message) for w in warned)
    # recorded for the next reconcile: the row stays pending, nothing became visible
    assert db.rows("SELECT stream, state FROM checkpoints WHERE step = 20") == [
        ("model", "pending")
    ]
    assert (committed(db), pointers(db)) == before
    assert any(str(leftover) in (d or "") for _s, _c, d in events(db, "cleanup_failed"))

    monkeypatch.undo()
    mgr.close()
    mgr2 = open_manager(streams=streams)  # reconcile runs at open
    assert not leftover.exists()
    assert db.rows("SELECT state FROM checkpoints WHERE step = 20") == [("aborted",)]
    assert temp_files(mgr2.save_dir) == []
    assert (committed(db), pointers(db)) == before
    assert mgr2.save(20, model=state(2.0))["model"].state == "committed"


def test_post_commit_cleanup_failure_does_not_fail_the_save(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    old = mgr.save(10, model=state(1.0))["model"]
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == old.path:
            raise PermissionError(errno.EACCES, "Permission denied")
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.warns(CleanupWarning, match=str(old.path.name)) as warned:
        result = mgr.save(20, model=state(2.0))

    new = result["model"]
    assert new.state == "committed" and new.step == 20
    assert any(str(old.path) in str(w.message) for w in warned)
    assert mgr.latest("model") == new
    assert pointers(db) == {"latest:model": new.id}
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old.id) == [("deleting",)]
    assert old.path.exists()
    failed = events(db, "cleanup_failed")
    assert len(failed) == 1
    assert failed[0][0] == 20 or failed[0][1] == old.id
    assert str(old.path) in failed[0][2]

    monkeypatch.undo()
    report = mgr.reconcile()
    assert not old.path.exists()
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old.id) == [("deleted",)]
    assert report.counts.get("deleted") == 1
    assert mgr.reconcile().actions == []  # idempotent
    assert files(mgr.save_dir) == ["model/step-000000020.pt"]


# ------------------------------------------------------------------ the guard


def trip_by_norm(guard: NonFiniteGradGuard, value: float, as_tensor: bool) -> None:
    guard.update(torch.tensor(value) if as_tensor else value)


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "float"])
@pytest.mark.parametrize(
    ("backend", "value"),
    on_both_backends([math.nan, math.inf, -math.inf], postgres=math.isnan),
    indirect=["backend"],
)
def test_tripped_guard_publishes_nothing(
    open_manager: Opener,
    streams: dict[str, Any],
    db: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
    value: float,
    as_tensor: bool,
) -> None:
    guard = NonFiniteGradGuard()
    mgr = open_manager(streams=streams, guard=guard)
    guard.update(torch.tensor(1.0))  # finite norms before do not matter
    trip_by_norm(guard, value, as_tensor)
    guard.update(torch.tensor(2.0))  # nor finite ones after
    calls = spy_save(monkeypatch)

    with pytest.raises(NonFiniteGradientError) as info:
        mgr.save(7, metrics={"val_loss": 1.0}, **boundary(1.0))

    err = info.value
    assert isinstance(err, CkptDBError) and isinstance(err, FloatingPointError)
    assert err.step == 7
    assert "7" in str(err)
    assert calls == []
    assert db.rows("SELECT * FROM checkpoints") == []
    assert pointers(db) == {}
    assert files(mgr.save_dir) == []
    assert [e[0] for e in events(db, "guard_tripped")] == [7]
    # reset whatever the outcome: the next boundary publishes
    assert guard.tripped() is False
    assert set(mgr.save(7, metrics={"val_loss": 1.0}, **boundary(1.0))) == set(BOUNDARY)
    assert len(events(db, "guard_tripped")) == 1


def test_tripped_guard_names_the_parameters(open_manager: Opener, db: LedgerClient) -> None:
    model = torch.nn.Linear(2, 1)
    guard = NonFiniteGradGuard(model)
    mgr = open_manager(guard=guard)
    model.weight.grad = torch.tensor([[math.nan, 1.0]])
    model.bias.grad = torch.tensor([0.5])
    guard.clip_grad_norm_(model.parameters(), max_norm=1.0)

    with pytest.raises(NonFiniteGradientError) as info:
        mgr.save(3, model=model.state_dict())
    assert info.value.parameters == ["weight"]
    assert "weight" in str(info.value) and "3" in str(info.value)
    assert db.rows("SELECT * FROM checkpoints") == []
    (detail,) = [e[2] for e in events(db, "guard_tripped")]
    assert "weight" in detail


class CountingGuard(NonFiniteGradGuard):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def tripped(self) -> bool:
        self.checks += 1
        return super().tripped()


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "tripped"])
@pytest.mark.parametrize("names", [("model",), ("model", "ema"), BOUNDARY])
def test_guard_is_checked_once_per_boundary(
    open_manager: Opener, streams: dict[str, Any], names: tuple[str, ...], bad: bool
) -> None:
    guard = CountingGuard()
    mgr = open_manager(streams=streams, guard=guard)
    if bad:
        guard.update(torch.tensor(math.nan))
    payloads = {n: p for n, p in boundary(1.0).items() if n in names}
    if bad:
        with pytest.raises(NonFiniteGradientError):
            mgr.save(1, metrics={"val_loss": 1.0}, **payloads)
    else:
        assert set(mgr.save(1, metrics={"val_loss": 1.0}, **payloads)) == set(names)
    assert guard.checks == 1


# ----------------------------------------------------------- metrics and top-K

BAD_RANKING_METRICS = [
    pytest.param(None, id="no-metrics"),
    pytest.param({}, id="empty"),
    pytest.param({"train_loss": 1.0}, id="other-metric"),
    pytest.param({"val_loss": math.nan}, id="nan"),
    pytest.param({"val_loss": math.inf}, id="inf"),
    pytest.param({"val_loss": -math.inf}, id="-inf"),
    pytest.param({"val_loss": torch.tensor(math.nan)}, id="tensor-nan"),
]


@pytest.mark.parametrize(
    ("backend", "metrics"),
    on_both_backends(BAD_RANKING_METRICS, postgres=lambda id_: id_ in ("no-metrics", "nan", "inf")),
    indirect=["backend"],
)
def test_topk_metric_must_be_present_and_finite(
    open_manager: Opener,
    streams: dict[str, Any],
    db: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
    metrics: Any,
) -> None:
    mgr = open_manager(streams=streams)
    mgr.save(1, metrics={"val_loss": 1.0}, **boundary(1.0))
    before = ledger_dump(db), disk(mgr.save_dir)
    calls = spy_save(monkeypatch)

    with pytest.raises(InvalidMetricError) as info:
        mgr.save(2, metrics=metrics, **boundary(2.0))

    assert isinstance(info.value, ValueError) and isinstance(info.value, CkptDBError)
    assert "val_loss" in str(info.value)
    assert calls == []
    assert (ledger_dump(db), disk(mgr.save_dir)) == before


@pytest.mark.parametrize("mode", ["min", "max"])
def test_candidate_outside_topk_is_not_written(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    sign = 1.0 if mode == "min" else -1.0
    mgr = open_manager(streams={"model": Keep(last=5), "best": TopK(2, "val_loss", mode=mode)})
    mgr.save(10, metrics={"val_loss": sign * 1.0}, model=state(1.0), best=state(1.0))
    mgr.save(20, metrics={"val_loss": sign * 2.0}, model=state(2.0), best=state(2.0))
    best_before = mgr.best("best")
    best_files = [n for n in files(mgr.save_dir) if n.startswith("best/")]
    calls = spy_save(monkeypatch)
    model_payload, best_payload = state(3.0), state(3.5)

    result = mgr.save(30, metrics={"val_loss": sign * 3.0}, model=model_payload, best=best_payload)

    assert set(result) == {"model"}
    assert result["model"].state == "committed"
    assert [id(c) for c in calls] == [id(model_payload)]
    assert mgr.best("best") == best_before
    assert [n for n in files(mgr.save_dir) if n.startswith("best/")] == best_files
    assert db.rows("SELECT stream FROM checkpoints WHERE step = 30") == [("model",)]
    assert mgr.latest("model") == result["model"]


@pytest.mark.parametrize("mode", ["min", "max"])
def test_topk_ties_go_to_the_earlier_step(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    mgr = open_manager(streams={"best": TopK(2, "val_loss", mode=mode)})
    a = mgr.save(10, metrics={"val_loss": 1.0}, best=state(1.0))["best"]
    b = mgr.save(20, metrics={"val_loss": 1.0}, best=state(2.0))["best"]
    calls = spy_save(monkeypatch)

    assert mgr.save(30, metrics={"val_loss": 1.0}, best=state(3.0)) == {}
    assert calls == []
    assert [c.step for c in mgr.best("best")] == [10, 20]

    c = mgr.save(5, metrics={"val_loss": 1.0}, best=state(0.5))["best"]
    assert [x.step for x in mgr.best("best")] == [5, 10]
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", b.id) == [("deleted",)]
    assert not b.path.exists()
    assert a.path.exists() and c.path.exists()


@pytest.mark.parametrize("new_value", [0.5, 1.5, 3.0], ids=["better", "same-rank", "worse"])
def test_resaving_a_topk_step_replaces_that_entry(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch, new_value: float
) -> None:
    mgr = open_manager(streams={"best": TopK(2, "val_loss")})
    old = mgr.save(10, metrics={"val_loss": 1.0}, best=state(1.0))["best"]
    other = mgr.save(20, metrics={"val_loss": 2.0}, best=state(2.0))["best"]
    old_bytes = old.path.read_bytes()
    old_ino = old.path.stat().st_ino

    def hook(_obj: Any, _f: Any) -> None:  # the old file is untouched while the new one is written
        assert old.path.stat().st_ino == old_ino
        assert old.path.read_bytes() == old_bytes

    spy_save(monkeypatch, hook)
    new = mgr.save(10, metrics={"val_loss": new_value}, best=state(9.0))["best"]

    assert new.path != old.path
    assert new.metric == new_value
    members = mgr.best("best")
    assert sorted((c.step, c.metric) for c in members) == sorted([(10, new_value), (20, 2.0)])
    assert [c.id for c in members] == sorted(
        [new.id, other.id], key=lambda i: {new.id: new_value, other.id: 2.0}[i]
    )
    assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old.id) == [("deleted",)]
    assert not old.path.exists()
    assert sorted(files(mgr.save_dir)) == sorted(
        [f"best/{new.path.name}", f"best/{other.path.name}"]
    )


def test_metric_values_are_stored_as_floats(
    open_manager: Opener, streams: dict[str, Any], db: LedgerClient
) -> None:
    mgr = open_manager(streams=streams)
    mgr.log_metrics(4, {"lr": 1, "loss": 0.5})
    result = mgr.save(5, metrics={"val_loss": 3, "epoch": 2}, **boundary(1.0))

    assert result["best"].metric == 3.0
    assert isinstance(result["best"].metric, float)
    # the type each value is stored with (SQLite types values, not columns)
    typeof, real = ("typeof", "real") if db.is_sqlite else ("pg_typeof", "double precision")
    ranked = db.rows(
        f"SELECT CAST({typeof}(metric) AS TEXT), metric FROM checkpoints WHERE stream = 'best'"
    )
    assert ranked == [(real, 3.0)]
    stored = db.rows(f"SELECT step, name, CAST({typeof}(value) AS TEXT), value FROM metrics")
    assert sorted(stored) == [
        (4, "loss", real, 0.5),
        (4, "lr", real, 1.0),
        (5, "epoch", real, 2.0),
        (5, "val_loss", real, 3.0),
    ]


BAD_METRIC_VALUES = [True, False, "1.0", None, 1j, [1.0], b"1"]


@pytest.mark.parametrize(
    ("backend", "value"),
    on_both_backends(BAD_METRIC_VALUES, postgres=lambda value: value is None, ids=repr),
    indirect=["backend"],
)
@pytest.mark.parametrize("where", ["save-ranked", "save-unranked", "log_metrics"])
def test_non_real_metric_values_are_rejected(
    open_manager: Opener, streams: dict[str, Any], db: LedgerClient, value: Any, where: str
) -> None:
    mgr = open_manager(streams=streams)
    mgr.save(1, metrics={"val_loss": 1.0}, **boundary(1.0))
    before = ledger_dump(db), disk(mgr.save_dir)

    with pytest.raises(TypeError) as info:
        if where == "save-ranked":
            mgr.save(2, metrics={"val_loss": value}, **boundary(2.0))
        elif where == "save-unranked":
            mgr.save(2, metrics={"val_loss": 1.0, "acc": value}, model=state(2.0))
        else:
            mgr.log_metrics(2, {"acc": value})

    assert isinstance(info.value, CkptDBError)
    mgr.flush()
    assert (ledger_dump(db), disk(mgr.save_dir)) == before


# ------------------------------------------------------------- timeline rule


def test_going_back_in_time_supersedes_the_abandoned_timeline(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = open_manager(streams={"model": Keep(last=5), "best": TopK(3, "val_loss")})
    old: dict[int, Checkpoint] = {}
    best: dict[int, Checkpoint] = {}
    for step, value in [(10, 3.0), (20, 2.0), (30, 1.0)]:
        result = mgr.save(step, metrics={"val_loss": value}, model=state(step), best=state(step))
        old[step], best[step] = result["model"], result["best"]
    old20_bytes = old[20].path.read_bytes()
    old20_ino = old[20].path.stat().st_ino

    def hook(_obj: Any, _f: Any) -> None:
        # the old step-20 file is still in place, unchanged, while the new one is written
        assert old[20].path.stat().st_ino == old20_ino
        assert old[20].path.read_bytes() == old20_bytes
        assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old[20].id) == [("committed",)]

    calls = spy_save(monkeypatch, hook)
    new20 = mgr.save(20, model=state(99.0))["model"]

    assert len(calls) == 1
    assert new20.path != old[20].path
    assert new20.path.parent == old[20].path.parent
    assert mgr.latest("model") == new20
    assert pointers(db)["latest:model"] == new20.id
    assert [(c.step, c.id) for c in mgr.checkpoints("model")] == [
        (10, old[10].id),
        (20, new20.id),
    ]
    for step in (20, 30):
        assert db.rows("SELECT state FROM checkpoints WHERE id = ?", old[step].id) == [("deleted",)]
        assert not old[step].path.exists()
    assert old[10].path.exists()
    # top-K members from the abandoned timeline stay by metric
    assert [c.step for c in mgr.best("best")] == [30, 20, 10]
    assert all(best[s].path.exists() for s in (10, 20, 30))
    loaded = mgr.load("latest")
    assert torch.equal(loaded["w"], state(99.0)["w"])


@pytest.mark.parametrize("resave", [10, 15, 30])
def test_timeline_rule_evicts_exactly_the_steps_at_or_after(
    open_manager: Opener, root: Path, resave: int
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    for step in (10, 20, 30):
        mgr.save(step, model=state(step))
    new = mgr.save(resave, model=state(0.0))["model"]
    steps = [c.step for c in mgr.checkpoints("model")]
    assert steps == [s for s in (10, 20, 30) if s < resave] + [resave]
    assert mgr.latest("model") == new
    assert len(files(mgr.save_dir)) == len(steps)


# --------------------------------------------------------------- retention


@pytest.mark.parametrize("last", [1, 2, 3, 5])
def test_keep_last_keeps_exactly_the_newest(open_manager: Opener, last: int) -> None:
    mgr = open_manager(streams={"model": Keep(last=last)})
    for step in range(0, 80, 10):
        mgr.save(step, model=state(step))
        steps = [c.step for c in mgr.checkpoints("model")]
        assert steps == list(range(0, step + 1, 10))[-last:]
        assert files(mgr.save_dir) == [f"model/step-{s:09d}.pt" for s in steps]


@pytest.mark.parametrize(
    ("policy", "steps", "kept"),
    [
        (Keep(last=2, every=3), range(1, 11), [3, 6, 9, 10]),
        (Keep(last=1, every=5), range(13), [0, 5, 10, 12]),
        (Keep(last=3, every=100), range(0, 500, 50), [0, 100, 200, 300, 350, 400, 450]),
    ],
)
def test_keep_every_keeps_multiples_forever(
    open_manager: Opener, db: LedgerClient, policy: Keep, steps: range, kept: list[int]
) -> None:
    mgr = open_manager(streams={"model": policy})
    for step in steps:
        mgr.save(step, model=state(step))
    assert [c.step for c in mgr.checkpoints("model")] == kept
    assert files(mgr.save_dir) == [f"model/step-{s:09d}.pt" for s in kept]
    expected_deleted = len(steps) - len(kept)
    assert db.rows("SELECT COUNT(*) FROM checkpoints WHERE state = 'deleted'") == [
        (expected_deleted,)
    ]


# --------------------------------------------------------------- bad input


BAD_CALLS = [
    pytest.param(lambda m: m.save(-1, model=state(1.0)), ValueError, id="negative-step"),
    pytest.param(lambda m: m.save(1.0, model=state(1.0)), TypeError, id="float-step"),
    pytest.param(lambda m: m.save(2.5, model=state(1.0)), TypeError, id="fractional-step"),
    pytest.param(lambda m: m.save(True, model=state(1.0)), TypeError, id="bool-step-true"),
    pytest.param(lambda m: m.save(False, model=state(1.0)), TypeError, id="bool-step-false"),
    pytest.param(lambda m: m.save(None, model=state(1.0)), TypeError, id="none-step"),
    pytest.param(lambda m: m.save("3", model=state(1.0)), TypeError, id="str-step"),
    pytest.param(lambda m: m.save(3), ValueError, id="no-payload"),
    pytest.param(lambda m: m.save(3, metrics={"val_loss": 1.0}), ValueError, id="metrics-only"),
    pytest.param(lambda m: m.save(3, nosuch=state(1.0)), UnknownStreamError, id="unknown-stream"),
    pytest.param(
        lambda m: m.save(3, model=state(1.0), nosuch=state(1.0)),
        UnknownStreamError,
        id="one-unknown-among-known",
    ),
    pytest.param(
        lambda m: m.save(3, **{"../model": state(1.0)}), UnknownStreamError, id="path-stream"
    ),
    pytest.param(
        lambda m: m.save(3, **{"ckptdb.sqlite": state(1.0)}),
        UnknownStreamError,
        id="ledger-name-stream",
    ),
    pytest.param(
        lambda m: m.save(3, metrics=[("val_loss", 1.0)], model=state(1.0)),
        TypeError,
        id="metrics-list",
    ),
    pytest.param(lambda m: m.save(3, metrics=1.0, model=state(1.0)), TypeError, id="metrics-float"),
    pytest.param(
        lambda m: m.save(3, metrics="val_loss", model=state(1.0)), TypeError, id="metrics-str"
    ),
    pytest.param(
        lambda m: m.save(3, metrics={1: 1.0}, model=state(1.0)), TypeError, id="metric-name-int"
    ),
    pytest.param(lambda m: m.log_metrics(-1, {"a": 1.0}), ValueError, id="log-negative-step"),
    pytest.param(lambda m: m.log_metrics(1.0, {"a": 1.0}), TypeError, id="log-float-step"),
    pytest.param(lambda m: m.log_metrics(1, [("a", 1.0)]), TypeError, id="log-metrics-list"),
]


@pytest.mark.parametrize(
    ("backend", "call", "builtin"),
    on_both_backends(
        BAD_CALLS,
        postgres=lambda id_: id_ in ("negative-step", "one-unknown-among-known", "log-float-step"),
    ),
    indirect=["backend"],
)
def test_bad_input_is_refused_and_changes_nothing(
    open_manager: Opener,
    streams: dict[str, Any],
    root: Path,
    db: LedgerClient,
    monkeypatch: pytest.MonkeyPatch,
    call: Callable[[CheckpointManager], Any],
    builtin: type[Exception],
) -> None:
    mgr = open_manager(streams=streams)
    mgr.save(1, metrics={"val_loss": 1.0}, **boundary(1.0))
    before = ledger_dump(db), disk(mgr.save_dir), sorted(files(root))
    calls = spy_save(monkeypatch)

    with pytest.raises(builtin) as info:
        call(mgr)

    assert isinstance(info.value, CkptDBError)
    if builtin in (ValueError, TypeError):
        assert isinstance(info.value, InvalidArgumentError)
    if builtin is UnknownStreamError:
        assert isinstance(info.value, ValueError)
    assert calls == []
    mgr.flush()  # nothing was buffered either
    assert (ledger_dump(db), disk(mgr.save_dir), sorted(files(root))) == before
    # the manager is still usable
    assert mgr.save(2, model=state(2.0))["model"].step == 2


# ------------------------------------------------------------------- metrics


@pytest.mark.parametrize("trigger", ["save", "flush", "close"])
def test_log_metrics_is_buffered_until_a_commit(
    open_manager: Opener, db: LedgerClient, trigger: str
) -> None:
    mgr = open_manager()
    mgr.log_metrics(1, {"loss": 0.75, "lr": 0.001})
    mgr.log_metrics(2, {"loss": 0.5})
    mgr.log_metrics(2, {"grad_norm": torch.tensor(1.25)})
    assert db.rows("SELECT * FROM metrics") == []

    if trigger == "save":
        mgr.save(2, model=state(1.0))
    elif trigger == "flush":
        mgr.flush()
    else:
        mgr.close()

    expected = [(1, "loss", 0.75), (1, "lr", 0.001), (2, "grad_norm", 1.25), (2, "loss", 0.5)]
    assert sorted(db.rows("SELECT step, name, value FROM metrics")) == expected
    attempts = db.rows("SELECT DISTINCT attempt_id FROM metrics")
    assert len(attempts) == 1 and attempts[0][0] is not None
    if trigger != "close":
        mgr.flush()
        mgr.close()
    assert sorted(db.rows("SELECT step, name, value FROM metrics")) == expected


@pytest.mark.parametrize(
    "kind", ["commit_after_metrics", "commit_locked", "torch_save_raises", "replace_exdev"]
)
def test_failed_boundary_loses_no_buffered_metric(
    open_manager: Opener, db: LedgerClient, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    mgr = open_manager()
    mgr.save(1, model=state(1.0))
    mgr.log_metrics(5, {"loss": 0.125})
    Fault(kind, 0).install(monkeypatch)

    with pytest.raises(PublishError):
        mgr.save(6, model=state(2.0))
    assert db.rows("SELECT * FROM metrics") == []

    monkeypatch.undo()
    mgr.save(6, model=state(2.0))
    assert db.rows("SELECT step, name, value FROM metrics") == [(5, "loss", 0.125)]
    mgr.flush()
    mgr.close()
    assert db.rows("SELECT step, name, value FROM metrics") == [(5, "loss", 0.125)]


# ------------------------------------------------------------ closed manager

CLOSED_CALLS = [
    pytest.param(lambda m: m.save(9, model=state(1.0)), id="save"),
    pytest.param(lambda m: m.latest(), id="latest"),
    pytest.param(lambda m: m.best("best"), id="best"),
    pytest.param(lambda m: m.checkpoints(), id="checkpoints"),
    pytest.param(lambda m: m.load(), id="load"),
    pytest.param(lambda m: m.log_metrics(9, {"loss": 1.0}), id="log_metrics"),
    pytest.param(lambda m: m.flush(), id="flush"),
    pytest.param(lambda m: m.reconcile(), id="reconcile"),
]


@pytest.mark.parametrize("how", ["close", "context"])
@pytest.mark.parametrize(
    ("backend", "call"),
    on_both_backends(
        CLOSED_CALLS, postgres=lambda id_: id_ in ("save", "latest", "flush", "reconcile")
    ),
    indirect=["backend"],
)
def test_closed_manager_refuses_work(
    open_manager: Opener,
    streams: dict[str, Any],
    root: Path,
    db: LedgerClient,
    call: Callable[[CheckpointManager], Any],
    how: str,
) -> None:
    if how == "close":
        mgr = open_manager(streams=streams)
        mgr.save(1, metrics={"val_loss": 1.0}, **boundary(1.0))
        mgr.close()
        mgr.close()  # idempotent
    else:
        with CheckpointManager(root, streams=streams, db_url=db.db_url) as mgr:
            mgr.save(1, metrics={"val_loss": 1.0}, **boundary(1.0))
    before = ledger_dump(db), disk(mgr.save_dir)

    with pytest.raises(CkptDBError):
        call(mgr)
    assert (ledger_dump(db), disk(mgr.save_dir)) == before
