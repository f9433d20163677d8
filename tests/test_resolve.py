"""The public read-only reader's ``load``, and restart resolution (``ckptdb.resolve``).

A reader never takes the writer lock, so it works while a trainer holds the
run; its ``load`` verifies size and hash like the manager's but never writes
the ledger. ``resolve`` answers a ``--resume``/``--init-from`` argument from
the ledger of the run that owns the checkpoint, never another run's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import LedgerClient, flip_byte, state

import ckptdb
from ckptdb import CheckpointManager, External, Keep, RunReader, Sharded, TopK
from ckptdb.errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
    UnknownStreamError,
)

STREAMS = {"model": Keep(last=None), "best": TopK(2, "loss")}


def make_run(root: Path, values: list[float]) -> None:
    """A run whose step ``10 * i`` saved ``state(v)`` on model and best (loss = v)."""
    with CheckpointManager(root, streams=STREAMS) as mgr:
        for i, v in enumerate(values):
            mgr.save(10 * i, metrics={"loss": v}, model=state(v), best=state(v))


def value(loaded: dict[str, torch.Tensor]) -> float:
    return float(loaded["w"].flatten()[0])


@pytest.fixture
def run_a(tmp_path: Path) -> Path:
    make_run(tmp_path / "a", [3.0, 1.0, 2.0])
    return tmp_path / "a"


@pytest.fixture
def run_b(tmp_path: Path) -> Path:
    make_run(tmp_path / "b", [7.0, 8.0])
    return tmp_path / "b"


# ----------------------------------------------------------------- reader.load


def test_reader_loads_verified_while_the_writer_holds_the_run(run_a: Path) -> None:
    with CheckpointManager(run_a) as writer, RunReader(run_a) as reader:
        assert value(reader.load()) == 2.0  # latest
        assert value(reader.load("best")) == 1.0
        assert value(reader.load(10)) == 1.0
        assert value(reader.load(10, stream="best")) == 1.0
        with pytest.raises(CheckpointNotFoundError):  # evicted from the top-2
            reader.load(0, stream="best")
        latest = writer.latest()
        assert latest is not None
        assert value(reader.load(latest)) == 2.0
        assert value(reader.load(latest.path)) == 2.0
        assert value(reader.load(os.path.relpath(latest.path))) == 2.0


def test_a_corrupt_file_is_refused_and_the_reader_changes_nothing(run_a: Path) -> None:
    with RunReader(run_a) as reader:
        latest = reader.latest()
        assert latest is not None
        flip_byte(latest.path)
        with pytest.raises(CorruptCheckpointError, match="refusing to load"):
            reader.load()
        assert reader.latest() == latest  # still the latest: a reader never writes
    states = LedgerClient(run_a).rows("SELECT state FROM checkpoints WHERE id = ?", latest.id)
    assert states == [("committed",)]
    with CheckpointManager(run_a) as writer:  # the writer marks it at its next load
        with pytest.raises(CorruptCheckpointError):
            writer.load()
        assert writer.latest().step == 10  # type: ignore[union-attr]


def test_a_vanished_file_is_lost(run_a: Path) -> None:
    with RunReader(run_a) as reader:
        latest = reader.latest()
        assert latest is not None
        latest.path.unlink()
        with pytest.raises(CheckpointLostError):
            reader.load()


def test_reader_loads_a_sharded_checkpoint_in_place(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "s") as mgr:
        mgr.save(5, model=Sharded({"w": torch.full((4,), 5.0)}))
    into = {"w": torch.zeros(4)}
    with RunReader(tmp_path / "s") as reader:
        assert reader.load(into=into) is into
        with pytest.raises(InvalidArgumentError, match="into="):
            reader.load()
    assert torch.equal(into["w"], torch.full((4,), 5.0))


def test_reader_load_of_bad_specs(run_a: Path, tmp_path: Path) -> None:
    with RunReader(run_a) as reader:
        with pytest.raises(CheckpointNotFoundError):
            reader.load(99)
        with pytest.raises(UnknownStreamError):
            reader.load("latest", stream="nope")
        with pytest.raises(ArgumentTypeError):
            reader.load(1.5)  # type: ignore[arg-type]
        stray = run_a / "checkpoints" / "model" / "not-ours.pt"
        torch.save({}, stray)
        with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
            reader.load(stray)


# --------------------------------------------------------- another run's root


def test_another_runs_root_resolves_through_that_runs_ledger(run_a: Path, run_b: Path) -> None:
    """The two-run regression: a manager of run A is open in this process."""
    with CheckpointManager(run_a) as a:
        assert a.latest().step == 20  # type: ignore[union-attr]
        found = ckptdb.resolve(run_b)
        assert (found.path.parent.parent.parent, found.step) == (run_b.resolve(), 10)
        with RunReader(run_a) as reader:
            assert value(reader.load(run_b)) == 8.0  # B's latest, not A's step 10
            assert reader.resolve(run_b, stream="best").path.parent.name == "best"
        assert ckptdb.resolve(run_a).step == 20


def test_a_checkpoint_path_of_another_run_uses_its_own_ledger(run_a: Path, run_b: Path) -> None:
    b_latest = ckptdb.resolve(run_b)
    found = ckptdb.resolve(b_latest.path, root=run_a)  # root= names A; the file is B's
    assert found == b_latest
    with RunReader(run_a) as reader:
        assert value(reader.load(b_latest.path)) == 8.0


def test_resolve_latest_best_and_steps_need_a_root(run_a: Path) -> None:
    assert ckptdb.resolve("latest", root=run_a).step == 20
    assert ckptdb.resolve("best", root=run_a).metric == 1.0
    assert ckptdb.resolve(10, root=run_a, stream="best").metric == 1.0
    for spec in ("latest", "best", 3):
        with pytest.raises(InvalidArgumentError, match="needs root"):
            ckptdb.resolve(spec)
    with pytest.raises(ArgumentTypeError):
        ckptdb.resolve(True)  # type: ignore[arg-type]


def test_a_path_outside_every_run_is_not_found(tmp_path: Path) -> None:
    lone = tmp_path / "lone.pt"
    torch.save({}, lone)
    with pytest.raises(CheckpointNotFoundError, match="no ckptdb run"):
        ckptdb.resolve(lone)
    with pytest.raises(CheckpointNotFoundError):
        ckptdb.resolve(tmp_path / "missing")


def test_a_run_without_a_model_stream_resolves_to_its_newest_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with CheckpointManager(root, streams={"ema": Keep(last=2), "best": TopK(1, "loss")}) as m:
        m.save(1, metrics={"loss": 1.0}, ema=state(1.0), best=state(1.0))
        m.save(2, metrics={"loss": 2.0}, ema=state(2.0))
    found = ckptdb.resolve(root)
    assert (found.stream, found.step) == ("ema", 2)


def test_a_lightning_style_dirpath_resolves_through_the_ledger_beside_it(tmp_path: Path) -> None:
    dirpath = tmp_path / "checkpoints"
    ledger = tmp_path / ".checkpoints.ckptdb"
    with CheckpointManager(ledger, save_dir=dirpath, streams={"val_loss": Keep(last=None)}) as m:
        for step in (4, 8):
            name = f"epoch={step // 4 - 1}-step={step}.ckpt"
            m.save(step, val_loss=External(lambda p, s=step: torch.save(state(s), p), name=name))
    assert ckptdb.resolve(dirpath).path == dirpath / "epoch=1-step=8.ckpt"
    assert ckptdb.resolve(dirpath / "epoch=0-step=4.ckpt").step == 4
    with RunReader(ledger) as reader:
        assert value(reader.load(dirpath / "epoch=0-step=4.ckpt")) == 4.0


# ----------------------------------------------------------- the review's cases


def test_a_run_whose_checkpoints_directory_is_a_symlink_resolves(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    root = tmp_path / "run"
    root.mkdir()
    (root / "checkpoints").symlink_to(scratch, target_is_directory=True)
    with CheckpointManager(root, save_dir=root / "checkpoints") as mgr:
        saved = mgr.save(1, model=state(1.0))["model"]
    # through the run's own (linked) path the run is found; the recorded path is the
    # link's target, outside the run root: then root= names the run
    assert ckptdb.resolve(root / "checkpoints" / "model" / saved.path.name).step == 1
    assert ckptdb.resolve(saved.path, root=root).step == 1
    with pytest.raises(CheckpointNotFoundError, match="pass root="):
        ckptdb.resolve(saved.path)


def test_a_steps_from_a_command_line_string(run_a: Path) -> None:
    assert ckptdb.resolve("10", root=run_a).step == 10
    with RunReader(run_a) as reader:
        assert value(reader.load("10")) == 1.0


def test_a_readers_own_root_and_another_runs_checkpoint_object(run_a: Path, run_b: Path) -> None:
    b_latest = ckptdb.resolve(run_b)
    with RunReader(run_a) as reader:
        assert reader.resolve(run_a).step == 20  # its own root: its latest
        assert reader.resolve(b_latest) == b_latest  # B's record, through B's ledger
        assert value(reader.load(b_latest)) == 8.0


def test_a_reader_refuses_a_file_reached_through_a_link_out_of_the_save_dir(
    run_a: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    model_dir = run_a / "checkpoints" / "model"
    model_dir.rename(outside)
    model_dir.symlink_to(outside, target_is_directory=True)
    with RunReader(run_a) as reader, pytest.raises(InvalidArgumentError, match="outside"):
        reader.load()


@pytest.mark.postgres
def test_paths_resolve_through_a_postgresql_ledger_and_a_sqlite_one(
    pg_url: str, tmp_path: Path, run_a: Path
) -> None:
    root = tmp_path / "pg-run"
    with CheckpointManager(root, db_url=pg_url, streams=STREAMS) as mgr:
        saved = mgr.save(5, metrics={"loss": 1.0}, model=state(5.0), best=state(5.0))["model"]
    assert ckptdb.resolve(saved.path, db_url=pg_url) == saved  # found by walking up, in db_url
    assert ckptdb.resolve(saved, db_url=pg_url) == saved
    assert ckptdb.resolve(root, db_url=pg_url) == saved
    with RunReader(root, db_url=pg_url) as reader:
        assert reader.resolve(run_a).step == 20  # a SQLite run, through its own ledger
        assert value(reader.load(run_a)) == 2.0
