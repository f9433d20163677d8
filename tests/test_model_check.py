"""Stateful model check of the publication protocol (boundary and reconcile).

A Hypothesis ``RuleBasedStateMachine`` drives one run through random boundaries
(random streams, steps that go forward, repeat and go back in time, random and
tied metrics), non-finite guard trips, transient I/O faults before the commit
(write, fsync, replace, ledger commit) and after it (an evicted file that cannot
be removed), interrupts, crashes at every protocol point followed by a reopen
(which reconciles), explicit reconciles and restarts from an older checkpoint.
Saves also run asynchronously (``blocking=False``): the handle is
fetched at once, or left in flight for the following rules (whose calls must
wait for it where the design says so: the next save, reconcile, close, a load
of a stream being written), or held in the background at a protocol point, where
a crash-and-reopen rule kills the process with the boundary unfinished (it is
published only if the hold point is past the commit).
A plain-Python reference model, written independently of :mod:`ckptdb.policies`,
says what must be committed per stream; it changes only when a save is
acknowledged (returned normally) or when a crash or interrupt hit after the
commit point (an asynchronous boundary is applied when the call returns, and
taken back if a crash hits it before its commit).

After every rule the ledger must agree with the model (committed (stream, step)
pairs, latest pointers, top-K order), ``mgr.check()`` must find nothing (but the
deletions a failed cleanup left to the next reconcile), and the save directory
must hold exactly the committed files (and those leftovers).

Default profile: 100 examples x up to 30 steps; ``CKPTDB_MODEL_EXAMPLES=1000``
for a deeper run.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import shutil
import sqlite3
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
import torch
from helpers import rows
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ckptdb import CheckpointManager, CleanupWarning, Keep, NonFiniteGradGuard, TopK, faults
from ckptdb.errors import NonFiniteGradientError, PublishError
from ckptdb.ledger import models as m
from ckptdb.protocol.asyncsave import SaveHandle
from ckptdb.protocol.reconcile import ReconcileReport

EXAMPLES = int(os.environ.get("CKPTDB_MODEL_EXAMPLES", "100"))
STEPS_PER_EXAMPLE = 30
WAIT = 60.0  # bound on any wait for the background thread (a hang fails, never passes)

# Thousands of boundaries, each with several fsyncs: on a tmpfs they cost nothing
# (this checks the protocol's logic; durability is the crash tests' business).
SCRATCH = os.environ.get("CKPTDB_MODEL_TMP") or (
    "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
)

STREAMS = ("model", "ema", "best")
METRIC = "val_loss"

# Crash points inside save, in protocol order. A crash at or after the commit
# point leaves the boundary committed; earlier ones leave it unpublished.
SAVE_POINTS = tuple(p for p in faults.POINTS if p != "mid_reconcile")
COMMITTED_POINTS = frozenset({"after_commit", "mid_cleanup"})
# Which PublishError phases each injected fault may surface as.
FAULT_PHASES = {
    "write": {"write"},
    "fsync": {"fsync", "fsync_dir", "intent"},  # intent: fsync of a new stream directory
    "replace": {"replace"},
    "commit": {"commit"},
}


class Crash(BaseException):
    """Stands for the process dying at a fault point."""


class Interrupt(BaseException):
    """Stands for a KeyboardInterrupt arriving at a fault point."""


# ------------------------------------------------------------ reference model


@dataclass(frozen=True)
class Saved:
    token: int  # the value stored in the payload, to check what a load returns
    metric: float | None
    seq: int  # publication order: the newest is the stream's latest


class Reference:
    """What must be committed per stream, from the design document alone."""

    def __init__(
        self, keep: dict[str, tuple[int | None, int | None]], topk: tuple[int, str]
    ) -> None:
        self.keep = keep  # stream -> (last, every)
        self.k, self.mode = topk  # the 'best' stream
        self.members: dict[str, dict[int, Saved]] = {s: {} for s in STREAMS}
        self.seq = 0

    def rank(self, step: int, metric: float) -> tuple[float, int]:
        """Smaller is better; ties go to the earlier step."""
        return (metric if self.mode == "min" else -metric, step)

    def _key(self, step: int, saved: Saved) -> tuple[float, int]:
        assert saved.metric is not None
        return self.rank(step, saved.metric)

    def admitted(self, step: int, streams: list[str], metric: float) -> list[str]:
        """The streams a boundary writes (top-K admission is decided before writing)."""
        out = []
        for stream in streams:
            if stream == "best":
                mine = self.rank(step, metric)
                better = [
                    s
                    for s, saved in self.members["best"].items()
                    if s != step and self._key(s, saved) < mine
                ]
                if len(better) >= self.k:
                    continue
            out.append(stream)
        return out

    def commit(self, step: int, streams: list[str], metric: float, token: int) -> None:
        for stream in streams:
            self.seq += 1
            members = self.members[stream]
            if stream == "best":
                members[step] = Saved(token, metric, self.seq)  # re-saving a step replaces it
                order = sorted(members, key=lambda s: self._key(s, members[s]))
                for s in order[self.k :]:
                    del members[s]
                continue
            last, every = self.keep[stream]
            for s in [s for s in members if s >= step]:  # the timeline rule
                del members[s]
            members[step] = Saved(token, None, self.seq)
            if last is None:
                continue
            window = set(sorted(members, reverse=True)[:last])
            for s in list(members):
                if s not in window and (every is None or s % every != 0):
                    del members[s]

    def committed(self) -> set[tuple[str, int]]:
        return {(stream, s) for stream, members in self.members.items() for s in members}

    def latest(self, stream: str) -> int | None:
        members = self.members[stream]
        return max(members, key=lambda s: members[s].seq) if members else None

    def best(self) -> list[tuple[int, float | None]]:
        members = self.members["best"]
        order = sorted(members, key=lambda s: self._key(s, members[s]))
        return [(s, members[s].metric) for s in order]


# --------------------------------------------------------------- injections


@contextmanager
def hook(fn: Callable[[str], None]) -> Iterator[None]:
    previous = faults.set_hook(fn)
    try:
        yield
    finally:
        faults.set_hook(previous)


class PointTrap:
    """Raises ``exc_type`` on the ``visit``-th visit of fault point ``point``."""

    def __init__(self, point: str, visit: int, exc_type: type[BaseException]) -> None:
        self.point, self.visit, self.exc_type = point, visit, exc_type
        self.seen = 0
        self.fired = False

    def __call__(self, name: str) -> None:
        if name != self.point:
            return
        self.seen += 1
        if self.seen == self.visit:
            self.fired = True
            raise self.exc_type(name)


class Hold:
    """Holds the background writer at its first visit of fault point ``point`` until
    :attr:`go` is set; it then goes on, or dies there (:class:`Crash`) if :attr:`dead`."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.arrived = threading.Event()
        self.go = threading.Event()
        self.dead = False

    def __call__(self, name: str) -> None:
        if name != self.point or self.arrived.is_set():
            return
        if threading.current_thread() is threading.main_thread():
            return
        self.arrived.set()
        if not self.go.wait(WAIT):
            raise TimeoutError(f"the machine never released the hold at {name}")
        if self.dead:
            raise Crash(name)


@dataclass
class InFlight:
    """An asynchronous boundary the machine has not seen finish yet."""

    handle: SaveHandle
    step: int
    expected: list[str]  # the streams it publishes (already applied to the reference)
    before: Reference  # the reference as it was without it (for a crash before its commit)
    hold: Hold | None  # the background thread is held at hold.point


class TransientFault:
    """Makes the ``nth`` call of one operation fail once with an OS or ledger error."""

    def __init__(self, target: str, nth: int) -> None:
        self.target, self.nth = target, nth
        self.calls = 0
        self.fired = False

    def _due(self) -> bool:
        self.calls += 1
        if self.calls == self.nth and not self.fired:
            self.fired = True
            return True
        return False

    @contextmanager
    def active(self) -> Iterator[None]:
        if self.target == "commit":

            def at_point(name: str) -> None:
                if name == "in_commit" and self._due():
                    raise sqlalchemy.exc.OperationalError(
                        "COMMIT", {}, sqlite3.OperationalError("database is locked")
                    )

            with hook(at_point):
                yield
            return
        owner: Any = torch if self.target == "write" else os
        name = "save" if self.target == "write" else self.target
        real = getattr(owner, name)
        code = {
            "write": errno.ENOSPC,
            "fsync": errno.EIO,
            "replace": errno.EXDEV,
            "unlink": errno.EACCES,
        }[self.target]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._due():
                raise OSError(code, os.strerror(code))
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)
        try:
            yield
        finally:
            setattr(owner, name, real)


@contextmanager
def no_rollback(mgr: CheckpointManager) -> Iterator[None]:
    """While active, a failure inside save leaves things exactly as a crash would."""
    mgr._publisher._roll_back = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del mgr._publisher._roll_back


# ------------------------------------------------------------- strategies

stream_sets = st.sets(st.sampled_from(STREAMS), min_size=1).map(
    lambda chosen: [s for s in STREAMS if s in chosen]
)
moves = st.just(0) | st.integers(min_value=-4, max_value=4)  # repeat, back in time, forward
metrics = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]),  # ties
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False),
)


class CheckpointLedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="ckptdb-model-", dir=SCRATCH))
        self.root = self.tmp / "run"
        self.mgr: CheckpointManager | None = None
        self.guard = NonFiniteGradGuard()
        self.clock = 0
        self.token = 0
        # evicted rows whose file could not be removed: relative path -> (stream, step);
        # they stay 'deleting' until the next reconcile (ckptdb.protocol.boundary, phase 6)
        self.deferred: dict[str, tuple[str, int]] = {}
        self.inflight: InFlight | None = None

    # ------------------------------------------------------------- helpers

    def _open(self) -> CheckpointManager:
        self.mgr = CheckpointManager(self.root, streams=self.policies, guard=self.guard)
        return self.mgr

    @property
    def live(self) -> CheckpointManager:
        assert self.mgr is not None
        return self.mgr

    def _abandon(self) -> None:
        """Drop the manager as a dead process would: no cleanup, no close."""
        mgr, self.mgr = self.live, None
        handle = mgr._inflight.handle
        assert handle is None or handle.done()  # the crash ended its work
        mgr._writer.shutdown()  # its idle thread: a dead process has no threads left
        mgr._closed = True
        mgr._ctx.ledger.dispose()
        assert mgr._ctx.lock is not None
        mgr._ctx.lock.release()

    def _next_step(self, move: int) -> int:
        self.clock = max(0, self.clock + move)
        return self.clock

    def _payloads(self, streams: list[str]) -> tuple[int, dict[str, Any]]:
        self.token += 1
        value = float(self.token)
        return self.token, {s: {"w": torch.tensor([value, -value])} for s in streams}

    def _reconciled(self, report: ReconcileReport, *, exact: bool) -> None:
        """A reconcile finished every deferred deletion (and, if ``exact``, did nothing else)."""
        done = [(a.kind, a.path) for a in report.actions]
        if exact:
            assert sorted(done) == sorted(("deleted", rel) for rel in self.deferred), str(report)
        else:
            assert {("deleted", rel) for rel in self.deferred} <= set(done), str(report)
        self.deferred.clear()

    def _members(self) -> set[tuple[str, int, int]]:
        return {
            (stream, step, saved.token)
            for stream, members in self.ref.members.items()
            for step, saved in members.items()
        }

    def _all_rows(self) -> int:
        return len(self.live.checkpoints(states=m.STATES))

    def _save(self, step: int, streams: list[str], metric: float) -> None:
        """An ordinary save that must succeed; applied to the model."""
        token, payloads = self._payloads(streams)
        expected = self.ref.admitted(step, streams, metric)
        before = self._all_rows()
        result = self.live.save(step, metrics={METRIC: metric}, **payloads)
        self._settled()  # the save waited for the boundary in flight
        assert sorted(result) == sorted(expected)
        assert all(c.step == step and c.state == m.COMMITTED for c in result.values())
        assert self._all_rows() == before + len(expected)  # a rejected candidate writes nothing
        self.ref.commit(step, expected, metric, token)

    # ------------------------------------------------ asynchronous boundaries

    def _release(self) -> None:
        """Let a boundary held in the background go on (it commits; nothing waits here)."""
        if self.inflight is not None and self.inflight.hold is not None:
            self.inflight.hold.go.set()
            self.inflight.hold = None

    def _settled(self) -> None:
        """The manager waited for the boundary in flight (if any): check its outcome."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return
        assert flight.handle.done(), f"step {flight.step} still in flight: nothing waited for it"
        result = flight.handle.result(timeout=0)
        assert sorted(result) == sorted(flight.expected)
        assert all(c.step == flight.step and c.state == m.COMMITTED for c in result.values())

    def _settle(self) -> None:
        """Wait for the boundary in flight here (before a rule injects faults, which
        must not hit it) and check its outcome."""
        if self.inflight is not None:
            self._release()
            self.inflight.handle.exception(timeout=WAIT)
            self._settled()

    def _crash_in_flight(self) -> None:
        """The process dies while its background thread is held at a protocol point."""
        flight, self.inflight = self.inflight, None
        assert flight is not None and flight.hold is not None
        with no_rollback(self.live):  # a dead process rolls nothing back
            flight.hold.dead = True
            flight.hold.go.set()
            flight.handle.exception(timeout=WAIT)
        published = flight.hold.point in COMMITTED_POINTS
        note(f"crash with step {flight.step} held at {flight.hold.point}: published={published}")
        if not published:
            self.ref = flight.before
        self._abandon()

    def _reopen_after_crash(self, crash_in_reconcile: bool, *, exact: bool) -> None:
        if crash_in_reconcile:  # crash again while the reopen reconciles
            with hook(PointTrap("mid_reconcile", 1, Crash)), pytest.raises(Crash):
                self._open()
            self.mgr = None
        report = self._open().last_reconcile
        note(f"reconcile at reopen: {report}")
        assert report.failures == []
        # a crash between boundaries leaves nothing to do but the deferred deletions
        self._reconciled(report, exact=exact and not crash_in_reconcile)
        assert self.live.reconcile().actions == []  # idempotent

    # -------------------------------------------------------------- rules

    @initialize(
        model_last=st.sampled_from([1, 2, 3, None]),
        ema_last=st.integers(min_value=1, max_value=2),
        ema_every=st.sampled_from([None, 2, 3]),
        k=st.integers(min_value=1, max_value=3),
        mode=st.sampled_from(["min", "max"]),
    )
    def open_run(
        self, model_last: int | None, ema_last: int, ema_every: int | None, k: int, mode: str
    ) -> None:
        self.policies = {
            "model": Keep(last=model_last),
            "ema": Keep(last=ema_last, every=ema_every),
            "best": TopK(k, METRIC, mode=mode),  # type: ignore[arg-type]
        }
        self.ref = Reference({"model": (model_last, None), "ema": (ema_last, ema_every)}, (k, mode))
        self._open()

    @rule(move=moves, streams=stream_sets, metric=metrics, finite_grad=st.booleans())
    def save(self, move: int, streams: list[str], metric: float, finite_grad: bool) -> None:
        self._release()
        if finite_grad:
            self.guard.update(torch.tensor(1.5))  # a finite norm never trips the guard
        self._save(self._next_step(move), streams, metric)

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        then=st.sampled_from(["fetch", "leave", "hold"]),
        point=st.sampled_from(SAVE_POINTS),
    )
    def save_async(
        self, move: int, streams: list[str], metric: float, then: str, point: str
    ) -> None:
        """``blocking=False``: fetch the result at once, leave the boundary in flight
        for the next rules, or hold it in the background at ``point`` (which a
        crash-and-reopen next may turn into a crash with the boundary unfinished)."""
        self._release()
        hold = Hold(point) if then == "hold" else None
        if hold is not None and self.inflight is not None:
            self.inflight.handle.wait()  # its fault points must not reach the new hook
        step = self._next_step(move)
        token, payloads = self._payloads(streams)
        expected = self.ref.admitted(step, streams, metric)
        before = self._all_rows()
        with hook(hold) if hold is not None else nullcontext():
            handle = self.live.save(step, metrics={METRIC: metric}, blocking=False, **payloads)
            self._settled()  # the call waited for the previous boundary
            while hold is not None and not hold.arrived.wait(0.001):
                if handle.done():  # the point was never visited: nothing is held
                    break
        assert isinstance(handle, SaveHandle) and handle.step == step
        flight = InFlight(handle, step, expected, copy.deepcopy(self.ref), None)
        if hold is not None and hold.arrived.is_set():
            flight.hold = hold
        # (held in_commit, the background thread holds the ledger's write lock: every
        # transaction, a read too, waits for it; the next rule releases or crashes it)
        if flight.hold is None or point != "in_commit":
            assert self._all_rows() == before + len(expected)  # its intent rows, at the call
        note(f"async step {step} ({then} at {point}): held={flight.hold is not None}")
        self.ref.commit(step, expected, metric, token)
        self.inflight = flight
        if then == "fetch":
            handle.result(timeout=WAIT)
            self._settled()

    @precondition(lambda self: self.inflight is not None and self.inflight.hold is not None)
    @rule(crash_in_reconcile=st.booleans())
    def crash_with_boundary_in_flight(self, crash_in_reconcile: bool) -> None:
        """The process dies while the background thread is held inside an asynchronous
        boundary (saved by an earlier rule): published only if held past the commit."""
        self._crash_in_flight()
        self._reopen_after_crash(crash_in_reconcile, exact=False)

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        bad=st.sampled_from([math.nan, math.inf, -math.inf]),
        as_tensor=st.booleans(),
        blocking=st.booleans(),
    )
    def guard_trip(
        self,
        move: int,
        streams: list[str],
        metric: float,
        bad: float,
        as_tensor: bool,
        blocking: bool,
    ) -> None:
        self._release()
        step = self._next_step(move)
        _, payloads = self._payloads(streams)
        before = self._all_rows()
        trips = self._events("guard_tripped")
        self.guard.update(torch.tensor(bad) if as_tensor else bad)
        with pytest.raises(NonFiniteGradientError):  # raised by the call, in both modes
            self.live.save(step, metrics={METRIC: metric}, blocking=blocking, **payloads)
        self._settled()
        assert not self.guard.tripped()  # reset after the boundary
        assert self._all_rows() == before  # nothing written, no row added
        assert self._events("guard_tripped") == trips + 1

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        kind=st.sampled_from(sorted(FAULT_PHASES)),
        nth=st.integers(min_value=1, max_value=4),
        mode=st.sampled_from(["blocking", "fetch", "unfetched"]),
    )
    def injected_fault(
        self, move: int, streams: list[str], metric: float, kind: str, nth: int, mode: str
    ) -> None:
        """``fetch``: an asynchronous save whose error ``exception()`` returns;
        ``unfetched``: nobody fetches it, and the next save raises it (and does nothing)."""
        self._settle()
        step = self._next_step(move)
        token, payloads = self._payloads(streams)
        expected = self.ref.admitted(step, streams, metric)
        fault = TransientFault(kind, nth)
        error: BaseException | None = None
        handle: SaveHandle | None = None
        with fault.active():
            try:
                if mode == "blocking":
                    self.live.save(step, metrics={METRIC: metric}, **payloads)
                else:
                    handle = self.live.save(
                        step, metrics={METRIC: metric}, blocking=False, **payloads
                    )
                    handle.wait()  # done before the fault is removed, not fetched
            except PublishError as exc:  # blocking, or a fault in the call's intent phase
                error = exc
        if handle is not None and mode == "fetch":
            error = handle.exception(timeout=0)
        if handle is not None and mode == "unfetched" and handle.done():
            unfetched = handle.unfetched_error  # (not fetched by asking)
            before = self._all_rows()
            if unfetched is not None:  # raised by the next save, which does not run
                with pytest.raises(PublishError) as raised:
                    self.live.save(step + 1, metrics={METRIC: metric}, **payloads)
                assert raised.value is unfetched
                assert self._all_rows() == before
            error = unfetched
        note(f"fault {kind} #{nth} ({mode}): fired={fault.fired} error={error!r}")
        if not fault.fired:  # the save never got that far: it is acknowledged
            assert error is None
            if handle is not None:
                assert sorted(handle.result(timeout=0)) == sorted(expected)
            self.ref.commit(step, expected, metric, token)
            return
        assert isinstance(error, PublishError), "an injected fault must not be swallowed"
        assert error.phase in FAULT_PHASES[kind]
        assert error.step == step
        assert error.cleanup_failures == []
        assert self.live.checkpoints(states=[m.PENDING]) == []
        self._check_consistent()  # nothing changed
        self._save(step, streams, metric)  # the fault was transient: the next save works

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        point=st.sampled_from(SAVE_POINTS),
        visit=st.integers(min_value=1, max_value=3),
        crash_in_reconcile=st.booleans(),
        blocking=st.booleans(),
    )
    def crash_and_reopen(
        self,
        move: int,
        streams: list[str],
        metric: float,
        point: str,
        visit: int,
        crash_in_reconcile: bool,
        blocking: bool,
    ) -> None:
        """A crash at a protocol point of this save (in the background thread if it
        is asynchronous), or, if a boundary is held in the background, right there."""
        if self.inflight is not None and self.inflight.hold is not None:
            self._crash_in_flight()
            self._reopen_after_crash(crash_in_reconcile, exact=False)
            return
        self._settle()
        step = self._next_step(move)
        token, payloads = self._payloads(streams)
        expected = self.ref.admitted(step, streams, metric)
        trap = PointTrap(point, visit, Crash)
        mgr = self.live
        handle: SaveHandle | None = None
        with hook(trap), no_rollback(mgr):
            try:
                if blocking:
                    mgr.save(step, metrics={METRIC: metric}, **payloads)
                else:  # every protocol point is in the background: the call returns
                    handle = mgr.save(step, metrics={METRIC: metric}, blocking=False, **payloads)
                    handle.wait()
            except BaseException:
                # a dead process raises nothing; what the simulated crash turned into
                # on its way out (torch wraps it inside its writer) does not matter
                if not trap.fired:
                    raise
        mode = "blocking" if blocking else "async"
        note(f"crash at {point} #{visit} ({mode}): fired={trap.fired}")
        if handle is not None and not trap.fired:
            assert sorted(handle.result(timeout=0)) == sorted(expected)
        if not trap.fired or point in COMMITTED_POINTS:
            self.ref.commit(step, expected, metric, token)
        self._abandon()
        self._reopen_after_crash(crash_in_reconcile, exact=not trap.fired)

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        point=st.sampled_from(SAVE_POINTS),
        visit=st.integers(min_value=1, max_value=2),
    )
    def interrupt(
        self, move: int, streams: list[str], metric: float, point: str, visit: int
    ) -> None:
        """A KeyboardInterrupt-like exception inside save, the manager kept in use.

        Before the commit point the boundary is rolled back at once; after it the
        boundary is published and only the removal of evicted files may be left
        (as after a cleanup failure) for the next reconcile.
        """
        self._settle()
        step = self._next_step(move)
        token, payloads = self._payloads(streams)
        expected = self.ref.admitted(step, streams, metric)
        trap = PointTrap(point, visit, Interrupt)
        with hook(trap):
            try:
                self.live.save(step, metrics={METRIC: metric}, **payloads)
            except Interrupt:
                assert trap.fired  # propagated unchanged, not wrapped
        note(f"interrupt at {point} #{visit}: fired={trap.fired}")
        published = not trap.fired or point in COMMITTED_POINTS
        if published:
            self.ref.commit(step, expected, metric, token)
        report = self.live.reconcile()
        note(f"reconcile after the interrupt: {report}")
        if published:
            assert {a.kind for a in report.actions} <= {"deleted"}, str(report)
        self._reconciled(report, exact=not published)

    @rule(
        move=moves,
        streams=stream_sets,
        metric=metrics,
        nth=st.integers(min_value=1, max_value=3),
    )
    def cleanup_fault(self, move: int, streams: list[str], metric: float, nth: int) -> None:
        """An evicted file cannot be removed after the commit: the save still succeeds."""
        self._settle()
        step = self._next_step(move)
        before = self._members()
        failures = self._events("cleanup_failed")
        fault = TransientFault("unlink", nth)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fault.active():
                self._save(step, streams, metric)  # acknowledged: the commit happened
        note(f"unlink fault #{nth}: fired={fault.fired}")
        reported = [w for w in caught if issubclass(w.category, CleanupWarning)]
        assert len(reported) == int(fault.fired)  # reported, never swallowed
        assert self._events("cleanup_failed") == failures + int(fault.fired)
        evicted = {(stream, s) for stream, s, _ in before - self._members()}
        left = [
            c
            for c in self.live.checkpoints(states=[m.DELETING])
            if c.path.relative_to(self.live.save_dir).as_posix() not in self.deferred
        ]
        assert len(left) == int(fault.fired)
        for c in left:
            assert (c.stream, c.step) in evicted
            self.deferred[c.path.relative_to(self.live.save_dir).as_posix()] = (c.stream, c.step)

    @rule(verify=st.booleans())
    def reconcile(self, verify: bool) -> None:
        self._release()
        report = self.live.reconcile(verify=verify)
        self._settled()  # it waited: the boundary in flight is not a crash to roll back
        assert report.failures == []
        self._reconciled(report, exact=True)

    @precondition(lambda self: bool(self.ref.members["model"]))
    @rule(
        pick=st.integers(min_value=0, max_value=8),
        move=st.integers(min_value=0, max_value=1),
        extra=st.sets(st.sampled_from(["ema", "best"])),
        metric=metrics,
        reopen=st.booleans(),
    )
    def restart_from_older(
        self, pick: int, move: int, extra: set[str], metric: float, reopen: bool
    ) -> None:
        """Load an older model checkpoint and continue training from its step."""
        self._release()
        steps = sorted(self.ref.members["model"])
        older = steps[:-1] or steps
        step = older[pick % len(older)]
        if reopen:
            self.live.close()
            self._settled()  # close waited for the boundary in flight
            self._reconciled(self._open().last_reconcile, exact=True)
        state = self.live.load(step, stream="model")
        self._loaded("model")
        token = self.ref.members["model"][step].token
        assert torch.equal(state["w"], torch.tensor([float(token), -float(token)]))
        self.clock = step
        streams = [s for s in STREAMS if s == "model" or s in extra]
        self._save(self._next_step(move), streams, metric)
        newest = max(c.step for c in self.live.checkpoints("model"))
        assert newest == self.clock  # the abandoned timeline is superseded

    @precondition(lambda self: bool(self.ref.committed()))
    @rule(pick=st.integers(min_value=0, max_value=20))
    def load_matches(self, pick: int) -> None:
        self._release()
        stream, step = sorted(self.ref.committed())[pick % len(self.ref.committed())]
        state = self.live.load(step, stream=stream)
        self._loaded(stream)
        token = self.ref.members[stream][step].token
        assert torch.equal(state["w"], torch.tensor([float(token), -float(token)]))

    def _loaded(self, stream: str) -> None:
        """A load of ``stream`` returned: it waited for a boundary in flight writing it
        (one writing other streams may still be in flight)."""
        if self.inflight is not None and stream in self.inflight.expected:
            self._settled()

    # --------------------------------------------------------- invariants

    def _events(self, kind: str) -> int:
        return int(rows(self.root, "SELECT COUNT(*) FROM events WHERE kind = ?", kind)[0][0])

    def _check_consistent(self) -> None:
        mgr = self.live
        committed = mgr.checkpoints()
        pairs = [(c.stream, c.step) for c in committed]
        assert len(pairs) == len(set(pairs)), f"a step committed twice: {pairs}"
        assert set(pairs) == self.ref.committed()
        for stream in STREAMS:
            latest = mgr.latest(stream)
            assert (latest.step if latest is not None else None) == self.ref.latest(stream), stream
            assert latest is None or latest.state == m.COMMITTED
        assert [(c.step, c.metric) for c in mgr.best("best")] == self.ref.best()
        deferred = {mgr.save_dir / rel for rel in self.deferred}
        assert {c.path for c in mgr.checkpoints(states=[m.DELETING])} == deferred
        # consistent, but for the deletions left to the next reconcile
        problems = mgr.check()
        assert len(problems) == len(deferred), problems
        for problem in problems:
            assert problem.startswith("reconcile would act: deleted"), problems
            assert any(rel in problem for rel in self.deferred), problems
        on_disk = {p for p in mgr.save_dir.rglob("*") if p.is_file() or p.is_symlink()}
        assert on_disk == {c.path for c in committed} | deferred
        assert not (self.root / "ckptdb.quarantine").exists()

    @invariant()
    def ledger_matches_model(self) -> None:
        if self.inflight is not None:
            if not self.inflight.handle.done():
                return  # still being written (or held): the next rules settle it
            self._settled()
        self._check_consistent()

    def teardown(self) -> None:
        try:
            self._release()
            if self.mgr is not None:
                self.mgr.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


# 8.2 s per example beside a second copy of the suite (2026-12-07) (815 s for 100): 3x that
@pytest.mark.timeout(max(900, EXAMPLES * 25))
def test_ledger_agrees_with_reference_model() -> None:
    run_state_machine_as_test(
        CheckpointLedgerMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS_PER_EXAMPLE,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
