"""Each framework integration loses its machine and resumes, on the default SQLite ledger.

The run trains, a replicator copies its checkpoints and its ledger to SeaweedFS
(a real S3 server), the whole run directory (checkpoints and ledger) is
deleted, and the same training command with one extra option (``remote=``,
``--ckptdb-remote``) resumes from the newest copied checkpoint: the open
brings the ledger back from its copy (:mod:`ckptdb.ledgercopy`), then the
checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckptdb import Replicator, RunReader

pytestmark = pytest.mark.timeout(180)


def kinds(root: Path) -> list[str]:
    with RunReader(root) as reader:
        return [e.kind for e in reader.events(limit=1000)]


def test_lightning_resumes_a_lost_machine_from_the_url(tmp_path: Path, s3_url: str) -> None:
    from lightninglib import Tiny, trainer

    from ckptdb.integrations.lightning import ModelCheckpoint, default_ledger

    d = tmp_path / "ckpts"
    ledger = default_ledger(d)
    trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1)], max_epochs=2).fit(Tiny())
    with Replicator(ledger, s3_url) as replicator:
        assert len(replicator.replicate()) == 2  # epoch=0-step=4, epoch=1-step=8
    whole = (d / "epoch=1-step=8.ckpt").read_bytes()
    shutil.rmtree(d)
    shutil.rmtree(ledger)  # the machine is gone with its ledger

    t = trainer(tmp_path, [ModelCheckpoint(dirpath=d, save_top_k=-1, remote=s3_url)], max_epochs=3)
    t.fit(Tiny(), ckpt_path="last")
    assert t.ckpt_path == str(d / "epoch=1-step=8.ckpt")
    assert t.global_step == 12  # resumed at 8, one more epoch
    assert (d / "epoch=1-step=8.ckpt").read_bytes() == whole
    with RunReader(ledger) as reader:
        assert [c.step for c in reader.checkpoints("checkpoints")] == [8, 12]
    assert "ledger_restored" in kinds(ledger)


def test_the_hf_trainer_resumes_a_lost_machine_from_the_url(tmp_path: Path, s3_url: str) -> None:
    from hflib import dataset, tiny_model, training_args

    from ckptdb.integrations.transformers import STREAM, Trainer

    out = tmp_path / "out"
    Trainer(model=tiny_model(), args=training_args(out), train_dataset=dataset()).train()
    with Replicator(out, s3_url) as replicator:
        assert len(replicator.replicate()) == 3  # checkpoint-4, -8, -12
    shutil.rmtree(out)

    t = Trainer(
        model=tiny_model(),
        args=training_args(out, max_steps=16),
        train_dataset=dataset(),
        remote=s3_url,
    )
    t.train(resume_from_checkpoint=True)
    with RunReader(out) as reader:
        attempt = reader.attempts()[-1]
        source = next(c for c in reader.checkpoints(STREAM) if c.id == attempt.resumed_from_id)
    assert source.step == 12
    assert t.state.global_step == 16
    assert "ledger_restored" in kinds(out)


def test_accelerate_resumes_a_lost_machine_from_the_url(tmp_path: Path, s3_url: str) -> None:
    from acceleratelib import Loop

    from ckptdb.integrations.accelerate import Checkpoints

    root = tmp_path / "run"
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(3, ckpts.save)
    with Replicator(root, s3_url) as replicator:
        assert len(replicator.replicate()) == 3
    shutil.rmtree(root)

    again = Loop(seed=1)
    with Checkpoints(again.accelerator, root, remote=s3_url) as ckpts:
        assert ckpts.resume() == 3
        assert ckpts.latest() == ckpts.resumed
    assert "ledger_restored" in kinds(root)


def test_deepmd_resumes_a_lost_machine_from_the_url(tmp_path: Path, s3_url: str) -> None:
    from deepmdlib import dp, make_run_dir, output

    root = make_run_dir(tmp_path / "run", numb_steps=40)
    first = dp(root, "--pt", "train", "input.json")
    assert first.returncode == 0, output(first)
    with Replicator(root, s3_url) as replicator:
        replicator.replicate()
    config = json.loads((root / "input.json").read_text())
    shutil.rmtree(root)  # the machine is gone; the user's configuration and data are not
    root = make_run_dir(tmp_path / "run", numb_steps=60)
    assert json.loads((root / "input.json").read_text())["model"] == config["model"]

    again = dp(
        root, "--pt", "train", "input.json", "--restart", "latest", "--ckptdb-remote", s3_url
    )
    assert again.returncode == 0, output(again)
    with RunReader(root) as reader:
        resumed = [e.step for e in reader.events(limit=1000) if e.kind == "resumed"]
        latest = reader.latest()
    assert resumed == [40]
    assert latest is not None and latest.step == 60
    assert "ledger_restored" in kinds(root)
