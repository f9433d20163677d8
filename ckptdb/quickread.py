"""``ckptdb latest ROOT`` and ``ckptdb best ROOT`` answered from the standard library.

"What is my latest (or best) checkpoint" is the question scripts ask most
(``--resume "$(ckptdb latest runs/exp1)"``), and on the default SQLite ledger
its answer is a couple of indexed reads of one file. The full command imports
click, SQLAlchemy and the ledger's models first, which costs a cold process
most of half a second; ``sqlite3`` answers in milliseconds.

So the command's entry point (:mod:`ckptdb.__main__`) asks :func:`answer`
first. It answers only the plain forms (``latest ROOT [--stream S]``,
``best ROOT [--stream S]``), and only where the full command would print the
same lines: a run's own SQLite ledger at this ckptdb's schema, a stream the run
has, a local save directory and at least one committed checkpoint to name.
Anything else (another ledger URL, an older schema, an unknown or ambiguous
stream, no checkpoint yet, a locked or unreadable file, any other option)
returns None, and the full command answers, with its errors. The statements
mirror :func:`ckptdb.ledger.rows.find_run`,
:func:`ckptdb.ledger.lookup.latest` and ``RunQueries.best``, and share with the
ledger and the full command what is not SQL (:func:`ckptdb.location.rebased`, the
default stream of ``best``); ``best`` ranks with the stream's own policy object
(:mod:`ckptdb.policies`, pure Python), so ties and ``TopK(last=...)`` rank as
they do everywhere else. tests/test_quickread.py compares the two answers.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

from .location import is_object_url, rebased
from .policies import Entry, Policy, PolicyRecord, default_ranked_stream, policy_from_record
from .record import COMMITTED, LEDGER_FILE, LEDGER_REVISION

#: The environment variable the command reads a ledger URL from (``--db-url``).
DB_URL_VARIABLE = "CKPTDB_DB_URL"
#: The commands answered here, and the stream each reads when none is given
#: (None: ``best``'s rule, the stream named ``best`` or the run's only top-K one).
COMMANDS: dict[str, str | None] = {"latest": "model", "best": None}


def answer(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """What ``ckptdb latest`` or ``ckptdb best`` would print for ``argv``, or None.

    Args:
        argv: The command's arguments (``sys.argv[1:]``).
        environ: The process environment (a ledger URL there is not ours to read).

    Returns:
        The output's lines (without the final newline): the latest committed
        checkpoint's absolute path, or the top-K's paths best first; None
        whenever the full command must answer (see the module docstring).
    """
    asked = _parse(argv)
    if asked is None or environ.get(DB_URL_VARIABLE):
        return None
    command, root_arg, stream = asked
    root = Path(root_arg).resolve()
    ledger = root / LEDGER_FILE
    if not ledger.is_file():
        return None
    try:
        uri = f"file:{quote(str(ledger))}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=1.0)) as db:
            paths = _answer(db, command, root, stream)
    except (sqlite3.Error, OSError, ValueError):
        # declined, not hidden: the full command meets the same file and reports it
        return None
    return "\n".join(str(path) for path in paths) if paths else None


def _parse(argv: Sequence[str]) -> tuple[str, str, str | None] | None:
    """(command, root, stream) of ``latest|best ROOT [--stream S]``; None otherwise."""
    if not argv or argv[0] not in COMMANDS:
        return None
    root: str | None = None
    stream = COMMANDS[argv[0]]
    rest = list(argv[1:])
    while rest:
        word = rest.pop(0)
        if word == "--stream" and rest:
            stream = rest.pop(0)
        elif word.startswith("--stream="):
            stream = word.partition("=")[2]
        elif word.startswith("-") or root is not None:
            return None  # an option of the full command, or a second argument
        else:
            root = word
    return None if root is None or stream == "" else (argv[0], root, stream)


def _answer(db: sqlite3.Connection, command: str, root: Path, stream: str | None) -> list[Path]:
    """The paths the command prints; empty where the full command must answer."""
    if db.execute("SELECT version_num FROM alembic_version").fetchall() != [(LEDGER_REVISION,)]:
        return []
    run = _run(db, root)
    if run is None or is_object_url(run[2]):
        return []
    run_id, stored_root, stored_save_dir = run
    policies = _policies(db, run_id)
    stream = default_ranked_stream(policies) if stream is None else stream
    if stream is None or stream not in policies:
        return []
    if command == "latest":
        found = db.execute(
            "SELECT c.path FROM checkpoints c JOIN pointers p ON p.checkpoint_id = c.id"
            " WHERE p.run_id = ? AND p.name = ? AND c.state = ?",
            (run_id, f"latest:{stream}", COMMITTED),
        ).fetchall()
        names = [str(row[0]) for row in found]
    else:
        names = _best(db, run_id, stream, policies[stream])
    save_dir = rebased(stored_save_dir, stored_root, root)
    return [save_dir / name for name in names]


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


def _run(db: sqlite3.Connection, root: Path) -> tuple[int, str, str] | None:
    """The run rooted at ``root``, else the ledger's only run (a moved run's own file)."""
    rows = db.execute("SELECT id, root, save_dir FROM runs WHERE root = ?", (str(root),)).fetchall()
    if not rows:
        rows = db.execute("SELECT id, root, save_dir FROM runs LIMIT 2").fetchall()
    return (int(rows[0][0]), str(rows[0][1]), str(rows[0][2])) if len(rows) == 1 else None
