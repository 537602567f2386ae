"""Chunk bytes this server sent to readers, by read path: ``bulk`` (the bulk port's read sessions)
and ``grpc`` (GetChunks). Counted once a batch or reply message is handed to the socket or to
gRPC, so a read refused or cut before that counts nothing. Exported as
``paramserver_served_bytes_total{path}`` and summed in ``ServerStatusReply.served_bytes``: the
figure a fleet's cold start is judged by (servers' egress against the model's size).
"""
from __future__ import annotations

import threading

PATHS = ("bulk", "grpc")


class ServedBytes:
    """Thread-safe byte counters per read path, since the process started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = dict.fromkeys(PATHS, 0)

    def add(self, path: str, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            self._bytes[path] += n  # KeyError for a path not in PATHS: a bug, not a reader's doing

    def by_path(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def total(self) -> int:
        with self._lock:
            return sum(self._bytes.values())


__all__ = ["PATHS", "ServedBytes"]
