"""A reader's pin on a checkpoint: a lease, renewed while held.

``with reader.pin(checkpoint, ttl=600) as pin:`` keeps the checkpoint's file on
disk while the block runs, even if the trainer's retention evicts it
meanwhile (see :mod:`ckptdb.ledger.pins`). A thread renews the lease every
third of ``ttl``; if renewing fails (the ledger is unreachable, or the lease
already expired and the writer cleared it), the pin says so in ``lost`` and a
warning is logged: the file may then go at the writer's next commit.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from types import TracebackType

from .record import Checkpoint

__all__ = ["Pin"]

log = logging.getLogger("ckptdb.pins")

#: Renew a lease when a third of it has passed.
RENEW_FRACTION = 1 / 3


class Pin:
    """A lease on one checkpoint; release it (or leave the ``with`` block) when done.

    Made by :meth:`ckptdb.RunReader.pin`, not directly. While it is live,
    retention may evict the checkpoint but its file stays; a background thread
    renews the lease well before it expires. ``lost`` turns True if the lease
    ran out anyway (the ledger was unreachable for longer than ``ttl``): the
    file may then be gone.

    Args:
        checkpoint: The pinned checkpoint (also ``pin.checkpoint``; pass the pin
            to ``reader.load`` to load it).
        pin_id: The lease's row in the ledger's ``pins`` table (``pin.id``).
        expires_at: When the lease runs out unless renewed.
        ttl: The lease's length in seconds, renewed by that much each time.
        renew: Extends the lease in the ledger (the reader's).
        release: Ends the lease in the ledger (the reader's).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        pin_id: int,
        expires_at: dt.datetime,
        ttl: float,
        renew: Callable[[int, float], dt.datetime | None],
        release: Callable[[int], None],
    ) -> None:
        self.checkpoint = checkpoint
        self.id = pin_id
        self.expires_at = expires_at
        self.ttl = ttl
        self.lost = False
        self._renew, self._release = renew, release
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"ckptdb-pin-{pin_id}", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> Pin:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._stop.is_set()

    def release(self) -> None:
        """End the lease now (idempotent): the writer may remove the file if it was evicted."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._release(self.id)

    def _keep_alive(self) -> None:
        interval = max(self.ttl * RENEW_FRACTION, 0.05)
        while not self._stop.wait(interval):
            try:
                renewed = self._renew(self.id, self.ttl)
            except Exception as exc:  # the ledger is unreachable: try again next time
                log.warning("ckptdb: could not renew the pin on %s: %s", self.checkpoint.path, exc)
                if dt.datetime.now(dt.timezone.utc) >= self.expires_at:
                    self.lost = True  # the lease ran out meanwhile: the file may go
                continue
            if renewed is None:
                self.lost = True
                log.warning(
                    "ckptdb: the pin on %s was lost (its lease expired and was cleared); "
                    "the file may be removed",
                    self.checkpoint.path,
                )
                return
            self.expires_at = renewed

    def __repr__(self) -> str:
        state = "released" if self.released else "lost" if self.lost else "held"
        return f"Pin({self.checkpoint.path}, {state}, expires {self.expires_at:%H:%M:%S})"
