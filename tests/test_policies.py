"""Retention (Keep), top-K (TopK) and stream-name rules, tested as pure functions.

Expected values are derived by hand from the rules in docs/guarantees.md,
or by a brute-force reference written independently of ckptdb.policies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import pytest
from helpers import LedgerClient, state
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdb import CheckpointManager, Keep, TopK
from ckptdb.errors import (
    ArgumentTypeError,
    CkptDBError,
    InvalidArgumentError,
    InvalidMetricError,
)
from ckptdb.policies import (
    Entry,
    Reads,
    replayed_evictions,
    validate_policies,
    validate_stream_name,
)

NEW_ID = 999


def entries(*steps: int) -> list[Entry]:
    """Committed entries at ``steps``; ids deliberately differ from steps."""
    return [Entry(id=100 + s, step=s) for s in steps]


def scored(*pairs: tuple[int, float]) -> list[Entry]:
    return [Entry(id=100 + s, step=s, metric=v) for s, v in pairs]


def steps_of(found: Sequence[Entry]) -> list[int]:
    return sorted(e.step for e in found)


def ids_of(found: Sequence[Entry]) -> list[int]:
    return sorted(e.id for e in found)


# --------------------------------------------------------------------------- Keep: window


@pytest.mark.parametrize(
    ("policy", "steps", "evicted"),
    [
        (Keep(last=3), [1, 2, 3, 4, 5], [1, 2]),
        (Keep(last=3), [5, 1, 4, 2, 3], [1, 2]),  # input order does not matter
        (Keep(last=1), [10, 20, 30], [10, 20]),
        (Keep(last=5), [1, 2, 3], []),
        (Keep(last=3), [1, 2, 3], []),
        (Keep(last=3), [], []),
        (Keep(last=None), list(range(50)), []),
        (Keep(last=None, every=7), list(range(50)), []),
        # steps divisible by `every` are kept forever, the rest leave the window
        (Keep(last=2, every=2), [1, 2, 3, 4, 5, 6], [1, 3]),
        (Keep(last=1, every=10), [10, 15, 20, 25], [15]),
        (Keep(last=1, every=10), [0, 5, 10, 11], [5]),
        (Keep(last=2, every=100), [100, 150, 200, 250, 300, 350], [150, 250]),
        (Keep(last=1, every=1), [1, 2, 3], []),
    ],
)
def test_keep_window_evictions(policy: Keep, steps: list[int], evicted: list[int]) -> None:
    found = policy.window_evictions(entries(*steps))
    assert steps_of(found) == evicted
    assert len({e.id for e in found}) == len(found)  # no duplicates


def test_keep_window_returns_the_entries_themselves() -> None:
    committed = entries(1, 2, 3)
    found = Keep(last=1).window_evictions(committed)
    assert ids_of(found) == [101, 102]
    assert all(any(e is c for c in committed) for e in found)


# --------------------------------------------------------------------------- Keep: timeline


@pytest.mark.parametrize(
    ("policy", "committed", "new_step", "evicted"),
    [
        # plain forward progress: only the window evicts
        (Keep(last=3), [1, 2, 3, 4, 5], 6, [1, 2, 3]),
        (Keep(last=3), [1, 2], 3, []),
        (Keep(last=1), [1], 2, [1]),
        # going back in time: steps >= s are superseded
        (Keep(last=3), [1, 2, 3, 4, 5], 3, [3, 4, 5]),
        (Keep(last=3), [1, 2, 3, 4, 5], 0, [1, 2, 3, 4, 5]),
        (Keep(last=5), [10, 20, 30], 15, [20, 30]),
        (Keep(last=1), [10, 20], 15, [10, 20]),  # 20 superseded, 10 left the window
        # re-saving the newest step replaces it
        (Keep(last=3), [1, 2, 3], 3, [3]),
        # last=None keeps everything except the abandoned timeline
        (Keep(last=None), [1, 2, 3, 4, 5], 6, []),
        (Keep(last=None), [1, 2, 3, 4, 5], 3, [3, 4, 5]),
        # keep-every steps survive the window but not the timeline rule
        (Keep(last=1, every=10), [10, 20, 30], 25, [30]),
        (Keep(last=1, every=10), [10, 15, 20, 21], 22, [15, 21]),
        (Keep(last=2, every=5), [5, 6, 7, 10, 11], 12, [6, 7]),
    ],
)
def test_keep_evictions_timeline_rule(
    policy: Keep, committed: list[int], new_step: int, evicted: list[int]
) -> None:
    new = Entry(id=NEW_ID, step=new_step)
    found = policy.evictions(entries(*committed), new)
    assert steps_of(found) == evicted
    assert NEW_ID not in {e.id for e in found}
    assert len({e.id for e in found}) == len(found)


@pytest.mark.parametrize("last", [1, 2, 3])
@pytest.mark.parametrize("new_step", [0, 1, 5, 9, 10, 11])
def test_keep_window_never_evicts_the_new_entry(last: int, new_step: int) -> None:
    committed = entries(*range(1, 11))
    found = Keep(last=last).evictions(committed, Entry(id=NEW_ID, step=new_step))
    survivors = {e.id for e in committed} - {e.id for e in found}
    assert NEW_ID not in {e.id for e in found}
    # the survivors are the newest last-1 steps strictly before new_step
    expected = sorted(s for s in range(1, 11) if s < new_step)[-(last - 1) :] if last > 1 else []
    assert sorted(i - 100 for i in survivors) == expected


def test_keep_evictions_ignore_a_committed_row_that_is_the_new_one() -> None:
    # the manager may hand the new row in `committed` too; it must never be evicted
    new = Entry(id=NEW_ID, step=4)
    found = Keep(last=2).evictions([*entries(1, 2, 3), new], new)
    assert NEW_ID not in {e.id for e in found}
    assert steps_of(found) == [1, 2]


def keep_reference(policy: Keep, committed: list[Entry], new: Entry) -> set[int]:
    """Brute force: what the rules in the issue say must go."""
    alive = [e for e in committed if e.step < new.step] + [new]
    by_step = sorted(alive, key=lambda e: e.step, reverse=True)
    window = by_step if policy.last is None else by_step[: policy.last]
    kept = {e.id for e in window}
    if policy.every is not None:
        kept |= {e.id for e in alive if e.step % policy.every == 0}
    return {e.id for e in committed} - kept


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.integers(0, 60), unique=True, max_size=15),
    new_step=st.integers(0, 65),
    last=st.one_of(st.none(), st.integers(1, 6)),
    every=st.one_of(st.none(), st.integers(1, 12)),
)
def test_keep_evictions_match_brute_force(
    steps: list[int], new_step: int, last: int | None, every: int | None
) -> None:
    policy = Keep(last=last, every=every)
    committed = entries(*steps)
    new = Entry(id=NEW_ID, step=new_step)
    found = policy.evictions(committed, new)
    assert len({e.id for e in found}) == len(found)
    assert {e.id for e in found} == keep_reference(policy, committed, new)


# --------------------------------------------------------------------------- Keep.from_ratio


@pytest.mark.parametrize(
    ("ratio", "num_steps", "save_freq", "expected"),
    [
        (0.5, 100, 10, 5),
        (0.25, 100, 10, 3),  # ceil(2.5)
        (1, 100, 10, 10),
        (1.0, 95, 10, 10),  # ceil(9.5) saves
        (0.5, 95, 10, 5),  # 10 saves -> 5
        (0.5, 101, 10, 6),  # 11 saves -> ceil(5.5)
        (0.01, 100, 10, 1),  # ceil(0.1)
        (1e-9, 1000, 1, 1),  # at least one
        (0.3, 7, 10, 1),  # fewer steps than save_freq: one save
        (1, 1, 1, 1),
        (0.5, 3, 1, 2),
        (Fraction(1, 3), 30, 1, 10),
        (0.2, 1000, 1, 200),
    ],
)
def test_keep_from_ratio(ratio: float, num_steps: int, save_freq: int, expected: int) -> None:
    policy = Keep.from_ratio(ratio, num_steps, save_freq)
    assert isinstance(policy, Keep)
    assert policy.last == expected
    assert policy.every is None


@pytest.mark.parametrize(
    ("ratio", "num_steps", "save_freq", "expected"),
    [
        # decimal ratios whose float product lands just above an integer
        (0.07, 1000, 10, 7),  # 7% of 100 saves
        (0.55, 1000, 10, 55),  # 55% of 100 saves
        (0.28, 250, 10, 7),  # 28% of 25 saves
        (0.14, 500, 10, 7),  # 14% of 50 saves
        # saves must be an exact integer ceiling, not a float division
        (1, 2**53 + 1, 1, 2**53 + 1),
        (1, 10**17 + 1, 10**17, 2),
    ],
)
def test_keep_from_ratio_is_exact(
    ratio: float, num_steps: int, save_freq: int, expected: int
) -> None:
    assert Keep.from_ratio(ratio, num_steps, save_freq).last == expected


@pytest.mark.parametrize("save_freq", [1, 7, 10])
def test_keep_from_ratio_matches_exact_arithmetic_for_every_percentage(save_freq: int) -> None:
    """Every whole percentage of 1..120 saves, against exact rational arithmetic."""
    wrong = []
    for saves in range(1, 121):
        num_steps = saves * save_freq
        for percent in range(1, 101):
            expected = max(1, math.ceil(Fraction(percent, 100) * saves))
            got = Keep.from_ratio(percent / 100, num_steps, save_freq).last
            if got != expected:
                wrong.append((percent / 100, num_steps, save_freq, got, expected))
    assert wrong == []


@pytest.mark.parametrize(
    "ratio", [0, 0.0, -0.5, -1, 1.0000001, 1.5, 2, float("nan"), float("inf"), float("-inf")]
)
def test_keep_from_ratio_rejects_ratio_outside_unit_interval(ratio: float) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        Keep.from_ratio(ratio, 100, 10)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, CkptDBError)


@pytest.mark.parametrize("ratio", ["0.5", None, 0.5j, [0.5]])
def test_keep_from_ratio_rejects_non_real_ratio(ratio: object) -> None:
    with pytest.raises(ArgumentTypeError) as info:
        Keep.from_ratio(ratio, 100, 10)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)


def test_keep_from_ratio_rejects_bool_ratio() -> None:
    with pytest.raises(InvalidArgumentError):
        Keep.from_ratio(True, 100, 10)


@pytest.mark.parametrize("which", ["num_steps", "save_freq"])
@pytest.mark.parametrize("value", [0, -1, -100])
def test_keep_from_ratio_rejects_counts_below_one(which: str, value: int) -> None:
    kwargs = {"ratio": 0.5, "num_steps": 100, "save_freq": 10, which: value}
    with pytest.raises(InvalidArgumentError) as info:
        Keep.from_ratio(**kwargs)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("which", ["num_steps", "save_freq"])
@pytest.mark.parametrize("value", [10.0, 2.5, "10", None, True])
def test_keep_from_ratio_rejects_non_int_counts(which: str, value: object) -> None:
    kwargs = {"ratio": 0.5, "num_steps": 100, "save_freq": 10, which: value}
    with pytest.raises(ArgumentTypeError) as info:
        Keep.from_ratio(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)


# --------------------------------------------------------------------------- constructors


@pytest.mark.parametrize(
    "make",
    [
        lambda: Keep(last=-1),
        lambda: Keep(last=0),
        lambda: Keep(last=-100),
        lambda: Keep(every=0),
        lambda: Keep(every=-5),
        lambda: Keep(last=None, every=0),
        lambda: TopK(k=0, metric="loss"),
        lambda: TopK(k=-1, metric="loss"),
        lambda: TopK(k=1, metric=""),
        lambda: TopK(k=1, metric=None),
        lambda: TopK(k=1, metric=3),
        lambda: TopK(k=1, metric="loss", mode="MIN"),
        lambda: TopK(k=1, metric="loss", mode="mean"),
        lambda: TopK(k=1, metric="loss", mode=""),
        lambda: TopK(k=1, metric="loss", mode=None),
    ],
)
def test_policy_constructor_rejects_bad_values(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgumentError) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, CkptDBError)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Keep(last=True),
        lambda: Keep(last=False),
        lambda: Keep(last=1.0),
        lambda: Keep(last="3"),
        lambda: Keep(every=2.5),
        lambda: Keep(every=True),
        lambda: TopK(k=True, metric="loss"),
        lambda: TopK(k=1.0, metric="loss"),
        lambda: TopK(k="2", metric="loss"),
    ],
)
def test_policy_constructor_rejects_bad_types(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ArgumentTypeError) as info:
        make()
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, InvalidArgumentError)


def test_policy_defaults_and_valid_arguments() -> None:
    assert (Keep().last, Keep().every) == (5, None)
    assert Keep(last=None).last is None
    assert (Keep(last=1, every=1).last, Keep(last=1, every=1).every) == (1, 1)
    top = TopK(3, "val_loss")
    assert (top.k, top.metric, top.mode) == (3, "val_loss", "min")
    assert TopK(1, "acc", "max").mode == "max"


def test_policies_are_immutable() -> None:
    keep = Keep(last=2)
    with pytest.raises(AttributeError):
        keep.last = 0  # type: ignore[misc]
    top = TopK(2, "loss")
    with pytest.raises(AttributeError):
        top.k = 0  # type: ignore[misc]


# --------------------------------------------------------------------------- TopK


@pytest.mark.parametrize(
    ("policy", "members", "candidate", "admitted"),
    [
        # min: lower is better
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.4), True),
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.1), True),
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.6), False),
        # a tie with the worst member: the earlier step wins
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.5), False),
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (5, 0.5), True),
        # max: higher is better
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (30, 0.6), True),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (30, 0.9), True),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (30, 0.4), False),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (30, 0.5), False),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (5, 0.5), True),
        # fewer than k members: anything gets in
        (TopK(3, "loss"), [(10, 0.1), (20, 0.2)], (30, 1e9), True),
        (TopK(1, "loss"), [], (30, 1e9), True),
        (TopK(3, "acc", "max"), [(10, 0.1)], (30, -1e9), True),
        # re-saving a step already in the top-K replaces it, even with a worse metric
        (TopK(2, "loss"), [(10, 0.1), (20, 0.2)], (10, 0.9), True),
        (TopK(1, "loss"), [(10, 0.1)], (10, 0.9), True),
        (TopK(2, "acc", "max"), [(10, 0.9), (20, 0.8)], (20, 0.1), True),
    ],
)
def test_topk_admits(
    policy: TopK,
    members: list[tuple[int, float]],
    candidate: tuple[int, float],
    admitted: bool,
) -> None:
    step, value = candidate
    assert policy.admits(scored(*members), Entry(id=-1, step=step, metric=value)) is admitted


@pytest.mark.parametrize(
    ("policy", "members", "new", "evicted"),
    [
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.4), [10]),
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.1), [10]),
        (TopK(2, "loss"), [(10, 0.5), (20, 0.3)], (5, 0.5), [10]),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (30, 0.6), [10]),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.7)], (5, 0.5), [10]),
        (TopK(3, "loss"), [(10, 0.5), (20, 0.3)], (30, 0.9), []),
        (TopK(1, "loss"), [(10, 0.5)], (20, 0.4), [10]),
        # re-saving a member replaces that entry only
        (TopK(2, "loss"), [(10, 0.1), (20, 0.2)], (10, 0.9), [10]),
        (TopK(2, "loss"), [(10, 0.1), (20, 0.2)], (20, 0.05), [20]),
        (TopK(3, "loss"), [(10, 0.1), (20, 0.2), (30, 0.3)], (20, 0.25), [20]),
        # exempt from the timeline rule: older steps do not supersede newer ones
        (TopK(3, "loss"), [(10, 0.1), (20, 0.2), (30, 0.3)], (5, 0.01), [30]),
        (TopK(3, "loss"), [(10, 0.1), (20, 0.2)], (5, 0.9), []),
        # more members than k (the policy was narrowed): trimmed to k
        (TopK(1, "loss"), [(10, 0.3), (20, 0.2), (30, 0.4)], (40, 0.1), [10, 20, 30]),
        (TopK(2, "loss"), [(10, 0.3), (20, 0.2), (30, 0.4)], (40, 0.25), [10, 30]),
    ],
)
def test_topk_evictions(
    policy: TopK,
    members: list[tuple[int, float]],
    new: tuple[int, float],
    evicted: list[int],
) -> None:
    step, value = new
    committed = scored(*members)
    found = policy.evictions(committed, Entry(id=NEW_ID, step=step, metric=value))
    assert ids_of(found) == sorted(100 + s for s in evicted)
    assert NEW_ID not in {e.id for e in found}
    survivors = len(committed) + 1 - len(found)
    assert survivors <= policy.k


@pytest.mark.parametrize(
    ("policy", "members", "order"),
    [
        (TopK(5, "loss"), [(10, 0.5), (20, 0.1), (30, 0.3)], [20, 30, 10]),
        (TopK(5, "acc", "max"), [(10, 0.5), (20, 0.1), (30, 0.3)], [10, 30, 20]),
        # ties: earlier step first, in both modes
        (TopK(5, "loss"), [(30, 0.2), (10, 0.2), (20, 0.2)], [10, 20, 30]),
        (TopK(5, "acc", "max"), [(30, 0.2), (10, 0.2), (20, 0.2)], [10, 20, 30]),
        (TopK(5, "loss"), [(30, -1.0), (10, 0.0), (20, -0.0)], [30, 10, 20]),
        (TopK(5, "loss"), [], []),
    ],
)
def test_topk_ranked_best_first(
    policy: TopK, members: list[tuple[int, float]], order: list[int]
) -> None:
    assert [e.step for e in policy.ranked(scored(*members))] == order


@pytest.mark.parametrize(
    ("policy", "members", "evicted"),
    [
        (TopK(2, "loss"), [(10, 0.5), (20, 0.1), (30, 0.3)], [10]),
        (TopK(2, "acc", "max"), [(10, 0.5), (20, 0.1), (30, 0.3)], [20]),
        (TopK(1, "loss"), [(10, 0.2), (20, 0.2), (30, 0.2)], [20, 30]),
        (TopK(5, "loss"), [(10, 0.5), (20, 0.1)], []),
    ],
)
def test_topk_window_evictions(
    policy: TopK, members: list[tuple[int, float]], evicted: list[int]
) -> None:
    assert steps_of(policy.window_evictions(scored(*members))) == evicted


def topk_reference(policy: TopK, committed: list[Entry], new: Entry) -> set[int]:
    """Brute force: survivors are the entries fewer than k others beat (k=None: all)."""

    def beats(a: Entry, b: Entry) -> bool:
        assert a.metric is not None and b.metric is not None
        better = a.metric < b.metric if policy.mode == "min" else a.metric > b.metric
        return better or (a.metric == b.metric and a.step < b.step)

    pool = [e for e in committed if e.step != new.step] + [new]
    limit = len(pool) if policy.k is None else policy.k
    return {e.id for e in pool if sum(beats(o, e) for o in pool if o is not e) < limit}


metrics = st.sampled_from([-1.0, -0.0, 0.0, 0.25, 0.5, 1.0, 2.5, 1e300, -1e300])


@settings(max_examples=400, deadline=None)
@given(
    members=st.dictionaries(st.integers(0, 30), metrics, max_size=9),
    new_step=st.integers(0, 32),
    new_metric=metrics,
    k=st.one_of(st.none(), st.integers(1, 5)),
    mode=st.sampled_from(["min", "max"]),
)
def test_topk_matches_brute_force(
    members: dict[int, float], new_step: int, new_metric: float, k: int | None, mode: str
) -> None:
    policy = TopK(k, "m", mode)  # type: ignore[arg-type]
    committed = scored(*members.items())
    new = Entry(id=NEW_ID, step=new_step, metric=new_metric)
    survivors = topk_reference(policy, committed, new)

    found = policy.evictions(committed, new)
    evicted = {e.id for e in found}
    assert len(evicted) == len(found)
    # admitted exactly when the reference keeps the candidate (id -1, as before a write)
    candidate = Entry(id=-1, step=new_step, metric=new_metric)
    assert policy.admits(committed, candidate) is (NEW_ID in survivors)
    if NEW_ID in survivors:  # the manager only commits an admitted candidate
        assert evicted == {e.id for e in committed} - survivors
        assert k is None or len(committed) + 1 - len(evicted) <= k
        assert NEW_ID not in evicted


# --------------------------------------------------------------------------- stream names


@pytest.mark.parametrize(
    "name",
    ["model", "ema", "best_ema", "a", "A-b_c.d", "0", "x" * 64, "v1.2", "ckptdb", "my.ckptdb.x"],
)
def test_valid_stream_names(name: str) -> None:
    assert validate_stream_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "a/b",
        "/abs",
        "model/",
        "../escape",
        "a\\b",
        "x" * 65,
        "ckptdb.",
        "ckptdb.sqlite",
        "ckptdb.lock",
        "ckptdb.quarantine",
        "with space",
        "tab\tname",
        "model\n",
        "new\nline",
        "a:b",
        "a*b",
        "nul\x00",
        "modèle",
        "step",
        "metrics",
        "blocking",
        "模型",
    ],
)
def test_invalid_stream_names(name: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        validate_stream_name(name)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("name", [None, 1, 1.5, b"model", Path("model"), ["model"]])
def test_stream_name_must_be_str(name: object) -> None:
    with pytest.raises(ArgumentTypeError) as info:
        validate_stream_name(name)
    assert isinstance(info.value, TypeError)


def test_validate_policies_accepts_and_copies() -> None:
    streams = {"model": Keep(last=2), "best": TopK(1, "loss")}
    checked = validate_policies(streams)
    assert checked == streams
    assert checked is not streams


@pytest.mark.parametrize(
    "streams",
    [
        {},
        None,
        [("model", Keep())],
        {"model": "keep"},
        {"model": None},
        {"a/b": Keep()},
        {"ckptdb.x": Keep()},
        {1: Keep()},
    ],
)
def test_validate_policies_rejects(streams: object) -> None:
    with pytest.raises(InvalidArgumentError):
        validate_policies(streams)


def test_topk_without_k_keeps_everything_ranked_and_survives_the_ledger(
    tmp_path: Path,
) -> None:
    """``TopK(None, ...)`` (Lightning's ``save_top_k=-1``): nothing is evicted,
    ``best`` ranks every checkpoint, and the policy reads back from the ledger."""
    policy = TopK(None, "loss", "max")
    assert policy.describe() == "all by loss (max)"
    with CheckpointManager(tmp_path / "run", streams={"best": policy}) as mgr:
        for step, loss in enumerate([0.5, 0.9, 0.1, 0.7]):
            mgr.save(step, metrics={"loss": loss}, best=state(loss))
        assert [c.metric for c in mgr.best("best")] == [0.9, 0.7, 0.5, 0.1]
        assert mgr.gc() == []
    with CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.policies["best"] == policy


@settings(max_examples=300, deadline=None)
@given(
    members=st.dictionaries(st.integers(0, 30), metrics, max_size=12),
    new_step=st.integers(0, 32),
    new_metric=metrics,
    policy=st.sampled_from(
        [Keep(last=None), Keep(last=None, every=3), TopK(None, "m"), TopK(None, "m", "max")]
    ),
)
def test_a_policy_that_keeps_all_evicts_only_from_the_new_step_on(
    members: dict[int, float], new_step: int, new_metric: float, policy: Keep | TopK
) -> None:
    """Why retention may read only the rows at the new step or later for such a policy
    (the boundary's commit relies on it: its cost must not grow with the history)."""
    assert policy.reads(new_step) == Reads()  # only what the new step supersedes
    committed = scored(*members.items())
    new = Entry(id=NEW_ID, step=new_step, metric=new_metric)
    later = [e for e in committed if e.step >= new_step]
    assert policy.evictions(committed, new) == policy.evictions(later, new)


def test_only_unbounded_policies_keep_all() -> None:
    bounded = [Keep(last=5), Keep(last=5, every=10), TopK(3, "m"), TopK(3, "m", last=4)]
    assert all(policy.reads(7) != Reads() for policy in bounded)


def test_a_keep_all_stream_still_supersedes_a_later_timeline(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "run", streams={"model": Keep(last=None)}) as mgr:
        for step in range(10):
            mgr.save(step, model=state(float(step)))
        mgr.save(5, model=state(50.0))  # restarted from step 4: steps 5-9 are abandoned
        assert [c.step for c in mgr.checkpoints("model")] == [0, 1, 2, 3, 4, 5]
        assert mgr.check() == []


# ------------------------------------------------------- TopK(last=N): best and recent


def best_and_recent_reference(policy: TopK, committed: list[Entry], new: Entry) -> set[int]:
    """Brute force for ``TopK(k, last=N)``: the entries fewer than k scored others beat,
    the new one, then the newest of the earlier steps until N are kept in all
    (k=None: every entry)."""

    def beats(a: Entry, b: Entry) -> bool:
        assert a.metric is not None and b.metric is not None
        better = a.metric < b.metric if policy.mode == "min" else a.metric > b.metric
        return better or (a.metric == b.metric and a.step < b.step)

    assert policy.last is not None
    pool = [e for e in committed if e.step != new.step] + [new]
    if policy.k is None:
        return {e.id for e in pool}  # keeps everything, scored or not
    scored_pool = [e for e in pool if e.metric is not None]
    kept = {
        e.id for e in scored_pool if sum(beats(o, e) for o in scored_pool if o is not e) < policy.k
    }
    kept.add(new.id)
    for e in sorted((e for e in pool if e.step < new.step), key=lambda e: e.step, reverse=True):
        if len(kept) >= policy.last:
            break
        kept.add(e.id)
    return kept


maybe_metrics = st.one_of(st.none(), metrics)


@settings(max_examples=400, deadline=None)
@given(
    members=st.dictionaries(st.integers(0, 30), maybe_metrics, max_size=10),
    new_step=st.integers(0, 32),
    new_metric=maybe_metrics,
    k=st.one_of(st.none(), st.integers(1, 4)),
    last=st.integers(1, 4),
    mode=st.sampled_from(["min", "max"]),
)
def test_best_and_recent_matches_brute_force(
    members: dict[int, float | None],
    new_step: int,
    new_metric: float | None,
    k: int | None,
    last: int,
    mode: str,
) -> None:
    policy = TopK(k, "m", mode, last=last)  # type: ignore[arg-type]
    committed = [Entry(id=100 + s, step=s, metric=v) for s, v in members.items()]
    new = Entry(id=NEW_ID, step=new_step, metric=new_metric)
    survivors = best_and_recent_reference(policy, committed, new)
    found = policy.evictions(committed, new)
    evicted = {e.id for e in found}
    assert len(evicted) == len(found)
    assert policy.admits(committed, Entry(id=-1, step=new_step, metric=new_metric))
    assert NEW_ID in survivors and NEW_ID not in evicted  # the newest is always kept
    assert evicted == {e.id for e in committed} - survivors
    if k is not None:
        assert len(committed) + 1 - len(evicted) <= max(k + 1, last)


def test_best_and_recent_keeps_the_best_whatever_its_age() -> None:
    """The Hugging Face Trainer's save_total_limit=2 with a best model: the best and
    the newest stay, whatever order they came in; two newest when the newest is best."""
    policy = TopK(1, "loss", "min", last=2)
    committed = [Entry(1, 10, 0.1), Entry(2, 20, 0.5)]
    assert steps_of(policy.evictions(committed, Entry(3, 30, 0.9))) == [20]
    assert steps_of(policy.window_evictions([*committed, Entry(3, 30, 0.9)])) == [20]
    assert steps_of(policy.evictions(committed, Entry(3, 30, 0.05))) == [10]
    assert [e.step for e in policy.ranked([*committed, Entry(3, 30, 0.9), Entry(4, 40, None)])] == [
        10,
        20,
        30,
        40,
    ]


def test_best_and_recent_with_one_slot_keeps_the_newest_beside_the_best() -> None:
    """save_total_limit=1: the newest is the resume source and is never evicted."""
    policy = TopK(1, "loss", "min", last=1)
    committed = [Entry(1, 10, 0.1), Entry(2, 20, 0.5)]
    assert steps_of(policy.evictions(committed, Entry(3, 30, 0.9))) == [20]
    assert steps_of(policy.evictions(committed, Entry(3, 30, 0.01))) == [10, 20]
    assert policy.capacity == 2


def test_best_and_recent_allows_saves_without_the_metric() -> None:
    recent = TopK(1, "loss", last=2)
    assert recent.writes_every_candidate and not recent.requires_metric
    assert TopK(1, "loss").requires_metric and not TopK(1, "loss").writes_every_candidate
    committed = [Entry(1, 1, None), Entry(2, 2, None)]
    assert steps_of(recent.evictions(committed, Entry(3, 3, None))) == [1]
    assert steps_of(recent.window_evictions([])) == []


def test_best_and_recent_applies_the_timeline_rule_to_recency_only() -> None:
    """Resumed from step 20: step 30 (abandoned) stays only because it is the best."""
    policy = TopK(1, "loss", "min", last=2)
    committed = [Entry(1, 10, 0.5), Entry(2, 20, 0.4), Entry(3, 30, 0.1), Entry(4, 40, 0.3)]
    assert steps_of(policy.evictions(committed, Entry(5, 25, 0.9))) == [10, 20, 40]


def test_best_and_recent_stream_through_the_manager(tmp_path: Path) -> None:
    """Saves with and without the metric, the ledger's record of the policy, ``best``
    and ``check`` (which knows recent members are not top-K members)."""
    policy = TopK(1, "loss", "min", last=3)
    assert policy.describe() == "top-1 by loss (min), 3 in all with the newest"
    with CheckpointManager(tmp_path / "run", streams={"ckpt": policy}) as mgr:
        for step, loss in [(1, 0.5), (2, 0.1), (3, None), (4, 0.7), (5, 0.9), (6, None)]:
            metrics = {} if loss is None else {"loss": loss}
            mgr.save(step, metrics=metrics, ckpt=state(float(step)))
        assert [c.step for c in mgr.checkpoints("ckpt")] == [2, 5, 6]
        assert [c.step for c in mgr.best("ckpt")] == [2, 5, 6]
        assert mgr.best("ckpt")[0].metric == 0.1
        assert mgr.check() == []
        with pytest.raises(InvalidMetricError):
            mgr.save(7, metrics={"loss": math.nan}, ckpt=state(7.0))
    with CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.policies["ckpt"] == policy


def test_a_keep_stream_can_become_best_and_recent_with_unscored_checkpoints(
    tmp_path: Path,
) -> None:
    """Re-ranking a stream whose checkpoints lack the metric is refused for a plain
    top-K, allowed for TopK(last=...): those checkpoints are simply never best."""
    with CheckpointManager(tmp_path / "run", streams={"ckpt": Keep(last=None)}) as mgr:
        mgr.save(1, ckpt=state(1.0))
        mgr.save(2, metrics={"loss": 0.3}, ckpt=state(2.0))
    with pytest.raises(InvalidArgumentError, match="without a finite"):
        CheckpointManager(tmp_path / "run", streams={"ckpt": TopK(1, "loss")})
    with CheckpointManager(tmp_path / "run", streams={"ckpt": TopK(1, "loss", last=2)}) as mgr:
        assert [(c.step, c.metric) for c in mgr.best("ckpt")] == [(2, 0.3), (1, None)]
        mgr.save(3, ckpt=state(3.0))
        assert [c.step for c in mgr.checkpoints("ckpt")] == [2, 3]
        assert mgr.check() == []


def test_check_finds_a_best_checkpoint_evicted_from_a_best_and_recent_stream(
    tmp_path: Path,
) -> None:
    """An eviction retention would never make (the best of the stream marked deleted
    while nothing ranks above it) is a finding; the recent member that outranks no
    one is not."""
    policy = TopK(1, "loss", "min", last=2)
    root = tmp_path / "run"
    with CheckpointManager(root, streams={"ckpt": policy}) as mgr:
        for step, loss in [(1, 0.1), (2, 0.5), (3, 0.6)]:
            mgr.save(step, metrics={"loss": loss}, ckpt=state(float(step)))
        assert mgr.check() == []
        best = mgr.best("ckpt")[0]
        LedgerClient(root).execute(
            "UPDATE checkpoints SET state = 'deleted', deleted_at = ? WHERE id = ?",
            "2999-01-01 00:00:00.000000",
            best.id,
        )
        best.path.unlink()
        assert any("step 1 was evicted while among the 1 best" in p for p in mgr.check())


def test_gc_of_a_keep_everything_best_and_recent_stream_keeps_everything(tmp_path: Path) -> None:
    """TopK(None, last=1) (everything, ranked; saves may omit the metric): gc evicts
    nothing, scored or not."""
    policy = TopK(None, "loss", last=1)
    assert policy.window_evictions([Entry(1, 1, None), Entry(2, 2, 0.5), Entry(3, 3, None)]) == []
    with CheckpointManager(tmp_path / "run", streams={"ckpt": policy}) as mgr:
        mgr.save(1, ckpt=state(1.0))
        mgr.save(2, metrics={"loss": 0.5}, ckpt=state(2.0))
        mgr.save(3, ckpt=state(3.0))
        assert mgr.gc() == []
        assert [c.step for c in mgr.checkpoints("ckpt")] == [1, 2, 3]


def test_dropping_last_from_a_topk_stream_with_unscored_checkpoints_is_refused(
    tmp_path: Path,
) -> None:
    """Without ``last`` every member must carry the metric: a stream holding
    checkpoints saved without it cannot become a plain top-K (saves would break)."""
    root = tmp_path / "run"
    with CheckpointManager(root, streams={"ckpt": TopK(1, "loss", last=2)}) as mgr:
        mgr.save(1, ckpt=state(1.0))
        mgr.save(2, metrics={"loss": 0.3}, ckpt=state(2.0))
    with pytest.raises(InvalidArgumentError, match="without a finite"):
        CheckpointManager(root, streams={"ckpt": TopK(1, "loss")})
    with CheckpointManager(root, streams={"ckpt": TopK(1, "loss", last=2)}) as mgr:
        assert [c.step for c in mgr.checkpoints("ckpt")] == [1, 2]


# ------------------------------------------- what a commit reads of a long history


@settings(max_examples=400, deadline=None)
@given(
    members=st.dictionaries(st.integers(0, 60), maybe_metrics, max_size=25),
    new_step=st.integers(0, 62),
    new_metric=metrics,
    policy=st.sampled_from(
        [
            Keep(last=1, every=5),
            Keep(last=3, every=2),
            Keep(last=2, every=10),
            Keep(last=None, every=3),
            Keep(last=None),
            Keep(last=4),
            TopK(None, "m"),
            TopK(None, "m", last=2),
            TopK(2, "m", last=3),
            TopK(3, "m"),
        ]
    ),
)
def test_the_rows_a_commit_reads_decide_the_same_evictions_as_all_rows(
    members: dict[int, float | None],
    new_step: int,
    new_metric: float,
    policy: Keep | TopK,
) -> None:
    """Why a commit may read only ``policy.reads(step)`` of a long history: the
    evictions it decides from those rows are exactly the ones all rows give."""
    committed = [
        Entry(
            id=100 + s,
            step=s,
            metric=v if policy.requires_metric is False or v is not None else 0.5,
        )
        for s, v in members.items()
    ]
    new = Entry(id=NEW_ID, step=new_step, metric=new_metric)
    read = policy.reads(new_step).select(committed, new_step)
    assert {e.id for e in policy.evictions(read, new)} == {
        e.id for e in policy.evictions(committed, new)
    }


def test_a_keep_every_stream_reads_only_what_it_can_evict(tmp_path: Path) -> None:
    """Keep(last=2, every=10): the kept multiples of 10 pile up, but a commit reads
    the newest two before it and the non-multiples (at most three), never the pile."""
    from ckptdb.ledger import rows as ledger_rows

    policy = Keep(last=2, every=10)
    with CheckpointManager(tmp_path / "run", streams={"model": policy}) as mgr:
        for step in range(1, 101):
            mgr.save(step, model=state(float(step)))
        kept = [c.step for c in mgr.checkpoints("model")]
        assert kept == [10, 20, 30, 40, 50, 60, 70, 80, 90, 99, 100]
        with mgr._ctx.ledger.transaction(read=True) as session:
            _, read = ledger_rows.committed_entries(
                session, mgr.run_id, "model", reads=policy.reads(101), step=101
            )
        assert sorted(e.step for e in read) == [99, 100]
        mgr.save(101, model=state(101.0))
        assert [c.step for c in mgr.checkpoints("model")] == [*kept[:-2], 100, 101]


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.integers(0, 8), min_size=1, max_size=10),
    last=st.integers(1, 3),
    every=st.none() | st.integers(2, 3),
    ranked=st.booleans(),
)
def test_a_replayed_window_keeps_what_the_stream_keeps(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[int],
    last: int,
    every: int | None,
    ranked: bool,
) -> None:
    """:func:`replayed_evictions` (how a remote tier applies a policy to its copies
    afterwards) keeps exactly what the stream's commits kept, resumes included."""
    policy = TopK(1, "loss", last=last) if ranked else Keep(last=last, every=every)
    root = tmp_path_factory.mktemp("replay")
    entries = []
    with CheckpointManager(root, streams={"model": policy}) as mgr:
        for i, step in enumerate(steps):
            loss = float((i * 7) % 5)
            saved = mgr.save(step, metrics={"loss": loss}, model=state(step))["model"]
            entries.append(Entry(id=saved.id, step=step, metric=loss))
        kept = {c.id for c in mgr.checkpoints("model")}
    evicted = {e.id for e in replayed_evictions(policy, entries)}
    assert {e.id for e in entries} - evicted == kept
