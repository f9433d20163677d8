"""Loading: what ``which`` selects, safe unpickling, verification before unpickling, resumes."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import flip_byte, patch_unpickle, rows, state, value_of

from ckptdb import Checkpoint, CheckpointManager
from ckptdb.errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    CkptDBError,
    CorruptCheckpointError,
    UnknownStreamError,
)


class Opaque:
    """Not a tensor, not a plain container: weights_only unpickling must refuse it."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture
def mgr(open_manager: Any, streams: dict[str, Any]) -> CheckpointManager:
    """A run with model steps 1-3 (last 3 kept), ema 2-3, best by val_loss {2, 3}."""
    manager: CheckpointManager = open_manager(streams=streams)
    for step, val_loss in ((1, 0.9), (2, 0.2), (3, 0.5)):
        manager.save(
            step,
            metrics={"val_loss": val_loss},
            model=state(step),
            ema=state(10 + step),
            best=state(100 + step),
        )
    return manager


# ---------------------------------------------------------------- selection


def test_load_latest_is_the_default(mgr):
    assert value_of(mgr.load()) == 3
    assert value_of(mgr.load("latest")) == 3
    assert value_of(mgr.load("latest", stream="ema")) == 13


def test_load_best_defaults_to_the_best_stream(mgr):
    # val_loss 0.2 at step 2 is the best; "best" must not look at stream "model".
    assert value_of(mgr.load("best")) == 102
    assert value_of(mgr.load("best", stream="best")) == 102


def test_load_by_step_and_stream(mgr):
    assert value_of(mgr.load(1)) == 1
    assert value_of(mgr.load(2, stream="model")) == 2
    assert value_of(mgr.load(2, stream="ema")) == 12
    assert value_of(mgr.load(3, stream="best")) == 103


def test_load_a_checkpoint_record(mgr):
    ckpt = mgr.checkpoints("ema")[0]
    assert isinstance(ckpt, Checkpoint)
    assert value_of(mgr.load(ckpt)) == 12
    assert value_of(mgr.load(mgr.best()[1])) == 103


def test_load_by_path(mgr, monkeypatch):
    ckpt = mgr.checkpoints("model")[1]
    assert ckpt.path.is_absolute()
    assert value_of(mgr.load(ckpt.path)) == 2
    assert value_of(mgr.load(str(ckpt.path))) == 2
    monkeypatch.chdir(mgr.save_dir)
    assert value_of(mgr.load(str(ckpt.path.relative_to(mgr.save_dir)))) == 2


def test_loaded_tensors_keep_their_values(mgr):
    loaded = mgr.load(2, stream="ema")
    assert set(loaded) == {"w", "b"}
    assert torch.equal(loaded["w"], state(12)["w"])


# ------------------------------------------------------------ safe unpickling


def test_weights_only_by_default(open_manager, monkeypatch):
    mgr = open_manager()
    mgr.save(1, model={"obj": Opaque(41)})
    seen: list[Any] = []

    def spy(real_load: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("weights_only", "default"))
            return real_load(*args, **kwargs)

        return call

    patch_unpickle(monkeypatch, spy)
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only"):
        mgr.load()
    assert seen == [True]
    # Refusing an unsafe object is not corruption: the row stays committed.
    assert rows(mgr.root, "SELECT state FROM checkpoints") == [("committed",)]

    loaded = mgr.load(weights_only=False)
    assert isinstance(loaded["obj"], Opaque)
    assert loaded["obj"].value == 41
    assert seen == [True, False]


def test_map_location_is_honoured(mgr):
    loaded = mgr.load(map_location="meta")
    assert loaded["w"].device.type == "meta"

    calls: list[str] = []

    def locate(storage: Any, location: str) -> Any:
        calls.append(location)
        return storage

    loaded = mgr.load(1, map_location=locate)
    assert calls and all(loc == "cpu" for loc in calls)
    assert value_of(loaded) == 1


def test_map_location_defaults_to_cpu(mgr, monkeypatch):
    seen: list[Any] = []

    def spy(real_load: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs.get("map_location"))
            return real_load(*args, **kwargs)

        return call

    patch_unpickle(monkeypatch, spy)
    assert mgr.load()["w"].device.type == "cpu"
    assert seen == ["cpu"]


# ----------------------------------------------------------------- corruption


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [flip_byte, truncate], ids=["flipped-byte", "truncated"])
def test_damaged_file_is_refused_before_unpickling(mgr, monkeypatch, damage):
    target = mgr.latest()
    size_before = target.path.stat().st_size
    damage(target.path)
    if damage is flip_byte:
        assert target.path.stat().st_size == size_before  # only the hash can tell

    def must_not_unpickle(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            pytest.fail("unpickled a file that does not match its ledger row")

        return call

    with monkeypatch.context() as patch:
        patch_unpickle(patch, must_not_unpickle)
        with pytest.raises(CorruptCheckpointError) as info:
            mgr.load("latest")
    assert isinstance(info.value, OSError)
    assert isinstance(info.value, CkptDBError)
    assert str(target.path) in str(info.value)

    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [("corrupt",)]
    assert rows(
        mgr.root, "SELECT step FROM events WHERE kind = 'corrupt' AND checkpoint_id = ?", target.id
    ) == [(target.step,)]
    # The file is left where it is (evidence), and "latest" falls back to the
    # newest healthy checkpoint of the stream.
    assert target.path.exists()
    assert mgr.latest().step == 2
    assert value_of(mgr.load("latest")) == 2
    assert [c.step for c in mgr.checkpoints("model")] == [1, 2]
    assert rows(mgr.root, "SELECT step FROM latest_checkpoints WHERE stream = 'model'") == [(2,)]


def test_a_corrupt_best_member_is_refused(mgr, monkeypatch):
    best = mgr.best()[0]
    flip_byte(best.path)
    patch_unpickle(
        monkeypatch, lambda real: lambda *a, **k: pytest.fail("unpickled a corrupt file")
    )
    with pytest.raises(CorruptCheckpointError):
        mgr.load("best")
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", best.id) == [("corrupt",)]


def test_a_vanished_file_is_never_unpickled(mgr, monkeypatch):
    target = mgr.latest()
    target.path.unlink()
    with monkeypatch.context() as patch:
        patch_unpickle(patch, lambda real: lambda *a, **k: pytest.fail("unpickled a missing file"))
        with pytest.raises(OSError):
            mgr.load()
    # Reconcile records the loss and "latest" falls back to the healthy step 2.
    mgr.reconcile()
    assert rows(mgr.root, "SELECT state FROM checkpoints WHERE id = ?", target.id) == [("lost",)]
    assert value_of(mgr.load()) == 2


# -------------------------------------------------------------------- missing


def test_nothing_to_load_on_an_empty_stream(open_manager, streams):
    mgr = open_manager(streams=streams)
    for which, stream in (("latest", None), ("latest", "ema"), ("best", None), (0, None)):
        with pytest.raises(CheckpointNotFoundError) as info:
            mgr.load(which, stream=stream)
        assert isinstance(info.value, LookupError)


def test_unknown_step(mgr):
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(4)
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(1, stream="ema")  # ema keeps only 2 and 3


def test_a_path_that_is_not_a_committed_checkpoint(mgr, tmp_path):
    stray = tmp_path / "stray.pt"
    torch.save(state(7), stray)
    step_one = mgr.checkpoints("model")[0]
    assert step_one.step == 1
    evicted = mgr.save(4, model=state(4))["model"].path.parent / "step-000000001.pt"
    assert not evicted.exists()  # step 1 left the window of 3
    copy = mgr.save_dir / "model" / "copy.pt"
    copy.write_bytes(mgr.latest().path.read_bytes())
    for path in (stray, str(stray), evicted, copy, mgr.root / "ckptdb.sqlite", "no/such.pt"):
        with pytest.raises(CheckpointNotFoundError):
            mgr.load(path)
    with pytest.raises(CheckpointNotFoundError):
        mgr.load(step_one)  # a record of a checkpoint that has since been evicted


def test_unknown_stream(mgr):
    for which in ("latest", "best", 1):
        with pytest.raises(UnknownStreamError):
            mgr.load(which, stream="nope")


@pytest.mark.parametrize("which", [1.0, None, True, b"latest", ["latest"], object()])
def test_bad_which_type(mgr, which):
    with pytest.raises(ArgumentTypeError) as info:
        mgr.load(which)
    assert isinstance(info.value, TypeError)


# --------------------------------------------------------------------- resumes


def test_first_load_records_the_resume(root, streams):
    with CheckpointManager(root, streams=streams) as first:
        for step in (1, 2):
            first.save(step, metrics={"val_loss": 1.0}, model=state(step), best=state(step))

    with CheckpointManager(root) as mgr:
        attempt = mgr.attempt_id
        query = "SELECT resumed_from_id FROM attempts WHERE id = ?"
        assert rows(root, query, attempt) == [(None,)]
        resumed_from = mgr.latest()
        assert value_of(mgr.load()) == 2
        assert rows(root, query, attempt) == [(resumed_from.id,)]
        mgr.load(1)  # only the first load is the resume
        mgr.load("best")
        assert rows(root, query, attempt) == [(resumed_from.id,)]
        events = rows(
            root,
            "SELECT attempt_id, checkpoint_id, step FROM events WHERE kind = 'resumed'",
        )
        assert events == [(attempt, resumed_from.id, 2)]


def test_a_refused_load_is_not_the_resume(mgr, monkeypatch):
    flip_byte(mgr.latest().path)
    with pytest.raises(CorruptCheckpointError):
        mgr.load()
    assert rows(mgr.root, "SELECT count(*) FROM events WHERE kind = 'resumed'") == [(0,)]
    healthy = mgr.latest()
    mgr.load()
    assert rows(mgr.root, "SELECT resumed_from_id FROM attempts WHERE id = ?", mgr.attempt_id) == [
        (healthy.id,)
    ]


def test_load_does_not_touch_the_file(mgr):
    ckpt = mgr.latest()
    before = ckpt.path.read_bytes()
    stat = os.stat(ckpt.path)
    mgr.load()
    assert ckpt.path.read_bytes() == before
    assert os.stat(ckpt.path).st_mtime_ns == stat.st_mtime_ns


def test_load_of_a_vanished_file_marks_it_lost_and_falls_back(open_manager, root):
    from ckptdb.errors import CheckpointLostError, CkptDBError

    mgr = open_manager()
    mgr.save(1, model=state(1))
    second = mgr.save(2, model=state(2))["model"]
    second.path.unlink()
    with pytest.raises(CheckpointLostError) as caught:
        mgr.load("latest")
    assert isinstance(caught.value, FileNotFoundError)
    assert isinstance(caught.value, CkptDBError)
    assert rows(root, "SELECT state FROM checkpoints WHERE id = ?", second.id) == [("lost",)]
    assert rows(root, "SELECT count(*) FROM events WHERE kind = 'lost'") == [(1,)]
    assert torch.equal(mgr.load("latest")["w"], state(1)["w"])


def test_a_forced_weights_only_load_is_honoured_like_torch_load(open_manager, monkeypatch):
    """``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes torch.load refuse arbitrary objects even
    when the caller asks for ``weights_only=False`` (an administrator's safety switch):
    the one-pass load, which calls torch's zip loader itself, must honour it too."""
    mgr = open_manager()
    mgr.save(1, model={"obj": Opaque(41)})
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only"):
        mgr.load(weights_only=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    assert mgr.load(weights_only=False)["obj"].value == 41
