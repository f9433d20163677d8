"""Scenarios of the library's other renames: aliases, and checkpoints adopted by a move.

``aliases``: the names other tools open (:meth:`CheckpointManager.derive_aliases`),
one of each kind: a directory checkpoint's tree of hard links, a file's hard
link, a symbolic link and a pointer file, re-pointed after each recorded
boundary, with a crash's half-made temporaries of the pointer and of the
tree left from before (the next re-point removes them). Before a crash
state is reopened (reopening re-points every alias), each alias must name a
whole checkpoint of its stream, never a torn or empty file, and once
``derive_aliases`` returned, never an older one than it named then; only a
directory alias may be missing, between the two renames of its swap.

``adopt``: ``adopt(move=True)`` of checkpoints written outside the save
directory, one at a time: the first moved in and committed; for the second
the directory fsync after its rename fails once, so the rename is undone;
the third moved in and committed. Each
candidate is written by "a framework" inside the recording, with no fsync:
an adopted one is committed and whole at its row's path (adopt fsyncs it
before the commit); the one whose adoption failed is back at its own name
(its bytes are its writer's to make durable).
"""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from crashlib import STREAM_CODE, integrity, ledger_rows, policies, read_sharded

from ckptdb import CheckpointManager, Keep
from ckptdb.errors import PhaseError
from ckptdb.protocol.adopt import ADOPTED, SKIPPED, Candidate
from ckptdb.storage import files

from .explorer import Check, ReferenceCheck
from .recording import Recorder
from .scenarios import Recorded, Run, Scenario, _paths, sharded

#: path (relative to the run root) -> (stream, kind); ``dir/model`` names a
#: directory checkpoint (``model`` is sharded in this scenario).
#: Each in a directory of its own, so that one alias's directory fsync never makes
#: another's rename durable (a missing fsync would go unseen).
ALIASES = {
    "dir/model": ("model", "link"),
    "link/ema.pt": ("ema", "link"),
    "symlink/ema": ("ema", "symlink"),
    "pointer/best.txt": ("best", "pointer"),
}
DIRECTORY_ALIAS = "dir/model"
#: A crash's leftovers of two alias swaps: the next re-point removes them.
LEFTOVERS = ("pointer/.best.txt.ckptdb-alias", "dir/.model.ckptdb-alias/")


def aliases_run(tmp: Path, deep: bool) -> Recorded:
    """Boundaries that improve every stream, each followed by a re-point of all aliases."""
    spec = [(10, 0.5), (20, 0.4)] + ([(30, 0.3), (40, 0.2), (50, 0.1)] if deep else [])
    run = Run(spec, history=1, make=sharded)
    world, root = _paths(tmp)
    with CheckpointManager(root, streams=policies()) as mgr:
        run.save_history(mgr)
        for rel in ALIASES:
            (root / rel).parent.mkdir()
        mgr.derive_aliases(ALIASES)
        for rel in LEFTOVERS:
            if rel.endswith("/"):
                (root / rel).mkdir()
                (root / rel / "half").write_bytes(b"a link tree never swapped in")
            else:
                (root / rel).write_text("../checkpoints/best/step-0000")
        with Recorder(world, root) as rec:
            for b in run.recorded:
                rec.mark({"begin": b.index})
                out = run._save(mgr, b)
                rec.mark({"ack": b.index, "rows": {s: c.id for s, c in out.items()}})
                mgr.derive_aliases(ALIASES)
                rec.mark({"aliased": b.index, "step": b.step})
    return Recorded("aliases", rec.trace(), AliasCheck(ReferenceCheck(run.ref)))


@dataclass
class AliasCheck:
    """The aliases as a crash left them (before the reopen), then ``inner``."""

    inner: Check

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        problems = alias_problems(root, records)
        return problems + self.inner(root, records, save_dir)


def alias_problems(root: Path, records: list[Mapping[str, Any]]) -> list[str]:
    if not root.is_dir():
        return []
    aliased = [r["step"] for r in records if "aliased" in r]
    floor = aliased[-1] if aliased else 0
    in_flight = bool(records) and "ack" in records[-1]  # a re-point begun, not returned
    paths = {r.path: r for r in ledger_rows(root)}
    problems = []
    for rel, (stream, kind) in ALIASES.items():
        alias = root / rel
        if not os.path.lexists(alias):
            if not (rel == DIRECTORY_ALIAS and in_flight):
                problems.append(f"alias {rel} is missing")
            continue
        try:
            step = _named_step(root, alias, kind, stream, paths)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            problems.append(f"alias {rel} does not name a whole checkpoint: {exc!r}")
            continue
        if step < floor:
            problems.append(f"alias {rel} names step {step}, older than step {floor} it named")
    return problems


def _named_step(root: Path, alias: Path, kind: str, stream: str, rows: Mapping[str, Any]) -> int:
    """The step of the checkpoint an alias names, checked whole where it is there."""
    if kind == "link":
        return _payload_step(alias, stream)
    text = os.readlink(alias) if kind == "symlink" else alias.read_text()
    if not text.strip():
        raise ValueError(f"an empty {kind}")
    target = Path(os.path.normpath(alias.parent / text))
    if target.exists():
        return _payload_step(target, stream)
    # a target evicted since: the alias is re-pointed at the next reopen; its name says
    rel = target.relative_to(root / "checkpoints").as_posix()
    if rel not in rows:
        raise ValueError(f"{text!r} names no checkpoint of the ledger")
    return int(rows[rel].step)


def _payload_step(path: Path, stream: str) -> int:
    state = read_sharded(path) if path.is_dir() else torch.load(path, weights_only=True)
    _, code, step = state["tag"].tolist()
    if code != STREAM_CODE[stream]:
        raise ValueError(f"a checkpoint of stream code {code}, not {stream}'s")
    return int(step)


# ------------------------------------------------------------------ adopt

ADOPTED_STREAM = "adopted"
STREAMS = {**policies(), ADOPTED_STREAM: Keep(last=None)}


def adopt_run(tmp: Path, deep: bool) -> Recorded:
    """adopt(move=True): one candidate moved in and committed, one whose move is undone,
    one more adopted after it (deep: two)."""
    run = Run([(10, 0.5)], history=1)
    world, root = _paths(tmp)
    incoming = world / "incoming"
    incoming.mkdir()
    steps = [100, 200, 300] + ([400] if deep else [])
    contents: dict[str, bytes] = {}
    with CheckpointManager(root, streams=STREAMS) as mgr:
        run.save_history(mgr)
        history = set(run.ref.acked)
        with Recorder(world, root) as rec:
            for step in steps:
                source = str(incoming / f"adopted-{step}.pt")
                rec.mark({"writing": source})  # a framework's writer: nothing fsynced
                tag = torch.tensor([9000 + step, STREAM_CODE["model"], step])
                torch.save({"tag": tag}, source)
                contents[source] = Path(source).read_bytes()
                failing = step == 200
                rec.mark({"adopting": source})
                candidate = Candidate(Path(source), "model", step)
                with _failing_fsync_dir(mgr.save_dir) if failing else contextlib.nullcontext():
                    (outcome,) = mgr.adopt([candidate], move=True)
                want = SKIPPED if failing else ADOPTED
                if outcome.status != want:
                    raise AssertionError(f"adopt of {source}: {outcome.status}, {outcome.detail}")
                if failing:
                    rec.mark({"kept_out": source})
                else:
                    assert outcome.checkpoint is not None
                    rec.mark({"adopted": source, "row": outcome.checkpoint.id})
    return Recorded("adopt", rec.trace(), AdoptCheck(history, contents))


@contextlib.contextmanager
def _failing_fsync_dir(save_dir: Path) -> Iterator[None]:
    """The first fsync of the save directory fails (EIO) while the block runs."""
    real = files.fsync_dir
    state = {"armed": True}

    def fsync_dir(directory: Path) -> None:
        if state["armed"] and Path(directory) == Path(save_dir):
            state["armed"] = False
            raise PhaseError("fsync_dir", directory, OSError(errno.EIO, "injected"))
        real(directory)

    files.fsync_dir = fsync_dir  # type: ignore[assignment]
    try:
        yield
    finally:
        files.fsync_dir = real  # type: ignore[assignment]


@dataclass
class AdoptCheck:
    """Reopen; the history still committed; each candidate's bytes where they belong."""

    history: set[int]
    contents: dict[str, bytes]

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        problems: list[str] = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # reconcile's repairs warn; the checks decide
                with CheckpointManager(root, streams=STREAMS) as mgr:
                    problems += [f"check: {p}" for p in mgr.check(load=True)]
                    where = mgr.save_dir
        except Exception as exc:  # the finding itself: the run does not reopen
            return [f"reopening the run raised {type(exc).__name__}: {exc}"]
        rows = {r.id: r for r in ledger_rows(root)}
        for ident in sorted(self.history):
            if ident not in rows or rows[ident].state != "committed":
                problems.append(f"acknowledged row {ident} of the history is not committed")
        adopted = {r["adopted"]: r["row"] for r in records if "adopted" in r}
        kept_out = {r["kept_out"] for r in records if "kept_out" in r}
        for source in [r["writing"] for r in records if "writing" in r]:
            data = self.contents[source]
            problems += _candidate_problems(where, rows, source, data, adopted, kept_out)
        status = integrity(root)
        return problems + ([] if status == "ok" else [f"PRAGMA integrity_check: {status}"])


def _candidate_problems(
    save_dir: Path,
    rows: Mapping[int, Any],
    source: str,
    data: bytes,
    adopted: Mapping[str, int],
    kept_out: set[str],
) -> list[str]:
    name = Path(source).name
    if source in adopted:
        row = rows.get(adopted[source])
        if row is None or row.state != "committed":
            return [f"adopted {name} (row {adopted[source]}) is not committed"]
        placed = save_dir / row.path
        if not placed.is_file() or placed.read_bytes() != data:
            return [f"adopted {name} is not whole at {row.path}"]
        return []
    if source in kept_out:  # its name back; its bytes are its writer's to make durable
        if not Path(source).is_file() or (save_dir / name).exists():
            return [f"{name}, whose adoption failed, is not back at {source}"]
        return []
    return []  # not adopted yet: nothing of it is ckptdb's


RENAME_SCENARIOS = {
    s.name: s
    for s in (
        Scenario("aliases", "aliases of each kind re-pointed after each boundary", aliases_run),
        Scenario("adopt", "adopt(move=True): moved in, a move undone, moved in", adopt_run),
    )
}
