"""Adopting a run: the checkpoints a layout finds, registered in a ledger.

:func:`adopt` is what ``ckptdb adopt`` runs: the layout named (one of
:func:`~ckptdb.integrations.layouts.layouts`, each framework's own, or the
generic ``glob`` layout defined here) scans ROOT, a dry look at the ledger
(:func:`~ckptdb.protocol.adopt.preview_recorded`) decides what each
candidate would become, and :meth:`CheckpointManager.adopt` commits them
under the writer lock.

An existing run keeps its stored save directory. Nothing but the ledger is
written, except the aliases a layout derives (DeePMD's ``model.ckpt.pt`` and
``checkpoint`` pointer, re-pointed at the newest committed checkpoint after
the commit, and registered in the ledger so that every later reconcile keeps
them pointed) and, with ``move``, checkpoints outside the run's save
directory (moved into it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ..errors import InvalidArgumentError
from ..manager import CheckpointManager
from ..protocol.adopt import (
    ADOPTED,
    NEW_STREAM_POLICY,
    Candidate,
    Outcome,
    RecordedRun,
    preview,
    preview_recorded,
)
from ..record import DerivedAlias
from ..storage import open_store
from .layouts import AliasChange, Layout, file_damage, layout_named, mtime, register, tree_damage

__all__ = ["AdoptReport", "GlobLayout", "adopt"]


@register
class GlobLayout(Layout):
    """Files (or directories) matching ``pattern`` under ROOT; step from the name.

    The step is the first integer in the file name, or the group of
    ``step_regex`` (its only group, or the one named ``step``) searched in
    the name. A ``torch.save`` or safetensors file must be whole.
    """

    name: ClassVar[str] = "glob"
    summary: ClassVar[str] = "--pattern under ROOT, step from the name; ROOT; 'model'"
    options: ClassVar[tuple[str, ...]] = ("pattern", "step_regex")
    generic: ClassVar[bool] = True

    def __init__(self, pattern: str | None, step_regex: str | None) -> None:
        if not pattern:
            raise InvalidArgumentError("--layout glob needs --pattern, e.g. --pattern 'ckpt_*.pt'")
        parts = Path(pattern).parts
        if Path(pattern).is_absolute() or ".." in parts or pattern.startswith("~"):
            raise InvalidArgumentError(
                f"--pattern {pattern!r} must be relative to ROOT, without '..'"
            )
        self.pattern = pattern
        self.step_regex = step_regex
        try:
            regex = re.compile(step_regex if step_regex is not None else r"\d+")
        except re.error as exc:
            raise InvalidArgumentError(
                f"--step-regex {step_regex!r} is not a regex: {exc}"
            ) from exc
        if step_regex is not None and "step" not in regex.groupindex and regex.groups != 1:
            raise InvalidArgumentError(
                f"--step-regex {step_regex!r} needs one group (or a group named 'step') "
                "that matches the step, e.g. 'step(\\d+)'"
            )
        self.regex = regex
        self.group: int | str = (
            "step" if "step" in regex.groupindex else (1 if regex.groups == 1 else 0)
        )

    def scan(self, root: Path) -> list[Candidate]:
        try:
            matches = sorted(root.glob(self.pattern))
        except (ValueError, NotImplementedError) as exc:
            raise InvalidArgumentError(f"--pattern {self.pattern!r}: {exc}") from exc
        found = []
        for path in matches:
            rel = path.relative_to(root).parts
            if not rel or any(p.startswith((".", "ckptdb.")) for p in rel):
                continue  # hidden files (ckptdb's temporaries among them), the ledger's own
            if not path.parent.resolve().is_relative_to(root):
                found.append(Candidate(path, problem="reached through a link out of ROOT"))
                continue
            found.append(self._read(path))
        return found

    def _read(self, path: Path) -> Candidate:
        if path.is_symlink():
            return Candidate(path, problem="a symbolic link (an alias), not a checkpoint")
        match = self.regex.search(path.name)
        text = match.group(self.group) if match is not None else None
        if text is None or not text.isdigit():
            how = f"--step-regex {self.step_regex!r}" if self.step_regex else "an integer"
            return Candidate(path, problem=f"no step in its name ({how})")
        step = int(text)
        problem = tree_damage(path) if path.is_dir() else file_damage(path)
        if problem is not None:
            return Candidate(path, step=step, problem=problem)
        return Candidate(path, "model", step, written_at=mtime(path))


@dataclass
class AdoptReport:
    """What one ``adopt`` did (or, with ``dry_run``, would do)."""

    root: Path
    layout: str
    ledger: Path
    save_dir: Path
    dry_run: bool
    outcomes: list[Outcome] = field(default_factory=list)
    aliases: list[AliasChange] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for o in self.outcomes if o.status == status)


def _order(candidate: Candidate) -> tuple[bool, int, str]:
    """Oldest first (adopting appends); those without a step last."""
    return (candidate.step is None, candidate.step or 0, str(candidate.source))


def adopt(
    root: str | os.PathLike[str],
    layout: str,
    *,
    pattern: str | None = None,
    step_regex: str | None = None,
    dry_run: bool = False,
    move: bool = False,
    db_url: str | None = None,
    report: Callable[[Outcome], None] | None = None,
) -> AdoptReport:
    """Adopt the checkpoints that ``layout`` finds in ``root`` (see the module docstring).

    Bad input (an unknown layout, a bad pattern, a ROOT that is no directory)
    raises :class:`~ckptdb.errors.InvalidArgumentError` before anything is
    read; a run whose writer lock another process holds raises
    :class:`~ckptdb.errors.LedgerLockedError` before anything changes.
    ``report`` hears each outcome once it is final.
    """
    lay = layout_named(layout, pattern=pattern, step_regex=step_regex)
    where = Path(root)
    if not where.is_dir():
        what = "does not exist" if not os.path.lexists(where) else "is not a directory"
        raise InvalidArgumentError(f"ROOT {where} {what}")
    where = where.resolve()
    candidates = sorted(lay.scan(where), key=_order)
    ledger_root = lay.ledger_root(where)
    recorded = preview_recorded(
        ledger_root,
        db_url,
        candidates,
        store_of=lambda save_dir: open_store(save_dir, probe=False),
        move=move,
        alias_stream=lay.alias_stream,
    )
    if recorded is None:
        save_dir = lay.save_dir(where)
        outcomes = preview(
            candidates, save_dir=save_dir, store=open_store(save_dir), policies={}, move=move
        )
        current = None
    else:
        save_dir = recorded.save_dir
        outcomes, current = recorded.outcomes, recorded.alias_target
    result = AdoptReport(where, lay.name, ledger_root, save_dir, dry_run, outcomes)
    planned = [o for o in outcomes if o.status == ADOPTED]
    newest = [o for o in planned if o.candidate.stream == lay.alias_stream and o.name]
    target = save_dir / str(newest[-1].name) if newest else current
    result.aliases = lay.alias_changes(where, target)
    unregistered = _unregistered(lay, where, recorded, planned)
    if dry_run or (not planned and not result.aliases and not unregistered):
        if report is not None:
            for outcome in outcomes:
                report(outcome)
        return result
    streams = {str(o.candidate.stream): NEW_STREAM_POLICY for o in planned}
    with CheckpointManager(
        ledger_root,
        streams=streams if recorded is None else None,
        save_dir=save_dir if recorded is None else None,
        db_url=db_url,
        maintenance=True,
    ) as mgr:
        result.outcomes = mgr.adopt(candidates, move=move, report=report)
        stream = lay.alias_stream
        latest = mgr.latest(stream) if stream is not None and stream in mgr.policies else None
        result.aliases = lay.alias_changes(where, latest.path if latest is not None else None)
        derived = [a for a in lay.aliases(where) if a.stream in mgr.policies]
        if derived:  # registered, so that every later reconcile keeps them pointed
            mgr.derive_aliases(derived)
    return result


def _unregistered(
    lay: Layout, root: Path, recorded: RecordedRun | None, planned: list[Outcome]
) -> list[DerivedAlias]:
    """The layout's aliases the run has not registered yet, of a stream it has (or
    will have once ``planned`` is adopted): adopting registers them."""
    streams = {str(o.candidate.stream) for o in planned}
    registered: tuple[DerivedAlias, ...] = ()
    if recorded is not None:
        streams |= set(recorded.policies)
        registered = recorded.aliases
    return [a for a in lay.aliases(root) if a.stream in streams and a not in registered]
