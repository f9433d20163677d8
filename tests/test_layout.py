"""The package layout shows the architecture (docs/architecture.md), and stays that way.

Read from the source with ``ast`` (every import, at module level or inside a
function): SQLAlchemy and Alembic are imported only inside ``ckptdb/ledger/``
(and ``migrations/``); no import cycle exists among ckptdb's modules; each
layer imports only the layers below it; the library never imports the demo.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "lazy": set(),  # a package's names imported on first use (no torch on a read)
    # `ckptdb latest`/`best` from the standard library: no SQLAlchemy, so not the ledger
    "quickread": {"location", "policies", "record", "sqliteread", "statusout", "textout"},
    "textout": {"record"},
    # ckptdb status's text and its parts read from events (both readers print it)
    "statusout": {"textout"},  # the command's tables, CSV and JSON (the quick read prints them too)
    "storage": {"errors", "faults", "lazy", "location", "policies", "trace"},
    "sqliteread": set(),  # a read-only SQLite connection's locks (both readers use them)
    "ledger": {"errors", "faults", "location", "policies", "record", "sqliteread", "trace"},
    "coord": {"errors"},
    "preemption": {"errors", "record"},
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
        "preemption",
        "ledgercopy",  # an open with remote= on a root without a ledger brings it back
        "goodput",  # interval="auto" reads the run's save cost and failure rate
        "interval",
        "exports",  # check() verifies the run's recorded exports
    },
    "goodput": {"errors", "ledger"},
    "interval": {"errors", "goodput", "protocol"},
    "pinning": {"record"},
    # a SQLite ledger's copies on a remote tier: files out, objects in, one event
    "ledgercopy": {"errors", "ledger", "storage"},
    # a lost machine's run back from a URL: the ledger, then an open of the run
    "recovery": {"errors", "ledger", "ledgercopy", "location", "manager", "record", "storage"},
    # a replicator: a reader of the run that also writes its copies' rows
    "replication": {
        "errors",
        "location",
        "policies",
        "record",
        "ledger",
        "ledgercopy",
        "storage",
        "reader",
    },
    "maintenance": {"errors", "ledger"},
    # a follower: a reader of the run that writes its own tracker row, then the tracker
    "trackers": {"errors", "ledger", "location", "reader", "record", "storage"},
    # a checkpoint read as tensors and written as safetensors; the reader records it
    "exports": {"errors", "ledger", "location", "record", "storage"},
    "reader": {
        "exports",
        "goodput",
        "errors",
        "location",
        "policies",
        "record",
        "ledger",
        "storage",
        "pinning",
        "protocol",  # check(): the invariants, as the manager checks them
        "statusout",  # preemptions(): what each cost, as ckptdb status shows it
    },
    # each integration is an addition on top of the public parts
    "integrations": {
        "errors",
        "location",
        "guard",
        "ledger",
        "manager",
        "policies",
        "preemption",  # their preemption= settings and the Preempted they raise
        "ledgercopy",  # whether a lost machine's ledger waits under remote= (Lightning)
        "goodput",  # the interval's default bounds
        "interval",  # interval= in each framework's idiom
        "protocol",  # adopt layouts produce the protocol's candidates
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
    "ckptdb.storage.derived",  # derived aliases: local names under the run root, not payloads
    "ckptdb.storage.topology",  # a payload's mesh description; a sharded load's layout check
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


#: The command itself: the CLI package and the entry point that tries the quick read first.
COMMAND = ("ckptdb.cli", "ckptdb.__main__")


def test_the_library_never_imports_the_cli_or_the_demo() -> None:
    users = {
        m
        for m, p in MODULES.items()
        if not m.startswith(COMMAND)
        and any(i.startswith("ckptdb.cli") for i in ours(imports_of(p)))
    }
    assert not users, f"the library imports the CLI/demo: {sorted(users)}"


INTEGRATIONS = "ckptdb.integrations"
#: The third-party frameworks the integrations are written for.
FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate", "deepmd")


def framework_package(module: str) -> str | None:
    """``ckptdb.integrations.<framework>`` for a module inside one, else None."""
    parts = module.split(".")
    if module.startswith(INTEGRATIONS + ".") and len(parts) >= 3:
        candidate = ".".join(parts[:3])
        if candidate in MODULES and MODULES[candidate].name == "__init__.py":
            return candidate
    return None


def framework_free(module: str) -> bool:
    """The shared layer, the adopt registry, each framework package's lazy ``__init__``
    and its adopt layout: what the core and the CLI may import without any framework."""
    if not module.startswith(INTEGRATIONS):
        return True
    package = framework_package(module)
    return package is None or module in (package, f"{package}.layout")


def test_nothing_in_the_library_imports_an_integrations_writer() -> None:
    """Writers need their framework installed; the core and the CLI must import without
    one (the CLI reaches only the framework-free adopt registry and layouts)."""
    users = {
        m: sorted(i for i in ours(imports_of(p)) if not framework_free(i))
        for m, p in MODULES.items()
        if not m.startswith(INTEGRATIONS)
    }
    users = {m: found for m, found in users.items() if found}
    assert not users, f"the library imports an integration's writer: {users}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if framework_free(m)))
def test_the_framework_free_modules_import_no_framework(module: str) -> None:
    found = {i for i in imports_of(MODULES[module]) if i.split(".")[0] in FRAMEWORKS}
    assert not found, f"{module} imports {sorted(found)}: only a writer module may"


def test_an_integration_package_imports_no_other_integration_package() -> None:
    """Each framework's package stands alone on the shared layer (common, layouts, adopt)."""
    crossing = {}
    for module, path in MODULES.items():
        package = framework_package(module)
        if package is None:
            continue
        others = {
            framework_package(i)
            for i in ours(imports_of(path))
            if framework_package(i) not in (None, package)
        }
        if others:
            crossing[module] = sorted(str(o) for o in others)
    assert not crossing, f"integration packages import each other: {crossing}"


def test_the_cli_imports_nothing_from_the_ledger_or_storage() -> None:
    """The CLI is a thin layer on the public parts (reader, manager, maintenance, the
    adopt registry): SQL and stores stay behind them."""
    reaching = {
        m: sorted(i for i in ours(imports_of(p)) if part_of(i) in ("ledger", "storage"))
        for m, p in MODULES.items()
        if part_of(m) == "cli"
    }
    reaching = {m: found for m, found in reaching.items() if found}
    assert not reaching, f"the CLI imports the ledger or storage directly: {reaching}"


def test_adopt_and_its_layouts_work_without_any_framework(tmp_path: Path) -> None:
    """With every framework made unimportable, the CLI starts, every framework package's
    layout registers, and its help lists them (none was imported on the way)."""
    script = f"""
import sys
for name in {FRAMEWORKS!r}:
    sys.modules[name] = None  # import raises ImportError
from click.testing import CliRunner
from ckptdb.cli import main
from ckptdb.integrations.layouts import layouts
result = CliRunner().invoke(main, ["adopt", "--help"])
assert result.exit_code == 0, result.output
print(sorted(layouts()))
print(result.output)
print(sorted(n for n in sys.modules if n.split(".")[0] in {FRAMEWORKS!r} and sys.modules[n]))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    names, *rest = done.stdout.splitlines()
    packages = sorted(p.parent.name for p in (PACKAGE / "integrations").glob("*/layout.py"))
    assert set(packages) <= set(eval(names)) and "glob" in eval(names), names
    assert all(f"  {name} " in done.stdout for name in eval(names)), done.stdout
    assert rest[-1] == "[]", rest[-1]


def test_the_layout_checks_see_every_part() -> None:
    """A new top-level module or package must be placed in a layer here."""
    parts = {part_of(m) for m in MODULES} - {""} - {"cli", "__main__"}
    assert parts == set(ALLOWED), sorted(parts ^ set(ALLOWED))


# Which store a location gets is decided in one place: ckptdb.storage.open_store.
STORE_FACTORY = "ckptdb.storage.opening"


def store_classes() -> dict[str, str]:
    """{class name: its module} of every payload store in ckptdb/storage: a class that
    defines every member of the ``PayloadStore`` protocol, or whose name ends in
    ``Store``; a ``Protocol`` (a structural type, as in s3dcp) is no store."""
    base = ast.parse((PACKAGE / "storage" / "base.py").read_text())
    protocol = next(
        n for n in base.body if isinstance(n, ast.ClassDef) and n.name == "PayloadStore"
    )
    required = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    found: dict[str, str] = {}
    for module, path in MODULES.items():
        if part_of(module) != "storage":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).split("[")[0].rpartition(".")[2] for b in node.bases}
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if "Protocol" not in bases and (required <= methods or node.name.endswith("Store")):
                found[node.name] = module
    return found


def test_only_open_store_constructs_a_store() -> None:
    """A part that builds a store itself would miss the checks open_store makes (options
    on a local path) and the next object store (a new scheme). A store's own module
    may build one (its ``__repr__``, a copy)."""
    stores = store_classes()
    assert {"LocalStore", "S3Store"} <= set(stores), f"the scan missed a store: {stores}"
    builders: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = {  # ``from .local import LocalStore as Local``
            a.asname: a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if a.asname and a.name in stores
        }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            cls = aliases.get(name, name)
            if cls in stores and module not in (STORE_FACTORY, stores[cls]):
                builders.setdefault(module, []).append(f"{cls}(...) on line {node.lineno}")
    assert not builders, (
        f"these construct a store themselves: {builders}; open it with "
        "ckptdb.storage.open_store(location, options) instead"
    )
