"""Derived aliases: registered by an integration, re-pointed after commits and by reconcile.

Aliases are derived: ``last.ckpt``, DeePMD's ``model.ckpt.pt`` and its
``checkpoint`` pointer file exist for other tools. ckptdb writes them only
after a commit, atomically, and never reads them to decide anything. The
ledger's ``aliases`` table records which ones a run has, so that a crash
between a commit and its aliases is repaired by the next reconcile instead of
leaving them stale until the integration runs again.

- :func:`requested` checks what a caller asked for (types, syntax, kinds)
  before anything is looked at;
- :meth:`AliasKeeper.register` refuses what may not be an alias (outside the
  run root, a checkpoint's own name, a directory...), records the rest and
  points them;
- :meth:`AliasKeeper.rederive` points every registered alias at the latest
  committed checkpoint of its stream (a dry run only reports). A stream with
  nothing committed leaves its alias as it is: an alias never names nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    RunDirectoryError,
    UnknownStreamError,
)
from ..ledger import Ledger
from ..ledger import aliases as ledger_aliases
from ..ledger import rows as ledger_rows
from ..location import ObjectPath
from ..record import ALIAS_KINDS, LINK, Checkpoint, DerivedAlias
from ..storage import derived
from ..storage.naming import is_own_name
from .report import Action

#: Temporary names of the alias primitives (``.<alias>.ckptdb-alias``): never an alias.
_TEMPORARY = (".ckptdb-alias", ".ckptdb-old")


def requested(aliases: object) -> list[DerivedAlias]:
    """``aliases`` (an iterable of :class:`DerivedAlias`, or a mapping of path to
    ``(stream, kind)``) checked for types and syntax, paths normalized to text."""
    if isinstance(aliases, Mapping):
        items = [_from_item(path, value) for path, value in aliases.items()]
    elif isinstance(aliases, (str, bytes)) or not isinstance(aliases, Iterable):
        raise ArgumentTypeError(
            "derive_aliases() takes DerivedAlias values or a mapping of path to "
            f"(stream, kind), got {aliases!r}"
        )
    else:
        items = [_checked(a) for a in aliases]
    paths = [a.path for a in items]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise InvalidArgumentError(f"alias paths given more than once: {twice}")
    return items


def _from_item(path: object, value: object) -> DerivedAlias:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ArgumentTypeError(f"alias {path!r}: expected (stream, kind), got {value!r}")
    return _checked(DerivedAlias(path, value[0], value[1]))  # type: ignore[arg-type]


def _checked(alias: object) -> DerivedAlias:
    if not isinstance(alias, DerivedAlias):
        raise ArgumentTypeError(f"expected a DerivedAlias, got {alias!r}")
    path: Any = alias.path
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ArgumentTypeError(f"an alias path is a str relative to the run root, got {path!r}")
    if not isinstance(alias.stream, str) or not alias.stream:
        raise ArgumentTypeError(f"alias {text!r}: the stream must be a name, got {alias.stream!r}")
    if not isinstance(alias.kind, str) or alias.kind not in ALIAS_KINDS:
        raise InvalidArgumentError(
            f"alias {text!r}: kind must be one of {list(ALIAS_KINDS)}, got {alias.kind!r}"
        )
    _check_syntax(text)
    return DerivedAlias(text, alias.stream, alias.kind)


def _check_syntax(text: str) -> None:
    parts = text.split("/")
    if not text or "\x00" in text or text.startswith("/") or {"", ".", ".."} & set(parts):
        raise InvalidArgumentError(
            f"alias path {text!r} must be relative to the run root, without '.', '..' "
            "or empty parts"
        )
    if any(p.startswith("ckptdb.") for p in parts) or parts[-1].endswith(_TEMPORARY):
        raise InvalidArgumentError(f"alias path {text!r} is one of ckptdb's own names")


class AliasKeeper:
    """A run's derived aliases: registered in the ledger, pointed on disk (chief only)."""

    def __init__(self, db: Ledger, run_id: int, root: Path, save_dir: Path) -> None:
        self.db, self.run_id, self.root, self.save_dir = db, run_id, root, save_dir

    @property
    def local(self) -> bool:
        """Aliases name local files: none for checkpoints in object storage."""
        return not isinstance(self.save_dir, ObjectPath)

    def register(self, wanted: list[DerivedAlias], *, replace: bool) -> list[Action]:
        """Refuse, record, point: nothing changes unless every alias is acceptable."""
        if not self.local:
            raise InvalidArgumentError(
                f"derived aliases name local files; this run's checkpoints are in object "
                f"storage ({self.save_dir})"
            )
        with self.db.transaction(read=True) as session:
            streams = set(ledger_rows.stream_names(session, self.run_id))
            known = {a.path: a for a in ledger_aliases.registered(session, self.run_id)}
            owned = {a.path for a in wanted if self._owned(session, a.path)}
        for alias in wanted:
            self._refuse(alias, streams, owned, dir_ok=known.get(alias.path) == alias)
        after = {**({} if replace else known), **{a.path: a for a in wanted}}
        if after != known:
            with self.db.transaction() as session:
                ledger_aliases.register(session, self.run_id, wanted, replace=replace)
        done = self.rederive(dry_run=False, only={a.path for a in wanted})
        failed = [a for a in done if a.kind == "failed"]
        if failed:  # recorded all the same: the next reconcile tries again
            said = "; ".join(f"{self.root / a.path}: {a.detail}" for a in failed)
            raise RunDirectoryError(f"derived aliases not written: {said}")
        return done

    def _refuse(
        self, alias: DerivedAlias, streams: set[str], owned: set[str], *, dir_ok: bool
    ) -> None:
        if alias.stream not in streams:
            raise UnknownStreamError(
                f"alias {alias.path!r}: the run has no stream {alias.stream!r} "
                f"(it has {sorted(streams)})"
            )
        where = derived.alias_path(self.root, alias.path)  # refused if it leaves the root
        problem = "a checkpoint's own name" if alias.path in owned else None
        problem = problem or derived.obstacle(where, alias.kind, dir_ok=dir_ok)
        if problem is not None:
            raise InvalidArgumentError(f"alias {alias.path!r} ({where}): {problem}")

    def _owned(self, session: Any, path: str) -> bool:
        """Whether ``path`` (relative to the root) is, or could be, a checkpoint's name:
        in ckptdb's naming, or a live row's, inside the save directory."""
        try:
            rel = derived.alias_path(self.root, path).relative_to(self.save_dir).as_posix()
        except (ValueError, InvalidArgumentError):
            return False  # outside the save directory (or refused later, with its reason)
        return is_own_name(rel) or ledger_rows.path_in_use(session, self.run_id, rel)

    def rederive(
        self,
        *,
        dry_run: bool,
        chosen: Mapping[str, int | None] | None = None,
        only: set[str] | None = None,
    ) -> list[Action]:
        """Point every registered alias (``only``: those paths) at the latest committed
        checkpoint of its stream (``chosen``: the ids a dry run's ``latest`` would be)."""
        if not self.local:
            return []
        with self.db.transaction(read=True) as session:
            aliases = [
                a
                for a in ledger_aliases.registered(session, self.run_id)
                if only is None or a.path in only
            ]
            streams = [a.stream for a in aliases]
            latest = ledger_aliases.latest_of(session, self.run_id, streams, self.save_dir, chosen)
            owned = {a.path for a in aliases if self._owned(session, a.path)}
        found = [self._derive(a, latest[a.stream], a.path in owned, dry_run) for a in aliases]
        return [action for action in found if action is not None]

    def _derive(
        self, alias: DerivedAlias, target: Checkpoint | None, owned: bool, dry_run: bool
    ) -> Action | None:
        try:
            where = derived.alias_path(self.root, alias.path)
        except InvalidArgumentError as exc:
            return Action("failed", alias.path, f"alias of {alias.stream!r}: {exc}")
        if target is None:
            if not os.path.lexists(where):
                return None
            detail = f"{alias.stream!r} has no committed checkpoint; left as it is"
            return Action("alias_left", alias.path, detail)
        if derived.names(where, alias.kind, target.path):
            return None
        ident, step = target.id, target.step
        problem = "a checkpoint's own name" if owned else None
        dir_ok = alias.kind == LINK and target.path.is_dir()
        problem = problem or derived.obstacle(where, alias.kind, dir_ok=dir_ok)
        if problem is not None:
            detail = f"alias of {alias.stream!r}: {problem}; left as it is"
            return Action("failed", alias.path, detail, ident, step)
        before = derived.named_now(where, alias.kind)
        if not dry_run:
            try:
                derived.point(where, alias.kind, target.path)
            except OSError as exc:
                detail = f"alias of {alias.stream!r}: {type(exc).__name__}: {exc}"
                return Action("failed", alias.path, detail, ident, step)
        detail = f"{alias.kind} -> {derived.pointer_text(where, target.path)}"
        if before is not None:
            detail += f", was {before}"
        return Action("aliased", alias.path, detail, ident, step)
