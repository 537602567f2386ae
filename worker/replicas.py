"""Replica choice for chunk reads: spread the bytes, prefer the fastest servers.

Pure policy (no sockets) so it can be unit-tested: the client feeds it observed throughput
and failures, and asks it which replica serves which chunk.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

DEFAULT_BYTES_PER_S = 500e6  # prior for a server never measured: optimistic, so it gets tried


@dataclass(frozen=True)
class Want:
    """One chunk to place: its id, size and the servers that may serve it, best first."""

    chunk_id: str
    nbytes: int
    candidates: Sequence[str]


class ReplicaSelector:
    """Moving average of each server's throughput, plus a short 'down' mark after failures.

    ``plan`` gives each chunk to the candidate that would finish its share soonest:
    ``(bytes already assigned + this chunk) / throughput``. Equal servers get equal shares; a
    server twice as fast gets about twice the bytes; a server marked down gets a chunk only when
    every candidate is down.
    """

    def __init__(self, alpha: float = 0.3, down_backoff_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self.down_backoff_s = down_backoff_s
        self.clock = clock
        self._lock = threading.Lock()
        self._rate: dict[str, float] = {}
        self._down_until: dict[str, float] = {}

    def observe(self, server: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        sample = nbytes / seconds
        with self._lock:
            old = self._rate.get(server)
            self._rate[server] = sample if old is None else (1 - self.alpha) * old + self.alpha * sample
            self._down_until.pop(server, None)

    def mark_down(self, server: str) -> None:
        with self._lock:
            self._down_until[server] = self.clock() + self.down_backoff_s

    def is_down(self, server: str) -> bool:
        with self._lock:
            return self._down_until.get(server, 0.0) > self.clock()

    def rate(self, server: str) -> float:
        with self._lock:
            return self._rate.get(server, self._prior_locked())

    def rates(self) -> dict[str, float]:
        with self._lock:
            return dict(self._rate)

    def _prior_locked(self) -> float:
        # An unmeasured server is assumed as fast as the best known one, so it is tried early.
        return max(self._rate.values(), default=DEFAULT_BYTES_PER_S)

    def plan(self, wants: Iterable[Want]) -> dict[str, list[str]]:
        """Server -> chunk ids (in the order given). Chunks with no candidates are left out."""
        now = self.clock()
        with self._lock:
            prior = self._prior_locked()
            rate = dict(self._rate)
            down = {s for s, t in self._down_until.items() if t > now}
        load: dict[str, float] = {}
        out: dict[str, list[str]] = {}
        for want in wants:
            if not want.candidates:
                continue
            live = [s for s in want.candidates if s not in down] or list(want.candidates)
            best = min(live, key=lambda s: ((load.get(s, 0.0) + want.nbytes) / rate.get(s, prior), live.index(s)))
            load[best] = load.get(best, 0.0) + want.nbytes
            out.setdefault(best, []).append(want.chunk_id)
        return out


def batches(ids: Sequence[str], size: int) -> list[list[str]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


__all__ = ["ReplicaSelector", "Want", "batches", "DEFAULT_BYTES_PER_S"]
