"""The figures of an exploration, as a Markdown table (for the docs).

``PYTHONPATH=.:tests python -m powerloss [--deep]``: every scenario under both
persistence models, with the budget of the default suite (or of
``CKPTDB_POWERLOSS=deep``), then the scenarios on object storage under the
object-store model (those of a replicated run among them), against a SeaweedFS
server started for the purpose
(``tests/s3lib.py``; skipped, and said so, without ``weed`` or boto3).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .catalog import DEEP_SCENARIOS, SCENARIOS
from .explorer import Explorer
from .persistence import MODELS, STORE_MODELS, Budget, PersistenceModel
from .scenarios import Scenario
from .settings import budget_for


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m powerloss")
    parser.add_argument("--deep", action="store_true", help="the deep budget and scenarios")
    parser.add_argument("--s3-only", action="store_true", help="only the object-store scenarios")
    args = parser.parse_args()
    budget = budget_for(args.deep)
    columns = "ops | crash points | states generated | distinct explored | violations | s"
    print(f"| scenario | model | {columns} |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    if not args.s3_only:
        failed += _explore(DEEP_SCENARIOS if args.deep else SCENARIOS, MODELS, budget, args.deep)
    with _s3_server() as started:
        if started:
            from .replication import REPLICATION_SCENARIOS
            from .s3scenarios import S3_SCENARIOS

            failed += _explore(S3_SCENARIOS, STORE_MODELS, budget, args.deep)
            failed += _explore(REPLICATION_SCENARIOS, STORE_MODELS, budget, args.deep)
    return 1 if failed else 0


def _explore(
    scenarios: dict[str, Scenario], models: dict[str, PersistenceModel], budget: Budget, deep: bool
) -> int:
    failed = 0
    for name, scenario in scenarios.items():
        for model in models.values():
            with tempfile.TemporaryDirectory() as tmp:
                recorded = scenario.record(Path(tmp), deep)
                rec, left = recorded, recorded.leftovers
                r = Explorer(name, rec.trace, rec.check, model, budget, leftovers=left).run()
            failed += len(r.violations)
            print(
                f"| {name} | {r.model} | {r.ops} | {r.crash_points} | {r.generated} | "
                f"{r.explored} | {len(r.violations)} | {r.seconds:.1f} |",
                flush=True,
            )
            for violation in r.violations[:3]:
                print(f"<!-- {violation} -->")
    return failed


@contextlib.contextmanager
def _s3_server() -> Iterator[bool]:
    """A SeaweedFS server and its environment for the S3 scenarios (False: none here)."""
    import s3lib

    try:
        import boto3  # noqa: F401
    except ImportError:
        print("<!-- S3 scenarios skipped: no boto3 -->")
        yield False
        return
    if s3lib.weed_binary() is None:
        print("<!-- S3 scenarios skipped: no weed binary -->")
        yield False
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = s3lib.start(Path(tmp))
        try:
            with s3lib.environment(server.env()):
                yield True
        finally:
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
