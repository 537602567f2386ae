"""The one chunk-fetch engine: the planner's decisions carried out over a transport into a sink.

``FetchEngine.fetch(chunks, wants, members, sink)`` reads every chunk of ``chunks`` (distinct ids,
rows of a manifest's table proven by its content id, in fetch order) from its replicas and hands
each verified chunk to ``sink``. The decisions -- which replica, what after a failure -- come
from the pure :class:`paramserver.client.fetch_plan.FetchPlanner`; this module only does the
I/O: reads run on a few threads per replica (a lane each), arrivals are verified
(:class:`Verifier`) and become planner events.

Chunks are named by their slot (position in the fetch) towards the planner and by their table
row towards the sink, and a batch that arrived together is handled with array operations: no
object or dict entry per chunk, so 4 KiB chunks cost little more than their bytes.

A sink receives the bytes straight into their destination when it can (``regions``: the place
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
from typing import Protocol, cast

import numpy as np

from chunking.chunk_table import ChunkRows, collector_paused
from chunking.errors import ChunkCorrupt
from chunking.hashing import Buffer, bytes_like
from paramserver.client.arrivals import Arrivals, ReadIds
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
    Wants,
    is_peer,
)
from paramserver.client.transport import ChunkTransport, ReadBroken
from paramserver.client.verify import Verifier


class ChunkSink(Protocol):
    def regions(self, rows: np.ndarray) -> Sequence[memoryview | None] | None:
        """For raw chunks about to arrive (their table rows): where each one's bytes may be received
        directly (its whole destination, exactly its size), or None; None for none of them."""

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:
        """The chunks of ``rows`` were received into what ``regions`` gave and verified there: they
        count from now on (a batch that arrived together). Bytes that came from a worker peer are
        told with ``source="peer"`` (a sink that reads from peers takes that keyword)."""

    def write(self, row: int, raw: Buffer, source: str = "network") -> None:
        """Verified raw bytes of the chunk of table row ``row``; a view of a buffer reused after the
        call: copy what must stay. From a peer: ``source="peer"`` as above."""


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
    peer_bytes: int = 0  # bytes landed from worker peers (also in by_server, as peer:ID)

    def add(self, other: FetchStats) -> None:
        """Add ``other``'s counts to these (a client's totals over its fetches)."""
        for name in ("chunks", "stored_bytes", "reads", "failovers", "corrupt_reports", "in_place", "extra_bytes",
                     "peer_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.by_server.items():
            self.by_server[k] = self.by_server.get(k, 0) + v


@dataclass(frozen=True)
class EngineOptions:
    max_read_bytes: int = 64 << 20
    call_timeout_s: float = 10.0  # a read's deadline: this, plus its bytes at min_bytes_per_s
    min_bytes_per_s: float = 50e6  # a replica slower than this is treated as failed and left
    # A worker peer's read deadline, plus its bytes at min_bytes_per_s: a peer holds a read while the
    # chunks it is loading land (paramserver.client.swarm_fetch), but never long; then the servers.
    peer_call_timeout_s: float = 8.0
    max_lanes: int = 16
    # Pause the cyclic garbage collector while a fetch runs (chunking.chunk_table.collector_paused):
    # at 4 KiB chunks the collector's passes over a load's objects took a third of it.
    pause_collector: bool = True


Report = Callable[[str, tuple[str, ...], str], None]  # (server, chunk ids, reason): tell the server
PEER_LANES = 2  # reads in flight per worker peer and fetch (a peer port caps connections per source address)


class _Fetch:
    def __init__(self, engine: FetchEngine, chunks: ChunkRows, wants: Wants, members: Sequence[str], sink: ChunkSink,
                 tensors_of: Callable[[int], Sequence[str]] | None, verifier: Verifier, salt: int = 0) -> None:
        self.engine = engine
        self.verifier = verifier
        # A peer is not trusted with CRCs (it could forge them): its chunks are proven by content id.
        self.peer_verifier = Verifier("content", verifier.algorithm)
        self.sink = sink
        self.tensors_of = tensors_of
        table = chunks.table
        self.table = table
        self.rows = chunks.rows
        # The manifest's columns in slot order, gathered once.
        self.crc = table.crc32c[self.rows]
        self.stored = table.stored_size[self.rows]
        self.raw = table.raw_rows[self.rows]
        self.extras = wants.extras  # slot -> servers with an extra copy of a hot chunk
        self.planner = FetchPlanner(wants, list(members), engine.reads_per_server, engine.options.max_read_bytes, salt)
        self.landed = np.zeros(len(self.rows), dtype=bool)
        self.lock = threading.Lock()
        self.finished = threading.Condition(self.lock)
        self.queues: dict[str, collections.deque[Read]] = {}
        self.lanes: dict[str, int] = {}
        self.error: BaseException | None = None
        self.stats = FetchStats()
        self.pool = ThreadPoolExecutor(max_workers=engine.options.max_lanes, thread_name_prefix="fetch")

    def chunk_id(self, slot: int) -> str:
        return bytes(self.table.digests[int(self.rows[slot])]).hex()  # not the whole table's hex ids

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
                self.stats.corrupt_reports += len(d.slots)
                if is_peer(d.server):  # a worker's bad bytes are not the servers' business
                    if self.engine.peer_report is not None:
                        self.pool.submit(self._peer_report, d.server, tuple(self.chunk_id(s) for s in d.slots), d.reason)
                elif self.engine.report is not None:
                    self.pool.submit(self._report, d.server, tuple(self.chunk_id(s) for s in d.slots), d.reason)
            elif isinstance(d, GiveUp) and self.error is None:
                row = int(self.rows[d.slot])
                tensors = tuple(self.tensors_of(row)) if self.tensors_of else ()
                cls = ChunkDataLoss if d.data_loss else ChunkUnavailable
                self.error = cls(self.chunk_id(d.slot), d.attempts, tensors)
        if self.planner.done or self.error is not None:
            self.finished.notify_all()

    def _report(self, server: str, ids: tuple[str, ...], reason: str) -> None:
        try:
            assert self.engine.report is not None
            self.engine.report(server, ids, reason)
        except Exception:  # noqa: BLE001 - best effort: the scrubber finds bad copies too
            pass

    def _peer_report(self, peer: str, ids: tuple[str, ...], reason: str) -> None:
        try:
            assert self.engine.peer_report is not None
            self.engine.peer_report(peer, ids, reason)
        except Exception:  # noqa: BLE001 - bookkeeping only: the chunk goes to the servers anyway
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

    def _read(self, read: Read) -> None:
        options = self.engine.options
        first = options.peer_call_timeout_s if is_peer(read.server) else options.call_timeout_s
        timeout = first + read.nbytes / options.min_bytes_per_s
        with self.lock:
            self.stats.reads += 1
        rows = self.rows[read.slots]
        raw, stored, sink = self.raw[read.slots], self.stored[read.slots], self.sink

        def into(first: int, ok_raw: np.ndarray, sizes: np.ndarray) -> Sequence[memoryview | None] | None:
            # A raw chunk of the size the manifest says goes straight to its destination.
            end = first + len(sizes)
            if end > len(rows):
                return None
            direct = ok_raw & raw[first:end] & (sizes == stored[first:end])
            if not direct.any():
                return None
            picked = np.flatnonzero(direct)
            given = sink.regions(rows[first + picked])
            if given is None:
                return None
            out: list[memoryview | None] = [None] * len(sizes)
            for k, view in zip(picked.tolist(), given):
                out[k] = view
            return out

        batches = self.engine.transport.read(read.server, ReadIds(self.table.digests[rows]), into, timeout)
        try:
            for arrivals in batches:
                if self.error is not None:
                    return
                self._arrive(read, arrivals)
        except ReadBroken as exc:
            self._step(ReadFailed(read.read, f"{exc.reason}", exc.replica_down))
            return
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        self._step(ReadEnded(read.read))

    def _arrive(self, read: Read, a: Arrivals) -> None:
        """One batch that arrived together: verified, handed to the sink and told to the planner in
        one step each."""
        peer = is_peer(read.server)
        verifier = self.peer_verifier if peer else self.verifier
        source = "peer" if peer else "network"
        positions = a.positions
        fits = (positions >= 0) & (positions < len(read.slots))
        if not fits.all():  # not asked for: never trusted
            keep = np.flatnonzero(fits)
            a = Arrivals(positions[keep], a.ok[keep], a.corrupt[keep], [a.codecs[k] for k in keep.tolist()], a.crcs[keep],
                         [a.data[k] for k in keep.tolist()], a.in_place[keep], [a.messages[k] for k in keep.tolist()])
            positions = a.positions
        slots = read.slots[positions]
        fresh = a.ok & ~self.landed[slots]  # a chunk another read delivered meanwhile is not taken twice
        refused: list[Refused] = []
        for k in np.flatnonzero(~a.ok).tolist():
            refused.append(Refused(read.read, int(slots[k]), a.messages[k][:300], corrupt=bool(a.corrupt[k])))
        landed = np.zeros(len(slots), dtype=bool)
        placed = np.flatnonzero(fresh & a.in_place)
        in_place = placed[:0]  # items received into their destination that verified there
        if len(placed):
            ps = slots[placed]
            ids = [self.chunk_id(int(s)) for s in ps] if verifier.mode == "content" else ()
            # in_place items' data is the memoryview ``into`` gave
            views = [cast(memoryview, a.data[k]) for k in placed.tolist()]
            good = verifier.check_in_place(self.crc[ps], a.crcs[placed], views, ids)
            in_place = placed[good]
            landed[in_place] = True
            check = "CRC32C or content id" if verifier.mode == "content" else "CRC32C"
            for k in placed[~good].tolist():
                refused.append(Refused(read.read, int(slots[k]), f"corrupt bytes ({check} of the received bytes does not "
                                                                 "match the manifest)", corrupt=True, report=True))
        bounced = np.flatnonzero(fresh & ~a.in_place)
        for k in bounced.tolist():
            slot = int(slots[k])
            row = int(self.rows[slot])
            try:
                raw = verifier.raw(self.table[row], a.codecs[k], int(a.crcs[k]), a.data[k])
            except ChunkCorrupt as exc:
                # Bytes that fail the manifest's checks never count; that replica is told.
                refused.append(Refused(read.read, slot, f"corrupt bytes ({exc.reason})", corrupt=True, report=True))
                continue
            self.sink.write(row, raw, source=source)
            landed[k] = True
        done = np.flatnonzero(landed)
        if len(in_place):
            self.sink.landed_in_place(self.rows[slots[in_place]], source=source)
        nbytes = sum(len(memoryview(bytes_like(a.data[k]))) for k in bounced.tolist() if landed[k])
        nbytes += int(self.stored[slots[in_place]].sum())
        extra_bytes = 0
        if self.extras:
            extras = self.extras
            server = read.server
            for k in done.tolist():
                if server in extras.get(int(slots[k]), ()):
                    extra_bytes += int(self.stored[slots[k]])
        with self.lock:
            if len(done):
                self.landed[slots[done]] = True
                stats = self.stats
                stats.chunks += len(done)
                stats.in_place += len(in_place)
                stats.stored_bytes += nbytes
                stats.by_server[read.server] = stats.by_server.get(read.server, 0) + nbytes
                stats.extra_bytes += extra_bytes
                if peer:
                    stats.peer_bytes += nbytes
                self._apply(self.planner.step(Landed(read.read, slots[done])))
            for event in refused:
                self._apply(self.planner.step(event))


class FetchEngine:
    """Thread-safe; one per client. ``transport``: how bytes move; ``verifier``: how they are checked."""

    def __init__(self, transport: ChunkTransport, verifier: Verifier, *, options: EngineOptions = EngineOptions(),
                 reads_per_server: Callable[[str], int] = lambda _s: 1, report: Report | None = None,
                 peer_report: Report | None = None) -> None:
        self.transport = transport
        self.verifier = verifier
        self.options = options
        self.reads_per_server = reads_per_server
        self.report = report
        self.peer_report = peer_report  # (peer:ID, chunk ids, reason): a worker peer served bad bytes

    def fetch(self, chunks: ChunkRows, wants: Wants, members: Sequence[str], sink: ChunkSink, *,
              verifier: Verifier | None = None, tensors_of: Callable[[int], Sequence[str]] | None = None,
              salt: int = 0) -> FetchStats:
        """Fetch ``chunks`` (distinct ids; ``wants``: their sizes and replicas, slot by slot) into
        ``sink``; raises ChunkUnavailable / ChunkDataLoss naming the first chunk no replica could
        serve intact, or what the sink or transport raised. ``tensors_of(row)`` names a failed
        chunk's tensors; ``salt`` orders the holders of hot chunks on ties (vary it per fetch)."""
        if len(wants) != len(chunks):
            raise ValueError(f"wants describe {len(wants)} chunks, the fetch has {len(chunks)}")
        if not len(chunks):
            return FetchStats()
        with collector_paused(self.options.pause_collector):
            return _Fetch(self, chunks, wants, members, sink, tensors_of, verifier or self.verifier, salt).run()


__all__ = ["PEER_LANES", "ChunkSink", "EngineOptions", "FetchEngine", "FetchStats"]
