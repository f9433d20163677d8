"""The DeePMD-kit case: a whole ``dp --pt train`` (and ``dp --pt-expt train``) through
ckptdb beside stock ``dp``.

Every contender is a subprocess that runs a complete DeePMD-kit 3.2 training
(one PyTorch backend, CPU, one thread) in a fresh directory of its own, on
the same tiny generated system and the same configuration, which checkpoints
often so that the checkpoints' cost shows: a periodic checkpoint and its EMA
twin every ``save_freq`` steps, and a full validation at the same steps with
``save_best`` (a best and a best-EMA checkpoint whenever the metric improves).
The contenders:

- **stock dp**: DeePMD-kit's own entry point (``deepmd.main``), with the one
  workaround ckptdb's entry point makes too: when the running torch is not
  the one DeePMD-kit's op library was built for, ``deepmd.pt.cxx_op`` is
  pre-seeded with ``ENABLE_CUSTOMIZED_OP = False`` (the baseline);
- **stock dp again**: the same, a second time, as a contender of its own:
  its ratio is the noise floor of the run (:data:`harness.AGAIN`);
- **ckptdb**: ``python -m ckptdb.integrations.deepmd --pt train input.json``,
  its defaults (the guard on, every checkpoint a ledger boundary).

Each backend (``--pt``, ``--pt-expt``) is a comparison of its own.

Two figures of the same runs, each its own comparison:

- **after import**: from DeePMD's first log line (its banner, once
  ``deepmd``, torch and, for ckptdb, ckptdb are imported) to the moment
  ``dp`` returns (a line the process prints last, :data:`END`): the data
  statistics, the ledger's opening, the training loop, every checkpoint,
  the ledger's closing; not the interpreter's start, the imports or the
  teardown (over a second here: the modules torch and DeePMD-kit load);
- **whole process**: from the start of the subprocess to its exit, all of
  that included (mostly imports: importing DeePMD-kit takes several seconds).

The system is a Lennard-Jones-like pair potential (two atom types, twelve
atoms in a periodic box), the model the smallest ``se_e2_a`` that trains:
a training step is a few tens of milliseconds, so a checkpoint every 20
steps is far more often than any real run would write one, which is what
makes the checkpoints' cost visible at all.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .deepmd_system import SPEED_ENV, VALIDATING
from .deepmd_system import make_run_dir as make_system_dir
from .harness import AGAIN, Comparison, compare

REPO = Path(__file__).resolve().parents[1]

STOCK = "stock dp (DeePMD-kit's own entry point)"
OURS = "ckptdb (python -m ckptdb.integrations.deepmd)"


#: DeePMD-kit's own ``dp``, with the op-library workaround of
#: ``ckptdb.integrations.deepmd.train._without_op_library``; nothing of ckptdb.
STOCK_DP = """\
import types
import torch
from deepmd.env import GLOBAL_CONFIG
built_for = str(GLOBAL_CONFIG.get("pt_version") or "")
if built_for and built_for != torch.__version__.split("+")[0]:
    stub = types.ModuleType("deepmd.pt.cxx_op")
    stub.ENABLE_CUSTOMIZED_OP = False
    stub.__all__ = ["ENABLE_CUSTOMIZED_OP"]
    sys.modules["deepmd.pt.cxx_op"] = stub
from deepmd.main import main
main(sys.argv[1:])
"""

#: ``python -m ckptdb.integrations.deepmd``, exactly (its ``sys.exit(run())`` included).
OURS_DP = """\
import runpy
runpy.run_module("ckptdb.integrations.deepmd", run_name="__main__", alter_sys=True)
"""

#: The line each process ends with: when ``dp`` returned (or raised), before the
#: interpreter's teardown.
END = "benchmark: dp returned at"


def _driver(dp: str) -> str:
    """The code of a contender's process (``python -c``): ``dp``, then the END line."""
    return (
        f"import sys, time\ntry:\n{textwrap.indent(dp, '    ')}finally:\n"
        f"    print({END!r}, repr(time.time()), file=sys.stderr, flush=True)\n"
    )


COMMANDS = {
    STOCK: [sys.executable, "-c", _driver(STOCK_DP)],
    OURS: [sys.executable, "-c", _driver(OURS_DP)],
}
#: ``dp``'s backends the case trains with, each a comparison of its own.
BACKENDS = ("--pt", "--pt-expt")


def dp_args(backend: str) -> list[str]:
    return [backend, "train", "input.json"]


# DeePMD's log lines start with their time: "[2026-12-05 09:03:34,485] DEEPMD INFO ..."
LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] DEEPMD ", re.M)
END_TIME = re.compile(rf"^{re.escape(END)} (\d+\.\d+)$", re.M)


def available() -> str | None:
    """Why the case cannot run here (None: it can): it needs DeePMD-kit."""
    if importlib.util.find_spec("deepmd") is None:
        return "no DeePMD-kit (pip install 'ckptdb[deepmd]')"
    return None


# ------------------------------------------------------------- the system


def make_run_dir(path: Path, steps: int, save_freq: int) -> Path:
    """A training directory on the shared system (:mod:`benchmarks.deepmd_system`):
    ``steps`` steps; every ``save_freq`` a periodic checkpoint with its EMA twin
    (the two newest of each kept) and a full validation, plain and EMA, whose
    improvements are saved as best checkpoints (the two best of each kept)."""
    path.mkdir(parents=True)
    validating = {**VALIDATING, "validation_freq": save_freq}
    return make_system_dir(
        path,
        validating=validating,
        numb_steps=steps,
        disp_freq=save_freq,
        save_freq=save_freq,
        enable_ema=True,
    )


# ------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    """One training subprocess: its times and what it reported saving."""

    whole_s: float  # the subprocess, start to exit
    after_import_s: float  # DeePMD's first log line to dp's return
    imports_s: float  # the subprocess's start to DeePMD's first log line
    teardown_s: float  # dp's return to the subprocess's exit
    saved: dict[str, int]  # checkpoints by kind, from DeePMD's own log lines


def _times(text: str) -> tuple[float, float]:
    """The wall-clock times (``time.time()``) of DeePMD's first log line in a run's
    output and of the driver's line saying that ``dp`` returned."""
    first, end = LOG_TIME.search(text), END_TIME.search(text)
    if first is None or end is None:
        raise RuntimeError(f"no DeePMD log line or no end in the run's output:\n{text[-3000:]}")
    return dt.datetime.strptime(first[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), float(end[1])


def _saved(where: Path, text: str) -> dict[str, int]:
    """How many checkpoints of each kind DeePMD said it saved (an EMA twin is not
    logged: it is written with each periodic checkpoint when ``enable_ema`` is on)."""
    val_ema = where / "val_ema.log"
    return {
        "periodic (+ its EMA twin)": len(re.findall(r"Saved model to model\.ckpt-\d+", text)),
        "best": len(re.findall(r"Saved best model to best\.ckpt-", text)),
        "best_ema": val_ema.read_text().count("saved best checkpoint: best_ema.ckpt-")
        if val_ema.exists()
        else 0,
    }


def train_once(
    where: Path,
    command: list[str],
    steps: int,
    save_freq: int,
    backend: str = "--pt",
    timeout: float = 600,
) -> Run:
    """One ``dp BACKEND train`` by ``command`` in a fresh ``where`` (removed afterwards)."""
    make_run_dir(where, steps, save_freq)
    env = {**os.environ, **SPEED_ENV}
    env.pop("CKPTDB_DB_URL", None)  # the run's own SQLite ledger
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    os.sync()  # no other contender's dirty pages written back inside this one's time
    started = time.time()
    start = time.perf_counter()
    proc = subprocess.run(
        [*command, *dp_args(backend)],
        cwd=where,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    ended = time.time()
    whole = time.perf_counter() - start
    if proc.returncode != 0 or f"Saved model to model.ckpt-{steps}.pt" not in proc.stdout:
        raise RuntimeError(
            f"dp {' '.join(dp_args(backend))} failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}"
        )
    first, returned = _times(proc.stdout)
    run = Run(
        whole_s=whole,
        after_import_s=returned - first,
        imports_s=first - started,
        teardown_s=ended - returned,
        saved=_saved(where, proc.stdout),
    )
    shutil.rmtree(where)
    return run


def deepmd_training(
    work: Path, steps: int, save_freq: int, reps: int, warmup: int = 1, backend: str = "--pt"
) -> list[Comparison]:
    """The after-import and the whole-process comparisons of the same interleaved runs
    of ``dp BACKEND train``."""
    counter = itertools.count()
    runs: dict[str, list[Run]] = {}

    def contender(key: str, command: list[str]) -> Callable[[], float]:
        runs[key] = []

        def run() -> float:
            done = train_once(work / str(next(counter)), command, steps, save_freq, backend)
            runs[key].append(done)
            return done.after_import_s

        return run

    # the noise floor as compare(noise_floor=True) makes it, but a callable of its own,
    # so that each run's whole-process time is also known by contender
    contenders = {
        STOCK: contender(STOCK, COMMANDS[STOCK]),
        OURS: contender(OURS, COMMANDS[OURS]),
        STOCK + AGAIN: contender(STOCK + AGAIN, COMMANDS[STOCK]),
    }
    what = f"DeePMD-kit dp {backend} train, {steps} steps, checkpoints every {save_freq}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        after = compare(
            f"{what}: after import",
            contenders,
            baseline=STOCK,
            reps=reps,
            warmup=warmup,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    timed = {key: done[warmup:] for key, done in runs.items()}
    whole = Comparison(
        f"{what}: whole process",
        STOCK,
        {key: [r.whole_s for r in done] for key, done in timed.items()},
    )
    saved = {key: done[-1].saved for key, done in timed.items()}
    if saved[OURS] != saved[STOCK]:
        raise RuntimeError(f"the contenders saved different checkpoints: {saved}")
    for result in (after, whole):
        result.notes["target"] = "ckptdb <= 1.05x stock dp"
        result.notes["checkpoints per run"] = saved[STOCK]
    after.notes["what"] = (
        "from DeePMD's first log line to dp's return: the interpreter's start, the imports "
        "and the teardown excluded"
    )
    whole.notes["what"] = "the whole training subprocess, from its start to its exit"
    for part in ("imports", "teardown"):
        whole.notes[f"{part}, median s"] = {
            key: round(statistics.median(getattr(r, f"{part}_s") for r in done), 3)
            for key, done in timed.items()
        }
    return [after, whole]
