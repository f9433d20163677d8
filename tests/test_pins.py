"""Pins: a reader's lease keeps an evicted checkpoint's file on disk until released.

The writer evicts a pinned checkpoint from its stream as usual; its row stays
``deleting`` with its file (the visible intermediate state) until the last
pin is released or its lease expires, then the writer's next commit, ``gc``
or reconcile removes it. A reader pins without the writer lock, in a short
transaction that never races an eviction.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import LedgerClient, invoke, state

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.errors import ArgumentTypeError, CheckpointNotFoundError, InvalidArgumentError
from ckptdb.ledger import pins as ledger_pins

pytestmark = pytest.mark.timeout(120)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def states(mgr: CheckpointManager) -> dict[int, str]:
    every = ("committed", "deleting", "deleted")
    return {c.step: c.state for c in mgr.checkpoints(states=every)}


def pin_rows(root: Path, db_url: str | None) -> list[tuple[int, ...]]:
    client = LedgerClient(root, db_url)
    try:
        return [tuple(r) for r in client.rows("SELECT checkpoint_id FROM pins ORDER BY id")]
    finally:
        client.close()


def test_a_pinned_checkpoint_survives_its_eviction_and_goes_after_release(
    root: Path, backend: str | None
) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=1)}, db_url=backend) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        with RunReader(root, db_url=backend) as reader:
            with reader.pin("latest") as pin:
                assert pin.checkpoint.id == first.id
                mgr.save(2, model=state(2.0))
                assert states(mgr) == {1: "deleting", 2: "committed"}
                assert first.path.exists()  # the intermediate state: evicted, still there
                assert torch.equal(reader.load(pin)["w"], state(1.0)["w"])  # as pinned
                assert mgr.check() == []
                mgr.save(3, model=state(3.0))  # still pinned: still there
                assert first.path.exists() and states(mgr)[1] == "deleting"
            assert pin.released
            mgr.save(4, model=state(4.0))
        assert states(mgr) == {1: "deleted", 2: "deleted", 3: "deleted", 4: "committed"}
        assert not first.path.exists()
        assert pin_rows(root, backend) == []  # pins of removed checkpoints are cleared
        assert mgr.check() == []


def test_an_evicted_checkpoint_cannot_be_pinned_and_nothing_is_written(root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        mgr.save(2, model=state(2.0))
        with RunReader(root) as reader:
            with pytest.raises(CheckpointNotFoundError):
                reader.pin(first)
            with pytest.raises(CheckpointNotFoundError):
                reader.pin(99)  # no such step
    assert pin_rows(root, None) == []


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ttl": 0}, InvalidArgumentError),
        ({"ttl": -5}, InvalidArgumentError),
        ({"ttl": "10"}, InvalidArgumentError),
        ({"ttl": True}, InvalidArgumentError),
        ({"holder": 3}, ArgumentTypeError),
    ],
)
def test_bad_pin_arguments_are_refused_before_anything_is_written(
    root: Path, kwargs: dict[str, object], error: type[Exception]
) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
        with RunReader(root) as reader, pytest.raises(error):
            reader.pin("latest", **kwargs)  # type: ignore[arg-type]
    assert pin_rows(root, None) == []


def test_the_lease_is_renewed_while_the_pin_is_held(root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        with RunReader(root) as reader, reader.pin("latest", ttl=0.6) as pin:
            granted = pin.expires_at
            mgr.save(2, model=state(2.0))
            time.sleep(1.5)  # more than twice the TTL: only renewal keeps it
            mgr.save(3, model=state(3.0))
            assert first.path.exists() and not pin.lost
            assert pin.expires_at > granted
        mgr.save(4, model=state(4.0))
        assert not first.path.exists()


PINNER = """
    import sys, time
    from ckptdb import RunReader
    reader = RunReader(sys.argv[1])
    pin = reader.pin("latest", ttl=float(sys.argv[2]))
    print("pinned", pin.checkpoint.step, flush=True)
    time.sleep(600)
"""


def test_the_lease_of_a_killed_reader_expires(root: Path, tmp_path: Path) -> None:
    """A crashed evaluator must not pin forever: its lease runs out, then the
    writer's next commit removes the file it held."""
    script = tmp_path / "pinner.py"
    script.write_text(textwrap.dedent(PINNER))
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        first = mgr.save(1, model=state(1.0))["model"]
        child = subprocess.Popen(
            [sys.executable, str(script), str(root), "2.0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().split() == ["pinned", "1"]
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            child.kill()
        mgr.save(2, model=state(2.0))
        assert first.path.exists()  # the lease is still running
        time.sleep(2.5)
        mgr.save(3, model=state(3.0))
        assert not first.path.exists()
        assert states(mgr)[1] == "deleted"
        assert pin_rows(root, None) == []


def test_reconcile_keeps_a_pinned_file_and_removes_it_once_released(root: Path) -> None:
    mgr = CheckpointManager(root, streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1.0))["model"]
    reader = RunReader(root)
    pin = reader.pin("latest")
    mgr.save(2, model=state(2.0))
    mgr.close()
    with CheckpointManager(root) as again:
        assert first.path.exists() and states(again)[1] == "deleting"
        assert [a.kind for a in again.last_reconcile.actions] == []
    pin.release()
    reader.close()
    with CheckpointManager(root) as again:
        assert not first.path.exists() and states(again)[1] == "deleted"
        assert [a.kind for a in again.last_reconcile.actions] == ["deleted"]
    assert pin_rows(root, None) == []


def test_gc_respects_pins_and_clears_expired_ones(root: Path) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=3)}) as mgr:
        saved = [mgr.save(step, model=state(float(step)))["model"] for step in (1, 2, 3)]
    reader = RunReader(root)
    held = reader.pin(1)
    expiring = reader.pin(2, ttl=0.3)
    expiring._stop.set()  # a reader that stopped renewing: its lease will run out
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        time.sleep(0.5)
        removed = mgr.gc()
        assert [c.step for c in removed] == [2]
        assert saved[0].path.exists() and not saved[1].path.exists()
        assert states(mgr) == {1: "deleting", 2: "deleted", 3: "committed"}
        held.release()
        assert [c.step for c in mgr.gc()] == [1]
        assert not saved[0].path.exists()
    reader.close()
    assert pin_rows(root, None) == []


def test_a_pin_whose_lease_was_cleared_knows_it_was_lost(root: Path) -> None:
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    with RunReader(root) as reader:
        pin = reader.pin("latest", ttl=0.3)
        LedgerClient(root).execute("DELETE FROM pins")  # what the writer does to an expired one
        deadline = time.monotonic() + 5
        while not pin.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pin.lost
        pin.release()


def test_pins_and_evictions_never_race(root: Path, backend: str | None) -> None:
    """A reader pins the latest checkpoint over and over while the writer evicts it
    at every boundary: each pin either fails (already evicted) or holds a file that
    stays readable until it is released."""
    problems: list[str] = []
    stop = threading.Event()
    held = 0

    def reader_loop() -> None:
        nonlocal held
        try:
            with RunReader(root, db_url=backend) as reader:
                while not stop.is_set():
                    try:
                        pin = reader.pin("latest", ttl=30)
                    except CheckpointNotFoundError:
                        continue
                    with pin:
                        held += 1
                        time.sleep(0.002)
                        if not pin.checkpoint.path.exists():
                            problems.append(f"step {pin.checkpoint.step} vanished while pinned")
        except Exception as exc:  # a reader that dies (a deadlock with the writer) fails it
            problems.append(f"the reader died: {exc!r}")

    with CheckpointManager(root, streams={"model": Keep(last=1)}, db_url=backend) as mgr:
        mgr.save(0, model=state(0.0))
        thread = threading.Thread(target=reader_loop)
        thread.start()
        try:
            for step in range(1, 60):
                mgr.save(step, model=state(float(step)))
        finally:
            stop.set()
            thread.join(timeout=60)
        mgr.save(60, model=state(60.0))
        assert problems == []
        assert held > 0
        assert [c.step for c in mgr.checkpoints()] == [60]
        assert mgr.check() == []


def test_ckptdb_pins_lists_them(root: Path, runner: CliRunner) -> None:
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        mgr.save(1, model=state(1.0))
        with RunReader(root) as reader, reader.pin("latest", holder="evaluator-a"):
            mgr.save(2, model=state(2.0))
            out = ok(invoke(runner, "pins", root)).stdout
            assert "evaluator-a" in out and "deleting" in out and "live" in out
        out = ok(invoke(runner, "pins", root)).stdout
        assert "released" in out


def test_an_expired_lease_is_never_revived_by_a_late_renewal(root: Path) -> None:
    """The writer may already have acted on an expiry: renewing it then would tell the
    reader it still holds a file that is gone."""
    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    with RunReader(root) as reader:
        pin = reader.pin("latest", ttl=600)
        pin._stop.set()  # no renewals from the thread; the test renews by hand
        LedgerClient(root).execute(
            "UPDATE pins SET expires_at = ? WHERE id = ?", "2000-01-01 00:00:00.000000", pin.id
        )
        with reader._writable().transaction() as session:
            assert ledger_pins.renew(session, pin.id, 600) is None


def test_the_writers_postgresql_transactions_are_read_committed(pg_url: str, root: Path) -> None:
    """Pins rely on each statement of the eviction seeing what committed before it: a
    server or role default of REPEATABLE READ must not change that."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    options = url.query["options"] + " -cdefault_transaction_isolation=repeatable\\ read"
    stricter = url.update_query_dict({"options": options}).render_as_string(hide_password=False)
    with CheckpointManager(root, db_url=stricter) as mgr:
        with mgr._ctx.ledger.transaction() as session:
            level = session.execute(text("SHOW transaction_isolation")).scalar_one()
        mgr.save(1, model=state(1.0))
    assert level == "read committed"


def test_a_reader_never_writes_a_sqlite_ledger_on_a_network_filesystem(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptdb.errors import NetworkFilesystemError
    from ckptdb.ledger import netfs

    with CheckpointManager(root) as mgr:
        mgr.save(1, model=state(1.0))
    monkeypatch.delenv("CKPTDB_ALLOW_NETWORK_SQLITE", raising=False)
    monkeypatch.setattr(netfs, "is_network_filesystem", lambda fstype: True)
    with RunReader(root) as reader:
        assert reader.latest() is not None  # reading is fine
        with pytest.raises(NetworkFilesystemError):
            reader.pin("latest")
        with pytest.raises(NetworkFilesystemError):
            reader.record_evaluation(reader.latest(), {"acc": 1.0}, evaluator="e")
    monkeypatch.undo()
    assert pin_rows(root, None) == []


def test_a_file_released_after_the_last_commit_goes_when_the_trainer_closes(root: Path) -> None:
    mgr = CheckpointManager(root, streams={"model": Keep(last=1)})
    first = mgr.save(1, model=state(1.0))["model"]
    with RunReader(root) as reader:
        with reader.pin("latest"):
            mgr.save(2, model=state(2.0))  # the last commit: step 1 kept for the pin
        assert first.path.exists()
        mgr.close()  # released after the last commit: removed at close, not at the next open
        assert not first.path.exists()
        assert {c.step: c.state for c in reader.checkpoints(states=("deleted",))} == {1: "deleted"}
    assert pin_rows(root, None) == []
