"""A stoppable periodic task, for wiring Repairer/Scrubber steps to threads.

    scrub = Periodic("scrub", 1.0, lambda: scrubber.step(config.scrub_bytes_per_s))
    repair = Periodic("repair", config.repair_interval_s, repairer.step)
    scrub.start(); repair.start() ... scrub.stop(); repair.stop()

An exception in one run is reported to ``on_error`` (default: logged) and the
task keeps running: one bad step must not stop repairs for good.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(
        self, name: str, interval_s: float, fn: Callable[[], object], *, on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self.fn = fn
        self.on_error = on_error or (lambda exc: log.exception("periodic task %s failed: %s", name, exc))
        self.runs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Periodic:
        if self._thread is not None:
            raise RuntimeError(f"periodic task {self.name} already started")
        self._thread = threading.Thread(target=self._loop, name=f"periodic-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - reported, and the loop goes on
                self.on_error(exc)
            self.runs += 1

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


__all__ = ["Periodic"]
