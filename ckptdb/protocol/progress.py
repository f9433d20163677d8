"""This attempt's progress: the steps it reports and the time its loop is blocked in saves.

Goodput (docs/goodput.md) needs, per attempt, when the first step ran, how far
training got before a crash, and how long the loop waited in saves. The
training loop reports each step (``mgr.due(step)``, or ``mgr.heartbeat(step)``
where the interval is chosen elsewhere): two assignments, and, at most every
``every`` seconds, one small UPDATE of the attempt's row. A SIGKILL leaves the
last one written, so a crash's time of death is known within ``every``
seconds plus one step (or from a checkpoint committed after it). That write
is not durable (no fsync): losing it to a power cut costs precision, never a
checkpoint. It runs on the training thread and is skipped while a save runs
in the background (it would wait for that save's commit). It never raises
into training: a ledger that cannot be written is said in the log, the next
try waits longer each time (up to :data:`MAX_BACKOFF_S`), and the next
boundary reports the ledger's state as an error anyway.

The blocked time and the saves counted begin at the first reported step:
a save before it (an initial checkpoint) belongs to the restart.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import WriterLockLostError
from ..ledger.progress import Heartbeat, launch_of_first_attempt

log = logging.getLogger(__name__)

#: Seconds between two heartbeats of a step-reporting attempt (a crash's end is
#: known within this much; one UPDATE without fsync each time).
HEARTBEAT_S = 10.0

#: The longest wait before trying again after heartbeats failed.
MAX_BACKOFF_S = 300.0


@dataclass
class Saving:
    """One save in progress; ``wrote=False`` when it turned out to write nothing (a
    top-K candidate not admitted): its time is blocked time, but it is no sample of
    what a checkpoint costs."""

    wrote: bool = True


class Progress:
    """One attempt's reported steps and blocked time (every rank keeps its own; the
    chief's is written)."""

    def __init__(self, every: float = HEARTBEAT_S) -> None:
        self.every = every
        self.first_step_at: float | None = None  # time.time() of the first report
        self.launched_at: dt.datetime | None = None  # the process's start, if this claimed it
        self.last_step: int | None = None
        self.saving_s = 0.0  # seconds blocked in finished saves
        self.saves = 0  # finished saves that wrote a checkpoint
        #: time.monotonic() when the newest save returned (None: none yet).
        self.last_save_end: float | None = None
        self._since: float | None = None  # time.monotonic() of the save in progress
        self._depth = 0
        self._before_first = (0.0, 0)  # (saving_s, saves) at the first step: the restart's
        self._next_write = -float("inf")
        self._backoff = 0.0
        self._writer: Callable[[Heartbeat], None] | None = None
        self._busy: Callable[[], bool] = lambda: False

    def write_with(self, writer: Callable[[Heartbeat], None], busy: Callable[[], bool]) -> None:
        """Heartbeats go to ``writer`` from now on (the chief's ledger), except while
        ``busy()`` (a save committing in the background)."""
        self._writer, self._busy = writer, busy

    def step(self, step: int) -> None:
        """``step`` is done; the heartbeat is written if ``every`` seconds passed."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
            self._before_first = (self.saving_s, self.saves)
            if self._writer is not None:  # the chief's first training attempt in this process
                self.launched_at = launch_of_first_attempt()
        self.last_step = step
        writer = self._writer
        if writer is not None and time.monotonic() >= self._next_write and not self._busy():
            self._write(writer)

    @contextlib.contextmanager
    def saving(self) -> Iterator[Saving]:
        """The loop is blocked in a save meanwhile; nested scopes (an integration's
        framework save around ``mgr.save``) count once."""
        this = Saving()
        self._depth += 1
        if self._depth == 1:
            self._since = time.monotonic()
        try:
            yield this
        finally:
            self._depth -= 1
            if self._depth == 0 and self._since is not None:
                end = time.monotonic()
                self.saving_s += end - self._since
                self.saves += 1 if this.wrote else 0
                self.last_save_end = end
                self._since = None

    def blocked(self) -> float:
        """Seconds blocked in saves since the first step, the save in progress included."""
        since = self._since
        now = self.saving_s + (time.monotonic() - since if since is not None else 0.0)
        return now - self._before_first[0]

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
            saves=self.saves - self._before_first[1],
            launched_at=self.launched_at,
        )

    def _write(self, writer: Callable[[Heartbeat], None]) -> None:
        try:
            writer(self.beat())
        except WriterLockLostError as exc:  # another writer has the run: this attempt is over
            self._writer = None
            log.warning("ckptdb: heartbeats stop: %s", exc)
            return
        except Exception as exc:
            self._backoff = min(max(2 * self._backoff, self.every), MAX_BACKOFF_S)
            self._next_write = time.monotonic() + self._backoff
            log.warning(
                "ckptdb: the heartbeat was not written (goodput loses precision, training "
                "goes on; next try in %.0f s): %r",
                self._backoff,
                exc,
            )
            return
        if self._backoff:
            log.info("ckptdb: heartbeats are written again")
        self._backoff = 0.0
        self._next_write = time.monotonic() + self.every  # counted from the write's end
