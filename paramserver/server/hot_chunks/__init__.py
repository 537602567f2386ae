"""Hot chunks: extra copies of often-read chunks on servers beyond their R ring replicas.

Each server keeps a decayed read rate per chunk it serves (:class:`RateTracker`, bounded). A chunk
this server holds as a ring replica whose rate passes ``hot_rate`` becomes hot
(:class:`HotPolicy`: hysteresis, a chunk cools only after its rate stayed below ``cool_rate`` for
``cool_s``; at most ``max_hot_chunks`` / ``max_hot_bytes`` hot at once). For each hot chunk the
server makes sure the next ``extra_copies`` servers on the ring after its R replicas hold a copy:
HasChunks(renew_hot) renews the copies there, PutChunks(hot_copy) sends the missing ones, the
normal ingest path (CRC32C and BLAKE3 checked by the receiver). It advertises the copies it
confirmed through GetHotChunks; clients add those holders as candidates for that chunk and
spread their reads over them (``paramserver.client.fetch_plan``).

Soft state, never in Raft. The receiver keeps a copy it did not hold before as an *extra*
(:class:`ExtraCopies`: bounded in count and bytes; leased): when no replica renews it for
``lease_s`` (the chunk cooled, or its replicas went away) it is deleted, unless this server has
become one of the chunk's ring replicas meanwhile, or the chunk was written or claimed since it
arrived (a push or a commit check relies on it). Extras never count as replicas: the commit
check, the push and re-replication only ever count the ring replicas, so an extra can never
make an under-replicated chunk look safe; orphan collection treats an extra like any other
stored chunk. A chunk this server already held, or holds as a ring replica, is never registered
as an extra, so the hot path never deletes a copy the cluster relies on. The extras are listed
in ``DATA_DIR/hot_extras.json`` (written on change, no fsync: losing it only keeps copies longer),
so a restart still drops them once their fresh lease ends.

The pure parts (tracker, policy, registry) take an injected clock and are unit-tested without
sockets (tests/unit/test_hot_chunks.py); :class:`HotChunks` wires them to the store and peers.
"""
from __future__ import annotations

from paramserver.server.hot_chunks.config import CONFIG_KEYS, HotConfig
from paramserver.server.hot_chunks.extras import STATE_FILE, ExtraCopies
from paramserver.server.hot_chunks.placement import HotChunks, HotReport, HotStats
from paramserver.server.hot_chunks.rates import HotPolicy, HotUpdate, RateTracker

__all__ = [
    "CONFIG_KEYS", "ExtraCopies", "HotChunks", "HotConfig", "HotPolicy", "HotReport", "HotStats", "HotUpdate", "RateTracker",
    "STATE_FILE",
]
