"""What the peer port's two transports share (worker.peer_port: bulk frames; worker.peer_grpc: GetChunks
under TLS): its settings, counters, token rule and thread priority."""
from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from paramserver.wire.address import split_host_port
from paramserver.wire.auth import READ_TOKEN_ENV, tokens_match
from worker.errors import ConfigError

TLSFiles = tuple[str | Path, str | Path, str | Path]  # (CA, certificate, key) files
PEER_NICE = 5  # serving threads' niceness: below the worker's own loads and requests
MISSING_MESSAGE = "not on this peer (or not landed in time): read it from the servers"


@dataclass(frozen=True)
class PeerPortConfig:
    listen: str = "127.0.0.1:0"  # loopback by default; exposing it goes through paramserver.wire.exposure
    max_connections: int = 256  # open connections in all (those that never said hello give way first)
    max_connections_per_source: int = 64  # connections past their hello from one address
    max_sessions: int = 16  # batches (or GetChunks calls) being answered at once: bounds bytes in flight
    peer_wait_s: float = 5.0  # a chunk a load is still fetching is waited for at most this long
    io_timeout_s: float = 30.0  # one send, or the rest of a request, must not take longer
    hello_timeout_s: float = 5.0  # the whole hello must arrive within this
    idle_timeout_s: float = 120.0  # a connection with no request for this long is closed

    def validate(self) -> PeerPortConfig:
        try:
            split_host_port(self.listen)
        except ValueError:
            raise ConfigError(f"peer listen address must be HOST:PORT (port 0 picks a free one), got {self.listen!r}; "
                              "fix --peer-listen") from None
        for name in ("max_connections", "max_connections_per_source", "max_sessions"):
            value = getattr(self, name)
            if not 1 <= value <= 65536:
                raise ConfigError(f"peer port {name} must be 1..65536, got {value}")
        if self.max_connections_per_source > self.max_connections:
            raise ConfigError(f"peer port max_connections_per_source ({self.max_connections_per_source}) is over "
                              f"max_connections ({self.max_connections}); lower it")
        for name in ("peer_wait_s", "io_timeout_s", "hello_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"peer port {name} must be in (0, 3600] seconds, got {value}")
        return self


def check_token(given: str | None, expected: str | None) -> str | None:
    """None when ``given`` may read here, else the one-line refusal (never echoing either token)."""
    if expected is None:
        return None  # an open port: the exposure check keeps it on loopback unless --insecure
    if tokens_match(given or "", expected) and given:
        return None
    problem = "no token was sent" if not given else "the token sent is wrong"
    return (f"a worker's peer port needs the cluster's read token (--token, ${READ_TOKEN_ENV}, the token this worker reads "
            f"the cluster with); {problem}")


def lower_priority() -> None:
    """Best effort: this thread's niceness to PEER_NICE (Linux: per thread), so peers wait, not the worker."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PEER_NICE)
    except (AttributeError, OSError):
        pass


class PeerCounters:
    """What the port served and refused; read by the worker's /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.served_bytes = 0
        self.served_chunks = 0
        self.missing = 0
        self.refused: Counter[str] = Counter()

    def served(self, chunks: int, nbytes: int, missing: int) -> None:
        with self._lock:
            self.served_chunks += chunks
            self.served_bytes += nbytes
            self.missing += missing

    def refuse(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1


__all__ = ["MISSING_MESSAGE", "PEER_NICE", "PeerCounters", "PeerPortConfig", "TLSFiles", "check_token", "lower_priority"]
