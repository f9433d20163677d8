"""Followers: ``RunReader.follow`` yields each checkpoint a running trainer publishes.

In commit order, exactly once, resumable with a ``since`` cursor; a
checkpoint evicted before the follower read it is yielded with its state;
a pending row stops the read so nothing behind it is skipped. On SQLite the
follower polls; on PostgreSQL the commit itself wakes it (NOTIFY).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from crashlib import fork_running, tail, wait_child
from helpers import LedgerClient, state

import ckptdb.ledger.follow
from ckptdb import CheckpointManager, Keep, RunReader, faults
from ckptdb.errors import (
    ArgumentTypeError,
    CkptDBError,
    InvalidArgumentError,
    LedgerError,
    UnknownStreamError,
)

pytestmark = pytest.mark.timeout(120)

STREAMS = {"model": Keep(last=None)}


def start_writer(root: Path, tmp_path: Path, steps: range, go: Path) -> int:
    """A trainer in a child process: waits for ``go``, then saves one checkpoint a step."""

    def body() -> int:
        deadline = time.monotonic() + 60
        while not go.exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.01)
        with CheckpointManager(root, streams=STREAMS) as mgr:
            for step in steps:
                mgr.save(step, model=state(float(step)))
                time.sleep(0.02)
        return 0

    return fork_running(tmp_path, tmp_path / "writer.log", body)


def test_a_follower_sees_every_checkpoint_of_a_running_trainer_in_order_once(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, streams=STREAMS).close()
    go = tmp_path / "go"
    pid = start_writer(root, tmp_path, range(8), go)
    seen = []
    with RunReader(root) as reader:
        follower = reader.follow(timeout=30, poll=0.05)
        go.touch()
        for checkpoint in follower:
            seen.append(checkpoint)
            if len(seen) == 8:
                break
        follower.close()
    assert wait_child(pid, timeout=60) == 0, tail(tmp_path / "writer.log")
    assert [c.step for c in seen] == list(range(8))
    assert all(c.state == "committed" for c in seen)
    assert [c.id for c in seen] == sorted({c.id for c in seen})


def test_a_restarted_follower_continues_from_its_cursor(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr:
        for step in range(6):
            mgr.save(step, model=state(float(step)))
    with RunReader(root) as reader:
        first = []
        for checkpoint in reader.follow(since=0, timeout=1, poll=0.05):
            first.append(checkpoint)
            if len(first) == 3:
                break  # the follower is stopped (killed) after handling three
        rest = list(reader.follow(since=first[-1].id, timeout=0.3, poll=0.05))
        assert list(reader.follow(timeout=0.2, poll=0.05)) == []  # nothing new since now
    assert [c.step for c in first + rest] == list(range(6))


def test_the_time_spent_on_a_backlog_is_not_idle(tmp_path: Path) -> None:
    """An evaluator slower than ``timeout`` on each checkpoint of a backlog: the follow
    still waits ``timeout`` seconds for the next one once the backlog is done (ckptdb
    follow --timeout ends a follow that waited that long with nothing new, not one that
    was busy)."""
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(0, model=state(0.0))
        seen = []
        with RunReader(root) as reader:
            for checkpoint in reader.follow(since=0, timeout=3.0, poll=0.05):
                seen.append(checkpoint.step)
                if len(seen) == 1:
                    time.sleep(3.5)  # an evaluation longer than the timeout
                    later = threading.Timer(0.3, lambda: mgr.save(1, model=state(1.0)))
                    later.start()  # committed while the follower waits for the next
        later.join()
    assert seen == [0, 1]


def test_stop_ends_a_follow_that_waits_and_one_with_a_backlog(tmp_path: Path) -> None:
    """``stop`` is asked while the follower waits (a follow without a timeout ends within
    a poll of it) and before each checkpoint (a backlog is not handed out after it)."""
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, model=state(float(step)))
    stopped = threading.Event()
    with RunReader(root) as reader:
        waiting = reader.follow(poll=0.05, stop=stopped.is_set)  # nothing new: it waits
        threading.Timer(0.3, stopped.set).start()
        began = time.monotonic()
        assert list(waiting) == []
        assert time.monotonic() - began < 30  # ended by stop, not by a timeout (none)
        backlog = reader.follow(since=0, poll=0.05, stop=stopped.is_set)
        assert list(backlog) == [] and backlog.cursor == 0  # nothing handed out
        with pytest.raises(StopIteration):  # and stays ended
            next(backlog)
        given = []
        go_on = threading.Event()
        for checkpoint in reader.follow(since=0, poll=0.05, stop=go_on.is_set):
            given.append(checkpoint.step)
            go_on.set()  # asked before the next one: the rest of the backlog stays
        assert given == [1]


def test_checkpoints_evicted_before_the_follower_read_them_are_reported(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams={"model": Keep(last=1)}) as mgr:
        for step in range(3):
            mgr.save(step, model=state(float(step)))
    with RunReader(root) as reader:
        seen = list(reader.follow(since=0, timeout=0.3, poll=0.05))
    assert [(c.step, c.state) for c in seen] == [(0, "deleted"), (1, "deleted"), (2, "committed")]


def test_a_pending_checkpoint_stops_the_read_until_it_is_resolved(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=state(1.0))

    def crash_in_the_write() -> int:
        faults.set_hook(lambda name: os._exit(9) if name == "after_fsync" else None)
        with CheckpointManager(root, streams=STREAMS) as mgr:
            mgr.save(2, model=state(2.0))
        return 0

    log = tmp_path / "crash.log"
    assert wait_child(fork_running(tmp_path, log, crash_in_the_write), timeout=60) == 9, tail(log)
    with RunReader(root) as reader:
        assert [c.step for c in reader.follow(since=0, timeout=0.2, poll=0.05)] == [1]
        cursor = reader.checkpoints()[-1].id
    with CheckpointManager(root, streams=STREAMS) as mgr:  # rolls step 2 back
        mgr.save(3, model=state(3.0))
    with RunReader(root) as reader:
        after = list(reader.follow(since=cursor, timeout=0.2, poll=0.05))
    assert [(c.step, c.state) for c in after] == [(3, "committed")]  # the aborted one never was
    # a pending row that nobody could roll back, with later rows behind it, is dead: passed over
    LedgerClient(root).execute("UPDATE checkpoints SET state = 'pending' WHERE state = 'aborted'")
    with RunReader(root) as reader:
        assert [c.step for c in reader.follow(since=0, timeout=0.2, poll=0.05)] == [1, 3]


def test_following_an_unknown_stream_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, streams=STREAMS).close()
    with RunReader(root) as reader, pytest.raises(UnknownStreamError):
        next(reader.follow("nope", timeout=0.1))


@pytest.mark.postgres
def test_on_postgresql_the_commit_wakes_the_follower(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the recheck far beyond the follow's timeout, only NOTIFY can deliver."""
    monkeypatch.setattr(ckptdb.ledger.follow, "NOTIFIED_RECHECK", 3600.0)
    root = tmp_path / "run"
    CheckpointManager(root, streams=STREAMS, db_url=pg_url).close()
    committed_at: list[float] = []
    ready = threading.Event()

    def writer() -> None:
        ready.wait(30)
        with CheckpointManager(root, streams=STREAMS, db_url=pg_url) as mgr:
            for step in range(3):
                time.sleep(0.2)
                mgr.save(step, model=state(float(step)))
                committed_at.append(time.monotonic())

    thread = threading.Thread(target=writer)
    thread.start()
    woken: list[tuple[Any, float]] = []
    try:
        with RunReader(root, db_url=pg_url) as reader:
            follower = reader.follow(timeout=20, poll=3600)
            ready.set()
            for checkpoint in follower:
                woken.append((checkpoint, time.monotonic()))
                if len(woken) == 3:
                    break
            follower.close()
    finally:
        ready.set()
        thread.join(60)
    assert [c.step for c, _ in woken] == [0, 1, 2]
    latency = [at - done for (_, at), done in zip(woken, committed_at, strict=True)]
    print(f"NOTIFY wake-up latency after commit: {[f'{x * 1000:.1f} ms' for x in latency]}")


def test_a_follower_made_before_a_commit_sees_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr, RunReader(root) as reader:
        follower = reader.follow(timeout=0.5, poll=0.05)  # settled here, not at next()
        mgr.save(1, model=state(1.0))
        assert [c.step for c in follower] == [1]


def test_since_none_includes_a_boundary_already_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "run"
    release = threading.Event()
    held = threading.Event()

    def hold(name: str) -> None:
        if name == "after_fsync":
            held.set()
            release.wait(30)

    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=state(1.0))
        faults.set_hook(hold)
        try:
            handle = mgr.save(2, blocking=False, model=state(2.0))
            assert held.wait(30)
            with RunReader(root) as reader:
                follower = reader.follow(timeout=1, poll=0.05)  # step 2 is pending now
                release.set()
                handle.result(30)
                assert [c.step for c in follower] == [2]
        finally:
            release.set()
            faults.set_hook(None)


def test_closing_the_reader_stops_its_followers(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS) as mgr:
        mgr.save(1, model=state(1.0))
    reader = RunReader(root)
    follower = reader.follow(since=0, timeout=5, poll=0.05)
    assert next(follower).step == 1
    reader.close()
    with pytest.raises(LedgerError, match="closed"):
        next(follower)


@pytest.mark.parametrize(
    "poll, since, stop",
    [(0, None, None), (-1, None, None), (0.1, "3", None), (0.1, True, None), (0.1, None, True)],
)
def test_bad_follow_arguments_are_refused(tmp_path: Path, poll: Any, since: Any, stop: Any) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, streams=STREAMS).close()
    with RunReader(root) as reader, pytest.raises((InvalidArgumentError, ArgumentTypeError)):
        reader.follow(poll=poll, since=since, stop=stop)


@pytest.mark.postgres
def test_a_postgresql_follower_leaves_the_reader_read_only(pg_url: str, tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, streams=STREAMS, db_url=pg_url) as mgr:
        mgr.save(1, model=state(1.0))
    with RunReader(root, db_url=pg_url) as reader:
        for _ in range(3):  # the listening connection never returns to the pool
            assert [c.step for c in reader.follow(since=0, timeout=0.2)] == [1]
        with pytest.raises(CkptDBError):
            reader.sql("UPDATE checkpoints SET error = 'written by a reader'")
    assert LedgerClient(root, pg_url).rows("SELECT error FROM checkpoints") == [(None,)]
