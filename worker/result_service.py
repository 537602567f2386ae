"""Answer one inference request through the result cache: L1, single-flight, L2, lease, compute.

``ResultService.answer(key, compute)``: ``key`` None (cache off, or the request opted out)
computes; otherwise, in order:

1. **L1** hit that XFetch does not pick for early refresh: answered (``hit_l1``).
2. **Single-flight**: identical requests in this worker wait for the first (``joined``).
3. The first one reads **L2** (``hit_l2``); on a miss it takes the key's **lease** in Redis,
   checks L2 again (the holder before it may just have written it) and computes; without the
   lease it waits, bounded, for the holder's value and then reads it, or computes itself.
4. **Compute** goes through admission (bounded concurrency and queue; :class:`Shed` beyond) and
   is written to L1 and L2. 200 answers live ``ttl_s`` plus jitter; 400 answers (deterministic
   request errors) ``negative_ttl_s``; errors (exceptions) are never cached.

What goes to L2 is sealed (``worker.result_cache.EntrySeal``: an HMAC under the deployment's key,
which Redis never sees); a value read back whose seal does not verify (forged, moved to another
key, written by a worker with another key, or from before sealing) is a miss, counted in
``pdparams_result_cache_l2_rejected_total`` and logged at most every 10 s, never served.

Redis is behind a circuit breaker: a failed or slow call counts against it and is treated as a
miss, so a dead Redis costs computation, never a failed request. An early refresh whose compute
is shed answers with the still-valid entry.
"""
from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from paramserver.wire.rate_limited_log import RateLimitedLog
from worker.admission import Admission, Shed
from worker.breaker import CircuitBreaker
from worker.errors import ConfigError
from worker.result_cache import CachedResult, EntrySeal, ResultCacheConfig, ResultL1, SingleFlight, xfetch_due
from worker.result_store import ResultStore
from worker.serve_metrics import ServeMetrics

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Computed:
    """What the model said: an HTTP status (200, or 400 for a request it cannot run) and a JSON object."""

    status: int
    body: bytes


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    outcome: str  # hit_l1, hit_l2, computed, joined


class ResultService:
    def __init__(self, config: ResultCacheConfig, admission: Admission, metrics: ServeMetrics,
                 store: ResultStore | None = None, *, clock: Callable[[], float] = time.time,
                 rand: Callable[[], float] = random.random, sleep: Callable[[float], None] = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic, request_timeout_s: float = 60.0) -> None:
        self.config = config.validate()
        self.admission = admission
        self.metrics = metrics
        self.store = store
        if store is not None and config.l2_key is None:
            raise ConfigError("an L2 result store needs the result cache key (--result-cache-key-file): entries are "
                              "authenticated with it")
        self.seal = EntrySeal(config.l2_key) if store is not None and config.l2_key is not None else None
        self._reject_log = RateLimitedLog(log)
        self.breaker = CircuitBreaker(config.breaker, monotonic, on_change=metrics.breaker_changed)
        self.l1 = ResultL1(config.l1_bytes, clock) if config.l1_bytes > 0 else None
        self.flights: SingleFlight[Answer] = SingleFlight()
        self._clock = clock
        self._rand = rand
        self._sleep = sleep
        self.request_timeout_s = request_timeout_s
        metrics.watch(lambda: admission.waiting, lambda: admission.running, lambda: self.l1.bytes if self.l1 else 0)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------ the request path

    def answer(self, key: str | None, compute: Callable[[], Computed]) -> Answer:
        if key is None or not self.config.enabled:
            return self._compute(None, compute, token=None)
        cached = self.l1.get(key) if self.l1 is not None else None
        if cached is not None and (self.flights.running(key) or not self._refresh_due(cached)):
            return Answer(cached.status, cached.body, "hit_l1")
        got, joined = self.flights.do(key, lambda: self._fill(key, compute, cached), self.request_timeout_s)
        return Answer(got.status, got.body, "joined") if joined else got

    def _refresh_due(self, entry: CachedResult) -> bool:
        return xfetch_due(entry, self._clock(), self.config.xfetch_beta, self._rand)

    def _fill(self, key: str, compute: Callable[[], Computed], stale: CachedResult | None) -> Answer:
        """The single-flight leader: L2, then the lease, then compute. ``stale``: a still-valid
        L1 entry XFetch picked for early refresh (answered if the refresh cannot run)."""
        if stale is None:
            hit = self._l2_get(key)
            if hit is not None:
                return hit
        token = secrets.token_hex(8)
        got_lease = self._acquire(key, token)
        if got_lease is False:  # another worker computes it now
            if stale is not None:
                return Answer(stale.status, stale.body, "hit_l1")  # it refreshes; this one stays valid meanwhile
            waited = self._wait_for_holder(key, token)
            if isinstance(waited, Answer):
                return waited
            got_lease = waited
        leased = bool(got_lease)
        try:
            if leased and stale is None:
                hit = self._l2_get(key)  # the holder before us may have written it just now
                if hit is not None:
                    return hit
            try:
                return self._compute(key, compute, token)
            except Shed:
                if stale is not None and stale.expires_at > self._clock():
                    return Answer(stale.status, stale.body, "hit_l1")
                raise
        finally:
            if leased:
                self._l2(lambda s: s.release(key, token), None)

    def _wait_for_holder(self, key: str, token: str) -> Answer | bool:
        """Another worker holds the lease: its value (an Answer), or True once we took the lease
        (the holder finished without writing, or its lease lapsed), or False when the wait ran out
        or Redis stopped answering (then compute without the lease)."""
        end = time.monotonic() + self.config.lease_wait_s
        pause = 0.002
        while time.monotonic() < end:
            self._sleep(pause)
            pause = min(0.05, pause * 2)
            hit = self._l2_get(key)
            if hit is not None:
                return hit
            got_lease = self._acquire(key, token)
            if got_lease is None:
                return False
            if got_lease:
                return True
        return False

    def _acquire(self, key: str, token: str) -> bool | None:
        """The key's lease: True taken, False held by another worker, None no Redis to ask."""
        return self._l2(lambda s: s.acquire(key, token, int(self.config.lease_s * 1000)), None)

    def _compute(self, key: str | None, compute: Callable[[], Computed], token: str | None) -> Answer:
        with self.admission.slot():
            started = time.monotonic()
            got = compute()
            took = time.monotonic() - started
        self.metrics.forward.inc()
        if key is not None:
            ttl = self._ttl_for(got.status)
            if ttl > 0 and len(got.body) <= self.config.max_entry_bytes:
                entry = CachedResult(got.status, got.body, took, self._clock() + ttl)
                if self.l1 is not None:
                    self.l1.put(key, entry)
                if self.seal is not None:
                    value = self.seal.seal(key, entry.encode())
                    self._l2(lambda s: s.set(key, value, entry.ttl_ms(self._clock())), None)
        return Answer(got.status, got.body, "computed")

    def _ttl_for(self, status: int) -> float:
        if status == 200:
            return self.config.ttl_s * (1.0 + self.config.ttl_jitter * self._rand())
        if status == 400:
            return self.config.negative_ttl_s
        return 0.0

    # ------------------------------------------------------------------ L2 behind the breaker

    def _l2_get(self, key: str) -> Answer | None:
        data = self._l2(lambda s: s.get(key), None)
        if data is None or self.seal is None:
            return None
        opened = self.seal.open(key, data)
        if opened is None:
            self._rejected(key)
            return None
        entry = CachedResult.decode(opened)
        if entry is None or entry.expires_at <= self._clock():
            return None
        if self.l1 is not None:
            self.l1.put(key, entry)
        return Answer(entry.status, entry.body, "hit_l2")

    def _rejected(self, key: str) -> None:
        """A value under ``key`` whose seal does not verify: counted, and logged at most every 10 s."""
        self.metrics.l2_rejected.inc()
        self._reject_log.warning(
            "l2_rejected", "result cache: an L2 entry failed its authentication and was not served (forged or altered "
            "in Redis, or written by a worker with another --result-cache-key-file) key=%s", key[:16])

    def _l2(self, call: Callable[[ResultStore], T], failed: T) -> T:
        """``call(store)`` when the breaker allows it; ``failed`` when it does not, or the call fails."""
        store = self.store
        if store is None or not self.breaker.allow():
            return failed
        started = time.monotonic()
        try:
            result = call(store)
        except Exception:  # noqa: BLE001 - any Redis failure is a miss; the breaker counts it
            self.breaker.failure()
            self.metrics.l2_errors.inc()
            return failed
        took = time.monotonic() - started
        self.breaker.record(True, took)
        if took > self.breaker.config.slow_s:
            self.metrics.l2_errors.inc()
        return result


__all__ = ["Answer", "Computed", "ResultService"]
