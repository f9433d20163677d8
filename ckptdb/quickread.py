"""The ckptdb command's read-only questions scripts ask most, answered from the standard library.

"What is my latest (or best) checkpoint" is the question scripts ask most
(``--resume "$(ckptdb latest runs/exp1)"``), followed by a query over the
ledger (``ckptdb sql``), a metric's curve (``ckptdb history``), the list of
checkpoints (``ckptdb list``) or the run's summary (``ckptdb status``). On the
default SQLite ledger each answer is a few indexed reads of one file. The full
command imports click, SQLAlchemy and the ledger's models first, which costs a
cold process most of half a second; ``sqlite3`` answers in milliseconds.

So the command's entry point (:mod:`ckptdb.__main__`) asks :func:`answer`
first. It answers only the plain forms (:data:`COMMANDS`: ``latest ROOT
[--stream S]``, ``best ROOT [--stream S]``, ``sql ROOT STATEMENT [--format
F]``, ``history ROOT --metric M [--json]``, ``list ROOT [--stream S] [--all]
[--json]``, ``status ROOT [--json]``), and only where the full command would print the same lines: a
run's own SQLite ledger at this ckptdb's schema, a stream the run has, a local
save directory, and something to print (a committed checkpoint, rows, points).
Anything else (another ledger URL, an older schema, an unknown or ambiguous
stream, no checkpoint yet, a statement that fails or returns no rows, an
unknown metric, a run with copies on a remote tier (or exports, for ``list``), a
locked or unreadable file, any other option) returns None, and the full command
answers, with its errors. The statements mirror
:func:`ckptdb.ledger.rows.find_run`, :func:`ckptdb.ledger.lookup.latest`,
``RunQueries.best``, ``RunQueries.metric_history``,
``RunQueries.checkpoints`` (with ``rows.to_record``) and the reader's counts,
attempts and events; what is not SQL is shared with the ledger and
the full command: :func:`ckptdb.location.rebased`, the default stream of
``best``, the policies (``best`` ranks with the stream's own policy object, so
ties and ``TopK(last=...)`` rank as they do everywhere else), the output's
format (:mod:`ckptdb.textout`) and the status's parts and text
(:mod:`ckptdb.statusout`). A statement of ``sql`` meets the restrictions
of the full command's reader: a read-only file, ``query_only``, no ``ATTACH``.
tests/test_quickread.py compares the two answers.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sqlite3
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from . import statusout, textout
from .location import is_object_url, rebased
from .policies import Entry, Policy, PolicyRecord, default_ranked_stream, policy_from_record
from .record import CHECKPOINT_FIELDS, COMMITTED, LEDGER_FILE, LEDGER_REVISION, STATES, Checkpoint
from .sqliteread import lock_read_only

#: The environment variable the command reads a ledger URL from (``--db-url``).
DB_URL_VARIABLE = "CKPTDB_DB_URL"


@dataclass(frozen=True)
class Form:
    """The plain form of one command: what the quick read parses, and nothing else.

    Attributes:
        arguments: How many positional arguments (the root first).
        options: The options that take a value (given twice: the last counts,
            as with click).
        choices: The values accepted, for an option limited to some.
        required: The options that must be given.
        flags: The options that take no value.
    """

    arguments: int
    options: tuple[str, ...] = ()
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


#: The commands answered here, in their plain forms.
COMMANDS: dict[str, Form] = {
    "latest": Form(1, ("--stream",)),
    "best": Form(1, ("--stream",)),
    "sql": Form(2, ("--format",), {"--format": ("table", "csv", "json")}),
    "history": Form(1, ("--metric",), required=("--metric",), flags=("--json",)),
    "list": Form(1, ("--stream",), flags=("--all", "--json")),
    "status": Form(1, flags=("--json",)),
}


@dataclass(frozen=True)
class Question:
    """A command line in its plain form.

    Attributes:
        command: The command's name, a key of :data:`COMMANDS`.
        arguments: Its positional arguments, the root first.
        options: The options given, with their values.
        flags: The flags given.
    """

    command: str
    arguments: tuple[str, ...]
    options: Mapping[str, str]
    flags: frozenset[str]


@dataclass(frozen=True)
class _Run:
    id: int
    root: str
    save_dir: str


def answer(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """What the full command would print for ``argv``, or None where it must answer.

    Args:
        argv: The command's arguments (``sys.argv[1:]``).
        environ: The process environment (a ledger URL there is not ours to read).

    Returns:
        The output's lines (without the final newline); None whenever the full
        command must answer (see the module docstring).
    """
    question = parse(argv)
    if question is None or environ.get(DB_URL_VARIABLE):
        return None
    root = Path(question.arguments[0]).resolve()
    ledger = root / LEDGER_FILE
    if not ledger.is_file():
        return None
    try:
        uri = f"file:{quote(str(ledger))}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=1.0)) as db:
            lock_read_only(db)
            return _answer(db, question, root)
    except (sqlite3.Error, OSError, ValueError):
        # declined, not hidden: the full command meets the same file and reports it
        return None


def parse(argv: Sequence[str]) -> Question | None:
    """The plain form of a command of :data:`COMMANDS` in ``argv``.

    Args:
        argv: The command's arguments (``sys.argv[1:]``).

    Returns:
        The question; None for anything else: another command or option, an
        empty value or one outside its choices, a required option missing, too
        few or too many arguments.
    """
    if not argv or argv[0] not in COMMANDS:
        return None
    form = COMMANDS[argv[0]]
    arguments: list[str] = []
    options: dict[str, str] = {}
    flags: set[str] = set()
    rest = list(argv[1:])
    while rest:
        word = rest.pop(0)
        name, equals, value = word.partition("=")
        if word in form.flags:
            flags.add(word)
        elif name in form.options and (equals or rest):
            options[name] = value if equals else rest.pop(0)
        elif word.startswith("-"):
            return None  # an option of the full command only, or one without its value
        else:
            arguments.append(word)
    plain = (
        len(arguments) == form.arguments
        and all(name in options for name in form.required)
        and all(value != "" for value in options.values())
        and all(options.get(name, allowed[0]) in allowed for name, allowed in form.choices.items())
    )
    return Question(argv[0], tuple(arguments), options, frozenset(flags)) if plain else None


def _answer(db: sqlite3.Connection, question: Question, root: Path) -> str | None:
    """The command's output; None where the full command must answer."""
    if db.execute("SELECT version_num FROM alembic_version").fetchall() != [(LEDGER_REVISION,)]:
        return None
    run = _run(db, root)
    if run is None:
        return None
    return _ANSWERS[question.command](db, question, run, root)


def _checkpoint_paths(
    db: sqlite3.Connection, question: Question, run: _Run, root: Path
) -> str | None:
    """``latest`` and ``best``: the paths they print, one per line."""
    if is_object_url(run.save_dir):
        return None
    policies = _policies(db, run.id)
    given = question.options.get("--stream")
    if question.command == "latest":
        stream: str | None = given or "model"
    else:
        stream = given or default_ranked_stream(policies)
    if stream is None or stream not in policies:
        return None
    if question.command == "latest":
        found = db.execute(
            "SELECT c.path FROM checkpoints c JOIN pointers p ON p.checkpoint_id = c.id"
            " WHERE p.run_id = ? AND p.name = ? AND c.state = ?",
            (run.id, f"latest:{stream}", COMMITTED),
        ).fetchall()
        names = [str(row[0]) for row in found]
    else:
        names = _best(db, run.id, stream, policies[stream])
    save_dir = rebased(run.save_dir, run.root, root)
    return "\n".join(str(save_dir / name) for name in names) or None


def _sql(db: sqlite3.Connection, question: Question, run: _Run, root: Path) -> str | None:
    """``sql``: the rows of one query, formatted as the full command formats them.

    A PRAGMA is left to the full command: its answer depends on the
    connection's own settings (``busy_timeout``, ``foreign_keys``), which differ.
    """
    statement = question.arguments[1]
    if statement.lstrip().lower().startswith("pragma"):
        return None
    cursor = db.execute(statement)
    if cursor.description is None:
        return None  # not a query: the full command says so
    headers = [str(column[0]) for column in cursor.description]
    rows = [tuple(row) for row in cursor.fetchall()]
    fmt = question.options.get("--format", "table")
    if fmt == "json":
        return textout.to_json([dict(zip(headers, row, strict=True)) for row in rows])
    if fmt == "csv":
        return textout.to_csv(headers, rows)
    return textout.table(headers, rows)


def _history(db: sqlite3.Connection, question: Question, run: _Run, root: Path) -> str | None:
    """``history``: one metric's points by step then attempt (``RunQueries.metric_history``)."""
    metric = question.options["--metric"]
    found = db.execute(
        "SELECT step, value, attempt_id FROM metrics WHERE run_id = ? AND name = ?"
        " ORDER BY step, attempt_id, id",
        (run.id, metric),
    ).fetchall()
    if not found:
        return None  # an unknown metric: the full command names the known ones
    points = [(s, math.nan if v is None else v, a) for s, v, a in found]
    if "--json" in question.flags:
        return textout.to_json([{"step": s, "value": v, "attempt": a} for s, v, a in points])
    return textout.table(["step", metric, "attempt"], points)


def _list(db: sqlite3.Connection, question: Question, run: _Run, root: Path) -> str | None:
    """``list``: the run's checkpoints by stream then step (``RunQueries.checkpoints``).

    A run with copies on a remote tier or exports is left to the full command,
    which adds a column for each.
    """
    stream = question.options.get("--stream")
    if is_object_url(run.save_dir) or (stream is not None and stream not in _policies(db, run.id)):
        return None
    if _has_rows(db, run.id, "replicas", "exports"):
        return None
    states = STATES if "--all" in question.flags else (COMMITTED,)
    save_dir = rebased(run.save_dir, run.root, root)
    found = _checkpoints(db, run.id, states, stream, save_dir)
    if "--json" in question.flags:
        listed = [{**textout.checkpoint_dict(c), "remote": None, "exports": []} for c in found]
        return textout.to_json(listed)
    rows = [textout.checkpoint_row(c) for c in found]
    return textout.table(list(textout.CHECKPOINT_COLUMNS), rows)


def _checkpoints(
    db: sqlite3.Connection, run_id: int, states: Sequence[str], stream: str | None, save_dir: Path
) -> list[Checkpoint]:
    """The run's checkpoints in ``states`` (of ``stream`` only if given), by stream then step
    (``rows.rows_in_state``)."""
    query = (
        f"SELECT {', '.join(CHECKPOINT_FIELDS)} FROM checkpoints WHERE run_id = ?"
        f" AND state IN ({', '.join('?' * len(states))})"
    )
    parameters: list[object] = [run_id, *states]
    if stream is not None:
        query, parameters = query + " AND stream = ?", [*parameters, stream]
    rows = db.execute(query + " ORDER BY stream, step, id", parameters)
    return [_checkpoint(row, save_dir) for row in rows]


def _checkpoint(row: Sequence[Any], save_dir: Path) -> Checkpoint:
    """A checkpoint row as the ledger's ``to_record`` reads it: the path under the save
    directory, the naive UTC timestamp made aware, the metrics' JSON parsed."""
    stream, step, path, size, hash_, metric, state, committed, id_, attempt, metrics, ranks = row
    return Checkpoint(
        stream,
        step,
        save_dir / path,
        size,
        hash_,
        metric,
        state,
        None if committed is None else _utc(committed),
        id_,
        attempt,
        json.loads(metrics) if metrics else {},
        ranks,
    )


def _utc(stored: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stored).replace(tzinfo=dt.timezone.utc)


def _status(db: sqlite3.Connection, question: Question, run: _Run, root: Path) -> str | None:
    """``status``: the data ``ckptdb status --json`` gathers, printed by :mod:`ckptdb.statusout`.

    A run with a registered tier or copies on one is left to the full command:
    its lines there read the replicator's own state file and the copies.
    """
    if is_object_url(run.save_dir) or _has_rows(db, run.id, "tiers", "replicas"):
        return None
    save_dir = rebased(run.save_dir, run.root, root)
    data = {
        "run": db.execute("SELECT name FROM runs WHERE id = ?", (run.id,)).fetchone()[0],
        "root": str(root),
        **_streams(db, run.id, save_dir),
        "states": _counts(db, "state", run.id),
        "attempts": [
            {
                "id": ident,
                "started_at": textout.jsonable(_utc(started)),
                "end_state": end_state,
                "kind": kind,
                "host": host,
                "pid": pid,
            }
            for ident, started, end_state, kind, host, pid in db.execute(
                "SELECT id, started_at, end_state, kind, host, pid FROM attempts"
                " WHERE run_id = ? ORDER BY id",
                (run.id,),
            )
        ],
        "preemptions": statusout.preemption_summary(
            _events(db, run.id, statusout.PREEMPTION_EVENTS)
        ),
        "interval": statusout.interval_now(_newest(_events(db, run.id, ("interval",)))),
        "tiers": [],
        "replicas": {},
        "events": [
            {"time": textout.cell(e.time), "kind": e.kind, "step": e.step, "detail": e.detail}
            for e in _events(db, run.id, None, newest=8)
        ],
    }
    if "--json" in question.flags:
        return textout.to_json(data)
    return statusout.render(data, bold=_bold if sys.stdout.isatty() else str)


def _streams(db: sqlite3.Connection, run_id: int, save_dir: Path) -> dict[str, Any]:
    """Each stream's policy, latest and count, and each top-K stream's members, ranked."""
    streams, best = [], {}
    committed = _counts(db, "stream", run_id, COMMITTED)
    for name, policy in _policies(db, run_id).items():
        latest = db.execute(
            "SELECT c.step, c.path FROM checkpoints c JOIN pointers p ON p.checkpoint_id = c.id"
            " WHERE p.run_id = ? AND p.name = ? AND c.state = ?",
            (run_id, f"latest:{name}", COMMITTED),
        ).fetchone()
        streams.append(
            {
                "name": name,
                "policy": policy.describe(),
                "latest_step": latest[0] if latest else None,
                "latest_path": str(save_dir / latest[1]) if latest else None,
                "committed": committed.get(name, 0),
            }
        )
        if policy.ranking_metric is not None:
            members = _checkpoints(db, run_id, (COMMITTED,), name, save_dir)
            by_id = {c.id: c for c in members}
            ranked = policy.ranked([Entry(id=c.id, step=c.step, metric=c.metric) for c in members])
            best[name] = [textout.checkpoint_dict(by_id[e.id]) for e in ranked]
    return {"streams": streams, "best": best}


def _counts(
    db: sqlite3.Connection, column: str, run_id: int, state: str | None = None
) -> dict[str, int]:
    """Rows per value of ``column`` (``state`` or ``stream``), in ``state`` only if given."""
    where = "run_id = ?" + (" AND state = ?" if state is not None else "")
    parameters = (run_id, state) if state is not None else (run_id,)
    found = db.execute(
        f"SELECT {column}, count(*) FROM checkpoints WHERE {where} GROUP BY {column}", parameters
    )
    return {str(value): int(count) for value, count in found}


@dataclass(frozen=True)
class _Event:
    kind: str
    time: dt.datetime
    attempt_id: int | None
    step: int | None
    detail: str | None


def _events(
    db: sqlite3.Connection, run_id: int, kinds: Sequence[str] | None, newest: int | None = None
) -> list[_Event]:
    """The run's events of ``kinds`` (None: any), oldest first; only the ``newest`` if given."""
    where, parameters = "run_id = ?", list[object]([run_id])
    if kinds is not None:
        where += f" AND kind IN ({', '.join('?' * len(kinds))})"
        parameters += list(kinds)
    order = f"ORDER BY id DESC LIMIT {int(newest)}" if newest is not None else "ORDER BY id"
    found = db.execute(
        f"SELECT kind, time, attempt_id, step, detail FROM events WHERE {where} {order}", parameters
    ).fetchall()
    events = [_Event(kind, _utc(at), a, s, text) for kind, at, a, s, text in found]
    return events[::-1] if newest is not None else events


def _newest(events: list[_Event]) -> _Event | None:
    return events[-1] if events else None


def _has_rows(db: sqlite3.Connection, run_id: int, *tables: str) -> bool:
    return any(
        db.execute(f"SELECT 1 FROM {table} WHERE run_id = ? LIMIT 1", (run_id,)).fetchall()
        for table in tables
    )


def _bold(text: str) -> str:
    """``click.style(text, bold=True)``: what the full command prints on a terminal."""
    return f"\x1b[1m{text}\x1b[0m"


_ANSWERS: dict[str, Callable[[sqlite3.Connection, Question, _Run, Path], str | None]] = {
    "latest": _checkpoint_paths,
    "best": _checkpoint_paths,
    "sql": _sql,
    "history": _history,
    "list": _list,
    "status": _status,
}


def _best(db: sqlite3.Connection, run_id: int, stream: str, policy: Policy) -> list[str]:
    """The stream's committed checkpoints as its policy ranks them (``RunQueries.best``)."""
    if policy.ranking_metric is None:
        return []  # not a top-K stream: the full command says so
    found = db.execute(
        "SELECT id, step, metric, path FROM checkpoints"
        " WHERE run_id = ? AND state = ? AND stream = ? ORDER BY stream, step, id",
        (run_id, COMMITTED, stream),
    ).fetchall()
    paths = {int(row[0]): str(row[3]) for row in found}
    entries = [Entry(id=int(row[0]), step=int(row[1]), metric=row[2]) for row in found]
    return [paths[entry.id] for entry in policy.ranked(entries)]


def _policies(db: sqlite3.Connection, run_id: int) -> dict[str, Policy]:
    """The run's streams and their stored policies, in the ledger's order."""
    found = db.execute(
        "SELECT name, kind, keep_last, keep_every, k, metric, mode FROM streams WHERE run_id = ?",
        (run_id,),
    )
    return {str(row[0]): policy_from_record(PolicyRecord(*row[1:])) for row in found}


def _run(db: sqlite3.Connection, root: Path) -> _Run | None:
    """The run rooted at ``root``, else the ledger's only run (a moved run's own file)."""
    rows = db.execute("SELECT id, root, save_dir FROM runs WHERE root = ?", (str(root),)).fetchall()
    if not rows:
        rows = db.execute("SELECT id, root, save_dir FROM runs LIMIT 2").fetchall()
    return _Run(int(rows[0][0]), str(rows[0][1]), str(rows[0][2])) if len(rows) == 1 else None
