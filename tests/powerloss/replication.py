"""The replicator's and restore's steps in the explorer: a local run copied to the real
S3-compatible server of the tests (SeaweedFS), and a run brought back from its copies.

The run saves on its local disk (the POSIX-minimal model, as the boundary
scenarios); its copies go to a prefix of the server (the object-store
model, :mod:`.objects`). The ledger records each copy by its whole URL, so
each crash state's objects are built under the recording's own prefix,
emptied first (``in_place``), and the state's ledger names them as it did.

Streams and payloads are the crash tests' (``model`` keep-2, just over one
5 MiB part from the recorded boundaries on, so its copy is a multipart
upload; ``ema`` keep-1; ``best`` top-2); ``model`` and ``ema`` are copied,
``best`` is local-only, and the remote tier keeps the last 2 copies of
``ema`` (``Replicator(keep=...)``).

What a crash state must satisfy, besides the boundary scenarios' checks
(:class:`ReplicationCheck`, :class:`RestoreCheck`):

- a copy the ledger calls ``replicated`` is in the store, every object of
  its manifest with the bytes it records, before anything is reopened;
- a local file evicted by retention is gone only if its checkpoint has a
  whole copy (or one the remote tier's retention removed);
- after the run is reopened and a new replicator has made one pass: no copy
  left ``uploading``, no upload in progress, no object that belongs to no
  whole copy, no checkpoint copied twice, every committed checkpoint of a
  copied stream copied once, and no local file still waiting for its copy;
- a run brought back from its copies (a new machine, a corrupt newest file)
  reopens with ``remote=`` on each stream's newest acknowledged checkpoint,
  holding its payload.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import s3lib
import xxhash
from crashlib import (
    HEALTHY_STATES,
    Boundary,
    Reference,
    integrity,
    ledger_rows,
    policies,
    sqlite_rows,
)
from helpers import flip_byte

from ckptdb import CheckpointManager, Keep, Replicator
from ckptdb.ledger.tiers import holder
from ckptdb.ledgercopy import KEEP_PER_EPOCH
from ckptdb.ledgercopy import PREFIX as LEDGER
from ckptdb.storage.remote import REMOTE
from ckptdb.storage.s3client import PROBE_DIR

from .explorer import in_flight_records
from .objects import ObjectRecorder, client, listing, split
from .recording import Recorder
from .s3scenarios import PART, payloads
from .scenarios import Recorded, Run, Scenario, _paths

#: The streams copied (``best`` stays local-only) and the remote tier's retention.
COPIED = ("model", "ema")
REMOTE_KEEP = {"ema": Keep(last=2)}
HOLD = holder(REMOTE)
REPLICAS_QUERY = (
    "SELECT r.id, r.checkpoint_id, r.state, r.location, r.manifest, c.stream, c.step "
    "FROM replicas r JOIN checkpoints c ON c.id = r.checkpoint_id"
)


@dataclass(frozen=True)
class Copy:
    id: int
    checkpoint_id: int
    state: str
    location: str
    manifest: str | None
    stream: str
    step: int


def replicator(root: Path, url: str) -> Replicator:
    return Replicator(
        root, url, storage_options={"part_size": PART}, streams=COPIED, keep=REMOTE_KEEP
    )


def copies(root: Path) -> list[Copy]:
    """Every replica row, read with plain SQL (no reconcile, no lock)."""
    return [Copy(*row) for row in sqlite_rows(root, REPLICAS_QUERY)]


def held(root: Path) -> set[int]:
    """The checkpoints whose local file a tier holds until their copy is whole."""
    sql = "SELECT checkpoint_id FROM pins WHERE holder = ? AND released_at IS NULL"
    return {ident for (ident,) in sqlite_rows(root, sql, HOLD)}


# ------------------------------------------------------------------ the store's side


def whole_copy_problems(url: str, found: list[Copy]) -> list[str]:
    """Each ``replicated`` copy's objects are in the store with the bytes its manifest
    records (never recorded as replicated unless it is)."""
    s3, (bucket, _) = client(), split(url)
    problems = []
    for c in found:
        if c.state != "replicated":
            continue
        for name, size, digest in json.loads(c.manifest or "{}").get("files", []):
            key = f"{split(c.location)[1]}/{name}"
            try:
                data = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception as exc:  # the finding itself: a copy recorded whole is not
                problems.append(f"replicated copy {c.id} of {c.stream} step {c.step}: {key}: {exc}")
                continue
            if (len(data), xxhash.xxh3_128_hexdigest(data)) != (size, digest):
                problems.append(
                    f"replicated copy {c.id} of {c.stream} step {c.step}: {key} holds "
                    f"{len(data)} bytes that are not the {size} its manifest records"
                )
    return problems


def store_leftovers(url: str, found: list[Copy]) -> list[str]:
    """After a replicator's pass: no upload in progress, and every object (but the
    conditional-write probe's) belongs to a whole copy."""
    keys, uploads = listing(client(), url)
    prefix = split(url)[1]
    whole = [
        split(c.location)[1][len(prefix) + 1 :] + "/" for c in found if c.state == "replicated"
    ]
    problems = [f"multipart upload of {rel} left in progress" for rel in sorted(uploads.values())]
    problems += ledger_copy_problems(url, [k for k in keys if k.startswith(f"{LEDGER}/")])
    for rel in keys:
        if rel.startswith((f"{PROBE_DIR}/", f"{LEDGER}/")):
            continue
        if not any(rel.startswith(w) for w in whole):
            problems.append(f"object {rel} belongs to no whole copy")
    return problems


def ledger_copy_problems(url: str, keys: list[str]) -> list[str]:
    """The copies of the run's SQLite ledger (:mod:`ckptdb.ledgercopy`), after a pass:
    at least one; each manifest's snapshot there with the bytes it records; no more
    snapshots per epoch than the copier keeps (a snapshot whose manifest a power cut
    prevented is removed in time, never left for good)."""
    if not keys:
        return ["no copy of the ledger after a pass"]
    bucket, prefix = split(url)
    s3, problems = client(), []
    epochs: dict[str, list[str]] = {}
    for rel in keys:
        epochs.setdefault(rel.rsplit("/", 1)[0], []).append(rel)
    for folder, found in sorted(epochs.items()):
        snapshots = [k for k in found if k.endswith(".sqlite")]
        if len(snapshots) > KEEP_PER_EPOCH:
            problems.append(
                f"{folder}: {len(snapshots)} snapshots left, more than {KEEP_PER_EPOCH}"
            )
        for rel in (k for k in found if k.endswith(".json") and not k.endswith("claim.json")):
            manifest = json.loads(
                s3.get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read()
            )
            snapshot = rel.removesuffix(".json") + ".sqlite"
            try:
                data = s3.get_object(Bucket=bucket, Key=f"{prefix}/{snapshot}")["Body"].read()
            except Exception as exc:  # the finding itself: a manifest without its snapshot
                problems.append(f"ledger copy {snapshot}: {exc}")
                continue
            if (len(data), xxhash.xxh3_128_hexdigest(data)) != (manifest["size"], manifest["hash"]):
                problems.append(f"ledger copy {snapshot} is not the bytes its manifest records")
    return problems


def copy_problems(found: list[Copy], rows: list[Any]) -> list[str]:
    """After a replicator's pass: nothing left uploading, no checkpoint copied twice,
    every committed checkpoint of a copied stream copied."""
    problems = [
        f"copy {c.id} of {c.stream} step {c.step} left uploading"
        for c in found
        if c.state == "uploading"
    ]
    whole: dict[int, list[int]] = {}
    for c in found:
        if c.state == "replicated":
            whole.setdefault(c.checkpoint_id, []).append(c.id)
    problems += [
        f"checkpoint {i} copied twice: copies {ids}" for i, ids in whole.items() if len(ids) > 1
    ]
    for row in rows:
        if row.stream in COPIED and row.state == "committed" and row.id not in whole:
            problems.append(f"committed {row.stream} step {row.step} (row {row.id}) has no copy")
    return problems


def gone_from_both(root: Path, rows: list[Any], found: list[Copy]) -> list[str]:
    """A checkpoint of a copied stream whose local file retention removed has a whole
    copy, or one the remote tier's retention removed: the local file is never removed
    before its copy is safe."""
    kept = {c.checkpoint_id for c in found if c.state in ("replicated", "deleting", "deleted")}
    save_dir = root / "checkpoints"
    return [
        f"evicted {row.stream} step {row.step} (row {row.id}, {row.state}) is gone locally "
        "and has no whole copy"
        for row in rows
        if row.stream in COPIED
        and row.state in ("deleting", "deleted")
        and not (save_dir / row.path).exists()
        and row.id not in kept
    ]


# ------------------------------------------------------------------ the checks


@dataclass
class ReplicationCheck:
    """A crash state of a replicated run (see the module docstring)."""

    base: Reference
    url: str

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        assert save_dir == self.url, "a replicated run's states are built in place"
        rows, found = ledger_rows(root), copies(root)
        problems = whole_copy_problems(self.url, found) + gone_from_both(root, rows, found)
        ref = copy.deepcopy(self.base)
        problems += ref.absorb_records(in_flight_records(records), rows)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # reconcile's repairs warn; the checks decide
                problems += _reopened(root, ref, waiting=held(root))
                with replicator(root, self.url) as again:
                    again.replicate()
                found = copies(root)
                problems += [f"after a pass: {p}" for p in copy_problems(found, ledger_rows(root))]
                problems += [f"after a pass: {p}" for p in store_leftovers(self.url, found)]
                problems += [f"after a pass: {p}" for p in whole_copy_problems(self.url, found)]
                problems += [f"after a pass, reopened: {p}" for p in _reopened(root, ref, set())]
        except Exception as exc:  # the finding itself: the run or its replicator does not open
            problems.append(f"reopening raised {type(exc).__name__}: {exc}")
        status = integrity(root)
        return problems + ([] if status == "ok" else [f"PRAGMA integrity_check: {status}"])


def _reopened(root: Path, ref: Reference, waiting: set[int]) -> list[str]:
    """The writer reopened: the boundary scenarios' checks, where a row ``deleting`` is
    right only while its tier holds it (``waiting``) for its copy."""
    with CheckpointManager(root, streams=policies()) as mgr:
        problems = [f"check: {p}" for p in mgr.check(load=True)]
        rows = ledger_rows(root)
        problems += ref.compare(rows)
        problems += ref.check_contents(mgr.save_dir, rows)
    odd = sorted(
        f"{r.stream} step {r.step} (row {r.id}) {r.state}"
        for r in rows
        if r.state not in HEALTHY_STATES and not (r.state == "deleting" and r.id in waiting)
    )
    return problems + ([f"rows left after reconcile: {odd}"] if odd else [])


@dataclass
class RestoreCheck:
    """A crash state of a run brought back from its copies: reopened with ``remote=`` and
    each stream's latest loaded (as a resume does: a bad file falls back to its copy),
    each stream's latest is its newest acknowledged (or committed in flight)
    checkpoint that had a copy or was saved after the loss, and holds its payload."""

    base: Reference
    url: str
    lost: set[int]  # the rows whose local copy went with the disk and have no copy

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        assert save_dir == self.url, "a replicated run's states are built in place"
        ref = copy.deepcopy(self.base)
        problems = ref.absorb_records(in_flight_records(records), ledger_rows(root))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with CheckpointManager(root, streams=policies(), remote=self.url) as mgr:
                    for stream in ref.live:  # as a resume does: a bad file falls back to its copy
                        if mgr.latest(stream) is not None:
                            mgr.load(stream=stream)
                    problems += [f"check: {p}" for p in mgr.check(load=True)]
                    rows = ledger_rows(root)
                    problems += self._latest(mgr, ref)
                    if not self.lost:  # a corrupt file brought back: nothing may be missing
                        problems += ref.compare(rows)
                    problems += ref.check_contents(mgr.save_dir, rows)
        except Exception as exc:  # the finding itself: the run does not reopen
            return [*problems, f"reopening raised {type(exc).__name__}: {exc}"]
        waiting = held(root)  # evicted since, waiting for a copy: the run is still replicated
        odd = sorted(
            f"{r.stream} step {r.step} (row {r.id}) {r.state}"
            for r in rows
            if r.state not in HEALTHY_STATES
            and not (r.state == "lost" and r.id in self.lost)
            and not (r.state == "deleting" and r.id in waiting)
        )
        status = integrity(root)
        return (
            problems
            + ([f"rows left after reconcile: {odd}"] if odd else [])
            + ([] if status == "ok" else [f"PRAGMA integrity_check: {status}"])
        )

    def _latest(self, mgr: CheckpointManager, ref: Reference) -> list[str]:
        problems = []
        for stream, live in ref.live.items():
            reachable = [e for e in live if e.id not in self.lost]
            want = max(reachable, key=lambda e: (e.step, e.id)).id if reachable else None
            got = mgr.latest(stream)
            if (got.id if got is not None else None) != want:
                problems.append(
                    f"latest {stream} is {got.id if got else None} "
                    f"({got.step if got else '-'}), expected row {want}"
                )
        return problems


# ------------------------------------------------------------------ recording


def _save_acked(run: Run, mgr: CheckpointManager, b: Boundary) -> None:
    """One boundary of the history: saved, and acknowledged in the reference."""
    out = run._save(mgr, b)
    problems = run.ref.commit(b, {s: c.id for s, c in out.items()}, acked=True)
    assert not problems, problems


def _save_marked(run: Run, mgr: CheckpointManager, rec: Recorder, b: Boundary) -> None:
    rec.mark({"begin": b.index})
    out = run._save(mgr, b)
    rec.mark({"ack": b.index, "rows": {s: c.id for s, c in out.items()}})


Step = Callable[[Recorder], None]


def _replicated(
    name: str, tmp: Path, spec: list[tuple[int, float]], history: int, plan: str
) -> Recorded:
    """History saved (a pass after its first boundary: the rest uncopied), then ``plan``
    recorded: ``b`` a boundary, ``p`` a replicator pass; the replicator and the writer
    closed inside the recording (the close removes the files whose copy came)."""
    url = s3lib.unique_prefix()
    world, root = _paths(tmp)
    run = Run(spec, history, payloads(history))
    boundaries = iter(run.recorded)
    with contextlib.ExitStack() as opened:
        mgr = opened.enter_context(CheckpointManager(root, streams=policies()))
        rep = opened.enter_context(replicator(root, url))
        for i, b in enumerate(run.plan[:history]):
            _save_acked(run, mgr, b)
            if i == 0:
                rep.replicate()
        with Recorder(world, root, ObjectRecorder(url, in_place=True)) as rec:
            for step in plan:
                if step == "b":
                    _save_marked(run, mgr, rec, next(boundaries))
                else:
                    rep.replicate()
            opened.close()
    return Recorded(name, rec.trace(), ReplicationCheck(run.ref, url))


def _restored(name: str, tmp: Path, deep: bool, *, lose_disk: bool) -> Recorded:
    """History saved and copied, then the loss (the whole save directory, or the newest
    ``model`` file corrupted in place), then recorded: the open with ``remote=`` (and,
    for the corrupt file, the load that falls back to the copy) and one boundary."""
    url = s3lib.unique_prefix()
    world, root = _paths(tmp)
    spec = [(10, 0.5), (20, 0.3), (30, 0.7), (40, 0.2)] + ([(50, 0.1)] if deep else [])
    run = Run(spec, 3, payloads(3))
    with CheckpointManager(root, streams=policies()) as mgr, replicator(root, url) as rep:
        for b in run.plan[:3]:
            _save_acked(run, mgr, b)
        rep.replicate()
    rows = ledger_rows(root)
    lost: set[int] = set()
    if lose_disk:
        shutil.rmtree(root / "checkpoints")  # the machine is gone; the ledger stays
        lost = {r.id for r in rows if r.state == "committed" and r.stream not in COPIED}
        lost |= _not_newest(rows)
    else:
        newest = max(
            (r for r in rows if r.stream == "model" and r.state == "committed"), key=lambda r: r.id
        )
        flip_byte(root / "checkpoints" / newest.path)
    recorder = Recorder(world, root, ObjectRecorder(url, in_place=True))
    with recorder as rec, CheckpointManager(root, streams=policies(), remote=url) as mgr:
        if not lose_disk:
            mgr.load(stream="model")  # the corrupt newest: its copy brought back
        for b in run.recorded:
            _save_marked(run, mgr, rec, b)
    return Recorded(name, rec.trace(), RestoreCheck(run.ref, url, lost))


def _not_newest(rows: list[Any]) -> set[int]:
    """The committed rows of the copied streams that are not their stream's newest: a new
    machine brings back only the newest copy of each."""
    newest: dict[str, int] = {}
    for r in rows:
        if r.stream in COPIED and r.state == "committed":
            newest[r.stream] = max(newest.get(r.stream, 0), r.id)
    return {
        r.id
        for r in rows
        if r.stream in COPIED and r.state == "committed" and r.id != newest[r.stream]
    }


# ------------------------------------------------------------------ the scenarios


def replicate(tmp: Path, deep: bool) -> Recorded:
    """A boundary that evicts a checkpoint not yet copied (its file held), then a pass:
    the held one copied and released, a multipart copy, the remote tier's retention
    removing a copy (one DeleteObjects), and the writer's close removing the released
    file (deep: two more boundaries and a pass)."""
    spec = [(10, 0.5), (20, 0.3), (30, 0.7)] + ([(40, 0.2), (50, 0.1)] if deep else [])
    return _replicated("replicate", tmp, spec, 2, "bp" + ("bbp" if deep else ""))


def restore_new_machine(tmp: Path, deep: bool) -> Recorded:
    """The save directory gone (a new machine, the ledger kept): the open with ``remote=``
    brings back each copied stream's newest checkpoint, makes the missing directories,
    marks the rest lost; then a boundary (deep: two)."""
    return _restored("restore_new_machine", tmp, deep, lose_disk=True)


def restore_corrupt(tmp: Path, deep: bool) -> Recorded:
    """The newest ``model`` file corrupted in place (its size unchanged): the load marks
    it corrupt, quarantines it, brings back its copy and commits the row again."""
    return _restored("restore_corrupt", tmp, deep, lose_disk=False)


REPLICATION_SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "replicate", "a replicator's pass: copies, a held file, remote retention", replicate
        ),
        Scenario(
            "restore_new_machine", "a new machine restored from its copies", restore_new_machine
        ),
        Scenario(
            "restore_corrupt", "a corrupt newest file restored from its copy", restore_corrupt
        ),
    )
}
