"""Adopt layouts: how one framework's finished checkpoints are found and read.

A **layout** knows one framework's checkpoints on disk: where they are,
which are complete, their step and metrics, and where that framework's
ckptdb integration keeps its ledger (so that a later training run with the
integration finds what was adopted). It only reads; :mod:`.adopt` does the
ledger work.

Each framework's layout lives in its own package,
``ckptdb/integrations/<framework>/layout.py``, beside that framework's
writer, and registers itself with :func:`register`. :func:`layouts` finds
them by importing every such module, so a new framework needs no entry in
any table here; the ``ckptdb adopt`` help text is generated from the
registry (:func:`help_table`). Layout modules never import their framework:
adopting a run must not need its training stack installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pkgutil
import re
import textwrap
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from ..errors import InvalidArgumentError
from ..protocol.adopt import Candidate
from ..record import DerivedAlias
from ..storage import derived

__all__ = [
    "AliasChange",
    "Layout",
    "file_damage",
    "help_table",
    "layout_named",
    "layouts",
    "register",
    "tree_damage",
]


class Layout:
    """One framework's checkpoints (see the module docstring). Subclasses scan.

    ``name`` is what ``--layout`` takes; ``summary`` the help text's line
    (``ROOT; where the ledger goes; stream``); ``options`` the layout's own
    CLI options (the glob layout's ``pattern`` and ``step_regex``), passed to
    the constructor. ``generic`` layouts (not one framework's) are listed last.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ()
    generic: ClassVar[bool] = False
    #: The stream whose newest checkpoint the layout's aliases name (None: no aliases).
    alias_stream: ClassVar[str | None] = None

    def ledger_root(self, root: Path) -> Path:
        return root

    def save_dir(self, root: Path) -> Path:
        return root

    def scan(self, root: Path) -> list[Candidate]:
        raise NotImplementedError

    def aliases(self, root: Path) -> list[DerivedAlias]:
        """The derived aliases of ``alias_stream`` in ``root`` (none by default): adopt
        registers them, so that every later reconcile keeps them pointed."""
        return []

    def alias_changes(self, root: Path, target: Path | None) -> list[AliasChange]:
        """The aliases that do not name ``target`` yet (none without a target)."""
        if target is None:
            return []
        changes = []
        for alias in self.aliases(root):
            where = root / alias.path
            if not derived.names(where, alias.kind, target):
                changes.append(AliasChange(where, target, alias.kind))
        return changes


L = TypeVar("L", bound=type[Layout])

_REGISTRY: dict[str, type[Layout]] = {}
#: Layout modules that failed to import, by package name: kept (never swallowed),
#: shown in the help and raised when that layout is asked for.
_BROKEN: dict[str, Exception] = {}
_DISCOVERED = False


def register(cls: L) -> L:
    """Class decorator: make ``cls`` a layout ``ckptdb adopt --layout`` knows."""
    if not cls.name or not cls.summary:
        raise TypeError(f"{cls.__qualname__} needs a name and a summary to be registered")
    known = _REGISTRY.get(cls.name)
    if known is not None and known is not cls:
        raise TypeError(f"two layouts are called {cls.name!r}: {known!r} and {cls!r}")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    """Import every ``ckptdb.integrations.<framework>.layout`` (once).

    One layout that fails to import must not take the whole ``ckptdb`` command
    down with it (the help is built from the registry): its error is kept in
    ``_BROKEN`` and raised when that layout is used.
    """
    global _DISCOVERED
    if _DISCOVERED:
        return
    package = importlib.import_module(__package__ or "ckptdb.integrations")
    for found in pkgutil.iter_modules(package.__path__):
        module = f"{package.__name__}.{found.name}.layout"
        if not found.ispkg or importlib.util.find_spec(module) is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:
            _BROKEN[found.name] = exc
    importlib.import_module(f"{package.__name__}.adopt")  # the generic (glob) layout
    _DISCOVERED = True


def layouts() -> dict[str, type[Layout]]:
    """Every registered layout by name: the frameworks' in name order, generic ones last."""
    _discover()
    ordered = sorted(_REGISTRY.values(), key=lambda c: (c.generic, c.name))
    return {cls.name: cls for cls in ordered}


def layout_named(name: str, **options: str | None) -> Layout:
    """The layout called ``name``, made with its own ``options`` (others must be unset)."""
    known = layouts()
    cls = known.get(name)
    if cls is None and name in _BROKEN:
        raise ImportError(f"the {name!r} layout could not be imported") from _BROKEN[name]
    if cls is None:
        raise InvalidArgumentError(f"unknown layout {name!r}; known: {', '.join(known)}")
    foreign = [k for k, v in options.items() if v is not None and k not in cls.options]
    if foreign:
        owner = next((c for c in known.values() if foreign[0] in c.options), None)
        if owner is None:
            raise TypeError(f"no layout takes the option {foreign[0]!r}")
        flags = " and ".join(f"--{key.replace('_', '-')}" for key in owner.options)
        verb = "are" if len(owner.options) > 1 else "is"
        raise InvalidArgumentError(f"{flags} {verb} for --layout {owner.name}")
    return cls(**{key: options.get(key) for key in cls.options})


def help_table(indent: int = 2, width: int = 88) -> str:
    """The layouts' lines of the ``ckptdb adopt`` help: name, then its summary wrapped."""
    known = layouts()
    column = max(len(name) for name in [*known, *_BROKEN]) + 2
    lines = []
    summaries = {name: cls.summary for name, cls in known.items()}
    for name, exc in sorted(_BROKEN.items()):
        summaries[name] = f"unavailable: {type(exc).__name__}: {exc}"
    for name, summary in summaries.items():
        body = textwrap.wrap(summary, width - indent - column) or [""]
        lines.append(" " * indent + name.ljust(column) + body[0])
        lines.extend(" " * (indent + column) + more for more in body[1:])
    return "\n".join(lines)


def layout_names() -> str:
    """The layout names as a phrase: ``a, b or c``."""
    names = list(layouts())
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# ------------------------------------------------------------------ file checks


def file_damage(path: Path) -> str | None:
    """Why a file looks partial or damaged; None if it looks whole (or its format is
    not one we can check). ``torch.save`` files (zip archives: their directory is at
    the end, so a truncated one has none) and safetensors (header vs size) are checked."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty file"
        with open(path, "rb") as f:
            head = f.read(8)
        if path.suffix == ".safetensors":
            return _safetensors_damage(path, size, head)
        if head.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _safetensors_damage(path: Path, size: int, head: bytes) -> str | None:
    if len(head) < 8:
        return f"truncated ({size} bytes)"
    length = int.from_bytes(head, "little")
    if 8 + length > size:
        return f"truncated: its header alone needs {8 + length} bytes, the file has {size}"
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(length))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"truncated: {size} bytes, its header describes {expected}"
    return None


def tree_damage(directory: Path) -> str | None:
    """The first damaged file of a checkpoint directory (or a link inside it)."""
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            return f"{rel}: a link inside the checkpoint directory"
        if path.is_file():
            damage = file_damage(path)
            if damage is not None:
                return f"{rel}: {damage}"
    return None


def torch_load(path: Path) -> Any:
    """A ``torch.save`` file's contents with ``weights_only=True`` (tensors memory-mapped)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a zip archive (the legacy format) cannot be mapped: read it
        return torch.load(path, map_location="cpu", weights_only=True)


def unreadable(exc: BaseException) -> str:
    """A candidate's problem when its file cannot be read."""
    text = " ".join(str(exc).split())[:200]
    return f"unreadable (partial or damaged?): {type(exc).__name__}: {text}"


def number(value: object) -> float | None:
    """A stored metric as a float (a one-element tensor too); None if it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if isinstance(value, (int, float)):
        return float(value)
    return None


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def kind_problem(path: Path, want_dir: bool) -> str | None:
    """Why ``path`` is not the kind of checkpoint a layout reads (a link is an alias)."""
    if path.is_symlink():
        return "a symbolic link (an alias), not a checkpoint"
    if want_dir and not path.is_dir():
        return "not a directory"
    if not want_dir and not path.is_file():
        return "not a regular file"
    return None


def numbered(
    directory: Path, pattern: re.Pattern[str], read: Callable[[Path, int], Candidate]
) -> list[Candidate]:
    """``read(entry, step)`` for each entry of ``directory`` whose whole name matches
    ``pattern``, the step being its first group: the checkpoints a framework numbers."""
    found = []
    for entry in sorted(directory.iterdir()):
        match = pattern.fullmatch(entry.name)
        if match is not None:
            found.append(read(entry, int(match.group(1))))
    return found


# ------------------------------------------------------------------ aliases


@dataclass(frozen=True)
class AliasChange:
    """A derived name that adopt re-points at the newest committed checkpoint (what a
    :meth:`Layout.aliases` alias names now is not ``target``)."""

    path: Path
    target: Path
    kind: str  # symlink | link | pointer (ckptdb.record.ALIAS_KINDS)

    def apply(self) -> None:
        derived.point(self.path, self.kind, self.target)

    def __str__(self) -> str:
        return f"{self.path.name} -> {os.path.relpath(self.target, self.path.parent)}"
