"""Fill a model's destination tensors: cache tiers first, then coalesced streams from the cluster.

Chunks are taken in heatmap order when the servers have a heatmap for the version (else manifest
order). Each verified chunk is written straight into its destination tensors: on CPU by one copy
from the received (or cached) bytes into the tensor's memory; on CUDA through the reused pinned
staging pool and a ``non_blocking`` copy on a side stream. ``TensorReadiness`` marks each tensor
usable as soon as its own chunks have landed. Chunks fetched from the network fill the cache.

The fetch itself is the client's one engine (``ClusterClient.fetch``); the prefetcher is its
sink. When the load owns fresh CPU targets (``private_targets``), a raw chunk that fills one
tensor region whole is received straight into it and verified there. On CPU the memory tier
then holds a view of the loaded tensor's bytes, not a copy (a loaded model is never in memory
twice), with the chunk's CRC32C: a later hit is re-verified before it is copied, so a tensor
the user changed in place never leaks into another load; those views are one entry of the tier
(``worker.tiered_cache.HeldGroup``), made when the load ends. On CUDA the tier holds one host copy.

When those views are of a host arena (``paramserver.client.hostmem``) and every tensor of that
load is gone, a later load of the same manifest is given the arena itself (``TieredCache.adopt``,
``hostmem.retarget``): each held chunk is re-verified where it lies and nothing is
copied; a chunk that fails (the user wrote into the old tensor) is fetched again into place.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from chunking.chunk_table import ChunkRows, collector_paused
from chunking.codec import as_u8
from chunking.hashing import Buffer, crc32c
from chunking.manifest import ChunkRef, Manifest
from paramserver.client.hostmem import ArenaView
from worker.chunk_writer import ChunkWriter
from worker.config import PrefetchConfig
from worker.heatmap import HeatmapRecorder, HeatReport, prefetch_order
from worker.readiness import TensorReadiness
from worker.staging import COMPLETED, StagingPool
from worker.tiered_cache import HeldChunk, HeldGroup, Locate, TieredCache

# A local source of raw chunk bytes (e.g. the tensors of the version being replaced); it must
# return only bytes it has verified against the chunk id, or None.
LocalSource = Callable[[ChunkRef], Buffer | None]

# "network": the servers; "peer": other workers of the cluster (paramserver.client.swarm_fetch).
TIERS = ("network", "peer", "memory", "disk", "local")
HIT_THREADS = max(1, min(4, os.cpu_count() or 1))
HIT_BLOCK = 32  # chunks a hit-landing thread takes at a time (one lookup, one landing), roughly in fetch order
TRUSTED_BATCH = 1024  # chunks of a private arena given back landed at a time (each batch readies its tensors)


@dataclass
class LoadCounters:
    """Bytes and chunks per source. ``bytes`` are raw (decoded) bytes written into tensors;
    ``network_stored_bytes`` are the bytes that crossed the wire from the servers (a peer's bytes
    are counted under ``bytes["peer"]`` only: the servers' share is what fan-out saves)."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    chunks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    network_stored_bytes: int = 0
    failovers: int = 0
    corrupt_reports: int = 0
    first_tensor_s: float | None = None


class SwarmFetch(Protocol):
    """What a load needs of the process's swarm (``paramserver.client.swarm_fetch.Swarm``)."""

    def fetch(self, manifest_id: str, chunks: ChunkRows, sink: Any, *, algorithm: str = "blake3",
              tensors_of: Callable[[int], Sequence[str]] | None = None) -> Any: ...


class ShelfEntry(Protocol):
    """One load on the peer shelf (``worker.peer_shelf.LoadEntry``): its chunks become servable to
    other workers as they land."""

    def landed(self, rows: np.ndarray) -> None: ...

    def keep(self, row: int, raw: bytes) -> None: ...

    def end(self, complete: bool) -> None: ...


def unique_order(manifest: Manifest, heat: HeatReport | None) -> np.ndarray:
    """Distinct chunks in fetch order, as the first row of each id: the heatmap's first (earliest
    first access first), then manifest order; each id where the order first reaches it."""
    table = manifest.chunks
    if heat is None:
        return table.first_rows  # manifest order, each id once
    order = np.asarray(prefetch_order(heat, range(len(table))), dtype=np.int64)
    firsts = table.first_of[order]
    _, at = np.unique(firsts, return_index=True)  # each id at its first position
    return firsts[np.sort(at)]


class Prefetcher:
    """One load of one manifest into ``targets``. ``run()`` blocks until every chunk landed (or raises)."""

    def __init__(
        self,
        manifest: Manifest,
        targets: Mapping[str, torch.Tensor],
        *,
        client: Any | None = None,  # paramserver.client.session.ClusterClient; None = cache/local only
        cache: TieredCache | None = None,
        config: PrefetchConfig = PrefetchConfig(),
        version: int | None = None,
        heat: HeatReport | Callable[[], HeatReport | None] | None = None,
        local: LocalSource | None = None,
        recorder: HeatmapRecorder | None = None,
        pool: StagingPool | None = None,
        on_progress: Callable[[int], None] | None = None,
        private_targets: bool = False,
        arena: ArenaView | None = None,
        adopted: HeldGroup | None = None,
        private_arena: bool = False,
        swarm: SwarmFetch | None = None,
        shelf_entry: ShelfEntry | None = None,
    ) -> None:
        """``heat``: the version's heatmap, or a function that gives it (asked only when some chunk
        must come from the network: it orders the fetch). ``arena``: where ``targets`` lie in a
        host arena (the memory tier then holds slices of it). ``adopted``: the held group whose
        arena ``targets`` were made on (``hostmem.retarget``): its chunks are verified in place
        instead of copied, or, when the group is private, taken as they are.
        ``private_arena``: ``targets`` are never handed to the caller (``worker.upload``): the
        group the tier keeps of this load is private. ``swarm``: the process's swarm (chunks from
        peers and servers) instead of ``client.fetch``; ``shelf_entry``: this load on the peer
        shelf, told of every chunk that lands (``_share``), ended when ``run()`` finishes."""
        self.manifest = manifest
        self.config = config.validate()
        self.client = client
        self.swarm = swarm
        self.shelf_entry = shelf_entry
        self.cache = cache
        self.version = manifest.version if version is None else version
        self.heat = heat
        self.local = local
        self.recorder = recorder or HeatmapRecorder(manifest.model, self.version)
        self.on_progress = on_progress
        self.private_targets = private_targets
        self.readiness = TensorReadiness({t.name: manifest.plan.tensor_chunks[i] for i, t in enumerate(manifest.tensors)})
        self.writer = ChunkWriter(manifest, targets, self.readiness, self.config, pool, arena)
        self.counters = LoadCounters()
        self._table = manifest.chunks
        self._lock = threading.Lock()
        self._done = np.zeros(len(self._table), dtype=bool)  # by first row: landed (no region is offered again)
        self._disk_queue: queue.Queue[tuple[str, bytes] | None] | None = None
        self._disk_thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        # The memory tier holds this load's tensors (views of their bytes, one entry charged the
        # whole model: a view keeps all of that memory alive) when they fit its budget.
        self._adopted = adopted
        # Where a chunk received in place goes: one slice of the arena, when there is one.
        self._region: Locate = self.writer.arena_locate or self.writer.region
        self._group = adopted or HeldGroup(manifest.id, arena, table=self._table, locate=self._region,
                                           crcs=self._table.crc32c)
        # A group given back is trusted only if private; it stays private only if this load hands
        # nothing out either, and a group becomes private only once a load has verified or
        # written every chunk it holds (run() succeeded).
        self._trusted = adopted is not None and adopted.private
        self._private_arena = private_arena
        self._group.private = self._trusted and private_arena
        # A model larger than the memory tier goes around it (a scan): copies of its chunks would
        # take the tier's whole budget on top of the loaded model, and a load reads a model in
        # order, so the next load of it would evict each copy before reaching it.
        self._views = cache is not None and cache.memory.capacity_bytes >= manifest.raw_bytes
        for i, t in enumerate(manifest.tensors):
            if manifest.plan.tensor_chunks[i]:
                self.readiness.on_ready(t.name, self._first_ready)

    def _first_ready(self, _name: str) -> None:
        with self._lock:
            if self.counters.first_tensor_s is None:
                self.counters.first_tensor_s = time.perf_counter() - self._t0

    def _land(self, rows: np.ndarray, tier: str, raws: Sequence[Buffer] | None = None) -> None:
        """The chunks of ``rows`` (each its id's first row) are verified: write their bytes wherever
        the manifest uses them -- ``raws``, or (None) the bytes received in place at those rows --
        and count them; one lock of each structure per batch."""
        table, write = self._table, self.writer.write
        repeats = table.repeats
        self._done[rows] = True
        seen = rows
        if raws is None:
            if repeats:  # the same bytes used again elsewhere: copied from where they landed
                again: list[int] = []
                for row in rows.tolist():
                    others = repeats.get(row)
                    if others:
                        view = self._region(row)
                        assert view is not None
                        for index in others[1:]:
                            write(index, view)
                        again += others[1:]
                if again:
                    seen = np.concatenate([rows, np.array(again, dtype=np.int64)])
            self.readiness.mark_landed_many(rows, COMPLETED)
        else:
            written: list[int] = []
            for row, raw in zip(rows.tolist(), raws):
                for index in table.rows_of(row):
                    write(index, raw)
                    written.append(index)
            seen = np.array(written, dtype=np.int64)
        self.recorder.record_many(seen)
        raw_bytes = int(table.raw_size[seen].sum())
        with self._lock:
            self.counters.bytes[tier] += raw_bytes
            self.counters.chunks[tier] += len(seen)
        if self.on_progress is not None:
            self.on_progress(raw_bytes)

    # -------------------------------------------------------------- the engine's sink

    def regions(self, rows: np.ndarray) -> Sequence[memoryview | None] | None:
        if not self.private_targets:
            return None
        done = self._done[rows].tolist()
        at = self.writer.arena_at
        if at is None:
            region = self.writer.region
            return [None if d else region(row) for row, d in zip(rows.tolist(), done)]
        view = self.writer.arena.view if self.writer.arena is not None else None
        assert view is not None
        return [None if d or a < 0 else view[a : a + n]
                for a, n, d in zip(at[rows].tolist(), self._table.raw_size[rows].tolist(), done)]

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:
        """``source``: "network" (a server) or "peer" (another worker); counted by where it came from."""
        peer = source == "peer"
        self._land(rows, "peer" if peer else "network")
        self._keep_in_place(rows, raw=True)
        self._share(rows)
        if not peer:
            with self._lock:
                self.counters.network_stored_bytes += int(self._table.stored_size[rows].sum())

    def write(self, row: int, raw: Buffer, source: str = "network") -> None:
        peer = source == "peer"
        rows = np.array([row], dtype=np.int64)
        self._land(rows, "peer" if peer else "network", [raw])
        if self._region(row) is not None:  # it lies whole in one CPU tensor: the tier keeps a view
            self._keep_in_place(rows, raw=bool(self._table.raw_rows[row]))
            self._share(rows)
        else:
            copy = self._keep_copy(row, as_u8(raw).data)
            self._share(rows, [copy] if copy is not None else [raw])
        if not peer:
            with self._lock:
                self.counters.network_stored_bytes += int(self._table.stored_size[row])

    def _share(self, rows: np.ndarray, raws: Sequence[Buffer] | None = None) -> None:
        """Tell the peer shelf that ``rows`` landed: in place (the shelf reads them where they lie,
        ``locate``) or, for a chunk that is not (``raws``: on CUDA, or spread over tensors), with a
        copy that stays valid after this call (an immutable ``bytes`` is reused as it is)."""
        entry = self.shelf_entry
        if entry is None:
            return
        if raws is not None:
            region = self._region
            for row, raw in zip(rows.tolist(), raws):
                if region(row) is None:
                    entry.keep(row, raw if isinstance(raw, bytes) else bytes(as_u8(raw).data))
        entry.landed(rows)

    @property
    def locate(self) -> Locate:
        """Where a landed chunk's raw bytes lie whole (a table row -> a view, or None): the peer
        shelf's ``begin_load`` reads landed chunks through it."""
        return self._region

    def _keep_in_place(self, rows: np.ndarray, *, raw: bool) -> None:
        """Fetched chunks that lie in the tensors go in the tiers: on CPU as views of those bytes."""
        if self.cache is None:
            return
        if self._views:
            # Only the rows: the group (one tier entry, held once the load is done) finds their bytes
            # in the arena, never through the tensors, which the tier must not keep alive.
            group = self._group
            with self._lock:
                if not raw:  # the manifest's CRC is of the stored (compressed) bytes: keep the raw bytes' own
                    for row in rows.tolist():
                        view = self._region(row)
                        assert view is not None
                        group.crc_of[row] = crc32c(view)
                group.mark(rows)
        if self.cache.disk is not None:
            for row in rows.tolist():
                view = self._region(row)
                assert view is not None
                self._to_disk(self._table.ids[row], bytes(view))

    def _keep_copy(self, row: int, view: memoryview) -> bytes | None:
        """A chunk that does not lie whole in one CPU tensor (or a CUDA staging copy): one copy,
        returned (the peer shelf keeps the same one); None when nothing kept it."""
        if self.cache is None:
            return None
        copy = bytes(view)  # a received buffer is reused after this call
        key = self._table.ids[row]
        if self._views:
            self.cache.memory.put(key, copy)
        if self.cache.disk is not None:
            self._to_disk(key, copy)
        return copy

    def _to_disk(self, key: str, data: bytes) -> None:
        # Disk-tier writes happen behind the fetch (write-behind) so file I/O overlaps the streams;
        # run() drains the queue before it returns, so the tier is complete when a load is.
        with self._lock:
            if self._disk_queue is None:
                self._disk_queue = queue.Queue(maxsize=256)
                self._disk_thread = threading.Thread(target=self._drain_disk, name="paramworker-disk-tier", daemon=True)
                self._disk_thread.start()
            q = self._disk_queue
        q.put((key, data))

    def _drain_disk(self) -> None:
        assert self._disk_queue is not None and self.cache is not None and self.cache.disk is not None
        while True:
            item = self._disk_queue.get()
            if item is None:
                return
            try:
                self.cache.disk.put(*item)
            except Exception:  # noqa: BLE001 - a cache write failure costs a refetch later, never the load
                pass

    def _finish_disk(self) -> None:
        if self._disk_queue is not None and self._disk_thread is not None:
            self._disk_queue.put(None)
            self._disk_thread.join()
            self._disk_queue = self._disk_thread = None

    def run(self) -> LoadCounters:
        self._t0 = time.perf_counter()
        ok = False
        try:
            with collector_paused(self.config.pause_collector):
                self._run()
            self._group.private = self._private_arena
            ok = True
        except BaseException as exc:
            for index in range(len(self._table)):
                self.readiness.mark_failed(index, exc)
            raise
        finally:
            if self.shelf_entry is not None:  # peers stop waiting on this load's missing chunks
                self.shelf_entry.end(complete=ok)
            self._finish_disk()
            # Also after a failure: what landed is verified, and a retry is given it.
            if self.cache is not None and self._views and self._group.count():
                self.cache.hold_group(self._group, self.manifest.raw_bytes)
        self.writer.synchronize()
        return self.counters

    def _heat(self) -> HeatReport | None:
        if not self.config.use_heatmap:
            return None
        return self.heat() if callable(self.heat) else self.heat

    def release_targets(self) -> None:
        """Drop this load's references to its targets once it is done (a host-staged load: the
        arena is then used by the memory tier alone, and a later load may be given it)."""
        self.writer.release_targets()

    def _land_trusted(self) -> None:
        """A private group's chunks, given back with its arena, are in place already: land them in
        large batches without a lookup or a re-verification per chunk."""
        assert self._adopted is not None
        rows = self._table.first_rows
        rows = rows[self._adopted.held[rows]]
        for start in range(0, len(rows), TRUSTED_BATCH):
            self._land(rows[start : start + TRUSTED_BATCH], "memory")
            self._share(rows[start : start + TRUSTED_BATCH])
        if self.cache is not None:
            self.cache.touch_group(self._adopted, len(rows))

    def _run(self) -> None:
        cache = self.cache
        if self._trusted:
            self._land_trusted()
            if self._done[self._table.first_rows].all():
                return
        # Chunks the cache does not hold go to the network at once, in a background thread, so
        # the streams run while this thread copies cache hits.
        if cache is None or cache.empty():  # a cold load asks nothing per chunk
            misses = order = unique_order(self.manifest, self._heat())
            misses = misses[~self._done[misses]]  # a trusted group evicted meanwhile landed some
            hits = misses[:0]
        else:
            order = rows = self._table.first_rows
            rows = rows[~self._done[rows]]
            ids = self._table.ids
            held = np.fromiter(cache.contains_many([ids[r] for r in rows.tolist()]), dtype=bool, count=len(rows))
            hits, misses = rows[held], rows[~held]
            if len(misses):  # fetched in heatmap order (hits are local: manifest order)
                order = unique_order(self.manifest, self._heat())
                misses = order[np.isin(order, misses)]
        # The heat this load reports ranks its chunks in the order it asked for them (see HeatmapRecorder).
        rank = np.zeros(len(self._table), dtype=np.int64)
        rank[order] = np.arange(len(order), dtype=np.int64)
        self.recorder.rank_as(rank[self._table.first_of])
        if self.local is not None and len(misses):
            misses = misses[[not self._try_local(row) for row in misses.tolist()]]
        net_error: list[BaseException] = []
        net_thread: threading.Thread | None = None
        if len(misses):
            net_thread = threading.Thread(target=self._fetch, args=(misses, net_error), name="paramworker-prefetch", daemon=True)
            net_thread.start()
        late = np.zeros(0, dtype=np.int64)
        try:
            if cache is not None and len(hits):
                late = self._land_hits(cache, hits[~self._done[hits]])
        finally:
            if net_thread is not None:  # also when a hit failed: nothing may write into the targets after run()
                net_thread.join()
        if net_error:
            raise net_error[0]
        if len(late):
            if self.local is not None:
                late = late[[not self._try_local(row) for row in late.tolist()]]
            if len(late):
                self._fetch(late, None)

    def _land_hits(self, cache: TieredCache, hits: np.ndarray) -> np.ndarray:
        """Copy cache hits (rows) into place; returns the rows the cache no longer had.

        Several threads share the work in blocks taken in fetch order: numpy releases the GIL
        while it copies, so one thread's bookkeeping overlaps another's copy.
        """
        late: list[int] = []
        lock = threading.Lock()
        next_block = [0]
        errors: list[BaseException] = []
        ids = self._table.ids

        def worker() -> None:
            try:
                while True:
                    with lock:
                        start = next_block[0]
                        next_block[0] += HIT_BLOCK
                    if start >= len(hits) or errors:
                        return
                    block = hits[start : start + HIT_BLOCK].tolist()
                    placed: list[int] = []  # already where they belong
                    copied: dict[str, tuple[list[int], list[Buffer]]] = {}  # by tier
                    gone: list[int] = []
                    for row, hit in zip(block, cache.get_many([ids[r] for r in block])):
                        value = hit.value
                        if isinstance(value, HeldChunk):
                            if not value.intact():  # the tensor it views was changed in place
                                cache.forget(ids[row], value)
                                value = None
                            elif value.group is self._adopted:
                                placed.append(row)
                                continue
                            else:
                                value = value.view
                        if value is None:  # evicted meanwhile, or dropped by the disk tier's verification
                            gone.append(row)
                        else:
                            rows_, raws = copied.setdefault(hit.tier or "memory", ([], []))
                            rows_.append(row)
                            raws.append(value)
                    if placed:
                        self._land(np.array(placed, dtype=np.int64), "memory")
                        self._share(np.array(placed, dtype=np.int64))
                    for tier, (rows_, raws) in copied.items():
                        self._land(np.array(rows_, dtype=np.int64), tier, raws)
                        self._share(np.array(rows_, dtype=np.int64), raws)
                    if gone:
                        with lock:
                            late.extend(gone)
            except BaseException as exc:  # noqa: BLE001 - handed to the loading thread, which re-raises it
                errors.append(exc)

        threads = [threading.Thread(target=worker, name=f"paramworker-hits-{i}", daemon=True)
                   for i in range(max(0, min(HIT_THREADS, -(-len(hits) // HIT_BLOCK)) - 1))]
        for t in threads:
            t.start()
        worker()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return np.array(sorted(late), dtype=np.int64)

    def _try_local(self, row: int) -> bool:
        assert self.local is not None
        ref = self._table[row]
        raw = self.local(ref)
        if raw is None:
            return False
        self._land(np.array([row], dtype=np.int64), "local", [raw])
        kept: Buffer = raw
        if self.cache is not None and not self.cache.contains(ref.id):
            kept = raw if isinstance(raw, bytes) else as_u8(raw).tobytes()
            self.cache.put(ref.id, kept)
        self._share(np.array([row], dtype=np.int64), [kept])
        return True

    def _fetch(self, rows: np.ndarray, errors: list[BaseException] | None) -> None:
        try:
            chunks = ChunkRows(self._table, rows)
            algorithm, tensors_of = self.manifest.hash_algorithm, self.manifest.tensors_of_chunk
            if self.swarm is not None:  # peers first where they have it, the servers for the rest
                stats = self.swarm.fetch(self.manifest.id, chunks, self, algorithm=algorithm, tensors_of=tensors_of)
            elif self.client is None:
                from chunking.errors import ChunkMissing

                raise ChunkMissing([self._table.ids[r] for r in rows.tolist()])
            else:
                stats = self.client.fetch(chunks, self, algorithm=algorithm, tensors_of=tensors_of)
            with self._lock:
                self.counters.failovers += stats.failovers
                self.counters.corrupt_reports += stats.corrupt_reports
        except BaseException as exc:
            if errors is None:
                raise
            errors.append(exc)


__all__ = ["ChunkWriter", "LoadCounters", "LocalSource", "Prefetcher", "ShelfEntry", "SwarmFetch", "TIERS", "unique_order"]
