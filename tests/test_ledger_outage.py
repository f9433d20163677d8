"""A ledger that goes away and comes back: a private PostgreSQL cluster stopped and
started under a running manager (never the shared server), and a second writer
that takes the run over meanwhile.

What is promised (docs/guarantees.md, "When the ledger is unreachable"): the
saves during the outage fail with :class:`LedgerUnavailableError`, one line
naming the ledger without its password; the first save after it succeeds in
the same manager; every acknowledged save is committed and the run checks
clean; a writer whose lock session ended never commits again once another
writer has opened the run.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from distlib import run_ranks
from pgcluster import Cluster, available

from ckptdb import CheckpointManager, Keep, RunReader, faults
from ckptdb.cli import main as ckptdb_cli
from ckptdb.errors import (
    CleanupWarning,
    CommitOutcomeUnknownError,
    LedgerLockedError,
    LedgerUnavailableError,
    PublishError,
    WriterLockLostError,
)

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    why = available()
    if why is not None:
        pytest.skip(why)
    made = Cluster(tmp_path_factory.mktemp("pgcluster"))
    made.start()
    yield made
    made.close()


@pytest.fixture
def server(cluster: Cluster) -> Iterator[Cluster]:
    """The private cluster, running before and after each test."""
    yield cluster
    if not cluster.running():  # a test that failed while it was down
        cluster.start()


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), float(step))}


def committed(root: Path, url: str) -> list[int]:
    with RunReader(root, db_url=url) as reader:
        return sorted(c.step for c in reader.checkpoints("model"))


def check_clean(root: Path, url: str) -> None:
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root), "--db-url", url])
    assert result.exit_code == 0 and "consistent" in result.output, result.output


def assert_one_clear_line(exc: BaseException, url: str) -> None:
    text = str(exc)
    assert "\n" not in text and "sqlalche.me" not in text and "Background on" not in text
    assert "is unreachable" in text and "training can go on" in text
    assert "127.0.0.1" in text and f":{url.rsplit(':', 1)[1].split('/')[0]}/" in text


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_saves_fail_typed_during_a_restart_and_succeed_after_it_in_the_same_manager(
    tmp_path: Path, server: Cluster, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, acknowledged, failed = tmp_path / "run", [], []
    with CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url) as mgr:
        for step in range(1, 9):
            if step == 3:
                server.stop(mode)
            if step == 6:
                server.start()
            try:
                mgr.save(step, model=state(step))
                acknowledged.append(step)
            except LedgerUnavailableError as exc:
                assert isinstance(exc, (ConnectionError, PublishError))
                assert exc.step == step and exc.__cause__ is not None
                assert_one_clear_line(exc, server.url)
                failed.append(step)
    assert (acknowledged, failed) == ([1, 2, 6, 7, 8], [3, 4, 5])
    assert committed(root, server.url) == acknowledged  # every acknowledged save, no other
    assert "taking the lock again" in caplog.text and "is held again" in caplog.text
    with RunReader(root, db_url=server.url) as reader:
        assert [a.end_state for a in reader.attempts()] == ["closed"]
    check_clean(root, server.url)


def test_a_restart_between_the_write_and_the_commit_fails_that_save_alone(
    tmp_path: Path, server: Cluster
) -> None:
    """The server goes away after the files are written: the commit fails typed, the
    rollback cannot be recorded (the row stays pending for the next reconcile) and no
    file is left under the checkpoint's name; the next save succeeds."""
    root = tmp_path / "run"
    armed = {"step": 2}

    def stop_before_commit(name: str) -> None:
        if name == "after_fsync_dir" and armed["step"] == 2:
            armed["step"] = 0
            server.stop("immediate")

    with CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url) as mgr:
        mgr.save(1, model=state(1))
        faults.set_hook(stop_before_commit)
        try:
            with (
                pytest.raises(LedgerUnavailableError) as failed,
                pytest.warns(CleanupWarning, match="record the rollback"),
            ):
                mgr.save(2, model=state(2))
        finally:
            faults.set_hook(None)
        assert failed.value.phase == "commit"
        assert_one_clear_line(failed.value, server.url)
        server.start()
        (kept,) = mgr.checkpoints("model")
        assert sorted((root / "checkpoints" / "model").iterdir()) == [kept.path]
        mgr.save(3, model=state(3))
    assert committed(root, server.url) == [1, 3]
    with CheckpointManager(root, db_url=server.url):  # its reconcile settles step 2's row
        pass
    check_clean(root, server.url)


def restarted_under(root: Path, server: Cluster) -> CheckpointManager:
    """A writer that committed step 1, then the server restarted under it (its lock
    session is gone, and it has not noticed yet)."""
    first = CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url)
    try:
        first.save(1, model=state(1))
        server.stop("immediate")
        server.start()
    except BaseException:
        first.close()
        raise
    return first


def test_a_writer_fenced_off_by_one_that_opened_during_the_outage_never_commits_again(
    tmp_path: Path, server: Cluster
) -> None:
    """The server restarts; a second writer opens the run before the first notices
    (the first's lock session is gone, so the lock is free). While it is open the
    first cannot take the lock back; after it closed, the fence stops the first."""
    root = tmp_path / "run"
    first = restarted_under(root, server)
    try:
        with CheckpointManager(root, db_url=server.url) as second:
            second.save(2, model=state(2))
            with pytest.raises(WriterLockLostError, match="another writer holds it"):
                first.save(3, model=state(3))
        with pytest.raises(WriterLockLostError):  # for good, once lost
            first.save(4, model=state(4))
    finally:
        first.close()
    assert committed(root, server.url) == [1, 2]


def test_the_fence_stops_a_writer_whose_lock_came_back_after_another_writer_came_and_went(
    tmp_path: Path, server: Cluster
) -> None:
    root = tmp_path / "run"
    first = restarted_under(root, server)
    try:
        with CheckpointManager(root, db_url=server.url) as second:  # opened and closed
            second.save(2, model=state(2))
        # the lock is free again and the first takes it back, but the run moved on
        with pytest.raises(WriterLockLostError, match="another writer opened it"):
            first.save(3, model=state(3))
        with pytest.raises(WriterLockLostError):
            first.save(4, model=state(4))
        # and it gave the lock up: a third writer can open the run
        with CheckpointManager(root, db_url=server.url) as third:
            third.save(5, model=state(5))
        first.log_metrics(6, {"loss": 0.5})
        # no other write either (metrics, retention); reading the run still works
        with pytest.raises(WriterLockLostError):
            first.flush()
        with pytest.raises(WriterLockLostError):
            first.gc()
        assert first.latest("model") is not None
    finally:
        first.close()  # records nothing: not its end, not its buffered metrics
    assert committed(root, server.url) == [1, 2, 5]
    with RunReader(root, db_url=server.url) as reader:
        assert [a.end_state for a in reader.attempts()] == ["crashed", "closed", "closed"]
        assert reader.metric_names() == []
    with RunReader(root, db_url=server.url) as reader:
        rows = reader.checkpoints(states=("pending", "aborted", "committed"))
    assert sorted(c.step for c in rows) == [1, 2, 5]  # the fenced writer wrote no row at all
    check_clean(root, server.url)


def test_a_writer_that_keeps_its_lock_through_a_blip_is_not_fenced(
    tmp_path: Path, server: Cluster
) -> None:
    """A second writer that tries to open while the first holds its lock is refused,
    as always: the fence never fires on a writer that never lost the run."""
    root = tmp_path / "run"
    with CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url) as mgr:
        mgr.save(1, model=state(1))
        with pytest.raises(LedgerLockedError):
            CheckpointManager(root, db_url=server.url)
        mgr.save(2, model=state(2))
    assert committed(root, server.url) == [1, 2]


def test_the_lock_log_lines_say_what_happened(
    tmp_path: Path, server: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with (
        caplog.at_level(logging.WARNING, logger="ckptdb.lock"),
        CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url) as mgr,
    ):
        mgr.save(1, model=state(1))
        server.stop("fast")
        server.start()
        mgr.save(2, model=state(2))
    messages = [r.getMessage() for r in caplog.records if r.name == "ckptdb.lock"]
    assert any("ended" in m and "taking the lock again" in m for m in messages), messages
    assert any("is held again" in m for m in messages), messages


def kill_the_commit_session(server: Cluster) -> None:
    """From another session: end the backend whose transaction is open (the commit's)."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    admin = create_engine(server.url, poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE state = 'idle in transaction' AND pid <> pg_backend_pid()"
            )
            conn.commit()
    finally:
        admin.dispose()


def lost_answer() -> Exception:
    """What the driver raises when the connection drops before COMMIT's answer came."""
    import psycopg
    import sqlalchemy.exc

    return sqlalchemy.exc.OperationalError(
        "COMMIT",
        {},
        psycopg.OperationalError("consuming input failed: server closed the connection"),
        connection_invalidated=True,
    )


@pytest.mark.parametrize("outcome", ["not committed", "committed"])
def test_a_commit_whose_answer_is_lost_is_settled_by_reading_the_ledger_back(
    tmp_path: Path, server: Cluster, outcome: str
) -> None:
    """Not committed: the backend is terminated (pg_terminate_backend from another
    session) just before COMMIT. Committed: COMMIT went through and its answer is
    lost (the connection error is raised once COMMIT returned). Either way the save
    says the outcome is unknown, keeps its files, and the next save settles it: a
    committed one stands (its metrics written once), another is rolled back."""
    root = tmp_path / "run"
    armed = {"on": True, "in_commit": False}

    def fault(name: str) -> None:
        if not armed["on"]:
            return
        if name == "in_commit":
            armed["in_commit"] = True  # the boundary's commit transaction, not the intent's
            if outcome == "not committed":
                armed["on"] = False
                kill_the_commit_session(server)
        if outcome == "committed" and name == "commit_answered" and armed["in_commit"]:
            armed["on"] = False
            raise lost_answer()

    with CheckpointManager(root, streams={"model": Keep(last=None)}, db_url=server.url) as mgr:
        mgr.save(1, model=state(1))
        mgr.log_metrics(2, {"loss": 0.25})
        faults.set_hook(fault)
        try:
            with pytest.raises(CommitOutcomeUnknownError) as unknown:
                mgr.save(2, model=state(2))
        finally:
            faults.set_hook(None)
        assert isinstance(unknown.value, LedgerUnavailableError)
        assert "not known yet" in str(unknown.value) and "\n" not in str(unknown.value)
        files = sorted(p.name for p in (root / "checkpoints" / "model").iterdir())
        assert len(files) == 2  # step 2's file kept: it may be a committed checkpoint
        mgr.save(3, model=state(3))  # settles step 2 first
        steps = [c.step for c in mgr.checkpoints("model")]
    if outcome == "committed":
        assert steps == [1, 2, 3]
        assert (root / "checkpoints" / "model").joinpath(files[1]).exists()
    else:
        assert steps == [1, 3]
        assert files[1] not in {p.name for p in (root / "checkpoints" / "model").iterdir()}
    with RunReader(root, db_url=server.url) as reader:
        assert [v for _, v, _ in reader.metric_history("loss")] == [0.25]  # once, either way
        states = {c.step: c.state for c in reader.checkpoints(states=("committed", "aborted"))}
        settled = [e for e in reader.events(limit=50) if e.kind == "commit_settled"]
    assert states[2] == ("committed" if outcome == "committed" else "aborted")
    assert len(settled) == (1 if outcome == "committed" else 0)
    check_clean(root, server.url)


def outage_on_two_ranks(rank: int, world: int, root: str, cluster: Cluster) -> dict[str, object]:
    """Each rank: save 1; the ledger goes down (rank 0 stops it) for save 2; back for 3."""
    import torch.distributed as dist

    failed: list[str] = []
    with CheckpointManager(
        Path(root), streams={"model": Keep(last=None)}, db_url=cluster.url
    ) as mgr:
        mgr.save(1, model=state(1))
        if rank == 0:
            cluster.stop("fast")
        dist.barrier()
        try:
            mgr.save(2, model=state(2))
        except PublishError as exc:
            failed.append(type(exc).__name__)
        if rank == 0:
            cluster.start()
        dist.barrier()
        mgr.save(3, model=state(3))
        latest = mgr.latest("model")
    return {"failed": failed, "latest": latest.step if latest is not None else None}


@pytest.mark.timeout(120)
def test_two_ranks_both_get_the_outage_error_and_both_save_after_it(
    tmp_path: Path, server: Cluster
) -> None:
    root = tmp_path / "run"
    ranks = run_ranks(outage_on_two_ranks, 2, tmp_path, str(root), server, timeout=90)
    assert [o.error for o in ranks] == [None, None], [o.trace for o in ranks]
    expected = {"failed": ["LedgerUnavailableError"], "latest": 3}
    assert [o.value for o in ranks] == [expected, expected]
    assert committed(root, server.url) == [1, 3]
    check_clean(root, server.url)
