"""A ckptdb Trainer run in a process of its own: for crashes and for torchrun.

``python hf_train.py OUT [--max-steps N] [--resume] [--kill-in-write STEP]
[--crash-at POINT --crash-step STEP] [--fail-rank R --fail-step STEP]``.
``--kill-in-write`` SIGKILLs the process while ``checkpoint-STEP`` is being
written (model and optimizer written, RNG state not yet); ``--crash-at`` exits
at one of ckptdb's fault points during that step's boundary; ``--fail-rank``
makes one rank's write raise. Prints ``RESULT <json>`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch.distributed as dist
from hflib import dataset, tiny_model, training_args
from transformers import TrainerCallback

from ckptdb import Preempted, faults
from ckptdb.integrations.transformers import Trainer


def say(line: str) -> None:
    """One line in one write (the ranks share torchrun's pipe; see tests/preempt_loop.py)."""
    os.write(1, (line + "\n").encode())


class SignalAt(TrainerCallback):
    """SIGTERM to this process at the end of ``step``, on ``rank`` only (before the
    ckptdb callback's check, which the Trainer runs after the user's callbacks)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        here = dist.get_rank() if dist.is_initialized() else 0
        if state.global_step == self.step and here == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-in-write", type=int)
    parser.add_argument("--crash-at")
    parser.add_argument("--crash-step", type=int)
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--fail-step", type=int)
    parser.add_argument("--gloo", action="store_true")
    parser.add_argument("--slow-rank", type=int)
    parser.add_argument("--preempt-step", type=int)
    parser.add_argument("--preempt-rank", type=int, default=0)
    opts = parser.parse_args()
    extra = {"ddp_backend": "gloo", "ddp_timeout": 60} if opts.gloo else {}
    args = training_args(Path(opts.out), max_steps=opts.max_steps, **extra)
    preempting = opts.preempt_step is not None
    trainer = Trainer(
        model=tiny_model(),
        args=args,
        train_dataset=dataset(),
        callbacks=[SignalAt(opts.preempt_step, opts.preempt_rank)] if preempting else None,
        preemption=preempting,
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    original = trainer._save_rng_state

    def save_rng_state(output_dir: str) -> None:
        step = trainer.state.global_step
        if opts.kill_in_write == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if opts.fail_rank == rank and opts.fail_step == step:
            raise OSError(28, "No space left on device (injected)", output_dir)
        if opts.slow_rank == rank:
            time.sleep(1.0)  # this rank's RNG file arrives after rank 0 has returned
        original(output_dir)

    trainer._save_rng_state = save_rng_state  # type: ignore[method-assign]
    if opts.crash_at is not None:

        def crash(name: str) -> None:
            if name == opts.crash_at and trainer.state.global_step == opts.crash_step:
                os._exit(17)

        faults.set_hook(crash)
    try:
        trainer.train(resume_from_checkpoint=True if opts.resume else None)
        outcome = {"step": trainer.state.global_step, "error": None}
    except Preempted as stopped:
        saved = [c.path.name for c in stopped.saved]
        outcome = {"step": stopped.step, "error": "Preempted", "code": stopped.code, "saved": saved}
        say("RESULT " + json.dumps({**outcome, "rank": rank}))
        raise
    except Exception as exc:
        outcome = {"step": trainer.state.global_step, "error": type(exc).__name__}
    say("RESULT " + json.dumps({**outcome, "rank": rank}))


if __name__ == "__main__":
    main()
