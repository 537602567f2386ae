"""The push sender: chunk bytes to their replicas, over bulk write sessions or PutChunks streams.

:class:`SendSession` takes chunks from one producer thread (``submit(chunk, servers)``) and
delivers each to every server named, counting each durable ack in the AckLedger:

- **Bulk write** (paramserver.client.bulk_writer) to a server whose member record advertises a
  bulk address, when TLS is off (the bulk port has no encryption): chunks are batched per
  server into PUTs of about ``batch_bytes``, each sent with one ``sendmsg`` of the chunks' own
  buffers, at most ``window`` PUTs unacknowledged per server (``submit`` blocks beyond that:
  backpressure). Each server stores a PUT with one group fsync and acks every chunk once durable.
- **gRPC PutChunks** (:class:`ServerStream`, the contract) for a server without a bulk address,
  with TLS, and as the fallback when its bulk session fails before any ack (refused hello, a
  server that serves bulk reads only, a reset): every chunk not acked yet is sent again over
  PutChunks and ``stats.bulk_fallbacks`` counts it. A bulk session failing after acks is a
  failure of that server, as a broken PutChunks stream is.
- **Chain** (``SendOptions.chain``): a batch is sent once, to one of its replicas (in turn), whose
  server forwards it to the next, and so on; its ACKS carry every replica's acks. A hop that
  could not be reached (or a server that does not forward) is answered FAILED: its chunks are
  sent to it directly and the session stops chaining.

Per-chunk errors become the status codes PutChunks would end with (INVALID -> INVALID_ARGUMENT,
CORRUPT_IN_TRANSIT -> DATA_LOSS, FULL -> RESOURCE_EXHAUSTED, FAILED -> UNAVAILABLE; a refused
token UNAUTHENTICATED), so ``push.FATAL_STREAM_CODES`` reads both transports alike. A chunk the
server refused is not acked; the other chunks of its PUT are. After INVALID, FULL, UNAUTHENTICATED
or a broken session nothing more goes to that server; after CORRUPT_IN_TRANSIT the rest still does.

Memory: a chunk is referenced (never copied) until every server it went to acked it, so at most
about ``window x batch_bytes`` per server is held; a 1 GiB model is never held twice.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Iterator, Mapping, Sequence, cast

import grpc

from paramserver.client.bulk_writer import ACK_CODES, BulkWriteError, BulkWriter, WriteBatch
from paramserver.client.cluster_view import ClusterView
from paramserver.client.errors import ClientError, rpc_code, rpc_details
from paramserver.client.push_plan import AckLedger
from paramserver.client.rpc import ChunkData, ParamServerClient
from paramserver.wire.bulk_frames import ACK_OK, CORRUPT_IN_TRANSIT, DEFAULT_WRITE_WINDOW, FAILED, FULL, MAX_PUT_ITEMS, encode_put_item
from paramserver.wire.proto import pb

_END = object()
_POLL_S = 0.2
ACKED = frozenset({pb.STORED, pb.ALREADY_PRESENT})
Failure = tuple[grpc.StatusCode | None, str]
# After these nothing more is sent to that server (another chunk would fail the same way).
_STOPPING = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED})


class _Aborted(Exception):
    """Raised inside a request iterator to cancel its PutChunks call."""


@dataclass(frozen=True)
class SendOptions:
    queue_items: int = 64  # gRPC: per server; 64 x 256 KiB = 16 MiB in flight per stream
    stream_bytes: int = 512 << 20  # gRPC: one PutChunks call is closed (and acked) after about this much
    batch_bytes: int = 4 << 20  # one PutChunks message / one bulk PUT
    progress_interval_s: float = 0.1
    bulk: bool = True  # bulk write sessions where a server advertises a bulk port (and TLS is off)
    window: int = DEFAULT_WRITE_WINDOW  # bulk: PUTs unacknowledged per server
    chain: bool = False  # bulk: send a batch once and let the replicas forward it (see the module docstring)
    connect_timeout_s: float = 3.0
    io_timeout_s: float = 30.0  # bulk: one send, or the rest of a frame
    ack_timeout_s: float = 120.0  # bulk: PUTs in flight and no ack for this long -> that server failed


@dataclass
class SendStats:
    """How the bytes went: for the push report."""

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


class ServerStream:
    """Everything sent to one server in one send round over PutChunks."""

    def __init__(self, server: str, client: ParamServerClient, ledger: AckLedger, options: SendOptions, abort: threading.Event) -> None:
        self.server = server
        self.client = client
        self.ledger = ledger
        self.options = options
        self.abort = abort
        self.queue: queue.Queue[object] = queue.Queue(maxsize=max(2, options.queue_items))
        self.error: str | None = None
        self.code: grpc.StatusCode | None = None
        self.yielded_bytes = 0
        self.thread = threading.Thread(target=self._run, name=f"push-{server}", daemon=True)

    def offer(self, item: object) -> bool:
        """Queue an item; False once this stream has failed (the item is then dropped)."""
        while True:
            if self.error is not None or self.abort.is_set():
                return False
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue

    def _requests(self, state: dict[str, bool]) -> Iterator[ChunkData]:
        sent = 0
        while True:
            if self.abort.is_set():
                raise _Aborted()
            if self.error is not None:
                return
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is _END:
                state["ended"] = True
                return
            assert isinstance(item, ChunkData)
            yield item
            sent += len(item.data)
            self.yielded_bytes += len(item.data)
            if sent >= self.options.stream_bytes:
                return

    def _run(self) -> None:
        state = {"ended": False}
        while not state["ended"] and not self.abort.is_set():
            try:
                reply = self.client.put_chunks(self._requests(state), batch_bytes=self.options.batch_bytes)
            except grpc.RpcError as exc:
                self.code, self.error = rpc_code(exc), rpc_details(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a bug must not hang the producer: it sees the error and stops feeding us
                self.code, self.error = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
                return
            for ack in reply.acks:
                if ack.status in ACKED:
                    self.ledger.ack(ack.id, self.server)


# ------------------------------------------------------------------ targets (one per server)

Entry = tuple[ChunkData, bytes, int]  # (chunk, its PUT_ITEM, stored bytes)


class _GrpcTarget:
    def __init__(self, session: SendSession, server: str, client: ParamServerClient) -> None:
        self.server = server
        self.stream = ServerStream(server, client, session.ledger, session.options, session.abort)
        self.stream.thread.start()
        session.stats.grpc_servers.add(server)
        self.ended = False

    def add(self, entry: Entry) -> None:
        self.stream.offer(entry[0])

    def put_direct(self, entries: list[Entry]) -> None:
        for entry in entries:
            self.add(entry)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.stream.offer(_END)

    @property
    def sent_bytes(self) -> int:
        return self.stream.yielded_bytes

    @property
    def failure(self) -> Failure | None:
        return (self.stream.code, self.stream.error) if self.stream.error is not None else None


class _BulkTarget:
    """One server over a bulk write session, with PutChunks as the fallback until its first ack."""

    def __init__(self, session: SendSession, server: str, address: str) -> None:
        self.session = session
        self.server = server
        self.address = address
        self.writer: BulkWriter | None = None
        self.grpc: _GrpcTarget | None = None
        self.pending: list[Entry] = []
        self.pending_bytes = 0
        self.bulk_sent = 0
        self.broken = False  # the bulk session is gone (fell back, or failed)

    @property
    def sent_bytes(self) -> int:
        return self.bulk_sent + (self.grpc.sent_bytes if self.grpc is not None else 0)

    @property
    def chains(self) -> bool:
        """Can be a chain's head or hop: a live bulk session (or one not opened yet)."""
        return not self.broken and not self.session.stops(self.server)

    def add(self, entry: Entry) -> None:
        if self.grpc is not None:
            self.grpc.add(entry)
            return
        if self.broken:
            return  # failed after acks: nothing more goes here
        self.pending.append(entry)
        self.pending_bytes += entry[2]
        if self.pending_bytes >= self.session.options.batch_bytes or len(self.pending) >= MAX_PUT_ITEMS:
            self.flush()

    def put_direct(self, entries: list[Entry]) -> None:
        for entry in entries:
            self.add(entry)

    def flush(self) -> None:
        if not self.pending:
            return
        entries, self.pending, self.pending_bytes = self.pending, [], 0
        self.put(entries, ())

    def put(self, entries: list[Entry], route: tuple[str, ...], addresses: Sequence[str] = ()) -> None:
        """One PUT of ``entries`` (``route``: the chain's servers after this one)."""
        session = self.session
        if self.grpc is not None or self.broken or session.stops(self.server):
            self._hand_on([(entries, route)])
            return
        if self.writer is None:
            try:
                self.writer = BulkWriter(self.address, session.token, self._on_acks, window=session.options.window,
                                         connect_timeout_s=session.options.connect_timeout_s,
                                         io_timeout_s=session.options.io_timeout_s, ack_timeout_s=session.options.ack_timeout_s,
                                         on_change=session.notify)
            except BulkWriteError as exc:
                self._broken(exc, [(entries, route)])
                return
            session.stats.bulk_servers.add(self.server)
        nbytes = sum(e[2] for e in entries)
        try:
            self.writer.put(entries, [e[1] for e in entries], [e[0].data for e in entries], nbytes, route, addresses,
                            payload=entries, abort=session.abort)
        except BulkWriteError as exc:
            self._broken(exc, [(entries, route)])
            return
        replicas = 1 + len(route)
        self.bulk_sent += nbytes * replicas
        session.stats.bulk_bytes += nbytes * replicas
        session.stats.bulk_puts += 1
        if route:
            session.stats.chain_puts += 1

    def settle(self) -> bool:
        """True when nothing is pending or in flight on the bulk session (producer thread)."""
        if self.pending:
            self.flush()
        writer = self.writer
        if writer is None or self.broken:
            return not self.pending
        try:
            left = writer.poll()
        except BulkWriteError as exc:
            self._broken(exc, [])
            return False
        return left == 0 and not self.pending

    def _broken(self, exc: BulkWriteError, extra: list[tuple[list[Entry], tuple[str, ...]]]) -> None:
        """The session failed: fall back to PutChunks when nothing was acked yet, else fail this server."""
        session = self.session
        writer = self.writer
        unacked = [(cast("list[Entry]", b.payload), b.route) for b in (writer.unacked() if writer is not None else [])] + extra
        acked = writer.acked_batches if writer is not None else 0
        if writer is not None:
            writer.close()
        self.broken = True
        fatal = exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED)
        if acked == 0 and not fatal and not session.abort.is_set():
            session.stats.bulk_fallbacks += 1
            session.stats.fallback_reasons[self.server] = str(exc)
            fallback = session.grpc_target(self.server)
            if isinstance(fallback, _GrpcTarget):
                self.grpc = fallback
        else:
            session.fail(self.server, exc.code, str(exc), stop=True)
        self._hand_on(unacked)

    def _hand_on(self, batches: list[tuple[list[Entry], tuple[str, ...]]]) -> None:
        """Chunks this session will not deliver over bulk: to PutChunks (after a fallback) and, for a
        chain PUT, directly to its hops."""
        for entries, route in batches:
            if self.grpc is not None:
                for entry in entries:
                    self.grpc.add(entry)
            for hop in route:
                self.session.resend(entries, hop)

    def _on_acks(self, batch: WriteBatch, acks: list[tuple[int, str, int]], replicas: int) -> None:
        """The reader thread: count acks, record errors, queue a chain hop's misses for a direct send."""
        session = self.session
        servers = (self.server, *batch.route)
        entries = cast("list[Entry]", batch.payload)
        ledger = session.ledger
        for k, entry in enumerate(entries):
            cid = entry[0].id
            for r in range(replicas):
                status, message, free = acks[k * replicas + r]
                server = servers[r]
                if status in ACK_OK:
                    ledger.ack(cid, server)
                elif r > 0 and status == FAILED:
                    session.chain_miss(entry, server, message)
                else:
                    if status == FULL and free and "free" not in message:
                        message = f"{message} ({free} bytes free)"
                    code = ACK_CODES.get(status, grpc.StatusCode.UNKNOWN)
                    session.fail(server, code, message, stop=status != CORRUPT_IN_TRANSIT)

    def end(self) -> None:
        if self.writer is not None and not self.broken:
            self.writer.close(goodbye=True)
        if self.grpc is not None:
            self.grpc.end()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _ChainGroup:
    """Chunks with the same replica set, batched and sent down a chain whose head turns per PUT."""

    def __init__(self, session: SendSession, servers: tuple[str, ...]) -> None:
        self.session = session
        self.servers = servers
        self.pending: list[Entry] = []
        self.pending_bytes = 0
        self.turn = 0

    def add(self, entry: Entry) -> None:
        self.pending.append(entry)
        self.pending_bytes += entry[2]
        if self.pending_bytes >= self.session.options.batch_bytes or len(self.pending) >= MAX_PUT_ITEMS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        entries, self.pending, self.pending_bytes = self.pending, [], 0
        session = self.session
        live = [s for s in self.servers if not session.stops(s)]
        bulk = [s for s in live if session.chainable(s)]
        if session.stats.chain_off or len(bulk) < 2:
            for s in live:
                session.target(s).put_direct(entries)
            return
        k = self.turn % len(bulk)
        self.turn += 1
        order = bulk[k:] + bulk[:k]
        head = cast(_BulkTarget, session.target(order[0]))
        hops = tuple(order[1:])
        head.put(entries, hops, [cast(_BulkTarget, session.target(s)).address for s in hops])
        for s in live:
            if s not in bulk:  # a replica over PutChunks gets its copy directly
                session.target(s).put_direct(entries)


class _FailedTarget:
    """A server that cannot be sent to at all (not a member)."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.sent_bytes = 0

    def add(self, entry: Entry) -> None:
        pass

    def put_direct(self, entries: list[Entry]) -> None:
        pass

    def end(self) -> None:
        pass


# ------------------------------------------------------------------ the session


class SendSession:
    """Deliver chunks to their replicas; see the module docstring. One producer thread calls
    ``submit`` and ``finish``; acks arrive on the transports' threads."""

    def __init__(self, view: ClusterView, ledger: AckLedger, options: SendOptions, progress: Callable[[int], None]) -> None:
        self.view = view
        self.ledger = ledger
        self.options = options
        self.progress = progress
        self.abort = threading.Event()
        self.stats = SendStats()
        view_options = view.options
        self.token: str | None = view_options.token
        tls = bool(getattr(view_options, "tls", False) or getattr(view_options, "tls_ca", None)
                   or getattr(view_options, "tls_cert", None))
        self._bulk = options.bulk and not tls
        self._targets: dict[str, _BulkTarget | _GrpcTarget | _FailedTarget] = {}
        self._groups: dict[tuple[str, ...], _ChainGroup] = {}
        self._failures: dict[str, Failure] = {}
        self._stopped: set[str] = set()
        self._resend: deque[tuple[Entry, str]] = deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._last_report = 0.0
        self._closed = False

    # ------------------------------------------------------------ targets

    def target(self, server: str) -> _BulkTarget | _GrpcTarget | _FailedTarget:
        found = self._targets.get(server)
        if found is None:
            member = self.view.members.get(server)
            address = member.bulk_address if member is not None and self._bulk else ""
            found = _BulkTarget(self, server, address) if address else self.grpc_target(server)
            self._targets[server] = found
        return found

    def grpc_target(self, server: str) -> _GrpcTarget | _FailedTarget:
        try:
            client = self.view.server_client(server)
        except ClientError as exc:
            self.fail(server, exc.code, str(exc), stop=True)
            return _FailedTarget(server)
        return _GrpcTarget(self, server, client)

    def chainable(self, server: str) -> bool:
        t = self.target(server)
        return isinstance(t, _BulkTarget) and t.chains

    def stops(self, server: str) -> bool:
        """Nothing more goes to ``server`` (a failure that another chunk would repeat)."""
        if server in self._stopped:
            return True
        t = self._targets.get(server)
        if isinstance(t, _GrpcTarget) and t.failure is not None:
            return True
        if isinstance(t, _BulkTarget) and t.grpc is not None and t.grpc.failure is not None:
            return True
        return False

    def fail(self, server: str, code: grpc.StatusCode | None, message: str, *, stop: bool) -> None:
        """Record a failure of ``server`` (any thread); the first one stays, unless a stopping one follows."""
        with self._changed:
            old = self._failures.get(server)
            if old is None or (code in _STOPPING and old[0] not in _STOPPING):
                self._failures[server] = (code, message)
            if stop:
                self._stopped.add(server)
            self._changed.notify_all()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def resend(self, entries: list[Entry], server: str) -> None:
        """Send these chunks to ``server`` directly (any thread; the producer does it)."""
        with self._changed:
            self._resend.extend((e, server) for e in entries)
            self._changed.notify_all()

    def chain_miss(self, entry: Entry, server: str, why: str) -> None:
        with self._changed:
            self._resend.append((entry, server))
            self.stats.chain_resent += 1
            if not self.stats.chain_off:
                self.stats.chain_off = why
            self._changed.notify_all()

    def _drain_resend(self) -> None:
        while True:
            with self._lock:
                if not self._resend:
                    return
                entry, server = self._resend.popleft()
            if not self.stops(server):
                self.target(server).add(entry)

    # ------------------------------------------------------------ the interface

    def submit(self, chunk: ChunkData, servers: Sequence[str]) -> None:
        """Queue ``chunk`` for every server of ``servers`` not failed yet; blocks while their windows are full."""
        if self._closed:
            raise RuntimeError("this SendSession is closed")
        self._drain_resend()
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
        entry: Entry = (chunk, item, nbytes)
        if self.options.chain and len(live) > 1 and not self.stats.chain_off and all(self.chainable(s) for s in live):
            key = tuple(sorted(live))
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _ChainGroup(self, key)
            group.add(entry)
        else:
            for s in live:
                self.target(s).add(entry)
        self._report()

    def failed(self) -> dict[str, Failure]:
        """Servers whose stream failed so far, with the gRPC code and the message."""
        with self._lock:
            out = dict(self._failures)
        for server, t in list(self._targets.items()):
            g = t if isinstance(t, _GrpcTarget) else t.grpc if isinstance(t, _BulkTarget) else None
            if g is not None and g.failure is not None and server not in out:
                out[server] = g.failure
        return out

    def finish(self) -> dict[str, Failure]:
        """Flush, wait for every ack (each counted in the ledger), end the streams; the failures."""
        if self._closed:
            raise RuntimeError("this SendSession is closed")
        while True:  # bulk sessions first: their failures may hand chunks to PutChunks or to other servers
            for group in list(self._groups.values()):
                group.flush()
            self._drain_resend()
            busy = False
            for t in list(self._targets.values()):
                if isinstance(t, _BulkTarget) and not t.settle():
                    busy = True
            with self._changed:
                if not busy and not self._resend:
                    break
                self._changed.wait(self.options.progress_interval_s)
            self._report()
        for t in self._targets.values():
            t.end()
        for t in list(self._targets.values()):
            g = t if isinstance(t, _GrpcTarget) else t.grpc if isinstance(t, _BulkTarget) else None
            if g is None:
                continue
            while g.stream.thread.is_alive():
                g.stream.thread.join(timeout=self.options.progress_interval_s)
                self._report()
        self._report(force=True)
        self._closed = True
        return self.failed()

    def close(self) -> None:
        """Abort everything still in flight (what was acked stays acked)."""
        self.abort.set()
        for t in list(self._targets.values()):
            if isinstance(t, _BulkTarget):
                t.abort()
        for t in list(self._targets.values()):
            g = t if isinstance(t, _GrpcTarget) else t.grpc if isinstance(t, _BulkTarget) else None
            if g is not None:
                g.stream.thread.join(timeout=10)
        self._closed = True

    def __enter__(self) -> SendSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sent_bytes(self) -> int:
        return sum(t.sent_bytes for t in list(self._targets.values()))

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= self.options.progress_interval_s:
            self._last_report = now
            self.stats.grpc_bytes = sum(t.sent_bytes for t in self._targets.values() if isinstance(t, _GrpcTarget)) + sum(
                t.grpc.sent_bytes for t in self._targets.values() if isinstance(t, _BulkTarget) and t.grpc is not None)
            self.progress(self.sent_bytes)


# ------------------------------------------------------------------ send_round (the round-based caller)


class _ClientsOnly:
    """A view without bulk addresses: every server over PutChunks through ``clients``."""

    def __init__(self, clients: Callable[[str], ParamServerClient]) -> None:
        self._clients = clients
        self.members: dict[str, pb.Member] = {}
        self.options = SimpleNamespace(token=None, tls=False, tls_ca=None, tls_cert=None)

    def server_client(self, server: str) -> ParamServerClient:
        return self._clients(server)


def _view_for(clients: Callable[[str], ParamServerClient]) -> ClusterView:
    owner = getattr(clients, "__self__", None)
    if isinstance(owner, ClusterView) and getattr(clients, "__func__", None) is ClusterView.server_client:
        return owner  # view.server_client: the view knows the bulk addresses too
    return cast(ClusterView, _ClientsOnly(clients))


def send_round(
    sends: Mapping[str, Sequence[str]],
    targets: Mapping[str, Sequence[str]],
    order: Sequence[str],
    fetch: Callable[[str], ChunkData],
    clients: Callable[[str], ParamServerClient],
    ledger: AckLedger,
    options: SendOptions,
    progress: Callable[[int], None],
) -> dict[str, Failure]:
    """Send every item of ``order`` that has targets to those servers; return failed servers' errors.

    A :class:`SendSession` does the work: bulk write sessions when ``clients`` is a ClusterView's
    ``server_client`` (the view knows the bulk addresses), PutChunks otherwise.
    ``progress(bytes handed to the transports so far)`` is called from this thread, which
    also runs ``fetch``; an exception from either cancels everything in flight.
    """
    with SendSession(_view_for(clients), ledger, options, progress) as session:
        for cid in order:
            servers = [s for s in targets.get(cid, ()) if s in sends and not session.stops(s)]
            if not servers:
                continue
            session.submit(fetch(cid), servers)
        return session.finish()


__all__ = ["ACKED", "SendOptions", "SendSession", "SendStats", "ServerStream", "send_round"]
