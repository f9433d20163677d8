"""The Accelerate integration, with a real ``accelerate.Accelerator`` on the CPU.

What it promises (docs/accelerate.md): a resume restores everything
``save_state`` saved, bit for bit, from the newest *committed* checkpoint
(never a partial or foreign directory, never one whose hash is wrong); a
crash anywhere in a save leaves nothing partial after the next open;
retention is the ledger's and spares the checkpoint a run resumed from;
Accelerate's own naming and deletion are refused; a NaN gradient refuses the
next checkpoint; under two gloo ranks the commit waits for every rank's files.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from acceleratelib import (
    Loop,
    crash_at,
    reference,
    same,
    two_ranks_disagree,
    two_ranks_resume,
    two_ranks_train,
)
from crashlib import fork_running, tail, wait_child
from distlib import run_ranks
from helpers import LedgerClient, flip_byte

from ckptdb import CheckpointManager
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    NonFiniteGradientError,
    UnsupportedVersionError,
)
from ckptdb.integrations.accelerate import STREAM, Checkpoints

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(120),
]


def dirs(save_dir: Path) -> list[str]:
    return sorted(os.listdir(save_dir)) if save_dir.exists() else []


def rows(root: Path, db_url: str | None, sql: str) -> list[tuple[Any, ...]]:
    client = LedgerClient(root, db_url)
    try:
        return client.rows(sql)
    finally:
        client.close()


def committed(root: Path, db_url: str | None = None) -> list[tuple[int, str]]:
    return [
        (step, path)
        for step, path in rows(
            root,
            db_url,
            "SELECT step, path FROM checkpoints WHERE state = 'committed' ORDER BY step",
        )
    ]


def check_clean(root: Path, db_url: str | None = None) -> None:
    """The invariants hold, and every committed directory is whole (hashes re-read)."""
    with CheckpointManager(root, db_url=db_url, maintenance=True) as mgr:
        assert mgr.check() == []
        assert mgr.reconcile(verify=True).actions == []


def train_and_save(root: Path, steps: int, **kwargs: Any) -> Loop:
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root, **kwargs) as ckpts:
        loop.train(steps, ckpts.save)
    return loop


# ------------------------------------------------------------------ round trip


def test_a_resume_restores_model_optimizer_scheduler_and_rng_bit_for_bit(
    tmp_path: Path, backend: str | None
) -> None:
    """On both ledgers (``backend``: SQLite, and PostgreSQL from CKPTDB_TEST_POSTGRES_URL)."""
    root, db_url = tmp_path / "run", backend
    expected = reference(6)
    first = Loop(seed=0)
    with Checkpoints(first.accelerator, root, db_url=db_url) as ckpts:
        assert ckpts.resume() is None  # nothing committed yet: nothing loaded
        first.train(3)
        record = ckpts.save(3, metrics={"loss": 0.5})
        first.train(6)
    assert same(first.everything(), expected)  # saving changed nothing (no RNG drawn)
    assert record is not None and record.path == root / "checkpoints" / "checkpoint_3"
    assert record.metrics == {"loss": 0.5}
    assert sorted(os.listdir(record.path)) == [
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "scheduler.bin",
    ]
    second = Loop(seed=1)  # other weights, other RNG: only load_state can make it match
    assert not same(second.everything(), expected)
    with Checkpoints(second.accelerator, root, db_url=db_url) as ckpts:
        second.done = ckpts.resume()  # type: ignore[assignment]
        assert second.done == 3 and ckpts.resumed is not None and ckpts.resumed.id == record.id
        second.train(6)
    assert same(second.everything(), expected)
    assert rows(root, db_url, "SELECT kind, step FROM events WHERE kind = 'resumed'") == [
        ("resumed", 3)
    ]
    check_clean(root, db_url)


def test_the_ledger_is_at_the_root_and_checkpoints_beneath_it(tmp_path: Path) -> None:
    root = tmp_path / "run"
    train_and_save(root, 2, keep_last=5)
    assert sorted(os.listdir(root)) == [
        "checkpoints",
        "ckptdb.lock",
        "ckptdb.owner",
        "ckptdb.sqlite",
    ]
    assert dirs(root / "checkpoints") == ["checkpoint_1", "checkpoint_2"]
    assert rows(root, None, "SELECT name FROM streams") == [(STREAM,)]


def test_extra_arguments_reach_save_state_and_load_state(tmp_path: Path) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.step()
        record = ckpts.save(1, safe_serialization=False)
        assert record is not None and (record.path / "pytorch_model.bin").is_file()
    loop = Loop(seed=1)
    with Checkpoints(loop.accelerator, root) as ckpts:
        assert ckpts.resume(map_location="cpu", load_kwargs={"weights_only": True}) == 1


# ---------------------------------------------------------------------- crashes


CRASH_POINTS = ["mid_write", "after_intent", "after_replace", "in_commit", "after_commit"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_kill_inside_a_save_resumes_from_the_last_commit_and_leaves_nothing_partial(
    tmp_path: Path, point: str
) -> None:
    root, log = tmp_path / "run", tmp_path / "child.log"
    pid = fork_running(tmp_path, log, lambda: crash_at(point, 3, root, total=5))
    assert wait_child(pid, timeout=60) == -signal.SIGKILL, tail(log)
    save_dir = root / "checkpoints"
    left = [n for n in dirs(save_dir) if "checkpoint_3" in n]
    assert left, "the child died before checkpoint 3 was started"
    if point == "mid_write":  # really in the middle: a half-written file in the temporary
        (tmp,) = left
        assert tmp.startswith(".checkpoint_3.ckptdb-tmp-")
        assert (save_dir / tmp / "optimizer.bin").stat().st_size == 100
    survived = point == "after_commit"
    loop = Loop(seed=7)
    with Checkpoints(loop.accelerator, root, keep_last=3) as ckpts:  # the open reconciles
        assert [n for n in dirs(save_dir) if "ckptdb-tmp" in n] == []
        assert dirs(save_dir) == ["checkpoint_1", "checkpoint_2"] + ["checkpoint_3"] * survived
        loop.done = ckpts.resume()  # type: ignore[assignment]
        assert loop.done == (3 if survived else 2)
        loop.train(5, ckpts.save)
    assert same(loop.everything(), reference(5))
    assert [step for step, _ in committed(root)] == [3, 4, 5]
    check_clean(root)


def test_a_partial_highest_numbered_directory_is_never_resumed_from(tmp_path: Path) -> None:
    root = tmp_path / "run"
    save_dir = root / "checkpoints"
    train_and_save(root, 2)
    planted = save_dir / "checkpoint_9"
    planted.mkdir()
    shutil.copy(save_dir / "checkpoint_2" / "model.safetensors", planted)  # no optimizer...
    loop = Loop(seed=1)
    with Checkpoints(loop.accelerator, root) as ckpts:
        assert ckpts.resume() == 2
        loop.done = 8
        record = loop.train(9, ckpts.save)[0]
    # the planted directory is not ours: left alone, never written over
    assert record is not None and record.path == save_dir / "checkpoint_9-v1"
    assert os.listdir(planted) == ["model.safetensors"]
    assert [p for _, p in committed(root)] == ["checkpoint_1", "checkpoint_2", "checkpoint_9-v1"]
    check_clean(root)


def test_a_checkpoint_whose_hash_is_wrong_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    train_and_save(root, 3)
    flip_byte(root / "checkpoints" / "checkpoint_3" / "optimizer.bin")  # same size
    loop = Loop(seed=1)
    with Checkpoints(loop.accelerator, root) as ckpts:
        assert ckpts.resume() == 2
        assert ckpts.latest() == ckpts.resumed  # latest fell back too
    assert "not resuming from" in caplog.text and "checkpoint_3" in caplog.text
    assert rows(root, None, "SELECT step, state FROM checkpoints ORDER BY step") == [
        (1, "committed"),
        (2, "committed"),
        (3, "corrupt"),  # recorded, as a load would
    ]


# -------------------------------------------------------------------- retention


def test_keep_last_keeps_exactly_the_newest_on_disk_and_in_the_ledger(tmp_path: Path) -> None:
    root = tmp_path / "run"
    train_and_save(root, 5, keep_last=2)
    assert dirs(root / "checkpoints") == ["checkpoint_4", "checkpoint_5"]
    assert [step for step, _ in committed(root)] == [4, 5]
    assert rows(root, None, "SELECT step FROM checkpoints WHERE state = 'deleted'") == [
        (1,),
        (2,),
        (3,),
    ]
    check_clean(root)


def test_the_checkpoint_resumed_from_stays_while_its_run_is_open(tmp_path: Path) -> None:
    root = tmp_path / "run"
    save_dir = root / "checkpoints"
    train_and_save(root, 3, keep_last=2)
    loop = Loop(seed=1)
    with Checkpoints(loop.accelerator, root, keep_last=2) as ckpts:
        loop.done = ckpts.resume()  # type: ignore[assignment]
        loop.train(5, ckpts.save)  # 4 evicts 2; 5 evicts 3, the one resumed from
        assert [step for step, _ in committed(root)] == [4, 5]
        assert dirs(save_dir) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    (state,) = rows(root, None, "SELECT state, error FROM checkpoints WHERE step = 3")
    assert state[0] == "deleted" and "kept on disk" in state[1]
    assert dirs(save_dir) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]  # the user's now
    check_clean(root)


def test_a_run_that_does_not_resume_never_deletes_the_earlier_runs_checkpoints(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    train_and_save(root, 2, keep_last=2)
    train_and_save(root, 3, keep_last=2)  # starts afresh at step 1 in the same root
    assert dirs(root / "checkpoints") == [
        "checkpoint_1",  # the earlier run's, evicted from the stream but kept
        "checkpoint_2",
        "checkpoint_2-v1",  # a taken name gets a version (1-v1 went by keep_last)
        "checkpoint_3",
    ]
    assert [p for _, p in committed(root)] == ["checkpoint_2-v1", "checkpoint_3"]
    kept = "SELECT path, state FROM checkpoints WHERE error LIKE '%kept on disk%' ORDER BY id"
    assert rows(root, None, kept) == [("checkpoint_1", "deleted"), ("checkpoint_2", "deleted")]
    check_clean(root)


# --------------------------------------------------------------------- refusals


def test_automatic_checkpoint_naming_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    root = tmp_path / "run"
    config = ProjectConfiguration(
        project_dir=str(root), automatic_checkpoint_naming=True, total_limit=1
    )
    loop = Loop(seed=0, accelerator=Accelerator(cpu=True, project_config=config))
    with pytest.raises(InvalidArgumentError, match="automatic_checkpoint_naming"):
        Checkpoints(loop.accelerator, root)
    assert not root.exists()


def test_automatic_naming_turned_on_later_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0, accelerator=Accelerator(cpu=True, project_dir=str(root)))
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(1, ckpts.save)
        loop.accelerator.project_configuration.automatic_checkpoint_naming = True
        loop.accelerator.project_configuration.total_limit = 1
        loop.step()
        with pytest.raises(InvalidArgumentError, match="automatic_checkpoint_naming"):
            ckpts.save(2)
        with pytest.raises(InvalidArgumentError, match="automatic_checkpoint_naming"):
            ckpts.resume()
    assert dirs(root / "checkpoints") == ["checkpoint_1"]
    assert rows(root, None, "SELECT step, state FROM checkpoints") == [(1, "committed")]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"accelerator": object()}, ArgumentTypeError),
        ({"root": 3}, ArgumentTypeError),
        ({"keep_last": 0}, InvalidArgumentError),
        ({"keep_last": "2"}, ArgumentTypeError),
        ({"best": "eval_loss"}, ArgumentTypeError),
        ({"best": ("eval_loss", "median")}, InvalidArgumentError),
        ({"best": ("", "min")}, InvalidArgumentError),
        ({"db_url": 5}, ArgumentTypeError),
        ({"guard": "yes"}, InvalidArgumentError),
    ],
    # stable ids (no object address): every pytest-xdist worker must collect the same tests
    ids=lambda v: (
        v.__name__
        if isinstance(v, type)
        else ",".join(f"{k}={'object()' if type(x) is object else repr(x)}" for k, x in v.items())
    ),
)
def test_bad_arguments_are_typed_errors_and_create_nothing(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    root = tmp_path / "run"
    args: dict[str, Any] = {"accelerator": Accelerator(cpu=True), "root": root, **kwargs}
    with pytest.raises(error):
        Checkpoints(**args)
    assert not root.exists()


@pytest.mark.parametrize(
    "step, extra, error",
    [
        (-1, {}, InvalidArgumentError),
        ("3", {}, ArgumentTypeError),
        (True, {}, ArgumentTypeError),
        (3, {"metrics": {"loss": "low"}}, ArgumentTypeError),
        (3, {"output_dir": "elsewhere"}, InvalidArgumentError),
    ],
)
def test_a_bad_save_is_a_typed_error_and_writes_nothing(
    tmp_path: Path, step: Any, extra: dict[str, Any], error: type[Exception]
) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(1, ckpts.save)
        with pytest.raises(error):
            ckpts.save(step, **extra)
        with pytest.raises(InvalidArgumentError):
            ckpts.resume(input_dir="elsewhere")
    assert dirs(root / "checkpoints") == ["checkpoint_1"]
    assert rows(root, None, "SELECT step FROM checkpoints") == [(1,)]
    assert rows(root, None, "SELECT COUNT(*) FROM metrics") == [(0,)]


# ------------------------------------------------------------------------ guard


@pytest.mark.parametrize("guard", [True, "raise", False])
def test_a_nan_gradient_refuses_the_next_checkpoint(
    tmp_path: Path, guard: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0, nan_at=2)
    with Checkpoints(loop.accelerator, root, guard=guard) as ckpts:
        loop.train(1, ckpts.save)
        loop.step()  # step 2: a NaN gradient
        if guard == "raise":
            with pytest.raises(NonFiniteGradientError) as raised:
                ckpts.save(2)
            assert raised.value.parameters == ["0.weight", "0.bias", "2.weight", "2.bias"]
        else:
            refused = ckpts.save(2)
            assert (refused is None) == bool(guard)
        loop.train(3, ckpts.save)  # the guard starts afresh after a refusal
    tripped = rows(root, None, "SELECT step, detail FROM events WHERE kind = 'guard_tripped'")
    if not guard:
        assert tripped == [] and [s for s, _ in committed(root)] == [1, 2, 3]
        return
    assert [s for s, _ in committed(root)] == [1, 3]
    assert dirs(root / "checkpoints") == ["checkpoint_1", "checkpoint_3"]
    assert len(tripped) == 1 and tripped[0][0] == 2
    assert json.loads(tripped[0][1])["parameters"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ("step 2 was not checkpointed" in caplog.text) == (guard is True)


def test_the_guard_ignores_optimizers_of_another_accelerator(tmp_path: Path) -> None:
    loop, other = Loop(seed=0), Loop(seed=1, nan_at=1)
    with Checkpoints(loop.accelerator, tmp_path / "run") as ckpts:
        other.step()  # a NaN step, but not of this run's optimizer
        loop.step()
        assert ckpts.save(1) is not None


def test_a_step_the_grad_scaler_skipped_does_not_trip_the_guard(tmp_path: Path) -> None:
    """A GradScaler that finds inf skips the optimizer step: nothing was applied, so
    nothing is refused. (Accelerate makes no scaler on the CPU; one is set by hand.)"""
    accelerator = Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu")
    loop = Loop(seed=0, accelerator=accelerator)
    before = loop.weights()
    with Checkpoints(loop.accelerator, tmp_path / "run") as ckpts:
        x = torch.randn(8, 4)
        loop.accelerator.backward(loop.model(x).sum())
        for p in loop.model.parameters():
            assert p.grad is not None
            p.grad.fill_(math.inf)
        loop.optimizer.step()
        assert loop.optimizer.step_was_skipped and same(loop.weights(), before)
        assert ckpts.save(1) is not None


# ------------------------------------------------------------------------ best


@pytest.mark.parametrize(
    "mode, keep_last, kept",
    [
        ("min", 1, [2, 6]),  # the best, and the newest (always kept)
        ("min", 3, [2, 5, 6]),  # keep_last in all: the best and the 2 newest
        ("max", 1, [4, 6]),
        ("max", 3, [4, 5, 6]),
        ("min", None, [1, 2, 3, 4, 5, 6]),  # everything, ranked
    ],
)
def test_best_keeps_the_best_checkpoint_whatever_its_age(
    tmp_path: Path, mode: str, keep_last: int | None, kept: list[int]
) -> None:
    root = tmp_path / "run"
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 4.0, 6: 2.5}  # step 5: saved without the metric
    loop = Loop(seed=0)
    with Checkpoints(
        loop.accelerator, root, keep_last=keep_last, best=("eval_loss", mode)
    ) as ckpts:

        def save(step: int) -> Any:
            metrics = {"eval_loss": losses[step]} if step in losses else {"train_loss": 0.1}
            return ckpts.save(step, metrics=metrics)

        assert all(c is not None for c in loop.train(6, save))
        best, latest = ckpts.best(), ckpts.latest()
        assert best is not None and best.step == (2 if mode == "min" else 4)
        assert latest is not None and latest.step == 6
    assert dirs(root / "checkpoints") == sorted(f"checkpoint_{s}" for s in kept)
    assert [step for step, _ in committed(root)] == kept
    loop = Loop(seed=1)
    with Checkpoints(
        loop.accelerator, root, keep_last=keep_last, best=("eval_loss", mode)
    ) as ckpts:
        assert ckpts.resume() == 6  # the newest, not the best
    check_clean(root)


def test_a_nan_best_metric_is_saved_but_never_the_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, tmp_path / "run", best=("eval_loss", "min")) as ckpts:
        loop.step()
        first = ckpts.save(1, metrics={"eval_loss": torch.tensor(math.nan), "lr": 0.1})
        loop.step()
        second = ckpts.save(2, metrics={"eval_loss": 5.0})
        assert first is not None and first.metric is None and first.metrics == {"lr": 0.1}
        assert ckpts.best() == second
    assert "eval_loss is nan; this checkpoint is never the best" in caplog.text


def test_best_is_none_without_best_or_before_a_scored_save(tmp_path: Path) -> None:
    loop = Loop(seed=0)
    with Checkpoints(loop.accelerator, tmp_path / "a") as ckpts:
        loop.train(1, ckpts.save)
        assert ckpts.best() is None
    with Checkpoints(loop.accelerator, tmp_path / "b", best=("eval_loss", "min")) as ckpts:
        loop.train(2, ckpts.save)
        assert ckpts.best() is None


# ------------------------------------------------------------------- lifecycle


def test_leaving_the_block_by_an_error_ends_the_attempt_as_failed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    loop = Loop(seed=0)
    with pytest.raises(KeyError), Checkpoints(loop.accelerator, root) as ckpts:
        loop.train(1, ckpts.save)
        raise KeyError("boom")
    assert rows(root, None, "SELECT end_state FROM attempts") == [("failed",)]
    loop.nan_at = loop.done + 1
    loop.step()  # the guard's optimizer hook went with the run
    assert ckpts.guard is not None and not ckpts.guard.tripped()
    with Checkpoints(loop.accelerator, root) as ckpts:  # the writer lock was released
        assert ckpts.resume() == 1


# ------------------------------------------------------------------ two ranks


@pytest.mark.timeout(150)
def test_two_gloo_ranks_commit_after_every_rank_wrote_and_resume_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 1 writes its RNG file late: the commit must wait for it (the hash that
    ``reconcile(verify=True)`` re-reads includes it). A NaN gradient on rank 1
    refuses the checkpoint on both. Each rank resumes its own RNG state."""
    root = tmp_path / "run"
    trained = run_ranks(two_ranks_train, 2, tmp_path, str(root), 1.0, timeout=60)
    assert [o.error for o in trained] == [None, None], [o.trace for o in trained]
    assert [o.value["saved"] for o in trained] == [[None, 2, None, 4]] * 2
    assert [step for step, _ in committed(root)] == [2, 4]
    for step, name in committed(root):  # what the chief sealed holds rank 1's late file
        files = list((root / "checkpoints" / name).iterdir())
        assert {"random_states_0.pkl", "random_states_1.pkl"} <= {f.name for f in files}
        (size,) = rows(root, None, f"SELECT size FROM checkpoints WHERE step = {step}")
        assert size == (sum(f.stat().st_size for f in files),)
    (tripped,) = rows(root, None, "SELECT step, detail FROM events WHERE kind = 'guard_tripped'")
    assert tripped[0] == 3 and json.loads(tripped[1])["ranks"] == [1]
    check_clean(root)
    resumed = run_ranks(two_ranks_resume, 2, tmp_path, str(root), timeout=60)
    assert [o.error for o in resumed] == [None, None], [o.trace for o in resumed]
    assert [o.value["resumed"] for o in resumed] == [4, 4]
    for rank in (0, 1):
        assert same(resumed[rank].value["state"], trained[rank].value["state"]), rank


@pytest.mark.timeout(90)
def test_two_ranks_that_disagree_all_raise_without_waiting(tmp_path: Path) -> None:
    """A step only rank 1 gets wrong, a load only rank 1 fails: each rank raises at
    once (rank 1 its own error, rank 0 RankFailedError naming rank 1), nothing is
    published, and both close the run."""
    root = tmp_path / "run"
    outcomes = run_ranks(two_ranks_disagree, 2, tmp_path, str(root), timeout=40)
    assert [o.error for o in outcomes] == [None, None], [o.trace for o in outcomes]
    assert outcomes[0].value == {
        "save": ("RankFailedError", [1]),
        "resume": ("RankFailedError", [1]),
        "committed": [1],
    }
    assert outcomes[1].value == {
        "save": ("InvalidArgumentError", None),
        "resume": ("OSError", None),
        "committed": [1],
    }
    assert rows(root, None, "SELECT end_state FROM attempts") == [("closed",)]


# ------------------------------------------------------------------------ docs


def test_the_example_in_the_docs_trains_and_resumes(tmp_path: Path) -> None:
    """docs/accelerate.md's first Python block, run as shown: 20 steps, then on to 40."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "accelerate.md").read_text()
    block = re.search(r"```python\n(.*?)```", page, re.S)
    assert block is not None
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "docs/accelerate.md", "exec"), namespace)
    root = tmp_path / "exp1"
    namespace["main"](str(root), 20)
    namespace["main"](str(root), 40)
    steps = [step for step, _ in committed(root)]
    assert {30, 40} <= set(steps) and len(steps) == 3  # 3 in all: the newest, and the best
    assert rows(root, None, "SELECT step FROM events WHERE kind = 'resumed'") == [(20,)]
    check_clean(root)


@pytest.mark.parametrize("version", ["1.14.0", "2.0.0", "dev"])
def test_a_release_outside_the_tested_range_is_refused_in_one_line(version: str) -> None:
    from ckptdb.integrations.accelerate.compat import check_version

    with pytest.raises(UnsupportedVersionError, match=r">=1\.15,<2") as caught:
        check_version(version)
    assert version in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("version", ["1.15.0", "1.16.0"])
def test_every_release_in_the_tested_range_is_accepted(version: str) -> None:
    from ckptdb.integrations.accelerate.compat import check_version

    assert check_version(version) == version
