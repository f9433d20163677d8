"""A run directory copied, moved or restored elsewhere: every command works on it.

The run's own SQLite ledger belongs to the directory it is in, wherever that
is. Reading (``status``, ``list``, ``latest``, ``history``, ``follow``,
``RunReader``) never rewrites the recorded root; the next writer does
(``check``, ``reconcile`` and ``gc`` are maintenance writers: they take the
writer lock). A ledger of release 0.1.0 (schema 0001) moved the same way is
upgraded with ``ckptdb db upgrade`` and then works too.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptdb import CheckpointManager, Keep, RunReader
from ckptdb.cli import main as ckptdb_cli

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_db_url_from_environment")]

FIXTURE_0001 = Path(__file__).parent / "data" / "ledger-0001.sqlite"


def recorded_root(root: Path) -> str:
    con = sqlite3.connect(root / "ckptdb.sqlite")
    try:
        ((found,),) = con.execute("SELECT root FROM runs").fetchall()
        return str(found)
    finally:
        con.close()


def ckptdb(*args: str) -> str:
    result = CliRunner().invoke(ckptdb_cli, list(args))
    assert result.exit_code == 0, (args, result.output)
    assert "no ckptdb run" not in result.output
    return result.output


@pytest.fixture
def moved(tmp_path: Path) -> tuple[Path, Path]:
    """A run trained at ``old``, then copied to ``new`` (``old`` stays, untouched)."""
    old = tmp_path / "disk1" / "exp"
    with CheckpointManager(old, streams={"model": Keep(last=2)}) as mgr:
        for step in (1, 2, 3):
            mgr.log_metrics(step, {"loss": 1.0 / step})
            mgr.save(step, model={"w": torch.full((2,), float(step))})
    new = tmp_path / "disk2" / "restored"
    shutil.copytree(old, new)
    return old, new


def test_reading_commands_work_on_a_copied_run_and_never_rewrite_its_root(
    moved: tuple[Path, Path],
) -> None:
    old, new = moved
    assert "step-000000003" in ckptdb("latest", str(new))
    assert str(new / "checkpoints") in ckptdb("latest", str(new))  # paths are the copy's
    listed = ckptdb("list", str(new)).splitlines()[1:]
    assert [line.split()[:3] for line in listed] == [
        ["model", "2", "committed"],
        ["model", "3", "committed"],
    ]
    assert "attempt_started" in ckptdb("status", str(new))
    assert "0.333" in ckptdb("history", str(new), "--metric", "loss")
    with RunReader(new) as reader:
        assert reader.latest("model").path == new / "checkpoints" / "model" / "step-000000003.pt"
        assert reader.load("latest")["w"][0] == 3.0
        followed = list(reader.follow("model", since=0, timeout=0.5))  # what `follow` reads
        assert [c.path.parent for c in followed] == [new / "checkpoints" / "model"] * 3
    assert recorded_root(new) == str(old.resolve())  # reading rewrote nothing


def test_maintenance_commands_work_on_a_copied_run_and_the_writer_records_the_new_root(
    moved: tuple[Path, Path],
) -> None:
    old, new = moved
    assert "consistent" in ckptdb("check", str(new))
    assert "nothing to do" in ckptdb("reconcile", "--dry-run", str(new))
    assert "nothing to do" in ckptdb("reconcile", str(new))
    assert "0 checkpoint(s) evicted" in ckptdb("gc", str(new))
    assert recorded_root(new) == str(new.resolve())
    # the original was never touched: its own ledger still names itself, and checks clean
    assert recorded_root(old) == str(old.resolve())
    assert "consistent" in ckptdb("check", str(old))
    with CheckpointManager(new) as mgr:  # and training goes on in the copy
        mgr.save(4, model={"w": torch.zeros(2)})
    assert "step-000000004" in ckptdb("latest", str(new))


def test_a_moved_ledger_of_release_0_1_0_upgrades_then_every_command_works(
    tmp_path: Path,
) -> None:
    """The fixture was written elsewhere (its recorded root is another machine's path)."""
    root = tmp_path / "restored"
    root.mkdir()
    shutil.copyfile(FIXTURE_0001, root / "ckptdb.sqlite")
    assert recorded_root(root) != str(root.resolve())
    result = CliRunner().invoke(ckptdb_cli, ["status", str(root)])
    assert result.exit_code != 0 and "ckptdb db upgrade" in result.output  # says what to run
    ckptdb("db", "upgrade", str(root))
    assert recorded_root(root) != str(root.resolve())  # upgrading is not opening a writer
    for command in (["status"], ["list"], ["history", "--metric", "loss"]):
        ckptdb(*command, str(root))
    # its checkpoint files were not restored with it: check says so, it does not refuse
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root)])
    assert "no ckptdb run" not in result.output and "Traceback" not in result.output
    assert result.exit_code in (0, 1), result.output
