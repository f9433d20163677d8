"""Retention and top-K policies: a small protocol, pure and free of I/O.

A :class:`Policy` answers questions over plain :class:`Entry` values (which
committed checkpoints of a stream must go when a new one commits, whether a
candidate is worth writing, how members rank), so it can be tested
exhaustively without a ledger or a disk. The boundary applies the answers
inside its transactions; the ledger stores a policy as a
:class:`PolicyRecord` and rebuilds it with :func:`policy_from_record`, the
one place where stored options become policies.

Retention windows are built from preservation rules that compose
(:class:`Newest`, :class:`EveryStep`, :class:`Best`, :class:`AnyOf`): a
checkpoint stays while any rule of its policy keeps it.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from .errors import ArgumentTypeError, InvalidArgumentError, UnknownStreamError

#: The largest number a policy holds: what the ledger's 64-bit integer columns store
#: (the ledger's own bounds, e.g. its largest step, start from it).
INT64_MAX = 2**63 - 1
STREAM_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
#: save()'s own keyword arguments: a stream of that name could never receive a payload.
RESERVED_STREAM_NAMES = frozenset({"step", "metrics", "blocking"})


@dataclass(frozen=True)
class Entry:
    """What a policy needs to know about one checkpoint of its stream."""

    id: int
    step: int
    metric: float | None = None


@dataclass(frozen=True)
class Reads:
    """Which committed rows a commit at ``step`` must read to decide its evictions.

    ``everything``: all of them. Otherwise the union of the rows at ``step`` or
    later (the timeline rule), the ``newest_below`` newest rows before ``step``,
    and the rows whose step is not a multiple of ``not_multiple_of``: the only
    rows a ``Keep(last, every)`` window can evict, however long its history of
    kept multiples grows.
    """

    everything: bool = False
    newest_below: int = 0
    not_multiple_of: int | None = None

    def select(self, committed: Sequence[Entry], step: int) -> list[Entry]:
        """The same selection over plain entries (what the ledger's queries return)."""
        if self.everything:
            return list(committed)
        below = sorted((e for e in committed if e.step < step), key=lambda e: (e.step, e.id))
        chosen = {e.id for e in committed if e.step >= step}
        chosen |= (
            {e.id for e in below[len(below) - self.newest_below :]} if self.newest_below else set()
        )
        if self.not_multiple_of is not None:
            chosen |= {e.id for e in committed if e.step % self.not_multiple_of != 0}
        return [e for e in committed if e.id in chosen]


@dataclass(frozen=True)
class PolicyRecord:
    """A policy as the ledger stores it: the policy columns of the ``streams`` table."""

    kind: str
    keep_last: int | None = None
    keep_every: int | None = None
    k: int | None = None
    metric: str | None = None
    mode: str | None = None


@runtime_checkable
class Policy(Protocol):
    """What the protocol asks of a stream's policy."""

    kind: ClassVar[str]

    @property
    def ranking_metric(self) -> str | None:
        """The metric that ranks the stream's checkpoints (None: not ranked)."""

    @property
    def capacity(self) -> int | None:
        """The most checkpoints the stream holds after a commit (None: no fixed bound)."""

    def reads(self, step: int) -> Reads:
        """The committed rows a commit at ``step`` must read (see :class:`Reads`)."""

    @property
    def writes_every_candidate(self) -> bool:
        """Whether every candidate is written (no admission decision to read members for)."""

    @property
    def requires_metric(self) -> bool:
        """Whether every save to the stream must carry the ranking metric."""

    def admits(self, members: Sequence[Entry], candidate: Entry) -> bool:
        """Whether ``candidate`` is worth writing (decided before any byte is written)."""

    def evictions(self, committed: Sequence[Entry], new: Entry) -> list[Entry]:
        """The committed entries that go when ``new`` commits."""

    def window_evictions(self, committed: Sequence[Entry]) -> list[Entry]:
        """The entries outside the retention window (``gc``)."""

    def ranked(self, members: Sequence[Entry]) -> list[Entry]:
        """Members best first (for a ranked stream) or newest first."""

    def describe(self) -> str:
        """One line for people (``ckptdb status``)."""

    def to_record(self) -> PolicyRecord:
        """The stored form (see :func:`policy_from_record`)."""


class Preserve(Protocol):
    """A preservation rule: which entries it keeps."""

    def keeps(self, entries: Sequence[Entry]) -> set[int]:
        """The ids of the entries this rule keeps."""


def _newest_first(entries: Sequence[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (e.step, e.id), reverse=True)


@dataclass(frozen=True)
class Newest:
    """Keeps the ``n`` newest entries (None: all)."""

    n: int | None

    def keeps(self, entries: Sequence[Entry]) -> set[int]:
        chosen = _newest_first(entries) if self.n is None else _newest_first(entries)[: self.n]
        return {e.id for e in chosen}


@dataclass(frozen=True)
class EveryStep:
    """Keeps the entries whose step is a multiple of ``n``."""

    n: int

    def keeps(self, entries: Sequence[Entry]) -> set[int]:
        return {e.id for e in entries if e.step % self.n == 0}


@dataclass(frozen=True)
class Best:
    """Keeps the ``n`` best entries by metric (None: all); ties go to the earlier step."""

    n: int | None
    mode: Literal["min", "max"] = "min"

    def key(self, entry: Entry) -> tuple[float, int, int]:
        assert entry.metric is not None
        value = entry.metric if self.mode == "min" else -entry.metric
        return (value, entry.step, entry.id)

    def keeps(self, entries: Sequence[Entry]) -> set[int]:
        return {e.id for e in sorted(entries, key=self.key)[: self.n]}


@dataclass(frozen=True)
class AnyOf:
    """Keeps what any of its rules keeps."""

    rules: tuple[Preserve, ...]

    def keeps(self, entries: Sequence[Entry]) -> set[int]:
        kept: set[int] = set()
        for rule in self.rules:
            kept |= rule.keeps(entries)
        return kept


def _positive_int(name: str, value: Any, *, allow_none: bool, most: int | None = INT64_MAX) -> None:
    """A positive int; a policy's own numbers (``most``) must fit the ledger's 64-bit
    columns, or the run's stream could not even be recorded at open."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
    if most is not None and value > most:
        raise InvalidArgumentError(f"{name} must be at most 2**63 - 1, got {value}")


@dataclass(frozen=True)
class Keep:
    """Keep the newest ``last`` checkpoints (None: all); steps divisible by ``every`` forever.

    The retention policy of a periodic stream: every save is written, and when one
    commits, the checkpoints outside the window are evicted in the same
    transaction (their files removed after it). Timeline rule: a new checkpoint at
    step ``s`` supersedes every checkpoint of the stream with step ``>= s`` (they
    belong to an abandoned timeline, e.g. after a resume from an earlier step), so
    the window never throws away the checkpoint just written. The policy is stored
    in the ledger: a lower ``last`` applies at the stream's next save, or at once
    with ``mgr.gc()``.

    Attributes:
        last: How many of the newest checkpoints are kept, at least 1 (default 5);
            None keeps every checkpoint. At most 2**63 - 1.
        every: Checkpoints whose step is a multiple of ``every`` are kept forever,
            besides the newest ``last``, at least 1; None (the default): none.
            At most 2**63 - 1.

    Raises:
        ArgumentTypeError: ``last`` or ``every`` is not an int, or is a bool.
        InvalidArgumentError: ``last`` or ``every`` is below 1 or above 2**63 - 1.
    """

    last: int | None = 5
    every: int | None = None

    kind: ClassVar[str] = "keep"

    def __post_init__(self) -> None:
        _positive_int("Keep(last=...)", self.last, allow_none=True)
        _positive_int("Keep(every=...)", self.every, allow_none=True)

    @classmethod
    def from_ratio(cls, ratio: float, num_steps: int, save_freq: int) -> Keep:
        """Keep the last ``ceil(ratio * ceil(num_steps / save_freq))`` saves, at least one.

        The ``max_ckpt_keep`` that DeePMD-kit users derive from a ratio: a run of
        ``num_steps`` steps that saves every ``save_freq`` makes
        ``ceil(num_steps / save_freq)`` saves, and a fraction ``ratio`` of them is
        kept. The arithmetic is exact: integer division for the saves, and a float
        ``ratio`` taken as the decimal it prints as (``0.07`` of 100 saves is 7,
        not 8); a ``Fraction`` is used as it is.

        Args:
            ratio: The fraction of the saves kept, a real number in ``(0, 1]``.
            num_steps: The run's number of steps, an int ``>= 1``.
            save_freq: Steps between two saves, an int ``>= 1``.

        Returns:
            ``Keep(last=n)`` with ``n = ceil(ratio * ceil(num_steps / save_freq))``,
                at least 1.

        Raises:
            ArgumentTypeError: ``ratio`` is not a real number (a bool, a string, a
                complex), or ``num_steps`` or ``save_freq`` is not an int (a float,
                a bool).
            InvalidArgumentError: ``ratio`` is outside ``(0, 1]`` (NaN and the
                infinities included), or ``num_steps`` or ``save_freq`` is below 1.
        """
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise ArgumentTypeError(f"ratio must be a real number, got {ratio!r}")
        if not 0 < ratio <= 1:
            raise InvalidArgumentError(f"ratio must be in (0, 1], got {ratio}")
        _positive_int("num_steps", num_steps, allow_none=False, most=None)  # never stored
        _positive_int("save_freq", save_freq, allow_none=False, most=None)
        saves = -(-num_steps // save_freq)
        # exact arithmetic: 0.07 * 100 saves is 7, not the float 7.000000000000001
        exact = ratio if isinstance(ratio, (int, Fraction)) else Fraction(repr(float(ratio)))
        return cls(last=max(1, math.ceil(exact * saves)))

    @property
    def ranking_metric(self) -> str | None:
        """The metric that ranks the stream: None, a Keep stream is not ranked."""
        return None

    @property
    def capacity(self) -> int | None:
        """The most checkpoints the stream holds after a commit: ``last`` (None with
        ``every``, whose kept multiples have no bound)."""
        return self.last if self.every is None else None

    @property
    def writes_every_candidate(self) -> bool:
        """True: a periodic checkpoint is always written."""
        return True

    @property
    def requires_metric(self) -> bool:
        """False: a save to a Keep stream needs no metric."""
        return False

    def reads(self, step: int) -> Reads:
        """The committed rows a commit at ``step`` must read to decide its evictions.

        Part of the policy protocol the boundary calls. Only the rows the window can
        evict are read, however long the history of kept multiples grows.

        Args:
            step: The step of the checkpoint being committed.

        Returns:
            The selection: what ``step`` supersedes for ``last=None``; everything
                (at most ``last + 1`` rows) without ``every``; else the ``last`` newest
                rows before ``step`` and the rows that are not multiples of ``every``.
        """
        if self.last is None:
            return Reads()  # keeps all: only what the new step supersedes
        if self.every is None:
            return Reads(everything=True)  # at most last + 1 rows: nothing to save
        return Reads(newest_below=self.last, not_multiple_of=self.every)

    @property
    def rule(self) -> Preserve:
        """The window as preservation rules: the newest ``last``, or any ``every``-th step."""
        newest = Newest(self.last)
        return newest if self.every is None else AnyOf((newest, EveryStep(self.every)))

    def admits(self, members: Sequence[Entry], candidate: Entry) -> bool:
        """Whether ``candidate`` is worth writing: always, for a Keep stream.

        Part of the policy protocol the boundary calls before anything is written.

        Args:
            members: The stream's committed checkpoints (not read).
            candidate: The checkpoint about to be saved.

        Returns:
            Always True: a periodic checkpoint is always written.
        """
        return True  # a periodic checkpoint is always written

    def evictions(self, committed: Sequence[Entry], new: Entry) -> list[Entry]:
        """The committed checkpoints that go when ``new`` commits.

        Part of the policy protocol the boundary calls inside its commit: first
        every checkpoint the timeline rule supersedes (a step ``>=`` the new one's),
        then those outside the window once ``new`` is in it.

        Args:
            committed: The stream's committed checkpoints the commit read (see
                :meth:`reads`).
            new: The checkpoint being committed.

        Returns:
            The checkpoints to evict; never ``new`` itself.
        """
        superseded = [e for e in committed if e.step >= new.step and e.id != new.id]
        remaining = [e for e in committed if e.step < new.step] + [new]
        return superseded + self.window_evictions(remaining)

    def window_evictions(self, committed: Sequence[Entry]) -> list[Entry]:
        """The checkpoints outside the retention window, newest first.

        What ``gc`` evicts (and :meth:`evictions` after the timeline rule): all but
        the newest ``last`` and the multiples of ``every``.

        Args:
            committed: The stream's committed checkpoints.

        Returns:
            The checkpoints the window does not keep, newest first.
        """
        kept = self.rule.keeps(committed)
        return [e for e in _newest_first(committed) if e.id not in kept]

    def ranked(self, members: Sequence[Entry]) -> list[Entry]:
        """The stream's checkpoints in order: newest first (a Keep stream is not ranked).

        Args:
            members: The stream's committed checkpoints.

        Returns:
            ``members``, newest step first.
        """
        return _newest_first(members)

    def describe(self) -> str:
        """One line for people, as ``ckptdb status`` shows the policy.

        Returns:
            E.g. ``"keep last 5"``, ``"keep all"`` or ``"keep last 3, every 1000"``.
        """
        text = "keep all" if self.last is None else f"keep last {self.last}"
        return text + (f", every {self.every}" if self.every else "")

    def to_record(self) -> PolicyRecord:
        """The policy as the ledger stores it (the policy columns of ``streams``).

        Returns:
            The record :meth:`from_record` rebuilds this policy from.
        """
        return PolicyRecord(self.kind, keep_last=self.last, keep_every=self.every)

    @classmethod
    def from_record(cls, record: PolicyRecord) -> Keep:
        """The Keep policy a stored record describes (the inverse of :meth:`to_record`).

        Args:
            record: A stored policy of kind ``keep``.

        Returns:
            The policy, with ``last`` and ``every`` as stored.
        """
        return cls(last=record.keep_last, every=record.keep_every)


@dataclass(frozen=True)
class TopK:
    """Keep the ``k`` best checkpoints by ``metrics[metric]``; ties go to the earlier step.

    The retention policy of a ranked stream. A candidate that would not enter the
    top-K is not written at all (the decision is made before any byte is), and
    every save to the stream must carry the metric (unless ``last`` is set); a
    metric given must be finite. ``k=None`` keeps every checkpoint, ranked
    (Lightning's ``save_top_k=-1``), and writes every candidate.

    Exempt from the timeline rule: a best model from an abandoned branch is
    still a good model. Re-saving a step already in the top-K replaces it.

    ``last=N`` makes the stream hold ``N`` checkpoints in all: the ``k``
    best, whatever their age, and the newest ones, as many as fit (the
    newest is always kept, so a stream may hold ``k + 1``). This is the
    Hugging Face Trainer's ``save_total_limit`` with ``metric_for_best_model``:
    one directory per save, recent and maybe best. Every candidate is then
    written, and a save may omit the metric (a checkpoint without it is never
    among the best). Recency follows the timeline rule: after a resume from
    an earlier step, checkpoints of the abandoned steps stay only if they are
    among the ``k`` best.

    The policy is stored in the ledger: a lower ``k`` applies at the stream's next
    save, or at once with ``mgr.gc()``; a new ``metric`` re-ranks the stream's
    checkpoints by their saved metrics, and is refused if one was saved without it
    (unless ``last`` is set: such a checkpoint is then kept by recency only).

    Attributes:
        k: How many of the best checkpoints are kept, at least 1 (at most
            2**63 - 1); None keeps every checkpoint, ranked.
        metric: The name of the metric in ``save(metrics=...)`` that ranks the
            stream, a non-empty string.
        mode: ``"min"`` (the default: lower is better, a loss) or ``"max"``
            (higher is better, an accuracy).
        last: The number of checkpoints the stream holds in all, best and newest
            (at least 1, at most 2**63 - 1); None (the default): only the ``k``
            best. With ``k=None`` every checkpoint is kept and ``last`` changes
            nothing.

    Raises:
        ArgumentTypeError: ``k`` or ``last`` is not an int, or ``metric`` is not a
            str.
        InvalidArgumentError: ``k`` or ``last`` is below 1 or above 2**63 - 1,
            ``metric`` is empty, or ``mode`` is neither ``"min"`` nor ``"max"``.
    """

    k: int | None
    metric: str
    mode: Literal["min", "max"] = "min"
    last: int | None = None

    kind: ClassVar[str] = "topk"

    def __post_init__(self) -> None:
        _positive_int("TopK(k=...)", self.k, allow_none=True)
        _positive_int("TopK(last=...)", self.last, allow_none=True)
        if not isinstance(self.metric, str):
            raise ArgumentTypeError(f"TopK(metric=...) must be a str, got {self.metric!r}")
        if not self.metric:
            raise InvalidArgumentError(
                f"TopK(metric=...) must be a non-empty str, got {self.metric!r}"
            )
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"TopK(mode=...) must be 'min' or 'max', got {self.mode!r}")

    @property
    def ranking_metric(self) -> str | None:
        """The metric that ranks the stream: ``metric``."""
        return self.metric

    @property
    def capacity(self) -> int | None:
        """The most checkpoints the stream holds after a commit (None: every one)."""
        if self.k is None or self.last is None:
            return self.k
        return max(self.k + 1, self.last)

    @property
    def writes_every_candidate(self) -> bool:
        """Whether every candidate is written (``k=None``, or ``last`` set)."""
        return self.k is None or self.last is not None

    @property
    def requires_metric(self) -> bool:
        """Whether every save must carry the metric: unless ``last`` is set."""
        return self.last is None

    def reads(self, step: int) -> Reads:
        """The committed rows a commit at ``step`` must read to decide its evictions.

        Part of the policy protocol the boundary calls.

        Args:
            step: The step of the checkpoint being committed.

        Returns:
            Every row of the stream; for ``k=None`` only the rows at ``step`` or
                later (a re-save of ``step`` replaces the one there).
        """
        return Reads() if self.k is None else Reads(everything=True)

    @property
    def rule(self) -> Best:
        """The window as a preservation rule: the ``k`` best by the metric."""
        return Best(self.k, self.mode)

    def _ranked(self, members: Sequence[Entry], candidate: Entry) -> list[Entry]:
        others = [m for m in members if m.step != candidate.step]
        return sorted([*others, candidate], key=self.rule.key)

    def admits(self, members: Sequence[Entry], candidate: Entry) -> bool:
        """Whether ``candidate`` would enter the top-K, decided before anything is written.

        Part of the policy protocol the boundary calls: a candidate not admitted is
        never written, and is absent from what ``save`` returns.

        Args:
            members: The stream's committed checkpoints, with their metric.
            candidate: The checkpoint about to be saved, with its metric.

        Returns:
            True when the candidate ranks among the ``k`` best (a member at the
                same step is replaced by it), or when every candidate is written.
        """
        if self.writes_every_candidate:
            return True
        return candidate in self._ranked(members, candidate)[: self.k]

    def evictions(self, committed: Sequence[Entry], new: Entry) -> list[Entry]:
        """The committed checkpoints that go when ``new`` commits.

        Part of the policy protocol the boundary calls inside its commit: a member
        at the same step (replaced by ``new``), then those that fall out of the
        ``k`` best, or with ``last``, out of the best and newest.

        Args:
            committed: The stream's committed checkpoints the commit read.
            new: The checkpoint being committed.

        Returns:
            The checkpoints to evict.
        """
        replaced = [m for m in committed if m.step == new.step and m.id != new.id]
        if self.k is None:
            return replaced
        if self.last is None:
            return replaced + self._ranked(committed, new)[self.k :]
        pool = [e for e in committed if e.step != new.step] + [new]
        current = [e for e in pool if e.step < new.step] + [new]  # the timeline rule
        kept = self._best_and_newest(pool, current)
        return replaced + [e for e in self.ranked(pool) if e.id not in kept]

    def window_evictions(self, committed: Sequence[Entry]) -> list[Entry]:
        """The checkpoints outside the retention window (what ``gc`` evicts).

        Args:
            committed: The stream's committed checkpoints.

        Returns:
            Those that are neither among the ``k`` best nor, with ``last``, among
                the newest that fit; in ranked order. Empty for ``k=None``.
        """
        if self.k is None:
            return []  # keeps everything, scored or not
        if self.last is None:
            kept = self._best(committed)
        elif not committed:
            return []
        else:
            kept = self._best_and_newest(committed, committed)
        return [e for e in self.ranked(committed) if e.id not in kept]

    def _best(self, entries: Sequence[Entry]) -> set[int]:
        """The ids of the ``k`` best entries among those that carry the metric."""
        return self.rule.keeps([e for e in entries if e.metric is not None])

    def _best_and_newest(self, pool: Sequence[Entry], current: Sequence[Entry]) -> set[int]:
        """``last`` in all: the best of ``pool``, the newest of ``current``, then the
        next newest of ``current`` while there is room."""
        assert self.last is not None
        newest = _newest_first(current)
        kept = self._best(pool) | {newest[0].id}
        for entry in newest:
            if len(kept) >= self.last:
                break
            kept.add(entry.id)
        return kept

    def ranked(self, members: Sequence[Entry]) -> list[Entry]:
        """The stream's checkpoints best first, as ``mgr.best()`` lists them.

        Ties go to the earlier step; checkpoints saved without the metric (with
        ``last``) come last, newest first.

        Args:
            members: The stream's committed checkpoints.

        Returns:
            ``members`` in ranked order.
        """
        scored = sorted((m for m in members if m.metric is not None), key=self.rule.key)
        return scored + _newest_first([m for m in members if m.metric is None])

    def describe(self) -> str:
        """One line for people, as ``ckptdb status`` shows the policy.

        Returns:
            E.g. ``"top-3 by val_loss (min)"``, with ``", 5 in all with the
                newest"`` when ``last`` is set.
        """
        size = "all" if self.k is None else f"top-{self.k}"
        recent = f", {self.last} in all with the newest" if self.last is not None else ""
        return f"{size} by {self.metric} ({self.mode}){recent}"

    def to_record(self) -> PolicyRecord:
        """The policy as the ledger stores it (the policy columns of ``streams``).

        Returns:
            The record :meth:`from_record` rebuilds this policy from.
        """
        return PolicyRecord(
            self.kind, keep_last=self.last, k=self.k, metric=self.metric, mode=self.mode
        )

    @classmethod
    def from_record(cls, record: PolicyRecord) -> TopK:
        """The TopK policy a stored record describes (the inverse of :meth:`to_record`).

        Args:
            record: A stored policy of kind ``topk``, with its metric.

        Returns:
            The policy, with ``k``, ``metric``, ``mode`` and ``last`` as stored.
        """
        assert record.metric is not None
        mode: Literal["min", "max"] = "max" if record.mode == "max" else "min"
        return cls(k=record.k, metric=record.metric, mode=mode, last=record.keep_last)


def replayed_evictions(policy: Policy, entries: Sequence[Entry]) -> list[Entry]:
    """The entries ``policy`` evicts when they commit one after another in this order,
    each judged against those still kept: a window applied after the fact to a
    stream's history (a remote tier's copies), timeline rule and all, as the
    stream's own commits applied it."""
    kept: list[Entry] = []
    evicted: list[Entry] = []
    for new in entries:
        pool = [*kept, new]
        doomed = {e.id for e in policy.evictions(kept, new)}
        evicted += [e for e in pool if e.id in doomed]
        kept = [e for e in pool if e.id not in doomed]
    return evicted


POLICY_KINDS: dict[str, Any] = {Keep.kind: Keep.from_record, TopK.kind: TopK.from_record}


def policy_from_record(record: PolicyRecord) -> Policy:
    """The policy a stored record describes (an unknown kind keeps everything)."""
    build = POLICY_KINDS.get(record.kind, Keep.from_record)
    policy: Policy = build(record)
    return policy


def default_ranked_stream(policies: Mapping[str, Policy]) -> str | None:
    """The stream ``ckptdb best`` reports when none is named: the top-K stream called
    ``best``, else the run's only top-K stream; None when it has none, or several.

    Args:
        policies: A run's streams and their policies.

    Returns:
        The stream's name, or None (the caller says why).
    """
    ranked = [name for name, policy in policies.items() if policy.ranking_metric is not None]
    if "best" in ranked:
        return "best"
    return ranked[0] if len(ranked) == 1 else None


def policy_of(policies: Mapping[str, Policy], stream: str) -> Policy:
    """The policy of ``stream``; an unknown stream is an error naming the known ones."""
    policy = policies.get(stream)
    if policy is None:
        raise UnknownStreamError(
            f"no stream {stream!r} is configured (streams: {', '.join(policies)})"
        )
    return policy


def validate_stream_name(name: object) -> str:
    if not isinstance(name, str):
        raise ArgumentTypeError(f"stream names are str, got {name!r}")
    if not STREAM_NAME.fullmatch(name) or name in (".", "..") or name.startswith("ckptdb."):
        raise InvalidArgumentError(
            f"invalid stream name {name!r}: use 1-64 letters, digits, '_', '-', '.' "
            "(not '.', '..' or a name starting with 'ckptdb.')"
        )
    if name in RESERVED_STREAM_NAMES:
        raise InvalidArgumentError(
            f"invalid stream name {name!r}: it is an argument of save(), so no payload "
            f"could be passed for it ({', '.join(sorted(RESERVED_STREAM_NAMES))} are taken)"
        )
    return name


def validate_policies(streams: object) -> dict[str, Policy]:
    if not isinstance(streams, dict) or not streams:
        raise ArgumentTypeError(f"streams must be a non-empty dict name -> policy, got {streams!r}")
    for name, policy in streams.items():
        validate_stream_name(name)
        # Only kinds the ledger can store and rebuild: a policy read back as something
        # else would retain (or evict) differently after the next open.
        if (
            isinstance(policy, type)
            or not isinstance(policy, Policy)
            or POLICY_KINDS.get(policy.kind) is None
        ):
            raise ArgumentTypeError(
                f"policy of stream {name!r} must be Keep or TopK, got {policy!r}"
            )
    return dict(streams)
