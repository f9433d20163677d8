"""The shared integration layer (ckptdb/integrations/common.py) and the contract every
integration holds (ckptdb/integrations/contract.py: the options, publish, names,
resuming, rank agreement), on their own.

The integrations' own suites (test_lightning, test_transformers,
test_accelerate) run these through the real frameworks; here each decision is
pinned where it is made: argument checks, the guard's refusal, free names,
newest-whole lookups, protection at start, the GradScaler-skip flag and the
one policy for non-finite metrics. ``agree`` runs on two gloo ranks.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import sys
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import pytest
import torch
from distlib import run_ranks
from helpers import rows
from torch import nn

from ckptdb import External, Keep, NonFiniteGradGuard, OnPreemption, TopK
from ckptdb.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    NonFiniteGradientError,
    RankFailedError,
)
from ckptdb.integrations import common
from ckptdb.integrations.contract import IntegrationLedger, LedgerOptions

LOG = logging.getLogger("ckptdb.test-integrations")
LARGEST = sys.float_info.max


def opened(
    root: Path | str, *, guard: Any = True, watch: NonFiniteGradGuard | None = None, **kw: Any
) -> IntegrationLedger:
    """A run opened the way every integration opens one."""
    return IntegrationLedger.open(root, LedgerOptions(guard=guard), guard=watch, **kw)


def write_file(value: float) -> External:
    def write(path: Path) -> None:
        torch.save({"w": torch.tensor(value)}, path)

    return External(write, f"ckpt-{value:g}.pt")


# ------------------------------------------------------------------- arguments


@pytest.mark.parametrize("guard", [True, False, "raise"])
def test_guard_settings_are_accepted(guard: Any) -> None:
    assert common.check_guard(guard) is guard


@pytest.mark.parametrize("guard", ["yes", 2, None, "Raise", "true"])
def test_any_other_guard_is_refused(guard: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="guard must be True, False or 'raise'"):
        common.check_guard(guard)


def test_paths_db_urls_and_streams_are_checked(tmp_path: Path) -> None:
    assert common.check_path(tmp_path, "ledger") == str(tmp_path)
    assert common.check_path(None, "ledger") is None
    with pytest.raises(ArgumentTypeError, match="ledger must be a path, got 3"):
        common.check_path(3, "ledger")
    for url in ("s3://bucket/run", Path("s3://bucket/run")):
        with pytest.raises(InvalidArgumentError, match="root is 's3:/"):
            common.check_local_root(url, "root")
    common.check_local_root(tmp_path, "root")
    assert list(tmp_path.iterdir()) == []
    assert common.check_db_url("sqlite:///x.db") == "sqlite:///x.db"
    with pytest.raises(ArgumentTypeError, match="db_url must be a str"):
        common.check_db_url(b"sqlite://")
    assert common.check_stream("val_loss", suffix=".last") == "val_loss"
    with pytest.raises(InvalidArgumentError, match=r"its '\.last' stream must fit in 64"):
        common.check_stream("s" * 60, suffix=".last")
    assert common.check_stream("s" * 59, suffix=".last") == "s" * 59


# ------------------------------------------------------------------- options


def test_ledger_options_are_checked_once_and_frozen() -> None:
    given = {"region": "eu"}
    options = LedgerOptions.of(
        db_url="sqlite:///x.db", guard="raise", remote="s3://b/p", remote_options=given,
        preemption=True,
    )  # fmt: skip
    given["region"] = "us"  # the caller's dict changes later: the options do not
    assert options.remote_options == {"region": "eu"}
    assert options.preemption == OnPreemption() and LedgerOptions.of().preemption is None
    with pytest.raises(FrozenInstanceError):
        options.guard = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.remote_options["region"] = "x"  # type: ignore[index]
    assert pickle.loads(pickle.dumps(options)) == options  # callbacks are pickled
    assert (
        options.remote_key()
        == LedgerOptions.of(remote="s3://b/p", remote_options={"region": "eu"}).remote_key()
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"guard": "yes"}, InvalidArgumentError, "guard must be True, False or 'raise'"),
        ({"db_url": b"sqlite://"}, ArgumentTypeError, "db_url must be a str"),
        ({"remote": "/local/dir"}, InvalidArgumentError, "remote must be an object-storage URL"),
        ({"remote_options": {"a": 1}}, InvalidArgumentError, "remote_options= goes with remote="),
        ({"remote": "s3://b/p", "remote_options": [1]}, ArgumentTypeError, "must be a mapping"),
        ({"preemption": "TERM"}, ArgumentTypeError, "preemption must be"),
    ],
)
def test_bad_ledger_options_are_refused_with_one_wording(
    kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=re.escape(text)):
        LedgerOptions.of(**kwargs)
    if "preemption" not in kwargs:  # the same check when the value is made directly
        with pytest.raises(error, match=re.escape(text)):
            LedgerOptions(**kwargs)


def test_ledger_options_never_show_a_secret(tmp_path: Path) -> None:
    options = LedgerOptions.of(
        db_url="postgresql+psycopg://trainer:hunter2@db.example/runs",
        remote="s3://bucket/run",
        remote_options={"aws_secret_access_key": "s3cr3t", "region_name": "eu"},
    )
    shown = repr(options)
    assert "hunter2" not in shown and "s3cr3t" not in shown
    assert "trainer:***@db.example" in shown and "aws_secret_access_key" in shown
    with opened(tmp_path / "run") as ledger:
        assert "s3cr3t" not in repr(IntegrationLedger(ledger.manager, options))


@pytest.mark.parametrize(
    ("kwargs", "secret"),
    [
        ({"remote": "https://AKIA:s3cr3t@store.example/bucket"}, "s3cr3t"),
        ({"remote": "s3://b/p", "remote_options": [("aws_secret_access_key", "s3cr3t")]}, "s3cr3t"),
        ({"db_url": b"postgresql://u:s3cr3t@h/db"}, "s3cr3t"),
    ],
    ids=["remote-url", "remote-options", "db-url"],
)
def test_a_refused_option_never_shows_a_secret(kwargs: dict[str, Any], secret: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        LedgerOptions.of(**kwargs)
    assert secret not in str(caught.value)
    with pytest.raises(ArgumentTypeError) as typed:
        IntegrationLedger.open("run", {"db_url": "postgresql://u:s3cr3t@h/db"})  # type: ignore[arg-type]
    assert "s3cr3t" not in str(typed.value)


def test_equal_options_compare_and_hash_equal_whatever_their_order() -> None:
    one = LedgerOptions.of(remote="s3://b/p", remote_options={"x": 1, "y": 2})
    two = LedgerOptions.of(remote="s3://b/p", remote_options={"y": 2, "x": 1})
    assert one == two and hash(one) == hash(two) and one.remote_key() == two.remote_key()
    assert (
        one.remote_key()
        != LedgerOptions.of(remote="s3://b/p", remote_options={"x": 2}).remote_key()
    )


def test_the_contract_takes_a_manager_and_options_only(tmp_path: Path) -> None:
    with pytest.raises(ArgumentTypeError, match="options must be a LedgerOptions"):
        IntegrationLedger.open(tmp_path / "run", {"guard": True})  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    with pytest.raises(ArgumentTypeError, match="manager must be a CheckpointManager"):
        IntegrationLedger("run", LedgerOptions())  # type: ignore[arg-type]


def test_leaving_the_contract_by_an_exception_ends_the_attempt_failed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with pytest.raises(KeyError), opened(root, streams={"model": Keep(last=1)}):
        raise KeyError("training failed")
    with opened(root) as ledger:
        ledger.publish(1, "model", write_file(1.0), metrics=None, log=LOG)
    assert rows(root, "SELECT end_state FROM attempts ORDER BY id") == [("failed",), ("closed",)]


def test_why_not_says_what_the_ledger_knows_of_a_path(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with opened(root, streams={"model": Keep(last=1)}) as ledger:
        for step in (1, 2):
            ledger.publish(step, "model", write_file(float(step)), metrics=None, log=LOG)
        save_dir = ledger.save_dir
        assert ledger.why_not(save_dir / "ckpt-1.pt") == "retention removed it"
        assert "no record of it" in ledger.why_not(save_dir / "ckpt-9.pt")
        assert ledger.committed_at("model", 2) is not None
        assert ledger.committed_at("model", 1) is None
    with open(save_dir / "ckpt-2.pt", "ab") as f:
        f.write(b"more")  # rewritten after its commit: another size
    with opened(root) as ledger:  # the open's reconcile marks it corrupt
        assert "no longer match its ledger row" in ledger.why_not(save_dir / "ckpt-2.pt")
        assert ledger.spoiled_at("model", 2) and not ledger.spoiled_at("model", 1)

        def broken(path: Path) -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(Exception, match="No space left"):
            ledger.publish(3, "model", External(broken, "ckpt-3.pt"), metrics=None, log=LOG)
        assert "its save never completed" in ledger.why_not(save_dir / "ckpt-3.pt")


# ---------------------------------------------------------- publish, refusals


def test_publish_commits_one_boundary(tmp_path: Path) -> None:
    with opened(tmp_path / "run", streams={"model": Keep(last=2)}) as mgr:
        record = mgr.publish(3, "model", write_file(1.0), metrics={"loss": 0.5}, log=LOG)
        assert record is not None and record.step == 3 and record.metrics == {"loss": 0.5}
        assert mgr.manager.latest("model") == record


@pytest.mark.parametrize("guard", [True, "raise"])
def test_a_guard_trip_is_recorded_then_warned_or_raised(
    tmp_path: Path, guard: Any, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(2, 1)
    watch = NonFiniteGradGuard(model)
    model.weight.grad = torch.full_like(model.weight, math.nan)
    watch.observe(list(model.parameters()))
    heard: list[NonFiniteGradientError] = []
    root = tmp_path / "run"
    with opened(root, streams={"model": Keep(last=2)}, watch=watch, guard=guard) as mgr:
        call = lambda: mgr.publish(  # noqa: E731
            4,
            "model",
            write_file(2.0),
            metrics=None,
            log=LOG,
            refused=heard.append,
        )
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            if guard == "raise":
                with pytest.raises(NonFiniteGradientError):
                    call()
            else:
                assert call() is None
        assert mgr.manager.checkpoints() == []
    assert len(heard) == 1 and isinstance(heard[0], NonFiniteGradientError)
    assert ("step 4 was not checkpointed" in caplog.text) == (guard is True)
    assert rows(root, "SELECT step FROM events WHERE kind = 'guard_tripped'") == [(4,)]
    assert list((root).glob("ckpt-*")) == []


def test_other_errors_propagate_untouched(tmp_path: Path) -> None:
    def broken(path: Path) -> None:
        raise OSError(28, "No space left on device")

    heard: list[Any] = []
    with opened(tmp_path / "run", streams={"model": Keep(last=2)}) as mgr:
        with pytest.raises(Exception, match="No space left") as caught:
            mgr.publish(
                1, "model", External(broken, "x.pt"), metrics=None, log=LOG,
                refused=heard.append,
            )  # fmt: skip
        assert not isinstance(caught.value, NonFiniteGradientError) and heard == []
        assert mgr.manager.checkpoints() == []


# ---------------------------------------------------------- names and resuming


def test_a_free_name_skips_names_live_rows_hold_and_anything_on_disk(tmp_path: Path) -> None:
    with opened(tmp_path / "run", streams={"model": Keep(last=None)}) as mgr:
        save_dir = mgr.save_dir
        assert mgr.free_name("ckpt-5.pt") == "ckpt-5.pt"
        mgr.publish(5, "model", write_file(5.0), metrics=None, log=LOG)
        assert mgr.holds("ckpt-5.pt") and not mgr.holds("ckpt-6.pt")
        os.unlink(save_dir / "ckpt-5.pt")  # gone from disk: its row still owns the name
        assert mgr.free_name("ckpt-5.pt") == "ckpt-5.pt-v1"
        (save_dir / "ckpt-5.pt-v1").mkdir()
        (save_dir / "ckpt-5.pt-v2").symlink_to(save_dir / "nowhere")  # a dangling link
        assert mgr.free_name("ckpt-5.pt") == "ckpt-5.pt-v3"
        elsewhere = tmp_path / "other"
        elsewhere.mkdir()
        assert mgr.free_name("ckpt-6.pt", elsewhere) == "ckpt-6.pt"


def test_holds_counts_every_live_state_and_no_other(tmp_path: Path) -> None:
    with opened(tmp_path / "run", streams={"model": Keep(last=1)}) as mgr:
        for step in (1, 2):
            mgr.publish(step, "model", write_file(float(step)), metrics=None, log=LOG)
        assert not mgr.holds("ckpt-1.pt")  # evicted and deleted: the name is free again
        assert mgr.holds("ckpt-2.pt")
        with pytest.raises(ArgumentTypeError):
            mgr.holds(Path("ckpt-2.pt"))  # type: ignore[arg-type]


def test_newest_whole_skips_and_marks_a_corrupt_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    with opened(root, streams={"model": Keep(last=None)}) as mgr:
        first = mgr.publish(1, "model", write_file(1.0), metrics=None, log=LOG)
        second = mgr.publish(2, "model", write_file(2.0), metrics=None, log=LOG)
        assert first is not None and second is not None
        with open(second.path, "r+b") as f:
            f.seek(40)
            f.write(b"\xff\xfe")  # same size, other bytes
        assert common.newest_whole_read_only(root, db_url=None, log=LOG) == first
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            assert mgr.newest_whole("model", LOG) == first
        assert "not resuming from it" in caplog.text
        assert [c.step for c in mgr.manager.checkpoints(states=("corrupt",))] == [2]


def test_newest_whole_read_only_of_a_first_run_is_none(tmp_path: Path) -> None:
    assert common.newest_whole_read_only(tmp_path / "nothing", db_url=None, log=LOG) is None
    assert not (tmp_path / "nothing").exists()


def test_protect_start_keeps_earlier_files_or_the_resumed_one(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with opened(root, streams={"model": Keep(last=1)}) as mgr:
        old = mgr.publish(5, "model", write_file(5.0), metrics=None, log=LOG)
    assert old is not None
    with opened(root) as mgr:  # a rerun from step 0: the new timeline evicts 5
        mgr.start_afresh("model")
        mgr.publish(1, "model", write_file(1.0), metrics=None, log=LOG)
        assert Path(old.path).exists()  # evicted from the stream, the file stays
        latest = mgr.manager.latest("model")
        assert latest is not None and latest.step == 1
    with opened(root) as mgr:
        resumed = mgr.manager.latest("model")
        assert resumed is not None
        mgr.resume_from(resumed)
        mgr.publish(2, "model", write_file(2.0), metrics=None, log=LOG)
        assert Path(resumed.path).exists()
    assert rows(root, "SELECT step FROM events WHERE kind = 'resumed'") == [(1,)]


# ----------------------------------------------------------------------- guard


def scaled_step(values: float) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    """A real GradScaler unscaling one optimizer's gradients filled with ``values``."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    for p in model.parameters():
        assert p.grad is not None
        p.grad.fill_(values)
    scaler.unscale_(opt)
    return scaler, opt


def test_the_scaler_skip_flag_is_the_scalers_own_verdict() -> None:
    scaler, opt = scaled_step(math.inf)
    flag = common.skipped_by_scaler(scaler, opt)
    assert flag is not None and bool(flag)
    assert bool(common.skipped_by_scaler(scaler))  # every optimizer it unscaled
    scaler, opt = scaled_step(1.0)
    flag = common.skipped_by_scaler(scaler, opt)
    assert flag is not None and not bool(flag)
    assert common.skipped_by_scaler(None, opt) is None
    assert common.skipped_by_scaler(scaler, torch.optim.SGD([nn.Parameter(torch.ones(1))])) is None


def test_optimizer_params_are_every_group_in_order() -> None:
    a, b, c = (nn.Parameter(torch.ones(1)) for _ in range(3))
    opt = torch.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1)
    assert common.optimizer_params(opt) == [a, b, c]


# --------------------------------------------------------------------- metrics


def test_scalars_take_real_numbers_and_one_element_tensors() -> None:
    found = dict(
        common.scalars(
            {
                "a": 1,
                "b": 2.5,
                "c": torch.tensor(3.0),
                "flag": True,
                "text": "x",
                "many": torch.ones(2),
                "z": torch.tensor(1 + 2j),
            }
        )
    )
    assert found == {"a": 1.0, "b": 2.5, "c": 3.0}


@pytest.mark.parametrize(
    "policy, value, stored",
    [
        (TopK(3, "loss", "min"), math.nan, LARGEST),  # NaN ranks worst
        (TopK(3, "acc", "max"), math.nan, -LARGEST),
        (TopK(3, "loss", "min"), math.inf, LARGEST),  # an infinity ranks where it would
        (TopK(3, "loss", "min"), -math.inf, -LARGEST),
        (TopK(None, "acc", "max"), math.inf, LARGEST),
    ],
)
def test_a_stream_that_ranks_every_checkpoint_stores_a_finite_rank(
    policy: TopK, value: float, stored: float
) -> None:
    metric = policy.metric
    got = common.rankable_metrics({metric: value, "lr": 0.1}, policy, step=1, log=LOG)
    assert got == {metric: stored, "lr": 0.1}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, torch.tensor(math.nan)])
def test_a_stream_that_keeps_the_newest_too_leaves_a_non_finite_value_out(
    value: Any, caplog: pytest.LogCaptureFixture
) -> None:
    policy = TopK(1, "eval_loss", "min", last=3)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        got = common.rankable_metrics({"eval_loss": value, "lr": 0.1}, policy, step=7, log=LOG)
    assert got == {"lr": 0.1}
    assert "step 7: eval_loss is" in caplog.text and "never the best" in caplog.text


def test_finite_values_other_metrics_and_unranked_streams_are_left_alone() -> None:
    metrics = {"loss": 0.5, "grad_norm": math.inf}
    assert common.rankable_metrics(metrics, TopK(1, "loss"), step=1, log=LOG) is metrics
    assert common.rankable_metrics(metrics, Keep(last=2), step=1, log=LOG) is metrics
    assert common.rankable_metrics(metrics, None, step=1, log=LOG) is metrics
    assert common.rankable_metrics(None, TopK(1, "loss"), step=1, log=LOG) is None
    odd = {"loss": "high"}  # not a number: ckptdb's own checks refuse it, typed
    assert common.rankable_metrics(odd, TopK(1, "loss"), step=1, log=LOG) is odd


def test_the_policy_holds_in_the_ledger(tmp_path: Path) -> None:
    """Through a real boundary: the worst-ranked NaN checkpoint is saved, and the best is
    the finite one."""
    policy = TopK(2, "loss", "min")
    with opened(tmp_path / "run", streams={"best": policy}) as mgr:
        for step, loss in ((1, math.nan), (2, 3.0)):
            metrics = common.rankable_metrics({"loss": loss}, policy, step=step, log=LOG)
            mgr.publish(step, "best", write_file(float(step)), metrics=metrics, log=LOG)
        assert [(c.step, c.metric) for c in mgr.manager.best("best")] == [(2, 3.0), (1, LARGEST)]


# ------------------------------------------------------------- rank agreement


def test_agree_in_one_process_raises_the_local_error_itself(tmp_path: Path) -> None:
    with opened(tmp_path / "run") as mgr:
        assert mgr.is_chief
        plan = {"step": 4}
        assert mgr.from_chief(plan) is plan
        mgr.agree(None)
        mine = InvalidArgumentError("bad step")
        with pytest.raises(InvalidArgumentError) as caught:
            mgr.agree(mine, what="save")
        assert caught.value is mine


def _agree_on_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    with opened(root, streams={"model": Keep(last=2)}) as mgr:
        mgr.agree(None, what="first")  # nobody failed: nothing raised anywhere
        local = OSError(5, "cannot read it") if rank == 1 else None
        try:
            mgr.agree(local, what="load_state")
        except Exception as exc:
            cause = exc.__cause__
            seen["raised"] = (type(exc).__name__, getattr(exc, "ranks", None), str(exc))
            seen["cause"] = type(cause).__name__ if cause is not None else None
        # every rank is still in step: a boundary after the agreement commits
        saved = mgr.manager.save(3, model={"w": torch.tensor(float(rank))})
        seen["saved"] = saved["model"].step if "model" in saved else None
        seen["is_chief"] = mgr.is_chief
        seen["from_chief"] = mgr.from_chief({"step": 10 + rank, "names": [f"r{rank}"]})
        seen["none_from_chief"] = mgr.from_chief(None if rank == 0 else "mine", what="end")
        # collective whatever each rank asks: the chief's question, answered everywhere
        found = mgr.committed_at("model", 3 if rank == 0 else None)
        seen["committed_at"] = found.step if found is not None else None
        seen["spoiled_at"] = mgr.spoiled_at("model", None if rank == 0 else 3)
        seen["after"] = mgr.from_chief("in step", what="after")
    return seen


@pytest.mark.timeout(60)
def test_agree_on_two_ranks_names_the_failed_rank_and_hangs_nobody(tmp_path: Path) -> None:
    outcomes = run_ranks(_agree_on_ranks, 2, tmp_path, str(tmp_path / "run"), timeout=45)
    assert [o.error for o in outcomes] == [None, None], [o.trace for o in outcomes]
    chief, other = outcomes[0].value, outcomes[1].value
    assert chief["raised"][:2] == ("RankFailedError", [1])
    assert chief["raised"][2].startswith("load_state failed on rank 1: ")
    assert "OSError" in chief["raised"][2] and "cannot read it" in chief["raised"][2]
    assert chief["cause"] is not None
    assert other["raised"][:2] == ("OSError", None) and other["cause"] is None
    assert chief["saved"] == other["saved"] == 3
    assert (chief["is_chief"], other["is_chief"]) == (True, False)
    assert chief["from_chief"] == other["from_chief"] == {"step": 10, "names": ["r0"]}
    assert chief["none_from_chief"] is None and other["none_from_chief"] is None
    assert chief["committed_at"] == other["committed_at"] == 3
    assert chief["spoiled_at"] == other["spoiled_at"] == []
    assert chief["after"] == other["after"] == "in step"


def test_rank_failed_error_is_the_typed_error_users_catch() -> None:
    assert issubclass(RankFailedError, RuntimeError)


# -------------------------------------------------------------- adopt registry


def test_a_layout_that_cannot_be_imported_is_kept_shown_and_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A framework package whose layout fails to import takes nothing else down (the
    other layouts, the help), and its error is raised when that layout is asked for."""
    import ckptdb.integrations
    from ckptdb.integrations import layouts

    package = tmp_path / "brokenfw"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layout.py").write_text("raise RuntimeError('this layout is broken')\n")
    monkeypatch.setattr(
        ckptdb.integrations, "__path__", [*ckptdb.integrations.__path__, str(tmp_path)]
    )
    monkeypatch.setattr(layouts, "_DISCOVERED", False)
    monkeypatch.setattr(layouts, "_BROKEN", {})
    monkeypatch.setattr(layouts, "_REGISTRY", dict(layouts._REGISTRY))
    monkeypatch.delitem(sys.modules, "ckptdb.integrations.brokenfw", raising=False)
    found = layouts.layouts()
    assert {"lightning", "transformers", "accelerate", "deepmd", "glob"} <= set(found)
    assert "brokenfw" not in found
    assert re.search(
        r"  brokenfw +unavailable: RuntimeError: this layout is broken", layouts.help_table()
    )
    with pytest.raises(ImportError, match="'brokenfw' layout could not be imported") as caught:
        layouts.layout_named("brokenfw")
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(InvalidArgumentError, match="unknown layout 'nope'; known: accelerate"):
        layouts.layout_named("nope")


def test_a_framework_packages_names_resolve_lazily_and_typos_fail() -> None:
    import ckptdb.integrations.lightning as package
    from ckptdb.integrations.lightning import callback

    assert package.ModelCheckpoint is callback.ModelCheckpoint
    assert {"ModelCheckpoint", "default_ledger", "newest_committed"} <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'ModelCheckpointt'"):
        package.ModelCheckpointt  # noqa: B018
    with pytest.raises(AttributeError):
        package.__wrapped__  # noqa: B018  # dunder names never reach the writer
