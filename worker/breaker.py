"""A circuit breaker around a shared dependency (the result cache's Redis): closed, open, half-open.

Pure state with an injected clock: the caller asks ``allow()`` before a call and reports
``success()`` or ``failure()`` after it. ``failures_to_open`` failures in a row open it; while open
every ``allow()`` is refused (the caller goes on without the dependency) until ``open_s`` has
passed; then exactly one probe call is let through (half-open): its success closes the breaker,
its failure opens it again for another ``open_s``. A call slower than ``slow_s`` counts as a
failure, so a Redis that answers but too slowly is treated like one that is down.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.errors import ConfigError

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)


@dataclass(frozen=True)
class BreakerConfig:
    failures_to_open: int = 3
    open_s: float = 2.0
    slow_s: float = 0.25

    def validate(self) -> BreakerConfig:
        if self.failures_to_open < 1:
            raise ConfigError(f"failures_to_open must be >= 1, got {self.failures_to_open}")
        if not 0 < self.open_s <= 3600:
            raise ConfigError(f"open_s must be in (0, 3600] seconds, got {self.open_s}")
        if not 0 < self.slow_s <= 60:
            raise ConfigError(f"slow_s must be in (0, 60] seconds, got {self.slow_s}")
        return self


class CircuitBreaker:
    """Thread-safe. ``on_change(old, new)`` runs (outside the lock) on every state change."""

    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[str, str], None] | None = None) -> None:
        self.config = config.validate()
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False
        self.opened = 0  # times it opened
        self.closed = 0  # times it closed again after being open

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go out now? In half-open state only one probe at a time."""
        change: tuple[str, str] | None = None
        with self._lock:
            if self._state == OPEN:
                if self._clock() - self._opened_at < self.config.open_s:
                    return False
                change = (OPEN, HALF_OPEN)
                self._state = HALF_OPEN
                self._probe_out = False
            if self._state == HALF_OPEN:
                if self._probe_out:
                    allowed = False
                else:
                    self._probe_out = allowed = True
            else:
                allowed = True
        self._notify(change)
        return allowed

    def record(self, ok: bool, seconds: float = 0.0) -> None:
        """Report how an allowed call went (``seconds``: how long it took)."""
        if ok and seconds <= self.config.slow_s:
            self.success()
        else:
            self.failure()

    def success(self) -> None:
        change: tuple[str, str] | None = None
        with self._lock:
            self._failures = 0
            if self._state == HALF_OPEN:
                change = (HALF_OPEN, CLOSED)
                self._state = CLOSED
                self._probe_out = False
                self.closed += 1
        self._notify(change)

    def failure(self) -> None:
        change: tuple[str, str] | None = None
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN or (self._state == CLOSED and self._failures >= self.config.failures_to_open):
                change = (self._state, OPEN)
                self._state = OPEN
                self._opened_at = self._clock()
                self._probe_out = False
                self.opened += 1
        self._notify(change)

    def _notify(self, change: tuple[str, str] | None) -> None:
        if change is not None and self._on_change is not None:
            self._on_change(*change)


__all__ = ["BreakerConfig", "CircuitBreaker", "CLOSED", "HALF_OPEN", "OPEN", "STATES"]
