"""Alembic environment for the ckptdb ledger.

ckptdb runs migrations itself when a ledger is opened (``ckptdb.ledger.engine``), passing
its own connection in ``config.attributes["connection"]``. From a checkout,
``alembic -c alembic.ini upgrade head`` works too; the URL then comes from
``-x db_url=...``, the ``CKPTDB_DB_URL`` environment variable, or alembic.ini.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

from ckptdb.ledger.engine import create_ledger_engine
from ckptdb.ledger.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("db_url")
    url = url or os.environ.get("CKPTDB_DB_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no ledger URL: pass -x db_url=... or set CKPTDB_DB_URL")
    return url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_ledger_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
