"""What this worker can serve to other workers of its cluster, by chunk id: the shelf behind the peer port.

A chunk id is a content address, so the shelf answers for any version: the chunks of a load still
in progress as soon as they landed (verified), then the memory tier (held loads' views, plain
copies), then the disk tier. Bytes are handed out as memoryviews of wherever they lie (the load's
arena or tensors, the cached bytes): the peer port sends them from there, no copy per read.

A chunk of an ACTIVE load that has not landed yet is waited for, up to the reader's deadline: a
peer that started loading the same version a moment later asks for chunks the seed is about to
have, and an answer a second later beats a round trip to the servers that would have to send them
again. An id that no active load will bring and no tier holds is answered None (MISSING) at once.

Nothing here is trusted by the reader: peers verify every chunk by its content id.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from chunking.hashing import Buffer, bytes_like, crc32c, is_content_id
from paramserver.client.peers import PeerVersion
from paramserver.wire.limits import MAX_PEER_VERSIONS

if TYPE_CHECKING:
    from chunking.chunk_table import ChunkTable
    from worker.tiered_cache import TieredCache

# The versions announced to the cluster's peer directory: at most this many (the servers keep at
# most MAX_PEER_VERSIONS per worker: paramserver.wire.limits).
MAX_VERSIONS = MAX_PEER_VERSIONS
# Completed versions remembered for versions() (those the memory tier still holds whole).
_MAX_COMPLETED = 4 * MAX_VERSIONS

Locate = Callable[[int], "memoryview | None"]


class Found(NamedTuple):
    """A chunk's raw bytes where they lie, and the CRC32C of those bytes."""

    view: memoryview
    crc: int


class LoadManifest(Protocol):
    """What the shelf reads of a manifest (chunking.manifest.Manifest has both)."""

    @property
    def id(self) -> str: ...

    @property
    def chunks(self) -> ChunkTable: ...


class LoadEntry:
    """One load on the shelf. The load calls ``landed``/``keep`` as chunks verify, then ``end``."""

    def __init__(self, shelf: PeerShelf, manifest_id: str, table: ChunkTable, locate: Locate, started_at: float) -> None:
        self._shelf = shelf
        self.manifest_id = manifest_id
        self.table = table
        self.locate = locate
        self.started_at = started_at
        self._landed = np.zeros(len(table), dtype=bool)  # by row (an id's first row); under the shelf's lock
        self._kept: dict[int, memoryview] = {}  # row -> bytes of a chunk that did not land in place
        self.active = True
        self.complete = False

    def landed(self, rows: np.ndarray | Sequence[int]) -> None:
        """The chunks of ``rows`` (their ids' first rows) are verified and lie where ``locate`` finds them."""
        with self._shelf._cond:
            self._landed[np.asarray(rows, dtype=np.int64)] = True
            self._shelf._cond.notify_all()

    def keep(self, row: int, raw: Buffer) -> None:
        """Chunk ``row`` is verified but not in place (bounced, copied): serve these bytes.
        The caller hands ``raw`` over: it must not reuse that buffer."""
        view = _flat(memoryview(bytes_like(raw)))
        with self._shelf._cond:
            self._kept[int(row)] = view
            self._landed[int(row)] = True
            self._shelf._cond.notify_all()

    def end(self, complete: bool) -> None:
        """The load is over: its chunks are served from the cache tiers from now on (whatever they kept)."""
        self._shelf._end(self, complete)

    def _state(self, chunk_id: str) -> tuple[int, int]:
        """(row, state) of ``chunk_id`` here: state 1 landed, 0 pending, -1 not in this load (or ended)."""
        row = self.table.first_row_of.get(chunk_id) if self.active else None
        if row is None:
            return -1, -1
        return row, int(self._landed[row])

    def _found(self, row: int) -> Found | None:
        """The bytes of landed ``row``; outside the lock (``locate`` is the load's)."""
        kept = self._kept.get(row)
        if kept is not None:
            return Found(kept, crc32c(kept))
        located = self.locate(row)
        if located is None:
            return None
        view = _flat(located)
        table = self.table
        # A raw chunk's manifest CRC is the CRC of these bytes (they were verified by content id
        # when they landed); a compressed chunk's is of its stored form: computed.
        crc = int(table.crc32c[row]) if table.raw_rows[row] else crc32c(view)
        return Found(view, crc)


def _flat(view: memoryview) -> memoryview:
    """Bytes, one dimension: what ``sendmsg`` and ``len`` count alike (a tensor's view may be typed)."""
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PeerShelf:
    """Thread-safe. ``cache``: the worker's tiers (None: only loads in progress are served)."""

    def __init__(self, cache: TieredCache | None) -> None:
        self.cache = cache
        self._clock = time.monotonic  # deadlines are time.monotonic; Condition.wait is real time too
        self._cond = threading.Condition()
        self._active: list[LoadEntry] = []
        self._completed: dict[str, float] = {}  # manifest id -> started_at of its last complete load, oldest first

    def begin_load(self, manifest: LoadManifest, locate: Locate, started_at: float) -> LoadEntry:
        entry = LoadEntry(self, manifest.id, manifest.chunks, locate, started_at)
        with self._cond:
            self._active.append(entry)
        return entry

    def _end(self, entry: LoadEntry, complete: bool) -> None:
        with self._cond:
            if not entry.active:
                return
            entry.active = False
            entry.complete = complete
            self._active = [e for e in self._active if e is not entry]
            if complete:
                self._completed.pop(entry.manifest_id, None)
                self._completed[entry.manifest_id] = entry.started_at
                while len(self._completed) > _MAX_COMPLETED:
                    del self._completed[next(iter(self._completed))]
            entry._kept.clear()
            self._cond.notify_all()  # waiters for its chunks look in the tiers now

    def lookup(self, ids: Sequence[str], deadline: float) -> list[memoryview | None]:
        """Per id its raw bytes (where they lie, no copy) or None (MISSING)."""
        return [None if f is None else f.view for f in self.find(ids, deadline)]

    def find(self, ids: Sequence[str], deadline: float) -> list[Found | None]:
        """``lookup`` with each chunk's CRC32C (what the peer port sends in its headers).

        A chunk of an active load that has not landed (and is in no tier) is waited for until
        ``deadline`` (time.monotonic) at most; anything else is answered at once."""
        out: list[Found | None] = [None] * len(ids)
        todo = list(range(len(ids)))
        first = True
        while todo:
            landed: list[tuple[int, LoadEntry, int]] = []
            absent: list[int] = []
            pending: list[int] = []
            with self._cond:
                while True:
                    for i in todo:
                        where = self._where(ids[i])
                        if where is None:
                            absent.append(i)
                        elif where[1] < 0:
                            pending.append(i)
                        else:
                            landed.append((i, where[0], where[1]))
                    if first or landed or absent or not pending or deadline - self._clock() <= 0:
                        break
                    self._cond.wait(deadline - self._clock())  # a landing or an end wakes us: look again
                    pending.clear()
            for i, entry, row in landed:
                out[i] = entry._found(row)
                if out[i] is None:
                    absent.append(i)  # in no place a peer can be sent it from: perhaps a tier holds it
            for i in absent:
                out[i] = self._from_tiers(ids[i])
            if first:
                # A chunk still to come in a load may be held already (another version had it);
                # those not held are waited for (one that landed meanwhile is served next round).
                first = False
                waiting, pending = pending, []
                for i in waiting:
                    out[i] = self._from_tiers(ids[i])
                    if out[i] is None:
                        pending.append(i)
            if deadline - self._clock() <= 0:
                return out
            todo = pending
        return out

    def _where(self, chunk_id: str) -> tuple[LoadEntry, int] | None:
        """Under the lock: (entry, row) of a landed copy, (any, -1) when only pending, None when in no active load."""
        pending: LoadEntry | None = None
        for entry in self._active:
            row, state = entry._state(chunk_id)
            if state > 0:
                return entry, row
            if state == 0:
                pending = entry
        return None if pending is None else (pending, -1)

    def _from_tiers(self, chunk_id: str) -> Found | None:
        cache = self.cache
        if cache is None or not is_content_id(chunk_id):
            return None
        held = cache.held(chunk_id)
        # A held chunk is a view of tensors its process may have changed since: only intact ones.
        if held is not None and held.intact():
            return Found(_flat(held.view), held.crc)
        # Plain copies: peeked, not referenced. A peer's read is not this worker's own use, and
        # must neither count as a hit of its tiers nor promote a disk copy into its memory.
        copy = cache.memory.peek(chunk_id)
        if isinstance(copy, bytes | bytearray | memoryview):
            view = _flat(memoryview(copy))
            return Found(view, crc32c(view))
        if cache.disk is not None:
            data = cache.disk.get(chunk_id)  # checked against its stored CRC on the way
            if data is not None:
                return Found(memoryview(data), crc32c(data))
        return None

    def raw_sizes(self, ids: Sequence[str]) -> np.ndarray:
        """Per id its raw size where it is known without reading it: an active load's table, the
        memory tier (0 otherwise: the disk tier, nobody). The peer port cuts its batches by these
        before anything is waited for or read, so a batch waits for and reads only what it can carry."""
        out = np.zeros(len(ids), dtype=np.int64)
        with self._cond:
            active = list(self._active)
        for entry in active:
            first, sizes = entry.table.first_row_of, entry.table.raw_size
            for i, chunk_id in enumerate(ids):
                if not out[i]:
                    row = first.get(chunk_id)
                    if row is not None:
                        out[i] = sizes[row]
        cache = self.cache
        if cache is not None:
            for i in np.flatnonzero(out == 0).tolist():
                held = cache.held(ids[i])
                if held is not None:
                    out[i] = held.view.nbytes
                    continue
                copy = cache.memory.peek(ids[i])
                if isinstance(copy, bytes | bytearray | memoryview):
                    out[i] = memoryview(copy).nbytes
        return out

    def versions(self) -> list[PeerVersion]:
        """Active loads (complete=False) and completed ones the memory tier still holds whole
        (complete=True), newest first, at most MAX_VERSIONS."""
        with self._cond:
            active = [(e.manifest_id, e.started_at) for e in self._active]
            completed = list(self._completed.items())
        found: dict[str, PeerVersion] = {}
        gone = []
        for manifest_id, started_at in completed:
            if self.cache is not None and self.cache.holds_most(manifest_id):
                found[manifest_id] = PeerVersion(manifest_id, True, started_at)
            else:
                gone.append((manifest_id, started_at))  # evicted: no longer announced
        for manifest_id, started_at in active:
            found.setdefault(manifest_id, PeerVersion(manifest_id, False, started_at))
        if gone:
            with self._cond:
                for manifest_id, started_at in gone:
                    if self._completed.get(manifest_id) == started_at:
                        del self._completed[manifest_id]
        return sorted(found.values(), key=lambda v: v.started_at, reverse=True)[:MAX_VERSIONS]


__all__ = ["Found", "LoadEntry", "LoadManifest", "MAX_VERSIONS", "PeerShelf", "PeerVersion"]
