"""Chunk transports behind one interface: the bulk TCP port and gRPC GetChunks.

``ChunkTransport.read(server, ids, into, timeout_s)`` yields :class:`Arrivals`, each what arrived
together (one bulk batch, one GetChunks message: the engine handles it in one step), every item
naming its position in ``ids``, each position answered at most once; it raises
:class:`ReadBroken` when the read cannot go on (the ids not yet answered then go to another
replica). ``into`` may offer the final destination of raw chunks so their bytes are received
straight there (``paramserver.client.arrivals``).

:class:`ClusterTransport` is the one the engine uses against a real cluster: a server's bulk
port when it advertises one (and TLS is off), falling back to GetChunks for the rest of the
read on any bulk failure and parking that port for a while. Worker peers (``peer:ID``, their
addresses set by the swarm in ``peer_addresses``) are read over their bulk port, or GetChunks
under TLS, with no fallback: a peer that fails fails the read, and the planner sends its chunks
to the servers. :class:`MemoryTransport` serves
chunks from a dict, with scripted faults, for tests without sockets.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

import numpy as np

from chunking.hashing import Buffer
from paramserver.client.arrivals import Arrivals, Into, ReadIds
from paramserver.client.bulk_transport import BulkBatch, BulkError, BulkPool, BulkUnauthenticated
from paramserver.client.errors import AuthFailed, ReadBroken, from_rpc, rpc_code, rpc_details
from paramserver.client.fetch_plan import is_peer
from paramserver.client.getchunks_transport import get_chunks_raw, open_channel
from paramserver.wire import bulk_frames
from paramserver.wire.proto import pb


class ChunkTransport(Protocol):
    def read(self, server: str, ids: ReadIds, into: Into | None, timeout_s: float) -> Iterator[Arrivals]: ...


@dataclass
class TransportStats:
    bulk_bytes: int = 0
    grpc_bytes: int = 0
    bulk_fallbacks: int = 0
    peer_bytes: int = 0


# Codes after which another replica may well succeed, and the replica should be left alone.
_REPLICA_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class ClusterTransport:
    """Reads from real servers. ``members()`` gives ``{server_id: pb.Member}`` (grpc and bulk addresses)."""

    def __init__(self, members: Callable[[], Mapping[str, pb.Member]], *, token: str | None, tls: bool, tls_ca: str | Path | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None, bulk: bool = True, bulk_down_s: float = 30.0,
                 max_message_bytes: int, get_message_bytes: int = 2 << 20, io_timeout_s: float = 30.0,
                 peer_io_timeout_s: float = 8.0) -> None:
        self._members = members
        self._token = token
        self._tls = tls
        self._tls_files = (tls_ca, tls_cert, tls_key)
        self._max_message_bytes = max_message_bytes
        self._get_message_bytes = get_message_bytes
        # The bulk port has no encryption: with TLS, chunk bytes go over gRPC only.
        self.bulk: BulkPool | None = BulkPool(token, down_for_s=bulk_down_s, io_timeout_s=io_timeout_s) if bulk and not tls else None
        # Worker peers: "peer:ID" -> HOST:PORT (set by paramserver.client.swarm_fetch). A silent peer is
        # given up after peer_io_timeout_s, not the servers' 30 s: the servers have every chunk.
        self.peer_addresses: dict[str, str] = {}
        self.peer_bulk: BulkPool | None = None if tls else BulkPool(token, down_for_s=10.0, io_timeout_s=peer_io_timeout_s,
                                                                     connect_timeout_s=min(2.0, peer_io_timeout_s))
        self.stats = TransportStats()
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        if self.peer_bulk is not None:
            self.peer_bulk.close()

    def uses_bulk(self, server: str) -> bool:
        member = self._members().get(server)
        return (self.bulk is not None and member is not None and bool(member.bulk_address)
                and self.bulk.client(member.bulk_address) is not None)

    def read(self, server: str, ids: ReadIds, into: Into | None, timeout_s: float) -> Iterator[Arrivals]:
        if is_peer(server):
            yield from self._peer(server, ids, into, timeout_s)
            return
        member = self._members().get(server)
        if member is None:
            raise ReadBroken(f"{server} is no longer a member")
        start = 0
        if self.bulk is not None and member.bulk_address:
            start = yield from self._bulk(member.bulk_address, ids, into)
            if start >= len(ids):
                return
        yield from self._grpc(member.grpc_address, ids, start, timeout_s)

    def _bulk(self, address: str, ids: ReadIds, into: Into | None) -> Generator[Arrivals, None, int]:
        """Generator returning how many ids the bulk port answered (the rest go over gRPC)."""
        assert self.bulk is not None
        client = self.bulk.client(address)
        if client is None:
            return 0
        answered = 0
        got = 0
        try:
            for batch in client.fetch_batches(ids, into):
                arrivals, nbytes = _arrivals(batch)
                got += nbytes
                yield arrivals
                # Counted as answered only once handed over: a batch the engine never took is owed still.
                answered = batch.first + len(batch.data)
        except BulkUnauthenticated as exc:
            raise AuthFailed(str(exc)) from None
        except BulkError:
            self.bulk.mark_broken(address)  # GetChunks serves the rest and, for a while, this server
            with self._lock:
                self.stats.bulk_fallbacks += 1
        finally:
            with self._lock:
                self.stats.bulk_bytes += got
        return answered

    def _peer(self, peer: str, ids: ReadIds, into: Into | None, timeout_s: float) -> Iterator[Arrivals]:
        address = self.peer_addresses.get(peer)
        if not address:
            raise ReadBroken(f"{peer} has no known address")
        if self.peer_bulk is None:  # TLS: the peer's GetChunks, with the cluster's CA and this client's certificate
            try:
                yield from self._grpc(address, ids, 0, timeout_s, peer=True)
            except AuthFailed as exc:  # a peer that refuses us is not a reason to fail the load
                raise ReadBroken(f"{peer} refused: {exc}") from None
            return
        client = self.peer_bulk.client(address)
        if client is None:
            raise ReadBroken(f"{peer} failed recently")
        deadline = time.monotonic() + timeout_s
        got = 0
        try:
            for batch in client.fetch_batches(ids, into):
                arrivals, nbytes = _arrivals(batch)
                got += nbytes
                yield arrivals
                if time.monotonic() > deadline and batch.first + len(batch.data) < len(ids):
                    raise ReadBroken(f"{peer} ran past its deadline ({timeout_s:.1f} s)")
        except BulkError as exc:  # includes a refused token: the servers serve the rest
            self.peer_bulk.mark_broken(address)
            raise ReadBroken(f"{peer}: {exc}") from None
        finally:
            with self._lock:
                self.stats.peer_bytes += got

    def _grpc(self, address: str, ids: ReadIds, start: int, timeout_s: float, *, peer: bool = False) -> Iterator[Arrivals]:
        ca, cert, key = self._tls_files
        hex_ids = ids.hex
        # Each id answered once, and only ids asked for: anything else is never trusted.
        position = {cid: k for k, cid in enumerate(hex_ids[start:], start)}
        # A channel per read: parallel reads then use separate connections (and HTTP/2 windows).
        channel = open_channel(address, token=self._token, max_message_bytes=self._max_message_bytes, tls=self._tls,
                               tls_ca=ca, tls_cert=cert, tls_key=key)
        got = 0
        try:
            for chunks, errors in get_chunks_raw(channel, hex_ids[start:], max_message_bytes=self._get_message_bytes,
                                                 timeout=timeout_s):
                items: list[tuple[int, bool, bool, str, int, Buffer, bool, str]] = []
                for chunk in chunks:
                    k = position.pop(chunk.id, None)
                    if k is not None:
                        got += len(chunk.data)
                        items.append((k, True, False, chunk.codec, chunk.crc32c, chunk.data, False, ""))
                for ack in errors:
                    k = position.pop(ack.id, None)
                    if k is not None:
                        items.append((k, False, ack.status == pb.CORRUPT, "", 0, b"", False,
                                      f"{pb.ChunkStatus.Name(ack.status)} {ack.message}"))
                yield Arrivals.of(items)
        except grpc.RpcError as exc:
            code = rpc_code(exc)
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise from_rpc(exc, f"reading chunks from {address}") from None
            raise ReadBroken(f"{code.name}: {rpc_details(exc)[:200]}", code in _REPLICA_DOWN) from None
        except ValueError as exc:  # a malformed reply
            raise ReadBroken(f"malformed GetChunks reply: {exc}") from None
        finally:
            channel.close()
            with self._lock:
                if peer:
                    self.stats.peer_bytes += got
                else:
                    self.stats.grpc_bytes += got


def _arrivals(batch: BulkBatch) -> tuple[Arrivals, int]:
    """One bulk batch as the engine takes it, and the stored bytes of its good chunks."""
    h = batch.headers
    good = h.status == bulk_frames.OK
    n = len(batch.data)
    messages = [""] * n
    for k in np.flatnonzero(~good).tolist():
        messages[k] = f"{bulk_frames.STATUS_NAMES[int(h.status[k])]} " + bytes(batch.data[k]).decode("utf-8", "replace")
    arrivals = Arrivals(np.arange(batch.first, batch.first + n, dtype=np.int64), good, h.status == bulk_frames.CORRUPT,
                        h.codecs, h.crc32c, batch.data, batch.in_place, messages)
    return arrivals, int(h.stored_size[good].sum())


@dataclass
class MemoryTransport:
    """Serves ``chunks[server][id] = (codec, crc32c, stored bytes)``; for tests of the engine.

    Faults, per server: ``dead`` (every read breaks at once), ``die_after[server] = n`` (the next read
    breaks after n chunks), ``slow`` (the read breaks as past its deadline), ``corrupt[server]``
    (ids whose bytes are served flipped). ``calls`` records ``(server, ids)`` of every read.
    """

    chunks: dict[str, dict[str, tuple[str, int, bytes]]]
    dead: set[str] = field(default_factory=set)
    slow: set[str] = field(default_factory=set)
    die_after: dict[str, int] = field(default_factory=dict)
    corrupt: dict[str, set[str]] = field(default_factory=dict)
    calls: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    batch: int = 3  # arrivals per yielded list (a bulk batch holds up to 64)

    def read(self, server: str, ids: ReadIds, into: Into | None, timeout_s: float) -> Iterator[Arrivals]:
        batch: list[tuple[int, bool, bool, str, int, Buffer, bool, str]] = []
        try:
            for item in self._items(server, ids, into, timeout_s):
                batch.append(item)
                if len(batch) >= self.batch:
                    yield Arrivals.of(batch)
                    batch = []
        except ReadBroken:
            if batch:
                yield Arrivals.of(batch)  # what arrived before the break still counts
            raise
        if batch:
            yield Arrivals.of(batch)

    def _items(self, server: str, ids: ReadIds, into: Into | None,
               timeout_s: float) -> Iterator[tuple[int, bool, bool, str, int, Buffer, bool, str]]:
        with self.lock:
            self.calls.append((server, tuple(ids.hex)))
        if server in self.dead:
            raise ReadBroken(f"{server}: UNAVAILABLE connection refused")
        if server in self.slow:
            raise ReadBroken(f"{server}: DEADLINE_EXCEEDED after {timeout_s:.1f}s")
        held = self.chunks.get(server, {})
        for n, cid in enumerate(ids.hex):
            if self.die_after.get(server) == n:
                del self.die_after[server]  # once: the replica comes back
                raise ReadBroken(f"{server}: connection reset mid-stream")
            found = held.get(cid)
            if found is None:
                yield n, False, False, "", 0, b"", False, "MISSING not stored here"
                continue
            codec, crc, data = found
            if cid in self.corrupt.get(server, set()):
                data = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
            given = into(n, np.array([codec == "raw"]), np.array([len(data)], dtype=np.int64)) if into is not None else None
            region = given[0] if given else None
            if region is not None:
                region[:] = data
                yield n, True, False, codec, crc, region, True, ""
            else:
                yield n, True, False, codec, crc, memoryview(data), False, ""


__all__ = ["ChunkTransport", "ClusterTransport", "MemoryTransport", "ReadBroken", "TransportStats"]
