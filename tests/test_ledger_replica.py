"""The default SQLite ledger survives losing its machine (SeaweedFS, a real S3 server).

A replicator copies the ledger beside the checkpoints' copies
(:mod:`ckptdb.ledgercopy`); a new, empty machine comes back from the URL alone
(``ckptdb restore URL DIR``, :func:`ckptdb.restore_run`, or an open with
``remote=`` on a directory without a ledger). The ledger copies are checked
against the bucket itself: a replicator SIGKILLed mid-upload, a zombie
replicator on the old machine, a damaged copy, and bad input.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import s3lib
import torch
from click.testing import CliRunner
from filelock import FileLock

from ckptdb import CheckpointManager, Keep, Replicator, RunReader, restore_run
from ckptdb.cli import main
from ckptdb.errors import (
    CorruptLedgerReplicaError,
    InvalidArgumentError,
    LedgerReplicaNotFoundError,
    ObjectStoreError,
    RestoreTargetError,
    RunDirectoryError,
    RunTakenOverError,
)
from ckptdb.ledgercopy import PREFIX, STATE_NAME, LedgerCopier, fetch_ledger, iter_copies
from ckptdb.policies import Policy
from ckptdb.storage.remote import remote_store
from ckptdb.storage.s3 import S3Store

pytestmark = pytest.mark.timeout(120)

STREAMS: dict[str, Policy] = {"model": Keep(last=3)}


def state(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, generator=generator), "step": step}


def ledger_keys(client: Any, url: str) -> list[str]:
    return [k for k in s3lib.keys_under(client, url, ledger=True) if f"/{PREFIX}/" in k]


def train(root: Path, steps: range, **kwargs: Any) -> None:
    with CheckpointManager(root, streams=STREAMS, **kwargs) as mgr:
        for step in steps:
            mgr.log_metrics(step, {"lr": 0.1 * step})
            mgr.save(step, model=state(step), metrics={"loss": 1.0 / step})


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as con:
        return con.execute(sql).fetchall()


# ---------------------------------------------------------------------- the whole story


def test_a_lost_machine_comes_back_from_the_url_alone(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    """10 boundaries replicated with their ledger; the machine is lost (its directory
    deleted); a new empty directory is restored from the URL, resumes from the newest
    copied checkpoint bit-identical, trains on, and its history is there."""
    root = tmp_path / "exp1"
    with (
        Replicator(root_with_run(root), s3_url) as replicator,
        CheckpointManager(root, streams=STREAMS) as mgr,
    ):
        for step in range(1, 11):
            mgr.log_metrics(step, {"lr": 0.1 * step})
            mgr.save(step, model=state(step), metrics={"loss": 1.0 / step})
            replicator.replicate()
    assert replicator.ledger_copy is not None
    assert ledger_keys(client, s3_url)  # the ledger went beside the copies
    shutil.rmtree(root)  # the machine is gone: only the bucket is left

    new = tmp_path / "elsewhere" / "exp1"
    outcome = restore_run(s3_url, new)
    assert [(c.stream, c.step) for c in outcome.restored] == [("model", 10)]
    assert outcome.ledger.run == "exp1" and outcome.ledger.damaged == ()
    with CheckpointManager(new, remote=s3_url) as mgr:
        latest = mgr.latest("model")
        assert latest is not None and latest.step == 10
        got = mgr.load("latest")
        assert torch.equal(got["w"], state(10)["w"]) and got["step"] == 10
        mgr.save(11, model=state(11), metrics={"loss": 1 / 11})
        assert mgr.check(load=True) == []
    result = CliRunner().invoke(main, ["history", str(new), "--metric", "lr", "--json"])
    assert result.exit_code == 0, result.output
    points = [(p["step"], p["value"]) for p in json.loads(result.output)]
    assert points == [(step, pytest.approx(0.1 * step)) for step in range(1, 11)]
    kinds = [e.kind for e in RunReader(new).events(limit=1000)]
    assert "ledger_restored" in kinds


def root_with_run(root: Path, streams: dict[str, Policy] = STREAMS) -> Path:
    """An empty run at ``root`` (a replicator needs the run to exist)."""
    CheckpointManager(root, streams=streams).close()
    return root


# ---------------------------------------------------------------------- a replicator killed


def _copy_until_killed(root: str, url: str, marker: str) -> None:
    """A replicator whose ledger copy stops after its first part (for the parent to kill)."""

    def slow(self: LedgerCopier, rel: str, path: Path) -> Any:
        return self._remote.write_object(
            rel, s3lib.stalled_after_first_part(path, rel, Path(marker))
        )

    LedgerCopier._upload = slow  # type: ignore[method-assign]  # a forked child's own class
    with Replicator(root, url, storage_options={"part_size": 5 << 20}) as replicator:
        replicator.replicate()


def test_a_replicator_killed_mid_copy_leaves_the_last_whole_ledger_and_the_next_catches_up(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 4))
    with Replicator(root, s3_url) as replicator:
        replicator.replicate()
    first = replicator.ledger_copy
    assert first is not None and first.seq == 1
    with CheckpointManager(root, streams=STREAMS) as mgr:  # the ledger grows past 6 MB
        for step in range(4, 6):
            mgr.save(step, model=state(step))
        for point in range(3000):
            mgr.log_metrics(100 + point, {f"m{i}": float(i * point) for i in range(40)})
    assert (root / "ckptdb.sqlite").stat().st_size > 6 << 20
    marker = tmp_path / "uploading"
    child = multiprocessing.get_context("fork").Process(
        target=_copy_until_killed, args=(str(root), s3_url, str(marker))
    )
    child.start()
    try:
        s3lib.wait_for_marker(marker, child)
        assert [k for k in s3lib.uploads_under(client, s3_url) if f"/{PREFIX}/" in k]
        os.kill(child.pid or 0, signal.SIGKILL)
    finally:
        child.join(10)
    token = replicator._token
    remote = remote_store(s3_url, None, probe=False)
    assert list(iter_copies(remote, token)) == [(1, 1)]  # the half copy is not a copy
    looked = fetch_ledger(remote, token, tmp_path / "look.sqlite", claim=False)
    assert (looked.epoch, looked.seq) == (1, 1)
    steps = rows(tmp_path / "look.sqlite", "SELECT step FROM checkpoints ORDER BY step")
    assert steps == [(1,), (2,), (3,)]  # consistent, and as of the last whole copy

    with Replicator(root, s3_url) as replicator:  # the next start catches up
        assert replicator._ledger_copier is not None
        assert replicator._ledger_copier.aborted == 1  # the dead upload is gone
        replicator.replicate()
    caught_up = replicator.ledger_copy
    assert caught_up is not None and caught_up.seq > first.seq
    assert s3lib.uploads_under(client, s3_url) == []
    fetch_ledger(remote, token, tmp_path / "now.sqlite", claim=False)
    points = "SELECT count(*) FROM metrics WHERE name LIKE 'm%'"
    assert rows(tmp_path / "now.sqlite", points) == [(3000 * 40,)]
    assert rows(tmp_path / "now.sqlite", "SELECT max(step) FROM checkpoints") == [(5,)]


# ---------------------------------------------------------------------- never back in time


def test_a_zombie_replicator_on_the_old_machine_never_rolls_the_restored_run_back(
    tmp_path: Path, s3_url: str, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    old = tmp_path / "old" / "exp1"
    train(old, range(1, 4))
    zombie = Replicator(old, s3_url)
    try:
        zombie.replicate()
        new = tmp_path / "new" / "exp1"
        restore_run(s3_url, new)  # the old machine is believed lost: it is not
        with Replicator(new, s3_url) as replicator:
            train(new, range(4, 6))
            replicator.replicate()
        assert replicator.ledger_copy is not None and replicator.ledger_copy.epoch == 2
        first = zombie.ledger_copy
        train(old, range(4, 9))  # the zombie trains on; its replicator stops, copying nothing
        with pytest.raises(RunTakenOverError, match="restored on another machine"):
            zombie.replicate()
        assert "restored on another machine" in caplog.text
        with pytest.raises(RunTakenOverError):
            zombie.replicate()  # and stays stopped
    finally:
        zombie.close()
    assert zombie.ledger_copy == first and first is not None and first.epoch == 1
    for step in (6, 7, 8):  # none of the zombie's checkpoints went to the bucket
        assert not [k for k in s3lib.keys_under(client, s3_url) if f"step-{step:09d}" in k]
    again = restore_run(s3_url, tmp_path / "third" / "exp1")
    assert (again.ledger.epoch, again.ledger.claimed_epoch) == (2, 3)
    with RunReader(tmp_path / "third" / "exp1") as reader:
        every = reader.checkpoints("model", states=("committed", "lost", "deleted"))
        assert max(c.step for c in every) == 5  # the new machine's; none of the zombie's 6-8
        latest = reader.latest("model")
        assert latest is not None and latest.step == 5


def test_a_replicator_started_on_the_old_machine_after_the_restore_copies_no_ledger(
    tmp_path: Path, s3_url: str
) -> None:
    old = tmp_path / "old" / "exp1"
    train(old, range(1, 3))
    with Replicator(old, s3_url) as replicator:
        replicator.replicate()
    token = replicator._token
    restore_run(s3_url, tmp_path / "new" / "exp1")
    train(old, range(3, 5))
    with pytest.raises(RunTakenOverError, match="this machine's replicator stops"):
        Replicator(old, s3_url)
    remote = remote_store(s3_url, None, probe=False)
    assert list(iter_copies(remote, token)) == [(1, 1)]
    lock = FileLock(str(old / ".ckptdb.replicator.lock"), timeout=0)
    lock.acquire()  # the refused replicator let go of the run's lock
    lock.release()


# ---------------------------------------------------------------------- damaged copies


def copied_three_times(root: Path, url: str) -> Replicator:
    train(root, range(1, 2))
    with Replicator(root, url, ledger_interval=1e-3) as replicator:
        replicator.replicate()
        for step in (2, 3):
            train(root, range(step, step + 1))
            replicator.replicate()
    return replicator


def damage(client: Any, url: str, token: str, epoch: int, seq: int) -> None:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/{PREFIX}/{token}/e{epoch:06d}/{seq:012d}.sqlite"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def test_a_damaged_newest_copy_falls_back_to_an_earlier_one_with_a_warning(
    tmp_path: Path, s3_url: str, client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    replicator = copied_three_times(tmp_path / "exp1", s3_url)
    assert replicator.ledger_copy is not None and replicator.ledger_copy.seq == 3
    damage(client, s3_url, replicator._token, 1, 3)
    outcome = restore_run(s3_url, tmp_path / "new" / "exp1")
    assert (outcome.ledger.epoch, outcome.ledger.seq) == (1, 2)
    assert len(outcome.ledger.damaged) == 1 and "000000000003.sqlite" in outcome.ledger.damaged[0]
    assert "is damaged" in caplog.text
    with RunReader(tmp_path / "new" / "exp1") as reader:
        assert reader.latest("model") is not None
        assert [e.kind for e in reader.events(limit=1000)].count("ledger_restored") == 1


def test_every_copy_damaged_is_a_typed_error_and_nothing_is_written(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    replicator = copied_three_times(tmp_path / "exp1", s3_url)
    for seq in (1, 2, 3):
        damage(client, s3_url, replicator._token, 1, seq)
    target = tmp_path / "new" / "exp1"
    with pytest.raises(CorruptLedgerReplicaError, match="every ledger copy"):
        restore_run(s3_url, target)
    assert not target.exists()
    remote = remote_store(s3_url, None, probe=False)
    assert list(iter_copies(remote, replicator._token)) == [(1, 1), (1, 2), (1, 3)]


def test_older_copies_beyond_the_newest_three_are_removed(tmp_path: Path, s3_url: str) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 2))
    with Replicator(root, s3_url, ledger_interval=1e-3) as replicator:
        for step in range(2, 7):
            train(root, range(step, step + 1))
            replicator.replicate()
        unchanged = replicator.ledger_copy
        replicator.replicate()  # nothing changed: no copy
        assert replicator.ledger_copy == unchanged
    remote = remote_store(s3_url, None, probe=False)
    assert unchanged is not None
    assert list(iter_copies(remote, replicator._token)) == [
        (1, unchanged.seq - 2),
        (1, unchanged.seq - 1),
        (1, unchanged.seq),
    ]


def test_the_interval_holds_back_a_ledger_where_only_metrics_changed(
    tmp_path: Path, s3_url: str
) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 2))
    with Replicator(root, s3_url, ledger_interval=3600) as replicator:
        replicator.replicate()
        first = replicator.ledger_copy
        with CheckpointManager(root, streams=STREAMS) as mgr:
            mgr.log_metrics(5, {"lr": 0.5})
        replicator.replicate()
        assert replicator.ledger_copy == first  # metrics only: within the interval
        train(root, range(2, 3))
        replicator.replicate()  # a checkpoint was copied: the ledger goes at once
        assert replicator.ledger_copy is not None and first is not None
        assert replicator.ledger_copy.seq == first.seq + 1
        with CheckpointManager(root, streams=STREAMS) as mgr:
            mgr.log_metrics(6, {"lr": 0.6})
    # closing copies the ledger as it was left
    assert replicator.ledger_copy is not None and replicator.ledger_copy.seq == first.seq + 2


# ---------------------------------------------------------------------- what the bucket holds


def test_a_lost_machine_resumes_from_the_newest_copy_the_local_window_had_dropped(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 1-3 copied; then the uplink fails while training runs past the local
    window (Keep(last=2) evicts step 3) and only the ledger still gets through; the
    machine is lost. Step 3 comes back (committed again) and the run resumes from it."""
    root = tmp_path / "exp1"
    streams: dict[str, Policy] = {"model": Keep(last=2)}
    with Replicator(root_with_run(root, streams), s3_url) as replicator:
        with CheckpointManager(root, streams=streams) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, model=state(step))
            replicator.replicate()
            assert [c.step for c in mgr.checkpoints("model")] == [2, 3]

            def uplink_down(self: Replicator, path: Path, rel: str) -> Any:
                raise ConnectionError("the uplink is down")

            monkeypatch.setattr(Replicator, "_upload_file", uplink_down)
            for step in (4, 5):
                mgr.save(step, model=state(step))
            replicator.replicate()  # the copies of 4 and 5 fail; the ledger's goes
        monkeypatch.undo()
    shutil.rmtree(root)

    outcome = restore_run(s3_url, tmp_path / "new" / "exp1")
    assert [c.step for c in outcome.restored] == [3]
    assert outcome.lost == 2  # 4 and 5: committed, never copied
    with CheckpointManager(tmp_path / "new" / "exp1", remote=s3_url) as mgr:
        latest = mgr.latest("model")
        assert latest is not None and latest.step == 3
        assert torch.equal(mgr.load("latest")["w"], state(3)["w"])


def test_a_copy_of_an_abandoned_timeline_is_never_brought_back(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 10, 20, 30 copied; the run resumes from 10 and saves 20 again (the
    timeline rule evicts the old 20 and 30), whose copy never completes; the machine
    is lost. The old 30 has a whole copy but is of the abandoned timeline: step 10
    comes back, never 30."""
    root = tmp_path / "exp1"
    streams: dict[str, Policy] = {"model": Keep(last=None)}
    with Replicator(root_with_run(root, streams), s3_url) as replicator:
        with CheckpointManager(root, streams=streams) as mgr:
            for step in (10, 20, 30):
                mgr.save(step, model=state(step))
        replicator.replicate()

        def uplink_down(self: Replicator, path: Path, rel: str) -> Any:
            raise ConnectionError("the uplink is down")

        monkeypatch.setattr(Replicator, "_upload_file", uplink_down)
        with CheckpointManager(root, streams=streams) as mgr:
            mgr.save(20, model=state(2000))  # the resumed timeline's step 20
            assert [c.step for c in mgr.checkpoints("model")] == [10, 20]
        replicator.replicate()
        monkeypatch.undo()
    shutil.rmtree(root)
    outcome = restore_run(s3_url, tmp_path / "new" / "exp1")
    assert [c.step for c in outcome.restored] == [10]
    with CheckpointManager(tmp_path / "new" / "exp1", remote=s3_url) as mgr:
        latest = mgr.latest("model")
        assert latest is not None and latest.step == 10
        assert torch.equal(mgr.load("latest")["w"], state(10)["w"])


# ---------------------------------------------------------------------- open with remote=


def test_an_open_with_remote_on_a_directory_without_a_ledger_brings_the_run_back(
    tmp_path: Path, s3_url: str
) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 4))
    with Replicator(root, s3_url) as replicator:
        replicator.replicate()
    shutil.rmtree(root)
    with CheckpointManager(root, streams=STREAMS, remote=s3_url) as mgr:
        assert mgr.ledger_restored is not None and mgr.ledger_restored.run == "exp1"
        assert [c.step for c in mgr.restored_at_open] == [3]
        assert torch.equal(mgr.load("latest")["w"], state(3)["w"])
    # another name under the same prefix starts anew: never someone else's run
    with CheckpointManager(tmp_path / "exp2", streams=STREAMS, remote=s3_url) as mgr:
        assert mgr.ledger_restored is None and mgr.latest("model") is None


# ---------------------------------------------------------------------- bad input


def test_a_url_without_a_ledger_copy_is_a_typed_error_and_nothing_is_written(
    tmp_path: Path, s3_url: str
) -> None:
    target = tmp_path / "new"
    with pytest.raises(LedgerReplicaNotFoundError, match="no ledger copy"):
        restore_run(s3_url, target)
    assert not target.exists()
    result = CliRunner().invoke(main, ["restore", s3_url, str(target)])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1 and "no ledger copy" in result.output
    assert not target.exists()


def test_a_bucket_holding_another_runs_ledger_is_refused(tmp_path: Path, s3_url: str) -> None:
    for name in ("exp1", "exp2"):
        train(tmp_path / name, range(1, 2))
        with Replicator(tmp_path / name, s3_url) as replicator:
            replicator.replicate()
    target = tmp_path / "new"
    with pytest.raises(InvalidArgumentError, match=r"several runs.*exp1.*exp2"):
        restore_run(s3_url, target)
    with pytest.raises(LedgerReplicaNotFoundError, match=r"of the run 'exp3'.*exp1, exp2"):
        restore_run(s3_url, target, run="exp3")
    assert not target.exists()
    outcome = restore_run(s3_url, target, run="exp2")
    assert outcome.ledger.run == "exp2"
    other = tmp_path / "by-token"
    by_token = restore_run(s3_url, other, run=outcome.ledger.token)  # runs of one name apart
    assert by_token.ledger.run == "exp2"


def test_a_url_that_is_not_one_is_refused_without_its_credentials(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="object-storage URL") as caught:
        restore_run("https://AKIAEXAMPLE:hunter2secret@minio.internal/bucket", tmp_path / "x")
    assert "hunter2secret" not in str(caught.value) and "AKIAEXAMPLE" not in str(caught.value)
    assert not (tmp_path / "x").exists()


def test_an_unreadable_state_file_is_an_error_not_epoch_one(tmp_path: Path, s3_url: str) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 2))
    (root / STATE_NAME).write_text("{ torn")
    with pytest.raises(RunDirectoryError, match="unreadable"):
        Replicator(root, s3_url)
    assert (root / STATE_NAME).read_text() == "{ torn"


def test_a_copy_that_cannot_be_read_now_is_an_error_never_an_older_ledger(
    tmp_path: Path, s3_url: str, client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout reading the newest copy is not damage: the restore fails, claims no
    epoch and writes nothing, rather than bring back an older ledger."""
    copied_three_times(tmp_path / "exp1", s3_url)
    original = S3Store.download

    def timing_out(self: S3Store, rel: str, sink: Any) -> Any:
        if rel.endswith("000000000003.sqlite"):
            raise ObjectStoreError("GetObject timed out (read timeout=60)")
        return original(self, rel, sink)

    monkeypatch.setattr(S3Store, "download", timing_out)
    target = tmp_path / "new" / "exp1"
    with pytest.raises(ObjectStoreError, match="timed out"):
        restore_run(s3_url, target)
    assert not target.exists()
    monkeypatch.undo()
    listing = s3lib.keys_under(client, s3_url, ledger=True)
    assert not [k for k in listing if "claim.json" in k]  # nothing taken over
    assert restore_run(s3_url, target).ledger.seq == 3


def test_a_target_that_is_not_empty_is_refused_and_left_as_it_was(
    tmp_path: Path, s3_url: str
) -> None:
    train(tmp_path / "exp1", range(1, 2))
    with Replicator(tmp_path / "exp1", s3_url) as replicator:
        replicator.replicate()
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(RestoreTargetError, match="not empty"):
        restore_run(s3_url, target)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    result = CliRunner().invoke(main, ["restore", s3_url, str(target)])
    assert result.exit_code == 1 and "not empty" in result.output
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    with pytest.raises(RestoreTargetError):
        restore_run(s3_url, tmp_path / "exp1")  # never over the live run either


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_a_bad_ledger_interval_is_refused(tmp_path: Path, s3_url: str, interval: Any) -> None:
    train(tmp_path / "exp1", range(1, 2))
    with pytest.raises(InvalidArgumentError, match="ledger_interval"):
        Replicator(tmp_path / "exp1", s3_url, ledger_interval=interval)
    with Replicator(tmp_path / "exp1", s3_url) as replicator:  # nothing held, nothing copied
        assert replicator.ledger_copy is None


def test_status_says_when_the_ledger_was_copied_and_what_has_no_copy(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "exp1"
    train(root, range(1, 3))
    with Replicator(root, s3_url) as replicator:
        replicator.replicate()
    train(root, range(3, 4))  # not copied yet
    result = CliRunner().invoke(main, ["status", str(root), "--json"])
    assert result.exit_code == 0, result.output
    (tier,) = json.loads(result.output)["tiers"]
    assert tier["uncopied"] == 1
    copy = replicator.ledger_copy
    assert copy is not None
    assert tier["ledger_copy"]["copied_at"] == copy.copied_at
    assert tier["ledger_copy"]["location"] == copy.location
    text = CliRunner().invoke(main, ["status", str(root)]).output
    assert "1 committed checkpoint(s) have no whole copy yet" in text
    assert f"ledger last copied at {copy.copied_at}" in text


def test_a_copy_swapped_for_another_sound_database_is_never_used(
    tmp_path: Path, s3_url: str, client: Any
) -> None:
    """The newest copy's object replaced by an older, sound SQLite file: SQLite's
    integrity check passes, the manifest's size and hash do not, so the restore says
    so and uses the copy that is what it claims."""
    replicator = copied_three_times(tmp_path / "exp1", s3_url)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    folder = f"{prefix}/{PREFIX}/{replicator._token}/e000001"
    older = client.get_object(Bucket=bucket, Key=f"{folder}/000000000001.sqlite")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{folder}/000000000003.sqlite", Body=older)
    outcome = restore_run(s3_url, tmp_path / "new" / "exp1")
    assert (outcome.ledger.epoch, outcome.ledger.seq) == (1, 2)
    assert "its manifest says" in outcome.ledger.damaged[0]


def test_the_replicate_commands_default_ledger_interval_is_the_libraries() -> None:
    """``ckptdb replicate --ledger-interval`` defaults to what Replicator does (the CLI
    spells the number out so that its module imports no ledgercopy on a cold start)."""
    from ckptdb.ledgercopy import DEFAULT_INTERVAL

    option = next(p for p in main.commands["replicate"].params if p.name == "ledger_interval")
    assert option.default == DEFAULT_INTERVAL
