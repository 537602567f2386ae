"""Connection limits per source address and in total: who is admitted, and whom a newcomer pushes out.

A pure table (no sockets; the clock is injected) that every listening port's transport asks at
accept (``ConnectionTable.offer``) and tells when a connection has sent something useful
(``useful``) or has gone (``remove``). What "useful" means is the transport's: a call's HEADERS
frame on the gRPC port, a complete request on the HTTP ports.

The rule: one source address holds at most ``per_source`` connections, and the port at most
``total``. When a cap is reached, the oldest connection that has sent nothing useful yet (from the
same source for the per-source cap, from anyone for the total) is evicted so the newcomer gets in:
a flood of connections that only connect (or only send a handshake) pushes out its own, and a client
connecting during it is admitted. Useful connections are never evicted for a newcomer; when every
connection at a cap is useful, the newcomer is refused.
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

    Not thread-safe: one thread (a selector loop) or the caller's lock."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits.validate()
        self._clock = clock
        self._source: dict[K, str] = {}  # every open connection -> its source
        self._since: dict[K, float] = {}
        self._per_source: dict[str, int] = {}
        # Connections that have sent nothing useful, oldest first: overall, and by source.
        self._idle: OrderedDict[K, None] = OrderedDict()
        self._idle_by_source: dict[str, OrderedDict[K, None]] = {}
        self.refused = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._source)

    def __contains__(self, key: object) -> bool:
        return key in self._source

    def count(self, source: str) -> int:
        return self._per_source.get(source, 0)

    def idle_count(self) -> int:
        return len(self._idle)

    def is_useful(self, key: K) -> bool:
        return key in self._source and key not in self._idle

    def age(self, key: K) -> float:
        return self._clock() - self._since[key]

    def source_of(self, key: K) -> str | None:
        return self._source.get(key)

    def offer(self, key: K, source: str) -> Admission[K]:
        """Decide for a newly accepted connection; an admitted one is recorded (as not yet useful)."""
        if key in self._source:
            raise ValueError(f"connection {key!r} is already in the table")
        evict: list[K] = []
        reason = ""
        if self.count(source) >= self.limits.per_source:
            reason = "per_source"
            victim = self._oldest_idle(self._idle_by_source.get(source))
            if victim is None:
                self.refused += 1
                return Admission(False, (), reason)
            evict.append(victim)
        elif len(self._source) >= self.limits.total:
            reason = "total"
            victim = self._oldest_idle(self._idle)
            if victim is None:
                self.refused += 1
                return Admission(False, (), reason)
            evict.append(victim)
        for victim in evict:
            self.remove(victim)
            self.evicted += 1
        self._source[key] = source
        self._since[key] = self._clock()
        self._per_source[source] = self.count(source) + 1
        self._idle[key] = None
        self._idle_by_source.setdefault(source, OrderedDict())[key] = None
        return Admission(True, tuple(evict), reason)

    def useful(self, key: K) -> None:
        """``key`` has sent something useful: from now on it is never evicted for a newcomer."""
        source = self._source.get(key)
        if source is None or key not in self._idle:
            return
        del self._idle[key]
        self._drop_idle_of(source, key)

    def remove(self, key: K) -> None:
        """``key`` is closed (or evicted); unknown keys are ignored (a close after an eviction)."""
        source = self._source.pop(key, None)
        if source is None:
            return
        del self._since[key]
        left = self._per_source[source] - 1
        if left:
            self._per_source[source] = left
        else:
            del self._per_source[source]
        if self._idle.pop(key, False) is None:
            self._drop_idle_of(source, key)

    def _drop_idle_of(self, source: str, key: K) -> None:
        mine = self._idle_by_source.get(source)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._idle_by_source[source]

    @staticmethod
    def _oldest_idle(idle: OrderedDict[K, None] | None) -> K | None:
        return next(iter(idle), None) if idle else None


__all__ = ["Admission", "ConnectionLimits", "ConnectionTable", "MAX_CONNECTIONS_LIMIT"]
