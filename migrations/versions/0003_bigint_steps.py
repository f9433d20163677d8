"""64-bit steps on PostgreSQL

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

The ``step`` columns of ``checkpoints``, ``metrics`` and ``events`` were
``INTEGER``: 64-bit on SQLite, but 32-bit on PostgreSQL, where a run that
counts its steps in samples or tokens passes 2**31 - 1 within days. They become
``BIGINT`` there; on SQLite nothing changes (its ``INTEGER`` already holds
64 bits), so this revision does nothing on SQLite.

PostgreSQL refuses to change the type of a column that a view reads, so
ckptdb's views are dropped first and then created again from their SQL as
revisions 0001 and 0002 wrote it (read from those revisions' files, so that
there is one text of each). A view of the user's own that reads these columns
or ckptdb's views is never dropped: the revision refuses to start, naming it
(``SchemaVersionError``), and nothing changes.

The change rewrites the three tables (``metrics`` is the large one): a one-time
cost at the first open by a ckptdb that has this revision, under the
migration lock. Downgrading turns the columns back into ``INTEGER``; PostgreSQL
refuses it (``integer out of range``), changing nothing, while any step is
past 2**31 - 1.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import context, op

from ckptdb.errors import SchemaVersionError

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STEP_COLUMNS = (("checkpoints", False), ("metrics", False), ("events", True))
#: A policy's numbers (``Keep(last, every)``, ``TopK(k)``): 64-bit as on SQLite, where a
#: ``Keep(every=...)`` in steps counted in tokens, or a ``Keep.from_ratio`` of a long
#: run, is stored as it is.
POLICY_NUMBERS = (
    ("streams", "keep_last", True),
    ("streams", "keep_every", True),
    ("streams", "k", True),
)


def upgrade() -> None:
    _retype(sa.Integer(), sa.BigInteger(), "BIGINT")


def downgrade() -> None:
    _retype(sa.BigInteger(), sa.Integer(), "INTEGER")


def _retype(old: sa.types.TypeEngine[int], new: sa.types.TypeEngine[int], new_sql: str) -> None:
    """Steps, policy numbers and ``metrics.id`` (with its sequence) become ``new``.

    ``metrics.id``: one row per point, in a table every run of the database
    shares, passes 2**31 - 1 within a team's year of runs; the rewrite of
    ``metrics`` for its steps pays for this too.
    """
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite's INTEGER is 64-bit already
    views = views_of_0002()
    offline = context.is_offline_mode()
    if not offline:
        schema, search_path = _enter_ledger_schema()
        _refuse_views_of_others(schema, list(views))
        extras = _view_extras(schema, list(views))
    for name in reversed(list(views)):
        op.execute(f"DROP VIEW {name}")
    columns = [(t, "step", n) for t, n in STEP_COLUMNS] + list(POLICY_NUMBERS)
    for table, column, nullable in columns:
        op.alter_column(table, column, existing_type=old, type_=new, existing_nullable=nullable)
    op.alter_column("metrics", "id", existing_type=old, type_=new, existing_nullable=False)
    op.execute(f"ALTER SEQUENCE metrics_id_seq AS {new_sql}")
    for name, sql in views.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")
    if offline:
        op.execute("-- grants, owners and comments of the views above are not restored")
        return
    for statement in extras:
        op.execute(statement)
    _set_search_path(search_path)


def _enter_ledger_schema() -> tuple[str, str]:
    """Work in the schema that holds the ledger (the one ``checkpoints`` resolves to
    on the caller's search path), for this revision only: with another schema first
    on the path, the views would be created there. Returns it, quoted as needed,
    and the search path to go back to."""
    bind = op.get_bind()
    schema: str = bind.execute(
        sa.text(
            "SELECT relnamespace::regnamespace::text FROM pg_class "
            "WHERE oid = 'checkpoints'::regclass"
        )
    ).scalar_one()
    previous: str = bind.execute(sa.text("SELECT current_setting('search_path')")).scalar_one()
    _set_search_path(schema)
    return schema, previous


def _set_search_path(path: str) -> None:
    """For the rest of the migration's transaction only (``set_config(..., true)``)."""
    op.get_bind().execute(sa.text("SELECT set_config('search_path', :path, true)"), {"path": path})


def _view_extras(schema: str, names: list[str]) -> list[str]:
    """What ``DROP VIEW`` would lose and ``CREATE VIEW`` does not bring back: the
    privileges granted on each view (a dashboard's read-only role), its owner and
    its comment, as the statements that restore them."""
    bind = op.get_bind()
    rows = bind.execute(
        sa.text(
            """
            SELECT c.relname,
                   CASE WHEN c.relowner <> (
                       SELECT oid FROM pg_roles WHERE rolname = current_user
                   ) THEN pg_get_userbyid(c.relowner) END,
                   obj_description(c.oid, 'pg_class'),
                   c.relacl IS NULL
            FROM pg_class c
            WHERE c.relnamespace = CAST(:schema AS regnamespace)
              AND c.relkind = 'v' AND c.relname = ANY(:names)
            """
        ),
        {"schema": schema, "names": names},
    ).all()
    quote = bind.dialect.identifier_preparer.quote
    statements = []
    for view, owner, comment, default_acl in rows:
        if owner is not None:  # another role's view: it stays theirs
            statements.append(f"ALTER VIEW {view} OWNER TO {quote(owner)}")
        if comment is not None:
            literal = comment.replace("'", "''")
            statements.append(f"COMMENT ON VIEW {view} IS '{literal}'")
        if default_acl:
            continue
        statements.append(f"REVOKE ALL ON {view} FROM PUBLIC")
        grants = bind.execute(
            sa.text(
                """
                SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                       a.privilege_type, a.is_grantable
                FROM pg_class c, aclexplode(c.relacl) a
                WHERE c.relnamespace = CAST(:schema AS regnamespace) AND c.relname = :view
                """
            ),
            {"schema": schema, "view": view},
        ).all()
        for grantee, privilege, grantable in grants:
            option = " WITH GRANT OPTION" if grantable else ""
            statements.append(f"GRANT {privilege} ON {view} TO {grantee}{option}")
    return statements


def _refuse_views_of_others(schema: str, ours: list[str]) -> None:
    """A view that is not ckptdb's and reads a step column or one of ckptdb's views
    would make the change fail half-way (PostgreSQL's message names only the view
    it could not drop): refused up front, by name, before anything is changed."""
    found = (
        op.get_bind()
        .execute(
            sa.text(
                """
            SELECT DISTINCT dependent.relnamespace::regnamespace::text || '.' || dependent.relname
            FROM pg_depend d
            JOIN pg_rewrite r ON r.oid = d.objid
            JOIN pg_class dependent ON dependent.oid = r.ev_class
            JOIN pg_class used ON used.oid = d.refobjid
            LEFT JOIN pg_attribute a ON a.attrelid = used.oid AND a.attnum = d.refobjsubid
            WHERE d.classid = 'pg_rewrite'::regclass AND d.refclassid = 'pg_class'::regclass
              AND used.relnamespace = CAST(:schema AS regnamespace)
              AND dependent.oid <> used.oid
              AND NOT (dependent.relnamespace = used.relnamespace
                       AND dependent.relname = ANY(:ours))
              AND (used.relname = ANY(:ours)
                   OR (used.relname = ANY(:tables) AND a.attname = 'step'))
            ORDER BY 1
            """
            ),
            {"schema": schema, "ours": ours, "tables": [table for table, _ in STEP_COLUMNS]},
        )
        .scalars()
    )
    others = list(found)
    if others:
        raise SchemaVersionError(
            "schema revision 0003 widens the ledger's step columns to 64 bits, which "
            "PostgreSQL allows only after dropping the views that read them; "
            f"these views depend on them and are not ckptdb's: {', '.join(others)}. "
            "Drop them, open the run (or run `ckptdb db upgrade`), then create them again"
        )


def views_of_0002() -> dict[str, str]:
    """Every view as revision 0002 left it, in creation order: 0001's, with 0002's
    ``best_checkpoints``, then 0002's ``checkpoint_evaluations``."""
    initial, pins = _revision("0001_initial.py"), _revision("0002_pins_evaluations.py")
    views: dict[str, str] = dict(initial.VIEWS)
    views["best_checkpoints"] = pins.BEST_AFTER
    views["checkpoint_evaluations"] = pins.CHECKPOINT_EVALUATIONS
    return views


def _revision(file_name: str) -> ModuleType:
    """An earlier revision's module, loaded from its file beside this one (revisions
    are files Alembic loads by path, not an importable package)."""
    path = Path(__file__).with_name(file_name)
    spec = importlib.util.spec_from_file_location(f"_ckptdb_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
