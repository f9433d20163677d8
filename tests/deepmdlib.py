"""A tiny DeePMD-kit training problem, and running ``dp --pt train`` through ckptdb.

The system and its configuration are :mod:`benchmarks.deepmd_system` (the
benchmark trains on the same one): a Lennard-Jones-like pair potential,
twelve atoms, the smallest ``se_e2_a`` model, a few seconds of training for
a hundred steps; most of a run's time is importing DeePMD-kit.

Every training run is a subprocess (``python tests/deepmd_run.py ...``, which
runs ``ckptdb.integrations.deepmd``'s ``main`` with the test-only faults of
:mod:`deepmd_run`), one thread each, with a hard timeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.deepmd_system import (
    CONFIG,
    SPEED_ENV,
    VALIDATING,
    make_run_dir,
    write_system,
)

__all__ = [
    "CONFIG",
    "SPEED_ENV",
    "VALIDATING",
    "dp",
    "left_alive",
    "make_run_dir",
    "output",
    "torchrun",
    "validation_log",
    "write_system",
]

TESTS = Path(__file__).resolve().parent
RUNNER = TESTS / "deepmd_run.py"
STOCK = TESTS / "deepmd_stock.py"  # DeePMD-kit's own dp, without ckptdb
REPO = TESTS.parent


def validation_log(path: Path) -> dict[int, float]:
    """Step -> the first metric column (E_MAE) of DeePMD's ``val.log``-style file."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            step, value = line.split()[:2]
            found[int(step)] = float(value)
    return found


def dp(
    cwd: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    stock: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python tests/deepmd_run.py ARGS`` (ckptdb's ``dp``; ``stock``: DeePMD-kit's own,
    ``tests/deepmd_stock.py``) in ``cwd``; never raises on a non-zero exit (the caller
    asserts on it, with the output in the message)."""
    full_env = {**os.environ, **SPEED_ENV, **(env or {})}
    full_env.pop("CKPTDB_DB_URL", None)  # the run's own SQLite ledger
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    return subprocess.run(
        [sys.executable, str(STOCK if stock else RUNNER), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def torchrun(
    cwd: Path,
    *args: str,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    timeout: float = 150,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=nproc tests/deepmd_run.py ARGS`` in ``cwd``:
    ckptdb's ``dp`` on ``nproc`` CPU ranks (gloo). Every rank's output goes to the one
    captured stdout/stderr; never raises on a non-zero exit."""
    full_env = {**os.environ, **SPEED_ENV, **(env or {})}
    full_env.pop("CKPTDB_DB_URL", None)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", str(RUNNER), *args]
    # on a timeout torchrun is told to stop (SIGTERM: it stops its ranks, which run in
    # sessions of their own), then its session is killed
    with subprocess.Popen(
        command,
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.communicate(timeout=40)
            finally:
                with contextlib.suppress(ProcessLookupError):  # torchrun's session is gone
                    os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def left_alive(stderr: str) -> dict[int, str]:
    """Rank -> what ``dp`` left in memory when it ended (``TEST: rank R left alive: [...]``
    of tests/deepmd_run.py): ``[]`` when the trainer's cycles were collected in time."""
    return {int(m[1]): m[2] for m in re.finditer(r"TEST: rank (\d) left alive: (.*)", stderr)}


def output(proc: subprocess.CompletedProcess[str]) -> str:
    """The tail of a run's output, for assertion messages."""
    return (
        f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
