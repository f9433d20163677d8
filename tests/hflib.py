"""A tiny Hugging Face setup for the integration tests: a real Trainer on a GPT-2 built
from a config (nothing downloaded), data made here, CPU, seconds per run.

``scripted_scores`` gives each evaluation a chosen ``eval_score`` so tests pick
which checkpoint is best; ``NaNAt`` poisons one step's gradients.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckptdb.integrations.common import release_of

VOCAB = 64
SEQ = 16

#: transformers 5 added ``enable_jit_checkpoint`` (a checkpoint on SIGTERM of its own).
HAS_JIT_CHECKPOINT = "enable_jit_checkpoint" in TrainingArguments.__dataclass_fields__
#: transformers 4.57 cannot resume under CPU DDP, stock Trainer included: it loads the
#: optimizer with ``map_location="cpu:0"``, which torch refuses (fixed in 5.0).
RESUMES_UNDER_CPU_DDP = (release_of(transformers.__version__) or (0, 0)) >= (5, 0)


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=32,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def dataset(n: int = 32, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def training_args(output_dir: Path, **overrides: Any) -> TrainingArguments:
    """Saves every 4 steps; 12 steps in all unless told otherwise."""
    options: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "max_steps": 12,
        "save_steps": 4,
        "logging_steps": 2,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",  # a run stopped early follows the same schedule
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 7,
        "data_seed": 7,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def scripted_scores(scores: Sequence[float]) -> Any:
    """A ``compute_metrics`` that returns ``scores`` in turn as ``score``."""
    calls = iter(scores)

    def compute(_prediction: Any) -> dict[str, float]:
        return {"score": next(calls)}

    return compute


def with_scores(output_dir: Path, **overrides: Any) -> TrainingArguments:
    """Evaluate (and save) every 4 steps; the best is the lowest ``eval_score``."""
    options: dict[str, Any] = {
        "eval_strategy": "steps",
        "eval_steps": 4,
        "metric_for_best_model": "score",
        "greater_is_better": False,
    }
    options.update(overrides)
    return training_args(output_dir, **options)


class NaNAt(TrainerCallback):  # type: ignore[misc]
    """Fills one parameter's gradient with NaN before the optimizer step of ``step``
    (registered before the ckptdb callback, so the guard sees it)."""

    def __init__(self, trainer_ref: list[Any], step: int) -> None:
        self.trainer_ref = trainer_ref
        self.step = step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step + 1 == self.step:  # global_step counts the steps done
            param = next(self.trainer_ref[0].model.parameters())
            assert param.grad is not None
            param.grad.fill_(math.nan)


class Definite(TrainerCallback):  # type: ignore[misc]
    """Added after the ckptdb callback: makes the gradients finite again, so training
    really goes on after the guard saw the NaN (a NaN applied poisons every step)."""

    def __init__(self, trainer_ref: list[Any]) -> None:
        self.trainer_ref = trainer_ref

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        for param in self.trainer_ref[0].model.parameters():
            if param.grad is not None:
                param.grad.nan_to_num_(0.0)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def torchrun(out: Path, *args: str) -> list[dict[str, Any]]:
    """``hf_train.py OUT --gloo ARGS`` on two ranks under torchrun: each rank's RESULT."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-port=0",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            str(Path(__file__).parent / "hf_train.py"),
            str(out),
            "--gloo",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    results = results_in(done.stdout)
    assert len(results) == 2, done.stdout[-2000:] + done.stderr[-4000:]
    return sorted(results, key=lambda r: r["rank"])


def results_in(stdout: str) -> list[dict[str, Any]]:
    """Every ``RESULT {json}`` in the ranks' shared output, wherever it starts: another
    process's print() writes its text and its newline apart, so a RESULT may follow
    that text on the same line."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("RESULT {")
    while at != -1:
        value, end = decoder.raw_decode(stdout, at + len("RESULT "))
        found.append(value)
        at = stdout.find("RESULT {", end)
    return found
