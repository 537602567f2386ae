"""Warnings logged at most once per interval per key, for what clients can cause at any rate (refused
connections, forged cache entries): the log says it happened without letting a flood fill the disk."""
from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """WARNING lines at most once per ``every_s`` per key; the next line says how many were not logged."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.every_s) < self.every_s:
                self._skipped[key] = self._skipped.get(key, 0) + 1
                return False
            self._last[key] = now
            skipped = self._skipped.pop(key, 0)
            if len(self._last) > 1024:  # keys are reasons, not addresses; stay bounded anyway
                self._last, self._skipped = {key: now}, {}
        self.logger.warning(message + " suppressed_since_last=%d", *args, skipped)
        return True


__all__ = ["RateLimitedLog"]
