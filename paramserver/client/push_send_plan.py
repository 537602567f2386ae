"""The push sending planner: which server gets which chunk, over which transport, and what a failure changes.

A pure state machine in the manner of etcd's raft and of ``fetch_plan`` for reads: no sockets, no
threads, no clock. The sender (``paramserver.client.push_sender.SendSession``) feeds it events --
a chunk submitted for its servers, a flush, a PUT's acks, a bulk session or a PutChunks stream
that failed -- and carries out the decisions it returns: open a PutChunks stream, stream a chunk
over it, send a PUT over a bulk write session. Every durable ack is counted in the AckLedger here.

The policy (the sender's module docstring tells the protocol side):

- A server whose member record advertises a bulk address gets its chunks in PUTs of about
  ``batch_bytes`` (at most ``MAX_PUT_ITEMS`` chunks); any other server a PutChunks stream.
- ``chain``: a chunk whose servers are all on bulk sessions joins the batch of its replica set,
  sent once down a chain whose head turns per PUT; its ACKS carry every replica's acks. A hop
  answered FAILED (unreachable, or a server that does not forward) gets its chunks directly, and
  the session stops chaining.
- A bulk session that fails before any of its PUTs was acked falls back to PutChunks: its PUTs
  not acked yet go over the stream (``stats.bulk_fallbacks``). One failing after acks, or refusing
  the token, is a failure of that server. A chain PUT's hops get its chunks directly either way.
- Per-chunk errors become the gRPC codes PutChunks would end with; after one that another chunk
  would repeat (all but CORRUPT_IN_TRANSIT) nothing more goes to that server.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc

from paramserver.client.push_plan import AckLedger
from paramserver.wire.bulk_frames import ACK_OK, CORRUPT_IN_TRANSIT, FAILED, FULL, INVALID, MAX_PUT_ITEMS, encode_put_item
from paramserver.wire.bulk_write_session import Ack
from paramserver.wire.chunk_record import ChunkRecord

# Per-chunk ack statuses as the gRPC codes PutChunks would have ended with (push.py decides on those).
ACK_CODES: dict[int, grpc.StatusCode] = {
    INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    CORRUPT_IN_TRANSIT: grpc.StatusCode.DATA_LOSS,
    FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FAILED: grpc.StatusCode.UNAVAILABLE,
}


class Failure(NamedTuple):
    """Why a server failed: the gRPC code PutChunks would have ended with, and the message."""

    code: grpc.StatusCode | None
    message: str


# After these nothing more is sent to that server (another chunk would fail the same way).
STOPPING = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED})
# A bulk session failing with these does not fall back to PutChunks: it would fail the same way.
NO_FALLBACK = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED})


class Outgoing(NamedTuple):
    """A chunk on its way: the record, its PUT_ITEM (encoded once, for any number of PUTs) and its
    stored bytes."""

    chunk: ChunkRecord
    item: bytes
    nbytes: int


@dataclass
class SendStats:
    """How the bytes went: for the push report. The planner keeps the policy figures (fallbacks,
    chain); the sender the transport ones (servers, bytes, PUTs)."""

    bulk_servers: set[str] = field(default_factory=set)  # servers that got at least one bulk PUT
    grpc_servers: set[str] = field(default_factory=set)  # servers that got a PutChunks stream
    bulk_fallbacks: int = 0  # bulk sessions that failed before any ack and went on over PutChunks
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    bulk_bytes: int = 0  # stored bytes handed to bulk sessions (a chain PUT once per replica it is for)
    grpc_bytes: int = 0
    bulk_puts: int = 0
    chain_puts: int = 0
    chain_resent: int = 0  # chunks a chain hop did not get, sent to it directly
    chain_off: str = ""  # why the session stopped chaining (empty: it did not)


# --------------------------------------------------------------------------- events in


@dataclass(frozen=True)
class Submit:
    """Send ``chunk`` to each of ``servers`` that has not failed (the producer)."""

    chunk: ChunkRecord
    servers: Sequence[str]


@dataclass(frozen=True)
class Flush:
    """Send what is batched and what waits to be resent (the producer, while finishing)."""


@dataclass(frozen=True)
class PutAcked:
    """The ACKS of PUT ``put``: chunk-major, ``replicas`` per chunk (the head, then its route)."""

    put: int
    acks: Sequence[Ack]
    replicas: int


@dataclass(frozen=True)
class BulkFailed:
    """``server``'s bulk write session failed (it could not open, a send failed, no acks in time)."""

    server: str
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class StreamAcked:
    """``server``'s PutChunks call ended and holds ``ids`` durably (STORED or ALREADY_PRESENT)."""

    server: str
    ids: Sequence[str]


@dataclass(frozen=True)
class StreamFailed:
    """``server``'s PutChunks stream broke; nothing more goes there."""

    server: str
    code: grpc.StatusCode | None
    message: str


@dataclass(frozen=True)
class NoStream:
    """No PutChunks client could be made for ``server`` (not a member, ...)."""

    server: str
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class Aborted:
    """The push is being abandoned: no more fallbacks."""


Event = Submit | Flush | PutAcked | BulkFailed | StreamAcked | StreamFailed | NoStream | Aborted

# --------------------------------------------------------------------------- decisions out


@dataclass(frozen=True, eq=False)
class Put:
    """Send ``chunks`` in one PUT over ``server``'s bulk session (at ``address``; opened on its first
    PUT). ``route``: the chain's servers after this one, ``hops`` their bulk addresses."""

    put: int
    server: str
    address: str
    chunks: tuple[Outgoing, ...]
    route: tuple[str, ...]
    hops: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True)
class OpenStream:
    """Open a PutChunks stream to ``server`` (an error making its client is the event NoStream)."""

    server: str


@dataclass(frozen=True, eq=False)
class Stream:
    """Send ``chunk`` over ``server``'s PutChunks stream."""

    server: str
    chunk: ChunkRecord


Decision = Put | OpenStream | Stream


@dataclass
class _Server:
    address: str  # bulk address; empty: PutChunks only
    stream: bool = False  # a PutChunks stream takes its chunks (the only one, or the fallback)
    broken: bool = False  # the bulk session is gone (fell back, or failed)
    acked_puts: int = 0
    pending: list[Outgoing] = field(default_factory=list)
    pending_bytes: int = 0
    stream_failure: Failure | None = None


@dataclass
class _Group:
    """Chunks with the same replica set, batched for a chain whose head turns per PUT."""

    servers: tuple[str, ...]
    pending: list[Outgoing] = field(default_factory=list)
    pending_bytes: int = 0
    turn: int = 0


class _Resend(NamedTuple):
    entry: Outgoing
    server: str


class SendPlanner:
    """Plan the sends of one push round; see the module docstring.

    ``bulk_address(server)``: the server's bulk address, empty for PutChunks (asked once per
    server, when it is first sent to). Not thread-safe: the sender steps it under one lock.
    """

    def __init__(self, ledger: AckLedger, bulk_address: Callable[[str], str], *, batch_bytes: int, chain: bool = False) -> None:
        self.ledger = ledger
        self.bulk_address = bulk_address
        self.batch_bytes = batch_bytes
        self.chain = chain
        self.stats = SendStats()
        self._servers: dict[str, _Server] = {}
        self._groups: dict[tuple[str, ...], _Group] = {}
        self._puts: dict[int, Put] = {}  # sent, not acked yet, in PUT order
        self._next_put = 0
        self._failures: dict[str, Failure] = {}
        self._stopped: set[str] = set()
        self._resend: deque[_Resend] = deque()
        self._aborted = False
        self._out: list[Decision] = []

    # ------------------------------------------------------------------ queries

    def stops(self, server: str) -> bool:
        """Nothing more goes to ``server`` (a failure that another chunk would repeat)."""
        if server in self._stopped:
            return True
        st = self._servers.get(server)
        return st is not None and st.stream_failure is not None

    def failures(self) -> dict[str, Failure]:
        """Servers that failed so far, with the gRPC code and the message."""
        out = dict(self._failures)
        for server, st in self._servers.items():
            if st.stream_failure is not None and server not in out:
                out[server] = st.stream_failure
        return out

    def current(self, put: int) -> bool:
        """``put`` is still to be sent (its session did not fail since it was planned)."""
        return put in self._puts

    @property
    def settled(self) -> bool:
        """Nothing batched, nothing to resend, no PUT unacknowledged."""
        return (not self._resend and not self._puts and all(not g.pending for g in self._groups.values())
                and all(not st.pending for st in self._servers.values()))

    # ------------------------------------------------------------------ transitions

    def step(self, event: Event) -> list[Decision]:
        """Apply ``event``; the decisions to carry out, in order. Events from the transports' threads
        (acks, a broken stream) return none: what they call for (a chain hop's misses) waits for the
        producer's next Submit or Flush."""
        self._out = []
        if isinstance(event, Submit):
            self._drain_resend()
            self._submit(event.chunk, event.servers)
        elif isinstance(event, Flush):
            for group in list(self._groups.values()):
                self._flush_group(group)
            self._drain_resend()
            for server, st in list(self._servers.items()):
                self._flush(server, st)
        elif isinstance(event, PutAcked):
            self._acked(event)
        elif isinstance(event, BulkFailed):
            self._bulk_failed(event)
        elif isinstance(event, StreamAcked):
            for cid in event.ids:
                self.ledger.ack(cid, event.server)
        elif isinstance(event, StreamFailed):
            st = self._target(event.server)
            if st.stream_failure is None:
                st.stream_failure = Failure(event.code, event.message)
        elif isinstance(event, NoStream):
            self._target(event.server).stream = False
            self.fail(event.server, event.code, event.message, stop=True)
        else:
            self._aborted = True
        out, self._out = self._out, []
        return out

    def fail(self, server: str, code: grpc.StatusCode | None, message: str, *, stop: bool) -> None:
        """Record a failure of ``server``; the first one stays, unless a stopping one follows."""
        old = self._failures.get(server)
        if old is None or (code in STOPPING and old.code not in STOPPING):
            self._failures[server] = Failure(code, message)
        if stop:
            self._stopped.add(server)

    # ------------------------------------------------------------------ internals

    def _target(self, server: str) -> _Server:
        st = self._servers.get(server)
        if st is None:
            st = self._servers[server] = _Server(self.bulk_address(server))
            if not st.address:
                st.stream = True
                self._out.append(OpenStream(server))
        return st

    def _chainable(self, server: str) -> bool:
        """Can be a chain's head or hop: a live bulk session (or one not opened yet)."""
        st = self._target(server)
        return bool(st.address) and not st.broken and not self.stops(server)

    def _submit(self, chunk: ChunkRecord, servers: Sequence[str]) -> None:
        live = [s for s in dict.fromkeys(servers) if not self.stops(s)]
        if not live:
            return
        nbytes = memoryview(chunk.data).nbytes
        try:
            item = encode_put_item(chunk.id, chunk.codec, chunk.raw_size, nbytes, chunk.crc32c)
        except ValueError as exc:  # what every server would refuse (INVALID_ARGUMENT), said before sending it
            for s in live:
                self.fail(s, grpc.StatusCode.INVALID_ARGUMENT, str(exc), stop=True)
            return
        entry = Outgoing(chunk, item, nbytes)
        if self.chain and len(live) > 1 and not self.stats.chain_off and all(self._chainable(s) for s in live):
            key = tuple(sorted(live))
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(key)
            group.pending.append(entry)
            group.pending_bytes += nbytes
            if self._full(group.pending, group.pending_bytes):
                self._flush_group(group)
        else:
            for s in live:
                self._add(s, entry)

    def _full(self, pending: list[Outgoing], nbytes: int) -> bool:
        return nbytes >= self.batch_bytes or len(pending) >= MAX_PUT_ITEMS

    def _add(self, server: str, entry: Outgoing) -> None:
        st = self._target(server)
        if st.stream:
            self._out.append(Stream(server, entry.chunk))
            return
        if st.broken or not st.address:
            return  # failed after acks, or no PutChunks client: nothing more goes here
        st.pending.append(entry)
        st.pending_bytes += entry.nbytes
        if self._full(st.pending, st.pending_bytes):
            self._flush(server, st)

    def _flush(self, server: str, st: _Server) -> None:
        if not st.pending:
            return
        entries, st.pending, st.pending_bytes = st.pending, [], 0
        self._put(server, entries, ())

    def _flush_group(self, group: _Group) -> None:
        if not group.pending:
            return
        entries, group.pending, group.pending_bytes = group.pending, [], 0
        live = [s for s in group.servers if not self.stops(s)]
        bulk = [s for s in live if self._chainable(s)]
        if self.stats.chain_off or len(bulk) < 2:
            for s in live:
                for entry in entries:
                    self._add(s, entry)
            return
        k = group.turn % len(bulk)
        group.turn += 1
        order = bulk[k:] + bulk[:k]
        self._put(order[0], entries, tuple(order[1:]))
        for s in live:
            if s not in bulk:  # a replica over PutChunks gets its copy directly
                for entry in entries:
                    self._add(s, entry)

    def _put(self, server: str, entries: list[Outgoing], route: tuple[str, ...]) -> None:
        """One PUT of ``entries`` to ``server`` (``route``: the chain's servers after it)."""
        st = self._target(server)
        if st.stream or st.broken or self.stops(server):
            self._hand_on(server, st, [(entries, route)])
            return
        self._next_put += 1
        put = Put(self._next_put, server, st.address, tuple(entries), route, tuple(self._servers[s].address for s in route),
                  sum(e.nbytes for e in entries))
        self._puts[put.put] = put
        self._out.append(put)

    def _hand_on(self, server: str, st: _Server, batches: Sequence[tuple[Sequence[Outgoing], tuple[str, ...]]]) -> None:
        """Chunks ``server``'s bulk session will not deliver: to its PutChunks stream (after a
        fallback) and, for a chain PUT, directly to its hops."""
        for entries, route in batches:
            if st.stream:
                self._out.extend(Stream(server, e.chunk) for e in entries)
            for hop in route:
                self._resend.extend(_Resend(e, hop) for e in entries)

    def _drain_resend(self) -> None:
        while self._resend:
            entry, server = self._resend.popleft()
            if not self.stops(server):
                self._add(server, entry)

    def _bulk_failed(self, event: BulkFailed) -> None:
        """Fall back to PutChunks when nothing was acked yet, else fail this server."""
        server = event.server
        st = self._target(server)
        if st.broken:
            return
        unacked = [p for p in self._puts.values() if p.server == server]
        for p in unacked:
            del self._puts[p.put]
        st.broken = True
        if st.acked_puts == 0 and event.code not in NO_FALLBACK and not self._aborted:
            self.stats.bulk_fallbacks += 1
            self.stats.fallback_reasons[server] = event.message
            st.stream = True
            self._out.append(OpenStream(server))
        else:
            self.fail(server, event.code, event.message, stop=True)
        self._hand_on(server, st, [(p.chunks, p.route) for p in unacked])

    def _acked(self, event: PutAcked) -> None:
        """Count acks, record errors, queue a chain hop's misses for a direct send."""
        put = self._puts.pop(event.put, None)
        if put is None:
            return  # its session failed meanwhile: its chunks went on elsewhere
        self._servers[put.server].acked_puts += 1
        servers = (put.server, *put.route)
        replicas = event.replicas
        for k, entry in enumerate(put.chunks):
            cid = entry.chunk.id
            for r in range(replicas):
                status, message, free = event.acks[k * replicas + r]
                server = servers[r]
                if status in ACK_OK:
                    self.ledger.ack(cid, server)
                elif r > 0 and status == FAILED:
                    self._resend.append(_Resend(entry, server))
                    self.stats.chain_resent += 1
                    if not self.stats.chain_off:
                        self.stats.chain_off = message
                else:
                    if status == FULL and free and "free" not in message:
                        message = f"{message} ({free} bytes free)"
                    code = ACK_CODES.get(status, grpc.StatusCode.UNKNOWN)
                    self.fail(server, code, message, stop=status != CORRUPT_IN_TRANSIT)


__all__ = [
    "ACK_CODES", "Aborted", "BulkFailed", "Decision", "Event", "Failure", "Flush", "NO_FALLBACK", "NoStream", "OpenStream", "Outgoing",
    "Put", "PutAcked", "STOPPING", "SendPlanner", "SendStats", "Stream", "StreamAcked", "StreamFailed", "Submit",
]
