"""``ckptdb latest ROOT`` answered from the standard library alone.

"What is my latest checkpoint" is the question scripts ask most
(``--resume "$(ckptdb latest runs/exp1)"``), and on the default SQLite ledger
its answer is one indexed read of one file. The full command imports click,
SQLAlchemy and the ledger's models first, which costs a cold process most of
half a second; ``sqlite3`` answers in milliseconds.

So the command's entry point (:mod:`ckptdb.__main__`) asks :func:`latest_path`
first. It answers only the plain case, and only where the full command would
print the same line: a run's own SQLite ledger at this ckptdb's schema, a
stream the run has, a local save directory and a committed latest. Anything
else (another ledger URL, an older schema, an unknown stream, no checkpoint
yet, a locked or unreadable file, any other option) returns None, and the full
command answers, with its errors. The statements mirror
:func:`ckptdb.ledger.rows.find_run`, :func:`~ckptdb.ledger.rows.rebased_save_dir`
and :func:`ckptdb.ledger.lookup.latest`; tests/test_quickread.py compares the
two answers run by run.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

from .location import is_object_url
from .record import COMMITTED, LEDGER_REVISION

#: The ledger file of a run root (``ckptdb.ledger.engine.LEDGER_FILE``).
LEDGER_FILE = "ckptdb.sqlite"
#: The environment variable the command reads a ledger URL from (``--db-url``).
DB_URL_VARIABLE = "CKPTDB_DB_URL"


def latest_path(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The line ``ckptdb latest`` would print for ``argv``, or None to let it answer.

    Args:
        argv: The command's arguments (``sys.argv[1:]``).
        environ: The process environment (a ledger URL there is not ours to read).

    Returns:
        The absolute path of the stream's latest committed checkpoint, or None
        whenever the full command must answer (see the module docstring).
    """
    asked = _parse(argv)
    if asked is None or environ.get(DB_URL_VARIABLE):
        return None
    root, stream = Path(asked[0]).resolve(), asked[1]
    ledger = root / LEDGER_FILE
    if not ledger.is_file():
        return None
    try:
        uri = f"file:{quote(str(ledger))}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=1.0)) as db:
            return _latest(db, root, stream)
    except (sqlite3.Error, OSError, ValueError):
        return None


def _parse(argv: Sequence[str]) -> tuple[str, str] | None:
    """(root, stream) of ``latest ROOT [--stream S]``; None for any other form."""
    if not argv or argv[0] != "latest":
        return None
    root: str | None = None
    stream = "model"
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
    return None if root is None or not stream else (root, stream)


def _latest(db: sqlite3.Connection, root: Path, stream: str) -> str | None:
    if db.execute("SELECT version_num FROM alembic_version").fetchall() != [(LEDGER_REVISION,)]:
        return None
    run = _run(db, root)
    if run is None:
        return None
    run_id, stored_root, stored_save_dir = run
    known = db.execute(
        "SELECT 1 FROM streams WHERE run_id = ? AND name = ?", (run_id, stream)
    ).fetchone()
    if known is None or is_object_url(stored_save_dir):
        return None
    found = db.execute(
        "SELECT c.path FROM checkpoints c JOIN pointers p ON p.checkpoint_id = c.id"
        " WHERE p.run_id = ? AND p.name = ? AND c.state = ?",
        (run_id, f"latest:{stream}", COMMITTED),
    ).fetchone()
    if found is None:
        return None
    return str(_save_dir(Path(stored_save_dir), Path(stored_root), root) / found[0])


def _run(db: sqlite3.Connection, root: Path) -> tuple[int, str, str] | None:
    """The run rooted at ``root``, else the ledger's only run (a moved run's own file)."""
    found = db.execute("SELECT id, root, save_dir FROM runs WHERE root = ?", (str(root),))
    rows = found.fetchall()
    if not rows:
        rows = db.execute("SELECT id, root, save_dir FROM runs LIMIT 2").fetchall()
    return (int(rows[0][0]), str(rows[0][1]), str(rows[0][2])) if len(rows) == 1 else None


def _save_dir(stored: Path, old_root: Path, root: Path) -> Path:
    """The stored save directory, following the root when it was inside it."""
    if stored == old_root or old_root in stored.parents:
        return root / stored.relative_to(old_root)
    return stored
