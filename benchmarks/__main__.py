"""Run the benchmark suite: ``python -m benchmarks [--quick] [--full] [--case NAME] [--out FILE]``.

``--check`` runs the cases that hold the key figures (default sizes) and
compares each with its recorded threshold (:mod:`benchmarks.check`); it exits 1
naming every figure that regressed.

Prints a markdown table of the ratios to each case's baseline and writes every
figure (medians, ratios, notes, machine description) to a JSON file.
``--case NAME`` (repeatable) runs only the cases named (``--help`` lists them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import (
    cases,
    check,
    cold_case,
    deepmd_case,
    export_case,
    goodput_case,
    ledgercopy_case,
    lightning_case,
    preemption_case,
    profile_case,
    s3_case,
    transformers_case,
)
from .harness import Comparison, markdown

# (publish sizes MB, repetitions, restart sizes, metric points, guard steps, load MB, ...;
# deepmd: training steps, a checkpoint every save_freq steps, rounds after `warmup`)
PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "publish_mb": [1],
        "reps": 2,
        "restart": [50, 100],
        "points": 2_000,
        "guard_steps": 5,
        "load_mb": 1,
        "growth": [20, 60],
        "s3_mb": 12,  # two 8 MiB parts: the multipart path
        "deepmd": {"steps": 10, "save_freq": 2, "reps": 1, "warmup": 0},
        "preemption_steps": 20,
        "goodput": {"steps": 200, "work_h": 50.0, "reps": 3},
        "ledger_copy": [(100, 2_000)],
        "export_mb": (16, 4),  # (model, largest tensor)
        "cold": 200,  # checkpoints in the run a cold command reads
    },
    "default": {
        "publish_mb": [1, 10, 100],
        "reps": 7,
        "restart": [1_000, 10_000, 20_000],
        "points": 1_000_000,
        "guard_steps": 50,
        "load_mb": 100,
        "growth": [1_000, 4_000],
        "s3_mb": 100,
        "deepmd": {"steps": 200, "save_freq": 20, "reps": 7, "warmup": 1},
        "preemption_steps": 1000,
        "goodput": {"steps": 20_000, "work_h": 500.0, "reps": 30},
        "ledger_copy": [(10_000, 1_000_000), (100_000, 1_000_000)],
        "export_mb": (2048, 64),
        "cold": 10_000,
    },
    "full": {
        "publish_mb": [1, 10, 100, 1024],
        "reps": 7,
        "restart": [1_000, 10_000, 20_000, 100_000],
        "points": 1_000_000,
        "guard_steps": 50,
        "load_mb": 100,
        "growth": [1_000, 20_000],
        "s3_mb": 100,
        "deepmd": {"steps": 200, "save_freq": 20, "reps": 7, "warmup": 1},
        "preemption_steps": 1000,
        "goodput": {"steps": 20_000, "work_h": 500.0, "reps": 30},
        "ledger_copy": [(10_000, 1_000_000), (100_000, 1_000_000)],
        "export_mb": (2048, 64),
        "cold": 10_000,
    },
}


def machine() -> dict[str, Any]:
    return {
        "date": dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


Case = Callable[[], list[Comparison]]


def suite(profile: dict[str, Any], work: Path) -> dict[str, Case]:
    """Every case of the suite by name, in the order it runs (nothing runs yet)."""
    reps = profile["reps"]
    deepmd = profile["deepmd"]
    return {
        "publish": lambda: [
            cases.publish(work / f"publish{mb}", mb, reps) for mb in profile["publish_mb"]
        ],
        "overhead": lambda: [cases.ledger_overhead(work / "overhead", max(reps, 30))],
        "floor": lambda: [cases.boundary_floor(work / "floor", max(reps, 30))],
        "profile": lambda: profile_case.profile(work / "profile", reps),
        "restart": lambda: [cases.restart(work / "restart", profile["restart"], reps)],
        "growth": lambda: cases.growth(work / "growth", profile["growth"], reps),
        "history": lambda: cases.history(work / "history", profile["points"], min(reps, 3)),
        "guard": lambda: [cases.guard(reps, profile["guard_steps"])],
        "preemption": lambda: [
            preemption_case.preemption_check(work / "preemption", profile["preemption_steps"], reps)
        ],
        "goodput": lambda: [
            goodput_case.heartbeat(work / "goodput", profile["goodput"]["steps"], reps),
            *goodput_case.intervals(profile["goodput"]["reps"], profile["goodput"]["work_h"]),
        ],
        # a load takes ~20 ms and its page faults vary: many samples steady the median
        "load": lambda: [cases.load(work / "load", profile["load_mb"], max(reps, 30))],
        "cold": lambda: [cold_case.cold(work / "cold", profile["cold"], reps)],
        "export": lambda: [
            export_case.export(
                work / "export", profile["export_mb"][0], profile["export_mb"][1], min(reps, 3)
            )
        ],
        "async": lambda: [cases.async_save(work / "async", profile["load_mb"], reps)],
        "lightning": lambda: [
            lightning_case.lightning_checkpoint(work / "lightning", profile["load_mb"], reps),
            lightning_case.lightning_guard(
                work / "lightning-guard", reps, profile["guard_steps"] * 20
            ),
        ],
        "transformers": lambda: [
            transformers_case.transformers_checkpoint(
                work / "transformers", profile["load_mb"], reps
            )
        ],
        "s3": lambda: _unless_missing(
            "S3", s3_case.available(), lambda: s3_case.run(work / "s3", profile["s3_mb"], reps)
        ),
        "ledgercopy": lambda: _unless_missing(
            "S3",
            s3_case.available(),
            lambda: ledgercopy_case.run(work / "ledgercopy", profile["ledger_copy"], reps),
        ),
        "deepmd": lambda: _unless_missing(
            "DeePMD-kit",
            deepmd_case.available(),
            lambda: [
                result
                for backend in deepmd_case.BACKENDS
                for result in deepmd_case.deepmd_training(
                    work / "deepmd",
                    deepmd["steps"],
                    deepmd["save_freq"],
                    deepmd["reps"],
                    deepmd["warmup"],
                    backend,
                )
            ],
        ),
    }


CASES = tuple(suite(PROFILES["quick"], Path()))


def _unless_missing(name: str, missing: str | None, case: Case) -> list[Comparison]:
    if missing is not None:
        print(f"skipped the {name} case: {missing}", file=sys.stderr)
        return []
    return case()


def run(profile: dict[str, Any], work: Path, only: list[str] | None = None) -> list[Comparison]:
    """The cases named in ``only`` (default: all of them), in the suite's order."""
    results: list[Comparison] = []
    for name, case in suite(profile, work).items():
        if only is None or name in only:
            results.extend(case())
    return results


def report(results: list[Comparison], out: Path) -> None:
    """Every figure to ``out`` (JSON); the table and the notes to stdout."""
    document = {"machine": machine(), "results": [r.as_dict() for r in results]}
    out.write_text(json.dumps(document, indent=2, default=str))
    print(markdown(results))
    print()
    for r in results:
        for key, value in r.notes.items():
            print(f"- {r.name}: {key}: {value}")
    print(f"\nwritten to {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    size.add_argument(
        "--full", action="store_true", help="also publish 1 GB and reopen 100k checkpoints"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmark-results.json"))
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    parser.add_argument(
        "--case",
        action="append",
        choices=CASES,
        metavar="NAME",
        help=f"run only this case (repeatable; default: all): {', '.join(CASES)}",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run the cases of the key figures and compare them with their recorded "
        "thresholds (benchmarks/check.py); exit 1 if any regressed",
    )
    args = parser.parse_args(argv)
    if args.check and (args.quick or args.full):
        parser.error("--check measures at the default sizes, which its thresholds are for")
    profile = PROFILES["quick" if args.quick else "full" if args.full else "default"]
    only = args.case or (check.checked_cases() if args.check else None)
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        results = run(profile, Path(scratch), only)
    report(results, args.out)
    if not args.check:
        return 0
    found = check.verdicts(results, only)
    print()
    for verdict in found:
        print(verdict.line())
    regressed = [v for v in found if v.regressed]
    if regressed:
        print(f"\n{len(regressed)} figure(s) regressed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
