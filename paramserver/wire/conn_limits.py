"""Connection limits per source address and in total: who is admitted, and whom a newcomer pushes out.

A pure table (no sockets; the clock is injected) that every listening port's transport asks at
accept (``ConnectionTable.offer``), tells when a connection has sent something useful (``useful``),
and tells when one has gone (``remove``). What "useful" means is the transport's: a call's HEADERS
frame on the gRPC port, a complete request on the HTTP ports.

The rule:
- the port holds at most ``total`` connections. At that cap a newcomer is admitted by evicting a
  connection that has sent nothing useful yet: the oldest such connection of the source that holds
  the most of them. Useful connections are never evicted for a newcomer; when every connection is
  useful, the newcomer is refused.
- one source address holds at most ``per_source`` useful connections: a newcomer from a source at
  that cap is refused, and a connection whose first useful bytes would take its source past it is
  refused then (the transport closes it).

Why connections that have sent nothing count against the total only: a flood of them from one
address then takes turns in the whole table, not in one source's share, so a client from the same
address that connects during the flood has ``total`` newer arrivals' time (not ``per_source``) to
make its first call before it could be the one evicted; and the flooding source, holding the most
idle connections, is the one whose connections give way to anyone else's.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from paramserver.wire.errors import ConfigError

K = TypeVar("K", bound=Hashable)

MAX_CONNECTIONS_LIMIT = 1 << 20


@dataclass(frozen=True)
class ConnectionLimits:
    """``per_source``: connections one client address may hold; ``total``: connections the port holds."""

    per_source: int = 256
    total: int = 4096

    def validate(self) -> ConnectionLimits:
        if not 1 <= self.total <= MAX_CONNECTIONS_LIMIT:
            raise ConfigError(f"the connection limit (total) must be 1..{MAX_CONNECTIONS_LIMIT}, got {self.total}")
        if not 1 <= self.per_source <= MAX_CONNECTIONS_LIMIT:
            raise ConfigError(f"the connection limit per source address must be 1..{MAX_CONNECTIONS_LIMIT}, "
                              f"got {self.per_source}")
        return self

    def within(self, total: int) -> ConnectionLimits:
        """These limits with the total at most ``total`` (an open-file budget), per source at most the total."""
        capped = max(1, min(self.total, total))
        return ConnectionLimits(min(self.per_source, capped), capped)


@dataclass(frozen=True)
class Admission(Generic[K]):
    """``admit``: the newcomer is in (recorded as not yet useful); ``evict``: connections the transport
    must close first (already forgotten by the table); ``reason``: the cap that was reached, if any
    ("per_source" or "total")."""

    admit: bool
    evict: tuple[K, ...] = ()
    reason: str = ""


class ConnectionTable(Generic[K]):
    """Open connections by key (whatever the transport names a connection by) and source address.

    Not thread-safe: one thread (a selector loop) or the caller's lock. Every operation is O(1)."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits.validate()
        self._clock = clock
        self._source: dict[K, str] = {}  # every open connection -> its source
        self._since: dict[K, float] = {}
        self._per_source: dict[str, int] = {}
        self._useful_by_source: dict[str, int] = {}
        # Connections that have sent nothing useful, oldest first, by source; and the sources by how
        # many such connections they hold (count -> sources), to find the largest holder at once.
        self._idle: dict[str, OrderedDict[K, None]] = {}
        self._by_idle_count: dict[int, dict[str, None]] = {}
        self._most_idle = 0
        self._idle_total = 0
        self.refused = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, key: object) -> bool:
        return key in self._source

    def count(self, source: str) -> int:
        return self._per_source.get(source, 0)

    def useful_count(self, source: str) -> int:
        return self._useful_by_source.get(source, 0)

    def idle_count(self) -> int:
        return self._idle_total

    def is_useful(self, key: K) -> bool:
        source = self._source.get(key)
        return source is not None and key not in self._idle.get(source, ())

    def age(self, key: K) -> float:
        return self._clock() - self._since[key]

    def source_of(self, key: K) -> str | None:
        return self._source.get(key)

    def offer(self, key: K, source: str) -> Admission[K]:
        """Decide for a newly accepted connection; an admitted one is recorded (as not yet useful)."""
        if key in self._source:
            raise ValueError(f"connection {key!r} is already in the table")
        if self.useful_count(source) >= self.limits.per_source:
            self.refused += 1
            return Admission(False, (), "per_source")
        evict: tuple[K, ...] = ()
        reason = ""
        if len(self._source) >= self.limits.total:
            reason = "total"
            if not self._most_idle:
                self.refused += 1
                return Admission(False, (), reason)
            biggest = next(iter(self._by_idle_count[self._most_idle]))
            victim = next(iter(self._idle[biggest]))
            self.remove(victim)
            self.evicted += 1
            evict = (victim,)
        self._source[key] = source
        self._since[key] = self._clock()
        self._per_source[source] = self.count(source) + 1
        self._add_idle(source, key)
        return Admission(True, evict, reason)

    def useful(self, key: K) -> bool:
        """``key`` has sent something useful: from now on it is never evicted for a newcomer. False:
        its source already holds ``per_source`` useful connections, so it is refused (forgotten
        here; the transport closes it). Unknown keys (closed already) and repeats are True."""
        source = self._source.get(key)
        if source is None or key not in self._idle.get(source, ()):
            return True
        if self.useful_count(source) >= self.limits.per_source:
            self.remove(key)
            self.refused += 1
            return False
        self._drop_idle(source, key)
        self._useful_by_source[source] = self.useful_count(source) + 1
        return True

    def remove(self, key: K) -> None:
        """``key`` is closed (or evicted); unknown keys are ignored (a close after an eviction)."""
        source = self._source.pop(key, None)
        if source is None:
            return
        del self._since[key]
        _decrement(self._per_source, source)
        if key in self._idle.get(source, ()):
            self._drop_idle(source, key)
        else:
            _decrement(self._useful_by_source, source)

    def _add_idle(self, source: str, key: K) -> None:
        mine = self._idle.setdefault(source, OrderedDict())
        self._move(source, len(mine), len(mine) + 1)
        mine[key] = None
        self._idle_total += 1

    def _drop_idle(self, source: str, key: K) -> None:
        mine = self._idle[source]
        del mine[key]
        self._move(source, len(mine) + 1, len(mine))
        if not mine:
            del self._idle[source]
        self._idle_total -= 1

    def _move(self, source: str, old: int, new: int) -> None:
        """``source`` now holds ``new`` idle connections instead of ``old``: keep the buckets and the maximum."""
        if old:
            bucket = self._by_idle_count[old]
            del bucket[source]
            if not bucket:
                del self._by_idle_count[old]
        if new:
            self._by_idle_count.setdefault(new, {})[source] = None
        if new > self._most_idle:
            self._most_idle = new
        elif old == self._most_idle and old not in self._by_idle_count:
            self._most_idle = new  # counts move by one: the next largest is ``new`` (or none)


def _decrement(counts: dict[str, int], source: str) -> None:
    left = counts[source] - 1
    if left:
        counts[source] = left
    else:
        del counts[source]


__all__ = ["Admission", "ConnectionLimits", "ConnectionTable", "MAX_CONNECTIONS_LIMIT"]
