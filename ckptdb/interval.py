"""``mgr.due(step)``: "checkpoint now?", from a fixed interval or one the ledger chooses.

``interval="auto"`` proposes the Young/Daly interval sqrt(2·C·M): C is the
mean time this run's loop was blocked per save (measured by every save,
this attempt's included), M the training time per failure: attempts that
ended crashed or preempted, the run's own and, on a shared ledger, other
runs' on this host. It stays within ``min_interval``/``max_interval``; with
no failure seen it is ``max_interval`` (a first checkpoint within 30 minutes
by default). Each change of more than a tenth, or of the rule that decided,
is an ``interval`` event with its C and M, so ``ckptdb status`` can say why.

Ranks agree without a blocking collective per step: the chief decides with
its clock, and its answer reaches every rank one call later through the
pipelined flag the preemption check uses (a one-byte all-reduce launched at
each call and read at the next). Every rank returns the same answer at the
same call; a checkpoint is taken one step after the chief saw it due.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgumentError
from .goodput import History, IntervalChoice, check_bounds, choose_interval
from .protocol.progress import Progress

log = logging.getLogger(__name__)

AUTO = "auto"

#: A relative change of the interval below this is not a change worth an event.
CHANGE = 0.1


@dataclass(frozen=True)
class IntervalSetting:
    """``interval=`` as given: seconds, or ``"auto"`` within the bounds."""

    fixed: float | None
    low: float
    high: float

    @classmethod
    def of(cls, interval: object, min_interval: object, max_interval: object) -> IntervalSetting:
        low, high = check_bounds(min_interval, max_interval)
        if interval == AUTO:
            return cls(None, low, high)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise InvalidArgumentError(
                f"interval must be a number of seconds or 'auto', got {interval!r}"
            )
        if not math.isfinite(interval) or interval <= 0:
            raise InvalidArgumentError(
                f"interval must be a positive number of seconds, got {interval}"
            )
        return cls(float(interval), low, high)


def interval_of(
    interval: object, min_interval: object, max_interval: object
) -> IntervalSetting | None:
    """``interval=`` and its bounds, checked (None: no interval, and then no bounds).

    Raises:
        InvalidArgumentError: a non-positive or non-finite number of seconds, an
            interval that is neither seconds nor ``"auto"``, crossed bounds, or
            bounds without an interval.
    """
    if interval is None:
        if min_interval is not None or max_interval is not None:
            raise InvalidArgumentError("min_interval= and max_interval= go with interval=")
        return None
    return IntervalSetting.of(interval, min_interval, max_interval)


@dataclass(frozen=True)
class Pacing:
    """A manager's ``interval=`` (None: ``due`` unavailable) and ``heartbeat=`` seconds."""

    interval: IntervalSetting | None
    heartbeat: float


def pacing_of(
    interval: object, min_interval: object, max_interval: object, heartbeat: object
) -> Pacing:
    """The manager's pacing arguments, checked before anything is opened.

    Raises:
        InvalidArgumentError: a non-positive or non-finite number of seconds, an
            interval that is neither seconds nor ``"auto"``, or bounds that cross.
    """
    setting = interval_of(interval, min_interval, max_interval)
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float)):
        raise InvalidArgumentError(f"heartbeat must be a number of seconds, got {heartbeat!r}")
    if not math.isfinite(heartbeat) or heartbeat <= 0:
        raise InvalidArgumentError(
            f"heartbeat must be a positive number of seconds, got {heartbeat}"
        )
    return Pacing(setting, float(heartbeat))


class Interval:
    """The clock behind ``due``: one per manager opened with ``interval=``."""

    def __init__(
        self,
        setting: IntervalSetting,
        progress: Progress,
        *,
        is_chief: bool,
        flag: Any,
        history: Callable[[], History],
        record: Callable[[IntervalChoice, int], None],
    ) -> None:
        self.setting, self.progress, self.is_chief = setting, progress, is_chief
        self._flag, self._history, self._record = flag, history, record
        self._past: History | None = None
        self._opened = time.monotonic()
        self._started: float | None = None  # the first due(): training began
        #: The interval in force (the chief's; None before the first ``due``).
        self.current: IntervalChoice | None = None
        self._recorded: IntervalChoice | None = None  # the last one an event recorded

    def due(self, step: int) -> bool:
        """Whether every rank checkpoints at this call (the same answer everywhere)."""
        now = time.monotonic()
        if self._started is None:
            self._started = now
        mine = 0
        if self.is_chief:
            choice = self._choose(step)
            since = self.progress.last_save_end
            since = self._started if since is None or since < self._started else since
            mine = int(now - since >= choice.seconds)
        if self._flag is None:
            return bool(mine)
        return any(self._flag.agree(mine))

    def close(self) -> None:
        if self._flag is not None:
            self._flag.close()

    def _choose(self, step: int) -> IntervalChoice:
        if self.setting.fixed is not None:
            choice = IntervalChoice(self.setting.fixed, None, None, 0, 0.0, "fixed")
        else:
            if self._past is None:
                self._past = self._read_history()
            past, progress = self._past, self.progress
            saves = past.saves + progress.saves
            cost = (past.saving_s + progress.saving_s) / saves if saves else None
            training = past.training_s + (time.monotonic() - self._opened)
            choice = choose_interval(
                cost, past.failures, training, self.setting.low, self.setting.high
            )
        self.current = choice
        if self._changed(choice):  # an event on a change worth saying, not at every save
            self._recorded = choice
            self._record(choice, step)
        return choice

    def _read_history(self) -> History:
        """The earlier attempts' measures; none where the ledger cannot be read now. Never
        raises: the chief alone reads it, and every rank must answer ``due`` alike."""
        try:
            return self._history()
        except Exception:
            log.error(
                "ckptdb: the run's save cost and failures could not be read; the interval "
                "starts from this attempt's own measures",
                exc_info=True,
            )
            return History()

    def _changed(self, choice: IntervalChoice) -> bool:
        old = self._recorded
        if old is None or old.why != choice.why:
            return True
        return abs(choice.seconds - old.seconds) > CHANGE * old.seconds
