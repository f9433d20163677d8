"""The scenarios explored: each runs boundaries for real under a recorder.

Every scenario publishes the crash tests' streams (``model`` keep-2, ``ema``
keep-1, ``best`` top-2 by ``val_loss``; ``tests/crashlib.py``) with payloads
tagged by their boundary, so the reference model can tell what must survive.
Saves made before the recording starts are the run's history (acknowledged,
and durable by assumption); the recorded ones are marked in the trace when
they begin and when they are acknowledged (``save`` returned; for an
asynchronous save, its handle's ``result()``).

``deep`` (``CKPTDB_POWERLOSS=deep``) records longer scenarios.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from crashlib import (
    EXTERNAL_DIR_STATE,
    STREAM_CODE,
    Boundary,
    ChildSpec,
    Reference,
    boundaries,
    ledger_rows,
    payload,
    plant_stray_temp,
    policies,
    run_forked,
)

from ckptdb import CheckpointManager, External, Sharded

from .explorer import Check, ReferenceCheck
from .recording import Recorder, Trace

Payloads = Callable[[Boundary], dict[str, Any]]


@dataclass(frozen=True)
class Recorded:
    name: str
    trace: Trace
    check: Check
    leftovers: list[str] = field(default_factory=list)  # in the store, once the run closed


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    record: Callable[[Path, bool], Recorded]  # (a fresh directory, deep)


def plain(b: Boundary) -> dict[str, Any]:
    return {s: payload(b, s) for s in STREAM_CODE}


def sharded(b: Boundary) -> dict[str, Any]:
    """``model`` as a DCP directory written in this process; the others as files."""
    return {**plain(b), "model": Sharded(payload(b, "model"))}


def external(b: Boundary) -> dict[str, Any]:
    """``model`` as a framework's file (Lightning style), ``ema`` as a framework's
    directory (Hugging Face style), each written by the framework's own code."""

    def write_file(path: Path) -> None:
        torch.save(payload(b, "model"), path)

    def write_dir(path: Path) -> None:
        (path / "meta").mkdir(parents=True)
        torch.save(payload(b, "ema"), path / EXTERNAL_DIR_STATE)
        (path / "meta" / "trainer_state.json").write_text(json.dumps({"step": b.step}))

    return {
        **plain(b),
        "model": External(write_file, name=f"lightning/step={b.step}.ckpt"),
        "ema": External(write_dir, name=f"hf/checkpoint-{b.step}"),
    }


class Run:
    """A scenario's schedule: history (saved unrecorded) then recorded boundaries."""

    def __init__(self, spec: list[tuple[int, float]], history: int, make: Payloads = plain):
        self.plan = list(boundaries(spec))
        self.history, self.make = history, make
        self.ref = Reference(policies(), {b.index: b for b in self.plan})

    @property
    def recorded(self) -> list[Boundary]:
        return self.plan[self.history :]

    def save_history(self, mgr: CheckpointManager) -> None:
        for b in self.plan[: self.history]:
            out = self._save(mgr, b)
            problems = self.ref.commit(b, {s: c.id for s, c in out.items()}, acked=True)
            assert not problems, problems

    def save_recorded(
        self, mgr: CheckpointManager, rec: Recorder, *, blocking: bool = True
    ) -> None:
        for b in self.recorded:
            rec.mark({"begin": b.index})
            out = self._save(mgr, b, blocking=blocking)
            rec.mark({"ack": b.index, "rows": {s: c.id for s, c in out.items()}})

    def _save(self, mgr: CheckpointManager, b: Boundary, *, blocking: bool = True) -> Any:
        out = mgr.save(b.step, metrics={"val_loss": b.val_loss}, blocking=blocking, **self.make(b))
        return out if blocking else out.result()


def _paths(tmp: Path) -> tuple[Path, Path]:
    world = tmp / "world"
    world.mkdir(parents=True)
    return world, world / "run"


def _recorded(name: str, tmp: Path, run: Run, *, blocking: bool = True) -> Recorded:
    """History saved, then the recorded boundaries on the same open run."""
    world, root = _paths(tmp)
    with CheckpointManager(root, streams=policies()) as mgr:
        run.save_history(mgr)
        with Recorder(world, root) as rec:
            run.save_recorded(mgr, rec, blocking=blocking)
    return Recorded(name, rec.trace(), ReferenceCheck(run.ref))


# ------------------------------------------------------------------ the scenarios


def new_run(tmp: Path, deep: bool) -> Recorded:
    """A run created inside the recording (root, ledger, stream directories) and its
    first boundaries: nothing is durable at the start but the empty world."""
    spec = [(10, 0.5)] + ([(20, 0.3), (30, 0.7), (40, 0.2)] if deep else [])
    run = Run(spec, history=0)
    world, root = _paths(tmp)
    with Recorder(world, root) as rec, CheckpointManager(root, streams=policies()) as mgr:
        run.save_recorded(mgr, rec)
    return Recorded("new_run", rec.trace(), ReferenceCheck(run.ref))


def made_root(tmp: Path, deep: bool) -> Recorded:
    """A run whose root the user (or a framework: the Trainer's ``os.makedirs``) made
    just before opening it, two levels deep, with nothing fsynced: the open must make
    every new entry above the root durable."""
    spec = [(10, 0.5)] + ([(20, 0.3)] if deep else [])
    run = Run(spec, history=0)
    world, _ = _paths(tmp)
    root = world / "user" / "made" / "run"
    with Recorder(world, root) as rec:
        os.makedirs(root)
        with CheckpointManager(root, streams=policies()) as mgr:
            run.save_recorded(mgr, rec)
    return Recorded("made_root", rec.trace(), ReferenceCheck(run.ref))


def history(tmp: Path, deep: bool) -> Recorded:
    """A boundary that evicts from every stream: both keep-last windows move, the
    top-2 admits the new one and drops its worst (deep: more, one rejected)."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7), (40, 0.2), (50, 0.1)]
    spec += [(60, 0.6), (70, 0.4), (80, 0.05)] if deep else []
    return _recorded("history", tmp, Run(spec, history=4))


def resave(tmp: Path, deep: bool) -> Recorded:
    """A step saved again: versioned names, the old ones evicted in the same commit
    (timeline rule), a top-K member replaced by its own step."""
    spec = [(10, 0.5), (20, 0.6), (30, 0.2), (30, 0.1)]
    spec += [(30, 0.05), (20, 0.3)] if deep else []
    return _recorded("resave", tmp, Run(spec, history=3))


def sharded_run(tmp: Path, deep: bool) -> Recorded:
    """``model`` as a DCP directory (one process): temp directory, DCP's own files and
    fsyncs, the seal, the placement of a directory, an evicted directory removed."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7)] + ([(40, 0.2)] if deep else [])
    return _recorded("sharded", tmp, Run(spec, history=2, make=sharded))


def async_run(tmp: Path, deep: bool) -> Recorded:
    """``save(blocking=False)``: intent and snapshot in the call, the rest on the
    background thread; acknowledged when the handle's result is in."""
    spec = [(10, 0.5), (20, 0.3)] + ([(30, 0.7), (40, 0.2), (50, 0.1)] if deep else [])
    return _recorded("async", tmp, Run(spec, history=1), blocking=False)


def external_run(tmp: Path, deep: bool) -> Recorded:
    """``ckptdb.External``: a framework writes a file and a directory under its own
    names (nothing fsynced by it); ckptdb seals, places and commits them."""
    spec = [(10, 0.5), (20, 0.3)] + ([(30, 0.7), (40, 0.2)] if deep else [])
    return _recorded("external", tmp, Run(spec, history=1, make=external))


def reconcile_run(tmp: Path, deep: bool) -> Recorded:
    """Reconcile cut short by the power: a run left by two crashes (rows left
    'deleting' mid-cleanup, rows 'pending' with their files placed), a stray
    temporary file, an unowned checkpoint and a writer's half-made owner record;
    the recording is the reopen that repairs it (and, deep, one more boundary)."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7), (40, 0.2), (50, 0.6), (60, 0.1)]
    world, root = _paths(tmp)
    run = Run(spec, history=0)
    _crash_child(tmp, "a", root, run, run.plan, crash_point="mid_cleanup", arm_after=2)
    rest = run.plan[run.ref.next_index :]
    _crash_child(tmp, "b", root, run, rest, crash_point="after_replace", maintenance=True)
    plant_stray_temp(root / "checkpoints", "ema")
    (root / "checkpoints" / "model" / "step-000999999.pt").write_bytes(b"no row owns me")
    (root / ".ckptdb.owner.999999").write_text('{"pid": 999999}')  # never renamed in
    run.history = run.ref.next_index
    run.plan = run.plan[: run.history + (1 if deep else 0)]
    with Recorder(world, root) as rec, CheckpointManager(root, streams=policies()) as mgr:
        run.save_recorded(mgr, rec)
    return Recorded("reconcile", rec.trace(), ReferenceCheck(run.ref))


def _crash_child(
    tmp: Path, name: str, root: Path, run: Run, plan: list[Boundary], **kwargs: Any
) -> None:
    child = ChildSpec(
        root=str(root),
        ack=str(tmp / f"{name}.ack"),
        log=str(tmp / f"{name}.log"),
        boundaries=plan,
        **kwargs,
    )
    code = run_forked(child)
    assert code != 0, f"child {name} did not crash:\n{Path(child.log).read_text()}"
    problems = run.ref.absorb(Path(child.ack), ledger_rows(root))
    assert not problems, problems


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("new_run", "model+ema+top-K on a new run (the open included)", new_run),
        Scenario("made_root", "a root made by the user, unsynced, then opened", made_root),
        Scenario("history", "model+ema+top-K on a run with history: evictions", history),
        Scenario("resave", "a re-save of the same step", resave),
        Scenario("sharded", "a sharded (DCP directory) boundary in one process", sharded_run),
        Scenario("async", "asynchronous boundaries (save(blocking=False))", async_run),
        Scenario("external", "External: a framework's file and directory, sealed", external_run),
        Scenario("reconcile", "a reconcile interrupted by power loss", reconcile_run),
    )
}
