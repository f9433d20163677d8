"""The ledger: every SQL statement and every SQLAlchemy import of ckptdb lives here.

- :mod:`~ckptdb.ledger.engine`: engines, :class:`Ledger` transactions (the one
  place that turns driver errors into :class:`~ckptdb.errors.DatabaseError`,
  and runs work queued with :func:`after_commit` once COMMIT returned),
  migrate-on-open;
- :mod:`~ckptdb.ledger.models`: the tables (the public SQL contract);
- :mod:`~ckptdb.ledger.rows`: row and pointer operations inside a transaction;
- :mod:`~ckptdb.ledger.queries`: latest, best, committed, history;
- :mod:`~ckptdb.ledger.runs`: opening a run as its writer or read-only;
- :mod:`~ckptdb.ledger.lock`: one writer per run (file or advisory lock);
- :mod:`~ckptdb.ledger.netfs`: refusing SQLite on a network filesystem.

Code outside this package holds sessions and rows only as opaque values it
passes back to these functions.
"""

from .engine import Ledger, after_commit, open_ledger
from .queries import RunQueries
from .runs import OpenedRun

__all__ = ["Ledger", "OpenedRun", "RunQueries", "after_commit", "open_ledger"]
