"""The library's durability sites, found by reading its source, and each one disabled.

A *site* is one call in ``ckptdb/`` of a function that decides what a power
cut leaves: ``os.fsync``/``os.fdatasync`` (data or entries made durable),
``os.replace``/``os.rename`` (a name moved), ``os.unlink``/``os.remove`` and
``shutil.rmtree`` (a name removed). :func:`find_sites` lists them from the
syntax tree, so a site added later is found without anyone listing it, and
:func:`hidden_calls` finds the spellings such a scan would miss (``from os
import fsync``, ``Path.unlink()``, ``Path.rename()``), which the tests refuse.

:func:`disabled` turns one site into a call that does nothing while a
scenario is recorded, as if a refactor had deleted that line and kept
everything else, including any log line next to it. It swaps the module's
``os`` (or ``shutil``) for a stand-in whose function of that name looks at
its caller: the call at the site's lines of the site's function does
nothing (and says it was reached); every other call is the real one. The
real library stays on disk and in every other module, so the run can be
reopened by the real library afterwards (:func:`enabled_again`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: module -> the functions of it whose calls are sites.
DURABILITY_CALLS = {
    "os": ("fsync", "fdatasync", "replace", "rename", "unlink", "remove"),
    "shutil": ("rmtree",),
}
#: The library's own durability helpers (``ckptdb/storage/files.py``): each call of one,
#: by name or as ``files.<name>``, is a site too, so that removing one ``fsync_dir(...)``
#: among many is tested on its own, not only the ``os.fsync`` inside the helper.
HELPERS = ("fsync_dir", "fsync_file", "sync_data")
#: Sites that change no run's state, each with the reason (shown by the tests).
EXEMPT = {
    ("ckptdb/exports/__init__.py", "_undo", "files.fsync_dir"): (
        "the undo of a failed export (what it wrote removed again): reached only when "
        "writing or recording it failed; a power cut there leaves the hidden temporary, "
        "or a complete directory without a row, as a crash does (the export scenario "
        "explores both); tests/test_export.py covers the failures themselves"
    ),
    ("ckptdb/cli/demo.py", "_clear", "shutil.rmtree"): (
        "the demo empties its own scratch directory before it starts, after checking "
        "that it is empty or a previous demo's run: no run is reopened from it"
    ),
    ("ckptdb/integrations/transformers/trainer.py", "_flush_files", "fsync_file"): (
        "a head start: the model's files are fsynced while the optimizer is serialized; "
        "the seal fsyncs every file of the directory again before the commit (the "
        "hf_trainer scenario's trace test checks that)"
    ),
    ("ckptdb/storage/files.py", "move_aside", "fsync_dir"): (
        "a quarantine move that a power cut undoes leaves the file where reconcile found "
        "it, and the next reconcile moves it again: nothing is lost either way (disabled, "
        "the reconcile scenario's states all pass)"
    ),
    ("ckptdb/storage/alias.py", "remove_alias", "fsync_dir"): (
        "only the Lightning callback removes an alias (a `last` alias it no longer "
        "keeps), and no scenario records a Lightning run: not covered"
    ),
    ("ckptdb/ledgercopy.py", "update_state", "os.fsync"): (
        "the state file of a SQLite ledger's copies (the epoch): written by a replicator "
        "and a restore from a URL, which the scenarios of this test do not record; "
        "test_powerloss.py's replicate scenario explores the copies: not covered here"
    ),
    ("ckptdb/ledgercopy.py", "_fetch_one", "os.fsync"): (
        "a restore from a URL (a ledger downloaded before it is put in place): no "
        "scenario of this test restores one: not covered"
    ),
    ("ckptdb/ledgercopy.py", "place_ledger", "fsync_dir"): (
        "a restore from a URL (the restored ledger's directory): no scenario of this "
        "test restores one: not covered"
    ),
    ("ckptdb/storage/alias.py", "_link_or_copy", "fsync_file"): (
        "the copy made where a filesystem has no hard links: the test filesystem has "
        "them, so no scenario reaches it: not covered"
    ),
}


@dataclass(frozen=True)
class Site:
    path: str  # relative to the repository, e.g. ckptdb/storage/files.py
    function: str  # the enclosing function, qualified by its class
    call: str  # e.g. os.fsync
    line: int
    end_line: int
    ordinal: int  # the how-manyth call of ``call`` in ``function`` (1, 2, ...)

    @property
    def name(self) -> str:
        module = self.path.removeprefix("ckptdb/").removesuffix(".py").replace("/", ".")
        nth = f" #{self.ordinal}" if self.ordinal > 1 else ""
        return f"{module}.{self.function}: {self.call}{nth}"

    @property
    def module(self) -> str:
        """The module to patch (a package's ``__init__`` is the package itself: importing
        ``pkg.__init__`` would make a second module, which nothing calls)."""
        return self.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def find_sites(repo: Path) -> list[Site]:
    """Every durability call in ``repo/ckptdb``, in file and line order."""
    sites: list[Site] = []
    for file in sorted((repo / "ckptdb").rglob("*.py")):
        rel = file.relative_to(repo).as_posix()
        tree = ast.parse(file.read_text(), rel)
        counted: dict[tuple[str, str], int] = {}
        for function, node in _calls(tree):
            call = _durability_call(node)
            if call is None or (rel, function, call) in EXEMPT:
                continue
            counted[function, call] = counted.get((function, call), 0) + 1
            end = node.end_lineno or node.lineno
            sites.append(Site(rel, function, call, node.lineno, end, counted[function, call]))
    return sites


def hidden_calls(repo: Path) -> list[str]:
    """Durability calls :func:`find_sites` would not see: imported by name, or a
    ``pathlib`` method (``unlink``, ``rename``) instead of ``os``."""
    found = []
    for file in sorted((repo / "ckptdb").rglob("*.py")):
        rel = file.relative_to(repo).as_posix()
        for node in ast.walk(ast.parse(file.read_text(), rel)):
            if isinstance(node, ast.ImportFrom) and node.module in DURABILITY_CALLS:
                names = {a.name for a in node.names} & set(DURABILITY_CALLS[node.module])
                found += [f"{rel}:{node.lineno}: from {node.module} import {n}" for n in names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method, owner = node.func.attr, node.func.value
                is_module = isinstance(owner, ast.Name) and owner.id in DURABILITY_CALLS
                if method in ("unlink", "rename") and not is_module:
                    found.append(f"{rel}:{node.lineno}: .{method}() of {ast.unparse(owner)}")
    return found


def _calls(tree: ast.AST) -> Iterator[tuple[str, ast.Call]]:
    """Each call with the qualified name of the function it is in."""

    def visit(node: ast.AST, scope: list[str]) -> Iterator[tuple[str, ast.Call]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Call):
                yield ".".join(scope) or "<module>", child
            yield from visit(child, scope)

    yield from visit(tree, [])


def _durability_call(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name) and func.id in HELPERS:
        return func.id
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
        return None
    owner, name = func.value.id, func.attr
    if name in DURABILITY_CALLS.get(owner, ()) or (owner == "files" and name in HELPERS):
        return f"{owner}.{name}"
    return None


# ------------------------------------------------------------------ disabling one


class _Switch:
    """Whether the disabled site does nothing (while recording) or its real work."""

    on = False
    reached = 0


def _disabling(real: Callable[..., Any], site: Site, filename: str) -> Callable[..., Any]:
    """``real``, except that a call from ``site``'s lines of ``filename`` does nothing
    while the switch is on."""

    def call(*args: Any, **kwargs: Any) -> Any:
        at_site = _Switch.on and any(
            frame.f_code.co_filename == filename and site.line <= frame.f_lineno <= site.end_line
            for frame in _callers(sys._getframe(1), CALLER_DEPTH)
        )
        if at_site:
            _Switch.reached += 1
            return None
        return real(*args, **kwargs)

    return call


class _StandIn(types.ModuleType):
    """``os`` or ``shutil`` as the site's module sees it: the site's call does nothing."""

    def __init__(self, real: types.ModuleType, site: Site, filename: str) -> None:
        super().__init__(real.__name__)
        self._real, self._site, self._filename = real, site, filename
        self._name = site.call.rsplit(".", 1)[-1]

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name != self._name:
            return value
        return _disabling(value, self._site, self._filename)


#: How many frames up the site's line is looked for: the caller itself, or the caller
#: of a test's fault-injecting wrapper in between (the adopt scenario's failing fsync).
CALLER_DEPTH = 2


def _callers(caller: types.FrameType, depth: int) -> Iterator[types.FrameType]:
    """``caller`` and the frames above it, ``depth`` in all."""
    frame: types.FrameType | None = caller
    for _ in range(depth):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


@contextlib.contextmanager
def disabled(site: Site) -> Iterator[None]:
    """While the block runs, ``site`` does nothing whenever :func:`enabled_again` is not
    in force; the module is restored afterwards."""
    module = importlib.import_module(site.module)
    owner = site.call.split(".", 1)[0]
    real = module.__dict__[owner]
    assert module.__file__ is not None
    if "." in site.call:
        module.__dict__[owner] = _StandIn(real, site, module.__file__)
    else:  # a helper imported by name: the name itself stands in
        module.__dict__[owner] = _disabling(real, site, module.__file__)
    _Switch.on, _Switch.reached = True, 0
    try:
        yield
    finally:
        module.__dict__[owner] = real
        _Switch.on = False


class _Counting(types.ModuleType):
    """``os``/``shutil``/``files`` as a module sees it while every site is counted: each
    call at a site's lines counts for that site, and does its real work."""

    def __init__(self, real: types.ModuleType, sites: list[Site], filename: str) -> None:
        super().__init__(real.__name__)
        self._real, self._sites, self._filename = real, sites, filename

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        mine = [site for site in self._sites if site.call.rsplit(".", 1)[-1] == name]
        return _counted(value, mine, self._filename) if mine else value


def _counted(real: Callable[..., Any], sites: list[Site], filename: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        for frame in _callers(sys._getframe(1), CALLER_DEPTH):
            if frame.f_code.co_filename == filename:
                for site in sites:
                    if site.line <= frame.f_lineno <= site.end_line:
                        _Counts.seen.add(site.name)
        return real(*args, **kwargs)

    return call


class _Counts:
    seen: set[str] = set()


@contextlib.contextmanager
def counting(sites: list[Site]) -> Iterator[set[str]]:
    """While the block runs, every site reached is added to the set yielded; nothing is
    disabled. (Which scenario reaches a site does not depend on the site doing nothing:
    the first call to it comes before it could have changed anything.)"""
    groups: dict[tuple[str, str], list[Site]] = {}
    for site in sites:
        groups.setdefault((site.module, site.call.split(".", 1)[0]), []).append(site)
    restore = []
    for (name, owner), members in groups.items():
        module = importlib.import_module(name)
        real = module.__dict__[owner]
        assert module.__file__ is not None
        restore.append((module, owner, real))
        if "." in members[0].call:
            module.__dict__[owner] = _Counting(real, members, module.__file__)
        else:
            module.__dict__[owner] = _counted(real, members, module.__file__)
    _Counts.seen = set()
    try:
        yield _Counts.seen
    finally:
        for module, owner, real in reversed(restore):
            module.__dict__[owner] = real


def reached() -> int:
    """How many times the disabled site was called (and did nothing)."""
    return _Switch.reached


@contextlib.contextmanager
def enabled_again() -> Iterator[None]:
    """The disabled site does its real work (the run reopened by the real library)."""
    before, _Switch.on = _Switch.on, False
    try:
        yield
    finally:
        _Switch.on = before
