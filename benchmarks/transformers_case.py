"""The Hugging Face case: the ckptdb Trainer's checkpoint beside the stock Trainer's.

Both contenders are real ``Trainer`` runs on the same GPT-2 built from a config
(sized to the requested state: weights plus AdamW's two moments), saving at
every step with ``save_total_limit=1``, so each save also removes the
previous checkpoint. What is timed is ``_save_checkpoint`` as the training
loop waits for it: the Trainer's savers (model, optimizer, scheduler, RNG,
trainer state) and rotation; for ckptdb also the fsync of every file, the
hash, the rename, the commit and the eviction. The stock Trainer fsyncs
nothing, so it is not a durable baseline; a third contender is the stock
save followed by what durability costs at the least (fsync of every file
and directory of the new checkpoint), to tell ckptdb's own overhead from
the price of durability.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ckptdb.storage.files import fsync_dir, fsync_file

from .harness import Comparison, compare

VOCAB = 1024
SEQ = 16


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """The Trainer's info lines, warnings and progress bars off while contenders run."""
    names = ("transformers", "ckptdb")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    previous = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
        if previous is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)


def _model(megabytes: float) -> Any:
    """A one-layer GPT-2 whose weights and AdamW moments come to about ``megabytes``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    params = megabytes * 2**20 / 4 / 3  # float32 weights + 2 moments
    width = max(32, int((params / 13) ** 0.5) // 32 * 32)  # 12 w^2 per layer + embeddings
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=width, vocab_size=VOCAB, n_positions=SEQ)
    return GPT2LMHeadModel(config)


def fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            fsync_file(path)
    fsync_dir(directory)
    fsync_dir(directory.parent)


def transformers_checkpoint(work: Path, megabytes: float, reps: int, saves: int = 3) -> Comparison:
    import transformers
    from transformers import TrainingArguments

    from ckptdb.integrations.transformers import Trainer as Ours

    class DurableStock(transformers.Trainer):  # type: ignore[misc]
        """The stock save, then every file and directory of the checkpoint fsynced."""

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            super()._save_checkpoint(model, trial)
            fsync_tree(Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}")

    data = [{"input_ids": (ids := torch.arange(SEQ) % VOCAB), "labels": ids} for _ in range(8)]
    counter = iter(range(10**9))

    def contender(cls: Any) -> Callable[[], float]:
        def run() -> float:
            where = work / str(next(counter))
            args = TrainingArguments(
                output_dir=str(where),
                per_device_train_batch_size=1,
                max_steps=saves,
                save_steps=1,
                save_total_limit=1,
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                logging_strategy="no",
            )
            trainer = cls(model=_model(megabytes), args=args, train_dataset=data)
            spent: list[float] = []
            save = trainer._save_checkpoint

            def timed(*a: Any) -> None:
                start = time.perf_counter()
                save(*a)
                spent.append(time.perf_counter() - start)

            trainer._save_checkpoint = timed
            trainer.train()
            shutil.rmtree(where)
            return sum(spent) / len(spent)

        return run

    try:
        with _silenced():
            result = compare(
                f"Hugging Face Trainer checkpoint {megabytes:g} MB",
                {
                    "Trainer._save_checkpoint (stock)": contender(transformers.Trainer),
                    "stock, then fsync of the checkpoint": contender(DurableStock),
                    "ckptdb Trainer": contender(Ours),
                },
                baseline="Trainer._save_checkpoint (stock)",
                reps=reps,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.notes["target"] = "ckptdb Trainer <= stock (which fsyncs nothing)"
    result.notes["per"] = "one checkpoint-N (write + removal of the previous one)"
    return result
