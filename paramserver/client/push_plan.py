"""Pure bookkeeping of a push: which server needs which chunk, and who acked what.

No sockets here, so dedup, replica assignment and W-quorum accounting are
unit-tested directly (tests/unit/test_push_plan.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

# A server whose HasChunks failed: we know nothing of what it holds and send it nothing.
Unreachable = None


@dataclass(frozen=True)
class Item:
    """One distinct blob to place: a chunk, or the manifest."""

    id: str
    stored_size: int


@dataclass(frozen=True)
class UploadPlan:
    """Per-server lists of the items to send, in item order, and the dedup figures."""

    sends: dict[str, list[str]]  # server -> ids it is missing (reachable servers only)
    targets: dict[str, list[str]]  # id -> servers it goes to
    deduplicated: tuple[str, ...]  # ids no reachable replica was missing
    bytes_to_send: int  # stored bytes of the distinct items sent (once each)
    wire_bytes: int  # stored bytes over all streams (an item counts once per target)


def placement_of(items: Iterable[Item], replicas: Callable[[str], Sequence[str]]) -> dict[str, list[str]]:
    return {item.id: list(replicas(item.id)) for item in items}


def wanted_by_server(placement: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """server -> the ids the ring puts there (to ask HasChunks about)."""
    out: dict[str, list[str]] = {}
    for cid, servers in placement.items():
        for server in servers:
            out.setdefault(server, []).append(cid)
    return out


def plan_uploads(
    items: Sequence[Item], placement: Mapping[str, Sequence[str]], present: Mapping[str, set[str] | None]
) -> UploadPlan:
    """Send each item to every reachable replica that lacks it.

    ``present[server]`` is the set HasChunks reported, or None when the server
    did not answer (it is skipped; the W check decides whether that matters).
    """
    sends: dict[str, list[str]] = {}
    targets: dict[str, list[str]] = {}
    dedup: list[str] = []
    once = wire = 0
    for item in items:
        reachable = [s for s in placement[item.id] if present.get(s) is not None]
        missing = [s for s in reachable if item.id not in (present[s] or ())]  # reachable: present[s] is a set
        if not missing:
            if reachable:  # on no reachable replica it is just short of W, not deduplicated
                dedup.append(item.id)
            continue
        targets[item.id] = missing
        once += item.stored_size
        wire += item.stored_size * len(missing)
        for server in missing:
            sends.setdefault(server, []).append(item.id)
    return UploadPlan(sends, targets, tuple(dedup), once, wire)


class AckLedger:
    """Which replicas hold each item (already present or acked by PutChunks); thread-safe."""

    def __init__(self, placement: Mapping[str, Sequence[str]], write_quorum: int) -> None:
        if write_quorum < 1:
            raise ValueError(f"write quorum must be >= 1, got {write_quorum}")
        self.placement = {cid: tuple(servers) for cid, servers in placement.items()}
        self.write_quorum = write_quorum
        self._held: dict[str, set[str]] = {cid: set() for cid in self.placement}
        self._lock = threading.Lock()

    def add(self, placement: Mapping[str, Sequence[str]]) -> None:
        """Place more items (a streaming push learns its chunks as it packs them); known ids are kept."""
        with self._lock:
            for cid, servers in placement.items():
                if cid not in self.placement:
                    self.placement[cid] = tuple(servers)
                    self._held[cid] = set()

    def record_present(self, present: Mapping[str, set[str] | None], ids: Iterable[str] | None = None) -> None:
        """Count the replicas HasChunks found holding each item (of ``ids``, default every item)."""
        with self._lock:
            for cid in (self.placement if ids is None else ids):
                servers = self.placement[cid]
                for server in servers:
                    have = present.get(server)
                    if have is not None and cid in have:
                        self._held[cid].add(server)

    def ack(self, cid: str, server: str) -> None:
        """Count an ack only from one of the item's ring replicas: the quorum check counts nothing else."""
        with self._lock:
            if cid in self._held and server in self.placement[cid]:
                self._held[cid].add(server)

    def count(self, cid: str) -> int:
        with self._lock:
            return len(self._held[cid])

    def holders(self, cid: str) -> frozenset[str]:
        with self._lock:
            return frozenset(self._held[cid])

    def short(self, ids: Iterable[str] | None = None) -> list[str]:
        """Ids below the write quorum, in the given (or placement) order."""
        with self._lock:
            return [cid for cid in (ids if ids is not None else self.placement) if len(self._held[cid]) < self.write_quorum]

    def lacking(self, cid: str, exclude: Iterable[str] = ()) -> list[str]:
        """Replicas of ``cid`` that do not hold it yet, minus ``exclude``."""
        skip = set(exclude)
        with self._lock:
            return [s for s in self.placement[cid] if s not in self._held[cid] and s not in skip]


__all__ = ["Item", "UploadPlan", "AckLedger", "placement_of", "wanted_by_server", "plan_uploads", "Unreachable"]
