"""The package layout shows the architecture (docs/architecture.md), and stays that way.

Read from the source with ``ast`` (every import, at module level or inside a
function): SQLAlchemy and Alembic are imported only inside ``ckptdb/ledger/``
(and ``migrations/``); no import cycle exists among ckptdb's modules; each
layer imports only the layers below it; the library never imports the demo.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ckptdb"
DATABASE_LIBRARIES = ("sqlalchemy", "alembic")

# What each part may import of ckptdb (besides itself). The base modules
# import nothing of ckptdb but errors.
ALLOWED = {
    "errors": set(),
    "policies": {"errors"},
    "record": set(),
    "location": {"errors"},
    "faults": set(),
    "trace": set(),
    "guard": set(),
    "storage": {"errors", "faults", "location", "policies", "trace"},
    "ledger": {"errors", "location", "policies", "record", "trace"},
    "coord": {"errors"},
    "protocol": {
        "errors",
        "faults",
        "location",
        "policies",
        "record",
        "guard",
        "storage",
        "ledger",
        "coord",
    },
    "manager": {
        "errors",
        "location",
        "policies",
        "record",
        "guard",
        "storage",
        "ledger",
        "coord",
        "protocol",
    },
    "pinning": {"record"},
    "reader": {"errors", "location", "policies", "record", "ledger", "storage", "pinning"},
    # each integration is an addition on top of the public parts
    "integrations": {
        "errors",
        "location",
        "guard",
        "ledger",
        "manager",
        "policies",
        "reader",
        "record",
        "storage",
    },
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = sources()


def ours(imported: set[str]) -> set[str]:
    """The ckptdb modules among ``imported`` (``from . import x`` names a module x)."""
    return {m for m in imported if m in MODULES}


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


@pytest.mark.parametrize("module", sorted(MODULES))
def test_sqlalchemy_is_imported_only_by_the_ledger(module: str) -> None:
    database = {m for m in imports_of(MODULES[module]) if m.split(".")[0] in DATABASE_LIBRARIES}
    if module.startswith("ckptdb.ledger"):
        return
    assert not database, f"{module} imports {sorted(database)}: SQL belongs in ckptdb.ledger"


def test_there_is_no_import_cycle() -> None:
    graph = {m: ours(imports_of(p)) - {m} for m, p in MODULES.items()}
    # A package's __init__ re-exporting its own submodules is not a cycle.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        trail.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = [*trail[trail.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        trail.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_each_layer_imports_only_the_layers_below_it(part: str) -> None:
    crossing = {}
    for module, path in MODULES.items():
        if part_of(module) != part:
            continue
        used = {part_of(m) for m in ours(imports_of(path))} - {part, ""}
        extra = used - ALLOWED[part]
        if extra:
            crossing[module] = sorted(extra)
    assert not crossing, f"imports across layers: {crossing}"


# The protocol reaches payloads only through the seam: the store protocol, payload
# kinds and names; which store a run uses is decided by the manager alone.
SEAM = {
    "ckptdb.storage",
    "ckptdb.storage.base",
    "ckptdb.storage.kinds",
    "ckptdb.storage.naming",
    "ckptdb.storage.external",  # the External payload and its names
}
SEAM_EXTRAS = {"ckptdb.storage.dcp"}  # resolving a sharded load target's Stateful values


def test_the_protocol_uses_only_the_storage_seam() -> None:
    reaching = {}
    for module, path in MODULES.items():
        if part_of(module) != "protocol":
            continue
        used = {m for m in ours(imports_of(path)) if part_of(m) == "storage"}
        beyond = used - SEAM - SEAM_EXTRAS
        if beyond:
            reaching[module] = sorted(beyond)
    assert not reaching, f"the protocol reaches past the storage seam: {reaching}"


def test_the_library_never_imports_the_cli_or_the_demo() -> None:
    users = {
        m
        for m, p in MODULES.items()
        if not m.startswith("ckptdb.cli")
        and any(i.startswith("ckptdb.cli") for i in ours(imports_of(p)))
    }
    assert not users, f"the library imports the CLI/demo: {sorted(users)}"


def test_nothing_in_the_library_imports_an_integration() -> None:
    """Integrations need their framework installed; the core must import without it."""
    users = {
        m
        for m, p in MODULES.items()
        if not m.startswith("ckptdb.integrations")
        and any(i.startswith("ckptdb.integrations") for i in ours(imports_of(p)))
    }
    assert not users, f"the library imports an integration: {sorted(users)}"


def test_the_layout_checks_see_every_part() -> None:
    """A new top-level module or package must be placed in a layer here."""
    parts = {part_of(m) for m in MODULES} - {""}
    assert parts - {"cli"} == set(ALLOWED), sorted(parts - {"cli"} ^ set(ALLOWED))
