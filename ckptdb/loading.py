"""Loading a committed checkpoint: resolve, verify, read (a mixin).

``which`` resolves through the ledger only; the file (or sharded directory)
is checked against its recorded size and hash before anything is unpickled,
and a mismatch or a vanished file is recorded, as reconcile would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from sqlalchemy import select

from . import ledger
from . import models as m
from .distributed import RankGroup
from .errors import (
    ArgumentTypeError,
    CheckpointLostError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidArgumentError,
)
from .queries import RunQueries
from .record import Checkpoint
from .sharded import load_sharded
from .storage import ForeignEntryError, checkpoint_size, confine, hash_checkpoint, is_sharded

if TYPE_CHECKING:
    from .asyncsave import SaveHandle
    from .db import Ledger


class LoadingMixin(RunQueries):
    """``load`` and what it needs; mixed into CheckpointManager."""

    if TYPE_CHECKING:  # provided by CheckpointManager
        _db: Ledger
        _group: RankGroup | None
        _inflight: SaveHandle | None
        _inflight_streams: frozenset[str]
        _resumed: bool
        attempt_id: int
        root: Path

        def _wait_inflight(self) -> None: ...
        def _load_collective(
            self,
            group: RankGroup,
            which: object,
            stream: str | None,
            map_location: Any,
            weights_only: bool,
            into: dict[str, Any] | None,
        ) -> Any: ...

    def load(
        self,
        which: str | int | Checkpoint | os.PathLike[str] = "latest",
        *,
        stream: str | None = None,
        map_location: Any = "cpu",
        weights_only: bool = True,
        into: dict[str, Any] | None = None,
    ) -> Any:
        """Load a committed checkpoint after verifying its size and hash.

        ``which`` is ``"latest"``, ``"best"``, a step, a :class:`Checkpoint`
        or a path. ``stream`` defaults to ``"best"`` for ``which="best"`` and
        ``"model"`` otherwise. A mismatch marks the row ``corrupt``, moves the
        latest pointer back to the newest healthy checkpoint and raises
        :class:`CorruptCheckpointError` before anything is unpickled; a
        vanished file is marked ``lost`` likewise (:class:`CheckpointLostError`).
        A sharded checkpoint loads in place into ``into`` (the caller's state
        dict, with the shapes and sharding to fill), which is returned.
        Under torch.distributed ``load`` is collective: the chief resolves
        and verifies, every rank loads that checkpoint.
        """
        self._check_open()
        if self._inflight is not None and self._inflight_writes(which, stream):
            self._wait_inflight()
        if self._group is not None:
            return self._load_collective(
                self._group, which, stream, map_location, weights_only, into
            )
        target, path = self._verified(which, stream)
        check_into(target, into)
        state = read_checkpoint(target, path, map_location, weights_only, into, None)
        self._note_resume(target)
        return state

    def _inflight_writes(self, which: object, stream: str | None) -> bool:
        """Whether the boundary in flight writes the stream that ``load`` asks for."""
        if isinstance(which, Checkpoint):
            wanted: str | None = which.stream
        elif which == "best":
            wanted = stream or "best"
        elif which == "latest" or isinstance(which, int):
            wanted = stream or "model"
        else:
            wanted = None  # a path: it may be the one being written
        streams = self._inflight_streams
        return wanted is None or wanted in streams

    def _verified(self, which: object, stream: str | None) -> tuple[Checkpoint, Path]:
        """The checkpoint ``which`` names, its size and hash checked (marked bad if not)."""
        target = self._resolve(which, stream)
        path = confine(self.save_dir, target.path.relative_to(self.save_dir))
        try:
            problem = verify_on_disk(path, target)
        except FileNotFoundError as exc:
            self._mark_bad(target, m.LOST, "file missing")
            raise CheckpointLostError(
                f"{target.path} is gone; marked lost, latest falls back to the previous one"
            ) from exc
        if problem is not None:
            self._mark_bad(target, m.CORRUPT, problem)
            raise CorruptCheckpointError(f"{target.path}: {problem}; refusing to load it")
        return target, path

    def _resolve(self, which: object, stream: str | None) -> Checkpoint:
        if isinstance(which, Checkpoint):
            return self._committed_by_path(which.path)
        if which == "latest":
            found = RunQueries.latest(self, stream or "model")
            if found is None:
                raise CheckpointNotFoundError(f"stream {stream or 'model'!r} has no checkpoint yet")
            return found
        if which == "best":
            best = RunQueries.best(self, stream or "best")
            if not best:
                raise CheckpointNotFoundError(f"stream {stream or 'best'!r} has no checkpoint yet")
            return best[0]
        if isinstance(which, int) and not isinstance(which, bool):
            name = stream or "model"
            self._check_stream(name)
            found = self._find_committed(stream=name, step=which)
            if found is None:
                raise CheckpointNotFoundError(
                    f"stream {name!r} has no committed checkpoint at step {which}"
                )
            return found
        if isinstance(which, (str, os.PathLike)):
            return self._committed_by_path(Path(which))
        raise ArgumentTypeError(
            f"which must be 'latest', 'best', a step, a Checkpoint or a path; got {which!r}"
        )

    def _committed_by_path(self, path: Path) -> Checkpoint:
        resolved = (Path.cwd() / path).resolve()
        save_dir = self.save_dir.resolve()
        found = None
        if resolved.is_relative_to(save_dir):
            found = self._find_committed(path=resolved.relative_to(save_dir).as_posix())
        if found is None:
            raise CheckpointNotFoundError(
                f"{path} is not a committed checkpoint of run {self.root}"
            )
        return found

    def _find_committed(self, **where: Any) -> Checkpoint | None:
        """The newest committed row matching ``where`` (column=value), by an indexed query."""
        with self._db.transaction(read=True) as session:
            query = select(m.Checkpoint).filter_by(run_id=self.run_id, state=m.COMMITTED, **where)
            row = session.scalars(query.order_by(m.Checkpoint.id.desc()).limit(1)).first()
            return Checkpoint.from_row(row, self.save_dir) if row is not None else None

    def _mark_bad(self, target: Checkpoint, state: str, problem: str) -> None:
        """Record a lost/corrupt file found at load time, as reconcile would."""
        with self._db.transaction() as session:
            ledger.set_state(session, [target.id], state, error=problem)
            ledger.repoint_latest(session, self.run_id, target.stream)
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                state,
                checkpoint_id=target.id,
                step=target.step,
                detail={"path": str(target.path), "detail": problem},
            )

    def _note_resume(self, target: Checkpoint) -> None:
        if self._resumed:
            return
        self._resumed = True
        with self._db.transaction() as session:
            attempt = session.get(m.Attempt, self.attempt_id)
            if attempt is not None and attempt.resumed_from_id is None:
                attempt.resumed_from_id = target.id
            ledger.add_event(
                session,
                self.run_id,
                self.attempt_id,
                "resumed",
                checkpoint_id=target.id,
                step=target.step,
            )


def verify_on_disk(path: Path, target: Checkpoint) -> str | None:
    """Why ``path`` does not match its ledger row, or None (FileNotFoundError if absent)."""
    try:
        size = checkpoint_size(path)
    except ForeignEntryError as exc:
        return str(exc)
    if size != target.size:
        return f"size {size} != recorded {target.size}"
    actual = hash_checkpoint(path)
    if actual.hash != target.hash:
        return f"hash {actual.hash} != recorded {target.hash}"
    return None


def check_into(target: Checkpoint, into: object) -> None:
    if is_sharded(target.path):
        if not isinstance(into, dict):
            raise InvalidArgumentError(
                f"{target.path} is a sharded checkpoint: pass into=<state dict> to load it in place"
            )
    elif into is not None:
        raise InvalidArgumentError(
            f"into= is for sharded checkpoints; {target.path} is a file, use the returned state"
        )


def read_checkpoint(
    target: Checkpoint,
    path: Path,
    map_location: Any,
    weights_only: bool,
    into: dict[str, Any] | None,
    group: RankGroup | None,
) -> Any:
    if into is not None:
        load_sharded(into, path, group.group if group is not None else None)
        return into
    # torch's own reader on the path is ~3x faster than through a Python file
    # object; the file is ours, in the save dir, verified just now.
    return torch.load(path, map_location=map_location, weights_only=weights_only)
