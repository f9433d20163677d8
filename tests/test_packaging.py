"""The built wheel ships the migrations and works from a fresh venv outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = (
    "ckptdb/migrations/env.py",
    "ckptdb/migrations/script.py.mako",
    "ckptdb/migrations/versions/0001_initial.py",
    "ckptdb/migrations/versions/0002_pins_evaluations.py",
    "ckptdb/migrations/versions/0003_bigint_steps.py",
    "ckptdb/integrations/common.py",
    "ckptdb/integrations/adopt.py",
    "ckptdb/integrations/lightning/callback.py",
    "ckptdb/integrations/lightning/layout.py",
    "ckptdb/integrations/transformers/trainer.py",
    "ckptdb/integrations/transformers/layout.py",
    "ckptdb/integrations/accelerate/checkpoints.py",
    "ckptdb/integrations/accelerate/layout.py",
    "ckptdb/integrations/deepmd/layout.py",
    "ckptdb/integrations/deepmd/train.py",
    "ckptdb/integrations/deepmd/__main__.py",
    "ckptdb/integrations/lazy.py",
    "ckptdb/py.typed",
)
# What is never part of a source tree that gets built (see .gitignore).
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    "build",
    "dist",
    ".venv",
    "venv",
    ".pytest_cache",
    ".ruff_cache",
    ".mypy_cache",
    ".hypothesis",
    "runs",
)

pytestmark = pytest.mark.timeout(600)


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=540, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the checkout's sources.

    pip builds a local directory in place, so the build runs on a copy of the
    checkout: it leaves no build/ or egg-info behind in the working tree and
    cannot race with another build there.
    """
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE, symlinks=True)
    out = base / "dist"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(source),
        ],
        cwd=base,
    )
    [built] = out.glob("ckptdb-*.whl")
    return built


def test_wheel_ships_the_migrations_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"{wheel.name} lacks {missing}; it has {sorted(names)}"
    assert not any(name.startswith(("tests/", "migrations/")) for name in names), sorted(names)


def test_wheel_declares_its_runtime_dependencies(wheel):
    with zipfile.ZipFile(wheel) as zf:
        [meta_name] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
    requires = {
        req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
        for req in meta.get_all("Requires-Dist", [])
        if "extra ==" not in req
    }
    assert {"torch", "sqlalchemy", "alembic", "filelock", "xxhash"} <= requires, requires
    torch_req = next(r for r in meta.get_all("Requires-Dist", []) if r.startswith("torch"))
    assert ">=2.6" in torch_req.replace(" ", ""), torch_req
    assert meta["Requires-Python"].replace(" ", "") == ">=3.10"


SMOKE = """
    import sys
    from pathlib import Path

    venv = Path(sys.argv[1]).resolve()
    root = Path(sys.argv[2])

    import ckptdb
    import torch
    from ckptdb import CheckpointManager, Keep
    from ckptdb.ledger.engine import migrations_dir

    here = Path(ckptdb.__file__).resolve()
    assert venv in here.parents, f"ckptdb imported from {here}, not from {venv}"
    assert venv in migrations_dir().resolve().parents, migrations_dir()

    with CheckpointManager(root, streams={"model": Keep(last=2)}) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, model={"w": torch.arange(4.0) * step})
        loaded = mgr.load()
        assert torch.equal(loaded["w"], torch.arange(4.0) * 3), loaded
        assert [c.step for c in mgr.checkpoints()] == [2, 3]
    with CheckpointManager(root) as mgr:  # reopened: the stored schema is current
        assert mgr.policies == {"model": Keep(last=2)}
        assert torch.equal(mgr.load(2)["w"], torch.arange(4.0) * 2)
    print("smoke ok", here)
"""


def test_installed_wheel_opens_a_ledger_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "fresh-venv"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)])

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = elsewhere / "smoke.py"
    script.write_text(textwrap.dedent(SMOKE))
    # Dependencies (torch, sqlalchemy, ...) come from this venv's site-packages
    # without a download. Its editable ckptdb is not importable from there: an
    # editable install works through a .pth file, which PYTHONPATH does not run.
    paths = sysconfig.get_paths()
    site = os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTHON", "VIRTUAL_ENV", "CKPTDB"))
    }
    env["PYTHONPATH"] = site
    root = tmp_path / "run"
    result = run([str(python), str(script), str(venv), str(root)], cwd=elsewhere, env=env)
    assert "smoke ok" in result.stdout
    assert REPO not in Path(result.stdout.split()[-1]).parents
    assert (root / "ckptdb.sqlite").is_file()

    # the wheel's console script: the quick read answers, and declines to the full command
    ckptdb = venv / "bin" / "ckptdb"
    latest = run([str(ckptdb), "latest", str(root)], cwd=elsewhere, env=env)
    assert latest.stdout.strip().endswith("step-000000003.pt"), latest.stdout
    refused = subprocess.run(
        [str(ckptdb), "latest", str(root), "--stream", "nope"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1 and "no stream 'nope'" in refused.stderr, refused.stderr
    usage = run([str(python), "-m", "ckptdb", "--help"], cwd=elsewhere, env=env)
    assert usage.stdout.startswith("Usage: ckptdb "), usage.stdout
