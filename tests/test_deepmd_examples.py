"""DeePMD-kit's own example configurations, trained through ckptdb on the CPU.

``tests/data/deepmd-examples`` holds a sample of DeePMD-kit's ``examples/`` with their
water data (unmodified, with DeePMD-kit's LGPL-3.0 license; its README says how they
were chosen): se_e2_a, se_e2_a by epochs (``num_epoch``),
DPA-2 small and a multi-task DPA-2 (two heads over one shared descriptor). Each is
copied into a run directory unchanged but for its data paths (made absolute) and its
length: a few steps, a checkpoint and a display every ``FREQ`` (the epoch example
keeps ``num_epoch``, a fraction of an epoch). Stock DeePMD-kit 3.2's ``dp`` trains,
freezes and restarts every one of them on both backends with these arguments.

Through ckptdb's ``dp`` each must exit 0 with every checkpoint DeePMD saved (its
``Saved model to`` lines) a committed row under DeePMD's own name, ``model.ckpt.pt``
and ``checkpoint`` naming the newest, ``ckptdb check --load`` clean, ``dp freeze``
following the pointer ckptdb wrote (``--head`` for the multi-task one), and a longer
run's ``--restart latest`` resuming from the last step and publishing on. The
multi-task checkpoint holds every head of ``model.model_dict``.

Every run passes ``--skip-neighbor-stat`` (no example has ``sel: "auto"``): DeePMD's
neighbor statistics would be most of a run on a CPU. What is left costs mostly
DeePMD's import and data statistics (the multi-task one computes them per head) and
the DPA-2 steps (seconds each on 192 atoms): a multi-task case takes two to four
minutes on a 2-core runner, a single-task one about one. So every example runs on
``--pt``, and on ``--pt-expt`` the se_e2_a and the multi-task one, which cover both of
that backend's trainers' paths (single-task and multi-task); the epoch and DPA-2
examples on ``--pt-expt`` differ from those in the run length and the descriptor only,
and run with ``CKPTDB_TEST_DEEPMD_EXAMPLES=all`` (``NOT_BY_DEFAULT`` says why each is
left out).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepmd")

from click.testing import CliRunner
from deepmdlib import REPO, dp, output
from test_deepmd import events, frozen_name

from ckptdb import RunReader
from ckptdb.cli import main as ckptdb_cli

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("no_db_url_from_environment")]

EXAMPLES = REPO / "tests" / "data" / "deepmd-examples" / "examples"

SE_E2_A = "water/se_e2_a/input_torch.json"
SE_E2_A_BY_EPOCHS = "water/se_e2_a/input_torch_num_epoch.json"
DPA2_SMALL = "water/dpa2/input_torch_small.json"
MULTI_TASK = "water_multi_task/pytorch_example/input_torch.json"

#: ``numb_steps`` of the first run and of the restarted one, and the ``save_freq`` and
#: ``disp_freq`` of both.
STEPS, MORE_STEPS, FREQ = 4, 6, 2
#: One ``dp`` command's limit: the multi-task example's first training took more than
#: 600 s beside a second copy of the suite (2026-12-07), so 3x that.
DP_TIMEOUT = 1800
#: The epoch example's ``num_epoch``, first and restarted: fractions of an epoch,
#: exact in binary (DeePMD rounds ``num_epoch * batches per epoch`` up to steps).
EPOCHS, MORE_EPOCHS = 1 / 64, 1 / 32
#: DeePMD's names of ``training.numb_epoch``.
EPOCH_KEYS = ("numb_epoch", "num_epoch", "numb_epochs", "num_epochs")

#: The pairs collected only with ``CKPTDB_TEST_DEEPMD_EXAMPLES=all`` (a deep profile), and why.
NOT_BY_DEFAULT = {
    (SE_E2_A_BY_EPOCHS, "--pt-expt"): "the se_e2_a model of --pt-expt's se_e2_a case, "
    "by epochs as on --pt",
    (DPA2_SMALL, "--pt-expt"): "--pt-expt's single-task trainer as in its se_e2_a case; "
    "DPA-2 on --pt-expt is in its multi-task case",
}
ALL_PAIRS = os.environ.get("CKPTDB_TEST_DEEPMD_EXAMPLES") == "all"


def case(example: str, backend: str, name: str, timeout: float = 600) -> Any:
    return pytest.param(
        example, backend, id=f"{name}-{backend[2:]}", marks=pytest.mark.timeout(timeout)
    )


def cases(*pairs: tuple[str, str, str]) -> list[Any]:
    """The (example, backend, name) pairs as parameters, but those of ``NOT_BY_DEFAULT``
    unless ``CKPTDB_TEST_DEEPMD_EXAMPLES=all``."""
    return [
        # the multi-task example's --pt took 731 s beside a second copy of the suite
        # (2026-12-07) and its --pt-expt more than its first DP_TIMEOUT: 3x headroom
        case(example, backend, name, timeout=3600 if example == MULTI_TASK else 600)
        for example, backend, name in pairs
        if ALL_PAIRS or (example, backend) not in NOT_BY_DEFAULT
    ]


SINGLE_TASK = cases(
    (SE_E2_A, "--pt", "se_e2_a"),
    (DPA2_SMALL, "--pt", "dpa2_small"),
    (SE_E2_A, "--pt-expt", "se_e2_a"),
    (SE_E2_A_BY_EPOCHS, "--pt", "se_e2_a_num_epoch"),
    (DPA2_SMALL, "--pt-expt", "dpa2_small"),
    (SE_E2_A_BY_EPOCHS, "--pt-expt", "se_e2_a_num_epoch"),
)


def data_sections(training: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``training_data``/``validation_data`` of a configuration: its own, or each
    task's of a multi-task one (``data_dict``)."""
    owners = [training, *training.get("data_dict", {}).values()]
    return [o[key] for o in owners for key in ("training_data", "validation_data") if key in o]


def copy_example(example: str, root: Path) -> dict[str, Any]:
    """The example's configuration as ``root/input.json``: its data paths absolute, the
    first run's length (``STEPS``, or ``EPOCHS`` where it is set by epochs), a save and
    a display every ``FREQ``; every other key as the example has it."""
    source = EXAMPLES / example
    config = json.loads(source.read_text())
    for section in data_sections(config["training"]):
        section["systems"] = [str((source.parent / s).resolve()) for s in section["systems"]]
    config["training"].update(save_freq=FREQ, disp_freq=FREQ)
    root.mkdir(parents=True)
    write_length(root, config, more=False)
    return config


def write_length(root: Path, config: dict[str, Any], *, more: bool) -> None:
    """``config`` as ``root/input.json``, ``numb_steps`` (or its epochs) set to the
    first run's length, or the restarted run's (``more``)."""
    training = config["training"]
    epoch_key = next((key for key in EPOCH_KEYS if key in training), None)
    if epoch_key is None:
        training["numb_steps"] = MORE_STEPS if more else STEPS
    else:
        training[epoch_key] = MORE_EPOCHS if more else EPOCHS
    (root / "input.json").write_text(json.dumps(config, indent=2))


def trained_steps(proc: subprocess.CompletedProcess[str], config: dict[str, Any]) -> int:
    """The run's length, as DeePMD logged it: ``numb_steps``, or the steps DeePMD
    computed from ``num_epoch``."""
    (steps,) = map(int, re.findall(r"Start to train (\d+) steps\.", proc.stderr))
    training = config["training"]
    if "numb_steps" in training:
        assert steps == training["numb_steps"], output(proc)
    else:
        computed = re.findall(r"Computed num_steps=(\d+) from num_epoch=", proc.stderr)
        assert computed == [str(steps)], output(proc)
    return steps


def saved_names(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The checkpoints DeePMD says it saved (``Saved model to NAME``), in order."""
    return re.findall(r"Saved model to (\S+\.pt)$", proc.stderr, flags=re.MULTILINE)


def assert_published(
    root: Path, proc: subprocess.CompletedProcess[str], first: int, last: int
) -> None:
    """The committed rows after step ``first`` are those of the steps DeePMD saves in
    (first, last] (each ``FREQ``-th and the last), under DeePMD's names, the files DeePMD
    said it saved; the alias and the pointer name the last."""
    steps = [s for s in range(first + 1, last + 1) if s % FREQ == 0 or s == last]
    names = [f"model.ckpt-{step}.pt" for step in steps]
    assert saved_names(proc) == names, output(proc)
    with RunReader(root) as reader:
        committed = {c.path.name: c for c in reader.checkpoints()}
        latest = reader.latest("model")
    assert {name for name, c in committed.items() if c.step > first} == set(names)
    assert {committed[name].stream for name in names} == {"model"}
    assert [committed[name].step for name in names] == steps
    assert latest is not None and latest.path == root.resolve() / names[-1]
    assert os.readlink(root / "model.ckpt.pt") == names[-1]
    assert (root / "checkpoint").read_text() == names[-1]


def assert_checks_clean(root: Path) -> None:
    result = CliRunner().invoke(ckptdb_cli, ["check", str(root), "--load"])
    assert result.exit_code == 0, result.output
    assert "consistent" in result.output


def assert_holds_every_head(path: Path, config: dict[str, Any]) -> None:
    """A multi-task checkpoint: the descriptor, fitting net and output statistics of
    every head of ``model.model_dict``, and nothing of another model."""
    heads = set(config["model"]["model_dict"])
    saved = torch.load(path, map_location="cpu", weights_only=False)["model"]
    assert set(saved["_extra_state"]["model_params"]["model_dict"]) == heads
    weights = [key for key in saved if key != "_extra_state"]
    assert all(key.startswith("model.") for key in weights), weights
    assert {key.split(".")[1] for key in weights} == heads
    for head in heads:
        for part in ("descriptor", "fitting_net", "out_bias"):
            prefix = f"model.{head}.atomic_model.{part}"
            assert any(key.startswith(prefix) for key in weights), (prefix, sorted(weights))


def assert_freezes_through_the_pointer(
    root: Path, backend: str, frozen: Path, config: dict[str, Any]
) -> None:
    """``freeze -c .`` follows the ``checkpoint`` pointer ckptdb wrote and writes a frozen
    model (of a multi-task model: its first head), on both backends: ``torch.export``
    of these models works under this torch, stock DeePMD-kit's as ckptdb's."""
    heads = list(config["model"].get("model_dict", {}))
    args = ["--head", heads[0]] if heads else []
    proc = dp(root, backend, "freeze", "-c", ".", "-o", str(frozen), *args, timeout=DP_TIMEOUT)
    assert proc.returncode == 0, output(proc)
    assert frozen.stat().st_size > 0


@pytest.mark.parametrize(("example", "backend"), SINGLE_TASK)
def test_an_example_trains_freezes_and_restarts_through_ckptdb(
    tmp_path: Path, example: str, backend: str
) -> None:
    train_freeze_and_restart(tmp_path, example, backend)


def train_freeze_and_restart(tmp_path: Path, example: str, backend: str) -> None:
    """The example trained, checked, frozen, then restarted longer (module docstring)."""
    root = tmp_path / "run"
    config = copy_example(example, root)
    proc = dp(root, backend, "train", "input.json", "--skip-neighbor-stat", timeout=DP_TIMEOUT)
    assert proc.returncode == 0, output(proc)
    first = trained_steps(proc, config)
    assert_published(root, proc, 0, first)
    assert_checks_clean(root)
    if "model_dict" in config["model"]:
        assert_holds_every_head(root / f"model.ckpt-{first}.pt", config)
    assert_freezes_through_the_pointer(root, backend, tmp_path / frozen_name(backend), config)

    write_length(root, config, more=True)
    args = ["train", "input.json", "--skip-neighbor-stat", "--restart", "latest"]
    again = dp(root, backend, *args, timeout=DP_TIMEOUT)
    assert again.returncode == 0, output(again)
    last = trained_steps(again, config)
    assert last > first
    assert [e.step for e in events(root) if e.kind == "resumed"] == [first]
    assert_published(root, again, first, last)
    assert_checks_clean(root)
    if "model_dict" in config["model"]:
        assert_holds_every_head(root / f"model.ckpt-{last}.pt", config)
