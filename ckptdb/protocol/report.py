"""What a reconcile did (or, in a dry run, would do): one :class:`Action` per repair.

Its own module so that the parts reconcile runs (:mod:`.aliases`) report in the
same words without importing reconcile itself. Both names are public
(``ckptdb.Action``, ``ckptdb.ReconcileReport``) and stay importable from
:mod:`ckptdb.protocol.reconcile`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Action:
    """One repair (or, in a dry run, one repair that would be made)."""

    # rolled_back | deleted | lost | corrupt | restored | repointed | removed_temp |
    # quarantined | aliased | alias_left | failed
    kind: str
    path: str
    detail: str = ""
    checkpoint_id: int | None = None
    step: int | None = None
    #: A quarantined payload left where it is (a store without rename): remembered
    #: in its event, so the next reconcile does not report it again.
    in_place: bool = False

    def __str__(self) -> str:
        return f"{self.kind:<12} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass
class ReconcileReport:
    """Every action of one reconcile, in the order they were made."""

    dry_run: bool = False
    actions: list[Action] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(a.kind for a in self.actions))

    @property
    def failures(self) -> list[Action]:
        return [a for a in self.actions if a.kind == "failed"]

    def __str__(self) -> str:
        if not self.actions:
            return "reconcile: ledger and disk agree; nothing to do"
        head = "reconcile (dry run)" if self.dry_run else "reconcile"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        return "\n".join([f"{head}: {counts}", *(f"  {a}" for a in self.actions)])
