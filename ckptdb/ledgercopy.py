"""The ledger's own replica: a SQLite ledger copied beside its checkpoints' copies.

A run on the default SQLite ledger survives losing its machine only if its
ledger does: the checkpoints' copies alone are loose files (no latest, no
best, no retention state, no history). So the :class:`~ckptdb.replication.Replicator`
also copies the ledger file to the remote tier, off the training loop, and a
new machine brings it back from the URL alone (:func:`fetch_ledger`, used by
``ckptdb restore URL DIR`` and by an open with ``remote=`` on a directory
without a ledger).

Each copy is a consistent snapshot made by SQLite itself (``VACUUM INTO``: never
a byte copy of a live WAL database), hashed, and uploaded under a key no other
copy uses::

    <prefix>/.ckptdb-ledger/<run token>/e<epoch>/<seq>.sqlite   the snapshot
    <prefix>/.ckptdb-ledger/<run token>/e<epoch>/<seq>.json     its manifest
    <prefix>/.ckptdb-ledger/<run token>/e<epoch>/claim.json     the restore that opened the epoch

A snapshot counts once its manifest (written after it, with its size and hash)
is there. Every object is written with ``If-None-Match: *``, so nothing is
ever overwritten. The epoch is what keeps a replica from going back in time: a
machine that restores the run claims the next epoch (a conditional write, so two
restores cannot claim the same one) and copies its ledger there; a restore
takes the newest snapshot of the highest epoch that has one. A replicator left
running on the old machine (a zombie) keeps writing its own, older epoch, which
no restore prefers; once it sees a newer epoch it stops copying the ledger.

Why snapshots and not Litestream: see docs/replication.md ("The ledger's own
copy"); the measured cost of a copy is in docs/performance.md ("Copying the
ledger").
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from .errors import (
    CorruptLedgerReplicaError,
    InvalidArgumentError,
    LedgerReplicaNotFoundError,
    ObjectStoreError,
    PhaseError,
    RunDirectoryError,
    RunTakenOverError,
    note_on,
)
from .ledger import rows as ledger_rows
from .storage.files import FileInfo, fsync_dir, hash_file, remove, rename_durably

log = logging.getLogger(__name__)

#: The folder, under a remote tier's prefix, that holds the ledgers' replicas.
PREFIX = ".ckptdb-ledger"
#: The file, in the run's root, that says which epoch this machine copies to and its last copy.
STATE_NAME = "ckptdb.ledger-copy.json"
#: Seconds between two copies of a ledger that keeps changing (metrics logged between
#: checkpoints); a pass that copied or removed a checkpoint copies the ledger at once.
DEFAULT_INTERVAL = 60.0
#: Snapshots kept per epoch: the newest, and earlier ones a damaged newest falls back to.
KEEP_PER_EPOCH = 3
#: Claims tried, one epoch after another, when restores race for the next epoch.
CLAIM_TRIES = 8
FORMAT = 1

_KEY = re.compile(
    r"(?P<token>[0-9a-f]+)/e(?P<epoch>[0-9]{6})/(?P<name>[0-9]{12}\.(sqlite|json)|claim\.json)"
)


def _rel(token: str, epoch: int, name: str) -> str:
    return f"{PREFIX}/{token}/e{epoch:06d}/{name}"


def _snapshot_names(seq: int) -> tuple[str, str]:
    return f"{seq:012d}.sqlite", f"{seq:012d}.json"


# ---------------------------------------------------------------------- what the bucket holds


@dataclass
class _Epoch:
    seqs: set[int] = field(default_factory=set)  # snapshots with a manifest
    orphans: set[int] = field(default_factory=set)  # a snapshot whose manifest never came
    claimed: bool = False


def _listing(remote: Any, token: str | None = None) -> dict[str, dict[int, _Epoch]]:
    """Every run token's epochs under ``remote``'s ledger folder (``token``: that run's
    only, one listing of its own folder)."""
    found: dict[str, dict[int, _Epoch]] = {}
    for rel in remote.list_under(PREFIX if token is None else f"{PREFIX}/{token}"):
        match = _KEY.fullmatch(rel[len(PREFIX) + 1 :])
        if match is None:
            continue
        epoch = found.setdefault(match["token"], {}).setdefault(int(match["epoch"]), _Epoch())
        name = match["name"]
        if name == "claim.json":
            epoch.claimed = True
        elif name.endswith(".json"):
            epoch.seqs.add(int(name[:12]))
        else:
            epoch.orphans.add(int(name[:12]))
    for epochs in found.values():
        for epoch in epochs.values():
            epoch.orphans -= epoch.seqs
    return found


def _read_json(remote: Any, rel: str) -> dict[str, Any]:
    chunks: list[bytes] = []
    remote.download(rel, chunks.append)
    value = json.loads(b"".join(chunks))
    if not isinstance(value, dict):
        raise ValueError(f"{rel} is not a JSON object")
    return value


def _write_bytes(remote: Any, rel: str, data: bytes) -> FileInfo:
    info: FileInfo = remote.write_object(rel, lambda writer: writer.write(data))
    return info


# ---------------------------------------------------------------------- the local state


def read_state(root: Path) -> dict[str, Any] | None:
    """What this machine knows of its ledger's copies (None: never copied nor restored).

    A file that is there and cannot be read is :class:`RunDirectoryError`: guessing
    epoch 1 would send a restored machine's copies where no restore looks."""
    path = root / STATE_NAME
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunDirectoryError(
            f"{path} is unreadable ({exc}): it says which epoch this machine copies the "
            "ledger to. If this machine never restored the run, remove it (copies go to "
            "epoch 1); else restore the run again"
        ) from exc
    if not isinstance(value, dict):
        raise RunDirectoryError(f"{path} is not a JSON object")
    return value


def update_state(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Read, ``change`` and write the state file whole under its lock (the writer's open
    and the replicator both update it): written aside under a name of this process's
    own, fsynced, renamed over, so the epoch survives a power cut."""
    with FileLock(str(root / f".{STATE_NAME}.lock"), timeout=30):
        state = read_state(root) or {}
        change(state)
        tmp = root / f".{STATE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            rename_durably(tmp, root / STATE_NAME)
        except BaseException:
            remove(tmp)
            raise


def _fingerprint(db_path: Path) -> list[int]:
    """What changes whenever the ledger does (the file's and its WAL's size and mtime):
    cheap enough for every pass; a false "changed" only costs one copy."""
    found = []
    for path in (db_path, db_path.with_name(db_path.name + "-wal")):
        try:
            st = path.stat()
        except FileNotFoundError:
            found += [-1, -1]
            continue
        found += [st.st_size, st.st_mtime_ns]
    return found


def snapshot(db_path: Path, into: Path) -> FileInfo:
    """A consistent copy of the ledger at ``db_path`` in ``into``, made by SQLite itself
    inside one read transaction (``VACUUM INTO``: never a byte copy of a live WAL
    database). The copy is one compact file in rollback-journal mode, so it needs no
    ``-wal`` or ``-shm`` beside it."""
    source = sqlite3.connect(db_path, timeout=30)  # not query_only: that refuses VACUUM INTO
    try:
        source.execute("VACUUM INTO ?", (str(into),))
    finally:
        source.close()
    return hash_file(into)  # a scratch file: what is uploaded is what was hashed, no fsync


# ---------------------------------------------------------------------- copying


@dataclass(frozen=True)
class LedgerCopy:
    """One copy of the ledger in the bucket."""

    epoch: int
    seq: int
    location: str
    size: int
    hash: str
    copied_at: str


class LedgerCopier:
    """Copies the SQLite ledger at ``db_path`` of the run whose objects carry ``token``
    to ``remote``, when it changed: the replicator's second duty (one per run at a
    time, under its lock)."""

    def __init__(
        self,
        remote: Any,
        root: Path,
        db_path: Path,
        *,
        token: str,
        run_name: str,
        interval: float = DEFAULT_INTERVAL,
    ) -> None:
        self._remote, self._root, self._db_path = remote, root, db_path
        self._token, self._run_name, self._interval = token, run_name, interval
        state = read_state(root) or {}
        self.epoch = int(state.get("epoch", 1))
        # a copy a killed replicator left half uploaded (one replicator per run at a time)
        self.aborted = remote.abort_uploads_under(_rel(token, self.epoch, "")[:-1])
        epochs = _listing(remote, token).get(token, {})
        mine = epochs.get(self.epoch, _Epoch())
        self._seq = max(mine.seqs | mine.orphans, default=0)
        last = state.get("last_copy") or {}
        self._last_fingerprint = (
            last.get("fingerprint") if last.get("epoch") == self.epoch else None
        )
        self._last_at = -float("inf")
        self.superseded = False
        newer = [e for e in epochs if e > self.epoch]
        if newer:
            self._supersede(max(newer))

    @property
    def location(self) -> str:
        return str(self._remote.url_of(f"{PREFIX}/{self._token}"))

    def copy(self, *, force: bool = False) -> LedgerCopy | None:
        """Copy the ledger if it changed since the last copy (``force``: whatever the
        interval); the copy made, or None."""
        if self.superseded:
            return None
        fingerprint = _fingerprint(self._db_path)
        if fingerprint == self._last_fingerprint:
            return None
        if not force and time.monotonic() - self._last_at < self._interval:
            return None
        done = self._copy_now()
        self._last_fingerprint, self._last_at = fingerprint, time.monotonic()
        last = {**done.__dict__, "fingerprint": fingerprint}
        update_state(self._root, lambda state: state.update(epoch=self.epoch, last_copy=last))
        return done

    def _copy_now(self) -> LedgerCopy:
        """Snapshot, upload, manifest; then the epoch's snapshots beyond the newest few go
        (and a newer epoch found then stops the copies that would follow)."""
        seq = self._seq = self._seq + 1  # taken, whatever happens next: a key is written once
        db_name, manifest_name = _snapshot_names(seq)
        # in the temporary directory, not the run's: a scratch file nobody ever reads
        # back, so nothing in the run's own tree changes but the state file
        with tempfile.TemporaryDirectory(prefix="ckptdb-ledger-") as scratch:
            tmp = Path(scratch) / db_name
            local = snapshot(self._db_path, tmp)
            sent = self._upload(_rel(self._token, self.epoch, db_name), tmp)
        if sent != local:
            raise CorruptLedgerReplicaError(
                f"the ledger copy sent ({sent.size} bytes, {sent.hash}) is not the snapshot "
                f"made ({local.size} bytes, {local.hash})"
            )
        copied_at = dt.datetime.now(dt.timezone.utc).isoformat()
        manifest = {
            "format": FORMAT,
            "run": self._run_name,
            "token": self._token,
            "epoch": self.epoch,
            "seq": seq,
            "size": local.size,
            "hash": local.hash,
            "copied_at": copied_at,
        }
        rel = _rel(self._token, self.epoch, manifest_name)
        _write_bytes(self._remote, rel, json.dumps(manifest, sort_keys=True).encode())
        self._prune(seq)
        location = str(self._remote.url_of(_rel(self._token, self.epoch, db_name)))
        return LedgerCopy(self.epoch, seq, location, local.size, local.hash, copied_at)

    def _upload(self, rel: str, path: Path) -> FileInfo:
        def copy(writer: Any) -> None:
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    writer.write(chunk)

        info: FileInfo = self._remote.write_object(rel, copy)
        return info

    def _prune(self, newest: int) -> None:
        """Remove this epoch's snapshots older than the newest :data:`KEEP_PER_EPOCH`
        (their manifest first, so a restore never picks a half-removed one; a snapshot
        whose manifest never came, or whose upload landed after it failed, goes too).
        The same listing says whether another machine took the run over."""
        epochs = _listing(self._remote, self._token).get(self._token, {})
        newer = [e for e in epochs if e > self.epoch]
        if newer:
            self._supersede(max(newer))
        mine = epochs.get(self.epoch, _Epoch())
        for seq in sorted(mine.seqs | mine.orphans):
            if seq > newest - KEEP_PER_EPOCH:
                break
            db_name, manifest_name = _snapshot_names(seq)
            for name in (manifest_name, db_name):
                self._remote.remove(_rel(self._token, self.epoch, name))

    def check_still_ours(self, *, look: bool = True) -> None:
        """:class:`RunTakenOverError` if a restore on another machine claimed a newer
        epoch: as last seen, or (``look``) after one listing of the run's folder, which
        the replicator asks for before it removes anything."""
        if look and not self.superseded:
            epochs = _listing(self._remote, self._token).get(self._token, {})
            newer = [e for e in epochs if e > self.epoch]
            if newer:
                self._supersede(max(newer))
        if self.superseded:
            raise RunTakenOverError(
                f"the run {self._run_name} was restored on another machine (its ledger "
                f"copies go to a newer epoch under {self.location}): this machine's "
                "replicator stops, so that nothing it copies or removes touches the new "
                "machine's copies"
            )

    def _supersede(self, epoch: int) -> None:
        self.superseded = True
        log.warning(
            "ckptdb: the run %s was restored on another machine (its ledger copies now go to "
            "epoch %d under %s; this machine's go to epoch %d): this machine's ledger is no "
            "longer copied",
            self._run_name,
            epoch,
            self.location,
            self.epoch,
        )


# ---------------------------------------------------------------------- restoring


@dataclass(frozen=True)
class FetchedLedger:
    """The ledger a restore brought back, and where from."""

    run: str
    token: str
    epoch: int  # the snapshot's
    seq: int
    location: str
    copied_at: str
    claimed_epoch: int  # the epoch this machine copies to from now on
    #: snapshots newer than the one restored, found damaged (each with why)
    damaged: tuple[str, ...] = ()


def replicated_runs(remote: Any) -> dict[str, str]:
    """Each run token with a ledger replica under ``remote`` and the run's name."""
    names = {}
    for token, epochs in _listing(remote).items():
        newest = max(((e, s) for e, epoch in epochs.items() for s in epoch.seqs), default=None)
        if newest is None:
            continue
        try:
            manifest = _read_json(remote, _rel(token, newest[0], _snapshot_names(newest[1])[1]))
            names[token] = str(manifest["run"])
        except (ObjectStoreError, ValueError, KeyError) as exc:
            log.warning("ckptdb: the ledger manifest of %s is unreadable: %s", token, exc)
            names[token] = "?"
    return names


def choose_run(remote: Any, run: str | None) -> str | None:
    """The token of the run to restore: the one named ``run``, or the only one there.

    None when nothing there is of ``run``; several runs and no ``run``, or several of
    that name, are refused (which one is the user's to say)."""
    runs = replicated_runs(remote)
    if run is not None:  # a name, or the token that tells runs of one name apart
        runs = {t: n for t, n in runs.items() if run in (n, t)}
    if len(runs) > 1:
        shown = ", ".join(f"{n} ({t})" for t, n in sorted(runs.items(), key=lambda i: i[1]))
        named = f" named {run}" if run else ""
        how = "(run=NAME, --run NAME)" if run is None else "by its token (--run TOKEN)"
        raise InvalidArgumentError(
            f"{remote.url_of(PREFIX)} holds the ledgers of several runs{named}: {shown}; "
            f"name the one to restore {how}"
        )
    return next(iter(runs), None)


def replica_for(remote_url: str, options: Mapping[str, object] | None, root: Path) -> str | None:
    """The token of the run whose ledger an open of ``root`` with ``remote=`` would bring
    back (None: none); for a framework that must look before it opens."""
    from .storage.remote import remote_store

    return choose_run(remote_store(remote_url, options, probe=False), root.name)


def fetch_ledger(remote: Any, token: str, into: Path, *, claim: bool = True) -> FetchedLedger:
    """The newest sound snapshot of the run ``token`` downloaded to ``into`` (verified
    against its manifest, then by SQLite's integrity check), and the next epoch claimed
    for this machine (``claim``; without it, a look that takes nothing over: its
    ``claimed_epoch`` is 0). A damaged newer snapshot is skipped with a warning; none
    sound raises :class:`CorruptLedgerReplicaError`, and ``into`` is removed."""
    epochs = _listing(remote, token).get(token, {})
    candidates = sorted(((e, s) for e, epoch in epochs.items() for s in epoch.seqs), reverse=True)
    if not candidates:
        raise LedgerReplicaNotFoundError(f"no ledger replica under {remote.url_of(PREFIX)}/{token}")
    damaged: list[str] = []
    for epoch, seq in candidates:
        try:
            manifest = _fetch_one(remote, token, epoch, seq, into)
        except ObjectStoreError as exc:  # gone since the listing (pruned): else not damage
            remove(into)
            if _still_there(remote, token, epoch, seq):
                raise  # a timeout, a refusal: never a reason to take an older ledger
            damaged.append(f"{remote.url_of(_rel(token, epoch, str(seq)))}: gone ({exc})")
            continue
        except (CorruptLedgerReplicaError, ValueError, KeyError) as exc:
            where = remote.url_of(_rel(token, epoch, _snapshot_names(seq)[0]))
            damaged.append(f"{where}: {exc}")
            log.warning(
                "ckptdb: the ledger copy %s is damaged (%s); trying an earlier one", where, exc
            )
            remove(into)
            continue
        claimed = _claim(remote, token, max(epochs) + 1) if claim else 0
        return FetchedLedger(
            run=str(manifest["run"]),
            token=token,
            epoch=epoch,
            seq=seq,
            location=str(remote.url_of(_rel(token, epoch, _snapshot_names(seq)[0]))),
            copied_at=str(manifest["copied_at"]),
            claimed_epoch=claimed,
            damaged=tuple(damaged),
        )
    error = CorruptLedgerReplicaError(
        f"every ledger copy under {remote.url_of(PREFIX)}/{token} is damaged; nothing restored"
    )
    for line in damaged:
        note_on(error, line)
    raise error


def _still_there(remote: Any, token: str, epoch: int, seq: int) -> bool:
    return all(remote.exists(_rel(token, epoch, name)) for name in _snapshot_names(seq))


def _fetch_one(remote: Any, token: str, epoch: int, seq: int, into: Path) -> dict[str, Any]:
    db_name, manifest_name = _snapshot_names(seq)
    manifest = _read_json(remote, _rel(token, epoch, manifest_name))
    if manifest.get("token") != token or manifest.get("format") != FORMAT:
        raise CorruptLedgerReplicaError(f"its manifest is not of this run's format {FORMAT} copies")
    with open(into, "wb") as f:
        got = remote.download(_rel(token, epoch, db_name), f.write)
        f.flush()
        os.fsync(f.fileno())
    if (got.size, got.hash) != (manifest["size"], manifest["hash"]):
        raise CorruptLedgerReplicaError(
            f"read {got.size} bytes hashing to {got.hash}; its manifest says "
            f"{manifest['size']} bytes, {manifest['hash']}"
        )
    problems = _integrity(into)
    if problems:
        raise CorruptLedgerReplicaError(f"SQLite's integrity check: {problems}")
    return manifest


def _integrity(path: Path) -> str | None:
    try:
        uri = f"{path.resolve().as_uri()}?mode=ro"  # escaped: a ? or % in the path
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            rows = db.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        return str(exc)
    found = [str(r[0]) for r in rows]
    return None if found == ["ok"] else "; ".join(found[:5])


def _claim(remote: Any, token: str, epoch: int) -> int:
    """Claim ``epoch`` (or the next free one, if a concurrent restore took it)."""
    last: Exception | None = None
    for candidate in range(epoch, epoch + CLAIM_TRIES):
        body = {
            "claimed_at": dt.datetime.now(dt.timezone.utc).isoformat(),
            "host": os.uname().nodename,
        }
        try:
            _write_bytes(remote, _rel(token, candidate, "claim.json"), json.dumps(body).encode())
            return candidate
        except PhaseError as exc:  # taken (or the write failed: the next try says which)
            last = exc
            if not remote.exists(_rel(token, candidate, "claim.json")):
                raise
    raise ObjectStoreError(f"could not claim a ledger epoch for {token}: {last}")


def place_ledger(fetched: FetchedLedger, downloaded: Path, db_path: Path) -> None:
    """Put the downloaded ledger in place and note, in the state file, the epoch this
    machine copies to (and that the restore is yet to be recorded as an event)."""
    root = db_path.parent
    restored = {**fetched.__dict__, "damaged": list(fetched.damaged), "recorded": False}

    def noted(state: dict[str, Any]) -> None:
        state.clear()
        state.update(epoch=fetched.claimed_epoch, restored=restored)

    update_state(root, noted)
    rename_durably(downloaded, db_path)
    fsync_dir(root)


def pending_restore(root: Path) -> dict[str, Any] | None:
    """The restore the state file notes and no open has recorded yet."""
    state = read_state(root) or {}
    restored = state.get("restored")
    return restored if isinstance(restored, dict) and not restored.get("recorded") else None


def mark_recorded(root: Path) -> None:
    def recorded(state: dict[str, Any]) -> None:
        if isinstance(state.get("restored"), dict):
            state["restored"]["recorded"] = True

    update_state(root, recorded)


def record_ledger_restore(ctx: Any) -> None:
    """The restore the state file notes, recorded as a ``ledger_restored`` event by the
    first open after it (so ``ckptdb history`` says when and from which copy)."""
    restored = pending_restore(ctx.root)
    if restored is None:
        return
    detail = {k: restored.get(k) for k in ("location", "copied_at", "epoch", "seq", "damaged")}
    detail["claimed_epoch"] = restored.get("claimed_epoch")
    with ctx.ledger.transaction() as session:
        ledger_rows.add_event(session, ctx.run_id, ctx.attempt_id, "ledger_restored", detail=detail)
    mark_recorded(ctx.root)


def bring_back(remote: Any, root: Path, db_path: Path, token: str) -> FetchedLedger:
    """Fetch the run ``token``'s ledger and put it at ``db_path``; nothing is left in
    ``root`` if it fails (the download, the state file's note of the restore)."""
    tmp = root / f".{STATE_NAME}.restoring"
    try:
        fetched = fetch_ledger(remote, token, tmp)
        place_ledger(fetched, tmp, db_path)
    except BaseException:
        remove(tmp)
        if not db_path.exists():  # the note of a restore that did not happen goes too
            remove(root / STATE_NAME)
        raise
    return fetched


def iter_copies(remote: Any, token: str) -> Iterator[tuple[int, int]]:
    """Every snapshot (epoch, seq) of the run ``token`` with its manifest, oldest first."""
    epochs = _listing(remote, token).get(token, {})
    yield from sorted((e, s) for e, epoch in epochs.items() for s in epoch.seqs)


__all__ = [
    "DEFAULT_INTERVAL",
    "PREFIX",
    "STATE_NAME",
    "FetchedLedger",
    "LedgerCopier",
    "LedgerCopy",
    "bring_back",
    "choose_run",
    "fetch_ledger",
    "iter_copies",
    "pending_restore",
    "read_state",
    "record_ledger_restore",
    "replica_for",
    "snapshot",
]
