"""The Hugging Face integration: a real ``transformers.Trainer`` (a GPT-2 built from a
config, CPU) whose ``checkpoint-N`` directories commit through the ledger.

What the Trainer's users rely on (its own tests: resume from the last
checkpoint reproduces an uninterrupted run, ``save_total_limit`` keeps the best,
``load_best_model_at_end`` loads it) is checked here, and so are the ways the
stock Trainer loses work: resuming from a partial directory, deleting the best
or the resume source, a stale best after resume, a rename before every rank
wrote.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hflib import (
    RESUMES_UNDER_CPU_DDP,
    Definite,
    NaNAt,
    dataset,
    same_weights,
    scripted_scores,
    tiny_model,
    torchrun,
    training_args,
    weights,
    with_scores,
)
from transformers.trainer_utils import get_last_checkpoint

from ckptdb import RunReader
from ckptdb.errors import (
    ArgumentTypeError,
    CkptDBError,
    InvalidArgumentError,
    NoCheckpointToResumeError,
    NonFiniteGradientError,
    UnsupportedVersionError,
)
from ckptdb.integrations.transformers import STREAM, Trainer, ledger_trainer, streams_for
from ckptdb.policies import Keep, TopK

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_db_url_from_environment")]

HERE = Path(__file__).parent
CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "optimizer.pt",
    "rng_state.pth",
    "scheduler.pt",
    "trainer_state.json",
    "training_args.bin",
}


def trainer(out: Path, args: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("train_dataset", dataset())
    return Trainer(model=tiny_model(), args=args or training_args(out), **kwargs)


def dirs(out: Path) -> list[str]:
    """The checkpoint directories on disk, hidden ones (temporaries) included."""
    return sorted(p.name for p in out.iterdir() if p.is_dir())


def committed(out: Path, db_url: str | None = None) -> list[tuple[int, str, float | None]]:
    with RunReader(out, db_url=db_url) as reader:
        return [(c.step, c.path.name, c.metric) for c in reader.checkpoints(STREAM)]


def check_clean(out: Path, db_url: str | None = None) -> None:
    from ckptdb import CheckpointManager

    with CheckpointManager(out, db_url=db_url, maintenance=True) as mgr:
        assert mgr.check() == []


def run_script(out: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "hf_train.py"), str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------- visibility


def test_each_checkpoint_directory_is_one_committed_row_with_the_trainers_files(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    t = trainer(out)
    t.train()
    assert committed(out) == [
        (4, "checkpoint-4", None),
        (8, "checkpoint-8", None),
        (12, "checkpoint-12", None),
    ]
    assert dirs(out) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert {p.name for p in (out / "checkpoint-8").iterdir()} == CHECKPOINT_FILES
    saved = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert saved["global_step"] == 8
    check_clean(out)


def steps_and_losses(state: Any) -> list[tuple[int, float]]:
    return [(e["step"], round(e["loss"], 4)) for e in state.log_history if "loss" in e]


def test_resume_from_the_newest_committed_checkpoint_reproduces_an_uninterrupted_run(
    tmp_path: Path,
) -> None:
    """The Trainer's own promise, kept: stop at 8, resume, finish at 12 = straight to 12."""
    straight = trainer(tmp_path / "a")
    straight.train()
    trainer(tmp_path / "b", training_args(tmp_path / "b", max_steps=8)).train()
    resumed = trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 12
    assert same_weights(weights(straight.model), weights(resumed.model))
    # the state too (the Trainer's own test compares it): the logged losses and steps
    assert steps_and_losses(resumed.state) == steps_and_losses(straight.state)
    with RunReader(tmp_path / "b") as reader:
        attempt = reader.attempts()[-1]
        source = next(c for c in reader.checkpoints(STREAM) if c.id == attempt.resumed_from_id)
    assert source.step == 8


def test_a_resume_with_another_batch_size_ends_as_the_stock_trainer_does(
    tmp_path: Path,
) -> None:
    """Resumed with ``per_device_train_batch_size`` changed: the step reached and the batch
    size in force (and in the saved state) are the stock Trainer's."""
    outcomes = []
    for kind, cls in (("stock", transformers.Trainer), ("ours", Trainer)):
        out = tmp_path / kind
        cls(
            model=tiny_model(), args=training_args(out, max_steps=8), train_dataset=dataset()
        ).train()
        args = training_args(out, per_device_train_batch_size=2)
        t = cls(model=tiny_model(), args=args, train_dataset=dataset())
        t.train(resume_from_checkpoint=str(out / "checkpoint-8"))
        saved = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
        outcomes.append((t.state.global_step, t.state.train_batch_size, saved["train_batch_size"]))
    assert outcomes[1] == outcomes[0] and outcomes[0][0] == 12


def test_a_partial_highest_numbered_directory_is_never_resumed_from(tmp_path: Path) -> None:
    """The stock ``get_last_checkpoint`` takes the highest number, complete or not."""
    out = tmp_path / "out"
    trainer(out, training_args(out, max_steps=8)).train()
    partial = out / "checkpoint-100"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half a file")
    assert get_last_checkpoint(str(out)) == str(partial)  # what the Trainer would resume
    t = trainer(out)
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 12
    assert [step for step, _, _ in committed(out)] == [4, 8, 12]
    assert partial.is_dir()  # not ckptdb's: never deleted either


def test_a_corrupt_newest_checkpoint_is_marked_and_the_previous_one_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    trainer(out).train()
    weights_file = out / "checkpoint-12" / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0xFF
    weights_file.write_bytes(bytes(data))
    t = trainer(out, training_args(out, max_steps=16))
    with caplog.at_level(logging.WARNING, logger="ckptdb.transformers"):
        t.train(resume_from_checkpoint=True)
    assert "not resuming from it" in caplog.text
    with RunReader(out) as reader:
        states = {c.step: c.state for c in reader.checkpoints(STREAM, states=("corrupt",))}
        attempt = reader.attempts()[-1]
        source = next(c for c in reader.checkpoints(STREAM) if c.id == attempt.resumed_from_id)
    assert states == {12: "corrupt"}
    assert source.step == 8


@pytest.mark.parametrize("how", ["kill-in-write", "after_replace", "in_commit"])
def test_a_crash_while_writing_a_checkpoint_resumes_from_the_previous_one(
    tmp_path: Path, how: str
) -> None:
    """SIGKILL inside the Trainer's savers (a temporary directory half written), or a
    crash after the directory got its final name but before the commit: the next run
    rolls it back and resumes from checkpoint-4."""
    out = tmp_path / "out"
    args = ["--kill-in-write", "8"] if how == "kill-in-write" else ["--crash-at", how]
    done = run_script(out, *args, "--crash-step", "8")
    assert done.returncode != 0 and "RESULT" not in done.stdout, done.stderr[-2000:]
    leftovers = [d for d in dirs(out) if d != "checkpoint-4"]
    assert leftovers  # the crash left a partial checkpoint-8 behind, somewhere
    if how != "kill-in-write":
        assert get_last_checkpoint(str(out)) == str(out / "checkpoint-8")  # stock would resume it
    t = trainer(out)
    t.train(resume_from_checkpoint=True)
    assert t.state.global_step == 12
    with RunReader(out) as reader:
        attempt = reader.attempts()[-1]
        aborted = [c.step for c in reader.checkpoints(STREAM, states=("aborted",))]
        source = next(c for c in reader.checkpoints() if c.id == attempt.resumed_from_id)
    assert source.step == 4 and aborted == [8]
    assert [step for step, _, _ in committed(out)] == [4, 8, 12]
    assert dirs(out) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    check_clean(out)


# -------------------------------------------------------------------- retention


def test_save_total_limit_keeps_the_best_whatever_its_age_and_loads_it_at_the_end(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    args = with_scores(out, save_total_limit=2, load_best_model_at_end=True, max_steps=16)
    t = trainer(
        out, args, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.1, 0.5, 0.4, 0.3])
    )
    best_weights: dict[str, torch.Tensor] = {}

    class Snapshot(transformers.TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 4:
                best_weights.update(weights(t.model))

    t.add_callback(Snapshot())
    t.train()
    assert dirs(out) == ["checkpoint-16", "checkpoint-4"]
    assert committed(out) == [(4, "checkpoint-4", 0.1), (16, "checkpoint-16", 0.3)]
    assert t.state.best_model_checkpoint == str(out / "checkpoint-4")
    assert t.state.best_metric == 0.1
    assert same_weights(weights(t.model), best_weights)  # load_best_model_at_end
    check_clean(out)


def test_save_total_limit_one_never_deletes_the_newest_nor_a_foreign_directory(
    tmp_path: Path,
) -> None:
    """The stock end of training deletes every checkpoint but the best (the resume
    source goes), and its rotation deletes any ``checkpoint-*`` it finds."""
    out = tmp_path / "out"
    foreign = out / "checkpoint-1"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("the user's")
    args = with_scores(out, save_total_limit=1, load_best_model_at_end=True)
    t = trainer(
        out, args, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.1, 0.5, 0.4])
    )
    t.train()
    assert dirs(out) == ["checkpoint-1", "checkpoint-12", "checkpoint-4"]
    assert [step for step, _, _ in committed(out)] == [4, 12]
    assert t.args.save_total_limit == 1  # put back after the end of training


def test_the_best_after_a_resume_is_the_ledgers(tmp_path: Path) -> None:
    """Resumed explicitly from checkpoint-4: its trainer_state.json knows nothing of the
    better checkpoint-8 that came later. The ledger does: that is the best when training
    begins. Re-saving step 8 on the new timeline replaces it (under a ``-v1`` name,
    since the directory is still there), and the best becomes what the ledger ranks."""
    out = tmp_path / "out"
    first = with_scores(out, save_total_limit=2, max_steps=8)
    trainer(
        out, first, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.5, 0.1])
    ).train()
    inside = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert inside["best_model_checkpoint"] == str(out / "checkpoint-4")
    args = with_scores(out, save_total_limit=2, max_steps=12)
    t = trainer(out, args, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.7, 0.9]))
    seen: list[tuple[str | None, float | None]] = []

    class Peek(transformers.TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append((state.best_model_checkpoint, state.best_metric))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append((state.best_model_checkpoint, state.best_metric))

    t.add_callback(Peek())
    t.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert seen == [
        (str(out / "checkpoint-8"), 0.1),
        (str(out / "checkpoint-4"), 0.5),  # step 8 re-saved as checkpoint-8-v1 (0.7)
        (str(out / "checkpoint-4"), 0.5),
    ]
    assert [name for _, name, _ in committed(out)] == ["checkpoint-4", "checkpoint-12"]
    assert dirs(out) == ["checkpoint-12", "checkpoint-4"]
    with RunReader(out) as reader:
        names = [c.path.name for c in reader.checkpoints(STREAM, states=("deleted",))]
    assert sorted(names) == ["checkpoint-8", "checkpoint-8-v1"]
    check_clean(out)


class QuietEvaluate(transformers.Trainer):  # type: ignore[misc]
    """A Trainer whose ``evaluate()`` returns (and logs) scripted metrics without
    announcing them to the callbacks, as many overriding subclasses do."""

    scores: list[float] = []

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics = {"eval_accuracy": self.scores.pop(0), "epoch": self.state.epoch}
        self.log(metrics)
        return metrics


def holds_weights_of(model: Any, checkpoint: Path) -> bool:
    """Whether ``model`` has the weights saved in ``checkpoint`` (a tied weight is saved
    once, so only the saved names are compared)."""
    from safetensors.torch import load_file

    saved, live = load_file(str(checkpoint / "model.safetensors")), weights(model)
    return bool(saved) and all(torch.equal(live[name], saved[name]) for name in saved)


@pytest.mark.parametrize("mixed", ["ledger_trainer(Subclass)", "subclass of ckptdb's Trainer"])
def test_an_evaluation_no_callback_hears_of_still_ranks_and_keeps_the_best(
    tmp_path: Path, mixed: str
) -> None:
    """accuracy 0.9, 0.8, 0.7 over three epochs, save_total_limit=1, load the best at the
    end: the stock Trainer's best is 0.9 at checkpoint-8, kept, and the run ends with its
    weights. The metrics reach the ledger however the evaluation was reached."""
    out = tmp_path / "out"
    if mixed == "ledger_trainer(Subclass)":
        cls: Any = ledger_trainer(QuietEvaluate)
    else:
        cls = type("Quiet", (Trainer,), {"evaluate": QuietEvaluate.evaluate})
    args = training_args(
        out,
        max_steps=-1,
        num_train_epochs=3,
        eval_strategy="epoch",
        save_strategy="epoch",
        metric_for_best_model="accuracy",
        greater_is_better=True,
        load_best_model_at_end=True,
        save_total_limit=1,
    )
    t = cls(model=tiny_model(), args=args, train_dataset=dataset(), eval_dataset=dataset(8))
    t.scores = [0.9, 0.8, 0.7]
    t.train()
    assert (t.state.best_metric, t.state.best_global_step) == (0.9, 8)
    assert t.state.best_model_checkpoint == str(out / "checkpoint-8")
    assert "checkpoint-8" in dirs(out)
    assert [(step, metric) for step, _, metric in committed(out)] == [(8, 0.9), (24, 0.7)]
    assert holds_weights_of(t.model, out / "checkpoint-8")
    assert not holds_weights_of(t.model, out / "checkpoint-24")
    check_clean(out)


def test_the_best_of_an_evaluation_that_was_not_saved_stays_the_trainers(tmp_path: Path) -> None:
    """Evaluated every 3 steps, saved every 2 (the Trainer's own case): its best (0.9 at
    step 3, never saved) stands as the Trainer computed it, and later evaluations compare
    with it; the best checkpoint named is always a committed one."""
    out = tmp_path / "out"
    args = with_scores(
        out,
        eval_steps=3,
        save_steps=2,
        max_steps=12,
        metric_for_best_model="score",
        greater_is_better=True,
    )
    stock_args = with_scores(
        tmp_path / "stock",
        eval_steps=3,
        save_steps=2,
        max_steps=12,
        metric_for_best_model="score",
        greater_is_better=True,
    )
    scores = [0.9, 0.8, 0.7, 0.6]
    stock = transformers.Trainer(
        model=tiny_model(),
        args=stock_args,
        train_dataset=dataset(),
        eval_dataset=dataset(8),
        compute_metrics=scripted_scores(scores),
    )
    stock.train()
    t = trainer(out, args, eval_dataset=dataset(8), compute_metrics=scripted_scores(scores))
    t.train()
    assert (t.state.best_metric, t.state.best_global_step) == (0.9, 3)
    assert (stock.state.best_metric, stock.state.best_global_step) == (0.9, 3)
    assert t.state.best_model_checkpoint in {str(c.path) for c in RunReader(out).checkpoints()}
    check_clean(out)


def test_an_earlier_runs_checkpoint_at_the_best_step_never_replaces_the_best(
    tmp_path: Path,
) -> None:
    """Run 1 saved steps 4 (0.5) and 8 (0.9). Run 2 trains again in the same directory,
    evaluating every 2 steps and saving every 6: its best is 0.95 at step 8, never saved.
    Run 1's checkpoint at step 8 is not run 2's step-8 evaluation: the Trainer's best
    stands, and run 2's later 0.92 is not a new best."""
    out = tmp_path / "out"
    first = with_scores(out, max_steps=8, greater_is_better=True)
    trainer(
        out, first, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.5, 0.9])
    ).train()
    args = with_scores(out, max_steps=12, eval_steps=2, save_steps=6, greater_is_better=True)
    scores = scripted_scores([0.1, 0.2, 0.3, 0.95, 0.4, 0.92])  # steps 2, 4, ..., 12
    t = trainer(out, args, eval_dataset=dataset(8), compute_metrics=scores)
    t.train()
    assert (t.state.best_metric, t.state.best_global_step) == (0.95, 8)
    with RunReader(out) as reader:
        paths = {str(c.path) for c in reader.checkpoints(STREAM)}
    assert t.state.best_model_checkpoint in paths


def test_save_strategy_best_saves_only_new_bests_as_the_stock_trainer_does(
    tmp_path: Path,
) -> None:
    """``save_strategy="best"``: a checkpoint only at an evaluation that beat the best so
    far (scores 0.60, 0.65, 0.64, greater is better): the same checkpoints and best as
    the stock Trainer."""
    outcomes = []
    for kind, cls in (("stock", transformers.Trainer), ("ours", Trainer)):
        out = tmp_path / kind
        args = training_args(
            out,
            max_steps=-1,
            num_train_epochs=3,
            eval_strategy="epoch",
            save_strategy="best",
            metric_for_best_model="score",
            greater_is_better=True,
        )
        t = cls(
            model=tiny_model(),
            args=args,
            train_dataset=dataset(),
            eval_dataset=dataset(8),
            compute_metrics=scripted_scores([0.60, 0.65, 0.64]),
        )
        t.train()
        checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
        outcomes.append((checkpoints, t.state.best_metric, t.state.best_model_checkpoint))
    (stock_dirs, stock_best, stock_path), (dirs_, best, path) = outcomes
    assert dirs_ == stock_dirs == ["checkpoint-16", "checkpoint-8"]
    assert best == stock_best == 0.65
    # transformers 5 names the best checkpoint; 4.57 never does with "best" (ckptdb does)
    assert path == str(tmp_path / "ours" / "checkpoint-16")
    assert stock_path in (None, str(tmp_path / "stock" / "checkpoint-16"))
    assert [step for step, _, _ in committed(tmp_path / "ours")] == [8, 16]


def test_a_checkpoint_rewritten_after_its_commit_is_refused_for_what_it_is(
    tmp_path: Path,
) -> None:
    """Its files were rewritten (another size): the open marks it corrupt, and resuming
    from it says so, not "a partial save"."""
    out = tmp_path / "out"
    trainer(out, training_args(out, max_steps=8)).train()
    with open(out / "checkpoint-4" / "trainer_state.json", "a") as f:
        f.write("\n")
    with pytest.raises(NoCheckpointToResumeError, match="no longer match its ledger row") as err:
        trainer(out).train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert "partial save" not in str(err.value)
    stray = out / "checkpoint-6"
    shutil.copytree(out / "checkpoint-8", stray)
    with pytest.raises(NoCheckpointToResumeError, match="no record of it"):
        trainer(out).train(resume_from_checkpoint=str(stray))


def test_a_rerun_without_resume_never_deletes_the_earlier_runs_directories(
    tmp_path: Path,
) -> None:
    """Training again from scratch in the same output_dir: the new run's steps get
    ``-v1`` names beside the old directories, and its retention takes the old ones
    out of the stream without deleting them (the stock rotation would)."""
    out = tmp_path / "out"
    trainer(out, training_args(out, save_total_limit=2)).train()
    assert dirs(out) == ["checkpoint-12", "checkpoint-8"]
    trainer(out, training_args(out, save_total_limit=2)).train()
    assert [name for _, name, _ in committed(out)] == ["checkpoint-8-v1", "checkpoint-12-v1"]
    assert dirs(out) == ["checkpoint-12", "checkpoint-12-v1", "checkpoint-8", "checkpoint-8-v1"]
    check_clean(out)


def test_a_name_held_by_a_lost_checkpoint_is_not_reused(tmp_path: Path) -> None:
    """checkpoint-8's directory vanished (its row is marked lost at the next open);
    training through step 8 again publishes checkpoint-8-v1 instead of failing."""
    out = tmp_path / "out"
    trainer(out).train()
    shutil.rmtree(out / "checkpoint-8")
    t = trainer(out)
    t.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    with RunReader(out) as reader:
        lost = [c.path.name for c in reader.checkpoints(STREAM, states=("lost",))]
    assert lost == ["checkpoint-8"]
    assert [name for _, name, _ in committed(out)] == [
        "checkpoint-4",
        "checkpoint-8-v1",
        "checkpoint-12",  # the abandoned step 12 went when step 8 was saved again
    ]


def test_every_eval_dataset_of_a_step_reaches_its_checkpoint(tmp_path: Path) -> None:
    """With a dict of eval datasets the Trainer evaluates each in turn (one on_evaluate
    each); the ranking metric of the first must not be lost to the second's."""
    out = tmp_path / "out"
    args = with_scores(
        out, metric_for_best_model="a_score", save_total_limit=2, load_best_model_at_end=True
    )
    scores = scripted_scores([0.1, 0.9, 0.5, 0.9, 0.4, 0.9])  # a, b, a, b, a, b
    evals = {"a": dataset(8), "b": dataset(8, seed=1)}
    t = trainer(out, args, eval_dataset=evals, compute_metrics=scores)
    t.train()
    rows = committed(out)
    assert [(step, metric) for step, _, metric in rows] == [(4, 0.1), (12, 0.4)]
    assert t.state.best_model_checkpoint == str(out / "checkpoint-4")
    with RunReader(out) as reader:
        kept = reader.checkpoints(STREAM)
    assert {"eval_a_score", "eval_b_score"} <= set(kept[0].metrics)


def test_a_warm_start_never_deletes_the_runs_earlier_checkpoints(tmp_path: Path) -> None:
    other, out = tmp_path / "other", tmp_path / "out"
    trainer(other, training_args(other, max_steps=4)).train()
    trainer(out).train()
    t = trainer(out, training_args(out, save_total_limit=1))
    t.train(resume_from_checkpoint=str(other / "checkpoint-4"))
    assert [name for _, name, _ in committed(out)] == ["checkpoint-12-v1"]
    assert {"checkpoint-4", "checkpoint-8", "checkpoint-12"} <= set(dirs(out))


def test_push_to_hub_with_the_ledger_in_output_dir_is_refused(tmp_path: Path) -> None:
    """The Hub upload of output_dir would take the ledger with it."""
    out = tmp_path / "out"
    args = training_args(out, push_to_hub=True, hub_model_id="me/x")
    with pytest.raises(InvalidArgumentError, match="push_to_hub"):
        Trainer(model=tiny_model(), args=args, train_dataset=dataset())
    assert not out.exists()


def test_a_trainer_class_without_the_overridden_methods_is_refused() -> None:
    class Odd(transformers.Trainer):
        _save_scaler = None  # type: ignore[assignment]

    with pytest.raises(ArgumentTypeError, match="_save_scaler"):
        ledger_trainer(Odd)


def test_streams_follow_the_training_arguments(tmp_path: Path) -> None:
    assert streams_for(training_args(tmp_path)) == {STREAM: Keep(last=None)}
    assert streams_for(training_args(tmp_path, save_total_limit=3)) == {STREAM: Keep(last=3)}
    scored = with_scores(tmp_path, save_total_limit=2)
    assert streams_for(scored) == {STREAM: TopK(1, "eval_score", "min", last=2)}
    unlimited = with_scores(tmp_path, greater_is_better=True)
    assert streams_for(unlimited) == {STREAM: TopK(None, "eval_score", "max", last=1)}


# ------------------------------------------------------------ guard and metrics


@pytest.mark.parametrize("guard", [True, "raise"])
def test_a_nan_gradient_refuses_the_next_checkpoint(
    tmp_path: Path, guard: Any, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    ref: list[Any] = []
    t = Trainer(
        model=tiny_model(),
        args=training_args(out),
        train_dataset=dataset(),
        callbacks=[NaNAt(ref, step=6)],
        guard=guard,
    )
    ref.append(t)
    t.add_callback(Definite(ref))
    announced: list[int] = []

    class Uploader(transformers.TrainerCallback):  # what the hub loggers do in on_save
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            announced.append(state.global_step)

    t.add_callback(Uploader())
    if guard == "raise":
        with pytest.raises(NonFiniteGradientError):
            t.train()
        assert [step for step, _, _ in committed(out)] == [4]
    else:
        with caplog.at_level(logging.WARNING, logger="ckptdb.transformers"):
            t.train()
        assert "non-finite gradient" in caplog.text
        assert [step for step, _, _ in committed(out)] == [4, 12]
        assert announced == [4, 12]  # on_save never hears of the refused step 8
    assert dirs(out) == ["checkpoint-12", "checkpoint-4"][guard == "raise" :]
    with RunReader(out) as reader:
        kinds = [e.kind for e in reader.events(limit=50)]
    assert "guard_tripped" in kinds


def test_a_step_without_nan_is_never_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer(out, guard=True).train()
    assert [step for step, _, _ in committed(out)] == [4, 8, 12]


def test_logged_values_reach_the_metrics_table_and_eval_metrics_the_row(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = with_scores(out)
    t = trainer(
        out, args, eval_dataset=dataset(8), compute_metrics=scripted_scores([0.3, 0.2, 0.1])
    )
    t.train()
    logged = [(h["step"], h["loss"]) for h in t.state.log_history if "loss" in h]
    with RunReader(out) as reader:
        history = [(step, value) for step, value, _ in reader.metric_history("loss")]
        rows = reader.checkpoints(STREAM)
    assert history == [(step, pytest.approx(loss)) for step, loss in logged]
    assert [c.metrics["eval_score"] for c in rows] == [0.3, 0.2, 0.1]
    assert all("eval_loss" in c.metrics for c in rows)


# ------------------------------------------------------------------ bad input


def test_ledger_trainer_takes_trainer_subclasses_only() -> None:
    with pytest.raises(ArgumentTypeError):
        ledger_trainer(torch.nn.Module)
    with pytest.raises(ArgumentTypeError):
        ledger_trainer("Trainer")  # type: ignore[arg-type]
    assert ledger_trainer(Trainer) is Trainer


def test_any_trainer_subclass_gets_the_ledger(tmp_path: Path) -> None:
    """Users train with TRL's trainers or their own: their overrides keep working."""
    calls: list[int] = []

    class Mine(transformers.Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return super().compute_loss(model, inputs, *args, **kwargs)

    Ledgered = ledger_trainer(Mine)
    assert issubclass(Ledgered, Mine) and issubclass(Ledgered, transformers.Trainer)
    out = tmp_path / "out"
    Ledgered(
        model=tiny_model(), args=training_args(out, max_steps=4), train_dataset=dataset()
    ).train()
    assert calls and [step for step, _, _ in committed(out)] == [4]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"guard": "yes"}, InvalidArgumentError),
        ({"ledger": 3}, ArgumentTypeError),
        ({"db_url": 5}, ArgumentTypeError),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(error):
        Trainer(model=tiny_model(), args=training_args(out), train_dataset=dataset(), **kwargs)
    assert not (out / "ckptdb.sqlite").exists()


def test_resume_true_with_nothing_committed_is_a_value_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint-8").mkdir()  # a directory, but no committed checkpoint
    with pytest.raises(NoCheckpointToResumeError, match="No valid checkpoint") as caught:
        trainer(out).train(resume_from_checkpoint=True)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, CkptDBError)
    assert dirs(out) == ["checkpoint-8"] and committed(out) == []


def test_resuming_from_an_uncommitted_directory_of_the_run_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    trainer(out, training_args(out, max_steps=4)).train()
    stray = out / "checkpoint-6"
    shutil.copytree(out / "checkpoint-4", stray)
    with pytest.raises(NoCheckpointToResumeError, match="not a committed checkpoint"):
        trainer(out).train(resume_from_checkpoint=str(stray))
    assert committed(out) == [(4, "checkpoint-4", None)] and stray.is_dir()


def test_resuming_from_a_directory_outside_the_run_is_the_users_call(tmp_path: Path) -> None:
    """Warm start from another run's files: handed to the Trainer as given."""
    other = tmp_path / "other"
    trainer(other, training_args(other, max_steps=4)).train()
    out = tmp_path / "out"
    t = trainer(out, training_args(out, max_steps=8))
    t.train(resume_from_checkpoint=str(other / "checkpoint-4"))
    assert t.state.global_step == 8
    assert [step for step, _, _ in committed(out)] == [8]


def test_a_failing_write_commits_nothing_and_training_stops(tmp_path: Path) -> None:
    out = tmp_path / "out"
    t = trainer(out)

    def broken(output_dir: str) -> None:
        if t.state.global_step == 8:
            raise OSError(28, "No space left on device", output_dir)

    original = t._save_rng_state
    t._save_rng_state = lambda d: (broken(d), original(d))  # type: ignore[method-assign]
    with pytest.raises(CkptDBError) as caught:
        t.train()
    assert "No space left on device" in str(caught.value) or isinstance(
        caught.value.__cause__, OSError
    )
    assert [step for step, _, _ in committed(out)] == [4]
    assert dirs(out) == ["checkpoint-4"]
    check_clean(out)


# ------------------------------------------------------------------ distributed


@pytest.mark.timeout(300)
def test_two_ranks_commit_only_after_both_wrote(tmp_path: Path) -> None:
    """Rank 1's write fails at step 8: no rank publishes it, no rank hangs, and the
    directory never appears; a rerun resumes from checkpoint-4 with both ranks' RNG."""
    out = tmp_path / "out"
    results = torchrun(out, "--fail-rank", "1", "--fail-step", "8")
    assert [r["error"] for r in results] == ["PublishError", "PublishError"]
    assert [step for step, _, _ in committed(out)] == [4]
    assert dirs(out) == ["checkpoint-4"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {
        p.name for p in (out / "checkpoint-4").iterdir()
    }
    if not RESUMES_UNDER_CPU_DDP:  # transformers 4.57's own resume fails here (hflib)
        return
    results = torchrun(out, "--resume", "--slow-rank", "1")
    assert [r["error"] for r in results] == [None, None]
    assert [step for step, _, _ in committed(out)] == [4, 8, 12]
    for name in ("checkpoint-8", "checkpoint-12"):  # rank 1 wrote late, and is in the commit
        assert (out / name / "rng_state_1.pth").is_file()
    check_clean(out)  # the committed hashes cover rank 1's late files


# ------------------------------------------------------------------ PostgreSQL


def test_the_ledger_can_live_in_postgresql(tmp_path: Path, pg_url: str) -> None:
    out = tmp_path / "out"
    t = Trainer(
        model=tiny_model(),
        args=training_args(out, max_steps=8),
        train_dataset=dataset(),
        db_url=pg_url,
    )
    t.train()
    assert not (out / "ckptdb.sqlite").exists()
    resumed = Trainer(
        model=tiny_model(), args=training_args(out), train_dataset=dataset(), db_url=pg_url
    )
    resumed.train(resume_from_checkpoint=True)
    assert [step for step, _, _ in committed(out, pg_url)] == [4, 8, 12]
    check_clean(out, pg_url)


def test_the_adopt_layout_reads_the_names_the_trainer_writes() -> None:
    """The layout (which imports no transformers) and the Trainer agree on the names."""
    from transformers.trainer import TRAINER_STATE_NAME as STOCK_STATE
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from ckptdb.integrations.transformers import layout

    assert layout.CHECKPOINT_PREFIX == PREFIX_CHECKPOINT_DIR
    assert layout.TRAINER_STATE_NAME == STOCK_STATE
    assert layout.STREAM == STREAM
    assert layout.TransformersLayout.PATTERN.fullmatch(f"{PREFIX_CHECKPOINT_DIR}-40")


@pytest.mark.parametrize("version", ["4.56.2", "6.0.0", "main"])
def test_a_release_outside_the_tested_range_is_refused_in_one_line(version: str) -> None:
    from ckptdb.integrations.transformers.compat import check_version

    with pytest.raises(UnsupportedVersionError, match=r">=4\.57,<6") as caught:
        check_version(version)
    assert version in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.25.0"])
def test_every_release_in_the_tested_range_is_accepted(version: str) -> None:
    from ckptdb.integrations.transformers.compat import check_version

    assert check_version(version) == version
