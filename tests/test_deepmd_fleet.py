"""DeePMD-kit runs on the fleet features: a PostgreSQL ledger shared by two ranks, a
replicator copying the run to a real S3 server (SeaweedFS), and a lost machine
resumed on an empty directory from those copies with ``--restart latest
--ckptdb-remote URL``.

The run uses DeePMD's stock layout (periodic checkpoints in ``ckpts/``, best
ones beside ``save_ckpt``), so the copies and the restore span the run's two
checkpoint directories. Both PyTorch backends; every run a subprocess with a
hard timeout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("deepmd")

from click.testing import CliRunner
from deepmdlib import VALIDATING, dp, make_run_dir, output, torchrun

from ckptdb import RunReader
from ckptdb.cli import main as ckptdb_cli

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("no_db_url_from_environment")]

#: DeePMD-kit's two PyTorch backends, as ``dp`` takes them.
BACKENDS = [pytest.param("--pt", id="pt"), pytest.param("--pt-expt", id="pt-expt")]


def stock_layout(root: Path, numb_steps: int) -> Path:
    return make_run_dir(
        root,
        validating=VALIDATING,
        numb_steps=numb_steps,
        enable_ema=True,
        save_dir="ckpts",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lost_machine_resumes_from_its_copies_on_a_postgresql_ledger(
    tmp_path: Path, backend: str, pg_url: str, s3_url: str
) -> None:
    """Two ranks train 40 steps with the ledger on PostgreSQL; ``ckptdb replicate``
    copies every committed checkpoint; the run directory is deleted (the machine is
    gone) and made again from the job's inputs alone (``input.json``, the data). One
    rank then resumes with ``--restart latest --ckptdb-remote URL``: the ledger brings
    back the newest whole copy of each stream, DeePMD loads step 40 and trains on to
    60, and the run checks clean."""
    root = stock_layout(tmp_path / "run", numb_steps=40)
    ledger = ["--ckptdb-db-url", pg_url]
    first = torchrun(root, backend, "train", "input.json", *ledger)
    assert first.returncode == 0, output(first)
    assert not (root / "ckptdb.sqlite").exists()  # the ledger is the PostgreSQL one
    with RunReader(root, db_url=pg_url) as reader:
        trained = {c.stream: c for c in (reader.latest(s) for s in ("model", "best")) if c}
        assert {c.world_size for c in trained.values()} == {2}
    result = CliRunner().invoke(
        ckptdb_cli, ["replicate", str(root), "--to", s3_url, "--db-url", pg_url]
    )
    assert result.exit_code == 0, result.output
    with RunReader(root, db_url=pg_url) as reader:
        copied = {(r.stream, r.step) for r in reader.replicas() if r.state == "replicated"}
        committed = {(c.stream, c.step) for c in reader.checkpoints(states=("committed",))}
    assert copied == committed and ("model", 40) in copied
    assert {"model", "model_ema", "best", "best_ema"} <= {stream for stream, _ in copied}

    shutil.rmtree(root)  # the machine is lost: nothing of the run directory is left
    stock_layout(root, numb_steps=60)  # the job's inputs, on a new machine
    again = dp(
        root, backend, "train", "input.json", "--restart", "latest", *ledger,
        "--ckptdb-remote", s3_url, timeout=200,
    )  # fmt: skip
    assert again.returncode == 0, output(again)
    with RunReader(root, db_url=pg_url) as reader:
        resumed = [e for e in reader.events(limit=1000) if e.kind == "resumed"]
        latest = reader.latest("model")
        best = reader.best("best")
    assert [(e.step, e.checkpoint_id) for e in resumed] == [(40, trained["model"].id)]
    assert latest is not None and latest.step == 60
    assert latest.path == root.resolve() / "ckpts" / "model.ckpt-60.pt"
    assert all(c.path.is_file() for c in best)  # restored (or saved again) beside save_ckpt
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root), "--db-url", pg_url, "--load"])
    assert result.exit_code == 0 and "consistent" in result.output, result.output
