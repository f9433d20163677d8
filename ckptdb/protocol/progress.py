"""This attempt's progress: the steps it reports and the time its loop is blocked in saves.

Goodput (docs/goodput.md) needs, per attempt, when the first step ran, how far
training got before a crash, and how long the loop waited in saves. The
training loop reports each step (``mgr.due(step)``, or ``mgr.heartbeat(step)``
where the interval is chosen elsewhere): two assignments, and, at most every
``every`` seconds, one small UPDATE of the attempt's row. A SIGKILL leaves the
last one written, so a crash's time of death is known within ``every``
seconds plus one step. That write is not durable (no fsync): losing it to a
power cut costs precision, never a checkpoint. It runs on the training
thread, so it never races the manager's own transactions, and it never raises
into training: a ledger that cannot be written is said in the log, and the
next boundary reports it as an error anyway.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator

from ..errors import WriterLockLostError
from ..ledger.progress import Heartbeat

log = logging.getLogger(__name__)

#: Seconds between two heartbeats of a step-reporting attempt (a crash's end is
#: known within this much; one UPDATE without fsync each time).
HEARTBEAT_S = 10.0


class Progress:
    """One attempt's reported steps and blocked time (every rank keeps its own; the
    chief's is written)."""

    def __init__(self, every: float = HEARTBEAT_S) -> None:
        self.every = every
        self.first_step_at: float | None = None  # time.time() of the first report
        self.last_step: int | None = None
        self.saving_s = 0.0  # seconds blocked in finished saves
        self.saves = 0
        #: time.monotonic() when the newest save returned (None: none yet).
        self.last_save_end: float | None = None
        self._since: float | None = None  # time.monotonic() of the save in progress
        self._depth = 0
        self._written = -float("inf")
        self._writer: Callable[[Heartbeat], None] | None = None
        self._failing = False

    def write_with(self, writer: Callable[[Heartbeat], None]) -> None:
        """Heartbeats go to ``writer`` from now on (the chief's ledger)."""
        self._writer = writer

    def step(self, step: int) -> None:
        """``step`` is done; the heartbeat is written if ``every`` seconds passed."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.last_step = step
        now = time.monotonic()
        if self._writer is not None and now - self._written >= self.every:
            self._written = now
            self._write(self._writer)

    @contextlib.contextmanager
    def saving(self, *, counts: bool = True) -> Iterator[None]:
        """The loop is blocked in a save meanwhile; nested scopes (an integration's
        framework save around ``mgr.save``) count once. ``counts=False``: blocked time
        that is no save of its own (a close waiting for the save in flight)."""
        self._depth += 1
        if self._depth == 1:
            self._since = time.monotonic()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._since is not None:
                end = time.monotonic()
                self.saving_s += end - self._since
                self.saves += 1 if counts else 0
                self.last_save_end = end
                self._since = None

    def blocked(self) -> float:
        """Seconds blocked in saves so far, the save in progress included."""
        since = self._since
        return self.saving_s + (time.monotonic() - since if since is not None else 0.0)

    def beat(self) -> Heartbeat:
        """The heartbeat as of now."""
        first = self.first_step_at
        return Heartbeat(
            first_step_at=(
                dt.datetime.fromtimestamp(first, dt.timezone.utc) if first is not None else None
            ),
            last_step=self.last_step,
            seen_at=dt.datetime.now(dt.timezone.utc),
            saving_s=self.blocked(),
            saves=self.saves,
        )

    def _write(self, writer: Callable[[Heartbeat], None]) -> None:
        try:
            writer(self.beat())
        except WriterLockLostError as exc:  # another writer has the run: this attempt is over
            self._writer = None
            log.warning("ckptdb: heartbeats stop: %s", exc)
        except Exception as exc:
            if not self._failing:
                log.warning(
                    "ckptdb: the heartbeat was not written (goodput loses precision, "
                    "training goes on): %r",
                    exc,
                    exc_info=True,
                )
            self._failing = True
        else:
            if self._failing:
                log.info("ckptdb: heartbeats are written again")
            self._failing = False
