"""Read-side questions about a run, shared by the writer and read-only readers.

Both :class:`~ckptdb.manager.CheckpointManager` and
:class:`~ckptdb.reader.RunReader` answer "what is latest / best / committed"
the same way, from the ledger only: never from file names or mtimes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import ledger
from . import models as m
from .db import Ledger
from .errors import InvalidArgumentError, UnknownStreamError
from .policies import Policy, TopK
from .record import Checkpoint


class RunQueries:
    """Mixin: needs ``_db``, ``run_id``, ``save_dir``, ``policies`` and ``_check_open``."""

    _db: Ledger
    run_id: int
    save_dir: Path
    policies: dict[str, Policy]

    def _check_open(self) -> None:
        raise NotImplementedError

    def latest(self, stream: str = "model") -> Checkpoint | None:
        """The newest committed checkpoint of ``stream`` (by publication, not by mtime)."""
        self._check_stream(stream)
        with self._db.transaction(read=True) as session:
            row = ledger.latest_row(session, self.run_id, stream)
            return Checkpoint.from_row(row, self.save_dir) if row is not None else None

    def best(self, stream: str = "best") -> list[Checkpoint]:
        """The members of a top-K stream, best first."""
        policy = self._check_stream(stream)
        if not isinstance(policy, TopK):
            raise InvalidArgumentError(f"stream {stream!r} is not a TopK stream")
        with self._db.transaction(read=True) as session:
            rows = ledger.rows_in_state(session, self.run_id, [m.COMMITTED], stream)
        by_id = {r.id: r for r in rows}
        return [
            Checkpoint.from_row(by_id[e.id], self.save_dir)
            for e in policy.ranked(ledger.entries(rows))
        ]

    def checkpoints(
        self, stream: str | None = None, *, states: Iterable[str] = (m.COMMITTED,)
    ) -> list[Checkpoint]:
        """Checkpoints (committed ones unless ``states`` says otherwise), by stream then step."""
        if stream is not None:
            self._check_stream(stream)
        else:
            self._check_open()
        with self._db.transaction(read=True) as session:
            rows = ledger.rows_in_state(session, self.run_id, tuple(states), stream)
        return [Checkpoint.from_row(r, self.save_dir) for r in rows]

    def _check_stream(self, stream: str) -> Policy:
        self._check_open()
        policy = self.policies.get(stream)
        if policy is None:
            raise UnknownStreamError(
                f"no stream {stream!r} is configured (streams: {', '.join(self.policies)})"
            )
        return policy
