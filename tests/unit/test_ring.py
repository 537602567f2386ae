from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from paramserver.wire.ring import Ring, RingConfig, key_point, points_of

N_KEYS = 20_000


@pytest.fixture(scope="module")
def keys() -> list[str]:
    rng = random.Random(1234)
    return [rng.getrandbits(256).to_bytes(32, "big").hex() for _ in range(N_KEYS)]


def test_deterministic_and_order_independent(keys: list[str]) -> None:
    a = Ring(["ps1", "ps2", "ps3", "ps4"])
    b = Ring(["ps4", "ps2", "ps1", "ps3"])
    assert [a.replicas(k, 3) for k in keys[:500]] == [b.replicas(k, 3) for k in keys[:500]]


def test_replicas_distinct_and_capped(keys: list[str]) -> None:
    ring = Ring([f"s{i}" for i in range(4)])
    for k in keys[:1000]:
        reps = ring.replicas(k, 3)
        assert len(reps) == 3 == len(set(reps))
        assert reps[0] == ring.primary(k)
    assert sorted(ring.replicas(keys[0], 10)) == ["s0", "s1", "s2", "s3"]
    assert Ring(["only"]).replicas(keys[0], 3) == ["only"]
    with pytest.raises(ValueError, match="no servers"):
        Ring([]).replicas(keys[0], 1)


@pytest.mark.parametrize("n", [3, 5, 10])
def test_balance(keys: list[str], n: int) -> None:
    ring = Ring([f"server-{i}" for i in range(n)])
    counts = Counter(ring.primary(k) for k in keys)
    mean = N_KEYS / n
    assert len(counts) == n
    # 128 vnodes: load spread of a few tens of percent at worst.
    assert max(counts.values()) < 1.35 * mean, counts
    assert min(counts.values()) > 0.65 * mean, counts


@pytest.mark.parametrize("n", [4, 8])
def test_adding_a_server_moves_about_one_nth(keys: list[str], n: int) -> None:
    old = Ring([f"server-{i}" for i in range(n)])
    new = Ring([f"server-{i}" for i in range(n + 1)])
    moved = [k for k in keys if old.primary(k) != new.primary(k)]
    share = len(moved) / N_KEYS
    assert 0.5 / (n + 1) < share < 1.6 / (n + 1), share
    # Keys only move *to* the new server, never between old ones.
    assert all(new.primary(k) == f"server-{n}" for k in moved)
    # Replica sets: a key's set changes only by admitting the new server.
    for k in keys[:3000]:
        before, after = set(old.replicas(k, 3)), set(new.replicas(k, 3))
        assert after - before <= {f"server-{n}"}


def test_removing_a_server_moves_only_its_keys(keys: list[str]) -> None:
    full = Ring([f"server-{i}" for i in range(6)])
    less = Ring([f"server-{i}" for i in range(6) if i != 2])
    moved = [k for k in keys if full.primary(k) != less.primary(k)]
    assert all(full.primary(k) == "server-2" for k in moved)
    assert 0.5 / 6 < len(moved) / N_KEYS < 1.6 / 6


def test_zone_aware_spreads_across_zones(keys: list[str]) -> None:
    zones = {"a1": "za", "a2": "za", "b1": "zb", "b2": "zb", "c1": "zc", "c2": "zc"}
    ring = Ring(zones)
    for k in keys[:2000]:
        reps = ring.replicas(k, 3)
        assert len({zones[s] for s in reps}) == 3
    two_zones = Ring({"a1": "za", "a2": "za", "b1": "zb"})
    for k in keys[:500]:
        reps = two_zones.replicas(k, 3)
        assert len(set(reps)) == 3 and {"za", "zb"} <= {zones.get(s, "zb") for s in reps}
    plain = Ring(zones, RingConfig(zone_aware=False))
    assert any(len({zones[s] for s in plain.replicas(k, 3)}) < 3 for k in keys[:2000])


@pytest.mark.parametrize("zones", [{"a": "", "b": "", "c": ""}, {"a": "z1", "b": "z1", "c": "z2", "d": "z3"}])
def test_replicas_many_is_replicas_of_each(keys: list[str], zones: dict[str, str]) -> None:
    ring = Ring(zones)
    # content ids, and ids that are not hex (placed by hashing them, one at a time)
    mixed = [*keys, "short", "not-hex-but-long-enough-to-slice", "x" * 16, "AB" * 20, "-" + "1" * 15, " " + "a" * 15]
    for ids in (keys, mixed):
        for r in (1, 2, 3, 5):
            assert [list(p) for p in ring.replicas_many(ids, r)] == [ring.replicas(i, r) for i in ids]
    assert ring.replicas_many([], 3) == []


@pytest.mark.parametrize("zones", [{"a": "", "b": "", "c": ""}, {"a": "z1", "b": "z1", "c": "z2", "d": "z3"}])
def test_placement_groups_are_the_rows_of_each_replica_set(keys: list[str], zones: dict[str, str]) -> None:
    ring = Ring(zones)
    mixed = [*keys, "short", "x" * 16, keys[0]]
    for ids in (keys, mixed):
        for r in (1, 2, 3):
            groups = ring.placement_groups_by_point(np.array([key_point(i) for i in ids], dtype=np.uint64), r)
            rows = sorted(int(i) for g in groups.values() for i in g)
            assert rows == list(range(len(ids)))
            for placed, group in groups.items():
                assert list(group) == sorted(group)
                assert all(ring.replicas(ids[int(i)], r) == list(placed) for i in group)
    assert ring.placement_groups_by_point(np.zeros(0, np.uint64), 3) == {}


@pytest.mark.parametrize("zones", [{"a": "", "b": "", "c": ""}, {"a": "z1", "b": "z1", "c": "z2", "d": "z3"}])
def test_placement_sets_name_the_replicas_of_each_key(keys: list[str], zones: dict[str, str]) -> None:
    ring = Ring(zones)
    points = np.array([key_point(i) for i in keys], dtype=np.uint64)
    for r in (1, 2, 3, 5):
        sets, set_of = ring.placement_sets(points, r)
        assert len(set(sets)) == len(sets) and set_of.shape == (len(keys),)
        assert [list(sets[k]) for k in set_of.tolist()] == [ring.replicas(i, r) for i in keys]
    assert ring.placement_sets(np.zeros(0, np.uint64), 3)[0] == ()


def test_points_of_content_ids_are_their_key_points_and_other_ids_fall_back() -> None:
    ids = [f"{random.Random(i).getrandbits(256):064x}" for i in range(500)]
    points = points_of(ids)
    assert points is not None and points.dtype == np.uint64
    assert [int(p) for p in points] == [key_point(cid) for cid in ids]
    assert points_of([]) is not None and len(points_of([])) == 0  # type: ignore[arg-type]
    for odd in (["short"], [ids[0], ids[1][:40]], ["zz" * 32], ["é" * 64]):
        assert points_of(odd) is None
    ring = Ring(["ps1", "ps2", "ps3"])
    assert ring.replicas_many(["not-hex-" * 3, *ids[:3]], 2) == [tuple(ring.replicas(c, 2)) for c in ["not-hex-" * 3, *ids[:3]]]
