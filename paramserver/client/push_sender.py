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

Which chunk goes where, and what a failure changes, is decided by the pure planner
(``paramserver.client.push_send_plan``); this module carries its decisions out, and the gRPC
streams live in ``paramserver.client.push_stream``.

Memory: a chunk is referenced (never copied) until every server it went to acked it, so at most
about ``window x batch_bytes`` per server is held; a 1 GiB model is never held twice.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence, cast

from paramserver.client.bulk_writer import BulkWriter, WriteBatch
from paramserver.client.cluster_view import ClusterView
from paramserver.client.errors import BulkWriteError, ClientError
from paramserver.client.push_plan import AckLedger
from paramserver.client.push_send_plan import (
    Aborted,
    BulkFailed,
    Decision,
    Event,
    Failure,
    Flush,
    NoStream,
    OpenStream,
    Put,
    PutAcked,
    SendPlanner,
    SendStats,
    StreamAcked,
    StreamFailed,
    Submit,
)
from paramserver.client.push_stream import ACKED, ServerStream
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.bulk_frames import DEFAULT_WRITE_WINDOW
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.proto import pb


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


class SendSession:
    """Deliver chunks to their replicas; see the module docstring. One producer thread calls
    ``submit`` and ``finish``; acks arrive on the transports' threads.

    The policy is :class:`~paramserver.client.push_send_plan.SendPlanner`'s: this class feeds it
    what happens (under one lock, from any thread) and carries out its decisions on the producer
    thread, outside the lock (a PUT may block on its window, a stream on its queue).
    """

    def __init__(self, view: ClusterView, ledger: AckLedger, options: SendOptions, progress: Callable[[int], None]) -> None:
        self.view = view
        self.ledger = ledger
        self.options = options
        self.progress = progress
        self.abort = threading.Event()
        view_options = view.options
        self.token: str | None = view_options.token
        tls = bool(getattr(view_options, "tls", False) or getattr(view_options, "tls_ca", None)
                   or getattr(view_options, "tls_cert", None))
        self._bulk = options.bulk and not tls
        self.planner = SendPlanner(ledger, self._bulk_address, batch_bytes=options.batch_bytes, chain=options.chain)
        self._writers: dict[str, BulkWriter] = {}  # live bulk sessions (a failed one is closed and dropped)
        self._streams: dict[str, ServerStream] = {}
        self._bulk_sent = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._last_report = 0.0
        self._closed = False

    @property
    def stats(self) -> SendStats:
        return self.planner.stats

    def _bulk_address(self, server: str) -> str:
        member = self.view.members.get(server)
        return member.bulk_address if member is not None and self._bulk else ""

    # ------------------------------------------------------------ planner in, decisions out

    def _step(self, event: Event) -> list[Decision]:
        with self._changed:
            decisions = self.planner.step(event)
            self._changed.notify_all()
        return decisions

    def _heard(self, event: Event) -> None:
        """An event from a transport's thread: it never calls for a decision (what it needs, e.g. a
        chain hop's misses sent directly, waits in the planner for the producer's next step)."""
        self._step(event)

    def _run(self, decisions: Sequence[Decision]) -> None:
        """Carry out ``decisions`` in order (the producer thread); what one of them fails feeds the
        planner at once, and its decisions run before the rest."""
        for d in decisions:
            if isinstance(d, Put):
                self._put(d)
            elif isinstance(d, OpenStream):
                self._open_stream(d.server)
            else:
                stream = self._streams.get(d.server)
                if stream is not None:  # none: its client could not be made (the planner knows)
                    stream.offer(d.chunk)

    def _put(self, put: Put) -> None:
        with self._lock:
            if not self.planner.current(put.put):
                return  # its session failed after it was planned: its chunks went on elsewhere
        server, options = put.server, self.options
        writer = self._writers.get(server)
        if writer is None:
            try:
                writer = BulkWriter(put.address, self.token, self._on_acks, window=options.window,
                                    connect_timeout_s=options.connect_timeout_s, io_timeout_s=options.io_timeout_s,
                                    ack_timeout_s=options.ack_timeout_s, on_change=self._notify)
            except BulkWriteError as exc:
                self._bulk_failed(server, exc)
                return
            self._writers[server] = writer
            self.stats.bulk_servers.add(server)
        chunks = put.chunks
        try:
            writer.put(chunks, [e.item for e in chunks], [e.chunk.data for e in chunks], put.nbytes, put.route, put.hops,
                       payload=put.put, abort=self.abort)
        except BulkWriteError as exc:
            self._bulk_failed(server, exc)
            return
        replicas = 1 + len(put.route)
        self._bulk_sent += put.nbytes * replicas
        self.stats.bulk_bytes += put.nbytes * replicas
        self.stats.bulk_puts += 1
        if put.route:
            self.stats.chain_puts += 1

    def _bulk_failed(self, server: str, exc: BulkWriteError) -> None:
        writer = self._writers.pop(server, None)
        if writer is not None:
            writer.close()
        self._run(self._step(BulkFailed(server, exc.code, str(exc))))

    def _on_acks(self, batch: WriteBatch, acks: list[tuple[int, str, int]], replicas: int) -> None:
        self._heard(PutAcked(cast(int, batch.payload), acks, replicas))

    def _open_stream(self, server: str) -> None:
        try:
            client = self.view.server_client(server)
        except ClientError as exc:
            self._run(self._step(NoStream(server, exc.code, str(exc))))
            return
        options = self.options
        stream = ServerStream(server, client, queue_items=options.queue_items, stream_bytes=options.stream_bytes,
                              batch_bytes=options.batch_bytes, abort=self.abort,
                              on_acks=lambda ids: self._heard(StreamAcked(server, tuple(ids))),
                              on_failed=lambda code, message: self._heard(StreamFailed(server, code, message)))
        self._streams[server] = stream
        stream.thread.start()
        self.stats.grpc_servers.add(server)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ the interface

    def stops(self, server: str) -> bool:
        """Nothing more goes to ``server`` (a failure that another chunk would repeat)."""
        with self._lock:
            return self.planner.stops(server)

    def submit(self, chunk: ChunkRecord, servers: Sequence[str]) -> None:
        """Queue ``chunk`` for every server of ``servers`` not failed yet; blocks while their windows are full."""
        if self._closed:
            raise RuntimeError("this SendSession is closed")
        self._run(self._step(Submit(chunk, tuple(servers))))
        self._report()

    def failed(self) -> dict[str, Failure]:
        """Servers whose stream failed so far, with the gRPC code and the message."""
        with self._lock:
            return self.planner.failures()

    def finish(self) -> dict[str, Failure]:
        """Flush, wait for every ack (each counted in the ledger), end the streams; the failures."""
        if self._closed:
            raise RuntimeError("this SendSession is closed")
        while True:  # bulk sessions first: their failures may hand chunks to PutChunks or to other servers
            self._run(self._step(Flush()))
            busy = False
            for server, writer in list(self._writers.items()):
                try:
                    left = writer.poll()
                except BulkWriteError as exc:
                    self._bulk_failed(server, exc)
                    busy = True
                    continue
                busy = busy or left > 0
            with self._changed:
                if not busy and self.planner.settled:
                    break
                self._changed.wait(self.options.progress_interval_s)
            self._report()
        for writer in self._writers.values():
            writer.close(goodbye=True)
        for stream in self._streams.values():
            stream.end()
        for stream in list(self._streams.values()):
            while stream.thread.is_alive():
                stream.thread.join(timeout=self.options.progress_interval_s)
                self._report()
        self._report(force=True)
        self._closed = True
        return self.failed()

    def close(self) -> None:
        """Abort everything still in flight (what was acked stays acked)."""
        self.abort.set()
        self._step(Aborted())
        for writer in list(self._writers.values()):
            writer.close()
        for stream in list(self._streams.values()):
            stream.thread.join(timeout=10)
        self._closed = True

    def __enter__(self) -> SendSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def sent_bytes(self) -> int:
        return self._bulk_sent + self._grpc_sent()

    def _grpc_sent(self) -> int:
        return sum(s.yielded_bytes for s in list(self._streams.values()))

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_report >= self.options.progress_interval_s:
            self._last_report = now
            self.stats.grpc_bytes = self._grpc_sent()
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
    fetch: Callable[[str], ChunkRecord],
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


__all__ = ["ACKED", "Failure", "SendOptions", "SendSession", "SendStats", "ServerStream", "send_round"]
