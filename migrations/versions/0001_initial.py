"""initial ledger schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# The views as this revision created them (frozen here, not imported, so that a
# later change to ckptdb.ledger.models cannot alter what this revision does).
VIEWS = {
    "latest_checkpoints": """
        SELECT p.run_id AS run_id, c.stream AS stream, c.step AS step, c.path AS path,
               c.size AS size, c.hash AS hash, c.metric AS metric,
               c.committed_at AS committed_at, c.id AS checkpoint_id
        FROM pointers p JOIN checkpoints c ON c.id = p.checkpoint_id
        WHERE p.name LIKE 'latest:%' AND c.state = 'committed'
    """,
    "best_checkpoints": """
        SELECT c.run_id AS run_id, c.stream AS stream, c.step AS step, c.path AS path,
               c.metric AS metric, s.metric AS metric_name, s.mode AS mode,
               ROW_NUMBER() OVER (
                   PARTITION BY c.run_id, c.stream
                   ORDER BY CASE WHEN s.mode = 'max' THEN -c.metric ELSE c.metric END, c.step
               ) AS rank,
               c.id AS checkpoint_id
        FROM checkpoints c
        JOIN streams s ON s.run_id = c.run_id AND s.name = c.stream
        WHERE s.kind = 'topk' AND c.state = 'committed'
    """,
    "attempt_summary": """
        SELECT t.*,
               CASE WHEN t.end_state = 'crashed' THEN t.last_step_seen - COALESCE(
                   t.last_committed_step,
                   (SELECT c.step FROM checkpoints c WHERE c.id = t.resumed_from_id), -1)
               END AS steps_lost
        FROM (
            SELECT a.run_id AS run_id, a.id AS attempt_id, a.started_at AS started_at,
                   a.ended_at AS ended_at, a.end_state AS end_state, a.host AS host,
                   a.pid AS pid, a.resumed_from_id AS resumed_from_id,
                   (SELECT MAX(seen.step) FROM (
                        SELECT mt.step AS step FROM metrics mt WHERE mt.attempt_id = a.id
                        UNION ALL
                        SELECT c.step AS step FROM checkpoints c WHERE c.attempt_id = a.id
                   ) AS seen) AS last_step_seen,
                   (SELECT MAX(c.step) FROM checkpoints c
                     WHERE c.attempt_id = a.id AND c.committed_at IS NOT NULL)
                       AS last_committed_step
            FROM attempts a
            WHERE a.kind = 'train'
        ) AS t
    """,
    "run_restarts": """
        SELECT r.id AS run_id, r.name AS run, r.root AS root,
               COUNT(a.id) AS attempts,
               CASE WHEN COUNT(a.id) > 0 THEN COUNT(a.id) - 1 ELSE 0 END AS restarts,
               SUM(CASE WHEN a.end_state = 'crashed' THEN 1 ELSE 0 END) AS crashes
        FROM runs r LEFT JOIN attempts a ON a.run_id = r.id AND a.kind = 'train'
        GROUP BY r.id, r.name, r.root
    """,
}

revision: str = "0001"

down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("root", sa.Text(), nullable=False),
        sa.Column("save_dir", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("root", name=op.f("uq_runs_root")),
    )
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("resumed_from_id", sa.Integer(), nullable=True),
        sa.Column("end_state", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
    )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempts_run_id"), ["run_id"], unique=False)

    op.create_table(
        "streams",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("keep_last", sa.Integer(), nullable=True),
        sa.Column("keep_every", sa.Integer(), nullable=True),
        sa.Column("k", sa.Integer(), nullable=True),
        sa.Column("metric", sa.String(length=255), nullable=True),
        sa.Column("mode", sa.String(length=8), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_streams_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_streams")),
        sa.UniqueConstraint("run_id", "name", name=op.f("uq_streams_run_id")),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("stream", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("tmp_path", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        # BIGINT on PostgreSQL (a checkpoint passes 2 GiB); INTEGER, already 64-bit, on SQLite
        sa.Column("size", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.Column("hash", sa.String(length=64), nullable=True),
        sa.Column("metric", sa.Float(), nullable=True),
        sa.Column("metrics", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("committed_at", sa.DateTime(), nullable=True),
        sa.Column("deleted_at", sa.DateTime(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_checkpoints_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(
            ["run_id", "stream"],
            ["streams.run_id", "streams.name"],
            name=op.f("fk_checkpoints_run_id_streams"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_checkpoints_attempt_id"), ["attempt_id"], unique=False)
        batch_op.create_index("ix_checkpoints_run_state", ["run_id", "state"], unique=False)
        batch_op.create_index(
            "ix_checkpoints_run_stream_state_step",
            ["run_id", "stream", "state", "step"],
            unique=False,
        )

    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("wall_time", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_metrics_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_metrics_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metrics")),
    )
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.create_index("ix_metrics_run_name_step", ["run_id", "name", "step"], unique=False)
        batch_op.create_index(
            "ix_metrics_run_name_value", ["run_id", "name", "value"], unique=False
        )

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("time", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_events_attempt_id_attempts")
        ),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_events_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_run_kind", ["run_id", "kind"], unique=False)

    op.create_table(
        "pointers",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_pointers_checkpoint_id_checkpoints"),
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_pointers_run_id_runs")),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_pointers")),
    )

    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql}")


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("pointers")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_kind")

    op.drop_table("events")
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index("ix_metrics_run_name_value")
        batch_op.drop_index("ix_metrics_run_name_step")

    op.drop_table("metrics")
    with op.batch_alter_table("checkpoints", schema=None) as batch_op:
        batch_op.drop_index("ix_checkpoints_run_stream_state_step")
        batch_op.drop_index("ix_checkpoints_run_state")
        batch_op.drop_index(batch_op.f("ix_checkpoints_attempt_id"))

    op.drop_table("checkpoints")
    op.drop_table("streams")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempts_run_id"))

    op.drop_table("attempts")
    op.drop_table("runs")
