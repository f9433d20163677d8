"""The invariant checker: ``mgr.check()`` and ``ckptdb check ROOT``.

A run that ckptdb itself produced checks clean; each kind of damage is
reported by a line naming the path or the stream, and checking repairs nothing.
Damage is done behind ckptdb's back, the way an operator, a disk or a crash
would: files changed on disk, the ledger changed through plain sqlite3.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import rows, state

from ckptdb import CheckpointManager, TopK
from ckptdb.cli import main

Opener = Callable[..., CheckpointManager]

# step -> val_loss. Afterwards model keeps 30, 40, 50; ema 40, 50; best (top-2)
# holds 20 and 40, evicted 10, and never wrote 30 and 50 (not admitted).
LOSSES = {10: 0.5, 20: 0.3, 30: 0.7, 40: 0.2, 50: 0.6}
NOT_LATEST = {"model": 30, "ema": 40, "best": 20}
LATEST = {"model": 50, "ema": 50, "best": 40}


@dataclass
class Opaque:
    """Picklable, but not loadable with ``weights_only=True``."""

    value: int


def rel(stream: str, step: int) -> str:
    return f"{stream}/step-{step:09d}.pt"


def execute(root: Path, sql: str, *args: Any) -> None:
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        with con:
            con.execute(sql, args)
    finally:
        con.close()


def row_id(root: Path, stream: str, step: int, state_: str = "committed") -> int:
    found = rows(
        root,
        "SELECT id FROM checkpoints WHERE stream = ? AND step = ? AND state = ?",
        stream,
        step,
        state_,
    )
    assert len(found) == 1, (stream, step, state_, found)
    return int(found[0][0])


def publish(mgr: CheckpointManager, step: int, loss: float, **only: Any) -> None:
    payloads = only or {s: state(step) for s in ("model", "ema", "best")}
    mgr.save(step, metrics={"val_loss": loss}, **payloads)


@pytest.fixture
def mgr(open_manager: Opener, streams: dict[str, Any]) -> CheckpointManager:
    manager = open_manager(streams=streams)
    for step, loss in LOSSES.items():
        publish(manager, step, loss)
    return manager


def snapshot(mgr: CheckpointManager) -> tuple[dict[str, str], list[Any], list[Any]]:
    """Every file under the root with its digest, and the rows and pointers."""
    digests = {
        str(p.relative_to(mgr.root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(mgr.root.rglob("*"))
        if p.is_file() and not p.name.startswith("ckptdb.")
    }
    return (
        digests,
        rows(mgr.root, "SELECT * FROM checkpoints ORDER BY id"),
        rows(mgr.root, "SELECT * FROM pointers ORDER BY name"),
    )


def own_lines(problems: list[str], subject: str) -> list[str]:
    """The checker's own lines about ``subject`` (not the dry-run reconcile's)."""
    return [p for p in problems if p.startswith(f"{subject}:") or p.startswith(f"{subject} ")]


# ------------------------------------------------------------------ consistent


def test_consistent_run_has_no_violations(
    mgr: CheckpointManager, open_manager: Opener, streams: dict[str, Any]
) -> None:
    assert mgr.check() == []
    assert mgr.check(load=True) == []
    publish(mgr, 30, 0.1)  # back in time: model/ema 40, 50 superseded; best admits 30
    publish(mgr, 30, 0.15)  # re-save of a top-K member's step replaces it
    mgr.save(60, model=state(60))  # a boundary with one stream
    assert mgr.check(load=True) == []
    mgr.close()
    assert open_manager(streams=streams).check(load=True) == []


def test_resaving_a_topk_member_with_a_worse_metric_checks_clean(open_manager: Opener) -> None:
    """Design 3: re-saving a step already in the top-K replaces that entry. The
    replacement may rank below checkpoints evicted before it; the run is still
    exactly what ckptdb's policy produced, so it must check clean."""
    mgr = open_manager(streams={"best": TopK(2, "val_loss")})
    for step, loss in [(10, 0.5), (20, 0.2), (30, 0.4), (30, 0.9)]:
        mgr.save(step, metrics={"val_loss": loss}, best=state(step))
    assert [(c.step, c.metric) for c in mgr.best("best")] == [(20, 0.2), (30, 0.9)]
    assert mgr.check(load=True) == []
    mgr.save(40, metrics={"val_loss": 0.8}, best=state(40))  # admitted after the replacement
    assert mgr.check(load=True) == []


def in_folder_that_is_no_stream(model_dir: Path) -> None:
    folder = model_dir.parent / "not a stream"
    folder.mkdir()
    (folder / "step-000000010.pt").write_bytes(b"x")


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda d: (d / "notes.txt").write_text("mine"), id="not-our-naming"),
        pytest.param(lambda d: (d / "step-1.pt").write_bytes(b"x"), id="short-step"),
        pytest.param(lambda d: (d / "step-000000010.pt.bak").write_bytes(b"x"), id="suffix"),
        pytest.param(lambda d: (d / "step-000000070.pt").mkdir(), id="directory-named-like-ours"),
        pytest.param(
            lambda d: (d / "step-000000080.pt").symlink_to(d / "notes"),
            id="symlink-named-like-ours",
        ),
        pytest.param(in_folder_that_is_no_stream, id="folder-that-is-no-stream"),
    ],
)
def test_what_reconcile_leaves_alone_is_not_a_violation(
    mgr: CheckpointManager, make: Callable[[Path], object]
) -> None:
    """Reconcile leaves these alone (design 4: "anything else: untouched"), so the
    checker must not count them: ``ckptdb check`` would fail forever on a run that
    reconcile calls clean."""
    make(mgr.save_dir / "model")
    assert mgr.reconcile().actions == []
    assert mgr.check() == []


# ------------------------------------------------------------- committed files


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "appended":
        path.write_bytes(data + b"\0")
    elif how == "bit_flipped":
        middle = len(data) // 2
        path.write_bytes(data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :])
    else:
        raise AssertionError(how)


SIZE_HASH = re.compile(r"size/hash (\d+)/(\w+) != ledger (\d+)/(\w+)")


@pytest.mark.parametrize("stream", sorted(NOT_LATEST))
@pytest.mark.parametrize("how", ["deleted", "truncated", "appended", "bit_flipped"])
@pytest.mark.parametrize("load", [False, True])
def test_damaged_committed_file_is_one_line_naming_it(
    mgr: CheckpointManager, stream: str, how: str, load: bool
) -> None:
    target = rel(stream, NOT_LATEST[stream])
    damage(mgr.save_dir / target, how)
    problems = mgr.check(load=load)
    mine = own_lines(problems, target)
    assert len(mine) == 1, problems
    assert all(target in p for p in problems), problems  # nothing else is reported
    if how == "deleted":
        assert "unreadable" in mine[0], mine
        return
    found = SIZE_HASH.search(mine[0])
    assert found is not None, mine
    size, digest, recorded_size, recorded_digest = found.groups()
    assert digest != recorded_digest
    assert (size == recorded_size) == (how == "bit_flipped"), mine
    if how == "bit_flipped":  # only hashing sees it; a size-only reconcile does not
        assert problems == mine


@pytest.mark.parametrize("where", ["dotdot", "through_a_linked_directory"])
@pytest.mark.parametrize("load", [False, True])
def test_a_committed_row_leading_outside_is_never_hashed_there(
    mgr: CheckpointManager, tmp_path: Path, where: str, load: bool
) -> None:
    """The check hashes every committed file by its text (one confinement per stream
    directory): a row whose name leads out of the save directory is unreadable, even
    where a file with exactly its size and hash waits out there."""
    target = rel("model", NOT_LATEST["model"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "step-000000077.pt").write_bytes((mgr.save_dir / target).read_bytes())
    (mgr.save_dir / "linked").symlink_to(outside, target_is_directory=True)
    stored = {
        "dotdot": os.path.relpath(outside / "step-000000077.pt", mgr.save_dir),
        "through_a_linked_directory": "linked/step-000000077.pt",
    }[where]
    execute(
        mgr.root,
        "UPDATE checkpoints SET path = ? WHERE id = ?",
        stored,
        row_id(mgr.root, "model", NOT_LATEST["model"]),
    )
    mine = own_lines(mgr.check(load=load), stored)
    assert len(mine) == 1 and "committed but unreadable" in mine[0], mine
    assert "is outside" in mine[0], mine


def test_damaged_latest_also_names_the_pointer(mgr: CheckpointManager) -> None:
    target = rel("model", LATEST["model"])
    damage(mgr.save_dir / target, "deleted")
    problems = mgr.check()
    assert len(own_lines(problems, target)) == 1, problems
    assert all(target in p or "latest:model" in p for p in problems), problems
    assert any("latest:model" in p for p in problems), problems


def test_file_that_does_not_load_with_weights_only(mgr: CheckpointManager) -> None:
    mgr.save(60, model={"w": torch.zeros(2), "extra": Opaque(1)})
    assert mgr.check() == []  # size and hash are right; only unpickling tells
    problems = mgr.check(load=True)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rel('model', 60)}:"), problems
    assert "weights_only" in problems[0], problems
    assert "\n" not in problems[0], problems  # one line per violation


# ------------------------------------------------------------------ stray files


@pytest.mark.parametrize(
    ("stream", "name", "phrase"),
    [
        ("model", ".step-000000060.pt.tmp-77", "temporary file left behind"),
        ("ema", ".step-000000040.v12.pt.tmp-12", "temporary file left behind"),
        ("model", "step-000000777.pt", "without a ledger row"),
        ("best", "step-000000040.v99.pt", "without a ledger row"),
    ],
)
def test_stray_file_in_our_naming(
    mgr: CheckpointManager, stream: str, name: str, phrase: str
) -> None:
    (mgr.save_dir / stream / name).write_bytes(b"leftover")
    target = f"{stream}/{name}"
    problems = mgr.check()
    mine = own_lines(problems, target)
    assert len(mine) == 1 and phrase in mine[0], problems
    assert all(target in p for p in problems), problems


# --------------------------------------------------------------- ledger state


@pytest.mark.parametrize("stream", ["model", "best"])
@pytest.mark.parametrize("how", ["older", "evicted", "missing"])
def test_latest_pointer_not_the_newest_healthy_row(
    mgr: CheckpointManager, stream: str, how: str
) -> None:
    root = mgr.root
    newest = row_id(root, stream, LATEST[stream])
    pointer = f"latest:{stream}"
    if how == "older":
        points_to: int | None = row_id(root, stream, NOT_LATEST[stream])
        execute(root, "UPDATE pointers SET checkpoint_id = ? WHERE name = ?", points_to, pointer)
    elif how == "evicted":
        evicted = row_id(root, stream, 10, "deleted")
        execute(root, "UPDATE pointers SET checkpoint_id = ? WHERE name = ?", evicted, pointer)
        points_to = None  # a pointer to a row that is not committed resolves to nothing
    else:
        execute(root, "DELETE FROM pointers WHERE name = ?", pointer)
        points_to = None
    problems = mgr.check()
    mine = own_lines(problems, pointer)
    assert mine == [f"{pointer} points to {points_to}, newest healthy is {newest}"], problems
    assert all(pointer in p for p in problems), problems


def test_topk_stream_with_more_than_k_members(mgr: CheckpointManager, open_manager: Opener) -> None:
    mgr.close()
    lowered = open_manager(streams={"best": TopK(1, "val_loss")})  # members stay until gc
    assert lowered.check() == ["best: 2 members, more than k=1"]
    assert [c.step for c in lowered.gc()] == [20]
    assert lowered.check(load=True) == []


def test_topk_stream_with_more_than_k_members_in_the_ledger(
    mgr: CheckpointManager, open_manager: Opener
) -> None:
    mgr.close()
    execute(mgr.root, "UPDATE streams SET k = 1 WHERE name = 'best'")
    problems = open_manager().check()  # stored policies
    assert problems == ["best: 2 members, more than k=1"]


def test_evicted_topk_row_ranking_above_a_member(mgr: CheckpointManager) -> None:
    execute(
        mgr.root,
        "UPDATE checkpoints SET metric = 0.01 WHERE stream = 'best' AND step = 10",
    )
    problems = mgr.check()
    assert len(problems) == 1, problems
    assert problems[0].startswith("best:"), problems
    assert "step 10" in problems[0] and "member step 20" in problems[0], problems


def test_several_violations_are_all_reported_and_nothing_is_repaired(
    mgr: CheckpointManager,
) -> None:
    damage(mgr.save_dir / rel("model", 30), "deleted")
    damage(mgr.save_dir / rel("ema", 40), "bit_flipped")
    (mgr.save_dir / "best" / ".step-000000090.pt.tmp-5").write_bytes(b"x")
    (mgr.save_dir / "best" / "step-000000777.pt").write_bytes(b"x")
    execute(mgr.root, "DELETE FROM pointers WHERE name = 'latest:ema'")
    before = snapshot(mgr)
    problems = mgr.check(load=True)
    for subject in (
        rel("model", 30),
        rel("ema", 40),
        "best/.step-000000090.pt.tmp-5",
        "best/step-000000777.pt",
        "latest:ema",
    ):
        assert len(own_lines(problems, subject)) == 1, (subject, problems)
    assert all("\n" not in p for p in problems)
    assert mgr.check(load=True) == problems
    assert snapshot(mgr) == before


# ------------------------------------------------------------------------- CLI


def damaged_and_closed(mgr: CheckpointManager) -> list[str]:
    """Damage the run, close it, and return what a maintenance manager's check says."""
    damage(mgr.save_dir / rel("ema", 40), "bit_flipped")
    (mgr.save_dir / "model" / ".step-000000060.pt.tmp-9").write_bytes(b"x")
    mgr.close()
    with CheckpointManager(mgr.root, maintenance=True) as again:
        expected = again.check()
    assert len(expected) >= 2, expected
    return expected


def test_cli_check_consistent_run(mgr: CheckpointManager) -> None:
    mgr.close()
    for extra in ([], ["--load"]):
        result = CliRunner().invoke(main, ["check", str(mgr.root), *extra])
        assert result.exit_code == 0, (result.output, result.exception)
        assert result.stdout.strip() == f"{mgr.root}: consistent"
        assert result.stderr == ""


def test_cli_check_one_line_per_violation(mgr: CheckpointManager) -> None:
    expected = damaged_and_closed(mgr)
    result = CliRunner().invoke(main, ["check", str(mgr.root)])
    assert result.exit_code == 1, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert result.stdout.splitlines() == expected
    assert result.stderr.strip() == f"Error: {len(expected)} violation(s) in {mgr.root}"


def test_cli_check_load_finds_unloadable_files(mgr: CheckpointManager) -> None:
    mgr.save(60, model={"w": torch.zeros(2), "extra": Opaque(1)})
    mgr.close()
    plain = CliRunner().invoke(main, ["check", str(mgr.root)])
    assert plain.exit_code == 0, plain.output
    loaded = CliRunner().invoke(main, ["check", str(mgr.root), "--load"])
    assert loaded.exit_code == 1, loaded.output
    lines = loaded.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{rel('model', 60)}:"), lines


@pytest.mark.timeout(180)
def test_cli_check_as_a_real_process(mgr: CheckpointManager) -> None:
    expected = damaged_and_closed(mgr)
    env = {k: v for k, v in os.environ.items() if k != "CKPTDB_DB_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "ckptdb.cli", "check", str(mgr.root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=150,
        check=False,
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stdout.splitlines() == expected
    assert result.stderr.strip() == f"Error: {len(expected)} violation(s) in {mgr.root}"
    assert "Traceback" not in result.stderr


def test_eviction_time_is_recorded_at_the_commit_not_at_the_late_unlink(
    open_manager: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A top-K member evicted while its unlink fails, then a re-save of the winner with a
    worse metric: the checker must compare against the eviction time, not the time the
    file was finally removed (found by the model check)."""
    import warnings

    from ckptdb import CleanupWarning, TopK

    mgr = open_manager(streams={"best": TopK(1, "val_loss")})
    mgr.save(1, metrics={"val_loss": 5.0}, best=state(1.0))
    real_unlink = os.unlink

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "refused", str(path))

    monkeypatch.setattr(os, "unlink", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanupWarning)
        mgr.save(2, metrics={"val_loss": 3.0}, best=state(2.0))  # evicts step 1, unlink fails
    monkeypatch.setattr(os, "unlink", real_unlink)
    evicted = rows(mgr.root, "SELECT state, deleted_at FROM checkpoints WHERE step = 1")
    assert evicted[0][0] == "deleting" and evicted[0][1] is not None
    mgr.save(2, metrics={"val_loss": 10.0}, best=state(3.0))  # replaces step 2, worse metric
    assert [a.kind for a in mgr.reconcile().actions] == ["deleted"]
    assert mgr.check() == []
