"""Payloads written by someone else: ``ckptdb.External(write, name=...)``.

A framework's writer (Lightning's ``trainer.save_checkpoint``, Hugging
Face's ``save_pretrained``) writes into a path ckptdb hands out; ckptdb does
everything else with the guarantees of its own saves: the intent row before
any byte, fsync of every file and directory, size and hash, placement under
the framework's name, one commit, eviction after commit. These tests use
plain writers (``torch.save``, a function that makes a directory); the
Lightning tests run the real framework through the same path.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crashlib import fork_running, tail, wait_child
from distlib import run_ranks
from helpers import LedgerClient, flip_byte, state, tree

from ckptdb import CheckpointManager, External, Keep, NonFiniteGradGuard, TopK
from ckptdb.errors import (
    ArgumentTypeError,
    CorruptCheckpointError,
    InvalidArgumentError,
    PublishError,
)
from ckptdb.storage import external as external_mod

Opener = Callable[..., CheckpointManager]


def torch_writer(value: float) -> Callable[[Path], None]:
    return lambda path: torch.save(state(value), path)


def dir_writer(files: dict[str, bytes]) -> Callable[[Path], None]:
    """Write a directory the way a framework does: its own layout, no fsync."""

    def write(path: Path) -> None:
        path.mkdir()
        for name, data in files.items():
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    return write


def ckpt_rows(root: Path) -> list[tuple[Any, ...]]:
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        return con.execute(
            "SELECT stream, step, path, state, tmp_path FROM checkpoints ORDER BY id"
        ).fetchall()
    finally:
        con.close()


# --------------------------------------------------------------------- publishing


def test_a_framework_named_file_is_published_under_its_own_name(
    open_manager: Opener, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=2)})
    saved = mgr.save(40, model=External(torch_writer(4.0), name="epoch=3-step=40.ckpt"))
    record = saved["model"]
    assert record.path == save_dir / "epoch=3-step=40.ckpt"
    assert sorted(os.listdir(save_dir)) == ["epoch=3-step=40.ckpt"]  # no stream dir, no temp
    assert record.size == record.path.stat().st_size
    assert mgr.latest() == record
    assert torch.equal(mgr.load("latest")["w"], state(4.0)["w"])
    assert mgr.check(load=True) == []


def test_a_name_with_subdirectories_and_a_directory_payload(
    open_manager: Opener, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    files = {"model.safetensors": b"m" * 100, "sub/optimizer.pt": b"o" * 7}
    record = mgr.save(500, model=External(dir_writer(files), name="hf/checkpoint-500"))["model"]
    assert record.path == save_dir / "hf" / "checkpoint-500"
    assert tree(record.path).keys() == {"model.safetensors", "sub", "sub/optimizer.pt"}
    assert record.size == 107
    assert mgr.check(load=True) == []  # a directory is verified, never unpickled
    with pytest.raises(InvalidArgumentError, match="load it with that framework"):
        mgr.load("latest")


def test_the_intent_row_exists_before_the_writer_runs(open_manager: Opener, root: Path) -> None:
    mgr = open_manager()
    seen: list[tuple[Any, ...]] = []

    def write(path: Path) -> None:
        seen.extend(ckpt_rows(root))
        assert not path.exists()  # a fresh path, which the writer creates
        torch.save(state(1.0), path)

    mgr.save(7, model=External(write, name="a.ckpt"))
    assert len(seen) == 1
    stream, step, path, row_state, tmp = seen[0]
    assert (stream, step, path, row_state) == ("model", 7, "a.ckpt", "pending")
    assert tmp == ".a.ckpt.ckptdb-tmp-1"
    assert ckpt_rows(root)[0][3:] == ("committed", None)


def test_every_file_and_directory_is_fsynced_before_placement(
    open_manager: Opener, save_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer synced nothing; ckptdb fsyncs each file and each directory
    of the tree before it renames the tree onto its final name."""
    mgr = open_manager()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    files = {"a.bin": b"a", "deep/er/b.bin": b"b"}
    mgr.save(1, model=External(dir_writer(files), name="checkpoint-1"))
    placed = events.index(("replace", str(save_dir / "checkpoint-1")))
    synced_before = {Path(p).name for kind, p in events[:placed] if kind == "fsync"}
    assert {"a.bin", "b.bin", "deep", "er"} <= synced_before
    assert any(p.endswith(".checkpoint-1.ckptdb-tmp-1") for _, p in events[:placed])
    assert ("fsync", str(save_dir)) in events[placed:]  # the rename made durable


def test_retention_evicts_framework_files_after_the_commit(
    open_manager: Opener, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=2)})
    for step in range(4):
        mgr.save(step, model=External(torch_writer(step), name=f"epoch={step}.ckpt"))
    assert sorted(os.listdir(save_dir)) == ["epoch=2.ckpt", "epoch=3.ckpt"]
    assert [c.step for c in mgr.checkpoints("model")] == [2, 3]


def test_top_k_admission_skips_the_writer_of_a_candidate_that_would_not_enter(
    open_manager: Opener, save_dir: Path
) -> None:
    mgr = open_manager(streams={"best": TopK(1, "loss")})
    calls: list[Path] = []

    def write(path: Path) -> None:
        calls.append(path)
        torch.save(state(1.0), path)

    mgr.save(1, metrics={"loss": 1.0}, best=External(write, name="one.ckpt"))
    assert mgr.save(2, metrics={"loss": 2.0}, best=External(write, name="two.ckpt")) == {}
    assert len(calls) == 1 and os.listdir(save_dir) == ["one.ckpt"]


# ------------------------------------------------------------------ failures


def test_a_writer_that_raises_rolls_the_boundary_back(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager()
    mgr.save(1, model=External(torch_writer(1.0), name="one.ckpt"))

    def half_then_fail(path: Path) -> None:
        path.write_bytes(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    with pytest.raises(PublishError) as caught:
        mgr.save(2, model=External(half_then_fail, name="two.ckpt"))
    assert caught.value.phase == "write"
    assert isinstance(caught.value.__cause__, OSError)
    assert os.listdir(save_dir) == ["one.ckpt"]  # neither the temp nor the final name
    assert [r[3] for r in ckpt_rows(root)] == ["committed", "aborted"]
    assert mgr.latest().step == 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "writer, reason",
    [
        (lambda path: None, "created nothing"),
        (lambda path: path.symlink_to("/etc/hostname"), "link or special file"),
        (lambda path: os.mkfifo(path), "link or special file"),
    ],
    ids=["nothing", "symlink", "fifo"],
)
def test_a_writer_that_leaves_no_file_or_directory_fails_the_write(
    open_manager: Opener, root: Path, save_dir: Path, writer: Any, reason: str
) -> None:
    mgr = open_manager()
    with pytest.raises(PublishError, match=reason) as caught:
        mgr.save(1, model=External(writer, name="x.ckpt"))
    assert caught.value.phase == "write"
    assert os.listdir(save_dir) == []
    assert [r[3] for r in ckpt_rows(root)] == ["aborted"]


def test_a_link_inside_a_written_directory_fails_the_write(
    open_manager: Opener, save_dir: Path
) -> None:
    def write(path: Path) -> None:
        path.mkdir()
        (path / "escape").symlink_to("/etc")

    with pytest.raises(PublishError) as caught:
        open_manager().save(1, model=External(write, name="d"))
    assert caught.value.phase == "write"
    assert os.listdir(save_dir) == []


BAD_NAMES = [
    "",
    "/abs/x.ckpt",
    "../x.ckpt",
    "a/../../x.ckpt",
    "a//b.ckpt",
    "dir/",
    ".hidden.ckpt",
    "a/.x/b.ckpt",
    "ckptdb.sqlite",
    "model/step-000000001.pt",
    ".step-000000001.pt.tmp-3",
    " x.ckpt",
    "a\\b.ckpt",
    "sharded.dcp",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_ckptdb_may_not_publish_is_bad_input_and_changes_nothing(
    open_manager: Opener, root: Path, save_dir: Path, name: str
) -> None:
    guard = NonFiniteGradGuard()
    guard.update(torch.tensor(float("nan")))
    mgr = open_manager(guard=guard)
    calls: list[Path] = []
    before = tree(root)
    with pytest.raises(InvalidArgumentError):
        mgr.save(1, model=External(calls.append, name=name))
    assert calls == [] and ckpt_rows(root) == []
    assert tree(root) == before
    assert guard.tripped()  # bad input is reported before the guard is read


def test_external_payload_arguments_are_type_checked() -> None:
    with pytest.raises(ArgumentTypeError):
        External("not callable", name="x")  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        External(print, name=Path("x"))  # type: ignore[arg-type]


def test_a_name_that_exists_is_never_published_over(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None), "other": Keep(last=None)})
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "users.ckpt").write_bytes(b"the user's own file")
    with pytest.raises(InvalidArgumentError, match="does not own"):
        mgr.save(1, model=External(torch_writer(1.0), name="users.ckpt"))
    assert (save_dir / "users.ckpt").read_bytes() == b"the user's own file"
    mgr.save(2, model=External(torch_writer(2.0), name="mine.ckpt"))
    with pytest.raises(InvalidArgumentError, match="live checkpoint"):
        mgr.save(3, other=External(torch_writer(3.0), name="mine.ckpt"))
    assert [r[3] for r in ckpt_rows(root)] == ["committed"]  # the refused intents left no row


def test_two_streams_cannot_publish_one_name(open_manager: Opener, root: Path) -> None:
    mgr = open_manager(streams={"a": Keep(last=1), "b": Keep(last=1)})
    w = torch_writer(1.0)
    with pytest.raises(InvalidArgumentError, match="both publish"):
        mgr.save(1, a=External(w, name="x.ckpt"), b=External(w, name="x.ckpt"))
    assert ckpt_rows(root) == []


def test_an_external_payload_cannot_be_saved_asynchronously(
    open_manager: Opener, root: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match="blocking=False"):
        open_manager().save(1, blocking=False, model=External(torch_writer(1), name="x.ckpt"))
    assert ckpt_rows(root) == []


def test_an_external_and_an_own_payload_commit_in_one_boundary(
    open_manager: Opener, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1), "ema": Keep(last=1)})
    saved = mgr.save(3, model=External(torch_writer(1.0), name="e.ckpt"), ema=state(2.0))
    assert saved["model"].path == save_dir / "e.ckpt"
    assert saved["ema"].path == save_dir / "ema" / "step-000000003.pt"
    assert saved["model"].committed_at == saved["ema"].committed_at


# ------------------------------------------------------------------ reconcile


def test_reconcile_leaves_framework_named_files_without_a_row_alone(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager()
    mgr.save(1, model=External(torch_writer(1.0), name="epoch=0.ckpt"))
    (save_dir / "epoch=9-step=90.ckpt").write_bytes(b"a file ckptdb never published")
    (save_dir / "notes.txt").write_text("the user's")
    (save_dir / "old-run").mkdir()
    before = tree(save_dir)
    report = mgr.reconcile(verify=True)
    assert report.actions == []
    assert tree(save_dir) == before
    assert mgr.check() == []


def test_reconcile_treats_a_framework_named_row_like_one_of_ours(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=None)})
    for step in (1, 2, 3):
        mgr.save(step, model=External(torch_writer(step), name=f"epoch={step}.ckpt"))
    (save_dir / "epoch=3.ckpt").unlink()
    flip_byte(save_dir / "epoch=2.ckpt")
    report = mgr.reconcile(verify=True)
    assert {(a.kind, a.path) for a in report.actions} >= {
        ("lost", "epoch=3.ckpt"),
        ("corrupt", "epoch=2.ckpt"),
    }
    assert mgr.latest().step == 1  # type: ignore[union-attr]


def test_a_corrupt_framework_file_is_refused_at_load(open_manager: Opener, save_dir: Path) -> None:
    mgr = open_manager()
    mgr.save(1, model=External(torch_writer(1.0), name="a.ckpt"))
    flip_byte(save_dir / "a.ckpt")
    with pytest.raises(CorruptCheckpointError):
        mgr.load("latest")


def test_a_crash_inside_the_writer_is_rolled_back_at_the_next_open(
    root: Path, save_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL-like death (``os._exit``) half way through a framework's write:
    the next open rolls the pending row back and removes the partial file."""
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=External(torch_writer(1.0), name="epoch=1.ckpt"))

    def body() -> int:
        def die_half_way(path: Path) -> None:
            path.write_bytes(b"partial")
            os._exit(9)

        with CheckpointManager(root) as mgr:
            mgr.save(2, model=External(die_half_way, name="epoch=2.ckpt"))
        return 0

    log = tmp_path / "child.log"
    pid = fork_running(root, log, body)
    assert wait_child(pid, timeout=60) == 9, tail(log)
    assert sorted(os.listdir(save_dir)) == [".epoch=2.ckpt.ckptdb-tmp-2", "epoch=1.ckpt"]
    with CheckpointManager(root) as mgr:
        assert [a.kind for a in mgr.last_reconcile.actions] == ["rolled_back"]
        assert sorted(os.listdir(save_dir)) == ["epoch=1.ckpt"]
        assert mgr.latest().step == 1  # type: ignore[union-attr]
        assert mgr.check() == []


def test_the_temporary_name_pattern() -> None:
    tmp = external_mod.temp_for("a/b/epoch=1.ckpt", 12)
    assert tmp == "a/b/.epoch=1.ckpt.ckptdb-tmp-12"
    assert external_mod.EXTERNAL_TEMP.fullmatch(Path(tmp).name)


# ------------------------------------------------------------------ distributed


def _two_rank_external(rank: int, world: int, root: str, fail_rank: int | None) -> Any:
    import torch.distributed as dist

    def write(path: Path) -> None:
        dist.barrier()  # a framework's save has collectives inside, on every rank
        if rank == fail_rank:
            raise OSError(5, f"rank {rank} could not write")
        if rank == 0:
            torch.save(state(float(rank)), path)

    with CheckpointManager(root) as mgr:
        try:
            saved = mgr.save(5, model=External(write, name="epoch=5.ckpt"))
        except PublishError as exc:
            return ("error", exc.phase, sorted(os.listdir(mgr.save_dir)))
        return ("ok", saved["model"].path.name, mgr.latest() == saved["model"])


@pytest.mark.timeout(90)
def test_every_rank_runs_the_writer_and_the_chief_commits(tmp_path: Path) -> None:
    outcomes = run_ranks(_two_rank_external, 2, tmp_path, str(tmp_path / "run"), None)
    assert [o.value for o in outcomes] == [("ok", "epoch=5.ckpt", True)] * 2, outcomes


@pytest.mark.timeout(90)
def test_a_writer_failing_on_one_rank_fails_the_boundary_on_every_rank(tmp_path: Path) -> None:
    outcomes = run_ranks(_two_rank_external, 2, tmp_path, str(tmp_path / "run"), 1)
    assert all(o.error is None for o in outcomes), outcomes
    assert [o.value[:2] for o in outcomes] == [("error", "write")] * 2
    assert outcomes[0].value[2] == []  # the chief rolled its file back
    assert LedgerClient(tmp_path / "run").rows("SELECT state FROM checkpoints") == [("aborted",)]


def _late_rank_directory(rank: int, world: int, root: str) -> Any:
    """A directory saver with no barrier at its end (Accelerate's ``save_state``, the
    Trainer's savers): rank 1 writes its file a second after rank 0 returned."""
    import time

    def write(path: Path) -> None:
        path.mkdir(exist_ok=True)
        if rank == 1:
            time.sleep(1.0)
        (path / f"rank{rank}.bin").write_bytes(bytes([rank]) * 1000)

    with CheckpointManager(root) as mgr:
        saved = mgr.save(5, model=External(write, name="state-5"))["model"]
        problems = mgr.check() if rank == 0 else []
        return sorted(os.listdir(saved.path)), saved.size, problems


@pytest.mark.timeout(90)
def test_the_chief_seals_only_after_every_rank_wrote(tmp_path: Path) -> None:
    outcomes = run_ranks(_late_rank_directory, 2, tmp_path, str(tmp_path / "run"))
    assert all(o.error is None for o in outcomes), outcomes
    names, size, problems = outcomes[0].value
    assert names == ["rank0.bin", "rank1.bin"]
    assert size == 2000  # the committed size counts rank 1's late file
    assert problems == []


# ------------------------------------------------------------------ protection


def test_a_protected_checkpoint_leaves_its_stream_but_its_file_stays(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=External(torch_writer(1.0), name="one.ckpt"))["model"]
    mgr.protect(first)
    mgr.save(2, model=External(torch_writer(2.0), name="two.ckpt"))
    mgr.save(3, model=External(torch_writer(3.0), name="three.ckpt"))
    assert sorted(os.listdir(save_dir)) == ["one.ckpt", "three.ckpt"]
    assert [c.step for c in mgr.checkpoints("model")] == [3]
    kept = LedgerClient(root).rows("SELECT state, error FROM checkpoints WHERE path = 'one.ckpt'")
    assert kept[0][0] == "deleted" and "kept on disk" in kept[0][1]
    assert mgr.check() == [] and mgr.reconcile(verify=True).actions == []
    with pytest.raises(ArgumentTypeError):
        mgr.protect("one.ckpt")  # type: ignore[arg-type]


def test_gc_keeps_a_protected_file_too(open_manager: Opener, save_dir: Path) -> None:
    mgr = open_manager(streams={"model": Keep(last=3)})
    saved = [
        mgr.save(s, model=External(torch_writer(s), name=f"{s}.ckpt"))["model"] for s in (1, 2)
    ]
    mgr.protect(saved[0])
    mgr.close()
    with CheckpointManager(mgr.root, streams={"model": Keep(last=1)}) as again:
        again.protect(saved[0])
        assert [c.step for c in again.gc()] == []  # nothing to remove: the file is kept
        assert sorted(os.listdir(save_dir)) == ["1.ckpt", "2.ckpt"]
        assert [c.step for c in again.checkpoints("model")] == [2]


def test_a_name_through_a_symlinked_directory_is_refused(
    open_manager: Opener, root: Path, save_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    mgr = open_manager()
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidArgumentError, match="outside"):
        mgr.save(1, model=External(torch_writer(1.0), name="link/x.ckpt"))
    assert os.listdir(outside) == [] and ckpt_rows(root) == []


def test_a_leftover_at_the_temporary_name_is_removed_never_written_through(
    open_manager: Opener, root: Path, save_dir: Path, tmp_path: Path
) -> None:
    """Row ids restart when a ledger is recreated; a link planted at the predictable
    temporary name must not make the writer write outside the save directory."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / ".x.ckpt.ckptdb-tmp-1").symlink_to(victim)
    (save_dir / ".y.ckpt.ckptdb-tmp-2").mkdir()
    (save_dir / ".y.ckpt.ckptdb-tmp-2" / "stale-shard").write_bytes(b"old")
    mgr = open_manager(streams={"model": Keep(last=None)})
    mgr.save(1, model=External(torch_writer(1.0), name="x.ckpt"))
    mgr.save(2, model=External(dir_writer({"new-shard": b"new"}), name="y.ckpt"))
    assert victim.read_text() == "precious"
    assert sorted(os.listdir(save_dir / "y.ckpt")) == ["new-shard"]
    assert sorted(os.listdir(save_dir)) == ["x.ckpt", "y.ckpt"]


def test_a_file_that_appears_at_the_name_during_the_write_is_never_replaced_or_removed(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager()

    def racing_writer(path: Path) -> None:
        torch.save(state(1.0), path)
        (save_dir / "a.ckpt").write_bytes(b"someone else's")

    with pytest.raises(PublishError) as caught:
        mgr.save(1, model=External(racing_writer, name="a.ckpt"))
    assert caught.value.phase == "replace"
    assert (save_dir / "a.ckpt").read_bytes() == b"someone else's"
    assert os.listdir(save_dir) == ["a.ckpt"] and [r[3] for r in ckpt_rows(root)] == ["aborted"]

    def failing_writer(path: Path) -> None:
        (save_dir / "b.ckpt").write_bytes(b"theirs too")
        raise OSError(5, "I/O error")

    with pytest.raises(PublishError):
        mgr.save(2, model=External(failing_writer, name="b.ckpt"))
    assert (save_dir / "b.ckpt").read_bytes() == b"theirs too"  # never placed: not ours


def test_reconcile_of_a_crash_before_placement_keeps_what_is_at_the_final_name(
    root: Path, save_dir: Path, tmp_path: Path
) -> None:
    def body() -> int:
        def die(path: Path) -> None:
            path.write_bytes(b"partial")
            (save_dir / "c.ckpt").write_bytes(b"not ours")
            os._exit(9)

        with CheckpointManager(root) as mgr:
            mgr.save(1, model=External(die, name="c.ckpt"))
        return 0

    log = tmp_path / "child.log"
    assert wait_child(fork_running(tmp_path, log, body), timeout=60) == 9, tail(log)
    with CheckpointManager(root) as mgr:
        assert [a.kind for a in mgr.last_reconcile.actions] == ["rolled_back"]
    assert os.listdir(save_dir) == ["c.ckpt"]
    assert (save_dir / "c.ckpt").read_bytes() == b"not ours"


def test_a_refused_name_records_no_metrics(open_manager: Opener, root: Path) -> None:
    mgr = open_manager()
    mgr.save(1, metrics={"loss": 1.0}, model=External(torch_writer(1.0), name="a.ckpt"))
    with pytest.raises(InvalidArgumentError):
        mgr.save(2, metrics={"loss": 2.0}, model=External(torch_writer(2.0), name="a.ckpt"))
    mgr.flush()
    assert LedgerClient(root).rows("SELECT step, value FROM metrics") == [(1, 1.0)]


def test_a_protected_checkpoint_in_ckptdbs_own_naming_is_not_quarantined(
    open_manager: Opener, root: Path, save_dir: Path
) -> None:
    mgr = open_manager(streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1.0))["model"]
    mgr.protect(first)
    mgr.save(2, model=state(2.0))
    mgr.close()
    with CheckpointManager(root) as again:
        assert again.last_reconcile.actions == []
        assert again.check() == []
    assert first.path.exists()
