"""The ledger's tables, as SQLAlchemy 2.x typed models.

The schema is the public SQL contract of ckptdb (users query it with any SQL
client), so columns are plain and named for people: ``checkpoints.stream`` is
the stream's name, states and event kinds are lower-case words, and paths are
stored relative to the run's save directory. Alembic revisions under
``migrations/versions`` create exactly these tables; a test compares them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from ..policies import INT64_MAX
from ..record import ABORTED as ABORTED
from ..record import COMMITTED as COMMITTED
from ..record import CORRUPT as CORRUPT
from ..record import DELETED as DELETED
from ..record import DELETING as DELETING
from ..record import LOST as LOST
from ..record import PENDING as PENDING
from ..record import STATES as STATES
from ..record import utcnow as utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# The publication states of a checkpoint row (PENDING ... CORRUPT, STATES) and
# utcnow are defined in ckptdb.record (the public vocabulary) and re-exported here.

#: The longest metric name ``metrics.name`` (VARCHAR(255)) holds; PostgreSQL enforces it.
MAX_METRIC_NAME = 255

#: The largest step a ledger holds: the step columns are 64-bit on every backend
#: (SQLite's INTEGER; BIGINT on PostgreSQL since revision 0003), less one, so that
#: ``attempt_summary``'s steps lost (the last step seen + 1 when nothing committed)
#: still fits in 64 bits (PostgreSQL raised ``bigint out of range`` for every run).
MAX_STEP = INT64_MAX - 1

#: A 64-bit integer column: BIGINT, except on SQLite, whose INTEGER already is 64-bit
#: (and where BIGINT would only be a spelling).
INT64 = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timestamp stored as naive UTC (readable in SQLite) and read back aware."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("ckptdb stores only timezone-aware timestamps")
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        assert isinstance(value, dt.datetime)
        return value.replace(tzinfo=dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    root: Mapped[str] = mapped_column(Text, unique=True)
    save_dir: Mapped[str] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Attempt(Base):
    """One process's life on a run: a row of ``attempts`` (columns and end states in
    docs/ledger.md). ``RunReader.attempts()`` returns them, oldest first."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    # The checkpoint this attempt first loaded. A plain id, not a foreign key:
    # attempts and checkpoints would otherwise reference each other.
    resumed_from_id: Mapped[int | None] = mapped_column(Integer)
    # running | closed | failed | crashed
    end_state: Mapped[str] = mapped_column(String(16), default="running")
    # train (a training process) | maintenance (the ckptdb command: gc, reconcile)
    kind: Mapped[str] = mapped_column(String(16), default="train")
    # The number of ranks the attempt ran on (NULL: opened before revision 0005).
    world_size: Mapped[int | None] = mapped_column(Integer)
    # Goodput (revision 0009; NULL: not measured). When the process started (its
    # restart includes its imports), when it reported its first step, the newest step
    # it reported, when it was last seen alive (its heartbeat; a crash's ended_at is
    # the next open's time), and how long and how often its loop was blocked in saves.
    launched_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    first_step_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    last_step: Mapped[int | None] = mapped_column(INT64)
    seen_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    saving_s: Mapped[float | None] = mapped_column(Float)
    saves: Mapped[int | None] = mapped_column(Integer)


class Stream(Base):
    __tablename__ = "streams"
    __table_args__ = (UniqueConstraint("run_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    name: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # keep | topk
    keep_last: Mapped[int | None] = mapped_column(INT64)
    keep_every: Mapped[int | None] = mapped_column(INT64)  # a number of steps
    k: Mapped[int | None] = mapped_column(INT64)
    metric: Mapped[str | None] = mapped_column(String(255))
    mode: Mapped[str | None] = mapped_column(String(8))  # min | max


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "stream"], ["streams.run_id", "streams.name"]),
        Index("ix_checkpoints_run_stream_state_step", "run_id", "stream", "state", "step"),
        Index("ix_checkpoints_run_state", "run_id", "state"),
        Index("ix_checkpoints_run_stream_id", "run_id", "stream", "id"),  # followers
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    stream: Mapped[str] = mapped_column(String(64))
    step: Mapped[int] = mapped_column(INT64)  # steps counted in samples pass 2**31
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"), index=True)
    path: Mapped[str] = mapped_column(Text)
    tmp_path: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    size: Mapped[int | None] = mapped_column(INT64)  # checkpoints pass 2 GiB
    hash: Mapped[str | None] = mapped_column(String(64))
    metric: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[str | None] = mapped_column(Text)  # JSON object of the boundary's metrics
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    committed_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    deleted_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)
    # The number of ranks that saved it (NULL: unknown, a row before revision 0005 or an
    # adopted file); for a sharded payload ``topology`` is JSON: the device meshes of its
    # DTensors, as the chief saw them (see docs/distributed.md).
    world_size: Mapped[int | None] = mapped_column(Integer)
    topology: Mapped[str | None] = mapped_column(Text)
    # The seconds its attempt's loop had been blocked in saves when this boundary began
    # (goodput: the saving that follows a resume point is not work redone).
    saving_before_s: Mapped[float | None] = mapped_column(Float)


class Pointer(Base):
    __tablename__ = "pointers"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_run_name_step", "run_id", "name", "step"),
        Index("ix_metrics_run_name_value", "run_id", "name", "value"),
    )

    id: Mapped[int] = mapped_column(INT64, primary_key=True)  # a row per point, all runs
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id"))
    step: Mapped[int] = mapped_column(INT64)  # steps counted in samples pass 2**31
    name: Mapped[str] = mapped_column(String(255))
    # NULL stands for NaN: SQLite cannot store NaN (a diverged loss is history too)
    value: Mapped[float | None] = mapped_column(Float)
    wall_time: Mapped[float] = mapped_column(Float)  # seconds since the epoch


class Event(Base):
    """Something that happened to a run: a row of ``events`` (``kind``, ``time``,
    ``step``, ``checkpoint_id``, ``detail`` as JSON; every kind is listed in
    docs/ledger.md). ``RunReader.events()`` returns the newest."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_kind", "run_id", "kind"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id"))
    time: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    step: Mapped[int | None] = mapped_column(INT64)
    detail: Mapped[str | None] = mapped_column(Text)  # JSON


class Pin(Base):
    """A reader's lease on a checkpoint: retention leaves its file on disk until the
    last pin is released or has expired (``expires_at``, renewed while held)."""

    __tablename__ = "pins"
    __table_args__ = (Index("ix_pins_run_checkpoint", "run_id", "checkpoint_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    holder: Mapped[str] = mapped_column(String(255))  # who: host, pid and a name
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    released_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class Evaluation(Base):
    """One value an evaluator computed for a checkpoint after it was published."""

    __tablename__ = "evaluations"
    __table_args__ = (
        Index("ix_evaluations_run_name_value", "run_id", "name", "value"),
        # one value per (checkpoint, evaluator, name): concurrent recorders cannot duplicate
        Index(
            "ux_evaluations_checkpoint_evaluator_name",
            "checkpoint_id",
            "evaluator",
            "name",
            unique=True,
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    evaluator: Mapped[str] = mapped_column(String(255))
    name: Mapped[str] = mapped_column(String(255))
    value: Mapped[float | None] = mapped_column(Float)  # NULL stands for NaN
    recorded_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Alias(Base):
    """A derived alias (DeePMD's ``model.ckpt.pt``, its ``checkpoint`` pointer file): a
    name other tools open, which reconcile re-points at the latest committed
    checkpoint of ``stream``. ckptdb never reads it to decide anything."""

    __tablename__ = "aliases"
    __table_args__ = (
        ForeignKeyConstraint(["run_id", "stream"], ["streams.run_id", "streams.name"]),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    path: Mapped[str] = mapped_column(Text, primary_key=True)  # relative to the run root
    stream: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))  # symlink | pointer | link


class Replica(Base):
    """One copy of a checkpoint on another tier (object storage): where it is and
    whether it is whole. ``replicated`` only once every object of the copy is
    complete and hashes to the checkpoint row's size and hash (see
    ckptdb.replication)."""

    __tablename__ = "replicas"
    __table_args__ = (
        Index("ix_replicas_run_tier_state", "run_id", "tier", "state"),
        Index("ix_replicas_checkpoint_id", "checkpoint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    tier: Mapped[str] = mapped_column(String(16))  # remote
    location: Mapped[str] = mapped_column(Text)  # the copy's URL: a prefix, one object per file
    state: Mapped[str] = mapped_column(
        String(16)
    )  # uploading | replicated | failed | deleting | deleted
    size: Mapped[int | None] = mapped_column(INT64)
    hash: Mapped[str | None] = mapped_column(String(64))
    manifest: Mapped[str | None] = mapped_column(Text)  # JSON: [[name, size, hash], ...]
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)
    # a failed copy's prefix, last swept for objects that landed after it failed
    swept_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime())


class Tier(Base):
    """A second tier a replicator registered for a run: where its copies go, which
    streams it copies (``streams``, JSON; NULL: every stream) and how long each
    stream's copies are kept there (``policies``, JSON: stream -> policy record; a
    stream not named keeps every copy). While it exists, local retention keeps an
    evicted checkpoint of a copied stream until its copy is whole (see
    ckptdb.ledger.tiers)."""

    __tablename__ = "tiers"
    __table_args__ = (Index("ux_tiers_run_tier", "run_id", "tier", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    tier: Mapped[str] = mapped_column(String(16))  # remote
    location: Mapped[str] = mapped_column(Text)  # the URL the copies go under
    streams: Mapped[str | None] = mapped_column(Text)
    policies: Mapped[str | None] = mapped_column(Text)
    registered_at: Mapped[dt.datetime] = mapped_column(UTCDateTime())


class Export(Base):
    """A derivative of a checkpoint written outside the run (``ckptdb export``): a
    directory in another format (``safetensors``), recorded once it is complete.
    ``path`` is absolute (it is not under the save directory); ``manifest`` is JSON,
    ``[[name, size, hash], ...]`` of its files, which ``ckptdb check`` verifies."""

    __tablename__ = "exports"
    __table_args__ = (Index("ix_exports_run_checkpoint", "run_id", "checkpoint_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    format: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(INT64)
    hash: Mapped[str] = mapped_column(String(64))
    manifest: Mapped[str] = mapped_column(Text)
    tensors: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Tracker(Base):
    """An experiment tracker a follower mirrors the run into (``ckptdb follow --to``):
    ``kind`` (``mlflow``, ``wandb``), ``target`` (where: a tracking URI and experiment,
    a W&B project), the tracker's own run id, the id of the last metric point
    mirrored, and ``mirrored`` (JSON): the checkpoints logged and the aliases set."""

    __tablename__ = "trackers"
    __table_args__ = (
        Index("ux_trackers_run_kind_target", "run_id", "kind", "target", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    kind: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(Text)
    external_id: Mapped[str | None] = mapped_column(String(255))
    metric_cursor: Mapped[int] = mapped_column(INT64)
    mirrored: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)


# Views created by the migrations (see migrations/versions): the latest
# checkpoint of every stream, the ranked members of every top-K stream,
# restarts per run, per training attempt how far it got and how many steps a
# crash lost (steps trained after its last committed checkpoint), and every
# checkpoint with the evaluations recorded for it.
VIEW_NAMES = (
    "latest_checkpoints",
    "best_checkpoints",
    "run_restarts",
    "attempt_summary",
    "checkpoint_evaluations",
)
