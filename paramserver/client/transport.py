"""Chunk transports behind one interface: the bulk TCP port and gRPC GetChunks.

``ChunkTransport.read(server, ids, into, timeout_s)`` yields lists of :class:`Arrival`, one per
id it answers, in order, each list what arrived together (one bulk batch, one GetChunks message:
the engine handles a list in one step), and raises :class:`ReadBroken` when the read cannot go on (the ids not yet
answered then go to another replica). ``into(id, codec, stored_size)`` may offer the final
destination of a raw chunk so its bytes are received straight there.

:class:`ClusterTransport` is the one the engine uses against a real cluster: a server's bulk
port when it advertises one (and TLS is off), falling back to GetChunks for the rest of the
read on any bulk failure and parking that port for a while. :class:`MemoryTransport` serves
chunks from a dict, with scripted faults, for tests without sockets.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from paramserver.client.bulk_transport import BulkError, BulkPool, BulkUnauthenticated, Into
from paramserver.client.errors import AuthFailed, from_rpc, rpc_code, rpc_details
from paramserver.client.getchunks_transport import get_chunks_raw, open_channel
from paramserver.client.verify import Arrival
from paramserver.wire import bulk_frames
from paramserver.wire.proto import pb


class ReadBroken(Exception):
    """A read stopped before answering every id; ``replica_down``: do not ask that replica again."""

    def __init__(self, reason: str, replica_down: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.replica_down = replica_down


class ChunkTransport(Protocol):
    def read(self, server: str, ids: Sequence[str], into: Into | None, timeout_s: float) -> Iterator[list[Arrival]]: ...


@dataclass
class TransportStats:
    bulk_bytes: int = 0
    grpc_bytes: int = 0
    bulk_fallbacks: int = 0


# Codes after which another replica may well succeed, and the replica should be left alone.
_REPLICA_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class ClusterTransport:
    """Reads from real servers. ``members()`` gives ``{server_id: pb.Member}`` (grpc and bulk addresses)."""

    def __init__(self, members: Callable[[], Mapping[str, pb.Member]], *, token: str | None, tls: bool, tls_ca: str | Path | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None, bulk: bool = True, bulk_down_s: float = 30.0,
                 max_message_bytes: int, get_message_bytes: int = 2 << 20, io_timeout_s: float = 30.0) -> None:
        self._members = members
        self._token = token
        self._tls = tls
        self._tls_files = (tls_ca, tls_cert, tls_key)
        self._max_message_bytes = max_message_bytes
        self._get_message_bytes = get_message_bytes
        # The bulk port has no encryption: with TLS, chunk bytes go over gRPC only.
        self.bulk: BulkPool | None = BulkPool(token, down_for_s=bulk_down_s, io_timeout_s=io_timeout_s) if bulk and not tls else None
        self.stats = TransportStats()
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()

    def uses_bulk(self, server: str) -> bool:
        member = self._members().get(server)
        return (self.bulk is not None and member is not None and bool(member.bulk_address)
                and self.bulk.client(member.bulk_address) is not None)

    def read(self, server: str, ids: Sequence[str], into: Into | None, timeout_s: float) -> Iterator[list[Arrival]]:
        member = self._members().get(server)
        if member is None:
            raise ReadBroken(f"{server} is no longer a member")
        owed = list(ids)
        if self.bulk is not None and member.bulk_address:
            owed = yield from self._bulk(member.bulk_address, owed, into)
            if not owed:
                return
        yield from self._grpc(member.grpc_address, owed, timeout_s)

    def _bulk(self, address: str, ids: list[str], into: Into | None) -> Generator[list[Arrival], None, list[str]]:
        """Generator returning the ids the bulk port did not answer (they go over gRPC)."""
        assert self.bulk is not None
        client = self.bulk.client(address)
        if client is None:
            return ids
        answered = 0
        got = 0
        try:
            ok = bulk_frames.OK
            for batch in client.fetch_batches(ids, into):
                arrivals = []
                for item in batch:
                    if item.status == ok:
                        got += len(item.data)
                        arrivals.append(Arrival(item.id, True, False, item.codec, item.crc32c, item.data))
                    else:
                        arrivals.append(Arrival(item.id, False, item.status == bulk_frames.CORRUPT, "", 0, b"",
                                                f"{item.status_name} {item.message}"))
                # Counted as answered only once handed over: a batch the engine never took is owed still.
                yield arrivals
                answered += len(batch)
        except BulkUnauthenticated as exc:
            raise AuthFailed(str(exc)) from None
        except BulkError:
            self.bulk.mark_broken(address)  # GetChunks serves the rest and, for a while, this server
            with self._lock:
                self.stats.bulk_fallbacks += 1
        finally:
            with self._lock:
                self.stats.bulk_bytes += got
        return ids[answered:]

    def _grpc(self, address: str, ids: list[str], timeout_s: float) -> Iterator[list[Arrival]]:
        ca, cert, key = self._tls_files
        # A channel per read: parallel reads then use separate connections (and HTTP/2 windows).
        channel = open_channel(address, token=self._token, max_message_bytes=self._max_message_bytes, tls=self._tls,
                               tls_ca=ca, tls_cert=cert, tls_key=key)
        got = 0
        try:
            for chunks, errors in get_chunks_raw(channel, ids, max_message_bytes=self._get_message_bytes, timeout=timeout_s):
                arrivals = []
                for chunk in chunks:
                    got += len(chunk.data)
                    arrivals.append(Arrival(chunk.id, True, False, chunk.codec, chunk.crc32c, chunk.data))
                for ack in errors:
                    arrivals.append(Arrival(ack.id, False, ack.status == pb.CORRUPT, "", 0, b"",
                                            f"{pb.ChunkStatus.Name(ack.status)} {ack.message}"))
                yield arrivals
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
                self.stats.grpc_bytes += got


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

    def read(self, server: str, ids: Sequence[str], into: Into | None, timeout_s: float) -> Iterator[list[Arrival]]:
        batch: list[Arrival] = []
        try:
            for arrival in self._arrivals(server, ids, into, timeout_s):
                batch.append(arrival)
                if len(batch) >= self.batch:
                    yield batch
                    batch = []
        except ReadBroken:
            if batch:
                yield batch  # what arrived before the break still counts
            raise
        if batch:
            yield batch

    def _arrivals(self, server: str, ids: Sequence[str], into: Into | None, timeout_s: float) -> Iterator[Arrival]:
        with self.lock:
            self.calls.append((server, tuple(ids)))
        if server in self.dead:
            raise ReadBroken(f"{server}: UNAVAILABLE connection refused")
        if server in self.slow:
            raise ReadBroken(f"{server}: DEADLINE_EXCEEDED after {timeout_s:.1f}s")
        held = self.chunks.get(server, {})
        for n, cid in enumerate(ids):
            if self.die_after.get(server) == n:
                del self.die_after[server]  # once: the replica comes back
                raise ReadBroken(f"{server}: connection reset mid-stream")
            found = held.get(cid)
            if found is None:
                yield Arrival(cid, False, False, "", 0, b"", "MISSING not stored here")
                continue
            codec, crc, data = found
            if cid in self.corrupt.get(server, set()):
                data = bytes([data[0] ^ 0xFF]) + data[1:] if data else data
            region = into(cid, codec, len(data)) if into is not None else None
            if region is not None:
                region[:] = data
                yield Arrival(cid, True, False, codec, crc, region)
            else:
                yield Arrival(cid, True, False, codec, crc, memoryview(data))


__all__ = ["ChunkTransport", "ClusterTransport", "MemoryTransport", "ReadBroken", "TransportStats"]
