"""Which chunks are hot: decayed read rates (``RateTracker``) and the hot set with hysteresis
(``HotPolicy``). Pure: the clock is injected, nothing touches the store or the network."""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class RateTracker:
    """Decayed read counts per chunk: each read adds 1, the count decays as exp(-t / tau).

    ``rate()`` is the count over tau, in reads per second (a steady rate converges to it). At most
    ``max_entries`` chunks are tracked: past that, the coldest half is forgotten (amortised O(1)
    per read). Thread-safe; the clock is injected."""

    def __init__(self, tau_s: float, max_entries: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        if tau_s <= 0 or max_entries < 2:
            raise ValueError("tau_s must be > 0 and max_entries >= 2")
        self.tau_s = tau_s
        self.max_entries = max_entries
        self.clock = clock
        self._counts: dict[str, tuple[float, float]] = {}  # id -> (count, at)
        self._lock = threading.Lock()
        self.reads = 0
        self.evicted = 0

    def record(self, chunk_id: str, reads: int = 1) -> None:
        now = self.clock()
        with self._lock:
            self.reads += reads
            found = self._counts.get(chunk_id)
            count = reads if found is None else found[0] * math.exp(-(now - found[1]) / self.tau_s) + reads
            self._counts[chunk_id] = (count, now)
            if found is None and len(self._counts) > self.max_entries:
                self._evict_locked(now)

    def _evict_locked(self, now: float) -> None:
        decayed = sorted(((c * math.exp(-(now - at) / self.tau_s), cid) for cid, (c, at) in self._counts.items()), reverse=True)
        keep = decayed[: self.max_entries // 2]
        self.evicted += len(decayed) - len(keep)
        self._counts = {cid: (c, now) for c, cid in keep}

    def rate(self, chunk_id: str) -> float:
        now = self.clock()
        with self._lock:
            found = self._counts.get(chunk_id)
        if found is None:
            return 0.0
        return found[0] * math.exp(-(now - found[1]) / self.tau_s) / self.tau_s

    def rates(self, min_rate: float = 0.0) -> dict[str, float]:
        """Every tracked chunk's rate of at least ``min_rate``; forgets those that decayed to nothing."""
        now = self.clock()
        out: dict[str, float] = {}
        floor = min(min_rate, 1e-3) * self.tau_s
        with self._lock:
            dead = []
            for cid, (count, at) in self._counts.items():
                c = count * math.exp(-(now - at) / self.tau_s)
                if c < floor:
                    dead.append(cid)
                r = c / self.tau_s
                if r >= min_rate:
                    out[cid] = r
            for cid in dead:
                del self._counts[cid]
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


@dataclass
class _Hot:
    size: int
    since: float
    below_since: float | None = None


@dataclass(frozen=True)
class HotUpdate:
    added: tuple[str, ...]
    cooled: tuple[str, ...]


class HotPolicy:
    """Which chunks are hot, from their rates. Pure: the caller passes the rates and the clock.

    A chunk becomes hot at ``hot_rate`` if the bounds allow (``max_chunks`` and ``max_bytes``,
    hottest first; a hot chunk is not displaced by a hotter one), and cools once its rate stayed
    below ``cool_rate`` for ``cool_s`` -- or at once when ``owned`` says this server no longer
    holds it as a ring replica."""

    def __init__(self, hot_rate: float, cool_rate: float, cool_s: float, *, max_chunks: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < cool_rate <= hot_rate:
            raise ValueError("need 0 < cool_rate <= hot_rate")
        self.hot_rate, self.cool_rate, self.cool_s = hot_rate, cool_rate, cool_s
        self.max_chunks, self.max_bytes = max_chunks, max_bytes
        self.clock = clock
        self._hot: dict[str, _Hot] = {}
        self._bytes = 0

    @property
    def hot(self) -> dict[str, int]:
        """Hot chunk id -> its stored size."""
        return {cid: h.size for cid, h in self._hot.items()}

    @property
    def hot_bytes(self) -> int:
        return self._bytes

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._hot

    def update(self, rates: Mapping[str, float], size_of: Callable[[str], int | None],
               owned: Callable[[str], bool] = lambda _cid: True) -> HotUpdate:
        """``rates``: chunk id -> reads/s (missing: 0); ``size_of``: stored size, None when not held here."""
        now = self.clock()
        cooled: list[str] = []
        for cid, h in list(self._hot.items()):
            if not owned(cid):
                cooled.append(cid)
                continue
            if rates.get(cid, 0.0) >= self.cool_rate:
                h.below_since = None
            elif h.below_since is None:
                h.below_since = now
            elif now - h.below_since >= self.cool_s:
                cooled.append(cid)
        for cid in cooled:
            self._bytes -= self._hot.pop(cid).size
        added: list[str] = []
        for cid, rate in sorted(rates.items(), key=lambda kv: (-kv[1], kv[0])):
            if rate < self.hot_rate:
                break
            if cid in self._hot or len(self._hot) >= self.max_chunks or not owned(cid):
                continue
            size = size_of(cid)
            if size is None or self._bytes + size > self.max_bytes:
                continue
            self._hot[cid] = _Hot(size, now)
            self._bytes += size
            added.append(cid)
        return HotUpdate(tuple(added), tuple(cooled))
