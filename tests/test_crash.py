"""Crash consistency: crash at every protocol phase, and SIGKILL at random.

Each test runs a trainer in a child process that dies mid-flight, then reopens
the run in the parent (reconcile at open) and checks, besides ``mgr.check``:
every acknowledged save is still committed unless a later committed boundary
evicted it by policy (invariant 5, against a reference model of the
policies), every committed file holds the payload of the boundary its row
names, ``PRAGMA integrity_check`` is ok (SQLite), a second reconcile does
nothing, and a further save succeeds.

Each test runs on both ledgers: the run's SQLite file and a PostgreSQL schema of
its own (``backend``; the children use the same URL). On PostgreSQL a
representative part runs, to keep the suite's time in bounds: the sweeps visit each
point once (n=1; the second visit differs in where the protocol is, not in what the
ledger does), a fresh interpreter dies once (inside the commit transaction), and
half as many random kills.

Reproduce a failure with the values in its message, e.g.
``pytest tests/test_crash.py -k "mid_cleanup and 2 and warm and sqlite"`` or
``CKPTDB_KILL_SEED=7 CKPTDB_KILLS=1000 pytest tests/test_crash.py -k sigkill``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from crashlib import (
    CRASH_EXIT,
    Boundary,
    ChildSpec,
    Reference,
    boundaries,
    fork_child,
    ledger_rows,
    plant_stray_temp,
    policies,
    run_child,
    run_forked,
    run_subprocess,
    save_once_more,
    tail,
    verify,
    wait_child,
    wait_for_line,
)
from helpers import await_sessions_gone

from ckptdb import CheckpointManager, Keep, TopK, faults
from ckptdb.errors import CleanupWarning, PublishError

# (step, val_loss) per boundary: steps go back in time at 5 and re-save a step at
# 7; top-K(2) admits, rejects (5, 9) and replaces (7, a re-save of member step 40).
SWEEP = [
    (10, 0.5), (20, 0.3), (30, 0.7), (40, 0.2), (50, 0.6),
    (30, 0.4), (40, 0.1), (40, 0.35), (50, 0.05), (60, 0.9),
    (70, 0.3), (80, 0.3), (60, 0.2), (70, 0.8), (80, 0.05),
    (90, 0.6), (100, 0.1), (110, 0.4), (120, 0.02), (130, 0.7),
]  # fmt: skip
WARMUP = 6  # boundaries published before the hook is armed in "warm" runs
START = {"new_run": 0, "warm": WARMUP}
QUARANTINE = "ckptdb.quarantine"
FURTHER_INDEX = 1_000_000  # the boundary published after recovery
BEFORE_COMMIT = frozenset(
    ("after_intent", "mid_write", "after_fsync", "after_replace", "after_fsync_dir", "in_commit")
)

KILLS = int(os.environ.get("CKPTDB_KILLS", "50"))
KILL_SEED = int(os.environ.get("CKPTDB_KILL_SEED", "20240611"))
PER_CHILD = 400  # boundaries a child is given; it is always killed long before

# (backend, n): the n-th visit of a point is where a sweep dies; once on PostgreSQL
BACKEND_N = [("sqlite", 1), ("sqlite", 2), ("postgres", 1)]
FRESH_INTERPRETER = [
    *(("sqlite", point) for point in ("mid_write", "in_commit", "after_commit")),
    ("postgres", "in_commit"),
]


def sweep_schedule() -> list[Boundary]:
    return list(boundaries(SWEEP))


def spec(tmp_path: Path, name: str, plan: list[Boundary], **kwargs: Any) -> ChildSpec:
    return ChildSpec(
        root=str(tmp_path / "run"),
        ack=str(tmp_path / f"{name}.ack"),
        log=str(tmp_path / f"{name}.log"),
        boundaries=plan,
        **kwargs,
    )


def ledger_name(db_url: str | None) -> str:
    return "sqlite" if db_url is None else "postgres"


def crash(child: ChildSpec, context: str, *, fork: bool = True) -> None:
    """Run a child that must die at its fault point."""
    code = run_forked(child) if fork else run_subprocess(child)
    assert code == CRASH_EXIT, (
        f"{context}: child exited with {code}, not {CRASH_EXIT}: "
        f"{'the fault point was never reached' if code == 0 else 'it failed'}\n"
        f"{tail(Path(child.log))}"
    )


def absorb(ref: Reference, child: ChildSpec) -> list[str]:
    return ref.absorb(Path(child.ack), ledger_rows(Path(child.root), child.db_url))


def assert_recovers(
    root: Path, ref: Reference, context: str, problems: list[str], db_url: str | None
) -> dict[str, int]:
    """Reopen, check every invariant, then publish one more boundary; returns the
    counts of the reconcile at reopen."""
    result = verify(root, ref, db_url)
    problems = problems + result.problems
    assert not problems, f"{context}: after reopen (reconcile {result.reconcile_counts}):\n" + (
        "\n".join(problems)
    )
    further = Boundary(FURTHER_INDEX, 10 * FURTHER_INDEX, 0.0)  # beyond every step
    problems = save_once_more(root, ref, further, db_url)
    assert not problems, f"{context}: further save:\n" + "\n".join(problems)
    return result.reconcile_counts


# ------------------------------------------------------------ crash-point sweep


def crash_in_save_loop(
    tmp_path: Path, point: str, n: int, arm_after: int, context: str, db_url: str | None
) -> None:
    plan = sweep_schedule()
    ref = Reference(policies(), {b.index: b for b in plan})
    child = spec(
        tmp_path, "child", plan, crash_point=point, crash_n=n, arm_after=arm_after, db_url=db_url
    )
    crash(child, context)
    problems = absorb(ref, child)
    assert ref.acks >= arm_after, f"{context}: only {ref.acks} boundaries before the crash"
    counts = assert_recovers(tmp_path / "run", ref, context, problems, db_url)
    # The commit point is where the design puts it: before it the boundary is
    # rolled back at reopen, after it the boundary stands and cleanup is finished.
    if point in BEFORE_COMMIT:
        assert ref.unacked_commits == 0, f"{context}: committed before the commit point"
        assert counts.get("rolled_back", 0) >= 2, f"{context}: nothing rolled back: {counts}"
    else:
        assert ref.unacked_commits == 1, f"{context}: boundary lost after its commit"
    if point == "mid_cleanup":
        assert counts.get("deleted", 0) >= 1, f"{context}: no cleanup finished: {counts}"


def crash_in_reconcile(
    tmp_path: Path, n: int, arm_after: int, context: str, db_url: str | None
) -> None:
    """Stack damage for reconcile, then crash inside the reconcile that repairs it.

    A: crash mid-cleanup (rows left 'deleting'); B: reopened without reconcile,
    crash after replace (rows left 'pending' with final files in place); then a
    stray temp file and an unowned checkpoint file. C crashes at the n-th
    reconcile: the one at open, or (n=2) an on-demand one after two more boundaries.
    """
    plan = sweep_schedule()
    ref = Reference(policies(), {b.index: b for b in plan})
    root = tmp_path / "run"
    a = spec(tmp_path, "a", plan, crash_point="mid_cleanup", arm_after=arm_after, db_url=db_url)
    crash(a, f"{context} (child A)")
    problems = absorb(ref, a)
    b = spec(
        tmp_path,
        "b",
        plan[ref.next_index :],
        crash_point="after_replace",
        maintenance=True,
        db_url=db_url,
    )
    crash(b, f"{context} (child B)")
    problems += absorb(ref, b)
    states = {r.state for r in ledger_rows(root, db_url)}
    assert {"pending", "deleting"} <= states, f"{context}: damage not staged: {states}"
    stray = plant_stray_temp(root / "checkpoints", "ema")
    orphan = root / "checkpoints" / "model" / "step-000999999.pt"
    orphan.write_bytes(b"no row owns me")
    c = spec(
        tmp_path,
        "c",
        plan[ref.next_index :],
        crash_point="mid_reconcile",
        crash_n=n,
        reconcile_every=2,
        db_url=db_url,
    )
    crash(c, f"{context} (child C)")
    problems += absorb(ref, c)
    assert_recovers(root, ref, context, problems, db_url)
    assert not stray.exists() and not orphan.exists(), context
    assert (root / QUARANTINE / "model" / orphan.name).read_bytes() == b"no row owns me", context


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", sorted(START))
@pytest.mark.parametrize(("backend", "n"), BACKEND_N, indirect=["backend"])
@pytest.mark.parametrize("point", faults.POINTS)
def test_crash_at_point_reconciles_to_a_consistent_run(
    tmp_path: Path, point: str, n: int, start: str, backend: str | None
) -> None:
    context = (
        f"point={point} n={n} start={start} ledger={ledger_name(backend)} "
        f"(schedule SWEEP, warm-up {START[start]})"
    )
    if point == "mid_reconcile":
        crash_in_reconcile(tmp_path, n, START[start], context, backend)
    else:
        crash_in_save_loop(tmp_path, point, n, START[start], context, backend)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("backend", "point"), FRESH_INTERPRETER, indirect=["backend"])
def test_crash_in_a_fresh_interpreter(tmp_path: Path, point: str, backend: str | None) -> None:
    """The sweep forks from the test process; a real interpreter behaves the same."""
    context = f"point={point} n=1 start=warm ledger={ledger_name(backend)}, subprocess child"
    plan = sweep_schedule()
    ref = Reference(policies(), {b.index: b for b in plan})
    child = spec(tmp_path, "child", plan, crash_point=point, arm_after=WARMUP, db_url=backend)
    crash(child, context, fork=False)
    problems = absorb(ref, child)
    assert ref.acks == WARMUP, context
    assert_recovers(tmp_path / "run", ref, context, problems, backend)


def test_sweep_covers_every_point_and_the_schedule_evicts() -> None:
    """Guard the sweep's premises: every fault point is swept, and the schedule
    exercises the timeline rule, top-K rejection and top-K replacement."""
    ref = Reference(policies(), {})
    evicting = set()
    rejected = []
    for b in sweep_schedule():
        before = set(ref.evicted_by)
        rows = {"model": 3 * b.index, "ema": 3 * b.index + 1}
        if ref.admits("best", b):
            rows["best"] = 3 * b.index + 2
        else:
            rejected.append(b.index)
        assert ref.commit(b, rows, acked=True) == []
        new = set(ref.evicted_by) - before
        evicting |= {ref.known[i].stream for i in new}
        if b.index == 5:  # back to step 30: model's steps 40 and 50 are superseded
            assert {ref.known[i].step for i in new if ref.known[i].stream == "model"} == {40, 50}
        if b.index == 7:
            assert 3 * 6 + 2 in new, "boundary 7 must replace the top-K member at step 40"
    assert 5 in rejected and 9 in rejected, rejected
    assert evicting == {"model", "ema", "best"}
    # the phases of the protocol; the sweep is parametrized over faults.POINTS, so a
    # point added later is swept too (and fails until a child can reach it)
    assert set(faults.POINTS) >= BEFORE_COMMIT | {"after_commit", "mid_cleanup", "mid_reconcile"}


# ------------------------------------------------------------------ random SIGKILL


@pytest.mark.timeout(max(300, 3 * KILLS))
def test_random_sigkill_never_loses_an_acknowledged_save(
    tmp_path: Path, backend: str | None
) -> None:
    rng = random.Random(KILL_SEED)
    schedule = boundaries(seed=KILL_SEED, big_every=4)
    plan: list[Boundary] = []
    ref = Reference(policies(), {})
    root = tmp_path / "run"
    outcomes: dict[str, int] = {}
    kills = KILLS if backend is None else max(1, KILLS // 2)
    for kill in range(kills):
        while len(plan) < ref.next_index + PER_CHILD:
            plan.extend(islice(schedule, 1000))
            ref.schedule.update((b.index, b) for b in plan)
        child = spec(
            tmp_path,
            f"kill{kill:04d}",
            plan[ref.next_index : ref.next_index + PER_CHILD],
            db_url=backend,
        )
        early = rng.random() < 0.25  # during start-up, open and reconcile
        delay = rng.uniform(0, 0.15) if early else rng.uniform(0, 0.3)
        context = (
            f"CKPTDB_KILL_SEED={KILL_SEED} ledger={ledger_name(backend)} kill #{kill} (of {kills}) "
            f"{'after fork' if early else 'after open'} delay={delay:.4f}s "
            f"first boundary={ref.next_index}"
        )
        pid = fork_child(child)
        if not early:
            wait_for_line(Path(child.ack), "opened", timeout=20)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        code = wait_child(pid, timeout=60)
        assert code == -signal.SIGKILL, f"{context}: child exited {code}\n{tail(Path(child.log))}"
        await_sessions_gone(backend, pid)
        problems = absorb(ref, child)
        result = verify(root, ref, backend)
        problems += result.problems
        assert not problems, f"{context}: reconcile {result.reconcile_counts}:\n" + "\n".join(
            problems
        )
        for kind in result.reconcile_counts or {"nothing": 1}:
            outcomes[kind] = outcomes.get(kind, 0) + 1
    last = plan[ref.next_index]
    problems = save_once_more(root, ref, last, backend)
    assert not problems, f"CKPTDB_KILL_SEED={KILL_SEED} final save:\n" + "\n".join(problems)
    summary = (
        f"{kills} kills, {ref.acks} acknowledged boundaries, {ref.interrupted} killed in "
        f"flight ({ref.unacked_commits} of them committed, unacknowledged); "
        f"reconcile at reopen: {outcomes}"
    )
    print(summary)
    assert ref.acks > 0 and ref.interrupted > 0, summary


# ------------------------------------------------------- durability call order


def test_durability_calls_are_ordered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str | None
) -> None:
    """What a crash test cannot see without power loss: each file is fsynced before
    it is renamed into place, its directory is fsynced before the commit, and
    evicted files are unlinked only after the commit."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the file behind an fsynced descriptor")
    trace: list[tuple[str, ...]] = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, os.unlink

    def fsync(fd: int) -> None:
        trace.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        trace.append(("replace", str(src), str(dst)))
        real_replace(src, dst, **kwargs)

    def unlink(path: Any, **kwargs: Any) -> None:
        trace.append(("unlink", str(path)))
        real_unlink(path, **kwargs)

    streams = {"model": Keep(last=1), "ema": Keep(last=1), "best": TopK(1, "val_loss")}
    with CheckpointManager(tmp_path / "run", streams=streams, db_url=backend) as mgr:
        first = mgr.save(10, metrics={"val_loss": 0.5}, **{s: {"w": [1]} for s in streams})
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "unlink", unlink)
        previous = faults.set_hook(lambda name: trace.append(("point", name)))
        try:
            second = mgr.save(20, metrics={"val_loss": 0.1}, **{s: {"w": [2]} for s in streams})
        finally:
            faults.set_hook(previous)
            monkeypatch.undo()
    commit = trace.index(("point", "in_commit"))
    committed = trace.index(("point", "after_commit"))
    assert sorted(second) == sorted(streams), trace
    for stream, ckpt in second.items():
        final = str(ckpt.path)
        placed = [i for i, t in enumerate(trace) if t[0] == "replace" and t[2] == final]
        assert len(placed) == 1, (stream, trace)
        tmp = trace[placed[0]][1]
        synced = [i for i, t in enumerate(trace) if t == ("fsync", tmp)]
        assert synced and synced[0] < placed[0], f"{stream}: file not fsynced before rename"
        dir_synced = [
            i
            for i, t in enumerate(trace)
            if t == ("fsync", str(ckpt.path.parent)) and i > placed[0]
        ]
        assert dir_synced and dir_synced[0] < commit, f"{stream}: dir not fsynced before commit"
        evicted = str(first[stream].path)
        removed = [i for i, t in enumerate(trace) if t == ("unlink", evicted)]
        assert len(removed) == 1 and removed[0] > committed, f"{stream}: unlink before commit"
    assert not [t for t in trace[:committed] if t[0] == "unlink"], trace


# ------------------------------------------------- exceptions at the fault points


class Interrupt(KeyboardInterrupt):
    """Ctrl-C arriving at a fault point (a BaseException: no ``except Exception`` sees it)."""


def raise_error() -> None:
    raise OSError(errno.EIO, "injected I/O error")


def raise_interrupt() -> None:
    raise Interrupt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("die", [raise_error, raise_interrupt], ids=["OSError", "interrupt"])
@pytest.mark.parametrize(("backend", "n"), BACKEND_N, indirect=["backend"])
@pytest.mark.parametrize("point", faults.POINTS)
def test_exception_at_point_leaves_a_consistent_run(
    tmp_path: Path, point: str, n: int, die: Callable[[], None], backend: str | None
) -> None:
    """An error or an interrupt raised at a fault point (in-process, after a warm-up):
    before the commit point the boundary is rolled back at once (the run checks clean
    without a reconcile); after it, the boundary stands. Either way the run reopens
    consistent with every acknowledged save, and the next save succeeds."""
    context = (
        f"point={point} n={n} raising {die.__name__} ledger={ledger_name(backend)} "
        f"(in-process, warm-up {WARMUP})"
    )
    plan = sweep_schedule()
    ref = Reference(policies(), {b.index: b for b in plan})
    root = tmp_path / "run"
    arm_after = 0 if point == "mid_reconcile" else WARMUP
    setup = (
        spec(tmp_path, "setup", plan[:WARMUP], db_url=backend) if point == "mid_reconcile" else None
    )
    if setup is not None:  # publish the warm-up, then leave reconcile something to do
        run_child(setup)
        problems = absorb(ref, setup)
        plant_stray_temp(root / "checkpoints")
    else:
        problems = []
    child = spec(
        tmp_path,
        "child",
        plan[ref.next_index :],
        crash_point=point,
        crash_n=n,
        arm_after=arm_after,
        reconcile_every=2,
        db_url=backend,
    )
    cleanup_fails = point == "mid_cleanup" and die is raise_error  # reported, not raised
    warned = pytest.warns(CleanupWarning) if cleanup_fails else contextlib.nullcontext()
    try:
        with warned:
            code: int | str = run_child(child, die)
    except (PublishError, OSError, KeyboardInterrupt) as exc:
        code = repr(exc)
    problems += absorb(ref, child)
    raised = code != 0
    assert raised or point == "mid_cleanup", f"{context}: nothing raised"
    if point in BEFORE_COMMIT:
        assert ref.unacked_commits == 0, f"{context}: boundary committed although it failed"
        with CheckpointManager(root, streams=policies(), maintenance=True, db_url=backend) as mgr:
            left = mgr.check(load=True)
        assert left == [], f"{context}: rollback left (before any reconcile):\n" + "\n".join(left)
    elif point in ("after_commit", "mid_cleanup"):
        assert ref.unacked_commits == int(raised), f"{context}: committed boundary undone"
    assert_recovers(root, ref, context, problems, backend)
