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
    """One repair (or, in a dry run, one repair that would be made).

    Each action a reconcile makes is also recorded as an event of the same kind
    (docs/ledger.md, "Event kinds").

    Attributes:
        kind: What was done: ``rolled_back``, ``deleted``, ``lost``, ``corrupt``,
            ``restored``, ``repointed``, ``removed_temp``, ``quarantined``,
            ``aliased``, ``alias_left`` or ``failed``.
        path: The file or directory acted on, relative to the save directory
            (the run root for an alias; ``latest:<stream>`` for a re-pointed
            pointer).
        detail: Why, or what failed (empty when the kind says it all).
        checkpoint_id: The ledger row concerned; None for a file no row owns.
        step: That row's step; None without a row.
        in_place: A quarantined payload left where it is (a store without
            rename): remembered in its event, so the next reconcile does not
            report it again.
    """

    kind: str
    path: str
    detail: str = ""
    checkpoint_id: int | None = None
    step: int | None = None
    in_place: bool = False

    def __str__(self) -> str:
        return f"{self.kind:<12} {self.path}" + (f"  ({self.detail})" if self.detail else "")


@dataclass
class ReconcileReport:
    """Every action of one reconcile, in the order they were made.

    ``str()`` gives one line of counts and a line per action, what
    ``ckptdb reconcile`` prints.

    Attributes:
        dry_run: True when nothing was changed: the actions are what a
            reconcile would do (``ckptdb reconcile --dry-run``).
        actions: Each :class:`Action`, in order.
    """

    dry_run: bool = False
    actions: list[Action] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        """The number of actions of each kind, e.g. ``{"rolled_back": 3}``."""
        return dict(Counter(a.kind for a in self.actions))

    @property
    def failures(self) -> list[Action]:
        """The actions that failed (kind ``failed``): what a reconcile could not repair."""
        return [a for a in self.actions if a.kind == "failed"]

    def __str__(self) -> str:
        if not self.actions:
            return "reconcile: ledger and disk agree; nothing to do"
        head = "reconcile (dry run)" if self.dry_run else "reconcile"
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        return "\n".join([f"{head}: {counts}", *(f"  {a}" for a in self.actions)])
