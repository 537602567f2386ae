from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from consensus.clock import Ordering, VectorClock
from consensus.errors import Invalid

publishers = st.sampled_from(["alice", "bob", "carol", "dave"])
clocks = st.dictionaries(publishers, st.integers(min_value=0, max_value=5), max_size=4).map(VectorClock)

OPPOSITE = {
    Ordering.BEFORE: Ordering.AFTER,
    Ordering.AFTER: Ordering.BEFORE,
    Ordering.EQUAL: Ordering.EQUAL,
    Ordering.CONCURRENT: Ordering.CONCURRENT,
}


@given(clocks, clocks)
def test_compare_is_antisymmetric(a: VectorClock, b: VectorClock) -> None:
    assert b.compare(a) is OPPOSITE[a.compare(b)]


@given(clocks, clocks)
def test_equal_exactly_when_same_counters(a: VectorClock, b: VectorClock) -> None:
    assert (a.compare(b) is Ordering.EQUAL) == (a == b)


@given(clocks, clocks)
def test_merge_is_commutative(a: VectorClock, b: VectorClock) -> None:
    assert a.merge(b) == b.merge(a)


@given(clocks, clocks, clocks)
def test_merge_is_associative(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    assert a.merge(b).merge(c) == a.merge(b.merge(c))


@given(clocks)
def test_merge_is_idempotent(a: VectorClock) -> None:
    assert a.merge(a) == a


@given(clocks, clocks)
def test_merge_is_at_or_after_both(a: VectorClock, b: VectorClock) -> None:
    merged = a.merge(b)
    assert merged.compare(a) in (Ordering.AFTER, Ordering.EQUAL)
    assert merged.compare(b) in (Ordering.AFTER, Ordering.EQUAL)


@given(clocks, publishers)
def test_increment_is_after(a: VectorClock, publisher: str) -> None:
    bumped = a.increment(publisher)
    assert bumped.compare(a) is Ordering.AFTER
    assert a.compare(bumped) is Ordering.BEFORE
    assert bumped[publisher] == a.get(publisher, 0) + 1


@given(clocks, publishers, publishers)
def test_independent_increments_are_concurrent(a: VectorClock, p: str, q: str) -> None:
    if p != q:
        assert a.increment(p).compare(a.increment(q)) is Ordering.CONCURRENT


@given(clocks)
def test_dict_round_trip(a: VectorClock) -> None:
    assert VectorClock.from_dict(a.to_dict()) == a
    assert hash(VectorClock.from_dict(a.to_dict())) == hash(a)


def test_zero_entries_do_not_matter() -> None:
    assert VectorClock({"a": 0}) == VectorClock()
    assert VectorClock({"a": 0, "b": 1}).to_dict() == {"b": 1}
    assert VectorClock({"a": 1}) == {"a": 1, "b": 0}


def test_immutable() -> None:
    clock = VectorClock({"a": 1})
    clock.increment("a")
    clock.merge({"a": 5})
    assert clock.to_dict() == {"a": 1}
    with pytest.raises(TypeError):
        clock["a"] = 2  # type: ignore[index]


@pytest.mark.parametrize("bad", [{"a": -1}, {"": 1}, {"a": 1.5}, {"a": True}, {3: 1}])
def test_rejects_bad_counters(bad: dict) -> None:
    with pytest.raises(Invalid):
        VectorClock(bad)
