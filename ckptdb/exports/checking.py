"""``ckptdb check``'s view of exports: each recorded file still what was written."""

from __future__ import annotations

from ..ledger import Ledger
from ..ledger import exports as ledger_exports
from ..record import Export
from ..storage.files import hash_file


def check_exports(db: Ledger, run_id: int) -> list[str]:
    """One line per file of a recorded export that is missing or not what was written."""
    with db.transaction(read=True) as session:
        found = ledger_exports.of_run(session, run_id)
    return [problem for export in found for problem in check_export(export)]


def check_export(export: Export) -> list[str]:
    problems = []
    where = f"export {export.id} ({export.path})"
    for recorded in export.files:
        try:
            actual = hash_file(export.path / recorded.name)
        except OSError as exc:
            problems.append(f"{where}: {recorded.name} unreadable: {exc}")
            continue
        if (actual.size, actual.hash) != (recorded.size, recorded.hash):
            problems.append(
                f"{where}: {recorded.name} size/hash {actual.size}/{actual.hash} "
                f"!= ledger {recorded.size}/{recorded.hash}"
            )
    return problems
