"""``ckptdb adopt``: the checkpoints of an existing run, registered in a ledger.

Each layout is tested on files its framework really wrote (a stock Lightning
``Trainer`` and ``ModelCheckpoint``, a stock Hugging Face ``Trainer``,
``Accelerator.save_state``) or, for DeePMD (not installed here), files of its
shape: complete checkpoints are adopted with their step and metrics, partial
ones are listed and skipped (and left alone), a dry run writes nothing, a
second run changes nothing, and the run's files are untouched. After
adopting, the ledger answers (latest, load, verify) and the framework's ckptdb
integration picks the adopted checkpoints up.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from helpers import LedgerClient, invoke, state, tree
from lightninglib import Tiny, trainer
from torch import nn

from ckptdb import CheckpointManager, Keep, RunReader, TopK
from ckptdb.errors import CkptDBError, InvalidArgumentError, LedgerLockedError
from ckptdb.integrations.adopt import adopt
from ckptdb.integrations.lightning.layout import stream_for_monitor as lightning_stream
from ckptdb.ledger.runs import ledger_beside

pytestmark = pytest.mark.usefixtures("no_db_url_from_environment")

TABLES = ("runs", "attempts", "streams", "checkpoints", "pointers", "metrics", "events")


# --------------------------------------------------------------------- helpers


def run_adopt(runner: CliRunner, root: Path, *args: Any) -> list[str]:
    """``ckptdb adopt ROOT ARGS``: must succeed; its output lines."""
    result = invoke(runner, "adopt", root, *args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout.splitlines()


def line_of(lines: list[str], name: str) -> str:
    found = [ln for ln in lines if f" {name}" in ln and not ln.startswith(("dry run", "pointed"))]
    assert len(found) == 1, (name, lines)
    return found[0]


def statuses(lines: list[str]) -> dict[str, str]:
    """{file name: adopted | would adopt | already | skipped} from the command's lines."""
    out = {}
    for line in lines:
        for verb in ("would adopt", "adopted", "already", "skipped"):
            if line.startswith(verb):
                rest = line[len(verb) :].strip()
                out[rest.split(":")[0].split("  (")[0]] = verb
    return out


def dump(root: Path, db_url: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the run's ledger (for "nothing changed")."""
    client = LedgerClient(root, db_url)
    try:
        return {t: client.rows(f"SELECT * FROM {t} ORDER BY 1, 2") for t in TABLES}
    finally:
        client.close()


def copy_run(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest, symlinks=True)
    return dest


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def under(snapshot: dict[str, str], prefix: str) -> dict[str, str]:
    """The part of a :func:`tree` snapshot under ``prefix``, relative to it."""
    return {k[len(prefix) + 1 :]: v for k, v in snapshot.items() if k.startswith(prefix + "/")}


def user_files(snapshot: dict[str, str]) -> dict[str, str]:
    """A :func:`tree` snapshot without ckptdb's own files (the ledger, the lock, its owner)."""
    return {k: v for k, v in snapshot.items() if not Path(k).name.startswith("ckptdb.")}


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, (result.output, result.exception)
    assert "Traceback" not in result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


# ------------------------------------------------------------------ Lightning


@pytest.fixture(scope="module")
def lightning_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock Lightning run: top-3 by val_loss (steps 4, 8, 12; step 16 was worse) + last.ckpt."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    base = tmp_path_factory.mktemp("lightning")
    callback = ModelCheckpoint(
        dirpath=base / "ckpts", monitor="val_loss", save_top_k=3, save_last=True
    )
    trainer(base, [callback], max_epochs=4).fit(Tiny(val_losses=[3.0, 1.0, 2.0, 4.0]))
    names = sorted(p.name for p in (base / "ckpts").iterdir())
    assert names == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]
    return base / "ckpts"


def test_lightning_layout_adopts_the_top_k_and_the_integration_resumes_from_it(
    runner: CliRunner, lightning_source: Path, tmp_path: Path
) -> None:
    from ckptdb.integrations.lightning import ModelCheckpoint as LedgerCheckpoint

    dirpath = copy_run(lightning_source, tmp_path / "ckpts")
    partial = dirpath / "epoch=3-step=16.ckpt"  # a crash in the middle of Lightning's save
    partial.write_bytes((dirpath / "last.ckpt").read_bytes()[:3000])
    ledger = ledger_beside(dirpath)
    before = tree(tmp_path)

    dry = run_adopt(runner, dirpath, "--layout", "lightning", "--dry-run")
    assert tree(tmp_path) == before  # nothing written, no ledger created
    assert statuses(dry) == {
        "epoch=0-step=4.ckpt": "would adopt",
        "epoch=1-step=8.ckpt": "would adopt",
        "epoch=2-step=12.ckpt": "would adopt",
        "epoch=3-step=16.ckpt": "skipped",
        "last.ckpt": "skipped",
    }
    assert dry[-1].startswith("dry run: 3 to adopt, 0 already in the ledger, 2 skipped")

    lines = run_adopt(runner, dirpath, "--layout", "lightning")
    assert statuses(lines) == {
        name: ("adopted" if s == "would adopt" else s) for name, s in statuses(dry).items()
    }
    assert "unreadable" in line_of(lines, "epoch=3-step=16.ckpt")
    assert "alias" in line_of(lines, "last.ckpt")
    assert "val_loss=1" in line_of(lines, "epoch=1-step=8.ckpt")
    assert lines[-1] == f"3 adopted, 0 already in the ledger, 2 skipped (ledger: {ledger})"
    assert tree(dirpath) == under(before, "ckpts")  # no file changed

    with RunReader(ledger) as reader:
        assert reader.save_dir == dirpath.resolve()
        assert reader.policies == {"val_loss": Keep(last=None)}
        adopted = reader.checkpoints()
        assert [(c.stream, c.step, c.metrics) for c in adopted] == [
            ("val_loss", 4, {"val_loss": 3.0}),
            ("val_loss", 8, {"val_loss": 1.0}),
            ("val_loss", 12, {"val_loss": 2.0}),
        ]
        latest = reader.latest("val_loss")
        assert latest is not None and latest.path == dirpath.resolve() / "epoch=2-step=12.ckpt"
        assert reader.load(latest)["global_step"] == 12  # size and hash verified first
        assert reader.metric_history("val_loss") == [(4, 3.0, 1), (8, 1.0, 1), (12, 2.0, 1)]
    check = invoke(runner, "check", ledger, "--load")
    assert check.exit_code == 0, check.output

    ledger_before, files_before = dump(ledger), tree(tmp_path)
    again = run_adopt(runner, dirpath, "--layout", "lightning")
    assert statuses(again)["epoch=1-step=8.ckpt"] == "already"
    assert again[-1].startswith("0 adopted, 3 already in the ledger, 2 skipped")
    assert dump(ledger) == ledger_before  # not even a maintenance attempt
    assert tree(tmp_path) == files_before

    # a later run with ckptdb's ModelCheckpoint: resumes from the newest adopted checkpoint,
    # and its top-2 is chosen among the adopted ones and its own
    partial.unlink()
    callback = LedgerCheckpoint(dirpath=dirpath, monitor="val_loss", save_top_k=2)
    later = trainer(tmp_path, [callback], max_epochs=6)
    later.fit(Tiny(val_losses=[3.0, 1.0, 2.0, 4.0, 0.5, 5.0]), ckpt_path="last")
    with RunReader(ledger) as reader:
        best = reader.best("val_loss")
        assert [(c.step, c.metric) for c in best] == [(20, 0.5), (8, 1.0)]
        attempts = reader.attempts()
        assert attempts[-1].resumed_from_id == adopted[-1].id
    assert (dirpath / "epoch=2-step=12.ckpt").exists()  # resumed from: kept on disk, as Lightning
    assert not (dirpath / "epoch=0-step=4.ckpt").exists()  # evicted by the run's own top-2
    assert invoke(runner, "check", ledger).exit_code == 0

    # the file evicted but kept on disk is the ledger's history, never adopted again
    ledger_before = dump(ledger)
    final = statuses(run_adopt(runner, dirpath, "--layout", "lightning"))
    assert final["epoch=2-step=12.ckpt"] == "already"
    assert final["epoch=4-step=20.ckpt"] == "already"
    assert dump(ledger) == ledger_before


def test_adopting_into_a_full_top_k_never_evicts(
    runner: CliRunner, lightning_source: Path, tmp_path: Path
) -> None:
    dirpath = copy_run(lightning_source, tmp_path / "ckpts")
    ledger = ledger_beside(dirpath)
    CheckpointManager(ledger, save_dir=dirpath, streams={"val_loss": TopK(2, "val_loss")}).close()
    lines = run_adopt(runner, dirpath, "--layout", "lightning")
    # steps 4 (3.0) and 8 (1.0) fill the top-2; step 12 (2.0) would push step 4 out
    assert statuses(lines)["epoch=0-step=4.ckpt"] == "adopted"
    assert statuses(lines)["epoch=1-step=8.ckpt"] == "adopted"
    assert "is full (top-2 by val_loss (min))" in line_of(lines, "epoch=2-step=12.ckpt")
    with CheckpointManager(ledger, maintenance=True) as mgr:
        assert [(c.step, c.state) for c in mgr.checkpoints(states=("committed", "deleted"))] == [
            (4, "committed"),
            (8, "committed"),
        ]
        assert mgr.check() == []
        assert mgr.policies["val_loss"] == TopK(2, "val_loss")  # its stored policy stays


@pytest.mark.parametrize("monitor", [None, "val_loss", "val/acc", "step", ".x.", "a" * 70])
def test_lightning_stream_names_match_the_integration(monitor: str | None) -> None:
    from ckptdb.integrations.lightning import ModelCheckpoint as LedgerCheckpoint

    callback = LedgerCheckpoint(monitor=monitor)
    assert lightning_stream(monitor) == callback.main_stream
    assert lightning_stream(monitor) + ".last" == callback.last_stream


# --------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stock Trainer's output_dir: checkpoint-2, -4, -6, evaluated at each save."""
    from hflib import dataset, tiny_model, training_args
    from transformers import Trainer

    out = tmp_path_factory.mktemp("hf") / "out"
    args = training_args(out, max_steps=6, save_steps=2, eval_strategy="steps", eval_steps=2)
    Trainer(model=tiny_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8)).train()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return out


def test_transformers_layout_adopts_complete_checkpoint_dirs(
    runner: CliRunner, hf_source: Path, tmp_path: Path
) -> None:
    from hflib import dataset, tiny_model, training_args
    from transformers import GPT2LMHeadModel

    from ckptdb.integrations.transformers import Trainer as LedgerTrainer

    out = copy_run(hf_source, tmp_path / "out")
    (out / "checkpoint-6" / "trainer_state.json").unlink()  # the Trainer writes it last
    (out / "checkpoint-8").mkdir()  # a save that never got going
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-10")
    state_file = out / "checkpoint-10" / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "global_step": 10}))
    truncate(out / "checkpoint-10" / "optimizer.pt")
    before = tree(tmp_path)

    dry = run_adopt(runner, out, "--layout", "transformers", "--dry-run")
    assert tree(tmp_path) == before
    lines = run_adopt(runner, out, "--layout", "transformers")
    expected = {
        "checkpoint-2": "adopted",
        "checkpoint-4": "adopted",
        "checkpoint-6": "skipped",
        "checkpoint-8": "skipped",
        "checkpoint-10": "skipped",
    }
    assert statuses(lines) == expected
    assert statuses(dry) == {k: "would adopt" if v == "adopted" else v for k, v in expected.items()}
    assert "no trainer_state.json" in line_of(lines, "checkpoint-6")
    assert "optimizer.pt" in line_of(lines, "checkpoint-10")
    changed = {
        k for k in set(before) | set(tree(tmp_path)) if before.get(k) != tree(tmp_path).get(k)
    }
    assert changed == {"out/ckptdb.sqlite", "out/ckptdb.lock", "out/ckptdb.owner"} | {
        k for k in changed if k.startswith("out/ckptdb.sqlite-")
    }

    with CheckpointManager(out, maintenance=True) as mgr:
        assert mgr.save_dir == out.resolve()
        found = mgr.checkpoints("checkpoints")
        assert [c.step for c in found] == [2, 4]
        assert set(found[1].metrics) >= {"eval_loss", "loss", "learning_rate"}
        latest = mgr.verify("latest", stream="checkpoints")  # size and hash of the tree
        assert latest.path == out.resolve() / "checkpoint-4"
        assert mgr.check() == []
    GPT2LMHeadModel.from_pretrained(latest.path)  # the framework's own loader

    ledger_before = dump(out)
    again = run_adopt(runner, out, "--layout", "transformers")
    assert again[-1].startswith("0 adopted, 2 already in the ledger, 3 skipped")
    assert dump(out) == ledger_before

    # ckptdb's Trainer resumes from the newest adopted checkpoint
    for name in ("checkpoint-6", "checkpoint-8", "checkpoint-10"):
        shutil.rmtree(out / name)
    later = LedgerTrainer(
        model=tiny_model(),
        args=training_args(out, max_steps=6, save_steps=2),
        train_dataset=dataset(),
    )
    later.train(resume_from_checkpoint=True)
    with RunReader(out) as reader:
        assert reader.attempts()[-1].resumed_from_id == latest.id
        assert reader.latest("checkpoints").step == 6  # type: ignore[union-attr]


# ----------------------------------------------------------------- accelerate


@pytest.fixture(scope="module")
def accelerate_source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project_dir with checkpoints/checkpoint_0..2 from Accelerator.save_state."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    root = tmp_path_factory.mktemp("accelerate") / "project"
    config = ProjectConfiguration(project_dir=str(root), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Linear(4, 2))
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        accelerator.backward(model(torch.randn(3, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield root


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
def test_accelerate_layout_adopts_save_state_dirs(
    runner: CliRunner, accelerate_source: Path, tmp_path: Path, backend: str | None
) -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    root = copy_run(accelerate_source, tmp_path / "project")
    ckpts = root / "checkpoints"
    shutil.copytree(ckpts / "checkpoint_2", ckpts / "checkpoint_3")
    (ckpts / "checkpoint_3" / "random_states_0.pkl").unlink()  # save_state writes it last
    shutil.copytree(ckpts / "checkpoint_2", ckpts / "checkpoint_4")
    truncate(ckpts / "checkpoint_4" / "optimizer.bin")
    (ckpts / "checkpoint_5").mkdir()
    url = ["--db-url", backend] if backend else []
    before = tree(tmp_path)

    dry = run_adopt(runner, root, "--layout", "accelerate", "--dry-run", *url)
    assert tree(tmp_path) == before
    assert dry[-1].startswith("dry run: 3 to adopt, 0 already in the ledger, 3 skipped")
    lines = run_adopt(runner, root, "--layout", "accelerate", *url)
    assert statuses(lines) == {
        "checkpoints/checkpoint_0": "adopted",
        "checkpoints/checkpoint_1": "adopted",
        "checkpoints/checkpoint_2": "adopted",
        "checkpoints/checkpoint_3": "skipped",
        "checkpoints/checkpoint_4": "skipped",
        "checkpoints/checkpoint_5": "skipped",
    }
    assert "random_states_0.pkl" in line_of(lines, "checkpoints/checkpoint_3")
    assert "optimizer.bin" in line_of(lines, "checkpoints/checkpoint_4")
    assert tree(ckpts) == under(before, "project/checkpoints")

    with CheckpointManager(root, db_url=backend, maintenance=True) as mgr:
        assert mgr.save_dir == ckpts.resolve()
        assert mgr.policies == {"checkpoints": Keep(last=None)}
        assert [c.step for c in mgr.checkpoints()] == [0, 1, 2]
        latest = mgr.verify("latest", stream="checkpoints")
        assert latest.path == ckpts.resolve() / "checkpoint_2"
        assert mgr.check() == []
    accelerator = Accelerator(cpu=True)
    try:
        model = accelerator.prepare(nn.Linear(4, 2))
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.load_state(str(latest.path))  # the framework's own loader
        assert optimizer is not None
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    ledger_before = dump(root, backend)
    again = run_adopt(runner, root, "--layout", "accelerate", *url)
    assert again[-1].startswith("0 adopted, 3 already in the ledger, 3 skipped")
    assert dump(root, backend) == ledger_before


# --------------------------------------------------------------------- DeePMD


def deepmd_file(path: Path, stored_step: int) -> None:
    """What DeePMD-kit's PyTorch trainer saves: {"model": wrapper state, "optimizer": ...},
    the step it had just done in model["_extra_state"]["train_infos"]["step"]."""
    torch.manual_seed(stored_step)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    weights: dict[str, Any] = {f"model.Default.{k}": v for k, v in model.state_dict().items()}
    weights["_extra_state"] = {
        "model_params": {"type_map": ["O", "H"], "descriptor": {"type": "se_e2_a", "rcut": 6.0}},
        "train_infos": {"lr": 1e-3, "step": stored_step},
    }
    torch.save({"model": weights, "optimizer": optimizer.state_dict()}, path)


@pytest.fixture
def deepmd_dir(tmp_path: Path) -> Path:
    """Steps 100-300 whole; 400 truncated, yet named by the alias and the pointer;
    500 stores another step than its name says."""
    root = tmp_path / "train"
    root.mkdir()
    for step in (100, 200, 300, 400):
        deepmd_file(root / f"model.ckpt-{step}.pt", step - 1)
    truncate(root / "model.ckpt-400.pt")
    deepmd_file(root / "model.ckpt-500.pt", 7)
    os.symlink("model.ckpt-400.pt", root / "model.ckpt.pt")
    (root / "checkpoint").write_text("model.ckpt-400.pt")
    (root / "lcurve.out").write_text("# step rmse\n")
    return root


def test_deepmd_layout_adopts_and_repoints_the_alias_and_the_pointer(
    runner: CliRunner, deepmd_dir: Path, tmp_path: Path
) -> None:
    root = deepmd_dir
    before = tree(tmp_path)
    dry = run_adopt(runner, root, "--layout", "deepmd", "--dry-run")
    assert tree(tmp_path) == before
    assert "would point  model.ckpt.pt -> model.ckpt-300.pt" in dry
    assert "would point  checkpoint -> model.ckpt-300.pt" in dry

    lines = run_adopt(runner, root, "--layout", "deepmd")
    assert statuses(lines) == {
        "model.ckpt-100.pt": "adopted",
        "model.ckpt-200.pt": "adopted",
        "model.ckpt-300.pt": "adopted",
        "model.ckpt-400.pt": "skipped",
        "model.ckpt-500.pt": "skipped",
    }
    assert "(7) does not match its name" in line_of(lines, "model.ckpt-500.pt")
    assert "pointed      model.ckpt.pt -> model.ckpt-300.pt" in lines
    after = tree(tmp_path)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert {k for k in changed if not k.startswith("train/ckptdb.")} == {
        "train/model.ckpt.pt",
        "train/checkpoint",
    }
    assert (root / "model.ckpt.pt").is_symlink()  # DeePMD's alias stays a symlink
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-300.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-300.pt"
    assert (
        torch.load(root / "model.ckpt.pt", weights_only=True)["model"]["_extra_state"][
            "train_infos"
        ]["step"]
        == 299
    )

    with CheckpointManager(root, maintenance=True) as mgr:
        assert [(c.stream, c.step) for c in mgr.checkpoints()] == [
            ("model", 100),
            ("model", 200),
            ("model", 300),
        ]
        assert mgr.load("latest")["model"]["_extra_state"]["train_infos"]["step"] == 299
        assert mgr.check() == []

    ledger_before, files_before = dump(root), tree(tmp_path)
    again = run_adopt(runner, root, "--layout", "deepmd")
    assert not [ln for ln in again if ln.startswith("pointed")]
    assert dump(root) == ledger_before
    assert tree(tmp_path) == files_before


def test_deepmd_alias_that_is_a_regular_file_stays_one(runner: CliRunner, deepmd_dir: Path) -> None:
    root = deepmd_dir
    (root / "model.ckpt.pt").unlink()
    os.link(root / "model.ckpt-200.pt", root / "model.ckpt.pt")  # where symlinks are not possible
    run_adopt(runner, root, "--layout", "deepmd")
    alias = root / "model.ckpt.pt"
    assert not alias.is_symlink()
    assert os.path.samefile(alias, root / "model.ckpt-300.pt")


# ----------------------------------------------------------------------- glob


def write_ckpt(path: Path, value: float) -> None:
    torch.save(state(value), path)


def test_glob_layout_takes_the_step_from_the_name(runner: CliRunner, tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    for step in (1, 2, 10):
        write_ckpt(root / f"ckpt_{step}.pt", step)
    write_ckpt(root / "ckpt_3.pt", 3)
    truncate(root / "ckpt_3.pt")
    write_ckpt(root / "ckpt_final.pt", 99)  # no step in the name
    write_ckpt(root / "step-000000005.pt", 5)  # ckptdb's own naming: never adopted
    (root / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    lines = run_adopt(runner, root, "--layout", "glob", "--pattern", "*.pt")
    assert statuses(lines) == {
        "ckpt_1.pt": "adopted",
        "ckpt_2.pt": "adopted",
        "ckpt_3.pt": "skipped",
        "ckpt_10.pt": "adopted",
        "ckpt_final.pt": "skipped",
        "step-000000005.pt": "skipped",
    }
    assert "ckptdb's own naming" in line_of(lines, "step-000000005.pt")
    assert "no step in its name" in line_of(lines, "ckpt_final.pt")
    after = tree(tmp_path)
    assert {k for k in set(before) | set(after) if before.get(k) != after.get(k)} <= {
        f"run/ckptdb.{n}" for n in ("sqlite", "sqlite-wal", "sqlite-shm", "lock", "owner")
    }
    with CheckpointManager(root, maintenance=True) as mgr:
        assert [c.step for c in mgr.checkpoints("model")] == [1, 2, 10]
        assert mgr.load("latest")["b"].item() == 10.0
        report = mgr.reconcile()  # framework-named files with rows, foreign files: nothing to do
        assert report.actions == []
    assert user_files(tree(tmp_path)) == user_files(after)


def test_reconcile_treats_adopted_checkpoints_as_committed_and_foreign_files_as_yours(
    runner: CliRunner, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    for step in (1, 2, 3):
        write_ckpt(root / f"ckpt_{step}.pt", step)
    (root / "ckpt_9.pt").write_bytes(b"not a checkpoint, not adopted")
    truncate(root / "ckpt_9.pt", 1.0)
    run_adopt(runner, root, "--layout", "glob", "--pattern", "ckpt_[123].pt")
    truncate(root / "ckpt_2.pt")
    (root / "ckpt_3.pt").unlink()
    with CheckpointManager(root, maintenance=True) as mgr:
        report = mgr.reconcile()
        assert sorted((a.kind, a.path) for a in report.actions if a.kind != "repointed") == [
            ("corrupt", "ckpt_2.pt"),
            ("lost", "ckpt_3.pt"),
        ]
        assert mgr.latest("model").step == 1  # type: ignore[union-attr]
    assert (root / "ckpt_2.pt").exists() and (root / "ckpt_9.pt").exists()  # nothing deleted


def test_glob_step_regex_and_a_stream_that_only_appends(runner: CliRunner, tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(root, save_dir=root, streams={"model": Keep(last=None)}) as mgr:
        mgr.save(150, model=state(150.0))  # ckptdb wrote step 150 itself
    for epoch, step in ((1, 100), (2, 250)):
        write_ckpt(root / f"run_e{epoch}_s{step}.pt", step)
    lines = run_adopt(
        runner,
        root,
        "--layout",
        "glob",
        "--pattern",
        "run_*.pt",
        "--step-regex",
        r"_s(?P<step>\d+)",
    )
    assert "already has a checkpoint at step 150" in line_of(lines, "run_e1_s100.pt")
    assert statuses(lines)["run_e2_s250.pt"] == "adopted"
    with RunReader(root) as reader:
        assert [c.step for c in reader.checkpoints("model")] == [150, 250]
        assert reader.latest("model").step == 250  # type: ignore[union-attr]


def test_move_brings_checkpoints_into_the_runs_save_directory(
    runner: CliRunner, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    CheckpointManager(root).close()  # an existing run: its save directory is run/checkpoints
    for step in (1, 2, 3):
        write_ckpt(root / f"ckpt_{step}.pt", step)
    (root / "checkpoints").mkdir(exist_ok=True)
    (root / "checkpoints" / "ckpt_2.pt").write_bytes(b"someone else's")
    ledger_before, files_before = dump(root), tree(tmp_path)

    lines = run_adopt(runner, root, "--layout", "glob", "--pattern", "ckpt_*.pt")
    assert set(statuses(lines).values()) == {"skipped"}
    assert "--move" in line_of(lines, "ckpt_1.pt")
    assert dump(root) == ledger_before and tree(tmp_path) == files_before

    lines = run_adopt(runner, root, "--layout", "glob", "--pattern", "ckpt_*.pt", "--move")
    assert statuses(lines) == {
        "ckpt_1.pt": "adopted",
        "ckpt_2.pt": "skipped",
        "ckpt_3.pt": "adopted",
    }
    assert "already exists" in line_of(lines, "ckpt_2.pt")
    assert not (root / "ckpt_1.pt").exists() and (root / "ckpt_2.pt").exists()
    assert (root / "checkpoints" / "ckpt_2.pt").read_bytes() == b"someone else's"
    with CheckpointManager(root, maintenance=True) as mgr:
        assert [(c.path.name, c.step) for c in mgr.checkpoints("model")] == [
            ("ckpt_1.pt", 1),
            ("ckpt_3.pt", 3),
        ]
        assert mgr.load("latest")["b"].item() == 3.0
        assert mgr.check() == []


def test_a_keep_window_is_applied_by_the_next_save_not_by_adopting(
    runner: CliRunner, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, save_dir=root, streams={"model": Keep(last=2)}).close()
    for step in (1, 2, 3, 4):
        write_ckpt(root / f"ckpt_{step}.pt", step)
    lines = run_adopt(runner, root, "--layout", "glob", "--pattern", "ckpt_*.pt")
    assert lines[-1].startswith("4 adopted")
    with CheckpointManager(root) as mgr:  # a training run: reconciles, then saves
        assert [c.step for c in mgr.checkpoints("model")] == [1, 2, 3, 4]  # nothing evicted
        mgr.save(5, model=state(5.0))
        # from now on they are the run's checkpoints: its window keeps the newest two
        assert [c.step for c in mgr.checkpoints("model")] == [4, 5]
        assert mgr.check() == []
    assert sorted(p.name for p in root.glob("ckpt_*.pt")) == ["ckpt_4.pt"]


def test_a_failed_commit_moves_the_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptdb.ledger.rows

    root = tmp_path / "run"
    CheckpointManager(root).close()  # its save directory is run/checkpoints
    write_ckpt(root / "ckpt_1.pt", 1)
    original = ckptdb.ledger.rows.add_event

    def failing(session: Any, run_id: int, attempt_id: Any, kind: str, **kw: Any) -> None:
        if kind == "adopted":
            raise OSError("injected: the commit fails")
        original(session, run_id, attempt_id, kind, **kw)

    monkeypatch.setattr(ckptdb.ledger.rows, "add_event", failing)
    ledger_before = dump(root)
    with pytest.raises(OSError, match="injected") as raised:
        adopt(root, "glob", pattern="ckpt_*.pt", move=True)
    assert "moved back" in "".join(getattr(raised.value, "__notes__", []))
    assert (root / "ckpt_1.pt").exists()
    assert not (root / "checkpoints" / "ckpt_1.pt").exists()
    after = dump(root)
    assert after["checkpoints"] == ledger_before["checkpoints"] == []  # rolled back
    monkeypatch.undo()
    assert adopt(root, "glob", pattern="ckpt_*.pt", move=True).count("adopted") == 1


def test_a_ranked_stream_needs_the_metric_from_the_layout(
    runner: CliRunner, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    CheckpointManager(root, save_dir=root, streams={"model": TopK(3, "val_loss")}).close()
    write_ckpt(root / "ckpt_1.pt", 1)
    ledger_before = dump(root)
    lines = run_adopt(runner, root, "--layout", "glob", "--pattern", "ckpt_*.pt")
    assert "ranks by 'val_loss'" in line_of(lines, "ckpt_1.pt")
    assert "recorded no 'val_loss'" in line_of(lines, "ckpt_1.pt")
    assert dump(root) == ledger_before


# ------------------------------------------------------------------ bad input


BAD = {
    "missing root": (["{missing}", "--layout", "glob", "--pattern", "*.pt"], "does not exist"),
    "root is a file": (["{file}", "--layout", "glob", "--pattern", "*.pt"], "not a directory"),
    "unknown layout": (["{root}", "--layout", "orbax"], "unknown layout 'orbax'"),
    "glob without pattern": (["{root}", "--layout", "glob"], "needs --pattern"),
    "pattern escapes": (["{root}", "--layout", "glob", "--pattern", "../*.pt"], "without '..'"),
    "absolute pattern": (["{root}", "--layout", "glob", "--pattern", "/tmp/*.pt"], "relative"),
    "bad regex": (
        ["{root}", "--layout", "glob", "--pattern", "*.pt", "--step-regex", "("],
        "regex",
    ),
    "regex of two groups": (
        ["{root}", "--layout", "glob", "--pattern", "*.pt", "--step-regex", r"(\d+)_(\d+)"],
        "one group",
    ),
    "pattern for another layout": (["{root}", "--layout", "deepmd", "--pattern", "*.pt"], "glob"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_typed_line_and_changes_nothing(
    runner: CliRunner, tmp_path: Path, case: str
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    write_ckpt(root / "ckpt_1.pt", 1)
    (tmp_path / "a_file").write_text("x")
    args, expected = BAD[case]
    values = {"root": root, "missing": tmp_path / "nope", "file": tmp_path / "a_file"}
    argv = [a.format(**values) for a in args]
    before = tree(tmp_path)
    line = one_line_error(invoke(runner, "adopt", *argv))
    assert expected in line, line
    assert tree(tmp_path) == before
    debug = invoke(runner, "--debug", "adopt", *argv)
    assert isinstance(debug.exception, InvalidArgumentError), debug.exception


def test_a_live_writer_is_refused_and_nothing_changes(
    runner: CliRunner, lightning_source: Path, tmp_path: Path
) -> None:
    dirpath = copy_run(lightning_source, tmp_path / "ckpts")
    ledger = ledger_beside(dirpath)
    with CheckpointManager(ledger, save_dir=dirpath, streams={"val_loss": Keep(last=None)}):
        ledger_before, files_before = dump(ledger), tree(tmp_path)
        line = one_line_error(invoke(runner, "adopt", dirpath, "--layout", "lightning"))
        assert f"pid {os.getpid()}" in line
        with pytest.raises(LedgerLockedError):
            adopt(dirpath, "lightning")
        assert dump(ledger) == ledger_before
        assert tree(tmp_path) == files_before


def test_every_refusal_is_a_ckptdb_error() -> None:
    for name in ("orbax", ""):
        with pytest.raises(CkptDBError):
            adopt(".", name)


def test_the_earlier_import_path_of_adopt_still_works() -> None:
    from ckptdb.cli.adopt import adopt as earlier
    from ckptdb.cli.adopt import lightning_stream as earlier_stream

    assert earlier is adopt and earlier_stream is lightning_stream
