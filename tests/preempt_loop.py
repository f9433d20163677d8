"""Test-only training loop that a test preempts: ``python tests/preempt_loop.py ROOT``.

A tiny model trains for ``--steps`` steps (resuming from the ledger's latest),
saving every ``--every`` steps into a ``Keep(last=3)`` stream, and asks
``stop.requested(step)`` once per step; when told to stop it makes the
preemption checkpoint and exits with ``stop.exit_code``. It prints ``STEP n``
as each step starts, ``RECEIVED n`` at the first step whose check comes after
this process's signal, and ``PREEMPTED n`` when the ranks agree, so the test can
send its signal at a step of its choosing and check the outcome. Under
torchrun (``LOCAL_RANK`` set) every rank joins a gloo group, prints
``RANK r PID p`` first, and prefixes each line with ``RANK r``.

Test-only faults, from the environment:

- ``PREEMPT_NAN_AT=k``: a NaN gradient at step k (the guard refuses what follows);
- ``PREEMPT_SIGNAL_AT=point``: during the preemption save, this process sends
  itself another SIGTERM at ckptdb's fault point ``point`` (inside the boundary);
- ``PREEMPT_SLEEP_AT=point:seconds``: the preemption save sleeps at that point
  (a slow write, to run past the grace period);
- ``PREEMPT_KILL_AT=point``: SIGKILL at that point of the preemption save.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ckptdb import CheckpointManager, Keep, NonFiniteGradGuard, faults

PREFIX = ""


def say(text: str) -> None:
    """One line in one write: ranks share the pipe, and print() writes the text and
    its newline separately (unbuffered), so two ranks' lines could interleave."""
    os.write(1, f"{PREFIX}{text}\n".encode())


def _faults_during_the_save() -> None:
    """Arm the environment's faults; they fire only inside the preemption save."""
    spec_signal = os.environ.get("PREEMPT_SIGNAL_AT")
    spec_sleep = os.environ.get("PREEMPT_SLEEP_AT")
    spec_kill = os.environ.get("PREEMPT_KILL_AT")

    def hook(name: str) -> None:
        if name == spec_signal:
            say(f"SIGNAL AGAIN at {name}")
            os.kill(os.getpid(), signal.SIGTERM)
        if spec_sleep and name == spec_sleep.split(":")[0]:
            time.sleep(float(spec_sleep.split(":")[1]))
        if name == spec_kill:
            say(f"SIGKILL at {name}")
            os.kill(os.getpid(), signal.SIGKILL)

    faults.set_hook(hook)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--grace", type=float, default=None)
    parser.add_argument("--pace", type=float, default=0.02, help="seconds per step")
    args = parser.parse_args()
    nan_at = int(os.environ.get("PREEMPT_NAN_AT", "-1"))
    if "LOCAL_RANK" in os.environ:
        global PREFIX
        dist.init_process_group("gloo")
        PREFIX = f"RANK {dist.get_rank()} "
        say(f"PID {os.getpid()}")

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = NonFiniteGradGuard(model)
    with CheckpointManager(args.root, streams={"model": Keep(last=3)}, guard=guard) as mgr:
        start = 0
        if mgr.latest("model") is not None:
            state = mgr.load("latest")
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"] + 1
        stop = mgr.preemption(grace=args.grace)
        say(f"START {start}")
        told = False
        for step in range(start, args.steps):
            say(f"STEP {step}")
            opt.zero_grad()
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            if step == nan_at:
                next(iter(model.parameters())).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
            guard.clip_grad_norm_(model.parameters(), 10.0)
            if step == nan_at:
                opt.zero_grad()  # the guard saw it; the weights stay finite
            opt.step()
            time.sleep(args.pace)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            if stop.received is not None and not told:
                told = True
                say(f"RECEIVED {step}")  # this rank's signal came before this step's call
            if stop.requested(step):
                say(f"PREEMPTED {step}")
                _faults_during_the_save()
                saved = stop.save(step, model=state)
                say(f"SAVED {sorted(saved) if saved is not None else None}")
                return stop.exit_code
            if step % args.every == 0:
                try:
                    mgr.save(step, model=state)
                except Exception as exc:  # the guard: training goes on
                    say(f"NOT SAVED {step}: {type(exc).__name__}")
    say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
