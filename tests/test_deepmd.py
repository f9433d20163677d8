"""DeePMD-kit's ``dp train`` through ckptdb, both PyTorch backends (``--pt``,
``--pt-expt``), with the real DeePMD-kit on the CPU.

Every training run is a subprocess of ``tests/deepmd_run.py`` (ckptdb's entry
point plus test-only faults: a NaN gradient, a SIGKILL at a fault point) on
the tiny system of :mod:`deepmdlib`. Runs cost mostly DeePMD's import. Per
backend: one trained run shared by the tests that only read it (EMA, full
validation with best checkpoints, a NaN gradient at step 46 whose boundaries
at 60 are refused; its ``lcurve.out`` and ``val.log`` as metrics; ``dp
freeze`` on it), a crash and its restart, DeePMD's stock layout (periodic
checkpoints in ``save_dir``, best ones beside ``save_ckpt``) trained,
reconciled and resumed, and a stock DeePMD-kit run (``tests/deepmd_stock.py``)
adopted, trained on through ckptdb, then restarted by stock DeePMD-kit.
Restart resolution, names, the save directory of a layout, the version
check, the refused configurations and the log reader are tested in-process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("deepmd")

from click.testing import CliRunner
from deepmdlib import VALIDATING, dp, make_run_dir, output, validation_log
from helpers import LedgerClient

from ckptdb import CheckpointManager, RunReader
from ckptdb.cli import main as ckptdb_cli
from ckptdb.errors import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    NonFiniteGradientError,
    UnsupportedVersionError,
)
from ckptdb.integrations.contract import IntegrationLedger, LedgerOptions
from ckptdb.integrations.deepmd import compat, session, train
from ckptdb.integrations.deepmd import config as deepmd_config

pytestmark = [pytest.mark.timeout(150), pytest.mark.usefixtures("no_db_url_from_environment")]

#: The shared run: 100 steps, a boundary every 20, NaN gradient at optimizer step 45
#: (the 46th step, between the boundaries at 40 and 60).
NAN_STEP = 45
REFUSED = 60
FOREIGN = "model.ckpt-500.pt"  # a longer earlier run's remnant, no row: never ckptdb's
FOREIGN_BEST = "best.ckpt-7.t-1.pt"  # a stock run's best file: stock DeePMD deletes it at start


def rows(root: Path) -> dict[tuple[str, int], tuple[str, str]]:
    """(stream, step) -> (state, file name) of every row, read-only."""
    with RunReader(root) as reader:
        found = reader.checkpoints(states=("committed", "deleted", "pending", "aborted"))
    return {(c.stream, c.step): (c.state, c.path.name) for c in found}


def events(root: Path) -> list[Any]:
    with RunReader(root) as reader:
        return reader.events(limit=1000)


def check_clean(root: Path) -> None:
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root)])
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output


#: DeePMD-kit's two PyTorch backends, as ``dp`` takes them.
BACKENDS = [pytest.param("--pt", id="pt"), pytest.param("--pt-expt", id="pt-expt")]


def backend_of(root: Path) -> str:
    """The backend the shared run was trained with."""
    return (root.parent / "backend.txt").read_text()


@pytest.fixture(scope="module", params=BACKENDS)
def trained(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    backend = str(request.param)
    root = make_run_dir(
        tmp_path_factory.mktemp("deepmd") / "run",
        enable_ema=True,
        ema_ckpt_keep=1,
        validating=VALIDATING,
        gradient_max_norm=10.0,  # DeePMD's own guard is fed, and must defer to ckptdb's
    )
    (root / FOREIGN).write_bytes(b"not ours")  # stock DeePMD's prune deletes it at step 20
    (root / FOREIGN_BEST).write_bytes(b"not ours either")
    proc = dp(root, backend, "train", "input.json", env={"CKPTDB_TEST_NAN_STEP": str(NAN_STEP)})
    assert proc.returncode == 0, output(proc)
    (root.parent / "stderr.txt").write_text(proc.stderr)
    (root.parent / "backend.txt").write_text(backend)
    return root


# ------------------------------------------------------------- the shared run


def test_every_periodic_save_is_one_committed_boundary_of_both_streams(trained: Path) -> None:
    found = {k: v for k, v in rows(trained).items() if k[0] in ("model", "model_ema")}
    saved = [20, 40, 80, 100]
    assert sorted(step for stream, step in found if stream == "model") == saved
    assert sorted(step for stream, step in found if stream == "model_ema") == saved
    for step in saved:
        assert found[("model", step)][1] == f"model.ckpt-{step}.pt"
        assert found[("model_ema", step)][1] == f"model_ema.ckpt-{step}.pt"
    with RunReader(trained) as reader:
        for step in saved:  # one boundary: one commit for both rows
            both = reader.checkpoints(states=("committed", "deleted"))
            pair = [c for c in both if c.step == step and c.stream.startswith("model")]
            assert len(pair) == 2
            assert len({c.committed_at for c in pair}) == 1, pair


def test_retention_is_the_ledgers(trained: Path) -> None:
    """max_ckpt_keep=2 and ema_ckpt_keep=1, applied by the ledger's evictions; DeePMD's
    prune never ran (it would have deleted the higher-numbered remnant at step 20)."""
    found = {k: v for k, v in rows(trained).items() if k[0] in ("model", "model_ema")}
    committed = {k for k, (state, _) in found.items() if state == "committed"}
    assert committed == {("model", 80), ("model", 100), ("model_ema", 100)}
    assert {k for k, (state, _) in found.items() if state == "deleted"} == set(found) - committed
    on_disk = sorted(p.name for p in trained.glob("model*.ckpt-*.pt"))
    assert on_disk == sorted(
        ["model.ckpt-80.pt", "model.ckpt-100.pt", "model_ema.ckpt-100.pt", FOREIGN]
    )
    assert (trained / FOREIGN).read_bytes() == b"not ours"


@pytest.mark.parametrize(
    ("stream", "log", "prefix"),
    [("best", "val.log", "best.ckpt"), ("best_ema", "val_ema.log", "best_ema.ckpt")],
)
def test_validation_best_checkpoints_are_the_ledgers_top_k(
    trained: Path, stream: str, log: str, prefix: str
) -> None:
    """max_best_ckpt=2 by E:MAE: the two lowest validations (but the refused step), under
    names that never change; DeePMD's renaming and deleting of best files never ran."""
    logged = validation_log(trained / log)
    assert sorted(logged) == [20, 40, 60, 80, 100]
    expected = sorted((v, step) for step, v in logged.items() if step != REFUSED)[:2]
    with RunReader(trained) as reader:
        best = reader.best(stream)
        ever = reader.checkpoints(stream, states=("committed", "deleted"))
    assert [c.step for c in best] == [step for _, step in expected]
    assert all(c.metrics["E:MAE"] == c.metric for c in best)
    assert REFUSED not in {c.step for c in ever}
    assert {c.path.name for c in ever} == {f"{prefix}-{c.step}.pt" for c in ever}
    on_disk = sorted(p.name for p in trained.glob(f"{prefix}-*.pt") if p.name != FOREIGN_BEST)
    assert on_disk == sorted(c.path.name for c in best)  # evicted ones gone, no .t-R names
    # DeePMD's own renaming and deleting of best files never ran (it deletes this at start)
    assert (trained / FOREIGN_BEST).read_bytes() == b"not ours either"


def test_aliases_name_the_newest_committed(trained: Path) -> None:
    assert os.readlink(trained / "model.ckpt.pt") == "model.ckpt-100.pt"
    assert os.readlink(trained / "model_ema.ckpt.pt") == "model_ema.ckpt-100.pt"
    assert (trained / "checkpoint").read_text() == "model.ckpt-100.pt"
    with RunReader(trained) as reader:
        latest = reader.latest("model")
    assert latest is not None and latest.path.name == "model.ckpt-100.pt"


def test_a_nan_gradient_refuses_that_boundary_and_training_goes_on(trained: Path) -> None:
    stderr = (trained.parent / "stderr.txt").read_text()
    assert f"TEST: NaN gradient at optimizer step {NAN_STEP}" in stderr
    assert f"ckptdb: step {REFUSED} was not checkpointed" in stderr
    assert not any(step == REFUSED for _, step in rows(trained))  # refused before any row
    tripped = [e for e in events(trained) if e.kind == "guard_tripped"]
    assert [e.step for e in tripped] == [REFUSED]
    # DeePMD's own guard was fed the NaN norm too and did not stop the run: the next
    # boundaries published (and the run exited 0, asserted by the fixture)
    assert rows(trained)[("model", 80)][0] == "committed"


def test_ckptdb_check_is_clean_after_a_run(trained: Path) -> None:
    check_clean(trained)


def column_log(path: Path) -> dict[int, dict[str, float]]:
    """Step -> column -> value of an ``lcurve.out``/``val.log``-style file (one attempt:
    one header), the units in the header left out: ``E_MAE(meV/atom)`` is ``E_MAE``."""
    columns: list[str] = []
    found: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("# step"):
            columns = [name.split("(")[0] for name in line[1:].split()[1:]]
        elif line.strip() and not line.startswith("#"):
            step, *values = line.split()
            found[int(step)] = dict(zip(columns, map(float, values), strict=True))
    return found


def metric_points(root: Path) -> dict[str, dict[int, list[tuple[float, int]]]]:
    """Metric -> step -> [(value, attempt id)] of every metric of the run."""
    found: dict[str, dict[int, list[tuple[float, int]]]] = {}
    with RunReader(root) as reader:
        for name in reader.metric_names():
            for step, value, attempt in reader.metric_history(name):
                found.setdefault(name, {}).setdefault(step, []).append((value, attempt))
    return found


def test_lcurve_and_validation_logs_are_the_ledgers_metrics(trained: Path) -> None:
    """Every row of ``lcurve.out`` (but its rounded ``lr``: the exact one is a metric of
    each checkpoint) and of ``val.log``/``val_ema.log`` (as ``val_*``/``val_ema_*``)
    is a metric point at its step, once, with the number the file holds."""
    points = metric_points(trained)
    expected: dict[str, dict[int, float]] = {}
    for log, prefix in (("lcurve.out", ""), ("val.log", "val_"), ("val_ema.log", "val_ema_")):
        logged = column_log(trained / log)
        assert logged, log
        for step, values in logged.items():
            for name, value in values.items():
                if prefix or name != "lr":
                    expected.setdefault(prefix + name, {})[step] = value
    assert sorted(expected["rmse_e_trn"]) == [1, 20, 40, 60, 80, 100]
    assert sorted(expected["val_E_MAE"]) == [20, 40, 60, 80, 100]
    assert "val_ema_F_RMSE" in expected
    for name, by_step in expected.items():
        got = {step: [v for v, _ in pts] for step, pts in points[name].items()}
        assert got == {step: [value] for step, value in by_step.items()}, name
    assert 1 not in points["lr"]  # lcurve's lr is not recorded, the checkpoints' is
    lcurve = column_log(trained / "lcurve.out")
    with RunReader(trained) as reader:
        saved = reader.checkpoints("model", states=("committed", "deleted"))
    for c in saved:  # each checkpoint's learning rate, lcurve's (rounded) at its step
        assert c.metrics["lr"] == pytest.approx(lcurve[c.step]["lr"], rel=0.05), c


def test_ckptdb_history_and_sql_read_deepmds_metrics(trained: Path) -> None:
    lcurve = column_log(trained / "lcurve.out")
    result = CliRunner().invoke(ckptdb_cli, ["history", str(trained), "--metric", "rmse_e_trn"])
    assert result.exit_code == 0, result.output
    body = [r for r in map(str.split, result.output.splitlines()) if r and r[0].isdigit()]
    assert [(int(r[0]), float(r[1])) for r in body] == [
        (step, v["rmse_e_trn"]) for step, v in sorted(lcurve.items())
    ]
    query = "SELECT step, value FROM metrics WHERE name = 'val_E_MAE' ORDER BY step"
    result = CliRunner().invoke(ckptdb_cli, ["sql", str(trained), query, "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert [line.split(",") for line in result.output.split()[1:]] == [
        [str(step), str(value)]
        for step, value in sorted(validation_log(trained / "val.log").items())
    ]


def test_a_log_tail_reads_whole_new_rows_only(tmp_path: Path) -> None:
    """What the earlier run wrote is not read (a restart: only its header is); a
    partial line waits; NaN is kept; a file rewritten from the start is read again."""
    path = tmp_path / "lcurve.out"
    header = "# step  rmse_val  rmse_trn  lr\n# If there is no available reference data\n"
    path.write_text(header + "   1   1.0e+00   nan   1.0e-03\n")
    tail = train.LogTail(path, append=True, skip={"lr"})
    assert tail.read() == []
    with path.open("a") as fout:
        fout.write("  20   5.0e-01   2.0e-01   1.0e-03\n  40   4.0e-01")
    assert tail.read() == [(20, {"rmse_val": 0.5, "rmse_trn": 0.2})]
    with path.open("a") as fout:
        fout.write("   nan   1.0e-03\n# saved best checkpoint: x\n")
    ((step, values),) = tail.read()
    assert step == 40 and values["rmse_val"] == 0.4 and values["rmse_trn"] != values["rmse_trn"]
    fresh = train.LogTail(path, append=False, prefix="val_")
    assert fresh.read() == []  # an earlier run's file: not until DeePMD rewrites it
    path.write_text("# step E_MAE(meV/atom)\n  20   3.5\n")
    assert fresh.read() == [(20, {"val_E_MAE": 3.5})]


def test_the_rows_after_the_last_boundary_land_when_training_ends(tmp_path: Path) -> None:
    path = tmp_path / "lcurve.out"
    path.write_text("# step  rmse_trn  lr\n   7   2.5e-01   1.0e-03\n")
    manager = CheckpointManager(tmp_path)
    trainer: Any = SimpleNamespace(
        manager=manager,
        ledger=IntegrationLedger(manager, LedgerOptions()),
        _ckptdb_hook=None,
        _ckptdb_stop_hook=None,
        _ckptdb_tails=[train.LogTail(path, append=False, skip={"lr"})],
    )
    trainer._ckptdb_tails[0]._stale = None  # as once DeePMD has rewritten it
    trainer._ckptdb_log_files = lambda: train.LedgerTrainer._ckptdb_log_files(trainer)
    train.LedgerTrainer._ckptdb_close(trainer, None)
    with RunReader(tmp_path) as reader:
        assert [(s, v) for s, v, _ in reader.metric_history("rmse_trn")] == [(7, 0.25)]


def test_dp_freeze_reads_a_run_written_by_ckptdb(trained: Path, tmp_path: Path) -> None:
    """``freeze -c DIR`` follows the ``checkpoint`` pointer that ckptdb wrote."""
    backend = backend_of(trained)
    assert_freezes(trained, backend, tmp_path / frozen_name(backend))


#: What stock DeePMD-kit 3.2.0's ``dp --pt-expt freeze`` of this se_e2_a model ends with
#: under torch 2.13 (its op library is built for 2.11), on a stock run as on ours: the
#: checkpoint is found and loaded, then ``torch.export`` fails on a data-dependent shape.
EXPT_EXPORT_FAILURE = "torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode"


def frozen_name(backend: str) -> str:
    return "frozen.pth" if backend == "--pt" else "frozen.pte"


def assert_freezes(root: Path, backend: str, frozen: Path) -> None:
    """``freeze -c .`` follows the ``checkpoint`` pointer ckptdb wrote and loads the
    checkpoint: a frozen model (``--pt``), or, for ``--pt-expt``, what stock DeePMD-kit
    does on this torch (a frozen model, or the export failure after loading)."""
    proc = dp(root, backend, "freeze", "-c", ".", "-o", str(frozen))
    if backend == "--pt-expt" and proc.returncode != 0:
        assert EXPT_EXPORT_FAILURE in proc.stderr, output(proc)
        return
    assert proc.returncode == 0, output(proc)
    assert frozen.stat().st_size > 0


# ---------------------------------------------------------------- restarting


@pytest.fixture
def ledger(trained: Path) -> Any:
    with CheckpointManager(trained, maintenance=True) as manager:
        yield IntegrationLedger(manager, LedgerOptions())


ALIASES = {"model.ckpt.pt": "model", "model_ema.ckpt.pt": "model_ema"}


@pytest.mark.parametrize(
    ("spec", "stream", "name"),
    [
        ("latest", "model", "model.ckpt-100.pt"),
        (".", "model", "model.ckpt-100.pt"),
        ("model.ckpt", "model", "model.ckpt-100.pt"),  # DeePMD's prefix: its alias
        ("model.ckpt.pt", "model", "model.ckpt-100.pt"),
        ("model_ema.ckpt", "model_ema", "model_ema.ckpt-100.pt"),
        ("model.ckpt-80", "model", "model.ckpt-80.pt"),  # .pt added, as DeePMD does
        ("model.ckpt-80.pt", "model", "model.ckpt-80.pt"),
    ],
)
def test_restart_resolves_through_the_ledger(
    ledger: IntegrationLedger, trained: Path, spec: str, stream: str, name: str
) -> None:
    found = train.resolve_restart(ledger, spec, root=trained, aliases=ALIASES)
    assert (found.stream, found.path.name, found.state) == (stream, name, "committed")


def test_restart_does_not_read_the_alias(ledger: IntegrationLedger, trained: Path) -> None:
    alias = trained / "model.ckpt.pt"
    alias.unlink()
    alias.symlink_to("model.ckpt-80.pt")
    try:
        found = train.resolve_restart(ledger, "model.ckpt", root=trained, aliases=ALIASES)
    finally:
        alias.unlink()
        alias.symlink_to("model.ckpt-100.pt")
    assert found.path.name == "model.ckpt-100.pt"


@pytest.mark.parametrize("spec", [FOREIGN, "model.ckpt-40.pt", "model.ckpt-60.pt"])
def test_restart_refuses_a_path_without_a_committed_row(
    ledger: IntegrationLedger, trained: Path, spec: str
) -> None:
    """A file with no row (the remnant), an evicted one, one that was never published."""
    with pytest.raises(CheckpointNotFoundError, match="has no committed row"):
        train.resolve_restart(ledger, spec, root=trained, aliases=ALIASES)


@pytest.mark.parametrize("name", ["frozen.pte", "frozen.pt2"])
def test_restart_names_a_pt_expt_file_as_given(
    ledger: IntegrationLedger, trained: Path, name: str
) -> None:
    """``--pt-expt`` takes ``.pte``/``.pt2`` files as they are (no ``.pt`` added): the
    refusal names the file the user gave."""
    with pytest.raises(CheckpointNotFoundError, match=rf"{trained / name} has no committed row"):
        train.resolve_restart(ledger, name, root=trained, aliases=ALIASES)


def test_restart_refuses_another_directory(
    ledger: IntegrationLedger, trained: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidArgumentError, match="not this run's directory"):
        train.resolve_restart(ledger, str(tmp_path), root=trained, aliases=ALIASES)


@pytest.mark.parametrize(
    ("base", "name"),
    [
        ("model.ckpt-100.pt", "model.ckpt-100-v1.pt"),  # a row holds it (a re-saved step)
        (FOREIGN, "model.ckpt-500-v1.pt"),  # a file without a row
        ("model.ckpt-120.pt", "model.ckpt-120.pt"),
    ],
)
def test_a_taken_name_gets_a_version_before_the_suffix(
    ledger: IntegrationLedger, base: str, name: str
) -> None:
    """DeePMD adds ``.pt`` to a --restart name without it: ``-v1`` must not come last."""
    assert ledger.free_name(base, suffix=".pt") == name


# -------------------------------------------------------------------- a crash


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_in_a_save_then_restart_latest(tmp_path: Path, backend: str) -> None:
    """Killed inside the periodic boundary at step 60 (files written, not committed):
    the aliases still name step 40; ``--restart latest`` reconciles, resumes from 40,
    publishes 60, and the run checks clean. Validation every 30 steps keeps best
    checkpoints across the restart: the boundaries are 20, 30 (best, best_ema), 40,
    60 (best, best_ema, periodic: the seventh, killed)."""
    validating = {**VALIDATING, "validation_freq": 30}
    root = make_run_dir(tmp_path / "run", validating=validating, numb_steps=60, enable_ema=True)
    proc = dp(root, backend, "train", "input.json", env={"CKPTDB_TEST_KILL_AT": "after_fsync:7"})
    assert proc.returncode == -signal.SIGKILL, output(proc)
    assert "TEST: SIGKILL at after_fsync #7" in proc.stderr
    assert rows(root)[("best", 60)][0] == "committed"
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-40.pt"
    assert os.readlink(root / "model_ema.ckpt.pt") == "model_ema.ckpt-40.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-40.pt"
    assert not (root / "model.ckpt-60.pt").exists()
    assert rows(root)[("model", 60)][0] == "pending"
    # the metrics read before each committed boundary are in (the killed one's are not):
    # lcurve's row 60 came before best@60, val.log's after it (before best_ema@60),
    # val_ema.log's after best_ema@60 (before the killed periodic boundary)
    killed = metric_points(root)
    assert sorted(killed["rmse_e_trn"]) == [1, 20, 40, 60]
    assert (sorted(killed["val_E_MAE"]), sorted(killed["val_ema_E_MAE"])) == ([30, 60], [30])
    # as if a crash had come between a commit and its aliases: start re-points it
    (root / "model.ckpt.pt").unlink()
    (root / "model.ckpt.pt").symlink_to("model.ckpt-20.pt")

    again = dp(root, backend, "train", "input.json", "--restart", "latest")
    assert again.returncode == 0, output(again)
    assert "a stale alias re-pointed at start: aliased" in again.stderr
    assert "was model.ckpt-20.pt" in again.stderr
    resumed = [e for e in events(root) if e.kind == "resumed"]
    assert [e.step for e in resumed] == [40]
    with RunReader(root) as reader:
        at_60 = [
            c
            for c in reader.checkpoints(states=("aborted", "committed"))
            if c.step == 60 and c.stream.startswith("model")
        ]
    # the killed boundary rolled back, then published again: the name was free
    assert sorted((c.stream, c.state) for c in at_60) == [
        ("model", "aborted"),
        ("model", "committed"),
        ("model_ema", "aborted"),
        ("model_ema", "committed"),
    ]
    found = rows(root)
    assert found[("model", 60)] == ("committed", "model.ckpt-60.pt")
    assert found[("model_ema", 60)] == ("committed", "model_ema.ckpt-60.pt")
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-60.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-60.pt"
    with RunReader(root) as reader:  # step 60 validated again, on the new timeline
        best = {stream: reader.best(stream) for stream in ("best", "best_ema")}
    for stream, prefix in (("best", "best.ckpt"), ("best_ema", "best_ema.ckpt")):
        # the new timeline's step 60 replaced the killed one's (its name taken: -v1)
        assert sorted(c.path.name for c in best[stream]) == [
            f"{prefix}-30.pt",
            f"{prefix}-60-v1.pt",
        ]
        assert all(c.path.exists() for c in best[stream])
    check_clean(root)
    # a crash between a commit and its aliases, then `ckptdb reconcile`: rebuilt
    (root / "model.ckpt.pt").unlink()
    (root / "model.ckpt.pt").symlink_to("model.ckpt-40.pt")
    (root / "checkpoint").write_text("model.ckpt-40.pt")
    result = CliRunner().invoke(ckptdb_cli, ["reconcile", str(root)])
    assert result.exit_code == 0, result.output
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-60.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-60.pt"


# ------------------------------------------------------------------ adopting


def set_steps(root: Path, numb_steps: int) -> None:
    config = json.loads((root / "input.json").read_text())
    config["training"]["numb_steps"] = numb_steps
    (root / "input.json").write_text(json.dumps(config, indent=2))


def data_steps(text: str) -> list[int]:
    """The steps of the rows of an ``lcurve.out`` text (headers and comments left out)."""
    return [int(line.split()[0]) for line in text.splitlines() if line.strip() and line[0] != "#"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_adopt_a_stock_run_train_on_with_ckptdb_then_restart_it_stock(
    tmp_path: Path, backend: str
) -> None:
    """Stock DeePMD trains 40 steps; ``ckptdb adopt --layout deepmd`` takes its
    checkpoints; ckptdb's ``--restart latest`` resumes from the adopted 40 and
    publishes 60 into the same stream; stock DeePMD's ``--restart model.ckpt.pt``
    then resumes from 60 through the alias ckptdb wrote."""
    root = make_run_dir(tmp_path / "run", numb_steps=40)
    proc = dp(root, backend, "train", "input.json", stock=True)
    assert proc.returncode == 0, output(proc)
    assert not (root / "ckptdb.sqlite").exists()
    result = CliRunner().invoke(ckptdb_cli, ["adopt", str(root), "--layout", "deepmd"])
    assert result.exit_code == 0, result.output
    assert rows(root) == {
        ("model", 20): ("committed", "model.ckpt-20.pt"),
        ("model", 40): ("committed", "model.ckpt-40.pt"),
    }

    set_steps(root, 60)
    stock_rows = (root / "lcurve.out").read_text()
    again = dp(root, backend, "train", "input.json", "--restart", "latest")
    assert again.returncode == 0, output(again)
    with RunReader(root) as reader:
        adopted = {c.step: c for c in reader.checkpoints("model", states=("committed", "deleted"))}
        attempts = [a.id for a in reader.attempts()]
    (resumed,) = [e for e in events(root) if e.kind == "resumed"]
    assert (resumed.step, resumed.checkpoint_id) == (40, adopted[40].id)
    assert rows(root)[("model", 60)] == ("committed", "model.ckpt-60.pt")
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-60.pt"
    assert (root / "checkpoint").read_text() == "model.ckpt-60.pt"
    check_clean(root)
    # the training attempt's metrics are its own rows of lcurve.out (DeePMD appends them,
    # with a header under --pt, without under --pt-expt), not the stock run's
    ckptdb_rows = (root / "lcurve.out").read_text()
    assert ckptdb_rows.startswith(stock_rows)
    ckptdb_steps = data_steps(ckptdb_rows[len(stock_rows) :])
    assert data_steps(stock_rows) == [1, 20, 40] and ckptdb_steps[-1] == 60
    points = metric_points(root)["rmse_e_trn"]
    assert {step: [a for _, a in pts] for step, pts in points.items()} == {
        step: [attempts[-1]] for step in ckptdb_steps
    }

    set_steps(root, 80)
    stock = dp(root, backend, "train", "input.json", "--restart", "model.ckpt.pt", stock=True)
    assert stock.returncode == 0, output(stock)
    restarted = data_steps((root / "lcurve.out").read_text()[len(ckptdb_rows) :])
    assert restarted[-1] == 80 and min(restarted) >= 60  # resumed from 60, not 0
    saved = torch.load(root / "model.ckpt-80.pt", map_location="cpu", weights_only=False)
    assert saved["model"]["_extra_state"]["train_infos"]["step"] in (79, 80)


@pytest.mark.timeout(420)  # 133 s beside a second copy of the suite (2026-12-07)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_stock_layout_trains_reconciles_and_resumes(tmp_path: Path, backend: str) -> None:
    """``training.save_dir: ckpts`` with full validation and ``save_best``, no
    ``save_best_dir``: DeePMD writes the best checkpoints beside ``save_ckpt`` (the
    working directory) and the periodic ones in ``ckpts/``. Every stream is the
    ledger's, in its own directory: retention, aliases, ``check --load``, a best
    file deleted then reconciled as lost, ``--restart latest``, ``freeze``."""
    root = make_run_dir(
        tmp_path / "run", validating=VALIDATING, numb_steps=60, enable_ema=True, save_dir="ckpts"
    )
    proc = dp(root, backend, "train", "input.json")
    assert proc.returncode == 0, output(proc)
    with RunReader(root) as reader:
        assert reader.save_dir == root.resolve()
        latest = {s: reader.latest(s) for s in ("model", "model_ema")}
        best = {s: reader.best(s) for s in ("best", "best_ema")}
        deleted = reader.checkpoints("model", states=("deleted",))
    ckpts = root.resolve() / "ckpts"
    assert latest["model"] is not None and latest["model"].path == ckpts / "model.ckpt-60.pt"
    assert latest["model_ema"] is not None
    assert latest["model_ema"].path == ckpts / "model_ema.ckpt-60.pt"
    assert [c.step for c in deleted] == [20]  # max_ckpt_keep 2, by the ledger
    assert sorted(p.name for p in ckpts.glob("model.ckpt-*.pt")) == [
        "model.ckpt-40.pt",
        "model.ckpt-60.pt",
    ]
    for stream, log in (("best", "val.log"), ("best_ema", "val_ema.log")):
        logged = validation_log(root / log)
        assert [c.step for c in best[stream]] == [
            s for _, s in sorted((v, s) for s, v in logged.items())
        ][:2]
        assert {c.path for c in best[stream]} == {
            root.resolve() / f"{stream}.ckpt-{c.step}.pt" for c in best[stream]
        }
        on_disk = {p.name for p in root.glob(f"{stream}.ckpt-*")}
        assert on_disk == {c.path.name for c in best[stream]}  # no .t-R names, no evicted
    assert os.readlink(root / "model.ckpt.pt") == "ckpts/model.ckpt-60.pt"
    assert os.readlink(root / "model_ema.ckpt.pt") == "ckpts/model_ema.ckpt-60.pt"
    assert (root / "checkpoint").read_text() == "ckpts/model.ckpt-60.pt"
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root), "--load"])
    assert result.exit_code == 0 and "consistent" in result.output, result.output
    assert_freezes(root, backend, tmp_path / frozen_name(backend))

    gone = best["best"][0].path
    gone.unlink()  # a best file lost behind the ledger's back
    result = CliRunner().invoke(ckptdb_cli, ["reconcile", str(root)])
    assert result.exit_code == 0, result.output
    with RunReader(root) as reader:
        lost = reader.checkpoints("best", states=("lost",))
    assert [c.path for c in lost] == [gone]

    set_steps(root, 80)
    again = dp(root, backend, "train", "input.json", "--restart", "latest")
    assert again.returncode == 0, output(again)
    assert [e.step for e in events(root) if e.kind == "resumed"] == [60]
    assert os.readlink(root / "model.ckpt.pt") == "ckpts/model.ckpt-80.pt"
    assert (ckpts / "model.ckpt-80.pt").is_file()
    check_clean(root)


# ------------------------------------------------------------ what is refused


def test_another_deepmd_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat.deepmd, "__version__", "3.3.0")
    with pytest.raises(UnsupportedVersionError, match=r"deepmd-kit>=3\.2,<3\.3") as info:
        train.main(["--pt", "train", "input.json"])
    assert isinstance(info.value, RuntimeError)
    assert "3.3.0" in str(info.value)
    with pytest.raises(UnsupportedVersionError):
        train.check_version("3.1.2")
    assert train.check_version("3.2.1") == "3.2.1"
    assert train.check_version is compat.check_version


def test_a_swapped_attribute_is_restored_when_the_block_raises() -> None:
    """compat's replacement for ``mock.patch.object``: the original comes back on
    an error as on a return, and DeePMD's ``Trainer`` is its own again after ``dp``."""
    owner = SimpleNamespace(name="original")
    with (
        pytest.raises(RuntimeError, match="in the block"),
        compat.swapped_attribute(owner, "name", "swapped"),
    ):
        assert owner.name == "swapped"
        raise RuntimeError("in the block")
    assert owner.name == "original"
    with compat.swapped_attribute(owner, "name", "swapped"):
        pass
    assert owner.name == "original"
    trainer = compat.training.Trainer
    with pytest.raises(RuntimeError), compat.trainer_replaced_by(train.LedgerTrainer):
        assert compat.training.Trainer is train.LedgerTrainer
        raise RuntimeError("dp failed")
    assert compat.training.Trainer is trainer


@pytest.mark.parametrize(
    ("save_dir", "best_dir", "expected"),
    [
        ("ckpts", None, "."),  # the stock layout: best files beside model.ckpt
        ("ckpts", "ckpts/best", "ckpts"),  # best inside: the periodic directory, as before
        (None, "best", "."),
        ("a/ckpts", "a/best", "a"),  # the nearest directory holding both
        ("ckpts", "{outside}/best", None),  # nothing of the run holds both: refused
        ("{outside}/ckpts", "{outside}/ckpts/best", "{outside}/ckpts"),  # inside it: fine
    ],
)
def test_a_runs_save_directory_holds_every_streams_directory(
    tmp_path: Path, save_dir: str | None, best_dir: str | None, expected: str | None
) -> None:
    root, outside = tmp_path / "run", str(tmp_path / "elsewhere")
    config: dict[str, Any] = {"training": {"enable_ema": True}, "validating": VALIDATING}
    if save_dir is not None:
        config["training"]["save_dir"] = save_dir.format(outside=outside)
    if best_dir is not None:
        config["validating"] = {**VALIDATING, "save_best_dir": best_dir.format(outside=outside)}
    directories = deepmd_config.stream_directories(config, root)
    assert set(directories) == {"model", "model_ema", "best", "best_ema"}
    if expected is None:
        with pytest.raises(InvalidArgumentError, match="share no directory of the run"):
            deepmd_config.ledger_save_dir(directories, root, None)
        return
    chosen = deepmd_config.ledger_save_dir(directories, root, None)
    assert chosen == (root / expected.format(outside=outside)).resolve()
    assert deepmd_config.ledger_save_dir(directories, root, root.parent) == root.parent  # kept


def test_a_run_whose_streams_move_out_of_its_save_directory_is_refused(tmp_path: Path) -> None:
    """Its rows are named relative to the save directory the ledger records: another
    one would make every checkpoint of the run unreachable, so it is refused before
    anything opens; a recorded save directory that still holds every stream's
    directory is kept; a run that holds no checkpoint may move; a run opened with
    its recorded one (a ledger the open had to migrate first) is refused once open."""
    root = tmp_path / "run"
    with CheckpointManager(root, save_dir=root / "ckpts") as manager:
        manager.save(20, model={"w": torch.zeros(1)})
    config: dict[str, Any] = {"training": {"save_dir": "ckpts"}, "validating": VALIDATING}
    directories = deepmd_config.stream_directories(config, root)  # best files: the root
    with pytest.raises(InvalidArgumentError, match="records 1 checkpoint"):
        session._save_dir_to_open(root, LedgerOptions(), directories)
    with (
        CheckpointManager(root, maintenance=True) as manager,
        pytest.raises(InvalidArgumentError, match="records 1 checkpoint"),
    ):
        session._check_save_dir(manager, directories)
    config["validating"] = {**VALIDATING, "save_best_dir": "ckpts/best"}
    inside = deepmd_config.stream_directories(config, root)
    assert session._save_dir_to_open(root, LedgerOptions(), inside) == root / "ckpts"
    new = tmp_path / "new"
    stock = {"training": {"save_dir": "ckpts"}, "validating": VALIDATING}
    fresh = deepmd_config.stream_directories(stock, new)
    assert session._save_dir_to_open(new, LedgerOptions(), fresh) == new.resolve()
    empty = tmp_path / "empty"
    CheckpointManager(empty, save_dir=empty / "ckpts").close()
    moved = deepmd_config.stream_directories(config, empty)
    assert session._save_dir_to_open(empty, LedgerOptions(), moved) == (empty / "ckpts").resolve()
    config["validating"] = VALIDATING
    assert (
        session._save_dir_to_open(
            empty, LedgerOptions(), deepmd_config.stream_directories(config, empty)
        )
        == empty.resolve()
    )  # nothing held: it may move


def test_a_checkpoint_under_a_linked_save_dir_is_named_inside_the_save_directory(
    tmp_path: Path,
) -> None:
    """``save_dir`` through a symlink (a scratch filesystem linked into the run): the
    save directory is the link's target, and DeePMD's path through the link is named
    inside it, never as a path climbing out (which the ledger refuses)."""
    root, scratch = tmp_path / "run", tmp_path / "scratch" / "ckpts"
    scratch.mkdir(parents=True)
    root.mkdir()
    (root / "ckpts").symlink_to(scratch)
    directories = deepmd_config.stream_directories({"training": {"save_dir": "ckpts"}}, root)
    save_dir = deepmd_config.ledger_save_dir(directories, root, None)
    assert save_dir == scratch.resolve()
    trainer: Any = SimpleNamespace(run_root=root, manager=SimpleNamespace(save_dir=save_dir))
    name = session.LedgerTraining._ckptdb_name(trainer, Path("ckpts/model.ckpt-20.pt"))
    assert name == "model.ckpt-20.pt"


@pytest.mark.parametrize("save_ckpt", ["../model.ckpt", "{outside}/model.ckpt"])
def test_a_save_ckpt_outside_the_working_directory_is_refused(
    tmp_path: Path, save_ckpt: str
) -> None:
    """DeePMD writes its ``model.ckpt.pt`` alias beside ``save_ckpt``; the ledger writes
    the aliases inside the run only, so such a prefix is refused before anything opens."""
    root = tmp_path / "run"
    root.mkdir()
    config = {"training": {"save_ckpt": save_ckpt.format(outside=tmp_path / "else")}}
    with pytest.raises(InvalidArgumentError, match=r"save_ckpt .* is outside the working"):
        deepmd_config.refuse_unsupported(config, root)
    deepmd_config.refuse_unsupported({"training": {"save_ckpt": "sub/model.ckpt"}}, root)


def test_another_backend_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(make_run_dir(tmp_path))
    with pytest.raises(InvalidArgumentError, match="--pt or --pt-expt"):
        train.main(["--tf", "train", "input.json"])


@pytest.mark.parametrize(
    ("args", "rest", "guard"),
    [
        (["--pt", "train", "in.json"], ["--pt", "train", "in.json"], True),
        (["--pt", "train", "--ckptdb-guard", "raise", "x"], ["--pt", "train", "x"], "raise"),
        (["--ckptdb-guard=off", "--pt", "train", "in.json"], ["--pt", "train", "in.json"], False),
    ],
)
def test_the_guard_option_is_taken_out_of_dps_arguments(
    args: list[str], rest: list[str], guard: object
) -> None:
    assert train._take_guard(args) == (rest, guard)


def test_a_bad_guard_option_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="warn, raise or off"):
        train._take_guard(["--ckptdb-guard", "maybe"])


class _Refusing:
    """A manager whose every boundary the guard refuses (it records the event itself)."""

    def save(self, step: int, **kwargs: Any) -> Any:
        raise NonFiniteGradientError(f"step {step} not published", step=step)


@pytest.mark.parametrize("guard", [True, "raise"])
def test_a_refused_boundary_warns_or_raises_and_refuses_the_rest_of_its_step(
    guard: object, caplog: pytest.LogCaptureFixture
) -> None:
    """``--ckptdb-guard warn`` goes on, ``raise`` stops; either way every later
    boundary of the step (the periodic one after a best one) is refused too."""
    options = LedgerOptions.of(guard=guard)
    refusing: Any = _Refusing()
    ledger = IntegrationLedger.__new__(IntegrationLedger)  # around a manager that refuses
    ledger.manager, ledger.options = refusing, options
    trainer: Any = SimpleNamespace(
        ledger=ledger,
        ckptdb=train.Options(ledger=options),
        _ckptdb_refused_step=None,
        _ckptdb_log_files=lambda: None,
    )
    plan = session.Plan(40, {}, None)
    if guard == "raise":
        with pytest.raises(NonFiniteGradientError):
            train.LedgerTrainer._ckptdb_publish_plan(trainer, plan, {})
    else:
        assert train.LedgerTrainer._ckptdb_publish_plan(trainer, plan, {}) is None
        assert "step 40 was not checkpointed" in caplog.text
    assert trainer._ckptdb_refused_step == 40
    trainer.ledger = None  # a later boundary of the step never reaches the ledger
    assert train.LedgerTrainer._ckptdb_publish_plan(trainer, plan, {}) is None


def test_a_ckptdb_error_is_one_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptdb.integrations.deepmd import __main__ as entry

    def refuse(argv: object) -> None:
        raise InvalidArgumentError("ckptdb trains DeePMD-kit's PyTorch backend only,\nnot 'tf'")

    monkeypatch.setattr(train, "main", refuse)
    assert entry.run(["--tf", "train", "input.json"]) == 1
    err = capsys.readouterr().err
    assert err == "Error: ckptdb trains DeePMD-kit's PyTorch backend only, not 'tf'\n"


@pytest.mark.timeout(300)  # 83 s beside a second copy of the suite (2026-12-07)
@pytest.mark.parametrize(("stream", "visit"), [("best", 5), ("best_ema", 6)])
def test_sigkill_in_a_best_save_then_restart_latest(
    tmp_path: Path, stream: str, visit: int
) -> None:
    """Killed inside a best boundary at step 60 (boundaries: 20, best 30, best_ema 30,
    40, best 60, best_ema 60): that checkpoint is pending and no file is under its
    name, the aliases still name 40; ``--restart latest`` rolls it back, resumes from
    40, and the new timeline's best at 60 takes the name the killed one never
    committed."""
    validating = {**VALIDATING, "validation_freq": 30}
    root = make_run_dir(tmp_path / "run", validating=validating, numb_steps=60, enable_ema=True)
    env = {"CKPTDB_TEST_KILL_AT": f"after_fsync:{visit}"}
    proc = dp(root, "--pt", "train", "input.json", env=env)
    assert proc.returncode == -signal.SIGKILL, output(proc)
    killed = rows(root)
    assert killed[(stream, 60)][0] == "pending"
    assert killed[(stream, 30)][0] == "committed" and ("model", 60) not in killed
    if stream == "best_ema":  # the live best of the step committed before it
        assert killed[("best", 60)][0] == "committed"
    assert not (root / killed[(stream, 60)][1]).exists()
    assert os.readlink(root / "model.ckpt.pt") == "model.ckpt-40.pt"

    again = dp(root, "--pt", "train", "input.json", "--restart", "latest")
    assert again.returncode == 0, output(again)
    assert [e.step for e in events(root) if e.kind == "resumed"] == [40]
    with RunReader(root) as reader:
        best = reader.best(stream)
        at_60 = [c for c in reader.checkpoints(stream, states=("aborted",)) if c.step == 60]
    assert len(at_60) == 1  # the killed attempt's, rolled back at the open
    prefix = f"{stream}.ckpt"
    assert sorted(c.path.name for c in best) == [f"{prefix}-30.pt", f"{prefix}-60.pt"]
    assert all(c.path.exists() for c in best)
    assert rows(root)[("model", 60)] == ("committed", "model.ckpt-60.pt")
    check_clean(root)


@pytest.mark.parametrize("training_failed", [False, True])
def test_a_failed_last_log_read_is_reported_never_in_place_of_the_outcome(
    tmp_path: Path, training_failed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The rows after the last boundary cannot be read: after a failed training the
    failure is a note on the training's own error; after a successful one it is an
    error record, and the attempt still ends as it should."""
    manager = CheckpointManager(tmp_path)

    def unreadable() -> None:
        raise OSError(5, "lcurve.out: input/output error")

    trainer: Any = SimpleNamespace(
        manager=manager,
        ledger=IntegrationLedger(manager, LedgerOptions()),
        _ckptdb_hook=None,
        _ckptdb_stop_hook=None,
        _ckptdb_log_files=unreadable,
    )
    own = RuntimeError("training diverged") if training_failed else None
    with caplog.at_level(logging.ERROR, logger="ckptdb.deepmd"):
        train.LedgerTrainer._ckptdb_close(trainer, own)
    if own is not None:
        assert any("lcurve.out: input/output error" in n for n in getattr(own, "__notes__", []))
        assert not caplog.records
    else:
        assert "lcurve.out: input/output error" in caplog.text
    ended = LedgerClient(tmp_path).rows("SELECT end_state FROM attempts")
    assert ended == [("failed",) if training_failed else ("closed",)]


def test_the_entry_point_reads_the_ledger_url_from_ckptdb_db_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CKPTDB_DB_URL``, as the ckptdb command reads it; ``--ckptdb-db-url`` wins."""
    from ckptdb.integrations.deepmd import train

    seen: list[str | None] = []

    def factory(backend: str, options: Any) -> Any:
        seen.append(options.ledger.db_url)
        return lambda *args, **kwargs: None

    monkeypatch.setattr(train, "_trainer_factory", factory)
    monkeypatch.setattr(train.compat, "run_dp", lambda args: None)
    monkeypatch.delenv("CKPTDB_DB_URL", raising=False)
    train.main(["--pt", "train", "input.json"])
    monkeypatch.setenv("CKPTDB_DB_URL", "postgresql+psycopg://trainer@db.example/ckpt")
    train.main(["--pt", "train", "input.json"])
    train.main(["--pt", "train", "input.json", "--ckptdb-db-url", "sqlite:////tmp/l.sqlite"])
    assert seen == [
        None,
        "postgresql+psycopg://trainer@db.example/ckpt",
        "sqlite:////tmp/l.sqlite",
    ]
