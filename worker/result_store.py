"""The result cache's shared tier (L2): values with a TTL and short compute leases, in Redis.

:class:`RedisResultStore` talks to a real ``redis-server``; :class:`MemoryResultStore` keeps the
same semantics in a dict with an injected clock, for tests of the cache logic without sockets.
Errors are not handled here: the caller wraps every call in its circuit breaker.

Values are stored as given: the caller seals them (``worker.result_cache.EntrySeal``), since
whoever can write to this Redis can write any value. ``rediss://`` URLs talk TLS (a private CA:
``?ssl_ca_certs=/path/ca.pem``); the AUTH password comes from a file, never the command line.

A lease is ``SET lease:KEY TOKEN NX PX ms``; it is released only by its holder (a compare-and-
delete script), so a worker whose lease expired cannot delete the next holder's.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

VALUE_PREFIX = "pdparams:result:"
LEASE_PREFIX = "pdparams:lease:"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class ResultStore(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl_ms: int) -> None: ...

    def acquire(self, key: str, token: str, ttl_ms: int) -> bool: ...

    def release(self, key: str, token: str) -> None: ...

    def close(self) -> None: ...


class RedisResultStore:
    """Thread-safe (redis-py's connection pool). ``timeout_s`` bounds connecting and every reply."""

    def __init__(self, url: str, timeout_s: float = 0.5, max_connections: int = 128, password: str | None = None) -> None:
        import redis

        # ``password``: Redis AUTH (read from a file by the CLI); with rediss:// it travels over TLS.
        extra: dict[str, Any] = {} if password is None else {"password": password}
        self._pool = redis.ConnectionPool.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
            retry_on_timeout=False, health_check_interval=0, **extra,
        )
        self._redis = redis.Redis(connection_pool=self._pool)
        self._release = self._redis.register_script(_RELEASE)
        self.url = url

    def get(self, key: str) -> bytes | None:
        value: Any = self._redis.get(VALUE_PREFIX + key)
        return bytes(value) if value is not None else None

    def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        self._redis.set(VALUE_PREFIX + key, value, px=max(1, ttl_ms))

    def acquire(self, key: str, token: str, ttl_ms: int) -> bool:
        return bool(self._redis.set(LEASE_PREFIX + key, token, nx=True, px=max(1, ttl_ms)))

    def release(self, key: str, token: str) -> None:
        self._release(keys=[LEASE_PREFIX + key], args=[token])

    def close(self) -> None:
        self._pool.disconnect()


class MemoryResultStore:
    """The same semantics in process memory; ``down = True`` makes every call fail like a dead Redis."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, tuple[bytes, float]] = {}
        self.down = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("result store down (test)")

    def _live(self, name: str) -> bytes | None:
        item = self._data.get(name)
        if item is None:
            return None
        if item[1] <= self._clock():
            del self._data[name]
            return None
        return item[0]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self._check()
            return self._live(VALUE_PREFIX + key)

    def set(self, key: str, value: bytes, ttl_ms: int) -> None:
        with self._lock:
            self._check()
            self._data[VALUE_PREFIX + key] = (bytes(value), self._clock() + max(1, ttl_ms) / 1000)

    def acquire(self, key: str, token: str, ttl_ms: int) -> bool:
        with self._lock:
            self._check()
            if self._live(LEASE_PREFIX + key) is not None:
                return False
            self._data[LEASE_PREFIX + key] = (token.encode(), self._clock() + max(1, ttl_ms) / 1000)
            return True

    def release(self, key: str, token: str) -> None:
        with self._lock:
            self._check()
            if self._live(LEASE_PREFIX + key) == token.encode():
                del self._data[LEASE_PREFIX + key]

    def close(self) -> None:
        pass


__all__ = ["LEASE_PREFIX", "MemoryResultStore", "RedisResultStore", "ResultStore", "VALUE_PREFIX"]
