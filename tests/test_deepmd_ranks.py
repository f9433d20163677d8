"""DeePMD-kit through ckptdb on two ranks: ``torchrun`` with gloo, the real DeePMD-kit on the CPU.

DeePMD saves from rank 0 alone; a ckptdb boundary is collective, so every
rank joins each one (rank 0's plan of it, then the fixed sequence of
collectives). Three runs of two ranks each, every one a subprocess with a
hard timeout (a rank left waiting in a collective fails the test instead of
hanging it): a run with EMA and full validation whose rank 1 alone sees a NaN
gradient, a run whose rank 1 fails a checkpoint write, and its restart.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("deepmd")

from click.testing import CliRunner
from deepmdlib import VALIDATING, left_alive, make_run_dir, output, torchrun, validation_log

from ckptdb import RunReader
from ckptdb.cli import main as ckptdb_cli
from ckptdb.errors import InvalidArgumentError
from ckptdb.integrations.deepmd import config as deepmd_config

pytestmark = [pytest.mark.timeout(200), pytest.mark.usefixtures("no_db_url_from_environment")]

#: NaN gradient at optimizer step 45 on rank 1 only (after DDP's all-reduce): the
#: boundaries of step 60 (best, best_ema, model, model_ema) are refused on both ranks.
NAN_STEP = 45
REFUSED = 60


def rows(root: Path) -> dict[tuple[str, int], tuple[str, str]]:
    with RunReader(root) as reader:
        found = reader.checkpoints(states=("committed", "deleted", "pending", "aborted"))
    return {(c.stream, c.step): (c.state, c.path.name) for c in found}


def check_clean(root: Path) -> None:
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root)])
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output


def raised(stderr: str) -> dict[int, str]:
    """Rank -> the error it ended with (``TEST: rank R raised ...`` of tests/deepmd_run.py)."""
    return {int(m[1]): m[2] for m in re.finditer(r"TEST: rank (\d) raised (.*)", stderr)}


#: DeePMD-kit's two PyTorch backends, as ``dp`` takes them.
BACKENDS = [pytest.param("--pt", id="pt"), pytest.param("--pt-expt", id="pt-expt")]


@pytest.fixture(scope="module", params=BACKENDS)
def two_ranks(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> SimpleNamespace:
    root = make_run_dir(
        tmp_path_factory.mktemp("deepmd-ranks") / "run",
        enable_ema=True,
        validating=VALIDATING,
    )
    env = {"CKPTDB_TEST_NAN_STEP": str(NAN_STEP), "CKPTDB_TEST_NAN_RANK": "1"}
    proc = torchrun(root, str(request.param), "train", "input.json", env=env)
    assert proc.returncode == 0, output(proc)
    return SimpleNamespace(root=root, stderr=proc.stderr)


def test_two_ranks_train_and_every_boundary_commits_once(two_ranks: SimpleNamespace) -> None:
    root = two_ranks.root
    found = rows(root)
    saved = [20, 40, 80, 100]
    for stream in ("model", "model_ema"):
        assert sorted(step for s, step in found if s == stream) == saved
    with RunReader(root) as reader:
        committed = reader.checkpoints(states=("committed",))
        latest = reader.latest("model")
    assert {c.step for c in committed if c.stream == "model"} == {80, 100}  # max_ckpt_keep=2
    assert {c.world_size for c in committed} == {2}  # both ranks took part in every boundary
    assert latest is not None and latest.path.name == "model.ckpt-100.pt"
    # one file per checkpoint (rank 0 wrote it; no rank wrote under another name)
    written = sorted(p.name for p in root.glob("*.ckpt-*.pt"))
    assert written == sorted(c.path.name for c in committed)
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-100.pt"
    assert os.readlink(root / "model_ema.ckpt.pt") == "model_ema.ckpt-100.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-100.pt"
    check_clean(root)


def test_two_ranks_leave_no_trainer_for_the_interpreters_exit(two_ranks: SimpleNamespace) -> None:
    """DeePMD's trainer (its DDP module, the ledger, and through them the process groups)
    is collected before each rank's interpreter exits: freed during its finalization, a
    gloo worker thread aborted a rank that had trained to the end (exit status -6)."""
    assert left_alive(two_ranks.stderr) == {0: "[]", 1: "[]"}, two_ranks.stderr[-3000:]


@pytest.mark.parametrize(("stream", "log"), [("best", "val.log"), ("best_ema", "val_ema.log")])
def test_two_ranks_rank_best_checkpoints_by_rank_0s_validation(
    two_ranks: SimpleNamespace, stream: str, log: str
) -> None:
    logged = validation_log(two_ranks.root / log)
    expected = sorted((v, step) for step, v in logged.items() if step != REFUSED)[:2]
    with RunReader(two_ranks.root) as reader:
        best = reader.best(stream)
    assert [c.step for c in best] == [step for _, step in expected]
    for c in best:  # the ledger's eV/atom, val.log's meV/atom to two decimals
        assert c.metric is not None and c.metric * 1000 == pytest.approx(logged[c.step], abs=0.01)


def test_a_nan_gradient_on_rank_1_alone_refuses_the_boundary_on_both_ranks(
    two_ranks: SimpleNamespace,
) -> None:
    stderr = two_ranks.stderr
    assert f"TEST: NaN gradient at optimizer step {NAN_STEP} on rank 1" in stderr
    assert f"optimizer step {NAN_STEP} on rank 0" not in stderr
    assert not any(step == REFUSED for _, step in rows(two_ranks.root))
    # both ranks were told: each logs the refusal of each of the step's boundaries: the
    # best checkpoints DeePMD proposed at that step (a validation in its top-K, as each
    # validator's log says), then model + model_ema
    proposed = sum(
        f".ckpt-{REFUSED}.t-" in line
        for log in ("val.log", "val_ema.log")
        for line in (two_ranks.root / log).read_text().splitlines()
        if line.startswith("# saved best checkpoint:")
    )
    warnings = stderr.count(f"ckptdb: step {REFUSED} was not checkpointed")
    assert warnings == 2 * (proposed + 1), stderr[-3000:]
    with RunReader(two_ranks.root) as reader:
        tripped = [e for e in reader.events(limit=1000) if e.kind == "guard_tripped"]
    assert [e.step for e in tripped] == [REFUSED]
    assert json.loads(tripped[0].detail or "{}")["ranks"] == [1]
    assert rows(two_ranks.root)[("model", 80)][0] == "committed"  # training went on


def test_the_chiefs_metrics_are_the_ledgers(two_ranks: SimpleNamespace) -> None:
    with RunReader(two_ranks.root) as reader:
        points = reader.metric_history("val_E_MAE")
    logged = validation_log(two_ranks.root / "val.log")
    assert sorted(step for step, _, _ in points) == sorted(logged)  # once each: rank 0's
    assert {step: value for step, value, _ in points} == pytest.approx(logged)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_ranks_failed_write_publishes_nothing_then_both_ranks_resume(
    tmp_path: Path, backend: str
) -> None:
    """Rank 1's part of the step-40 boundary fails: both ranks raise the same typed
    error, nothing of step 40 is published; a restart on two ranks resumes from 20."""
    root = make_run_dir(tmp_path / "run", numb_steps=60)
    failed = torchrun(root, backend, "train", "input.json", env={"CKPTDB_TEST_FAIL_WRITE": "1:2"})
    assert failed.returncode != 0, output(failed)
    assert "TEST: write #2 fails on rank 1" in failed.stderr
    seen = raised(failed.stderr)
    assert sorted(seen) == [0, 1], output(failed)
    assert seen[0] == seen[1], seen  # the same error, word for word
    assert seen[0].startswith("PublishError: step 40 not published: write failed: rank 1: ")
    assert "injected write failure" in seen[0]
    assert seen[0].count("injected write failure") == 1  # said once, not relayed again
    assert {k: v[0] for k, v in rows(root).items()} == {
        ("model", 20): "committed",
        ("model", 40): "aborted",
    }
    assert not (root / "model.ckpt-40.pt").exists()
    assert not list(root.glob(".*ckptdb-tmp*")), list(root.iterdir())
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-20.pt"
    check_clean(root)

    resumed = torchrun(root, backend, "train", "input.json", "--restart", "latest")
    assert resumed.returncode == 0, output(resumed)
    with RunReader(root) as reader:
        committed = {c.step for c in reader.checkpoints("model", states=("committed",))}
        resumes = [e for e in reader.events(limit=1000) if e.kind == "resumed"]
    assert committed == {40, 60}
    assert [e.step for e in resumes] == [20]
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-60.pt"
    check_clean(root)


def test_sharded_training_on_several_ranks_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ZeRO/FSDP (``zero_stage`` > 0) saves on every rank: not guarded yet, refused
    before anything is opened; with one rank DeePMD drops the stage itself."""
    dist: Any = deepmd_config.torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    config = {"training": {"zero_stage": 1}}
    with pytest.raises(InvalidArgumentError, match="zero_stage=1"):
        deepmd_config.refuse_unsupported(config, tmp_path)
    deepmd_config.refuse_unsupported({"training": {"zero_stage": 0}}, tmp_path)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    deepmd_config.refuse_unsupported(config, tmp_path)
