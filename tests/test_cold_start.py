"""Reading a ledger imports neither torch nor Alembic: a cold ``ckptdb latest`` answers at once.

``import torch`` alone takes about 1.5 s and Alembic a few hundred ms more; a
read needs SQLAlchemy and the ledger's models, nothing else. Each read-only
command (and ``RunReader``, ``resolve``) runs here in a fresh interpreter that
reports, after each command, every module of torch or Alembic it holds: a
top-level import anywhere on the read path fails the test, naming the
command. Its speed is measured in benchmarks/ (case ``cold``), not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.ledger import engine

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_db_url_from_environment")]

#: What a read must not import (``torch`` covers ``torch.distributed``).
HEAVY = ("torch", "alembic")

#: The read-only commands, as a user types them after ``ckptdb`` (ROOT is the run).
READS = [
    ["latest", "ROOT"],
    ["latest", "ROOT", "--stream", "best"],
    ["best", "ROOT"],
    ["list", "ROOT", "--all"],
    ["status", "ROOT"],
    ["status", "ROOT", "--json"],
    ["sql", "ROOT", "SELECT stream, step FROM checkpoints ORDER BY id"],
    ["history", "ROOT", "--metric", "loss"],
    ["pins", "ROOT"],
    ["goodput", "ROOT", "--json"],
    ["check", "ROOT"],
]

#: Runs in the fresh interpreter: each command, then which of HEAVY it has imported so far.
PROBE = textwrap.dedent(
    """
    import json, sys
    from ckptdb.cli import main

    def heavy():
        return sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))

    report = {}
    for args in COMMANDS:
        try:
            main([a.replace("ROOT", ROOT) for a in args], standalone_mode=False)
        except SystemExit as exc:
            report[" ".join(args)] = ["exit %s" % exc.code]
            continue
        report[" ".join(args)] = heavy()
    from ckptdb import RunReader, resolve
    with RunReader(ROOT) as reader:
        reader.latest(), reader.best(), reader.checkpoints(), reader.metric_history("loss")
    resolve("best", root=ROOT)
    resolve(ROOT)
    report["RunReader, resolve"] = heavy()
    print("REPORT " + json.dumps(report))
    """
)


def make_run(root: Path) -> Path:
    """Three streams, metrics, a top-K: every read above has something to show."""
    streams = {"model": Keep(last=2), "best": TopK(2, "val_loss")}
    with CheckpointManager(root, streams=streams) as mgr:
        for step, val in enumerate([3.0, 1.0, 2.0]):
            mgr.log_metrics(step, {"loss": 10.0 - step})
            tensor = {"w": torch.full((4,), float(step))}
            mgr.save(step, metrics={"val_loss": val}, model=tensor, best=tensor)
    return root


def probe(root: Path, commands: list[list[str]]) -> dict[str, list[str]]:
    """Run ``commands`` in one fresh interpreter; what each left imported."""
    script = f"HEAVY = {HEAVY!r}\nROOT = {str(root)!r}\nCOMMANDS = {commands!r}\n" + PROBE
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, check=False
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report: dict[str, list[str]] = json.loads(line.removeprefix("REPORT "))
    return report


def test_no_read_only_command_imports_torch_or_alembic(tmp_path: Path) -> None:
    report = probe(make_run(tmp_path / "run"), READS)
    assert list(report) == [" ".join(args) for args in READS] + ["RunReader, resolve"]
    offenders = {command: found for command, found in report.items() if found}
    assert offenders == {}, f"a read imported torch or Alembic (or failed): {offenders}"


def test_the_probe_sees_an_import_of_torch(tmp_path: Path) -> None:
    """The guard above can fail: ``ckptdb demo``'s module imports torch, and is seen."""
    report = probe(make_run(tmp_path / "run"), [["latest", "ROOT"]])
    assert report["latest ROOT"] == []
    script = "import ckptdb.cli.demo\n"
    proc = subprocess.run(
        [sys.executable, "-c", script + "import sys; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    assert "'torch'" in proc.stdout


def test_a_ledger_at_an_older_revision_still_migrates_through_alembic(tmp_path: Path) -> None:
    """The fast path is taken at :data:`~ckptdb.ledger.engine.HEAD_REVISION` only: a ledger
    one revision older reads as ``older`` and is upgraded by Alembic."""
    from alembic import command

    root = make_run(tmp_path / "run")
    ledger = engine.open_ledger(engine.default_sqlite_url(root))
    try:
        with ledger.engine.begin() as conn:
            cfg = engine.alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "-1")
        assert ledger.heads() != (engine.HEAD_REVISION,)
        assert ledger.schema() == "older"
        ledger.migrate()
        assert ledger.heads() == (engine.HEAD_REVISION,)
        assert ledger.schema() == "current"
    finally:
        ledger.dispose()


def test_head_revision_is_the_newest_migration() -> None:
    """A new migration must move :data:`~ckptdb.ledger.engine.HEAD_REVISION` with it."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(engine.alembic_config())
    assert script.get_heads() == [engine.HEAD_REVISION]


@pytest.mark.parametrize("package", ["ckptdb", "ckptdb.storage"])
def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error(
    package: str,
) -> None:
    """The lazy names (:mod:`ckptdb.lazy`) are the package's ``__all__``, each the object its
    module defines; a misspelt one raises as a plain module's would."""
    import importlib

    module = importlib.import_module(package)
    assert set(module._PUBLIC) == set(module.__all__) - {"__version__"}
    for name, where in module._PUBLIC.items():
        defined = getattr(importlib.import_module(where, package), name)
        assert getattr(module, name) is defined, name
        assert name in dir(module)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        module.Nope  # noqa: B018
