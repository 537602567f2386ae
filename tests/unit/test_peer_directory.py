"""The worker-peer directory (paramserver.server.peer_directory) with a fake clock, and the
checks of its gRPC front (paramserver.server.peer_service) without a server."""
from __future__ import annotations

import random

import pytest

from paramserver.server.peer_directory import DEFAULT_LEASE_S, Announcement, Limits, PeerDirectory, Version
from paramserver.server.peer_service import BadRequest, PeerService
from paramserver.server.served_bytes import ServedBytes
from paramserver.wire.limits import MAX_PEER_VERSIONS, MAX_PEERS_FOUND, PEER_LEASE_MAX_S, PEER_LEASE_MIN_S, PEER_SEEDS
from paramserver.wire.proto import pb

M1, M2, M3 = "a" * 64, "b" * 64, "c" * 64


def mid(i: int) -> str:
    return f"{i:064x}"


def ann(worker: str, *versions: Version, lease: float = 10.0, instance: str = "i1", leaving: bool = False) -> Announcement:
    return Announcement(worker, f"127.0.0.1:{7000 + len(worker)}", instance, "host", tuple(versions), lease, leaving)


def loading(m: str, started: float = 0.0) -> Version:
    return Version(m, False, started)


def holding(m: str) -> Version:
    return Version(m, True, 0.0)


def names(d: PeerDirectory, m: str, now: float, limit: int = 0, exclude: str = "", seed: int = 0) -> list[str]:
    return [e.worker_id for e in d.find(m, limit, exclude, now, random.Random(seed))]


def test_an_entry_lives_its_lease_then_expires() -> None:
    d = PeerDirectory()
    lease, kept = d.announce(ann("w1", holding(M1), lease=5.0), now=100.0)
    assert (lease, kept) == (5.0, 1)
    [e] = d.find(M1, 0, "", 104.0, random.Random(0))
    assert (e.worker_id, e.address, e.complete, e.host_id) == ("w1", "127.0.0.1:7002", True, "host")
    assert e.lease_left_s == pytest.approx(1.0)
    assert names(d, M1, 105.0) == []  # expired at its lease's end: never returned again
    assert d.entries() == 0 and d.workers() == 0 and d.versions() == 0  # and dropped, not just hidden


def test_announcing_again_renews_the_lease_and_expire_drops_only_silent_workers() -> None:
    d = PeerDirectory()
    d.announce(ann("w1", holding(M1), lease=5.0), now=0.0)
    d.announce(ann("w2", holding(M1), lease=5.0), now=0.0)
    d.announce(ann("w1", holding(M1), lease=5.0), now=4.0)  # w1 renews, w2 goes silent
    assert d.expire(6.0) == 1
    assert names(d, M1, 6.0) == ["w1"]
    assert d.expire(9.5) == 1 and d.entries() == 0


def test_lease_is_clamped_and_zero_means_the_default() -> None:
    d = PeerDirectory()
    assert d.announce(ann("w1", holding(M1), lease=0.01), 0.0)[0] == PEER_LEASE_MIN_S
    assert d.announce(ann("w2", holding(M1), lease=1e9), 0.0)[0] == PEER_LEASE_MAX_S
    assert d.announce(ann("w3", holding(M1), lease=0.0), 0.0)[0] == DEFAULT_LEASE_S
    with pytest.raises(ValueError, match="finite"):
        d.announce(ann("w4", holding(M1), lease=float("nan")), 0.0)


def test_an_announce_replaces_the_workers_versions_and_a_new_instance_replaces_the_entry() -> None:
    d = PeerDirectory()
    d.announce(ann("w1", loading(M1, 5.0), holding(M2)), 0.0)
    d.announce(ann("w1", holding(M1)), 1.0)  # same instance: M2 no longer listed, so no longer found
    assert names(d, M2, 1.0) == [] and d.entries() == 1
    [e] = d.find(M1, 0, "", 1.0, random.Random(0))
    assert e.complete
    restarted = Announcement("w1", "127.0.0.1:9999", "i2", "host2", (loading(M3, 7.0),), 10.0)
    d.announce(restarted, 2.0)
    assert names(d, M1, 2.0) == []  # the old process's versions went with it
    [e] = d.find(M3, 0, "", 2.0, random.Random(0))
    assert (e.address, e.host_id, e.started_at) == ("127.0.0.1:9999", "host2", 7.0)
    assert d.workers() == 1 and d.entries() == 1


def test_leaving_drops_the_worker_but_not_a_newer_instance() -> None:
    d = PeerDirectory()
    d.announce(ann("w1", holding(M1), instance="old"), 0.0)
    d.announce(ann("w1", holding(M1), instance="new"), 1.0)
    assert d.announce(ann("w1", leaving=True, instance="old"), 2.0)[1] == 0  # the old process's late goodbye
    assert names(d, M1, 2.0) == ["w1"]
    d.announce(ann("w1", leaving=True, instance="new"), 3.0)
    assert names(d, M1, 3.0) == [] and d.workers() == 0 and d.entries() == 0
    d.announce(ann("w2", holding(M1)), 4.0)
    d.announce(Announcement("w2", leaving=True), 5.0)  # no instance named: drops whatever is kept
    assert d.workers() == 0


def test_an_announce_with_no_versions_keeps_nothing() -> None:
    d = PeerDirectory()
    d.announce(ann("w1", holding(M1)), 0.0)
    assert d.announce(ann("w1"), 1.0) == (10.0, 0)
    assert d.workers() == 0 and d.entries() == 0


def test_versions_per_worker_are_bounded_and_duplicates_refused() -> None:
    d = PeerDirectory(Limits(max_versions=3))
    with pytest.raises(ValueError, match="at most 3 versions"):
        d.announce(ann("w1", *(holding(mid(i)) for i in range(4))), 0.0)
    with pytest.raises(ValueError, match="listed twice"):
        d.announce(ann("w1", holding(M1), loading(M1)), 0.0)
    assert d.workers() == 0 and d.entries() == 0  # a refused announce changed nothing
    assert d.announce(ann("w1", *(holding(mid(i)) for i in range(3))), 0.0)[1] == 3
    assert PeerDirectory().limits.max_versions == MAX_PEER_VERSIONS


def test_workers_per_version_are_bounded_least_recently_announced_first() -> None:
    d = PeerDirectory(Limits(max_per_version=3))
    d.announce(ann("w1", holding(M1), holding(M2)), 0.0)
    d.announce(ann("w2", holding(M1)), 1.0)
    d.announce(ann("w3", holding(M1), holding(M3)), 2.0)
    d.announce(ann("w1", holding(M1), holding(M2)), 3.0)  # w1 renews: w2 is now the least recent of M1
    d.announce(ann("w4", holding(M1)), 4.0)
    assert sorted(names(d, M1, 4.0)) == ["w1", "w3", "w4"]
    assert names(d, M3, 4.0) == ["w3"]  # w3 keeps its other version
    assert d.workers() == 3  # w2 had only M1 and went with it
    assert d.evicted == 1 and d.entries() == 5  # w1: M1, M2; w3: M1, M3; w4: M1


def test_workers_in_all_are_bounded_and_memory_stays_bounded_under_a_flood() -> None:
    d = PeerDirectory(Limits(max_workers=50))
    for i in range(1000):
        d.announce(ann(f"w{i}", holding(mid(i % 7)), lease=100.0), float(i) / 1000)
    assert d.workers() == 50 and d.entries() == 50
    assert sorted(names(d, mid(999 % 7), 1.0, limit=64)) == sorted(f"w{i}" for i in range(950, 1000) if i % 7 == 999 % 7)
    for i in range(10000):  # one worker announcing as fast as it can: the expiry heap is compacted
        d.announce(ann("hot", holding(M1), lease=100.0), 2.0 + i / 1e6)
    assert len(d._expiry) <= 2 * d.workers() + 64
    assert d.expire(1e6) == 50 and d.entries() == 0 and d.versions() == 0


def test_the_earliest_come_first_in_order_then_a_shuffled_sample() -> None:
    d = PeerDirectory()
    # 20 loaders started at 100 - i (so w19 is the earliest), ties broken by worker id; 30 holders that
    # started later (a holder is a loader that finished: it ranks by when it started)
    for i in range(20):
        d.announce(ann(f"l{i:02d}", loading(M1, 100.0 - (i // 2))), 0.0)
    for i in range(30):
        d.announce(ann(f"h{i:02d}", Version(M1, True, 200.0 + i)), 0.0)
    found = d.find(M1, 0, "", 1.0, random.Random(1))
    seeds = [e.worker_id for e in found[:PEER_SEEDS]]
    assert seeds == ["l18", "l19", "l16", "l17", "l14", "l15", "l12", "l13"]  # by (started_at, worker id)
    assert len(found) == 32  # the default answer size
    rest = [e.worker_id for e in found[PEER_SEEDS:]]
    assert len(set(rest)) == len(rest) and not set(rest) & set(seeds)
    assert any(w.startswith("l") for w in rest) and any(w.startswith("h") for w in rest)  # holders and later loaders
    others = [names(d, M1, 1.0, seed=s)[PEER_SEEDS:] for s in range(2, 6)]
    assert any(o != rest for o in others)  # shuffled: another draw, another sample
    assert all(n[:PEER_SEEDS] == seeds for n in (names(d, M1, 1.0, seed=s) for s in range(6)))  # seeds always the same


def test_an_asker_gets_those_between_half_its_place_in_line_and_it() -> None:
    d = PeerDirectory()
    for i in range(200):
        d.announce(ann(f"w{i:03d}", loading(M1, float(i))), 0.0)
    for rank in (20, 100, 199):
        found = names(d, M1, 1.0, limit=24, exclude=f"w{rank:03d}")
        assert found[:PEER_SEEDS] == [f"w{i:03d}" for i in range(PEER_SEEDS)]
        parents = found[PEER_SEEDS:]
        window = {f"w{i:03d}" for i in range(PEER_SEEDS + (rank - PEER_SEEDS) // 2, rank)}
        assert len(parents) == 16 and len(set(parents)) == 16
        # the ranks a late loader reads from come first, as many as fit; the rest filled from anyone
        take = min(len(window), 16)
        assert set(parents[:take]) <= window
        assert d.rank(M1, f"w{rank:03d}") == rank
    # a worker that announced nothing (it serves nobody) gets the seeds and a plain sample, and no rank
    assert len(names(d, M1, 1.0, limit=24, exclude="stranger")) == 24 and d.rank(M1, "stranger") is None


def test_the_answer_is_bounded_by_the_limit_and_the_maximum() -> None:
    d = PeerDirectory()
    for i in range(200):
        d.announce(ann(f"w{i:03d}", loading(M1, float(i))), 0.0)
    assert len(names(d, M1, 1.0, limit=5)) == 5
    assert names(d, M1, 1.0, limit=3) == ["w000", "w001", "w002"]  # fewer than the seeds: the earliest
    assert len(names(d, M1, 1.0, limit=10_000)) == MAX_PEERS_FOUND
    assert d.known(M1, 1.0) == 200 and d.known(M2, 1.0) == 0


def test_the_asking_worker_is_excluded() -> None:
    d = PeerDirectory()
    d.announce(ann("w1", loading(M1, 1.0)), 0.0)
    d.announce(ann("w2", holding(M1)), 0.0)
    assert names(d, M1, 1.0, exclude="w1") == ["w2"]
    assert names(d, M1, 1.0, exclude="w2") == ["w1"]
    assert names(d, M2, 1.0) == []


# ------------------------------------------------------------------ the gRPC front's checks


def request(**kw: object) -> pb.AnnouncePeerRequest:
    fields: dict[str, object] = dict(worker_id="w1", address="127.0.0.1:7100", instance="i", host_id="h",
                                     versions=[pb.PeerVersion(manifest_id=M1, complete=False, started_at=1.0)], lease_s=5.0)
    fields.update(kw)
    return pb.AnnouncePeerRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "message"), [
    (dict(worker_id=""), "worker_id is empty"),
    (dict(worker_id="w" * 257), "at most 256"),
    (dict(worker_id="a\nb"), "control characters"),
    (dict(address="nohost"), "is not HOST:PORT"),
    (dict(address="127.0.0.1:0"), "port 0"),
    (dict(versions=[pb.PeerVersion(manifest_id="A" * 64)]), "64 lowercase hex"),
    (dict(versions=[pb.PeerVersion(manifest_id=mid(i)) for i in range(MAX_PEER_VERSIONS + 1)]), "at most 16"),
    (dict(versions=[pb.PeerVersion(manifest_id=M1), pb.PeerVersion(manifest_id=M1)]), "listed twice"),
    (dict(versions=[pb.PeerVersion(manifest_id=M1, started_at=float("inf"))]), "finite"),
    (dict(lease_s=float("nan")), "finite"),
    (dict(lease_s=-1.0), ">= 0"),
])
def test_bad_announces_are_refused_with_what_to_fix(fields: dict[str, object], message: str) -> None:
    service = PeerService("ps1", clock=lambda: 0.0)
    with pytest.raises(BadRequest, match=message) as info:
        service.announce(request(**fields))
    assert "\n" not in str(info.value)
    assert service.entries() == 0


def test_the_service_announces_finds_and_expires_on_its_clock() -> None:
    now = [0.0]
    service = PeerService("ps1", clock=lambda: now[0], rng=random.Random(0))
    reply = service.announce(request())
    assert (reply.lease_s, reply.versions) == (5.0, 1)
    service.announce(request(worker_id="w2", address="[::1]:7101", versions=[pb.PeerVersion(manifest_id=M1, complete=True)]))
    found = service.find(pb.FindPeersRequest(manifest_id=M1, exclude_worker="w2"))
    assert found.server_id == "ps1" and found.known == 2 and [p.worker_id for p in found.peers] == ["w1"]
    assert found.peers[0].address == "127.0.0.1:7100" and found.peers[0].lease_left_s == 5.0
    service.announce(request(leaving=True, address=""))  # a goodbye needs no address
    assert service.entries() == 1
    now[0] = 6.0
    assert service.step() == 1 and service.entries() == 0
    with pytest.raises(BadRequest, match="manifest id"):
        service.find(pb.FindPeersRequest(manifest_id="xyz"))


def test_served_bytes_count_per_path() -> None:
    served = ServedBytes()
    served.add("bulk", 10)
    served.add("grpc", 5)
    served.add("grpc", 0)
    assert served.by_path() == {"bulk": 10, "grpc": 5} and served.total() == 15
