"""Preemption: a signal on any rank becomes one agreed, guarded save before the job dies.

Schedulers announce a preemption with a signal and a grace period (SIGTERM
on Kubernetes and spot instances, SIGUSR1 with SLURM's ``--signal``). Saving
inside the signal handler is what goes wrong elsewhere: the handler runs
between two bytecodes of whatever the process was doing, maybe inside a
collective or a write. Here the flow is:

1. **Handler.** It only records the first signal (which one, when) and
   counts later ones. It never saves, never raises, never touches the ledger,
   so a second signal during the save interrupts nothing.
2. **Agreement.** Every rank calls :meth:`Preemption.requested` once per step.
   In one process it is the local flag. Under torch.distributed it is a
   pipelined all-reduce (MAX) of one byte per rank on a gloo group of its
   own: launched without waiting at one call, read at the next. So there is
   no blocking collective per step and no host sync of a CUDA tensor, and
   every rank gets the same answer at the same call: a signal that reached
   any rank before call ``k`` is seen by every rank at call ``k + 1``.
3. **Save.** :meth:`Preemption.save` is an ordinary boundary (guarded,
   durable, committed), with the grace period as its deadline: a boundary
   still before its commit when the deadline passes is rolled back, never
   half-done. A guard trip refuses it: the last good checkpoint stands.
4. **Record.** The chief records a ``preempted`` event when the ranks agree
   (before the save: a job killed during the save is still known as
   preempted), then ``preemption_saved`` with the outcome; the attempt ends as
   ``preempted``, not ``crashed``. :attr:`Preemption.exit_code` is the status
   of a process killed by the signal (143 for SIGTERM), for the scheduler.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .errors import ArgumentTypeError, InvalidArgumentError, NonFiniteGradientError, note_on
from .record import Checkpoint

__all__ = [
    "DEFAULT_SIGNALS",
    "OnPreemption",
    "Preempted",
    "Preemption",
    "Received",
    "on_preemption",
]

log = logging.getLogger("ckptdb.preemption")

#: What "preemption" means unless told otherwise: Kubernetes', the clouds' and
#: SLURM's own termination signal. SLURM's ``--signal=USR1@90`` adds SIGUSR1.
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)

#: Records an event (kind, step, detail) in the ledger; the chief's only.
Recorder = Callable[[str, int, dict[str, Any]], None]
#: Makes every blocking boundary begun inside it end by a deadline (``time.time()``).
DeadlineScope = Callable[[float | None], AbstractContextManager[None]]
T = TypeVar("T")


@dataclass(frozen=True)
class OnPreemption:
    """What a framework integration does on preemption: its ``preemption=`` setting.

    The arguments of :meth:`ckptdb.CheckpointManager.preemption`, checked when made,
    so a bad setting fails when the integration is configured, not when the signal
    comes. ``preemption=True`` is ``OnPreemption()``: SIGTERM, no grace period, the
    agreement at every step.

    Attributes:
        signals: The signals that mean preemption, as ``signal.Signals`` (duplicates
            dropped); default ``(SIGTERM,)``. SLURM's ``--signal=USR1@90`` adds
            SIGUSR1. SIGKILL and SIGSTOP cannot be handled.
        grace: Seconds, from the first signal, within which the preemption checkpoint
            must commit, else it is rolled back; None (the default): no deadline.
        every: Under torch.distributed, the agreement is launched every ``every``
            steps (default 1: a signal is acted on within two steps).

    Raises:
        InvalidArgumentError: no signal, a number that is not a signal, SIGKILL or
            SIGSTOP; ``grace`` not positive and finite; ``every`` below 1.
        ArgumentTypeError: ``signals`` is not a sequence of signal numbers,
            ``grace`` is not a number, or ``every`` is not an int.
    """

    signals: Sequence[signal.Signals | int] = DEFAULT_SIGNALS
    grace: float | None = None
    every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", _checked_signals(self.signals))
        object.__setattr__(self, "grace", _checked_grace(self.grace))
        object.__setattr__(self, "every", _checked_every(self.every))


def on_preemption(value: object) -> OnPreemption | None:
    """An integration's ``preemption=`` argument: ``True`` (the defaults), an
    :class:`OnPreemption`, or ``False``/``None`` (off)."""
    if value is None or value is False:
        return None
    if value is True:
        return OnPreemption()
    if isinstance(value, OnPreemption):
        return value
    raise ArgumentTypeError(
        f"preemption must be True, False, None or an OnPreemption(...), got {value!r}"
    )


class Preempted(SystemExit):
    """Raised by a framework integration once the preemption checkpoint is dealt with.

    It ends the job the way the signal would have (:attr:`Preemption.exit_code`).
    A ``SystemExit``: uncaught, the process exits with ``code`` (143 for
    SIGTERM), so a scheduler sees "terminated" (a Kubernetes Job retries it; an
    exit status of 0 would mark it complete), and no code after ``fit``/``train``
    runs inside the grace period. Made by :meth:`Preemption.stop`.

    Args:
        code: The exit status, 128 + the signal's number (143 for SIGTERM).
        step: The step the ranks agreed to stop at.
        saved: What was committed as the preemption checkpoint (empty when it was
            refused or abandoned: the last good one stands).

    Attributes:
        code: The exit status (``SystemExit``'s own).
        step: The agreed step.
        saved: The committed checkpoints, empty when none was.
    """

    def __init__(self, code: int, step: int, saved: list[Checkpoint]) -> None:
        super().__init__(code)
        self.step = step
        self.saved = saved

    def __str__(self) -> str:
        what = ", ".join(str(c.path) for c in self.saved) or "nothing (the last good one stands)"
        return f"preempted at step {self.step} (exit status {self.code}); saved: {what}"


@dataclass(frozen=True)
class Received:
    """The first preemption signal this process received.

    Attributes:
        signal: Which signal.
        at: When, as ``time.time()`` in the handler: ranks on several hosts compare
            it, and the grace period counts from it.
    """

    signal: signal.Signals
    at: float  # time.time() in the handler: ranks on several hosts compare it


class Preemption:
    """The agreed answer to "were we told to stop?", and the save that answers it.

    Made by :meth:`ckptdb.CheckpointManager.preemption` (collective: every rank
    makes one), not directly; making it installs the signal handlers, which only
    record the signal, and :meth:`close` (or the manager's close) restores the
    previous ones. A training loop asks :meth:`requested` once per step and, once
    it is True, saves with :meth:`save` and exits with :attr:`exit_code`.

    Args:
        save: The manager's ``save``, which the preemption checkpoint calls.
        record: Records an event ``(kind, step, detail)`` in the ledger (the
            chief's; a no-op on other ranks).
        deadline_scope: A context manager factory taking a deadline
            (``time.time()``, or None): every blocking boundary begun inside it is
            rolled back if the deadline passes before its commit.
        signals: The signals that mean preemption; default ``(SIGTERM,)``.
        grace: Seconds from the first signal within which the checkpoint must
            commit; None (the default): no deadline.
        every: Under torch.distributed, the agreement is launched every ``every``
            steps (default 1).
        group: The gloo process group the agreement runs on; None (the default):
            one process, the local flag is the answer.

    Attributes:
        signals: The handled signals, checked, duplicates dropped.
        grace: The grace period in seconds, or None.
        every: Steps between two launches of the agreement.
        received: The first signal this process received and when (None: none).
        count: The signals received, the first included.
        agreed_step: The step at which the ranks agreed to stop (None: not yet).
        agreed_signal: The signal of the lowest-numbered signalled rank, once
            agreed.
        ranks: The ranks that had received a signal when the ranks agreed.

    Raises:
        InvalidArgumentError: a bad signal, ``grace`` or ``every`` (see
            :class:`OnPreemption`), or handlers installed from a thread other than
            the main one.
        ArgumentTypeError: ``signals``, ``grace`` or ``every`` of the wrong type.
    """

    def __init__(
        self,
        save: Callable[..., dict[str, Checkpoint]],
        record: Recorder,
        deadline_scope: DeadlineScope,
        *,
        signals: Iterable[signal.Signals | int] = DEFAULT_SIGNALS,
        grace: float | None = None,
        every: int = 1,
        group: Any = None,
    ) -> None:
        self.signals = _checked_signals(signals)
        self.grace = _checked_grace(grace)
        self.every = _checked_every(every)
        self._save = save
        self._record = record
        self._deadline_scope = deadline_scope
        self.received: Received | None = None
        self.count = 0  # signals received, the first included
        self.agreed_step: int | None = None
        self.agreed_signal: signal.Signals | None = None  # the lowest signalled rank's
        self.ranks: list[int] = []  # the ranks that received a signal before the agreement
        self._flag = PipelinedFlag(group) if group is not None else None
        self._calls = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._install()

    # ------------------------------------------------------------ the handler

    def _install(self) -> None:
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as exc:  # not the main thread
            self.close()
            raise InvalidArgumentError(
                f"preemption signals can only be handled from the main thread: {exc}"
            ) from exc

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Record, and nothing else: never a save, a lock, a log call or an exception.

        Another ledger's preemption handler that this one replaced (two managers in
        one process) records the signal too. Any other handler of the signal does
        not run while this one is installed: a framework's would save or raise
        inside the handler, which is what this one exists to avoid.
        """
        self.count += 1
        if self.received is None:
            self.received = Received(signal.Signals(signum), time.time())
        replaced = self._previous.get(signal.Signals(signum))
        if isinstance(getattr(replaced, "__self__", None), Preemption):
            replaced(signum, frame)  # type: ignore[misc]

    def close(self) -> None:
        """Restore the handlers that were there before; wait for an agreement in flight.

        A handler someone installed over ours (a framework's, for its own run)
        is left alone: whoever installed it restores what it replaced, and
        putting back what ours replaced would undo that.

        A signal received that no agreement acted on (it came after the last
        :meth:`requested`, its pipelined agreement was still in flight, or it came
        while the ledger was closing) is not acted on:
        training is over, and the run ends as it would have (a job that
        finished does not exit 143, which a scheduler would retry). It is said
        in a warning, never dropped silently.
        """
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            current = signal.getsignal(sig)
            if current != self._handle:
                over = getattr(current, "__self__", None)
                if isinstance(over, Preemption) and over._previous.get(sig) == self._handle:
                    over._previous[sig] = handler  # another ledger's, over ours: it restores ours'
                continue
            try:
                signal.signal(sig, handler)
            except ValueError:  # closed from a thread other than the main one
                log.error(
                    "ckptdb: the handler of %s could not be restored outside the main "
                    "thread; ckptdb's stays installed (it only records the signal)",
                    sig.name,
                    exc_info=True,
                )
        if self._flag is not None:
            self._flag.close()
        told = self.received
        if told is not None and self.agreed_step is None:
            log.warning(
                "ckptdb: %s was received but no preemption agreement acted on it (it came "
                "after the last check, or its agreement was still in flight); the run ended "
                "as it would have",
                told.signal.name,
            )

    # ------------------------------------------------------------- agreement

    def requested(self, step: int) -> bool:
        """Whether every rank must save ``step`` and stop; one cheap call per step.

        Every rank calls it once per step, with the same ``step``, and gets the
        same answer at the same call. Once True it stays True (and runs no more
        collectives). The first True is recorded as the ``preempted`` event, before
        the save, so a job killed during the save is still known as preempted. In
        one process the answer is the local flag. Under torch.distributed the
        agreement (a one-byte all-reduce on a gloo group, no host sync of a CUDA
        tensor) is launched at every ``every``-th call and read at the next one: a
        signal is acted on at most ``every + 1`` steps after it came (``every``
        trades that delay for the cost of one small all-reduce per step).

        Args:
            step: The step just finished, the same on every rank; the one to save
                when the answer is True.

        Returns:
            True when every rank must save ``step`` and stop.
        """
        if self.agreed_step is not None:
            return True
        mine = int(self.received.signal) if self.received is not None else 0
        launch = self._calls % self.every == 0
        self._calls += 1
        # one process: the flag itself, at every call
        agreed = [mine] if self._flag is None else self._flag.agree(mine, launch=launch)
        if not any(agreed):
            return False
        self.agreed_step = step
        self.ranks = [rank for rank, signum in enumerate(agreed) if signum]
        self.agreed_signal = signal.Signals(agreed[self.ranks[0]])
        detail = {"signal": self.agreed_signal.name, "ranks": self.ranks}
        self._note("preempted", step, detail)
        return True

    # ------------------------------------------------------------------ save

    @property
    def deadline(self) -> float | None:
        """The end of this rank's grace period (``time.time()``), counted from its
        first signal; None without a grace period or a signal."""
        if self.grace is None or self.received is None:
            return None
        return self.received.at + self.grace

    def _agreed_deadline(self) -> float | None:
        """The earliest rank's deadline (collective under torch.distributed): a signal
        that reached one rank only still bounds the save the chief commits."""
        if self._flag is None:
            return self.deadline
        found = [d for d in self._flag.gather(self.deadline) if d is not None]
        return min(found) if found else None

    def save(
        self, step: int, *, metrics: Mapping[str, float] | None = None, **payloads: Any
    ) -> dict[str, Checkpoint] | None:
        """The preemption checkpoint: ``manager.save(step, ...)`` within the grace period.

        An ordinary blocking boundary (guarded, durable, committed) whose deadline
        is the end of the grace period, the earliest rank's: a boundary still
        before its commit when it passes is rolled back, never half-done. Collective,
        like ``save``. The outcome is recorded as a ``preemption_saved`` event.

        Args:
            step: The step :meth:`requested` agreed on.
            metrics: As for ``save``: metric name -> real number; None (the
                default): none.
            **payloads: As for ``save``: stream name -> payload.

        Returns:
            The committed checkpoints by stream, as ``save`` returns them; None when
                nothing was published: the guard refused the step (its
                ``guard_tripped`` event says why) or the grace period ended before the
                commit (rolled back). The last good checkpoint then stands.

        Raises:
            PublishError: the boundary failed for another reason (recorded first);
                so does any other error ``save`` raises (see
                :meth:`ckptdb.CheckpointManager.save`), except a guard refusal.
        """
        try:
            return self.publish(step, lambda: self._save(step, metrics=metrics, **payloads))
        except NonFiniteGradientError as exc:
            log.warning("ckptdb: the preemption checkpoint of step %d was refused: %s", step, exc)
            return None

    def publish(self, step: int, boundary: Callable[[], T]) -> T | None:
        """The preemption checkpoint written by ``boundary``, within the grace period.

        For integrations, whose frameworks write a checkpoint their own way:
        ``boundary()`` runs the framework's usual publish (which calls
        ``manager.save``); every blocking boundary it begins is rolled back if
        the grace period ends before its commit. The outcome is recorded as a
        ``preemption_saved`` event. Collective: every rank calls it.

        Args:
            step: The step :meth:`requested` agreed on.
            boundary: Runs the framework's publish and returns what it committed
                (a falsy value when the guard refused the step without raising).

        Returns:
            What ``boundary()`` returned; None when it returned nothing (the guard
                refused the step) or the grace period ended before the commit.

        Raises:
            NonFiniteGradientError: the guard refused the step by raising (recorded
                first).
            PublishError: the boundary failed for another reason (recorded first);
                any other error ``boundary()`` raises is recorded and raised too.
        """
        deadline = self._agreed_deadline()
        try:
            with self._deadline_scope(deadline):
                saved = boundary()
        except NonFiniteGradientError as exc:
            self._note("preemption_saved", step, {"saved": False, "why": f"guard: {exc}"})
            raise
        except Exception as exc:
            self._note("preemption_saved", step, {"saved": False, "why": str(exc)}, onto=exc)
            if getattr(exc, "phase", None) == "deadline":
                log.warning("ckptdb: the preemption checkpoint of step %d: %s", step, exc)
                return None
            raise
        if not saved:
            why = "guard: the guard refused the step (see its guard_tripped event)"
            self._note("preemption_saved", step, {"saved": False, "why": why})
            return None
        self._note("preemption_saved", step, {"saved": True})
        return saved

    def already_saved(self, step: int) -> None:
        """Record that the framework's own checkpoint of the agreed step is the preemption one.

        For integrations whose framework committed its checkpoint of the agreed step
        before the agreement: no second checkpoint is written, and the
        ``preemption_saved`` event says it was saved.

        Args:
            step: The agreed step, whose checkpoint is already committed.
        """
        self._note("preemption_saved", step, {"saved": True})

    def stop(self, step: int, saved: Iterable[Checkpoint] = ()) -> Preempted:
        """The :class:`Preempted` an integration raises to end the job after ``step``.

        Args:
            step: The agreed step.
            saved: The preemption checkpoint's committed checkpoints (default: none,
                when it was refused or abandoned).

        Returns:
            The exception to raise, with :attr:`exit_code` as its code.
        """
        return Preempted(self.exit_code, step, list(saved))

    def _note(
        self,
        kind: str,
        step: int,
        detail: dict[str, Any],
        *,
        onto: BaseException | None = None,
    ) -> None:
        """Record an event; a failure to record it (the ledger unreachable) never
        changes what this call returns, since it happens on the chief alone and the
        ranks must agree: it is attached to ``onto`` (the error being raised) or
        logged with its error."""
        try:
            self._record(kind, step, detail)
        except Exception as failed:
            text = f"the {kind!r} event of step {step} was not recorded: {failed!r}"
            if onto is not None:
                note_on(onto, f"ckptdb: {text}")
            else:
                log.error("ckptdb: %s", text, exc_info=True)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (143 for SIGTERM), the status of a process the
        signal killed: schedulers read it as "terminated", not "finished". Once
        the ranks agreed, every rank's is the agreed signal's (a rank that was not
        signalled itself still stops for it); before that, this rank's own
        signal's, or 0 without one."""
        sig = self.agreed_signal or (self.received.signal if self.received else None)
        return 128 + int(sig) if sig is not None else 0


class PipelinedFlag:
    """Every rank's signal number (0: none), all-reduced with MAX one call late.

    Call ``k`` launches the all-reduce of the flag as it is now, without
    waiting, and returns the result of call ``k - 1``'s (waited for here: it
    finished long ago, in the previous step). One byte per rank, on a gloo
    group: a CPU tensor, never a device sync.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._buffer: torch.Tensor | None = None
        self._work: Any = None

    def agree(self, mine: int, *, launch: bool = True) -> list[int]:
        """The previous launch's result (empty if none was in flight); then, with
        ``launch`` and no agreement yet, the next launch."""
        agreed: list[int] = []
        if self._work is not None:
            self._work.wait()
            assert self._buffer is not None
            agreed = [int(x) for x in self._buffer.tolist()]
            self._work = None
        if any(agreed) or not launch:
            return agreed
        # on the CPU whatever the ambient device (DeePMD steps its optimizer inside
        # `with torch.device(DEVICE)`): a gloo collective, never a device sync
        buffer = torch.zeros(self.size, dtype=torch.uint8, device="cpu")
        buffer[self.rank] = mine
        self._buffer = buffer
        self._work = dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def gather(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` (after the agreement in flight, on the same group)."""
        self.close()
        found: list[Any] = [None] * self.size
        dist.all_gather_object(found, mine, group=self.group)
        return found

    def close(self) -> None:
        """The agreement in flight completes (every rank launched it) before the group goes."""
        work, self._work = self._work, None
        if work is not None:
            work.wait()


def _checked_signals(signals: Iterable[signal.Signals | int]) -> tuple[signal.Signals, ...]:
    if isinstance(signals, (str, bytes, int)):
        raise ArgumentTypeError(f"signals must be a sequence of signals, got {signals!r}")
    found: list[signal.Signals] = []
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, int):
            raise ArgumentTypeError(f"a preemption signal must be a signal number, got {sig!r}")
        try:
            found.append(signal.Signals(sig))
        except ValueError:
            raise InvalidArgumentError(f"{sig!r} is not a signal") from None
    if not found:
        raise InvalidArgumentError("preemption needs at least one signal")
    for sig in found:
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidArgumentError(f"{sig.name} cannot be handled: no process can catch it")
    return tuple(dict.fromkeys(found))


def _checked_every(every: int) -> int:
    if isinstance(every, bool) or not isinstance(every, int):
        raise ArgumentTypeError(f"every must be a number of steps, got {every!r}")
    if every < 1:
        raise InvalidArgumentError(f"every must be at least 1 step, got {every}")
    return every


def _checked_grace(grace: float | None) -> float | None:
    if grace is None:
        return None
    if isinstance(grace, bool) or not isinstance(grace, (int, float)):
        raise ArgumentTypeError(f"grace must be a number of seconds, got {grace!r}")
    if not grace > 0 or grace == float("inf"):
        raise InvalidArgumentError(f"grace must be a positive, finite number of seconds: {grace!r}")
    return float(grace)
