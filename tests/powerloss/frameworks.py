"""A framework's own writer under the explorer: the Hugging Face Trainer.

ckptdb's Trainer lets ``transformers`` write each ``checkpoint-N`` directory
with its own code (``model.safetensors`` from safetensors' Rust writer,
``optimizer.pt`` and the others from torch's C++ writer, the JSON files from
Python), none of which fsyncs anything, then seals and commits it. No seam
in ckptdb sees those writes; the recording (strace) does, so the explorer
models them as what they are: data that a power cut may cut short unless
ckptdb's seal made it durable before the commit.

The run: the tiny GPT-2 of ``tests/hflib.py`` trained for 8 steps, a
checkpoint every 4, all of it recorded (a new run); the Trainer's
``on_save`` (called once ``_save_checkpoint`` returned: the checkpoint is
committed) is the acknowledgement. A crash state is reopened by the real
library and must pass ``check(load=True)``, with every acknowledged
checkpoint still committed, holding the Trainer's files whole.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .recording import Recorder
from .scenarios import Recorded, Scenario, _paths


def hf_trainer_run(tmp: Path, deep: bool) -> Recorded:
    from hflib import dataset, tiny_model, training_args
    from transformers import TrainerCallback

    from ckptdb.integrations.transformers import Trainer, streams_for

    world, root = _paths(tmp)
    steps = 12 if deep else 8  # a checkpoint every 4 steps

    class Acknowledge(TrainerCallback):  # type: ignore[misc]
        def __init__(self, rec: Recorder) -> None:
            self.rec = rec

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.rec.mark({"ack_step": state.global_step})

    args = training_args(root, max_steps=steps, save_steps=4, logging_steps=4)
    with warnings.catch_warnings(), Recorder(world, root) as rec:
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=tiny_model(), args=args, train_dataset=dataset(), callbacks=[Acknowledge(rec)]
        )
        trainer.train()
    return Recorded("hf_trainer", rec.trace(), TrainerCheck(streams_for(args)))


@dataclass
class TrainerCheck:
    """Reopen as the Trainer does (its streams): ``check(load=True)``; each acknowledged
    checkpoint committed, its ``trainer_state.json`` whole."""

    streams: Mapping[str, Any]

    def __call__(
        self, root: Path, records: list[Mapping[str, Any]], save_dir: str | None = None
    ) -> list[str]:
        from ckptdb import CheckpointManager, RunReader
        from ckptdb.errors import UnknownStreamError
        from ckptdb.integrations.transformers import STREAM

        if not root.is_dir():
            return [] if not records else ["the run's directory is gone"]
        acked = [int(r["ack_step"]) for r in records if "ack_step" in r]
        problems: list[str] = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with CheckpointManager(root, streams=dict(self.streams)) as mgr:
                    problems += [f"check: {p}" for p in mgr.check(load=True)]
                with RunReader(root) as reader:
                    try:
                        found = reader.checkpoints(STREAM)
                    except UnknownStreamError:  # cut before the Trainer's first save
                        found = []
                    committed = {c.step: c.path for c in found}
        except Exception as exc:  # the finding itself: the run does not reopen
            return [f"reopening the run raised {type(exc).__name__}: {exc}"]
        for step in acked:
            path = committed.get(step)
            if path is None:
                problems.append(f"acknowledged checkpoint-{step} is not committed")
                continue
            state = Path(path) / "trainer_state.json"
            try:
                saved = json.loads(state.read_text())["global_step"]
            except (OSError, ValueError, KeyError) as exc:
                problems.append(f"checkpoint-{step}'s trainer_state.json: {exc!r}")
                continue
            if saved != step:
                problems.append(f"checkpoint-{step}'s trainer_state.json says step {saved}")
        return problems


FRAMEWORK_SCENARIOS = {
    s.name: s
    for s in (
        Scenario(
            "hf_trainer",
            "a real transformers.Trainer writing its checkpoint directories itself",
            hf_trainer_run,
        ),
    )
}
