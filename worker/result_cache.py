"""The inference result cache's parts: keys, the stored entry, the L1 tier, single-flight, XFetch.

- **Key**: SHA-256 over the loaded version's model fingerprint (from its manifest: it covers the
  weights' bytes and layout, so a tag move can never find the old version's results), the
  SHA-256 of the canonical JSON of the request (every field but ``cache``), and the runtime
  parameters that change the output (dtype, device type, the module factory) as canonical JSON.
- **Entry** (:class:`CachedResult`): status, the result's JSON bytes, how long computing it took
  (XFetch's delta) and when it expires (wall clock, so workers sharing Redis agree).
- **Seal** (:class:`EntrySeal`): what goes to L2 carries an HMAC-SHA256 under a key the workers
  of a deployment share and Redis never sees, over the entry and the key it is stored under. A
  Redis (or anyone who can write to it) cannot make a worker serve a value it did not compute, nor
  move a real entry to another request's key: such an entry is a miss.
- **L1** (:class:`ResultL1`): in-process, bounded in bytes, LRU-2 admission (``worker.lru_k``):
  a key seen once is evicted before any key seen twice, so a scan of one-off requests cannot
  flush the hot set. L1 holds the entries themselves; only L2 holds their encoded bytes.
- **Single-flight** (:class:`SingleFlight`): identical concurrent requests in one worker share
  one computation.
- **XFetch** (:func:`xfetch_due`, Vattani, Chierichetti and Lowenstein, VLDB 2015): a hit
  recomputes early with a probability that grows as expiry nears, scaled by the computation's
  cost, so a hot key is refreshed by one request before it expires instead of by all at once.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import random
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from worker.breaker import BreakerConfig
from worker.errors import ConfigError
from worker.lru_k import LRUKCache

MIB = 1 << 20
KEY_DOMAIN = b"pdparams-result-v1\n"
_ENTRY = struct.Struct("!4sHdd")  # magic, HTTP status, delta seconds, expires at (unix seconds)
_MAGIC = b"PDR1"
_SEALED = b"PDA1"  # an L2 value: this, the HMAC-SHA256 tag, then the entry
MAC_DOMAIN = b"pdparams-result-mac-v1\n"
MIN_KEY_BYTES = 32

T = TypeVar("T")


@dataclass(frozen=True)
class ResultCacheConfig:
    """``l1_bytes`` 0 turns L1 off; ``redis_url`` None turns L2 off (the defaults need no Redis)."""

    l1_bytes: int = 64 * MIB
    ttl_s: float = 300.0
    ttl_jitter: float = 0.1  # each entry lives ttl_s * (1 + U(0, ttl_jitter)): no avalanche of expiries
    negative_ttl_s: float = 5.0  # 400 answers (deterministic request errors); 5xx are never cached
    max_entry_bytes: int = 8 * MIB
    redis_url: str | None = None
    redis_timeout_s: float = 0.5
    lease_s: float = 10.0  # how long one worker's right to compute a key lasts in Redis
    lease_wait_s: float = 5.0  # how long others wait for that result before computing themselves
    xfetch_beta: float = 1.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # Secrets, never in a repr: the key L2 entries are authenticated with (required with L2), and
    # the Redis AUTH password (else none, or the one in a URL given through the environment).
    l2_key: bytes | None = field(default=None, repr=False)
    redis_password: str | None = field(default=None, repr=False)

    @property
    def enabled(self) -> bool:
        return self.l1_bytes > 0 or self.redis_url is not None

    def validate(self) -> ResultCacheConfig:
        if self.l1_bytes < 0:
            raise ConfigError(f"l1_bytes must be >= 0 (0 turns the in-process cache off), got {self.l1_bytes}")
        if not 0 < self.ttl_s <= 30 * 86400:
            raise ConfigError(f"ttl_s must be in (0, 30 days], got {self.ttl_s}")
        if not 0 <= self.ttl_jitter <= 1:
            raise ConfigError(f"ttl_jitter must be in [0, 1], got {self.ttl_jitter}")
        if not 0 <= self.negative_ttl_s <= 3600:
            raise ConfigError(f"negative_ttl_s must be in [0, 3600] (0: do not cache request errors), got {self.negative_ttl_s}")
        if not 1 <= self.max_entry_bytes <= 512 * MIB:
            raise ConfigError(f"max_entry_bytes must be 1 B..512 MiB, got {self.max_entry_bytes}")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--result-cache-redis {self.redis_url!r} must be a redis://HOST:PORT/DB (or rediss://, unix://) URL")
        if self.redis_url is not None and self.l2_key is None:
            raise ConfigError("--result-cache-redis needs --result-cache-key-file FILE (or PARAMS_RESULT_CACHE_KEY_FILE): the "
                              "key the deployment's workers share, and Redis never sees, that L2 entries are authenticated "
                              "with; make one with python3 -c 'import os; print(os.urandom(32).hex())' > FILE; "
                              "chmod 600 FILE")
        if self.l2_key is not None and len(self.l2_key) < MIN_KEY_BYTES:
            raise ConfigError(f"--result-cache-key-file: the key is {len(self.l2_key)} bytes, fewer than {MIN_KEY_BYTES}; write a longer "
                              "random one, e.g. python3 -c 'import os; print(os.urandom(32).hex())'")
        for name in ("redis_timeout_s", "lease_s", "lease_wait_s"):
            value = getattr(self, name)
            if not 0 < value <= 600:
                raise ConfigError(f"{name} must be in (0, 600] seconds, got {value}")
        if not 0 <= self.xfetch_beta <= 100:
            raise ConfigError(f"xfetch_beta must be in [0, 100] (0: no early refresh), got {self.xfetch_beta}")
        self.breaker.validate()
        return self


def canonical_json(value: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no spaces, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def result_key(fingerprint: str, request: Mapping[str, Any], params: Mapping[str, Any]) -> str:
    """The cache key of ``request`` answered by the version with this model fingerprint."""
    h = hashlib.sha256(KEY_DOMAIN)
    h.update(fingerprint.encode() + b"\n")
    h.update(hashlib.sha256(canonical_json(dict(request))).digest())
    h.update(canonical_json(dict(params)))
    return h.hexdigest()


@dataclass(frozen=True)
class CachedResult:
    status: int
    body: bytes  # a JSON object
    delta_s: float  # how long computing it took
    expires_at: float  # unix seconds

    def encode(self) -> bytes:
        return _ENTRY.pack(_MAGIC, self.status, self.delta_s, self.expires_at) + self.body

    @classmethod
    def decode(cls, data: bytes) -> CachedResult | None:
        """None for bytes that are not an entry (a foreign value under our key is a miss, not a crash)."""
        if len(data) < _ENTRY.size:
            return None
        magic, status, delta, expires = _ENTRY.unpack_from(data)
        if magic != _MAGIC or not 100 <= status <= 599 or not (math.isfinite(delta) and math.isfinite(expires)):
            return None
        return cls(status, bytes(data[_ENTRY.size:]), max(0.0, delta), expires)

    @property
    def nbytes(self) -> int:
        return _ENTRY.size + len(self.body)

    def ttl_ms(self, now: float) -> int:
        return max(1, int((self.expires_at - now) * 1000))


class EntrySeal:
    """Authenticates L2 values: ``seal`` prefixes an HMAC-SHA256 tag over the cache key and the
    encoded entry; ``open`` returns the entry only when the tag matches (constant-time compare)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ConfigError(f"the result cache key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:
        return "EntrySeal(<key>)"

    def _tag(self, cache_key: str, entry: bytes) -> bytes:
        # The key is bound in, so a real entry copied under another request's key does not verify.
        return hmac.new(self._key, MAC_DOMAIN + cache_key.encode() + b"\n" + entry, hashlib.sha256).digest()

    def seal(self, cache_key: str, entry: bytes) -> bytes:
        return _SEALED + self._tag(cache_key, entry) + entry

    def open(self, cache_key: str, data: bytes) -> bytes | None:
        """The entry, or None when ``data`` is not a value sealed under this key for ``cache_key``."""
        head = len(_SEALED) + hashlib.sha256().digest_size
        if len(data) < head or not data.startswith(_SEALED):
            return None
        entry = bytes(data[head:])
        return entry if hmac.compare_digest(data[len(_SEALED):head], self._tag(cache_key, entry)) else None


def xfetch_due(entry: CachedResult, now: float, beta: float, rand: Callable[[], float] = random.random) -> bool:
    """True when this hit should recompute: ``now - delta * beta * ln(U) >= expiry``, U in (0, 1]."""
    if now >= entry.expires_at:
        return True
    if beta <= 0 or entry.delta_s <= 0:
        return False
    u = 1.0 - rand()  # (0, 1]: log never sees 0
    return now - entry.delta_s * beta * math.log(u) >= entry.expires_at


class ResultL1:
    """In-process result cache under a byte budget; expired entries are dropped when read."""

    def __init__(self, capacity_bytes: int, clock: Callable[[], float]) -> None:
        # No correlated-reference period: repeats of one request are exactly the signal we want.
        self._cache = LRUKCache(capacity_bytes, k=2, correlated_reference_period=0.0, max_retained_history=200_000)
        self._clock = clock

    def get(self, key: str) -> CachedResult | None:
        entry: CachedResult | None = self._cache.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            self._cache.pop(key)
            return None
        return entry

    def put(self, key: str, entry: CachedResult) -> bool:
        # The entry itself (no encoding: a hit is not decoded again), charged at its stored size.
        return self._cache.put(key, entry, size=entry.nbytes)

    @property
    def bytes(self) -> int:
        return self._cache.bytes

    def __len__(self) -> int:
        return len(self._cache)


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None
        self.joined = 0


class SingleFlight(Generic[T]):
    """``do(key, fn, timeout)``: the first caller for a key runs ``fn``; callers that arrive while
    it runs wait for its value (or its exception). Returns ``(value, joined)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight[T]] = {}

    def running(self, key: str) -> bool:
        with self._lock:
            return key in self._flights

    def __len__(self) -> int:
        with self._lock:
            return len(self._flights)

    def do(self, key: str, fn: Callable[[], T], timeout: float) -> tuple[T, bool]:
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
            else:
                flight.joined += 1
        if not leader:
            if not flight.done.wait(timeout):
                raise TimeoutError(f"an identical request has been computing for more than {timeout:g} s")
            if flight.error is not None:
                raise flight.error
            return flight.value, True  # type: ignore[return-value]  # set before done, never None for a value
        try:
            flight.value = fn()
            return flight.value, False
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()


__all__ = ["CachedResult", "EntrySeal", "MIN_KEY_BYTES", "ResultCacheConfig", "ResultL1", "SingleFlight", "canonical_json",
           "result_key", "xfetch_due"]
