"""The cold case: a read-only ``ckptdb`` command, in a fresh process, on a run of many checkpoints.

What a user types in a shell ("what is my latest checkpoint?") starts a new
interpreter every time, so its import is most of its cost. Each command runs
as a real process (``ckptdb ...``), side by side with the ``sqlite3`` shell
running the same question's SQL on the same ledger file: the floor of any
answer that starts a process and opens the database. The notes give each
command's median in seconds (the target on the reference machine is 0.3 s)
and, for scale, a fresh ``python -c "import torch"``.

The run is built directly (rows and small files, as the restart case builds
its runs): ``count`` checkpoints of ``model``, a top-3 ``best`` stream, and
one ``loss`` point per step.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .cases import insert_committed
from .harness import Comparison, compare

BASELINE = "sqlite3 shell: latest"
#: The ``sqlite3`` shell; where it is not installed, the same query through Python's
#: own sqlite3 module in an isolated interpreter (a few ms more: its start).
SQLITE = (
    ["sqlite3"]
    if shutil.which("sqlite3")
    else [
        sys.executable,
        "-I",
        "-c",
        "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchall())",
    ]
)
#: Each command with the SQL a ``sqlite3`` user would type for the same answer.
COMMANDS: dict[str, tuple[list[str], str]] = {
    "latest": (["latest"], "SELECT path FROM latest_checkpoints WHERE stream = 'model'"),
    "best": (["best"], "SELECT step, path, metric FROM best_checkpoints ORDER BY rank"),
    "status": (["status"], "SELECT stream, count(*) FROM checkpoints GROUP BY stream"),
    "sql": (
        ["sql", "SELECT count(*) FROM checkpoints"],
        "SELECT count(*) FROM checkpoints",
    ),
    "history": (
        ["history", "--metric", "loss"],
        "SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step",
    ),
    "list": (["list"], "SELECT stream, step, path FROM checkpoints ORDER BY stream, step"),
}
#: ``check`` hashes every committed file and stats each again (its dry-run reconcile):
#: its floor is reading the run's files, not starting a process, so it has its own note
#: and threshold and stays out of the slowest command's; sqlite3's part is the integrity
#: check it runs too.
CHECK = (["check"], "PRAGMA integrity_check")


def make_run(root: Path, count: int) -> None:
    """``count`` committed checkpoints of ``model`` (rows and files made directly), a
    top-3 ``best`` stream saved for real, and a ``loss`` point per step."""
    from ckptdb import CheckpointManager, Keep, TopK
    from ckptdb.storage import checkpoint_name, hash_file

    streams = {"model": Keep(last=None), "best": TopK(3, "val_loss")}
    with CheckpointManager(root, streams=streams) as mgr:
        for step, val in enumerate([3.0, 1.0, 2.0]):
            tensor = {"w": torch.full((2,), float(step))}
            saved = mgr.save(step, metrics={"val_loss": val}, model=tensor, best=tensor)
        first = saved["model"]
        run_id, attempt_id = mgr.run_id, mgr.attempt_id
    data, info = first.path.read_bytes(), hash_file(first.path)
    rows = []
    for step in range(3, count):
        (first.path.parent / checkpoint_name(step)).write_bytes(data)
        rel = f"model/{checkpoint_name(step)}"
        stamp = "2026-01-01 00:00:00"
        rows.append((run_id, "model", step, attempt_id, rel, "committed", info.size, info.hash))
        rows[-1] += (stamp, stamp)
    points = [(run_id, attempt_id, step, "loss", 1.0 / (step + 1), 0.0) for step in range(count)]
    con = sqlite3.connect(root / "ckptdb.sqlite")
    with con:
        insert_committed(con, rows)
        con.executemany(
            "INSERT INTO metrics (run_id, attempt_id, step, name, value, wall_time)"
            " VALUES (?,?,?,?,?,?)",
            points,
        )
        con.execute(
            "UPDATE pointers SET checkpoint_id = (SELECT MAX(id) FROM checkpoints"
            " WHERE stream = 'model') WHERE name = 'latest:model'"
        )
    con.close()


def _process(command: list[str]) -> Any:
    def run() -> None:
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()}")

    return run


def cold(work: Path, count: int, reps: int) -> Comparison:
    """Every command of :data:`COMMANDS` and :data:`CHECK`, and ``sqlite3`` running its
    SQL, as processes."""
    root = work / "run"
    make_run(root, count)
    ledger = str(root / "ckptdb.sqlite")
    script = Path(sys.executable).with_name("ckptdb")
    ckptdb = [str(script)] if script.exists() else [sys.executable, "-m", "ckptdb"]
    contenders = {BASELINE: _process([*SQLITE, ledger, COMMANDS["latest"][1]])}
    for name, (args, query) in {**COMMANDS, "check": CHECK}.items():
        contenders[f"ckptdb {name}"] = _process([*ckptdb, args[0], str(root), *args[1:]])
        if name != "latest":
            contenders[f"sqlite3 shell: {name}"] = _process([*SQLITE, ledger, query])
    contenders["python -c 'import torch' (for scale)"] = _process(
        [sys.executable, "-c", "import torch"]
    )
    try:
        result = compare(
            f"cold read-only command, {count} checkpoints", contenders, baseline=BASELINE, reps=reps
        )
    finally:
        shutil.rmtree(work)
    med = result.medians()
    for name in COMMANDS:
        result.notes[f"ckptdb {name} (s)"] = round(med[f"ckptdb {name}"], 3)
    result.notes["slowest command (s)"] = round(max(med[f"ckptdb {n}"] for n in COMMANDS), 3)
    result.notes["ckptdb check (s)"] = round(med["ckptdb check"], 3)
    result.notes["target (s)"] = 0.3
    return result
