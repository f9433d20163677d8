"""The seams the protocol is built on (docs/architecture.md), each tested on its own.

- the ledger's transaction: work queued with ``after_commit`` runs only after
  COMMIT, in order, never after a rollback; a failing piece does not stop the
  file work behind it; driver errors become ``DatabaseError`` in one place;
- errors: every public error class survives its wire form (type, message,
  declared fields), as ranks need to agree on one error;
- the payload store: the protocol reaches payloads only through it, in the
  documented order, and ``verify`` sorts a bad payload into lost or corrupt;
- policies: preservation rules compose;
- warnings point at the caller's line, wherever the clean-up ran.
"""

from __future__ import annotations

import errno
import inspect
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
import torch
from helpers import rows, state

import ckptdb.errors as e
from ckptdb import CheckpointManager, CleanupWarning, Keep, NonFiniteGradGuard, Sharded, TopK
from ckptdb.coord.base import LocalCoordinator
from ckptdb.ledger import after_commit, open_ledger
from ckptdb.ledger.engine import default_sqlite_url
from ckptdb.policies import AnyOf, Best, Entry, EveryStep, Newest, policy_from_record
from ckptdb.storage.base import CORRUPT, LOST, FileInfo, Finding, Found
from ckptdb.storage.local import LocalStore

# ------------------------------------------------------------- after_commit


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Any]:
    db = open_ledger(default_sqlite_url(tmp_path))
    db.migrate()
    yield db
    db.dispose()


def test_after_commit_work_runs_in_order_once_committed(ledger: Any) -> None:
    seen: list[str] = []
    with ledger.transaction() as session:
        session.connection().exec_driver_sql("CREATE TABLE t (x INTEGER)")
        session.connection().exec_driver_sql("INSERT INTO t VALUES (1)")

        def first() -> None:
            # the data is committed: another transaction sees it
            with ledger.transaction(read=True) as other:
                seen.append(
                    f"first saw {other.connection().exec_driver_sql('SELECT x FROM t').scalar()}"
                )

        after_commit(session, first)
        after_commit(session, lambda: seen.append("second"))
        assert seen == []  # nothing runs before COMMIT
    assert seen == ["first saw 1", "second"]


def test_after_commit_work_never_runs_after_a_rollback(ledger: Any) -> None:
    seen: list[str] = []
    with pytest.raises(ZeroDivisionError), ledger.transaction() as session:
        after_commit(session, lambda: seen.append("ran"))
        raise ZeroDivisionError
    assert seen == []


def test_a_failing_piece_does_not_stop_the_work_behind_it(ledger: Any) -> None:
    seen: list[str] = []

    def boom(text: str) -> Callable[[], None]:
        def fail() -> None:
            raise RuntimeError(text)

        return fail

    with pytest.raises(RuntimeError, match="first") as info, ledger.transaction() as session:
        after_commit(session, boom("first"))
        after_commit(session, lambda: seen.append("file work"))
        after_commit(session, boom("second"))
    assert seen == ["file work"]
    assert any("second" in note for note in getattr(info.value, "__notes__", [])), info.value


def test_an_interrupt_stops_the_queue(ledger: Any) -> None:
    seen: list[str] = []

    def interrupt() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), ledger.transaction() as session:
        after_commit(session, interrupt)
        after_commit(session, lambda: seen.append("ran"))
    assert seen == []


def test_driver_errors_become_database_errors_in_one_place(ledger: Any) -> None:
    with pytest.raises(e.DatabaseError) as info, ledger.transaction() as session:
        session.connection().exec_driver_sql("SELECT * FROM no_such_table")
    err = info.value
    assert isinstance(err, e.LedgerError) and isinstance(err, RuntimeError)
    assert isinstance(err.__cause__, sqlalchemy.exc.OperationalError)
    assert err.original is err.__cause__
    assert "no such table: no_such_table" in str(err)
    assert "[SQL:" not in str(err)  # the driver's first line, not SQLAlchemy's dump


def test_a_locked_ledger_on_flush_is_a_database_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.log_metrics(1, {"loss": 0.5})
        holder = sqlite3.connect(root / "ckptdb.sqlite", timeout=0)
        holder.execute("BEGIN IMMEDIATE")
        engine = mgr._ctx.ledger.engine
        engine.dispose()  # new connections pick up the short busy timeout below
        pool_connect = engine.pool._creator  # type: ignore[attr-defined]
        engine.pool._creator = lambda: _short_timeout(pool_connect())  # type: ignore[attr-defined]
        try:
            with pytest.raises(e.DatabaseError, match="database is locked") as info:
                mgr.flush()
        finally:
            holder.rollback()
            holder.close()
        assert isinstance(info.value.__cause__, sqlalchemy.exc.OperationalError)
        mgr.flush()  # nothing was lost: the buffered point is written now
    assert rows(root, "SELECT step, name, value FROM metrics") == [(1, "loss", 0.5)]


def _short_timeout(conn: Any) -> Any:
    conn.execute("PRAGMA busy_timeout = 50")
    return conn


# ------------------------------------------------------------------ errors


def _public_errors() -> list[type[e.CkptDBError]]:
    return sorted(
        (
            c
            for c in vars(e).values()
            if inspect.isclass(c) and issubclass(c, e.CkptDBError) and c is not e.PhaseError
        ),
        key=lambda c: c.__name__,
    )


def _example(cls: type[e.CkptDBError]) -> e.CkptDBError:
    if issubclass(cls, e.PublishError):
        failure = e.CleanupFailure(Path("/run/x.tmp"), PermissionError(13, "denied"))
        return cls(
            "step 3 not published",
            phase="fsync",
            step=3,
            path=Path("/run/x"),
            stream="model",
            cleanup_failures=[failure],
        )
    if issubclass(cls, e.NonFiniteGradientError):
        return cls("nan", step=7, parameters=["fc.weight"])
    if issubclass(cls, e.LedgerLockedError):
        return cls("locked", holder={"pid": 12, "host": "h"})
    return cls(f"a {cls.__name__}")


@pytest.mark.parametrize("cls", _public_errors(), ids=lambda c: c.__name__)
def test_every_error_survives_its_wire_form(cls: type[e.CkptDBError]) -> None:
    original = _example(cls)
    original.stage = 2
    wire = e.encode(3, original)
    rebuilt = e.decode(wire)
    assert type(rebuilt) is cls
    assert rebuilt.ranks == [3] and rebuilt.stage == 2
    assert str(rebuilt) == f"rank 3: {original}"
    for name, value in vars(original).items():
        if name in ("ranks", "stage"):
            continue
        got = getattr(rebuilt, name)
        if name == "cleanup_failures":
            assert [(f.path, type(f.error), str(f.error)) for f in got] == [
                (f.path, type(f.error), str(f.error)) for f in value
            ]
        else:
            assert got == value, name


def test_an_internal_phase_error_arrives_as_a_publish_error() -> None:
    failure = e.PhaseError("fsync", Path("/run/model/.x.tmp-1"), OSError(errno.EIO, "EIO"))
    rebuilt = e.decode(e.encode(0, failure))
    assert type(rebuilt) is e.PublishError
    assert (rebuilt.phase, rebuilt.path) == ("fsync", Path("/run/model/.x.tmp-1"))


def test_an_error_that_is_not_ours_arrives_as_the_fallback() -> None:
    rebuilt = e.decode(e.encode(1, KeyError("w"), fallback="RankFailedError"))
    assert type(rebuilt) is e.RankFailedError
    assert str(rebuilt) == "rank 1: KeyError: 'w'" and rebuilt.ranks == [1]


# -------------------------------------------------------------- the store seam


class RecordingStore:
    """A PayloadStore that records each call and delegates to a LocalStore."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.calls = inner, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.inner, name)
        if not callable(real):
            return real

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return real(*args, **kwargs)

        return recorded


def test_the_protocol_reaches_payloads_only_through_the_store(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", streams={"model": Keep(last=1)}) as mgr:
        mgr.save(1, model=state(1.0))
        store = RecordingStore(mgr._ctx.store)  # type: ignore[arg-type]
        mgr._ctx.store = store  # type: ignore[assignment]
        mgr.save(2, model=state(2.0))  # evicts step 1
        boundary = list(store.calls)
        store.calls.clear()
        assert torch.equal(mgr.load()["w"], state(2.0)["w"])
        loading = list(store.calls)
    # intent (the save and stream directories still there), write a temporary object,
    # place it durably, and after the commit remove
    assert boundary == [
        "absent",
        "absent",
        "prepare_stream",
        "exists",
        "write_object",
        "place",
        "sync_placed",
        "remove",
    ]
    # verify (which confines the name and holds the bytes it hashed), then the read of
    # those held bytes: the file is not opened again by its path, nor its name resolved
    assert loading == ["verify", "open_verified", "forget_verified"]


class NotTheChief(LocalCoordinator):
    """A rank other than the chief, alone: each agreement is its own outcome."""

    is_chief = False


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "directory"])
def test_a_rank_that_is_not_the_chief_confines_what_it_reads_by_path(
    tmp_path: Path, sharded: bool
) -> None:
    """The chief's verify confined the name; another rank that reads a directory by its
    path confines the name itself (``local_path``), and one that reads a file verifies
    its own read (which confines it) and reads the bytes it hashed."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, model=Sharded(state(1.0)) if sharded else state(1.0))
        store = RecordingStore(mgr._ctx.store)  # type: ignore[arg-type]
        mgr._ctx.store = store  # type: ignore[assignment]
        mgr._loader.coord = NotTheChief()
        into = state(0.0) if sharded else None
        loaded = mgr.load(into=into)
        assert torch.equal(loaded["w"], state(1.0)["w"])
    calls = [c for c in store.calls if c in ("verify", "local_path", "open_verified")]
    if sharded:  # the chief's verify, then this rank's own confinement, then a read by path
        assert calls[:2] == ["verify", "local_path"] and "open_verified" not in calls
    else:  # the chief's verify, this rank's own, then its own held bytes
        assert calls == ["verify", "verify", "open_verified"]


def test_threads_loading_at_once_keep_their_own_verified_bytes(tmp_path: Path) -> None:
    """A verify holds the bytes its load reads next; another thread's verify, load or
    refused load in between must neither replace nor drop them."""
    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    infos = {
        rel: store.write_object(rel, lambda f, v=v: torch.save({"w": v}, f))
        for rel, v in (("model/a.pt", 1.0), ("model/b.pt", 2.0))
    }

    def verify(rel: str) -> None:
        assert store.verify(rel, infos[rel].size, infos[rel].hash, full=True, keep=True) is None

    verify("model/a.pt")
    other = threading.Thread(target=lambda: (verify("model/b.pt"), store.forget_verified()))
    other.start()
    other.join(10)
    held = store.open_verified("model/a.pt")
    assert held is not None and held.load(None, True) == {"w": 1.0}


def test_a_load_refused_after_its_verify_holds_nothing(tmp_path: Path) -> None:
    """The verify of a load holds the whole payload for the read that follows; a load
    refused between the two (here: ``into=`` for a file) must not leave it held until
    the next verify."""
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, model=state(1.0))
        with pytest.raises(e.InvalidArgumentError, match="into= is for sharded"):
            mgr.load(into={"w": torch.zeros(4)})
        assert mgr._ctx.store._held is None  # type: ignore[attr-defined]
        assert torch.equal(mgr.load()["w"], state(1.0)["w"])


def test_verify_sorts_a_bad_payload_into_lost_or_corrupt(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    info = store.write_object("model/a.pt", lambda f: f.write(b"x" * 100))
    assert (
        info == FileInfo(100, info.hash)
        and store.verify("model/a.pt", 100, info.hash, full=True) is None
    )

    missing = store.verify("model/gone.pt", 100, info.hash, full=True)
    assert isinstance(missing, Finding) and missing.state == LOST and missing.missing
    assert isinstance(missing.error, FileNotFoundError)

    short = store.verify("model/a.pt", 99, info.hash, full=False)
    assert short is not None and short.state == CORRUPT and short.actual == FileInfo(100, "")

    flipped = store.verify("model/a.pt", 100, "0" * 32, full=True)
    assert flipped is not None and flipped.state == CORRUPT and "hash" in flipped.detail
    assert store.verify("model/a.pt", 100, "0" * 32, full=False) is None  # size-only pass

    escaping = store.verify("../outside.pt", 1, "", full=True)
    assert escaping is not None and escaping.state == LOST and not escaping.missing
    assert isinstance(escaping.error, e.InvalidArgumentError)

    sharded = tmp_path / "model" / "step-000000001.dcp"
    sharded.mkdir()
    (sharded / "link").symlink_to(tmp_path / "model" / "a.pt")
    linked = store.verify("model/step-000000001.dcp", 0, "", full=True)
    assert linked is not None and linked.state == CORRUPT
    assert isinstance(linked.error, e.ForeignEntryError)


def test_the_store_lists_only_what_is_ours(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "model").mkdir()
    for name in ("step-000000001.pt", ".step-000000002.pt.tmp-7", "notes.txt", "step-1.pt"):
        (tmp_path / "model" / name).write_bytes(b"x")
    (tmp_path / "model" / "step-000000003.pt").symlink_to(tmp_path / "model" / "notes.txt")
    assert list(store.list_ours()) == [
        Found("model", ".step-000000002.pt.tmp-7", "temp"),
        Found("model", "step-000000001.pt", "checkpoint"),
    ]


def test_local_store_has_every_method_of_the_seam() -> None:
    from ckptdb.storage.base import PayloadStore

    wanted = {n for n in vars(PayloadStore) if not n.startswith("_")}
    missing = {n for n in wanted if not hasattr(LocalStore, n)}
    assert wanted and not missing, missing
    assert isinstance(LocalStore(Path("/")).memoized(), AbstractContextManager)


# ------------------------------------------------------------------ policies


def entries(*steps: int, metric: float | None = None) -> list[Entry]:
    return [
        Entry(id=i, step=s, metric=metric if metric is not None else float(s))
        for i, s in enumerate(steps)
    ]


def test_preservation_rules_compose() -> None:
    found = entries(10, 20, 30, 40, 50)
    assert Newest(2).keeps(found) == {3, 4}
    assert EveryStep(20).keeps(found) == {1, 3}
    assert Best(1, "max").keeps(found) == {4} and Best(1, "min").keeps(found) == {0}
    assert AnyOf((Newest(1), EveryStep(20))).keeps(found) == {1, 3, 4}
    # Keep(last, every) is exactly that composition
    keep = Keep(last=1, every=20)
    assert {x.id for x in keep.window_evictions(found)} == {0, 2}


@pytest.mark.parametrize("policy", [Keep(last=3), Keep(last=None, every=5), TopK(2, "loss", "max")])
def test_a_policy_survives_its_stored_form(policy: Any) -> None:
    assert policy_from_record(policy.to_record()) == policy


# ------------------------------------------------------------------ façade details


def test_cleanup_warnings_point_at_the_callers_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptdb.storage.files

    real = ckptdb.storage.files.remove

    def stubborn(path: Path) -> bool:
        if path.name == "step-000000001.pt":
            raise PermissionError(errno.EACCES, "denied (injected)", str(path))
        return real(path)

    with CheckpointManager(tmp_path / "run", streams={"model": Keep(last=1)}) as mgr:
        mgr.save(1, model=state(1.0))
        monkeypatch.setattr(ckptdb.storage.files, "remove", stubborn)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.save(2, model=state(2.0))
        cleanup = [w for w in caught if issubclass(w.category, CleanupWarning)]
        assert cleanup, [str(w.message) for w in caught]
        assert all(os.path.samefile(w.filename, __file__) for w in cleanup), [
            (w.filename, w.lineno) for w in cleanup
        ]


def test_the_guard_can_be_replaced_between_boundaries(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    with CheckpointManager(tmp_path / "run") as mgr:
        guard = NonFiniteGradGuard(model)
        mgr.guard = guard
        guard.update(torch.tensor(float("nan")))
        with pytest.raises(e.NonFiniteGradientError):
            mgr.save(1, model=state(1.0))
        with pytest.raises(e.ArgumentTypeError):
            mgr.guard = "not a guard"  # type: ignore[assignment]
        mgr.guard = None
        assert mgr.save(2, model=state(2.0))["model"].step == 2


def test_save_handle_is_exported_for_annotations(tmp_path: Path) -> None:
    import ckptdb
    from ckptdb.protocol.asyncsave import SaveHandle

    assert ckptdb.SaveHandle is SaveHandle and "SaveHandle" in ckptdb.__all__
    with CheckpointManager(tmp_path / "run") as mgr:
        handle = mgr.save(1, model=state(1.0), blocking=False)
        assert isinstance(handle, ckptdb.SaveHandle)
        assert handle.result()["model"].step == 1


def test_reconcile_logs_under_the_name_users_configure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
        stray = mgr.save_dir / "model" / ".step-000000009.pt.tmp-999"
    stray.write_bytes(b"half")
    with caplog.at_level("INFO", logger="ckptdb.reconcile"), CheckpointManager(root):
        pass
    assert any(
        r.name == "ckptdb.reconcile" and "removed_temp" in r.getMessage() for r in caplog.records
    ), [(r.name, r.getMessage()) for r in caplog.records]


class _Unstorable:
    """Implements the Policy protocol, but of a kind the ledger cannot rebuild."""

    kind = "mine"
    ranking_metric = None
    capacity = None

    def admits(self, members: Any, candidate: Any) -> bool:
        return True

    def evictions(self, committed: Any, new: Any) -> list[Entry]:
        return []

    def window_evictions(self, committed: Any) -> list[Entry]:
        return []

    def ranked(self, members: Any) -> list[Entry]:
        return list(members)

    def describe(self) -> str:
        return "mine"

    def to_record(self) -> Any:
        from ckptdb.policies import PolicyRecord

        return PolicyRecord(self.kind)


def test_a_policy_the_ledger_cannot_rebuild_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with pytest.raises(e.ArgumentTypeError, match="must be Keep or TopK"):
        CheckpointManager(root, streams={"model": _Unstorable()})  # type: ignore[dict-item]
    assert not root.exists()  # bad input changes nothing
