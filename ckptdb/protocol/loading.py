"""Loading a committed checkpoint: resolve, verify, read.

``which`` resolves through the ledger only; the payload is checked against its
recorded size and hash (by the store, the one place that sorts lost from
corrupt) before anything is unpickled, and a mismatch or a vanished payload
is recorded, as reconcile would. Three agreements make a load collective
under torch.distributed: ``resolve`` (the chief resolves and verifies; every
other rank that reads a file verifies its own read too, since what it
unpickles is what it hashed), ``ready`` (every rank can load it: a sharded
load is itself collective, so no rank may skip it) and ``loaded``; in a
single process each is the local outcome itself.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ..coord.base import Coordinator
from ..errors import (
    CheckpointLostError,
    CkptDBError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ObjectStoreError,
    note_on,
)
from ..ledger import rows as ledger_rows
from ..record import Checkpoint
from ..storage import topology
from ..storage.base import LOST
from ..storage.dcp import resolve_stateful
from ..storage.kinds import TORCH_FILE, PayloadKind, kind_of_path
from ..storage.naming import is_sharded
from . import restore as restoring
from .asyncsave import InFlight
from .context import RunContext

log = logging.getLogger(__name__)


class Loader:
    """``load`` for one open run."""

    def __init__(self, ctx: RunContext, coord: Coordinator, inflight: InFlight) -> None:
        self.ctx, self.coord, self.inflight = ctx, coord, inflight
        self._resumed = False

    def load(
        self,
        which: object,
        stream: str | None,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
        missing_keys: str = topology.ERROR,
    ) -> Any:
        if self.inflight.writes(self._stream_of(which, stream)):
            self.inflight.wait()
        try:
            return self._load(which, stream, map_location, weights_only, into, missing_keys)
        finally:  # a load refused after its verify leaves nothing held
            self.ctx.store.forget_verified()

    def _load(
        self,
        which: object,
        stream: str | None,
        map_location: Any,
        weights_only: bool,
        into: dict[str, Any] | None,
        missing_keys: str,
    ) -> Any:
        target = self.coord.shared("resolve", lambda: self.verified(which, stream, keep=True))
        kind = kind_of_path(target.path)
        rel = self.ctx.rel(target.path)
        problem: BaseException | None = None
        verifies_here = not self.coord.is_chief and self._reads_verified_bytes(kind)
        try:  # everything that could fail on one rank only, before the collective read
            topology.check_policy(missing_keys)
            kind.check_into(str(target.path), into)
            if not self.coord.is_chief and not verifies_here:
                # the name is confined (not re-resolved where a verify just did: the
                # chief's, or this rank's own below), as this rank reads it by its path
                self.ctx.store.local_path(rel)
            if into is not None:
                resolve_stateful(into)
            if verifies_here:
                self._verify_here(target, rel)
        except Exception as exc:
            problem = exc
        self.coord.agree("ready", problem, fallback="InvalidArgumentError")
        state: Any = None
        try:
            state = kind.load(
                self.ctx.store,
                rel,
                map_location=map_location,
                weights_only=weights_only,
                into=into,
                group=self.coord.group,
                planner=topology.LayoutCheckingPlanner(
                    missing_keys,
                    where=str(target.path),
                    saved_world_size=target.world_size,
                    world_size=self.coord.size,
                ),
            )
            if self.ctx.is_writer:
                self.note_resume(target)
                self._note_world_size(target)
        except CheckpointException as exc:  # DCP's agreed failure, the same on every rank
            problem = topology.agreed_mismatch(exc) or exc
        except Exception as exc:
            problem = exc
        self.coord.agree("loaded", problem, fallback="RankFailedError")
        return state

    def _note_world_size(self, target: Checkpoint) -> None:
        """A load of a checkpoint saved on another number of ranks, said and recorded
        (a ``world_size_changed`` event), so history shows where a job was resized."""
        saved, now = target.world_size, self.coord.size
        if saved is None or saved == now:
            return
        log.info("%s was saved on %d ranks; loaded on %d", target.path, saved, now)
        self.ctx.event(
            "world_size_changed",
            checkpoint_id=target.id,
            step=target.step,
            detail={"path": self.ctx.rel(target.path), "saved": saved, "now": now},
        )

    @staticmethod
    def _stream_of(which: object, stream: str | None) -> str | None:
        """The stream ``load`` asks for (None: a path, which may be any stream)."""
        if isinstance(which, Checkpoint):
            return which.stream
        if which == "best":
            return stream or "best"
        if which == "latest" or isinstance(which, int):
            return stream or "model"
        return None

    def _reads_verified_bytes(self, kind: PayloadKind) -> bool:
        """Whether this rank's read is served from bytes it verifies itself: every payload
        on object storage (one GET serves both), and a ``torch.save`` file on any store
        (read once, hashed as it is read, unpickled from what was hashed)."""
        return self.ctx.store.reads_verified_bytes or kind.name == TORCH_FILE.name

    def _verify_here(self, target: Checkpoint, rel: str) -> None:
        """A rank other than the chief, on a store whose reads are the verified bytes:
        its own hash-checked GET (the chief's bytes are in the chief's memory). A
        mismatch is raised, not recorded: only the chief writes the ledger, and it
        finds the same at its next load or reconcile --verify.

        A sharded checkpoint is not hashed whole here: its manifest is checked
        against the row and its files' sizes, and each file this rank reads is
        hashed against that manifest as it is read (the chief hashed every file),
        so a rank downloads only what it loads, not the whole checkpoint."""
        full = not is_sharded(rel)
        finding = self.ctx.store.verify(rel, target.size, target.hash, full=full, keep=True)
        if finding is None:
            return
        if finding.state == LOST and finding.missing:
            raise CheckpointLostError(
                f"{target.path} vanished after the chief verified it"
            ) from finding.error
        if finding.state == LOST:
            assert finding.error is not None
            raise finding.error  # unreadable now is not proof that it is gone
        raise CorruptCheckpointError(f"{target.path}: {finding.detail}; refusing to load it")

    def verified(self, which: object, stream: str | None, *, keep: bool = False) -> Checkpoint:
        """The checkpoint ``which`` names, its size and hash checked (marked bad if not).

        ``keep``: a load follows, so the store may hold the verified bytes for it."""
        target = self.resolve(which, stream)
        finding = self._verify(target, keep)
        if finding is None:
            return target
        if finding.state == LOST and not finding.missing:
            assert finding.error is not None
            raise finding.error  # unreadable now is not proof that it is gone
        self._mark_bad(target, finding.state, finding.detail)
        error: CkptDBError
        if finding.state == LOST:
            error = CheckpointLostError(
                f"{target.path} is gone; marked lost, latest falls back to the previous one"
            )
            error.__cause__ = finding.error
        else:
            error = CorruptCheckpointError(f"{target.path}: {finding.detail}; refusing to load it")
        if self._restored(target, error):
            if self._verify(target, keep) is None:
                return target
            note_on(error, "its copy was restored, yet it does not verify here")
        raise error

    def _verify(self, target: Checkpoint, keep: bool) -> Any:
        rel = self.ctx.rel(target.path)
        return self.ctx.store.verify(rel, target.size, target.hash, full=True, keep=keep)

    def _restored(self, target: Checkpoint, error: BaseException) -> bool:
        """Whether ``target``, just marked lost or corrupt, was brought back from its copy
        on the remote tier (``remote=``); a failure to is noted on ``error``."""
        if self.ctx.remote is None:
            return False
        try:
            done = restoring.restore_one(self.ctx, self.ctx.remote, self.ctx.remote_tier, target)
        except (ObjectStoreError, CorruptCheckpointError, InvalidArgumentError, OSError) as exc:
            # the load's own error stays the one raised (a ledger's error propagates)
            note_on(error, f"restoring it from its copy failed too: {type(exc).__name__}: {exc}")
            return False
        if not done:
            note_on(error, "it has no whole copy on the remote tier")
        return done

    def resolve(self, which: object, stream: str | None) -> Checkpoint:
        return self.ctx.queries().resolve(which, stream, self.ctx.root)

    def _mark_bad(self, target: Checkpoint, state: str, problem: str) -> None:
        """Record a lost/corrupt payload found at load time, as reconcile would."""
        self.ctx.change_state(
            target,
            state,
            event=state,
            detail={"path": str(target.path), "detail": problem},
            error=problem,
        )

    def note_resume(self, target: Checkpoint) -> None:
        """Record the checkpoint this attempt resumed from (the first one only)."""
        if self._resumed:
            return
        self._resumed = True
        ctx = self.ctx
        with ctx.ledger.transaction() as session:
            ledger_rows.note_resume(session, ctx.attempt_id, target.id)
            ledger_rows.add_event(
                session,
                ctx.run_id,
                ctx.attempt_id,
                "resumed",
                checkpoint_id=target.id,
                step=target.step,
            )
