"""Derived aliases (ckptdb.protocol.aliases): registered in the ledger, rebuilt by reconcile.

An integration registers the names other tools open (DeePMD's ``model.ckpt.pt``
symlink and ``checkpoint`` pointer file, a hard-linked ``last.ckpt``) with
``CheckpointManager.derive_aliases``; every reconcile (at open, ``ckptdb
reconcile``) then re-points one that does not name the latest committed
checkpoint of its stream, so a crash between a commit and its aliases leaves
them stale only until the next open. Every test runs on both ledgers (``db_url``
follows ``backend``, see conftest); the disk is compared with ``tree`` (links
not followed) and the ledger read with plain SQL through ``db``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result
from distlib import run_ranks
from helpers import LedgerClient, invoke, ledger_objects, migrate_to, schema_diff, state
from helpers import tree as full_tree

from ckptdb import CheckpointManager, DerivedAlias, Keep
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    RunDirectoryError,
    UnknownStreamError,
)
from ckptdb.ledger.engine import default_sqlite_url, newest_revision

Opener = Callable[..., CheckpointManager]
STREAMS = {"model": Keep(last=3), "ema": Keep(last=2)}
#: DeePMD's two, a hard-linked last.ckpt, and an EMA alias.
ALIASES = {
    "model.ckpt.pt": ("model", "symlink"),
    "checkpoint": ("model", "pointer"),
    "last.ckpt": ("model", "link"),
    "model_ema.ckpt.pt": ("ema", "symlink"),
}
MODEL_ALIASES = {path: spec for path, spec in ALIASES.items() if spec[0] == "model"}

pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")


@pytest.fixture
def db_url(backend: str | None) -> str | None:
    """Runs opened here (``open_manager``, ``db``) use both ledgers in turn."""
    return backend


def ckpt(root: Path, step: int, stream: str = "model") -> Path:
    return root / "checkpoints" / stream / f"step-{step:09d}.pt"


def rel(root: Path, step: int, stream: str = "model") -> str:
    """What a symlink or pointer at the run root says to name that checkpoint."""
    return os.path.relpath(ckpt(root, step, stream), root)


def assert_names(root: Path, step: int, aliases: dict[str, tuple[str, str]]) -> None:
    """Every alias of ``aliases`` (of the model stream) names model's step ``step``."""
    for path, (stream, kind) in aliases.items():
        alias, target = root / path, ckpt(root, step, stream)
        if kind == "symlink":
            assert os.readlink(alias) == os.path.relpath(target, alias.parent), path
        elif kind == "pointer":
            assert not alias.is_symlink() and alias.read_text() == rel(root, step, stream)
        else:
            assert not alias.is_symlink() and os.path.samefile(alias, target), path


def tree(directory: Path) -> dict[str, str]:
    """Every entry under ``directory`` (links not followed) but the ledger's own files
    (SQLite's WAL changes with every transaction, a read included)."""
    return {k: v for k, v in full_tree(directory).items() if "ckptdb." not in k}


def registered(db: LedgerClient) -> list[tuple[Any, ...]]:
    return db.rows("SELECT path, stream, kind FROM aliases ORDER BY path")


def alias_events(db: LedgerClient) -> list[tuple[str, int | None, str]]:
    """(kind, checkpoint_id, path) of the alias events the ledger holds."""
    found = db.rows(
        "SELECT kind, checkpoint_id, detail FROM events "
        "WHERE kind IN ('aliased', 'alias_left') ORDER BY id"
    )
    return [(k, c, json.loads(d)["path"]) for k, c, d in found]


def latest_id(db: LedgerClient, stream: str = "model") -> int:
    [(ident,)] = db.rows("SELECT checkpoint_id FROM pointers WHERE name = ?", f"latest:{stream}")
    return int(ident)


@pytest.fixture
def mgr(open_manager: Opener) -> CheckpointManager:
    """Model at steps 1 and 2, ema at step 1; every value different (so bytes differ)."""
    manager = open_manager(streams=STREAMS)
    manager.save(1, model=state(1.0), ema=state(1.5))
    manager.save(2, model=state(2.0))
    return manager


def cli(runner: Any, db_url: str | None, *args: Any) -> Result:
    return invoke(runner, *args, *(["--db-url", db_url] if db_url else []))


# ----------------------------------------------------------------- registration


def test_registration_records_the_aliases_and_points_them(
    mgr: CheckpointManager, root: Path, db: LedgerClient
) -> None:
    done = mgr.derive_aliases(ALIASES)
    assert sorted(a.path for a in done) == sorted(ALIASES)
    assert {a.kind for a in done} == {"aliased"}
    pointer = next(a for a in done if a.path == "checkpoint")
    assert (pointer.checkpoint_id, pointer.step) == (latest_id(db), 2)
    assert registered(db) == sorted((p, s, k) for p, (s, k) in ALIASES.items())
    assert_names(root, 2, MODEL_ALIASES)
    assert os.readlink(root / "model_ema.ckpt.pt") == rel(root, 1, "ema")
    # DeePMD's convention, exactly: the path relative to the run root, no newline
    assert (root / "checkpoint").read_text() == "checkpoints/model/step-000000002.pt"
    assert alias_events(db) == []  # routine: reconcile's repairs are the events

    before = (tree(root), registered(db))
    as_records = [DerivedAlias(p, s, k) for p, (s, k) in ALIASES.items()]
    assert mgr.derive_aliases(as_records) == []  # the same aliases: nothing to do
    assert (tree(root), registered(db)) == before


def test_an_alias_that_cannot_be_written_is_raised_naming_it_and_reconcile_retries(
    mgr: CheckpointManager, root: Path, db: LedgerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses the write (fault injection): ``derive_aliases`` raises a typed
    error naming the alias, never returns quietly; the alias stays registered and
    the next reconcile writes it."""
    from ckptdb.storage import derived

    def refused(*args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(derived, "point", refused)
    with pytest.raises(RunDirectoryError, match=r"checkpoint: .*No space left") as caught:
        mgr.derive_aliases({"checkpoint": ("model", "pointer")})
    assert isinstance(caught.value, OSError)
    assert not (root / "checkpoint").exists()
    assert registered(db) == [("checkpoint", "model", "pointer")]
    monkeypatch.undo()
    report = mgr.reconcile()
    assert [a.kind for a in report.actions] == ["aliased"]
    assert (root / "checkpoint").read_text() == rel(root, 2)


def test_each_commit_then_derive_aliases_moves_them_and_reregistering_replaces(
    mgr: CheckpointManager, root: Path, db: LedgerClient
) -> None:
    mgr.derive_aliases(MODEL_ALIASES)
    mgr.save(3, model=state(3.0))
    assert_names(root, 2, MODEL_ALIASES)  # ckptdb never moves them on its own in a save
    assert [a.kind for a in mgr.derive_aliases(MODEL_ALIASES)] == ["aliased"] * 3
    assert_names(root, 3, MODEL_ALIASES)

    mgr.derive_aliases({"checkpoint": ("ema", "pointer")})  # the same path, a new stream
    assert ("checkpoint", "ema", "pointer") in registered(db)
    assert (root / "checkpoint").read_text() == rel(root, 1, "ema")
    mgr.derive_aliases([DerivedAlias("model.ckpt.pt", "model", "symlink")], replace=True)
    assert registered(db) == [("model.ckpt.pt", "model", "symlink")]
    assert (root / "last.ckpt").is_file()  # forgotten, not removed


BAD: list[tuple[str, Any, type[Exception]]] = [
    ("absolute", {"/tmp/elsewhere.pt": ("model", "symlink")}, InvalidArgumentError),
    ("dotdot", {"../out.pt": ("model", "symlink")}, InvalidArgumentError),
    ("dotdot_inside", {"a/../b.pt": ("model", "symlink")}, InvalidArgumentError),
    ("dot", {"./b.pt": ("model", "symlink")}, InvalidArgumentError),
    ("empty", {"": ("model", "symlink")}, InvalidArgumentError),
    ("trailing_slash", {"b/": ("model", "symlink")}, InvalidArgumentError),
    ("ledger", {"ckptdb.sqlite": ("model", "pointer")}, InvalidArgumentError),
    ("temporary", {".x.ckptdb-alias": ("model", "pointer")}, InvalidArgumentError),
    ("kind", {"x.pt": ("model", "hardlink")}, InvalidArgumentError),
    ("kind_type", {"x.pt": ("model", 3)}, InvalidArgumentError),
    ("stream", {"x.pt": ("nope", "symlink")}, UnknownStreamError),
    ("stream_type", {"x.pt": (None, "symlink")}, ArgumentTypeError),
    ("path_type", {3: ("model", "symlink")}, ArgumentTypeError),
    ("value", {"x.pt": "model"}, ArgumentTypeError),
    ("not_a_mapping", "model.ckpt.pt", ArgumentTypeError),
    ("not_an_alias", [("x.pt", "model", "symlink")], ArgumentTypeError),
    (
        "twice",
        [DerivedAlias("x.pt", "model", "symlink"), DerivedAlias("x.pt", "model", "pointer")],
        InvalidArgumentError,
    ),
    ("own_name", {"checkpoints/model/step-000000001.pt": ("model", "link")}, InvalidArgumentError),
    (
        "unsaved_own_name",
        {"checkpoints/model/step-000000009.pt": ("model", "link")},
        InvalidArgumentError,
    ),
    ("stream_directory", {"checkpoints/model": ("model", "link")}, InvalidArgumentError),
    ("no_directory", {"nowhere/x.pt": ("model", "symlink")}, InvalidArgumentError),
]


@pytest.mark.parametrize(("case", "aliases", "error"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_aliases_are_refused_with_a_typed_error_and_nothing_changes(
    mgr: CheckpointManager, root: Path, db: LedgerClient, case: str, aliases: Any, error: type
) -> None:
    if isinstance(aliases, dict):  # with a good one beside it: that one is not registered either
        aliases = {"model.ckpt.pt": ("model", "symlink"), **aliases}
    before = (tree(root.parent), db.rows("SELECT * FROM events ORDER BY id"))
    with pytest.raises(error) as caught:
        mgr.derive_aliases(aliases)
    assert type(caught.value) is error, repr(caught.value)
    assert registered(db) == []
    assert (tree(root.parent), db.rows("SELECT * FROM events ORDER BY id")) == before


def test_a_directory_or_a_link_out_of_the_root_is_refused_and_never_followed(
    mgr: CheckpointManager, root: Path, db: LedgerClient, tmp_path: Path
) -> None:
    (root / "last.ckpt").mkdir()
    (root / "last.ckpt" / "mine.txt").write_text("yours")
    secret = tmp_path / "outside.txt"
    secret.write_text("not ckptdb's")
    os.symlink(secret, root / "checkpoint")
    outside_dir = tmp_path / "elsewhere"
    outside_dir.mkdir()
    os.symlink(outside_dir, root / "out")
    before = tree(tmp_path)
    for alias in ({"last.ckpt": ("model", "link")}, {"checkpoint": ("model", "pointer")}):
        with pytest.raises(InvalidArgumentError, match=r"a directory|a symbolic link"):
            mgr.derive_aliases(alias)
    with pytest.raises(InvalidArgumentError, match="outside"):
        mgr.derive_aliases({"out/model.ckpt.pt": ("model", "symlink")})
    assert tree(tmp_path) == before and registered(db) == []

    # a symlink alias replaces a symlink as a link: its target is never touched
    os.symlink(secret, root / "model.ckpt.pt")
    mgr.derive_aliases({"model.ckpt.pt": ("model", "symlink")})
    assert os.readlink(root / "model.ckpt.pt") == rel(root, 2)
    assert secret.read_text() == "not ckptdb's"
    before.pop("run/model.ckpt.pt", None)
    after = tree(tmp_path)
    assert after.pop("run/model.ckpt.pt") == "link->" + rel(root, 2)
    assert after == before


# ---------------------------------------------------------------- reconcile


def test_stale_aliases_are_repaired_when_the_manager_opens(
    mgr: CheckpointManager, open_manager: Opener, root: Path, db: LedgerClient
) -> None:
    """A crash between a commit and its aliases: the next open re-points them, one
    report line and one event each; a second open has nothing to do."""
    mgr.derive_aliases(ALIASES)
    mgr.save(3, model=state(3.0))  # committed; the aliases were not moved after it
    mgr.close()
    assert_names(root, 2, MODEL_ALIASES)

    again = open_manager()
    actions = [a for a in again.last_reconcile.actions if a.kind == "aliased"]
    assert sorted(a.path for a in actions) == sorted(MODEL_ALIASES)
    assert all(a.checkpoint_id == latest_id(db) and a.step == 3 for a in actions)
    assert "was checkpoints/model/step-000000002.pt" in str(again.last_reconcile)
    assert_names(root, 3, MODEL_ALIASES)
    events = alias_events(db)
    assert sorted(events) == sorted(("aliased", latest_id(db), p) for p in MODEL_ALIASES)
    again.close()

    files = tree(root)
    third = open_manager()
    assert third.last_reconcile.actions == []  # idempotent
    assert alias_events(db) == events and tree(root) == files


def test_the_reconcile_command_repairs_aliases_and_its_dry_run_changes_nothing(
    mgr: CheckpointManager, root: Path, db: LedgerClient, runner: Any, db_url: str | None
) -> None:
    """The latest checkpoint's file vanished: the dry run says where latest and every
    alias would go, changing nothing; the real one moves them to step 1's; then quiet."""
    mgr.derive_aliases(MODEL_ALIASES)
    mgr.close()
    ckpt(root, 2).unlink()
    (root / "last.ckpt").unlink()  # a crash between the unlink and the link of an update
    # the command's own maintenance attempt records attempt_started; nothing else may change
    reconciled = "SELECT * FROM events WHERE kind <> 'attempt_started' ORDER BY id"
    before = (tree(root), db.rows(reconciled), db.rows("SELECT * FROM pointers"))

    dry = cli(runner, db_url, "reconcile", root, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "reconcile (dry run)" in dry.output and "3 aliased" in dry.output
    assert f"checkpoint  (pointer -> {rel(root, 1)}, was {rel(root, 2)})" in dry.output
    assert (tree(root), db.rows(reconciled), db.rows("SELECT * FROM pointers")) == before

    done = cli(runner, db_url, "reconcile", root, "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["counts"] == {"lost": 1, "repointed": 1, "aliased": 3}
    assert_names(root, 1, MODEL_ALIASES)
    assert len([e for e in alias_events(db) if e[0] == "aliased"]) == 3

    quiet = cli(runner, db_url, "reconcile", root)
    assert quiet.exit_code == 0 and "nothing to do" in quiet.output


def test_a_stream_with_nothing_committed_leaves_its_alias_as_it_is(
    open_manager: Opener, root: Path, db: LedgerClient
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    assert mgr.derive_aliases({"model_ema.ckpt.pt": ("ema", "symlink")}) == []
    assert not os.path.lexists(root / "model_ema.ckpt.pt")  # never a link to nothing
    assert mgr.reconcile().actions == []

    os.symlink("checkpoints/ema/step-000000007.pt", root / "model_ema.ckpt.pt")  # a stale one
    report = mgr.reconcile()
    assert [(a.kind, a.path) for a in report.actions] == [("alias_left", "model_ema.ckpt.pt")]
    assert "'ema' has no committed checkpoint" in str(report)
    assert os.readlink(root / "model_ema.ckpt.pt") == "checkpoints/ema/step-000000007.pt"
    assert not report.failures


def test_the_only_checkpoint_lost_leaves_the_alias_naming_it(
    open_manager: Opener, root: Path
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    mgr.derive_aliases({"model.ckpt.pt": ("model", "symlink")})
    ckpt(root, 1).unlink()
    kinds = [a.kind for a in mgr.reconcile().actions]
    assert kinds == ["lost", "repointed", "alias_left"]
    assert os.readlink(root / "model.ckpt.pt") == rel(root, 1)


def test_an_alias_that_became_a_directory_or_a_link_out_is_left_alone(
    mgr: CheckpointManager, root: Path, tmp_path: Path
) -> None:
    """Reconcile never replaces what an alias of its kind never is, and never writes
    through a directory that leads out of the root: each is one ``failed`` line."""
    (root / "sub").mkdir()
    mgr.derive_aliases({**MODEL_ALIASES, "sub/model.ckpt.pt": ("model", "symlink")})
    assert os.readlink(root / "sub" / "model.ckpt.pt") == os.path.join("..", rel(root, 2))
    mgr.save(3, model=state(3.0))
    secret = tmp_path / "outside.txt"
    secret.write_text("not ckptdb's")
    (root / "checkpoint").unlink()
    os.symlink(secret, root / "checkpoint")  # a pointer file became a link out of the root
    (root / "last.ckpt").unlink()
    (root / "last.ckpt").mkdir()  # a hard link became a directory of somebody's
    (root / "last.ckpt" / "mine.txt").write_text("yours")
    (root / "sub" / "model.ckpt.pt").unlink()
    (root / "sub").rmdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "sub")  # the alias's directory leads out
    before = tree(tmp_path)

    with pytest.warns(UserWarning, match="could not repair"):
        report = mgr.reconcile()
    failed = {a.path: a.detail for a in report.failures}
    assert sorted(failed) == ["checkpoint", "last.ckpt", "sub/model.ckpt.pt"]
    assert "a symbolic link" in failed["checkpoint"] and "a directory" in failed["last.ckpt"]
    assert "outside" in failed["sub/model.ckpt.pt"]
    assert [a.path for a in report.actions if a.kind == "aliased"] == ["model.ckpt.pt"]
    after = tree(tmp_path)
    assert after.pop("run/model.ckpt.pt") == "link->" + rel(root, 3)
    before.pop("run/model.ckpt.pt")
    assert after == before  # the rest exactly as it was, inside the root and out


# -------------------------------------------------------------- adopt, migration


def deepmd_file(path: Path, step: int) -> None:
    """A checkpoint as DeePMD-kit's PyTorch trainer saves it (the step it had just done)."""
    weights: dict[str, Any] = {"w": torch.full((2,), float(step))}
    weights["_extra_state"] = {"train_infos": {"lr": 1e-3, "step": step - 1}}
    torch.save({"model": weights, "optimizer": {}}, path)


def test_adopt_deepmd_registers_its_aliases_and_reconcile_keeps_them(
    runner: Any, tmp_path: Path, db_url: str | None
) -> None:
    root = tmp_path / "train"
    root.mkdir()
    for step in (100, 200):
        deepmd_file(root / f"model.ckpt-{step}.pt", step)
    os.symlink("model.ckpt-100.pt", root / "model.ckpt.pt")
    (root / "checkpoint").write_text("model.ckpt-100.pt")
    adopted = cli(runner, db_url, "adopt", root, "--layout", "deepmd")
    assert adopted.exit_code == 0, adopted.output
    db = LedgerClient(root, db_url)
    try:
        assert registered(db) == [
            ("checkpoint", "model", "pointer"),
            ("model.ckpt.pt", "model", "symlink"),
        ]
        assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-200.pt"
        os.unlink(root / "model.ckpt.pt")  # stale again: as a crash after a commit leaves them
        os.symlink("model.ckpt-100.pt", root / "model.ckpt.pt")
        (root / "checkpoint").write_text("model.ckpt-100.pt")
        fixed = cli(runner, db_url, "reconcile", root)
        assert fixed.exit_code == 0 and "2 aliased" in fixed.output, fixed.output
        assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-200.pt"
        assert (root / "checkpoint").read_text() == "model.ckpt-200.pt"

        db.execute("DELETE FROM aliases")  # a run adopted before aliases were recorded
        again = cli(runner, db_url, "adopt", root, "--layout", "deepmd")
        assert again.exit_code == 0, again.output
        assert len(registered(db)) == 2
        ledger = {t: db.rows(f"SELECT * FROM {t}") for t in ("aliases", "attempts", "events")}
        assert cli(runner, db_url, "adopt", root, "--layout", "deepmd").exit_code == 0
        assert {t: db.rows(f"SELECT * FROM {t}") for t in ledger} == ledger  # now a no-op
    finally:
        db.close()


def test_a_ledger_at_0003_upgrades_and_then_keeps_aliases(
    open_manager: Opener, root: Path, db: LedgerClient, runner: Any, db_url: str | None
) -> None:
    mgr = open_manager(streams=STREAMS)
    mgr.save(1, model=state(1.0))
    mgr.close()
    url = db_url or default_sqlite_url(root)
    migrate_to(url, "0003", down=True)
    tables, _, version = ledger_objects(url)
    assert version == "0003" and "aliases" not in tables
    rows_before = db.rows("SELECT id, stream, step, state, path FROM checkpoints ORDER BY id")

    upgraded = cli(runner, db_url, "db", "upgrade", root)
    assert upgraded.exit_code == 0, upgraded.output
    tables, _, version = ledger_objects(url)
    assert version == newest_revision() and "aliases" in tables
    assert schema_diff(url) == []
    assert db.rows("SELECT id, stream, step, state, path FROM checkpoints ORDER BY id") == (
        rows_before
    )
    later = open_manager()
    assert [a.kind for a in later.derive_aliases(MODEL_ALIASES)] == ["aliased"] * 3
    assert_names(root, 1, MODEL_ALIASES)

    # and back: 0004's downgrade drops only the table (the aliases on disk stay)
    later.close()
    migrate_to(url, "0003", down=True)
    assert "aliases" not in ledger_objects(url)[0] and (root / "checkpoint").is_file()


# ------------------------------------------------------------------ two ranks


def _derive_on_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    with CheckpointManager(root, streams={"model": Keep(last=2)}) as mgr:
        mgr.save(1, model={"w": torch.tensor(1.0)})
        mine = {"checkpoint": ("model", "pointer")} if rank == 0 else {"x": ("nope", "bad")}
        done = mgr.derive_aliases(mine)  # every rank calls it; the chief's aliases count
        try:
            mgr.derive_aliases({"/abs": ("model", "pointer")} if rank == 0 else {})
        except InvalidArgumentError as exc:
            refused = type(exc).__name__
        mgr.save(2, model={"w": torch.tensor(2.0)})  # every rank still in step
    return {"done": [(a.kind, a.path) for a in done], "refused": refused}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_on_two_ranks_only_the_chief_registers_and_every_rank_gets_its_answer(
    tmp_path: Path, backend: str | None
) -> None:
    root = tmp_path / "run"
    outcomes = run_ranks(_derive_on_ranks, 2, tmp_path, str(root), timeout=45)
    assert [o.error for o in outcomes] == [None, None], [o.trace for o in outcomes]
    assert (
        outcomes[0].value
        == outcomes[1].value
        == {
            "done": [("aliased", "checkpoint")],
            "refused": "InvalidArgumentError",
        }
    )
    db = LedgerClient(root)
    assert registered(db) == [("checkpoint", "model", "pointer")]
    assert (root / "checkpoint").read_text() == "checkpoints/model/step-000000001.pt"
