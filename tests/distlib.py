"""Run a function on N forked ranks of a gloo process group, with hard timeouts.

Each rank runs ``fn(rank, world, *args)`` and reports either its return value
or the exception it raised (type names along the MRO, message, failing ranks)
through a pickle file. A rank that is still running after ``timeout`` seconds
is killed and reported as hung, so a protocol bug fails the test instead of
hanging it. Collectives time out after ``COLLECTIVE_TIMEOUT`` seconds.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COLLECTIVE_TIMEOUT = 15.0


@dataclass
class Outcome:
    """What one rank ended with."""

    rank: int
    value: Any = None
    error: str | None = None  # the exception's type name
    mro: list[str] = field(default_factory=list)
    message: str = ""
    ranks: list[int] | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    trace: str = ""

    def raised(self, name: str) -> bool:
        return name in self.mro


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    fn: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple[Any, ...]
) -> None:
    import torch.distributed as dist

    result = Outcome(rank)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=dt.timedelta(seconds=COLLECTIVE_TIMEOUT),
        )
        result.value = fn(rank, world, *args)
    except BaseException as exc:
        result.error = type(exc).__name__
        result.mro = [c.__name__ for c in type(exc).__mro__]
        result.message = str(exc)
        result.ranks = getattr(exc, "ranks", None)
        for name in ("phase", "step", "parameters"):
            if hasattr(exc, name):
                result.attrs[name] = getattr(exc, name)
        failures = getattr(exc, "cleanup_failures", None)
        if failures is not None:
            result.attrs["cleanup_failures"] = [str(f) for f in failures]
        result.trace = traceback.format_exc()
    try:
        with open(out, "wb") as f:
            pickle.dump(result, f)
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    workdir: Path,
    *args: Any,
    timeout: float = 45.0,
    may_die: bool = False,
) -> list[Any]:
    """Run ``fn`` on ``world`` forked ranks; every rank's :class:`Outcome`, by rank.

    With ``may_die`` a rank that exited without an outcome is reported as None.
    """
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    outs = [workdir / f"rank{r}.outcome" for r in range(world)]
    for out in outs:
        out.unlink(missing_ok=True)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, str(outs[r]), args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    hung = []
    for r, p in enumerate(procs):
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            hung.append(r)
    for r in hung:
        procs[r].kill()
        procs[r].join()
    if hung:
        raise AssertionError(f"ranks {hung} hung (killed after the timeout)")
    results = []
    for r, out in enumerate(outs):
        if not out.exists() and may_die:
            results.append(None)
            continue
        if not out.exists():
            raise AssertionError(f"rank {r} exited with {procs[r].exitcode} and no outcome")
        with open(out, "rb") as f:
            results.append(pickle.load(f))
    return results
