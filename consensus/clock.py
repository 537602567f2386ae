"""Vector clocks that order model versions (docs/architecture.md, invariant 4)."""
from __future__ import annotations

import enum
from typing import Iterator, Mapping

from .errors import Invalid


class Ordering(enum.Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


class VectorClock(Mapping[str, int]):
    """An immutable map publisher -> counter. Missing publishers count as 0.

    Zero entries are dropped on construction so that ``{"a": 0}`` and ``{}``
    are the same clock (they compare EQUAL and hash alike).
    """

    __slots__ = ("_counters",)

    def __init__(self, counters: Mapping[str, int] | None = None) -> None:
        clean: dict[str, int] = {}
        for publisher, counter in (counters or {}).items():
            if not isinstance(publisher, str) or not publisher:
                raise Invalid(f"vector clock publisher must be a non-empty string, got {publisher!r}")
            if isinstance(counter, bool) or not isinstance(counter, int) or counter < 0:
                raise Invalid(f"vector clock counter for {publisher!r} must be an int >= 0, got {counter!r}")
            if counter:
                clean[publisher] = counter
        self._counters = dict(sorted(clean.items()))

    def __getitem__(self, publisher: str) -> int:
        return self._counters[publisher]

    def get(self, publisher: str, default: int | None = 0) -> int | None:  # type: ignore[override]
        return self._counters.get(publisher, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._counters)

    def __len__(self) -> int:
        return len(self._counters)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VectorClock):
            return self._counters == other._counters
        if isinstance(other, Mapping):
            return self._counters == VectorClock(other)._counters
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._counters.items()))

    def __repr__(self) -> str:
        return f"VectorClock({self._counters!r})"

    def compare(self, other: Mapping[str, int]) -> Ordering:
        """How ``self`` relates to ``other`` in happened-before order."""
        other_clock = other if isinstance(other, VectorClock) else VectorClock(other)
        less = greater = False
        for publisher in self._counters.keys() | other_clock._counters.keys():
            mine = self._counters.get(publisher, 0)
            theirs = other_clock._counters.get(publisher, 0)
            if mine < theirs:
                less = True
            elif mine > theirs:
                greater = True
        if less and greater:
            return Ordering.CONCURRENT
        if less:
            return Ordering.BEFORE
        if greater:
            return Ordering.AFTER
        return Ordering.EQUAL

    def merge(self, other: Mapping[str, int]) -> VectorClock:
        """The least clock that is at or after both."""
        merged = dict(self._counters)
        for publisher, counter in VectorClock(other)._counters.items():
            merged[publisher] = max(merged.get(publisher, 0), counter)
        return VectorClock(merged)

    def increment(self, publisher: str) -> VectorClock:
        """A clock strictly after this one: ``publisher`` made one more version."""
        counters = dict(self._counters)
        counters[publisher] = counters.get(publisher, 0) + 1
        return VectorClock(counters)

    def to_dict(self) -> dict[str, int]:
        return dict(self._counters)

    @classmethod
    def from_dict(cls, data: Mapping[str, int]) -> VectorClock:
        return cls(data)
