"""The bad input corpus: malformed input across the API and the CLI.

Every case is one parametrized test. API cases must raise a typed
:class:`~ckptdb.errors.CkptDBError` subclass that is also the natural built-in
(``ValueError``, ``TypeError``, ``LookupError``, ``OSError``, ``RuntimeError``);
CLI cases must exit 1 (2 for usage errors) with exactly one ``Error:`` line on
stderr, no traceback and no "unexpected" (untyped) error. Either way nothing
may change on disk or in the ledger: the test images every file and directory
under its temporary directory (content hashes) and every row of every table of
every ledger there, before and after.

Two things are deliberately left out of the image: SQLite's ``-wal`` and
``-shm`` files (any connection, even a read-only one, may create them; the
ledger is compared row by row instead), and the writer lock's files
``ckptdb.lock`` / ``ckptdb.owner`` next to an existing ledger (a writer must
take the lock before it may read the ledger at all). A root without a ledger
gets no exception: not even the lock files may appear there.

A few inputs change the ledger by design, and the test checks exactly that
change: an unpicklable payload is a failed boundary (its rows ``aborted``, a
``publish_failed`` event); loading a damaged or vanished file marks its row
``corrupt`` / ``lost``; a non-finite ranking metric is refused, but its value
stays in the metric history like any logged metric (written at the next
flush), as for a boundary the guard refuses.
"""

from __future__ import annotations

import decimal
import math
import os
import sqlite3
import string
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import boundary, cli_subprocess, digest, state

from ckptdb import CheckpointManager, External, Keep, NonFiniteGradGuard, TopK
from ckptdb.cli import main
from ckptdb.errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CkptDBError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidMetricError,
    LedgerError,
    PublishError,
    SchemaVersionError,
    UnknownStreamError,
)
from ckptdb.storage import TEMP_NAME

LEDGER = "ckptdb.sqlite"
LOCK_FILES = ("ckptdb.lock", "ckptdb.owner")
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")
STREAMS = {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(2, "val_loss")}
GARBAGE = b"this is not a database, just some bytes\x00\xff" * 200

pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")


# ----------------------------------------------------------- images of the disk


def ledger_rows(path: Path) -> Any:
    """Every row of every table, as (column, value) pairs; a string if not SQLite."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        return f"<unreadable: {exc}>"
    con.row_factory = sqlite3.Row
    try:
        tables = [
            name
            for (name,) in con.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return {
            t: sorted(
                (
                    tuple(zip(r.keys(), tuple(r), strict=True))
                    for r in con.execute(f'SELECT * FROM "{t}"')
                ),
                key=repr,
            )
            for t in tables
        }
    except sqlite3.DatabaseError as exc:
        return f"<unreadable: {exc}>"
    finally:
        con.close()


def image(base: Path, *, ledger_bytes: bool = True) -> dict[str, Any]:
    """Every entry under ``base``: directories, files (hash), ledgers (hash and rows)."""
    out: dict[str, Any] = {}
    for p in sorted(base.rglob("*")):
        rel = p.relative_to(base).as_posix()
        if p.name.endswith(SQLITE_SIDE_FILES):
            continue
        if p.name in LOCK_FILES and (p.parent / LEDGER).exists():
            continue
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        elif p.name == LEDGER:
            out[rel] = ("ledger", digest(p) if ledger_bytes else None, ledger_rows(p))
        else:
            out[rel] = ("file", digest(p))
    return out


def table_diff(before: Any, after: Any) -> dict[str, tuple[list[Any], list[Any]]]:
    """Per changed table: (rows removed, rows added), each row as a dict."""
    assert isinstance(before, dict) and isinstance(after, dict), (before, after)
    diff = {}
    for table in sorted(before.keys() | after.keys()):
        old, new = before.get(table, []), after.get(table, [])
        if old != new:
            removed = [dict(r) for r in old if r not in new]
            added = [dict(r) for r in new if r not in old]
            diff[table] = (removed, added)
    return diff


def assert_only_expected_change(
    before: dict[str, Any], after: dict[str, Any], change: str, ledger_key: str | None
) -> None:
    if change == "same" or ledger_key is None:
        assert after == before
        return
    rest_before = {k: v for k, v in before.items() if k != ledger_key}
    rest_after = {k: v for k, v in after.items() if k != ledger_key}
    assert rest_after == rest_before  # no file or directory changed
    diff = table_diff(before[ledger_key][2], after[ledger_key][2])
    if change == "aborted":  # a failed boundary: aborted rows and one publish_failed event
        assert {"checkpoints", "events"} <= set(diff) <= {"checkpoints", "events", "metrics"}
        if "metrics" in diff:  # a failed boundary loses none of its metrics (documented)
            removed, added = diff["metrics"]
            assert removed == [] and {r["name"] for r in added} == {"val_loss"}, diff
        removed, added = diff["checkpoints"]
        assert removed == [] and added and {r["state"] for r in added} == {"aborted"}, diff
        removed, added = diff["events"]
        assert removed == [] and [e["kind"] for e in added] == ["publish_failed"], diff
    elif change in ("corrupt", "lost"):  # one committed row marked, latest repointed
        assert set(diff) <= {"checkpoints", "events", "pointers"} and "checkpoints" in diff
        removed, added = diff["checkpoints"]
        assert [r["state"] for r in removed] == ["committed"], diff
        assert [(r["id"], r["state"]) for r in added] == [(removed[0]["id"], change)], diff
        removed, added = diff["events"]
        assert removed == [] and [e["kind"] for e in added] == [change], diff
    elif change == "metrics":  # the refused call's metric values, and nothing else
        assert set(diff) == {"metrics"}, diff
        removed, added = diff["metrics"]
        assert removed == [] and {r["name"] for r in added} == {"val_loss"}, diff
    else:  # pragma: no cover
        raise AssertionError(change)


# -------------------------------------------------------------- what cases act on


def build_run(root: Path) -> Path:
    """A closed run: model/ema/best at steps 1 and 2, a logged metric."""
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.log_metrics(0, {"loss": 1.0})
        for step in (1, 2):
            mgr.save(step, metrics={"val_loss": 3.0 - step}, **boundary(float(step)))
    return root


def build_newer(root: Path) -> Path:
    build_run(root)
    con = sqlite3.connect(root / LEDGER)
    with con:
        con.execute("UPDATE alembic_version SET version_num = 'ffff'")
    con.close()
    return root


def build_garbage(root: Path) -> Path:
    root.mkdir()
    (root / LEDGER).write_bytes(GARBAGE)
    return root


def build_ledger_dir(root: Path) -> Path:
    (root / LEDGER).mkdir(parents=True)
    return root


def build_empty_ledger(root: Path) -> Path:
    """A zero-byte ledger (a truncated file) next to a checkpoint in our naming."""
    (root / "checkpoints" / "model").mkdir(parents=True)
    (root / LEDGER).write_bytes(b"")
    torch.save(state(1.0), root / "checkpoints" / "model" / "step-000000001.pt")
    return root


def build_notrun(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    (root / "notes.txt").write_text("keep me")
    return root


def build_file(path: Path) -> Path:
    path.write_text("a plain file, not a directory")
    return path


def _refuses_new_files(directory: Path) -> bool:
    probe = directory / ".ckptdb-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return True
    os.close(fd)
    probe.unlink()
    return False


def build_readonly(root: Path) -> Path:
    """A run root where nothing can be created.

    Without privileges: a run made read-only with chmod 0o555. As root, chmod
    does not stop writes, so an existing directory of a read-only pseudo file
    system is used instead (skipped if there is none).
    """
    if os.geteuid() != 0:
        build_run(root)
        root.chmod(0o555)
        return root
    for candidate in (Path("/sys/kernel"), Path("/sys"), Path("/proc/self")):
        if candidate.is_dir() and _refuses_new_files(candidate):
            return candidate
    pytest.skip("running as root and no directory here refuses new files: cannot make one")


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "run": build_run,
    "newer": build_newer,
    "garbage": build_garbage,
    "ledgerdir": build_ledger_dir,
    "emptyledger": build_empty_ledger,
    "notrun": build_notrun,
    "afile": build_file,
    "readonly": build_readonly,
}


@dataclass
class Env:
    tmp: Path
    paths: dict[str, Path] = field(default_factory=dict)
    mgr: CheckpointManager | None = None
    to_close: list[Any] = field(default_factory=list)

    def __getitem__(self, name: str) -> Path:
        """A built target, or (for any other name) a path under tmp that does not exist."""
        return self.paths.get(name, self.tmp / name)

    @property
    def m(self) -> CheckpointManager:
        assert self.mgr is not None
        return self.mgr


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path / "t")
    e.tmp.mkdir()
    yield e
    if e.mgr is not None:
        e.mgr.close()
    for resource in e.to_close:
        resource.close()
    for path in e.paths.values():
        if path.is_relative_to(e.tmp) and path.is_dir():
            path.chmod(0o755)  # a read-only root, so that pytest can remove it


def build(env: Env, needs: tuple[str, ...]) -> None:
    for name in needs:
        env.paths[name] = BUILDERS[name](env.tmp / name)


# ----------------------------------------------------------------- the API corpus


@dataclass(frozen=True)
class ApiCase:
    call: Callable[[Env], Any]
    error: type[CkptDBError]
    builtin: type[BaseException]
    on: str = "manager"  # manager: an open manager on a run | open: opening one | pure
    needs: tuple[str, ...] = ("run",)
    ledger: str = "same"  # same | aborted | corrupt | lost | metrics (see the docstring)
    prepare: Callable[[Env], None] | None = None  # damage done before the "before" image
    check: Callable[[Env, BaseException], None] | None = None


def api(
    case_id: str,
    call: Callable[[Env], Any],
    error: type[CkptDBError],
    builtin: type[BaseException],
    **kwargs: Any,
) -> Any:
    if kwargs.get("on") == "pure":
        kwargs.setdefault("needs", ())
    return pytest.param(ApiCase(call, error, builtin, **kwargs), id=f"api-{case_id}")


def opening(case_id: str, error: type[CkptDBError], builtin: type[BaseException], **kw: Any) -> Any:
    """Open a manager with ``kw`` (``root`` names a target; default: the existing run)."""
    target = kw.pop("root", "run")
    needs = kw.pop("needs", (target,) if target in BUILDERS else ())
    options = kw.pop("options")
    return api(
        case_id,
        lambda e: CheckpointManager(e[target], **options),
        error,
        builtin,
        on="open",
        needs=needs,
        **kw,
    )


def saving(case_id: str, error: type[CkptDBError], builtin: type[BaseException], **kw: Any) -> Any:
    step = kw.pop("step", 3)
    payloads = kw.pop("payloads", None)
    metrics = kw.pop("metrics", {"val_loss": 0.5})

    def call(e: Env) -> Any:
        given = payloads(e) if callable(payloads) else payloads
        return e.m.save(step, metrics=metrics, **(boundary(3.0) if given is None else given))

    return api(case_id, call, error, builtin, **kw)


def _flip_latest_model(e: Env) -> None:
    latest = e.m.latest("model")
    assert latest is not None
    data = bytearray(latest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    latest.path.write_bytes(bytes(data))


def _remove_latest_model(e: Env) -> None:
    latest = e.m.latest("model")
    assert latest is not None
    latest.path.unlink()


def _nothing_written(e: Env, err: BaseException) -> None:
    assert isinstance(err, PublishError)
    assert err.phase == "write" and err.stream == "model"
    assert err.path is not None and TEMP_NAME.fullmatch(err.path.name)
    assert not err.path.exists()
    assert err.cleanup_failures == []


def _open_file(e: Env) -> Any:
    f = open(__file__, "rb")  # noqa: SIM115 (closed at teardown)
    e.to_close.append(f)
    return f


BAD_NAMES = {
    "slash": "a/b",
    "parent-path": "../model",
    "backslash": "a\\b",
    "dotdot": "..",
    "dot": ".",
    "empty": "",
    "65-chars": "x" * 65,
    "reserved-prefix": "ckptdb.x",
    "ledger-name": "ckptdb.sqlite",
    "space": "my model",
    "nul": "model\x00",
}

API_CORPUS = [
    # -- steps
    saving("step-negative", InvalidArgumentError, ValueError, step=-1),
    saving("step-huge-negative", InvalidArgumentError, ValueError, step=-(2**70)),
    saving("step-past-64-bits", InvalidArgumentError, ValueError, step=2**63),
    saving("step-at-the-64-bit-maximum", InvalidArgumentError, ValueError, step=2**63 - 1),
    saving("step-huge", InvalidArgumentError, ValueError, step=2**70),
    saving("step-float", ArgumentTypeError, TypeError, step=1.5),
    saving("step-integral-float", ArgumentTypeError, TypeError, step=3.0),
    saving("step-nan", ArgumentTypeError, TypeError, step=math.nan),
    saving("step-true", ArgumentTypeError, TypeError, step=True),
    saving("step-false", ArgumentTypeError, TypeError, step=False),
    saving("step-none", ArgumentTypeError, TypeError, step=None),
    saving("step-str", ArgumentTypeError, TypeError, step="3"),
    saving("step-numpy-int64", ArgumentTypeError, TypeError, step=np.int64(3)),
    saving("step-decimal", ArgumentTypeError, TypeError, step=decimal.Decimal(3)),
    saving("step-tensor", ArgumentTypeError, TypeError, step=torch.tensor(3)),
    api(
        "log-metrics-negative-step",
        lambda e: e.m.log_metrics(-1, {"x": 1.0}),
        InvalidArgumentError,
        ValueError,
    ),
    api(
        "log-metrics-step-at-the-64-bit-maximum",
        lambda e: e.m.log_metrics(2**63 - 1, {"x": 1.0}),
        InvalidArgumentError,
        ValueError,
    ),
    # -- payload stream names (unknown, or not a stream name at all)
    *(
        saving(f"payload-name-{key}", UnknownStreamError, ValueError, payloads={name: state(1.0)})
        for key, name in BAD_NAMES.items()
    ),
    saving(
        "payload-unknown-among-known",
        UnknownStreamError,
        ValueError,
        payloads={"model": state(1.0), "nope": state(1.0)},
    ),
    saving("no-payload", InvalidArgumentError, ValueError, payloads={}),
    # -- payloads that cannot be pickled: a failed boundary, nothing left on disk
    *(
        saving(
            f"payload-unpicklable-{key}",
            PublishError,
            RuntimeError,
            payloads=lambda e, make=make: {"model": make(e)},
            ledger="aborted",
            check=_nothing_written,
        )
        for key, make in (
            ("lambda", lambda e: {"fn": lambda x: x}),
            ("open-file", lambda e: {"f": _open_file(e)}),
            ("lock", lambda e: {"lock": threading.Lock()}),
        )
    ),
    # -- metrics of a top-K stream
    *(
        saving(f"metric-{key}", InvalidMetricError, ValueError, metrics=m, ledger=ledger)
        for key, m, ledger in (
            ("nan", {"val_loss": math.nan}, "metrics"),
            ("inf", {"val_loss": math.inf}, "metrics"),
            ("-inf", {"val_loss": -math.inf}, "metrics"),
            ("tensor-nan", {"val_loss": torch.tensor(math.nan)}, "metrics"),
            ("missing", {"train_loss": 0.5}, "same"),
            ("empty", {}, "same"),
            ("none-metrics", None, "same"),
        )
    ),
    *(
        saving(f"metric-{key}", ArgumentTypeError, TypeError, metrics={"val_loss": value})
        for key, value in (
            ("str", "0.5"),
            ("bool", True),
            ("none", None),
            ("complex", 1j),
            ("list", [0.5]),
            ("tensor-vector", torch.tensor([0.5, 0.5])),
        )
    ),
    *(
        saving(
            f"external-name-{key}",
            InvalidArgumentError,
            ValueError,
            payloads={"model": External(lambda p: torch.save({}, p), name=name)},
        )
        for key, name in (
            ("escapes", "../outside.ckpt"),
            ("absolute", "/tmp/x.ckpt"),
            ("hidden", ".x.ckpt"),
            ("ours", "model/step-000000003.pt"),
        )
    ),
    saving(
        "external-async",
        InvalidArgumentError,
        ValueError,
        payloads={"model": External(lambda p: torch.save({}, p), name="a.ckpt"), "blocking": False},
    ),
    saving("metrics-list", ArgumentTypeError, TypeError, metrics=[("val_loss", 0.5)]),
    saving("metrics-str", ArgumentTypeError, TypeError, metrics="val_loss"),
    saving("metrics-float", ArgumentTypeError, TypeError, metrics=0.5),
    saving("metric-name-int", ArgumentTypeError, TypeError, metrics={1: 0.5, "val_loss": 0.5}),
    saving("metric-name-empty", ArgumentTypeError, TypeError, metrics={"": 0.5, "val_loss": 0.5}),
    # -- policies
    *(
        api(f"topk-k-{key}", lambda e, k=k: TopK(k, "val_loss"), err, builtin, on="pure")
        for key, k, err, builtin in (
            ("0", 0, InvalidArgumentError, ValueError),
            ("-1", -1, InvalidArgumentError, ValueError),
            ("1.5", 1.5, ArgumentTypeError, TypeError),
            ("true", True, ArgumentTypeError, TypeError),
            ("past-64-bits", 2**63, InvalidArgumentError, ValueError),
        )
    ),
    api(
        "topk-last-past-64-bits",
        lambda e: TopK(2, "val_loss", last=2**63),
        InvalidArgumentError,
        ValueError,
        on="pure",
    ),
    api("topk-metric-empty", lambda e: TopK(2, ""), InvalidArgumentError, ValueError, on="pure"),
    api("topk-metric-int", lambda e: TopK(2, 3), ArgumentTypeError, TypeError, on="pure"),
    api(
        "topk-mode",
        lambda e: TopK(2, "val_loss", mode="median"),
        InvalidArgumentError,
        ValueError,
        on="pure",
    ),
    *(
        api(f"keep-{key}", lambda e, kw=kw: Keep(**kw), err, builtin, on="pure")
        for key, kw, err, builtin in (
            ("last-negative", {"last": -1}, InvalidArgumentError, ValueError),
            ("last-0", {"last": 0}, InvalidArgumentError, ValueError),
            ("last-past-64-bits", {"last": 2**63}, InvalidArgumentError, ValueError),
            ("every-past-64-bits", {"every": 2**63}, InvalidArgumentError, ValueError),
            ("last-float", {"last": 1.5}, ArgumentTypeError, TypeError),
            ("last-true", {"last": True}, ArgumentTypeError, TypeError),
            ("every-0", {"every": 0}, InvalidArgumentError, ValueError),
            ("every-negative", {"every": -10}, InvalidArgumentError, ValueError),
            ("every-str", {"every": "10"}, ArgumentTypeError, TypeError),
        )
    ),
    *(
        api(f"ratio-{key}", lambda e, a=args: Keep.from_ratio(*a), err, builtin, on="pure")
        for key, args, err, builtin in (
            ("0", (0, 100, 10), InvalidArgumentError, ValueError),
            ("negative", (-0.1, 100, 10), InvalidArgumentError, ValueError),
            ("above-1", (1.5, 100, 10), InvalidArgumentError, ValueError),
            ("nan", (math.nan, 100, 10), InvalidArgumentError, ValueError),
            ("inf", (math.inf, 100, 10), InvalidArgumentError, ValueError),
            ("str", ("0.5", 100, 10), ArgumentTypeError, TypeError),
            ("bool", (True, 100, 10), ArgumentTypeError, TypeError),
            ("num-steps-0", (0.5, 0, 10), InvalidArgumentError, ValueError),
            ("num-steps-float", (0.5, 100.0, 10), ArgumentTypeError, TypeError),
            ("save-freq-0", (0.5, 100, 0), InvalidArgumentError, ValueError),
        )
    ),
    # -- streams= when opening (a fresh root: nothing may be created)
    *(
        opening(
            f"streams-name-{key}",
            InvalidArgumentError,
            ValueError,
            root="fresh",
            options={"streams": {name: Keep()}},
        )
        for key, name in BAD_NAMES.items()
        if key != "ledger-name"  # a valid stream name (it lives in checkpoints/)
    ),
    *(
        opening(
            f"streams-name-{key}",
            ArgumentTypeError,
            TypeError,
            root="fresh",
            options={"streams": {name: Keep()}},
        )
        for key, name in (("int", 1), ("none", None), ("bytes", b"model"), ("tuple", ("m",)))
    ),
    *(
        opening(f"streams-{key}", ArgumentTypeError, TypeError, options={"streams": value})
        for key, value in (
            ("list", [("model", Keep())]),
            ("empty-dict", {}),
            ("str", "model"),
            ("policy-int", {"model": 5}),
            ("policy-str", {"model": "keep"}),
            ("policy-class", {"model": Keep}),
            ("policy-dict", {"model": {"last": 3}}),
        )
    ),
    opening(
        "streams-rerank-by-a-metric-never-saved",
        InvalidArgumentError,
        ValueError,
        options={"streams": {"model": TopK(2, "accuracy")}},
    ),
    *(
        opening(f"guard-{key}", ArgumentTypeError, TypeError, options={"guard": guard})
        for key, guard in (
            ("str", "guard"),
            ("class", NonFiniteGradGuard),
            ("module", torch.nn.Linear(1, 1)),
            ("callable", lambda: None),
        )
    ),
    # -- ledger locations
    *(
        opening(f"db-url-{key}", LedgerError, RuntimeError, root="fresh", options={"db_url": url})
        for key, url in (
            ("not-a-url", "not a url"),
            ("unknown-dialect", "nosuchdb://x"),
            ("missing-directory", "sqlite:////nonexistent-dir/x.sqlite"),
        )
    ),
    opening("ledger-not-sqlite", LedgerError, RuntimeError, root="garbage", options={}),
    opening("ledger-is-a-directory", LedgerError, RuntimeError, root="ledgerdir", options={}),
    opening("ledger-newer-schema", SchemaVersionError, RuntimeError, root="newer", options={}),
    # -- roots that cannot hold a run
    opening("root-is-a-file", CkptDBError, OSError, root="afile", options={}),
    opening(
        "root-parent-is-a-file",
        CkptDBError,
        OSError,
        root="afile/run",
        needs=("afile",),
        options={},
    ),
    opening("root-under-proc", CkptDBError, OSError, root="proc", options={}),
    opening(
        "root-read-only",
        CkptDBError,
        OSError,
        root="readonly",
        options={},
        check=lambda e, err: not (e["readonly"] / "ckptdb.lock").exists() or pytest.fail("lock"),
    ),
    # -- loading
    api("load-missing-step", lambda e: e.m.load(99), CheckpointNotFoundError, LookupError),
    api("load-step-past-64-bits", lambda e: e.m.load(2**70), InvalidArgumentError, ValueError),
    api("load-negative-step", lambda e: e.m.load(-1), InvalidArgumentError, ValueError),
    api("load-step-huge-negative", lambda e: e.m.load(-(2**70)), InvalidArgumentError, ValueError),
    api(
        "load-evicted-step",
        lambda e: e.m.load(1, stream="ema"),
        CheckpointNotFoundError,
        LookupError,
        prepare=lambda e: e.m.save(3, metrics={"val_loss": 9.0}, ema=state(3.0)),
    ),
    api(
        "load-unknown-stream",
        lambda e: e.m.load(1, stream="../model"),
        UnknownStreamError,
        ValueError,
    ),
    api(
        "load-best-of-a-keep-stream",
        lambda e: e.m.load("best", stream="model"),
        InvalidArgumentError,
        ValueError,
    ),
    api(
        "load-a-path-that-is-not-a-checkpoint",
        lambda e: e.m.load(e["run"] / LEDGER),
        CheckpointNotFoundError,
        LookupError,
    ),
    *(
        api(f"load-which-{key}", lambda e, w=which: e.m.load(w), ArgumentTypeError, TypeError)
        for key, which in (
            ("float", 1.5),
            ("none", None),
            ("bool", True),
            ("bytes", b"latest"),
            ("list", ["latest"]),
        )
    ),
    api(
        "load-corrupted-file",
        lambda e: e.m.load("latest"),
        CorruptCheckpointError,
        OSError,
        ledger="corrupt",
        prepare=_flip_latest_model,
    ),
    api(
        "load-vanished-file",
        lambda e: e.m.load("latest"),
        CheckpointLostError,
        FileNotFoundError,
        ledger="lost",
        prepare=_remove_latest_model,
    ),
    # -- queries
    api("best-of-a-keep-stream", lambda e: e.m.best("model"), InvalidArgumentError, ValueError),
    api("latest-unknown-stream", lambda e: e.m.latest("nope"), UnknownStreamError, ValueError),
    api(
        "checkpoints-path-stream",
        lambda e: e.m.checkpoints("../model"),
        UnknownStreamError,
        ValueError,
    ),
]


def _spy_torch_save(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    real, calls = torch.save, []

    def spy(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(obj)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", spy)
    return calls


def raised_by(call: Callable[[], Any]) -> BaseException:
    try:
        result = call()
    except Exception as exc:
        return exc
    if isinstance(result, CheckpointManager):
        result.close()
    pytest.fail(f"no error was raised; the call returned {result!r}")


@pytest.mark.parametrize("case", API_CORPUS)
def test_api_bad_input_is_refused_and_changes_nothing(
    env: Env, monkeypatch: pytest.MonkeyPatch, case: ApiCase
) -> None:
    env.paths["proc"] = Path("/proc/ckptdb-bad-input/run")
    build(env, case.needs)
    if case.on == "manager":
        env.mgr = CheckpointManager(env["run"])
    if case.prepare is not None:
        case.prepare(env)
    before = image(env.tmp, ledger_bytes=env.mgr is None)
    calls = _spy_torch_save(monkeypatch)

    err = raised_by(lambda: case.call(env))

    assert isinstance(err, CkptDBError), f"bare {type(err).__module__}.{type(err).__name__}: {err}"
    assert isinstance(err, case.error), repr(err)
    assert isinstance(err, case.builtin), repr(err)
    assert str(err).strip()
    if case.check is not None:
        case.check(env, err)
    if env.mgr is not None:
        env.mgr.flush()  # nothing of the refused call may be waiting in the buffer either
        if case.ledger in ("same", "metrics"):
            assert calls == [], "torch.save ran for a refused call"
    ledger_key = f"run/{LEDGER}" if env.mgr is not None else None
    assert_only_expected_change(
        before, image(env.tmp, ledger_bytes=env.mgr is None), case.ledger, ledger_key
    )
    assert not env["proc"].parent.exists()
    if env.mgr is not None:  # the manager is still usable, and the run consistent
        assert env.mgr.save(7, metrics={"val_loss": 0.1}, **boundary(7.0))["model"].step == 7
        assert env.mgr.check() == []


# ----------------------------------------------------------------- the CLI corpus


@dataclass(frozen=True)
class CliCase:
    args: tuple[str, ...]  # "{name}" is a target path, "{tmp}" the temporary directory
    exit_code: int = 1


def cli(case_id: str, *args: str, exit_code: int = 1) -> Any:
    return pytest.param(CliCase(args, exit_code), id=f"cli-{case_id}")


CLI_CORPUS = [
    # -- roots
    cli("status-missing-root", "status", "{fresh}"),
    cli("status-root-is-a-file", "status", "{afile}", exit_code=2),
    cli("reconcile-root-is-a-file", "reconcile", "{afile}", exit_code=2),
    cli("check-root-parent-is-a-file", "check", "{afile}/run"),
    cli("list-not-a-run", "list", "{notrun}"),
    cli("reconcile-not-a-run", "reconcile", "{notrun}"),
    cli("gc-not-a-run", "gc", "{notrun}"),
    cli("db-upgrade-not-a-run", "db", "upgrade", "{notrun}"),
    cli("reconcile-empty-ledger", "reconcile", "{emptyledger}"),
    # -- streams, metrics, options
    cli("latest-unknown-stream", "latest", "{run}", "--stream", "nope"),
    cli("list-path-stream", "list", "{run}", "--stream", "../model"),
    cli("best-of-a-keep-stream", "best", "{run}", "--stream", "model"),
    cli("history-unknown-metric", "history", "{run}", "--metric", "nope"),
    cli("sql-bad-format", "sql", "{run}", "SELECT 1", "--format", "xml", exit_code=2),
    cli("list-unknown-option", "list", "{run}", "--bogus", exit_code=2),
    cli("demo-steps-not-a-number", "demo", "{fresh}", "--steps", "many", exit_code=2),
    # -- SQL
    cli("sql-syntax-error", "sql", "{run}", "SELEC nonsense"),
    cli("sql-unknown-table", "sql", "{run}", "SELECT * FROM nosuchtable"),
    cli("sql-write", "sql", "{run}", "DELETE FROM checkpoints"),
    cli("sql-attach", "sql", "{run}", "ATTACH DATABASE '{tmp}/x.db' AS x"),
    cli("sql-no-rows-statement", "sql", "{run}", "PRAGMA user_version = 7"),
    # -- broken or foreign ledgers
    cli("status-ledger-not-sqlite", "status", "{garbage}"),
    cli("reconcile-ledger-not-sqlite", "reconcile", "{garbage}"),
    cli("check-ledger-not-sqlite", "check", "{garbage}"),
    cli("db-current-ledger-not-sqlite", "db", "current", "{garbage}"),
    cli("status-ledger-newer-schema", "status", "{newer}"),
    cli("gc-ledger-newer-schema", "gc", "{newer}"),
    cli("db-upgrade-ledger-newer-schema", "db", "upgrade", "{newer}"),
    cli("status-db-url-garbage", "status", "{run}", "--db-url", "not a url"),
    cli("gc-db-url-unknown-dialect", "gc", "{run}", "--db-url", "nosuchdb://x"),
    cli(
        "reconcile-db-url-missing-directory",
        "reconcile",
        "{run}",
        "--db-url",
        "sqlite:////nonexistent-dir/x.sqlite",
    ),
]

CORPUS = API_CORPUS + CLI_CORPUS


def test_the_corpus_is_large_and_every_case_is_named_once() -> None:
    ids = [p.id for p in CORPUS]
    assert len(CORPUS) >= 40
    assert len(API_CORPUS) >= 40 and len(CLI_CORPUS) >= 20
    assert len(set(ids)) == len(ids)


def targets_of(args: tuple[str, ...]) -> tuple[str, ...]:
    names = [f for a in args for _, f, _, _ in string.Formatter().parse(a) if f]
    return tuple(dict.fromkeys(n for n in names if n in BUILDERS))


def render(env: Env, args: tuple[str, ...]) -> list[str]:
    values = {
        name: str(env[name]) for a in args for _, name, _, _ in string.Formatter().parse(a) if name
    }
    values["tmp"] = str(env.tmp)
    return [a.format(**values) for a in args]


def assert_one_line_error(code: int, stdout: str, stderr: str, expected: int) -> str:
    assert code == expected, (code, stdout, stderr)
    assert "Traceback" not in stdout + stderr
    assert stdout.strip() == ""
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr
    if expected == 1:
        assert [line for line in stderr.splitlines() if line.strip()] == errors, stderr
        assert "unexpected" not in errors[0], f"an untyped error: {errors[0]}"
    else:
        assert "Usage:" in stderr
    return errors[0]


@pytest.mark.parametrize("case", CLI_CORPUS)
def test_cli_bad_input_is_one_line_and_changes_nothing(env: Env, case: CliCase) -> None:
    build(env, targets_of(case.args))
    args = render(env, case.args)
    before = image(env.tmp)

    result = CliRunner().invoke(main, args)

    assert isinstance(result.exception, SystemExit), result.exception  # handled, not a crash
    assert_one_line_error(result.exit_code, result.stdout, result.stderr, case.exit_code)
    assert image(env.tmp) == before


@pytest.mark.parametrize(
    "args",
    [("sql", "{run}", "SELEC nonsense"), ("status", "{garbage}")],
    ids=["bad-sql", "garbage-ledger"],
)
def test_cli_bad_input_in_a_real_process(env: Env, args: tuple[str, ...]) -> None:
    build(env, targets_of(args))
    argv = render(env, args)
    before = image(env.tmp)
    proc = cli_subprocess(*argv)
    line = assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, 1)
    assert line.strip() != "Error:"
    assert image(env.tmp) == before
