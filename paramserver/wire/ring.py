"""Consistent-hash placement ring with virtual nodes.

Each server owns ``vnodes`` points at ``u64(blake3("server_id#i")[:8])``; a
chunk's replicas are the first R distinct servers clockwise from the chunk's
point. Built only from the member list, so every process that sees the same
members computes the same placement. Adding or removing one of N servers moves
about 1/N of the primaries, and only to or from that server.

Zone-aware placement (when members carry zones) prefers servers in zones not
yet used by earlier replicas, then fills with the remaining servers in ring
order, so R > number of zones still works.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import blake3
import numpy as np

DEFAULT_VNODES = 128


def _point(key: bytes) -> int:
    return int.from_bytes(blake3.blake3(key).digest(length=8), "big")


def key_point(chunk_id: str) -> int:
    """Ring position of a key. Content ids are already uniform hashes: use their first 64 bits."""
    if len(chunk_id) >= 16:
        try:
            return int(chunk_id[:16], 16)
        except ValueError:
            pass
    return _point(chunk_id.encode())


def points_of(chunk_ids: Sequence[str]) -> np.ndarray | None:
    """``key_point`` of every id as one uint64 array, or None unless all are hex content ids of one
    length (then the first 16 hex digits of each are cut out of the joined ids in one pass)."""
    if not chunk_ids:
        return np.zeros(0, dtype=np.uint64)
    width = len(chunk_ids[0])
    if width < 16 or any(len(cid) != width for cid in chunk_ids):
        return None
    try:
        joined = "".join(chunk_ids).encode("ascii")
        heads = np.frombuffer(joined, dtype=np.uint8).reshape(len(chunk_ids), width)[:, :16].tobytes()
        return np.frombuffer(bytes.fromhex(heads.decode("ascii")), dtype=">u8").astype(np.uint64)
    except (UnicodeError, ValueError):
        return None


@dataclass(frozen=True)
class RingConfig:
    vnodes: int = DEFAULT_VNODES
    zone_aware: bool = True

    def validate(self) -> RingConfig:
        if not 1 <= self.vnodes <= 4096:
            raise ValueError(f"vnodes must be between 1 and 4096, got {self.vnodes}")
        return self


class Ring:
    def __init__(self, servers: Iterable[str] | Mapping[str, str], config: RingConfig = RingConfig()) -> None:
        """``servers``: ids, or a mapping server id -> zone."""
        config.validate()
        self.config = config
        zones = dict(servers) if isinstance(servers, Mapping) else {s: "" for s in servers}
        if any(not s for s in zones):
            raise ValueError("server ids must be non-empty")
        self.zones: dict[str, str] = dict(sorted(zones.items()))
        points: list[tuple[int, str]] = []
        for server in self.zones:
            for i in range(config.vnodes):
                points.append((_point(f"{server}#{i}".encode()), server))
        points.sort()  # ties (astronomically rare) broken by server id: still deterministic
        self._points = [p for p, _ in points]
        self._points_u64 = np.array(self._points, dtype=np.uint64)
        self._owners = [s for _, s in points]
        self._zone_count = len({z for z in self.zones.values()})
        # (vnode index, r) -> replicas: a pull places thousands of chunks on a few hundred vnodes.
        self._placed: dict[tuple[int, int], tuple[str, ...]] = {}

    @property
    def servers(self) -> list[str]:
        return list(self.zones)

    def __len__(self) -> int:
        return len(self.zones)

    def primary(self, chunk_id: str) -> str:
        return self.replicas(chunk_id, 1)[0]

    def replicas(self, chunk_id: str, r: int) -> list[str]:
        """R distinct servers for ``chunk_id`` (R capped by the cluster size), primary first."""
        if not self.zones:
            raise ValueError("the ring has no servers; add members before placing chunks")
        r = max(1, min(r, len(self.zones)))
        start = bisect.bisect_right(self._points, key_point(chunk_id)) % len(self._points)
        return list(self._placed_from(start, r))

    def _placed_from(self, start: int, r: int) -> tuple[str, ...]:
        """The R replicas of a key whose ring walk starts at vnode ``start``, computed once per (start, r)."""
        placed = self._placed.get((start, r))
        if placed is None:
            placed = self._placed[(start, r)] = tuple(self._place(start, r))
        return placed

    def _place(self, start: int, r: int) -> list[str]:
        walk = self._distinct_from(start)
        if not (self.config.zone_aware and self._zone_count > 1):
            return [next(walk) for _ in range(r)]
        # First one server per zone (in ring order), then the rest in ring order.
        chosen: list[str] = []
        passed: list[str] = []
        used_zones: set[str] = set()
        for server in walk:
            passed.append(server)
            if self.zones[server] not in used_zones:
                chosen.append(server)
                used_zones.add(self.zones[server])
                if len(chosen) == r or len(used_zones) == self._zone_count:
                    break
        fill = (s for s in [*passed, *walk] if s not in chosen)
        while len(chosen) < r:
            chosen.append(next(fill))
        return chosen

    def _distinct_from(self, start: int) -> Iterator[str]:
        owners = self._owners
        n = len(owners)
        seen: set[str] = set()
        for step in range(n):
            server = owners[(start + step) % n]
            if server not in seen:
                seen.add(server)
                yield server
                if len(seen) == len(self.zones):
                    return

    def placement_groups_by_point(self, points: np.ndarray, r: int) -> dict[tuple[str, ...], np.ndarray]:
        """The rows of ``points`` (positions in it, ascending) grouped by their replicas, for keys
        given as their ring points (``key_point``: for a content id, the first 8 bytes of its
        digest, big-endian): what ``replicas_many`` gives, without a hex string or tuple per id."""
        sets, set_of = self.placement_sets(points, r)
        order = np.argsort(set_of, kind="stable")
        bounds = np.cumsum(np.bincount(set_of, minlength=len(sets)))[:-1]
        return dict(zip(sets, np.split(order, bounds)))

    def placement_sets(self, points: np.ndarray, r: int) -> tuple[tuple[tuple[str, ...], ...], np.ndarray]:
        """``(sets, set_of)``: the distinct replica lists (primary first) of keys given as ring
        points, and per key the index of its list in ``sets``: ``replicas`` of each key, with an
        int per key instead of a tuple (a fetch of half a million chunks places them in one pass)."""
        if not len(points):
            return (), np.zeros(0, dtype=np.int64)
        if not self.zones:
            raise ValueError("the ring has no servers; add members before placing chunks")
        starts = np.searchsorted(self._points_u64, np.asarray(points, dtype=np.uint64), side="right") % len(self._points)
        r = max(1, min(r, len(self.zones)))
        unique, inverse = np.unique(starts, return_inverse=True)
        index: dict[tuple[str, ...], int] = {}
        of_start = np.array([index.setdefault(self._placed_from(s, r), len(index)) for s in unique.tolist()], dtype=np.int64)
        return tuple(index), of_start[inverse.reshape(-1)]

    def _starts(self, chunk_ids: Sequence[str]) -> np.ndarray:
        """The vnode each id's ring walk starts at."""
        if not chunk_ids:
            return np.zeros(0, dtype=np.int64)
        if not self.zones:
            raise ValueError("the ring has no servers; add members before placing chunks")
        n = len(self._points)
        keys = points_of(chunk_ids)
        if keys is not None:
            return np.searchsorted(self._points_u64, keys, side="right") % n
        # not all content ids: one at a time, exactly as replicas() does
        return np.array([bisect.bisect_right(self._points, key_point(cid)) % n for cid in chunk_ids], dtype=np.int64)

    def replicas_many(self, chunk_ids: Sequence[str], r: int) -> list[tuple[str, ...]]:
        """``replicas(id, r)`` of every id, as tuples, in one pass: the ring positions of content ids
        are decoded and searched as one array, so placing a whole manifest costs little per chunk."""
        if not chunk_ids:
            return []
        starts: list[int] = self._starts(chunk_ids).tolist()
        r = max(1, min(r, len(self.zones)))
        placed = {start: self._placed_from(start, r) for start in set(starts)}
        return [placed[s] for s in starts]


def replication_and_quorum(replication_factor: int, write_quorum: int | None, cluster_size: int) -> tuple[int, int]:
    """(R, W) for a cluster of ``cluster_size`` up members: R capped by the cluster, W a majority
    of R unless configured, and never above R. Servers and clients must agree on this rule, so
    it lives here once."""
    r = max(1, min(replication_factor, cluster_size))
    w = write_quorum if write_quorum else r // 2 + 1
    return r, min(w, r)


__all__ = ["Ring", "RingConfig", "DEFAULT_VNODES", "key_point", "points_of", "replication_and_quorum"]
