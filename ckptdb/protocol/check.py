"""The consistency invariants of a run, checked (not repaired).

After any crash and reopen, these must hold; the crash tests assert them and
users run them as ``ckptdb check ROOT`` / ``mgr.check()``:

1. every ``committed`` row's file exists, has the recorded size and hash,
   and (with ``load=True``) loads with ``weights_only=True``;
2. no temporary file remains, and no file in our naming lacks a row;
3. each stream's latest pointer is its newest healthy committed checkpoint;
4. each top-K stream holds at most K members, and no evicted checkpoint
   ranks above a member (unless a re-save of its step replaced it);
5. SQLite's ``PRAGMA integrity_check`` is ``ok``; a dry-run reconcile finds
   nothing to do.

(The invariant "every acknowledged save is still committed unless a later
commit evicted it by policy" needs the list of acknowledgements, which only
the caller has; the crash tests check it themselves.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import RunDirectoryError
from ..ledger import Ledger
from ..ledger import models as m
from ..ledger import replicas as ledger_replicas
from ..ledger import rows as ledger_rows
from ..policies import Entry, Policy, TopK
from ..storage.base import LOST, PayloadStore
from .reconcile import Reconciler


class Checker:
    def __init__(
        self, db: Ledger, run_id: int, root: Path, store: PayloadStore, policies: dict[str, Policy]
    ) -> None:
        self.db, self.run_id, self.root, self.store = db, run_id, root, store
        self.policies = policies

    def run(self, *, load: bool = False) -> list[str]:
        """Every violation, one line each; an empty list means consistent."""
        with self.db.transaction(read=True) as session:
            rows = ledger_rows.rows_in_state(session, self.run_id, m.STATES)
            pointers = {s: ledger_rows.latest_row(session, self.run_id, s) for s in self.policies}
            newest = {
                s: ledger_rows.newest_committed_id(session, self.run_id, s) for s in self.policies
            }
            integrity = ledger_rows.integrity(session)
            kept = ledger_rows.kept_on_disk(session, self.run_id)
            if not self.store.renames:  # quarantined where they are (no move)
                kept |= ledger_rows.quarantined_in_place(session, self.run_id)
                kept |= ledger_rows.disowned_paths(session, self.run_id)
        problems = [f"integrity_check: {integrity}"] if integrity != "ok" else []
        committed = [r for r in rows if r.state == m.COMMITTED]
        with self.store.memoized():  # each stream directory is confined once for the pass
            for row in committed:
                problems.extend(self._check_file(row, load))
        live = {r.path for r in rows if r.state in ledger_rows.LIVE_STATES} | kept
        problems.extend(self._check_disk(live))
        for stream in self.policies:
            pointer = pointers[stream]
            actual = pointer.id if pointer is not None else None
            if actual != newest[stream]:
                problems.append(
                    f"latest:{stream} points to {actual}, newest healthy is {newest[stream]}"
                )
        for stream, policy in self.policies.items():
            if policy.ranking_metric is not None:
                problems.extend(self._check_topk(stream, policy, rows))
        try:
            report = Reconciler(self.db, self.run_id, None, self.root, self.store).run(dry_run=True)
        except RunDirectoryError as refused:  # a directory not there: itself a finding
            problems.append(f"reconcile would refuse: {refused}")
            return problems
        problems.extend(f"reconcile would act: {a}" for a in report.actions)
        return problems

    def _check_file(self, row: Any, load: bool) -> list[str]:
        finding = self.store.verify(row.path, row.size, row.hash, full=True, keep=load)
        if finding is not None:
            actual = finding.actual
            if finding.state == LOST or actual is None:
                reason = finding.error if finding.error is not None else finding.detail
                return [f"{row.path}: committed but unreadable: {reason}"]
            return [
                f"{row.path}: size/hash {actual.size}/{actual.hash} != ledger {row.size}/{row.hash}"
            ]
        if load:
            from ..storage.kinds import kind_of_path  # torch: only with load

            try:
                kind_of_path(row.path).check_loadable(self.store, row.path)
            except Exception as exc:  # any unpickling failure is the finding itself
                reason = " ".join(str(exc).split())
                return [f"{row.path}: does not load with weights_only=True: {reason}"]
        return []

    def _check_disk(self, owned: set[str]) -> list[str]:
        problems = []
        for found in self.store.list_ours():
            if found.rel in owned:
                continue
            if found.role == "temp":
                problems.append(f"{found.rel}: temporary file left behind")
            else:
                problems.append(f"{found.rel}: checkpoint file without a ledger row")
        return problems

    def _check_topk(self, stream: str, policy: Policy, rows: list[Any]) -> list[str]:
        """At most k members, and no member outranked by a checkpoint evicted while it was one.

        Members only ever leave, so a member committed before a checkpoint's
        eviction was a member then, and the eviction means it ranked below.
        (Replaced re-saves of a step are exempt: the newer entry wins whatever
        its metric. Rows still 'deleting' carry no eviction time and are skipped.)
        """
        if isinstance(policy, TopK) and policy.last is not None:
            return self._check_best_and_recent(stream, policy, rows)
        mine = [r for r in rows if r.stream == stream and r.metric is not None]
        members = [r for r in mine if r.state == m.COMMITTED]
        limit = policy.capacity
        if limit is not None and len(members) > limit:
            return [f"{stream}: {len(members)} members, more than k={limit}"]
        published = [r for r in mine if r.committed_at is not None]
        problems: list[str] = []
        for gone in published:
            replaced = any(r.step == gone.step and r.id > gone.id for r in published)
            if gone.state != m.DELETED or gone.deleted_at is None or replaced:
                continue
            gone_entry = Entry(gone.id, gone.step, gone.metric)
            outranked = [
                Entry(member.id, member.step, member.metric)
                for member in members
                if member.committed_at is not None
                and member.committed_at <= gone.deleted_at
                and policy.ranked([gone_entry, Entry(member.id, member.step, member.metric)])[0]
                is gone_entry
            ]
            if outranked:
                worst = policy.ranked(outranked)[-1]
                problems.append(
                    f"{stream}: evicted step {gone.step} ranks above member step {worst.step}"
                )
        return problems

    def _check_best_and_recent(self, stream: str, policy: TopK, rows: list[Any]) -> list[str]:
        """``TopK(last=N)``: at most max(k + 1, N) members, and no checkpoint evicted while it was
        among the k best of the checkpoints then live (its stream held k better ones)."""
        mine = [r for r in rows if r.stream == stream]
        members = [r for r in mine if r.state == m.COMMITTED]
        limit = policy.capacity
        if limit is not None and len(members) > limit:
            return [f"{stream}: {len(members)} members, more than {limit}"]
        published = [r for r in mine if r.committed_at is not None and r.metric is not None]
        problems: list[str] = []
        for gone in published:
            replaced = any(r.step == gone.step and r.id > gone.id for r in mine)
            if gone.state != m.DELETED or gone.deleted_at is None or replaced:
                continue
            gone_entry = Entry(gone.id, gone.step, gone.metric)
            better = [
                r
                for r in published
                if r.id != gone.id
                and r.committed_at <= gone.deleted_at
                and (r.deleted_at is None or r.deleted_at > gone.deleted_at)
                and policy.ranked([gone_entry, Entry(r.id, r.step, r.metric)])[0] is not gone_entry
            ]
            if policy.k is not None and len(better) < policy.k:
                problems.append(
                    f"{stream}: step {gone.step} was evicted while among the {policy.k} best"
                )
        return problems


def failed_copy_leftovers(ledger: Ledger, run_id: int, remote: Any, tier: str) -> list[str]:
    """One line per failed copy on ``tier`` under ``remote`` whose prefix still holds
    objects (a copy that landed after it failed): what the replicator's sweep has not
    removed yet (``check`` with ``remote=``)."""
    with ledger.transaction(read=True) as session:
        found = [
            (row.id, prefix)
            for row in ledger_replicas.in_state(session, run_id, tier, ledger_replicas.FAILED)
            if (prefix := remote.rel_of(row.location)) is not None
        ]
    problems = []
    for replica_id, prefix in found:
        left = remote.list_under(prefix)
        if left:
            problems.append(
                f"failed copy {replica_id} left {len(left)} object(s) at {remote.url_of(prefix)} "
                "(a replicator's sweep removes them)"
            )
    return problems
