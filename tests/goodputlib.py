"""A training loop with a known step time, run in forked processes the tests kill.

The child logs its own clock (JSON lines): when it reported each step, each
save's start and end, the step it resumed from, and its close. The test adds
what only it knows (when it started each process, when it killed it) and
computes the wall-clock truth of every goodput figure from these alone,
never from the ledger.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptdb import CheckpointManager, Keep

STEP_S = 0.02  # the known step time
SAVE_EVERY = 25  # steps
HEARTBEAT_S = 0.02
PAYLOAD = 2_000_000  # float32 values: an 8 MB save, tens of milliseconds with its fsyncs


def train(root: str, log: str, startup: float, final_step: int, options: dict[str, Any]) -> None:
    """One attempt: simulated imports, open, resume, then steps until killed or done."""
    with open(log, "a", encoding="utf-8") as out:

        def note(kind: str, **fields: Any) -> None:
            out.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
            out.flush()

        time.sleep(startup)  # what a real restart spends importing torch and the model
        mgr = CheckpointManager(
            root, streams={"model": Keep(last=3)}, heartbeat=HEARTBEAT_S, **options
        )
        stop = mgr.preemption()
        latest = mgr.latest("model")
        start = 0
        if latest is not None:
            start = int(mgr.load(latest)["step"])
        note("resumed", step=start if latest is not None else None)
        due = (lambda s: mgr.due(s)) if "interval" in options else None
        for step in range(start + 1, final_step + 1):
            time.sleep(STEP_S)
            note("step", step=step)
            if stop.requested(step):
                payload = _payload(step)
                saving = time.time()
                stop.save(step, model=payload)
                note("save", step=step, start=saving, end=time.time())
                mgr.close()
                note("closed")
                raise stop.stop(step)
            wants = (
                due(step) if due is not None else (mgr.heartbeat(step), step % SAVE_EVERY == 0)[1]
            )
            if wants:
                payload = _payload(step)
                note("saving", step=step)
                saving = time.time()
                mgr.save(step, model=payload)
                note("save", step=step, start=saving, end=time.time())
        mgr.close()
        note("closed")


def _payload(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((PAYLOAD,), float(step))}


@dataclass
class Attempt:
    """One forked attempt: what the parent saw and what the child logged."""

    launched: float
    log: Path
    forked: float  # the parent's clock just before the fork: the start's lower bound
    ended: float | None = None  # the kill (SIGKILL) as the parent timed it
    how: str = "closed"
    lines: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> None:
        """The child's lines; its own clock's start replaces the parent's (a fork under
        load takes tens of milliseconds after the parent timed it)."""
        self.lines = [json.loads(x) for x in self.log.read_text().splitlines() if x.strip()]
        self.launched = self.of("launched")[0]["t"]

    def last_step(self) -> int:
        self.read()
        return int(self.of("step")[-1]["step"])

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [x for x in self.lines if x["kind"] == kind]


def start(
    root: Path, log: Path, startup: float, final_step: int, **options: Any
) -> tuple[Any, Attempt]:
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(str(root), str(log), startup, final_step, options))
    launched = time.time()
    proc.start()
    return proc, Attempt(launched, log, forked=launched)


def _child(root: str, log: str, startup: float, final_step: int, options: dict[str, Any]) -> None:
    with open(log, "a", encoding="utf-8") as out:  # the process's start, as it sees it
        out.write(json.dumps({"kind": "launched", "t": time.time()}) + "\n")
    torch.set_num_threads(1)
    try:
        train(root, log, startup, final_step, options)
    except SystemExit as stop:
        os._exit(int(stop.code or 0))
    os._exit(0)


def wait_for(attempt: Attempt, kind: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if attempt.log.exists() and f'"kind": "{kind}"' in attempt.log.read_text():
            return
        time.sleep(0.01)
    raise AssertionError(f"the child never logged {kind!r}")


def kill(proc: Any, attempt: Attempt, sig: signal.Signals, timeout: float = 60.0) -> None:
    attempt.how = "crashed" if sig == signal.SIGKILL else "preempted"
    if sig == signal.SIGKILL:
        attempt.ended = time.time()
    os.kill(proc.pid, sig)
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError("the child did not end after its signal (killed)")


def finish(proc: Any, timeout: float = 60.0) -> int:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError("the child hung (killed after the timeout)")
    return int(proc.exitcode)


def truth(attempts: list[Attempt]) -> dict[str, float]:
    """The wall-clock figures, from the parent's and the children's clocks alone."""
    for a in attempts:
        a.read()
    figures = dict.fromkeys(("productive_s", "saving_s", "lost_s", "restart_s", "idle_s"), 0.0)
    for i, a in enumerate(attempts):
        end = a.ended if a.how == "crashed" else a.of("closed")[-1]["t"]
        assert end is not None
        first = a.of("step")[0]["t"]
        saves = a.of("save")
        saving = sum(s["end"] - s["start"] for s in saves)
        begun = [s for s in a.of("saving") if s["step"] not in {x["step"] for x in saves}]
        assert len(begun) <= 1
        saving += sum(end - s["t"] for s in begun)  # a save the kill interrupted
        training = end - first - saving
        if i + 1 < len(attempts):
            resumed = attempts[i + 1].of("resumed")[0]["step"]
            cut = [s for s in saves if s["step"] == resumed]
        else:
            cut = None
        if cut is None:
            productive = training
        elif cut:
            before = sum(s["end"] - s["start"] for s in saves if s["start"] < cut[0]["start"])
            productive = cut[0]["start"] - first - before
        else:
            productive = 0.0
        figures["productive_s"] += productive
        figures["lost_s"] += training - productive
        figures["saving_s"] += saving
        figures["restart_s"] += first - a.launched
        if i:
            previous = attempts[i - 1]
            gone = previous.ended if previous.how == "crashed" else previous.of("closed")[-1]["t"]
            assert gone is not None
            figures["idle_s"] += a.launched - gone
    figures["total_s"] = sum(figures.values())
    return figures


def bounds(attempts: list[Attempt]) -> dict[str, tuple[float, float]]:
    """Each figure's range: the truth, widened where the test cannot know the start.

    The ledger counts an attempt from its process's start as the kernel keeps it
    (``/proc``, in clock ticks, truncated). The test knows only that the start
    lies between the parent's clock before the fork and the child's first line:
    about 10 ms apart when quiet, more when the child waits to be scheduled. A
    start anywhere in that window (less one clock tick) moves time from the
    previous idle gap into the restart, and widens the total by the first's.
    """
    figures = truth(attempts)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    early = [a.launched - a.forked + tick for a in attempts]
    found = {name: (value, value) for name, value in figures.items()}
    found["restart_s"] = (figures["restart_s"], figures["restart_s"] + sum(early))
    found["idle_s"] = (figures["idle_s"] - sum(early[1:]), figures["idle_s"])
    found["total_s"] = (figures["total_s"], figures["total_s"] + early[0])
    return found
