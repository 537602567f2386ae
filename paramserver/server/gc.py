"""Orphan collection: delete chunks no committed version refers to.

A failed or interrupted push leaves chunks that no manifest names. They are
deleted once older than a grace period, which must exceed the longest push
(a push in flight has uploaded chunks it has not committed yet). "Older" counts from
the last write or claim: a push that finds a chunk already stored (HasChunks, or a
PutChunks of it) refreshes its claim time, so an old orphan that a new push reuses is not
collected between the dedup check and the commit (after a restart every chunk counts as
claimed at the restart). Space comes back when compaction rewrites the segment. When any
manifest cannot be read, the step deletes nothing: never delete when unsure.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from chunking.errors import ManifestError
from chunking.manifest import Manifest
from consensus.api import MetadataPlane

from paramserver.server.errors import ParamServerError
from paramserver.server.store import ChunkStore

log = logging.getLogger(__name__)

_DELETE_BATCH = 256  # orphans deleted with one durable batch of tombstones


@dataclass
class GcReport:
    scanned: int = 0
    referenced: int = 0
    deleted: int = 0
    skipped_reason: str = ""


class References:
    """The chunk ids (manifests included) that committed versions refer to."""

    def __init__(self, metadata: MetadataPlane, fetch_blob: Callable[[str], bytes]) -> None:
        self.metadata = metadata
        self.fetch_blob = fetch_blob
        self._chunks_of: dict[str, frozenset[str]] = {}  # manifests are immutable: parse each once
        # The last answer and the manifests it was made of: asked every few seconds by the
        # background tasks, the union of half a million ids is made again only when they change.
        self._last: tuple[tuple[str, ...], frozenset[str]] | None = None

    def __call__(self) -> frozenset[str] | None:
        """The referenced ids, or None when some manifest cannot be read right now."""
        manifests: list[str] = []
        for model in self.metadata.list_models().value:
            for version in self.metadata.list_versions(model).value:
                mid = version.manifest_id
                if mid not in self._chunks_of:
                    try:
                        manifest = Manifest.read(mid, self.fetch_blob, parallel=4)
                    except (ParamServerError, ManifestError) as exc:
                        log.warning("orphan collection skipped: manifest %s of %s v%d unreadable (%s)", mid, model, version.number, exc)
                        return None
                    self._chunks_of[mid] = manifest.all_chunk_ids()  # tensor, file and manifest-part blobs
                manifests.append(mid)
        key = tuple(manifests)
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        refs: set[str] = set(manifests)
        for mid in manifests:
            refs |= self._chunks_of[mid]
        frozen = frozenset(refs)
        self._last = (key, frozen)
        return frozen


class OrphanCollector:
    def __init__(
        self,
        references: References,
        store: ChunkStore,
        *,
        grace_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        in_sync: Callable[[], bool] = lambda: True,
    ) -> None:
        """``in_sync``: whether this node's metadata is in sync with a leader (``MetadataPlane.in_sync``)."""
        self.references = references
        self.in_sync = in_sync
        self.store = store
        self.grace_s = grace_s
        self.clock = clock
        self._unsynced_logged = False

    def step(self) -> GcReport:
        report = GcReport()
        # Alone, catching up or cut off, this node's versions may miss ones the cluster committed,
        # whose chunks would look unreferenced: deleting is the one step that must wait. (The other
        # users of References, re-replication and hand-off, only copy, or delete what every replica holds.)
        if not self.in_sync():
            if not self._unsynced_logged:
                log.warning("orphan collection waits: this server's metadata is not in sync with a Raft "
                            "leader, so it cannot tell which chunks committed versions use")
                self._unsynced_logged = True
            report.skipped_reason = "this server's metadata is not in sync with a leader"
            return report
        self._unsynced_logged = False
        refs = self.references()
        if refs is None:
            report.skipped_reason = "a manifest could not be read"
            return report
        report.referenced = len(refs)
        cutoff = self.clock() - self.grace_s
        batch: list[str] = []
        for chunk_id in list(self.store.iter_ids()):
            report.scanned += 1
            if chunk_id in refs:
                continue
            batch.append(chunk_id)
            if len(batch) >= _DELETE_BATCH:
                report.deleted += len(self.store.delete_unclaimed(batch, cutoff))
                batch = []
        if batch:
            # The claim time is re-read under the store's lock: a push that has just found this
            # chunk here (HasChunks, or a PutChunks of it) claimed it and it stays.
            report.deleted += len(self.store.delete_unclaimed(batch, cutoff))
        if report.deleted:
            log.info("orphan collection deleted %d unreferenced chunks", report.deleted)
        return report


__all__ = ["GcReport", "OrphanCollector", "References"]
