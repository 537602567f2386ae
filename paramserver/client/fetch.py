"""The one chunk-fetch engine: the planner's decisions carried out over a transport into a sink.

``FetchEngine.fetch(refs, placement, members, sink)`` reads every chunk of ``refs`` (distinct
ids from a manifest proven by its content id) from its replicas and hands each verified chunk
to ``sink``. The decisions -- which replica, what after a failure -- come from the pure
:class:`paramserver.client.fetch_plan.FetchPlanner`; this module only does the I/O: reads run on
a few threads per replica (a lane each), arrivals are verified (:class:`Verifier`) and become
planner events.

A sink receives the bytes straight into their destination when it can (``region``: the place
of a raw chunk in a tensor, a file's pages), and otherwise gets verified raw bytes to copy
(``write``): host tensors (``paramserver.client.sinks``), a ``.safetensors`` file, the worker's
tensors, pinned staging and cache.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from chunking.chunk_table import collector_paused
from chunking.errors import ChunkCorrupt
from chunking.hashing import Buffer, bytes_like
from chunking.manifest import ChunkRef
from paramserver.client.errors import ChunkDataLoss, ChunkUnavailable
from paramserver.client.fetch_plan import (
    Decision,
    Event,
    FetchPlanner,
    GiveUp,
    Landed,
    Read,
    ReadEnded,
    ReadFailed,
    Refused,
    ReportCorrupt,
    Want,
)
from paramserver.client.transport import ChunkTransport, ReadBroken
from paramserver.client.verify import Arrival, Verifier


class ChunkSink(Protocol):
    def region(self, ref: ChunkRef) -> memoryview | None:
        """Where a raw chunk's bytes may be received directly (its whole destination), or None."""

    def landed_in_place(self, chunks: Sequence[tuple[ChunkRef, memoryview]]) -> None:
        """The bytes received into each ``region`` (what ``region(ref)`` gave) verified: those chunks
        count from now on (a batch that arrived together)."""

    def write(self, ref: ChunkRef, raw: Buffer) -> None:
        """Verified raw bytes of ``ref``; a view of a buffer reused after the call: copy what must stay."""


@dataclass
class FetchStats:
    chunks: int = 0
    stored_bytes: int = 0
    reads: int = 0
    failovers: int = 0
    corrupt_reports: int = 0
    by_server: dict[str, int] = field(default_factory=dict)
    in_place: int = 0  # chunks received straight into their destination
    extra_bytes: int = 0  # stored bytes read from extra copies of hot chunks (not ring replicas)


@dataclass(frozen=True)
class EngineOptions:
    max_read_bytes: int = 64 << 20
    call_timeout_s: float = 10.0  # a read's deadline: this, plus its bytes at min_bytes_per_s
    min_bytes_per_s: float = 50e6  # a replica slower than this is treated as failed and left
    max_lanes: int = 16
    # Pause the cyclic garbage collector while a fetch runs (chunking.chunk_table.collector_paused):
    # a fetch makes a few acyclic objects per chunk, and at 4 KiB chunks the collector's passes
    # over them took a third of a load.
    pause_collector: bool = True


Report = Callable[[str, tuple[str, ...], str], None]  # (server, chunk ids, reason): tell the server


class _Fetch:
    def __init__(self, engine: FetchEngine, refs: Sequence[ChunkRef], placement: Callable[[str], Sequence[str]],
                 members: Sequence[str], sink: ChunkSink, tensors_of: Callable[[ChunkRef], Sequence[str]] | None,
                 verifier: Verifier, extras: Callable[[str], Sequence[str]] | None = None, salt: int = 0) -> None:
        self.engine = engine
        self.verifier = verifier
        self.sink = sink
        self.tensors_of = tensors_of
        self.refs = {r.id: r for r in refs}
        wants = [Want(r.id, r.stored_size, tuple(placement(r.id)), tuple(extras(r.id)) if extras is not None else ())
                 for r in refs]
        self.extras = {w.id: frozenset(w.extras) - frozenset(w.replicas) for w in wants if w.extras}
        self.planner = FetchPlanner(wants, list(members), engine.reads_per_server, engine.options.max_read_bytes, salt)
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)
        self.queues: dict[str, collections.deque[Read]] = {}
        self.lanes: dict[str, int] = {}
        self.error: BaseException | None = None
        self.stats = FetchStats()
        self.direct: dict[str, memoryview] = {}  # chunk id -> the destination it is being received into
        self.pool = ThreadPoolExecutor(max_workers=engine.options.max_lanes, thread_name_prefix="fetch")

    # ---------------------------------------------------------------- driving the planner

    def run(self) -> FetchStats:
        try:
            with self.lock:
                self._apply(self.planner.start())
                while not self.planner.done and self.error is None:
                    self.finished.wait(0.5)
                error = self.error
        finally:
            with self.lock:
                if self.error is None and not self.planner.done:
                    self.error = RuntimeError("fetch abandoned")
                for q in self.queues.values():
                    q.clear()
            self.pool.shutdown(wait=True)
        if error is not None:
            raise error
        self.stats.failovers = self.planner.failovers
        return self.stats

    def _step(self, event: Event) -> None:
        with self.lock:
            self._apply(self.planner.step(event))

    def _apply(self, decisions: list[Decision]) -> None:
        """Carry out decisions; called with the lock held."""
        for d in decisions:
            if isinstance(d, Read):
                self.queues.setdefault(d.server, collections.deque()).append(d)
                self._start_lanes(d.server)
            elif isinstance(d, ReportCorrupt):
                self.stats.corrupt_reports += len(d.ids)
                if self.engine.report is not None:
                    self.pool.submit(self._report, d)
            elif isinstance(d, GiveUp) and self.error is None:
                ref = self.refs[d.chunk_id]
                tensors = tuple(self.tensors_of(ref)) if self.tensors_of else ()
                cls = ChunkDataLoss if d.data_loss else ChunkUnavailable
                self.error = cls(d.chunk_id, d.attempts, tensors)
        if self.planner.done or self.error is not None:
            self.finished.notify_all()

    def _report(self, d: ReportCorrupt) -> None:
        try:
            assert self.engine.report is not None
            self.engine.report(d.server, d.ids, d.reason)
        except Exception:  # noqa: BLE001 - best effort: the scrubber finds bad copies too
            pass

    def _start_lanes(self, server: str) -> None:
        want = min(self.engine.reads_per_server(server), len(self.queues[server]) + self.lanes.get(server, 0))
        while self.lanes.get(server, 0) < want:
            self.lanes[server] = self.lanes.get(server, 0) + 1
            self.pool.submit(self._lane, server)

    # ---------------------------------------------------------------- I/O

    def _lane(self, server: str) -> None:
        while True:
            with self.lock:
                queue = self.queues.get(server)
                if self.error is not None or not queue:
                    self.lanes[server] -= 1
                    return
                read = queue.popleft()
                skip = server in self.planner.down()
            if skip:
                self._step(ReadFailed(read.read, f"{server} failed earlier in this fetch"))
                continue
            try:
                self._read(read)
            except BaseException as exc:  # noqa: BLE001 - fatal: handed to the waiting thread
                with self.lock:
                    if self.error is None:
                        self.error = exc
                    self.finished.notify_all()

    def _into(self, chunk_id: str, codec: str, stored_size: int) -> memoryview | None:
        ref = self.refs.get(chunk_id)
        if ref is None or codec != "raw" or ref.codec != "raw" or stored_size != ref.stored_size:
            return None
        region = self.sink.region(ref)
        if region is not None:
            self.direct[chunk_id] = region
        return region

    def _read(self, read: Read) -> None:
        options = self.engine.options
        timeout = options.call_timeout_s + read.nbytes / options.min_bytes_per_s
        with self.lock:
            self.stats.reads += 1
        batches = self.engine.transport.read(read.server, read.ids, self._into, timeout)
        asked = frozenset(read.ids)  # a read names up to max_read_bytes of chunks: thousands of small ones
        try:
            for arrivals in batches:
                if self.error is not None:
                    return
                self._arrive(read, asked, arrivals)
        except ReadBroken as exc:
            self._step(ReadFailed(read.read, f"{exc.reason}", exc.replica_down))
            return
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        self._step(ReadEnded(read.read))

    def _arrive(self, read: Read, asked: frozenset[str], arrivals: Sequence[Arrival]) -> None:
        """One batch that arrived together: verified, handed to the sink and told to the planner in
        one step each, so a chunk of 4 KiB costs little more than its bytes."""
        refs, direct, verifier, sink = self.refs, self.direct, self.verifier, self.sink
        landed: list[str] = []
        in_place: list[tuple[ChunkRef, memoryview]] = []
        refused: list[Refused] = []
        nbytes = extra_bytes = 0
        extras = self.extras
        for arrival in arrivals:
            ref = refs.get(arrival.id)
            if ref is None or arrival.id not in asked:
                continue  # not asked for: never trusted
            if not arrival.ok:
                refused.append(Refused(read.read, arrival.id, arrival.message[:300], corrupt=arrival.corrupt))
                continue
            try:
                region = direct.pop(arrival.id, None)
                if region is not None and arrival.data is region:
                    verifier.check_in_place(ref, arrival, region)
                    in_place.append((ref, region))
                else:
                    sink.write(ref, verifier.raw(ref, arrival))
            except ChunkCorrupt as exc:
                # Bytes that fail the manifest's checks never count; that replica is told.
                refused.append(Refused(read.read, arrival.id, f"corrupt bytes ({exc.reason})", corrupt=True, report=True))
                continue
            landed.append(arrival.id)
            data = arrival.data
            size = data.nbytes if type(data) is memoryview else len(memoryview(bytes_like(data)))
            nbytes += size
            if extras and read.server in extras.get(arrival.id, ()):
                extra_bytes += size
        if in_place:
            sink.landed_in_place(in_place)
        with self.lock:
            if landed:
                stats = self.stats
                stats.chunks += len(landed)
                stats.in_place += len(in_place)
                stats.stored_bytes += nbytes
                stats.by_server[read.server] = stats.by_server.get(read.server, 0) + nbytes
                stats.extra_bytes += extra_bytes
                self._apply(self.planner.step(Landed(read.read, tuple(landed))))
            for event in refused:
                self._apply(self.planner.step(event))


class FetchEngine:
    """Thread-safe; one per client. ``transport``: how bytes move; ``verifier``: how they are checked."""

    def __init__(self, transport: ChunkTransport, verifier: Verifier, *, options: EngineOptions = EngineOptions(),
                 reads_per_server: Callable[[str], int] = lambda _s: 1, report: Report | None = None) -> None:
        self.transport = transport
        self.verifier = verifier
        self.options = options
        self.reads_per_server = reads_per_server
        self.report = report

    def fetch(self, refs: Sequence[ChunkRef], placement: Callable[[str], Sequence[str]], members: Sequence[str],
              sink: ChunkSink, *, verifier: Verifier | None = None,
              tensors_of: Callable[[ChunkRef], Sequence[str]] | None = None,
              extras: Callable[[str], Sequence[str]] | None = None, salt: int = 0) -> FetchStats:
        """Fetch ``refs`` (distinct ids) into ``sink``; raises ChunkUnavailable / ChunkDataLoss naming
        the first chunk no replica could serve intact, or what the sink or transport raised.
        ``extras(id)``: servers with an extra copy of a hot chunk (read from as readily as its
        replicas; ``salt`` orders them on ties, vary it per fetch)."""
        if not refs:
            return FetchStats()
        with collector_paused(self.options.pause_collector):
            return _Fetch(self, refs, placement, members, sink, tensors_of, verifier or self.verifier, extras, salt).run()


__all__ = ["ChunkSink", "EngineOptions", "FetchEngine", "FetchStats"]
