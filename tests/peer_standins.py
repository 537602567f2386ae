"""Minimal stand-ins for the peer parts the worker's wiring uses (issue 42), for tests only.

``worker.peer_shelf`` (PeerShelf, LoadEntry), ``worker.peer_port`` (PeerPort, PeerPortConfig) and
``paramserver.client.swarm_fetch`` (Swarm, SwarmOptions) / ``paramserver.client.peers``
(PeerVersion) with the interfaces of the design, recording what the wiring asks of them:
the swarm fetches from the servers only (``client.fetch``), the port listens and serves nothing.
``install(monkeypatch)`` puts them in ``sys.modules`` (``worker.peer_link`` imports them by name),
so the wiring is tested on its own, whatever the real parts do.
"""
from __future__ import annotations

import socket
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from paramserver.wire.address import split_host_port


@dataclass(frozen=True)
class PeerVersion:
    manifest_id: str
    complete: bool
    started_at: float


class LoadEntry:
    def __init__(self, manifest: Any, locate: Callable[[int], memoryview | None], started_at: float) -> None:
        self.manifest = manifest
        self.locate = locate
        self.started_at = started_at
        self.landed_rows: list[int] = []
        self.kept: dict[int, bytes] = {}
        self.ended: list[bool] = []
        self._lock = threading.Lock()

    def landed(self, rows: np.ndarray) -> None:
        with self._lock:
            self.landed_rows.extend(int(r) for r in rows.tolist())

    def keep(self, row: int, raw: bytes) -> None:
        assert isinstance(raw, bytes), type(raw)  # a copy that stays valid
        with self._lock:
            self.kept[row] = raw

    def end(self, complete: bool) -> None:
        self.ended.append(complete)


class PeerShelf:
    made: list[PeerShelf] = []

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.entries: list[LoadEntry] = []
        PeerShelf.made.append(self)

    def begin_load(self, manifest: Any, locate: Callable[[int], memoryview | None], started_at: float) -> LoadEntry:
        entry = LoadEntry(manifest, locate, started_at)
        self.entries.append(entry)
        return entry

    def lookup(self, ids: Sequence[str], deadline: float) -> list[memoryview | None]:
        return [None] * len(ids)

    def versions(self) -> list[PeerVersion]:
        return [PeerVersion(e.manifest.id, e.ended == [True], e.started_at) for e in self.entries if e.ended != [False]]


@dataclass(frozen=True)
class PeerPortConfig:
    listen: str = "127.0.0.1:0"
    max_connections_per_source: int = 16


@dataclass
class PortCounters:
    served_bytes: int = 0
    served_chunks: int = 0
    refused: dict[str, int] = field(default_factory=dict)


class PeerPort:
    made: list[PeerPort] = []

    def __init__(self, shelf: PeerShelf, config: PeerPortConfig, token: str | None, tls: Any) -> None:
        self.shelf, self.config, self.token, self.tls = shelf, config, token, tls
        self.counters = PortCounters()
        self.connections = 0
        self.address: str | None = None
        self.stopped = False
        self._sock: socket.socket | None = None
        PeerPort.made.append(self)

    # the real port's public counters (worker.peer_port.PeerPort)
    @property
    def served_bytes(self) -> int:
        return self.counters.served_bytes

    @property
    def served_chunks(self) -> int:
        return self.counters.served_chunks

    @property
    def refused(self) -> dict[str, int]:
        return dict(self.counters.refused)

    def start(self) -> PeerPort:
        host, port = split_host_port(self.config.listen)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.bind((host, port))  # OSError (e.g. in use) as the real port raises it
        except OSError:
            sock.close()
            raise
        sock.listen()
        self._sock = sock
        self.address = f"{host}:{sock.getsockname()[1]}"
        return self

    def stop(self) -> None:
        self.stopped = True
        if self._sock is not None:
            self._sock.close()


@dataclass(frozen=True)
class SwarmOptions:
    enabled: bool = True
    lease_s: float = 10.0
    peer_wait_s: float = 5.0
    seed_window_s: float = 1.0
    window_bytes: int = 32 << 20
    max_peers: int = 64

    def validate(self) -> SwarmOptions:
        return self


@dataclass
class SwarmCounters:
    peer_bytes: int = 0
    peers_dropped: dict[str, int] = field(default_factory=dict)
    peer_reads: int = 0
    peer_failovers: int = 0


class Swarm:
    made: list[Swarm] = []

    def __init__(self, client: Any, *, worker_id: str, options: SwarmOptions = SwarmOptions()) -> None:
        self.client, self.worker_id, self.options = client, worker_id, options
        self.counters = SwarmCounters()
        self.address: str | None = None
        self.versions: Callable[[], Sequence[PeerVersion]] | None = None
        self.announced: list[list[PeerVersion]] = []
        self.fetched: list[str] = []
        self.closed = False
        Swarm.made.append(self)

    def serve_at(self, address: str, versions: Callable[[], Sequence[PeerVersion]]) -> None:
        self.address, self.versions = address, versions

    def announce_now(self) -> None:
        assert self.versions is not None
        self.announced.append(list(self.versions()))

    def fetch(self, manifest_id: str, chunks: Any, sink: Any, *, algorithm: str = "blake3", tensors_of: Any = None) -> Any:
        self.fetched.append(manifest_id)
        return self.client.fetch(chunks, sink, algorithm=algorithm, tensors_of=tensors_of)

    def close(self) -> None:
        self.closed = True


def modules() -> dict[str, types.ModuleType]:
    out: dict[str, types.ModuleType] = {}
    for name, names in (("worker.peer_shelf", (PeerShelf, LoadEntry)), ("worker.peer_port", (PeerPort, PeerPortConfig)),
                        ("paramserver.client.swarm_fetch", (Swarm, SwarmOptions, SwarmCounters)),
                        ("paramserver.client.peers", (PeerVersion,))):
        mod = types.ModuleType(name, "test stand-in (tests/peer_standins.py)")
        for obj in names:
            setattr(mod, obj.__name__, obj)
        out[name] = mod
    return out


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins in place of the real parts for one test; their records start empty."""
    for name, mod in modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    PeerShelf.made.clear()
    PeerPort.made.clear()
    Swarm.made.clear()


__all__ = ["LoadEntry", "PeerPort", "PeerPortConfig", "PeerShelf", "PeerVersion", "Swarm", "SwarmOptions", "install",
           "modules"]
