"""The figures of an exploration, as a Markdown table (for the docs).

``PYTHONPATH=.:tests python -m powerloss [--deep]``: every scenario under both
persistence models, with the budget of the default suite (or of
``CKPTDB_POWERLOSS=deep``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from .explorer import Explorer
from .persistence import MODELS
from .scenarios import SCENARIOS
from .settings import budget_for


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m powerloss")
    parser.add_argument("--deep", action="store_true", help="the deep budget and scenarios")
    args = parser.parse_args()
    budget = budget_for(args.deep)
    columns = "ops | crash points | states generated | distinct explored | violations | s"
    print(f"| scenario | model | {columns} |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    for name, scenario in SCENARIOS.items():
        for model in MODELS.values():
            with tempfile.TemporaryDirectory() as tmp:
                recorded = scenario.record(Path(tmp), args.deep)
                r = Explorer(name, recorded.trace, recorded.check, model, budget).run()
            failed += len(r.violations)
            print(
                f"| {name} | {r.model} | {r.ops} | {r.crash_points} | {r.generated} | "
                f"{r.explored} | {len(r.violations)} | {r.seconds:.1f} |",
                flush=True,
            )
            for violation in r.violations[:3]:
                print(f"<!-- {violation} -->")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
