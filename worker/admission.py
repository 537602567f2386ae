"""Admission control for forward passes: bounded concurrency, a bounded queue, load shedding.

At most ``max_concurrency`` forward passes run at once; at most ``max_queue`` requests wait for
a slot, each at most ``queue_timeout_s``. A request beyond the queue, or one that waited too
long, is shed at once with :class:`Shed` (the HTTP layer answers 503 with ``Retry-After``), so
an overload costs a quick refusal instead of a pile of threads and memory.

:class:`ByteBudget` bounds the bytes of request bodies read and parsed at once, across all
connections (bodies arrive before a forward slot is asked for, so admission alone does not).
"""
from __future__ import annotations

import math
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from worker.errors import ConfigError, Shed  # Shed: re-exported, its home is worker.errors

_TOO_MANY = b'{"error":"overloaded: too many open connections; retry later"}'
# The whole answer to a connection past a server's connection cap (paramworker serve, paramrouter),
# written before any request is read, then the connection is closed.
TOO_MANY_CONNECTIONS = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: " + str(len(_TOO_MANY)).encode() + b"\r\n\r\n" + _TOO_MANY)

log = logging.getLogger(__name__)


class Refuser:
    """Answers connections past a server's cap with ``TOO_MANY_CONNECTIONS`` without letting a reset
    overtake it: closing a socket with the client's request unread sends a reset, and a client
    that gets the reset before it reads may lose the 503. So the answer goes out with a FIN and
    one thread reads and drops what the client sent, for up to ``linger_s``, before closing; past
    ``max_draining`` sockets at once, the rest are closed at once."""

    def __init__(self, linger_s: float = 1.0, max_draining: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.linger_s = linger_s
        self.max_draining = max_draining
        self._clock = clock
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._until: dict[socket.socket, float] = {}
        self._thread: threading.Thread | None = None

    @property
    def draining(self) -> int:
        with self._lock:
            return len(self._until)

    def refuse(self, sock: socket.socket) -> None:
        """Write the 503 on ``sock`` (a fresh connection) and take it over; it is closed later."""
        try:
            sock.setblocking(False)
            sock.send(TOO_MANY_CONNECTIONS)  # a fresh socket's buffer takes it whole
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        with self._lock:
            if len(self._until) >= self.max_draining:
                sock.close()
                return
            self._until[sock] = self._clock() + self.linger_s
            self._selector.register(sock, selectors.EVENT_READ)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="refuse-drain", daemon=True)
                self._thread.start()

    def _close(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._until[sock]
        sock.close()

    def _run(self) -> None:
        try:
            self._drain()
        except Exception:
            log.exception("the drain of refused connections failed; the connections it held are closed")
        finally:
            with self._lock:
                if self._thread is threading.current_thread():  # it failed: close what it held, so the next refuse starts afresh
                    for sock in list(self._until):
                        try:
                            self._close(sock)
                        except (KeyError, ValueError, OSError):
                            self._until.pop(sock, None)
                            sock.close()
                    self._thread = None

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._until:
                    self._thread = None
                    return
                wait = max(0.0, min(self._until.values()) - self._clock())
            events = self._selector.select(min(wait, 0.1))
            with self._lock:
                for key, _mask in events:
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        done = not sock.recv(65536)  # the client's request: dropped
                    except BlockingIOError:
                        done = False
                    except OSError:
                        done = True
                    if done and sock in self._until:
                        self._close(sock)
                now = self._clock()
                for sock in [s for s, t in self._until.items() if t <= now]:
                    self._close(sock)


@dataclass(frozen=True)
class AdmissionConfig:
    max_concurrency: int = 1
    max_queue: int = 64
    queue_timeout_s: float = 10.0

    def validate(self) -> AdmissionConfig:
        if not 1 <= self.max_concurrency <= 1024:
            raise ConfigError(f"max_concurrency must be 1..1024 forward passes at once, got {self.max_concurrency}")
        if not 0 <= self.max_queue <= 100_000:
            raise ConfigError(f"max_queue must be 0..100000 waiting requests, got {self.max_queue}")
        if not 0 < self.queue_timeout_s <= 3600:
            raise ConfigError(f"queue_timeout_s must be in (0, 3600] seconds, got {self.queue_timeout_s}")
        return self


class Admission:
    """Thread-safe gate in front of the forward pass."""

    def __init__(self, config: AdmissionConfig = AdmissionConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config.validate()
        self._clock = clock
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._service_s = 0.05  # running mean of a forward pass, for Retry-After
        self.shed_full = 0
        self.shed_timeout = 0

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    @property
    def waiting(self) -> int:
        with self._cond:
            return self._waiting

    def retry_after_s(self) -> int:
        with self._cond:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        backlog = self._waiting + self._running
        return max(1, math.ceil(backlog * self._service_s / self.config.max_concurrency))

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one forward-pass slot for the block; raises Shed when none is free in time."""
        c = self.config
        with self._cond:
            if self._running >= c.max_concurrency:
                if self._waiting >= c.max_queue:
                    self.shed_full += 1
                    raise Shed(f"{self._waiting} requests already queued (--max-queue {c.max_queue})",
                               self._retry_after_locked())
                self._waiting += 1
                try:
                    end = self._clock() + c.queue_timeout_s
                    while self._running >= c.max_concurrency:
                        left = end - self._clock()
                        if left <= 0:
                            self.shed_timeout += 1
                            raise Shed(f"no forward slot free within {c.queue_timeout_s:g} s (--queue-timeout-s)",
                                       self._retry_after_locked())
                        self._cond.wait(left)
                finally:
                    self._waiting -= 1
            self._running += 1
        started = self._clock()
        try:
            yield
        finally:
            took = self._clock() - started
            with self._cond:
                self._running -= 1
                self._service_s += 0.2 * (took - self._service_s)
                self._cond.notify()


class ByteBudget:
    """A counting semaphore over bytes: ``acquire(n, wait_s)`` takes ``n`` (at most ``capacity``) or
    gives up after ``wait_s``; ``release(n)`` gives them back. Thread-safe."""

    def __init__(self, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ConfigError(f"a byte budget must be at least 1 byte, got {capacity}")
        self.capacity = capacity
        self._clock = clock
        self._cond = threading.Condition()
        self._used = 0
        self.refused = 0

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    def acquire(self, n: int, wait_s: float) -> bool:
        """Take ``n`` bytes (callers ask for at most ``capacity``); False when they are not free within ``wait_s``."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"cannot take {n} bytes of a {self.capacity}-byte budget")
        with self._cond:
            end = self._clock() + wait_s
            while self._used + n > self.capacity:
                left = end - self._clock()
                if left <= 0:
                    self.refused += 1
                    return False
                self._cond.wait(left)
            self._used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self._used = max(0, self._used - n)
            self._cond.notify_all()


__all__ = ["Admission", "AdmissionConfig", "ByteBudget", "Shed"]
