"""Hot chunks without sockets: the decayed rate tracker, the hot-set policy, the extra-copy registry,
the holder side of HotChunks over a real chunk store, and the planner's spreading of hot chunks."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest

from chunking.hashing import content_id, crc32c
from consensus.records import MemberRecord
from paramserver.client.fetch_plan import FetchPlanner, Read, Refused, Want, Wants, spread_rank
from paramserver.server.errors import ConfigError
from paramserver.server.hot_chunks import ExtraCopies, HotChunks, HotConfig, HotPolicy, RateTracker
from paramserver.server.store import ChunkStore
from paramserver.wire.ring import Ring
from tests.store_checks import records

MiB = 1 << 20


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# ------------------------------------------------------------------ RateTracker


def test_rate_is_a_decayed_count_over_tau() -> None:
    clock = Clock()
    t = RateTracker(tau_s=10.0, clock=clock)
    for _ in range(20):
        t.record("a")
    assert t.rate("a") == pytest.approx(2.0)
    clock.advance(10.0)
    assert t.rate("a") == pytest.approx(2.0 / math.e)
    t.record("a")
    assert t.rate("a") == pytest.approx((20 / math.e + 1) / 10)
    assert t.rate("never") == 0.0


def test_a_steady_rate_converges_to_itself() -> None:
    clock = Clock()
    t = RateTracker(tau_s=2.0, clock=clock)
    for _ in range(400):  # 5 reads/s for 80 s
        t.record("a")
        clock.advance(0.2)
    assert t.rate("a") == pytest.approx(5.0, rel=0.15)


def test_tracker_is_bounded_and_keeps_the_hottest() -> None:
    clock = Clock()
    t = RateTracker(tau_s=10.0, max_entries=64, clock=clock)
    for _ in range(50):
        t.record("hot")
    for i in range(1000):
        t.record(f"cold{i}")
    assert len(t) <= 64
    assert t.rate("hot") > 4.0
    assert t.evicted > 0


def test_rates_filters_and_forgets_decayed_entries() -> None:
    clock = Clock()
    t = RateTracker(tau_s=1.0, clock=clock)
    for _ in range(5):
        t.record("a")
    t.record("b")
    assert set(t.rates(min_rate=2.0)) == {"a"}
    clock.advance(60.0)
    assert t.rates(min_rate=0.1) == {}
    assert len(t) == 0


# ------------------------------------------------------------------ HotPolicy


def policy(clock: Clock, **kw: int) -> HotPolicy:
    return HotPolicy(2.0, 0.5, 5.0, max_chunks=kw.get("max_chunks", 10), max_bytes=kw.get("max_bytes", 10 * MiB), clock=clock)


def test_policy_threshold_and_hysteresis() -> None:
    clock = Clock()
    p = policy(clock)
    size = lambda _cid: MiB  # noqa: E731
    assert p.update({"a": 1.9}, size).added == ()
    assert p.update({"a": 2.0}, size).added == ("a",)
    # below hot_rate but above cool_rate: stays hot however long
    for _ in range(10):
        clock.advance(5.0)
        assert p.update({"a": 0.6}, size).cooled == ()
    # below cool_rate: cools only after cool_s below it
    assert p.update({"a": 0.1}, size).cooled == ()
    clock.advance(4.9)
    assert p.update({}, size).cooled == ()
    clock.advance(0.2)
    assert p.update({}, size).cooled == ("a",)
    assert "a" not in p and p.hot_bytes == 0


def test_policy_reset_of_the_cooling_clock() -> None:
    clock = Clock()
    p = policy(clock)
    size = lambda _cid: 1  # noqa: E731
    p.update({"a": 3.0}, size)
    p.update({"a": 0.1}, size)
    clock.advance(4.0)
    p.update({"a": 1.0}, size)  # back above cool_rate: the clock starts over
    clock.advance(4.0)
    p.update({"a": 0.1}, size)
    clock.advance(4.0)
    assert p.update({"a": 0.1}, size).cooled == ()


def test_policy_bounds_count_and_bytes_hottest_first() -> None:
    clock = Clock()
    p = policy(clock, max_chunks=2)
    got = p.update({"a": 3.0, "b": 9.0, "c": 5.0}, lambda _cid: 1)
    assert got.added == ("b", "c")
    p2 = policy(clock, max_bytes=3 * MiB)
    got = p2.update({"a": 3.0, "b": 9.0, "c": 5.0}, lambda cid: 2 * MiB if cid == "b" else MiB)
    assert set(p2.hot) == {"b", "c"} and p2.hot_bytes == 3 * MiB
    # not held here (size None): never hot
    assert policy(clock).update({"x": 9.0}, lambda _cid: None).added == ()


def test_policy_drops_what_this_server_no_longer_owns() -> None:
    clock = Clock()
    p = policy(clock)
    p.update({"a": 3.0}, lambda _cid: 1)
    assert p.update({"a": 3.0}, lambda _cid: 1, owned=lambda _cid: False).cooled == ("a",)
    assert p.update({"a": 3.0}, lambda _cid: 1, owned=lambda _cid: False).added == ()


# ------------------------------------------------------------------ ExtraCopies


def test_extra_copies_bounded_and_leased() -> None:
    clock = Clock()
    e = ExtraCopies(max_chunks=2, max_bytes=10, lease_s=5.0, clock=clock)
    assert e.reserve("a", 4) and e.reserve("b", 4)
    assert not e.reserve("c", 1)  # count bound (reservations count)
    e.cancel("b")
    assert not e.reserve("c", 7)  # byte bound
    assert e.reserve("c", 6)
    e.confirm("a", 1.0)
    e.confirm("c", 2.0)
    assert len(e) == 2 and e.nbytes == 10 and "a" in e
    clock.advance(3.0)
    assert e.renew(["a", "zzz"]) == 1
    clock.advance(2.5)
    assert e.expired() == [("c", 2.0)]
    e.forget("c")
    clock.advance(3.0)
    assert e.expired() == [("a", 1.0)]
    e.cancel("a")  # a confirmed extra is not a reservation: cancel leaves it
    assert "a" in e


def test_extra_copies_state_round_trip() -> None:
    clock = Clock()
    e = ExtraCopies(10, 100, 5.0, clock)
    e.reserve("a", 3)
    e.confirm("a", 1.0)
    e.reserve("b", 4)  # reserved only: not listed
    again = ExtraCopies(10, 100, 5.0, clock)
    assert again.load(e.dump(), lambda cid: 7.0 if cid == "a" else None) == 1
    assert again.expired() == [] and again.held() == {"a": 3}
    clock.advance(5.0)
    assert again.expired() == [("a", 7.0)]  # fresh baseline, fresh lease
    assert ExtraCopies(1, 1, 1.0).load(b"not json", lambda _c: 1.0) == 0


# ------------------------------------------------------------------ HotConfig


def test_config_from_extra_keys() -> None:
    c = HotConfig.from_extra({"hot_chunks": "off", "hot_rate": 4, "hot_extra_copies": 1, "hot_max_bytes": 8 * MiB})
    assert not c.enabled and c.hot_rate == 4.0 and c.extra_copies == 1 and c.max_hot_bytes == 8 * MiB
    assert c.cool == 1.0
    assert HotConfig.from_extra({}).enabled
    assert HotConfig.from_extra({"hot_chunks": True}).enabled


@pytest.mark.parametrize("extra", [
    {"hot_chunks": "maybe"}, {"hot_rate": 0}, {"hot_rate": "x"}, {"hot_extra_copies": 1.5}, {"hot_cool_rate": 5.0},
    {"hot_lease_s": 0.5, "hot_interval_s": 1.0}, {"hot_max_chunks": 100000}, {"hot_max_extra_bytes": 10},
])
def test_config_refuses_bad_values(extra: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HotConfig.from_extra(extra)


# ------------------------------------------------------------------ HotChunks, holder side (real store, no sockets)


class Peers:
    """What HotChunks reads of a PeerSet: the members, their ring, R."""

    def __init__(self, self_id: str, servers: list[str], r: int) -> None:
        self.self_id = self_id
        self.servers = servers
        self.replication_factor = r
        self.timeout_s = 1.0

    def ring(self) -> Ring:
        return Ring(self.servers)

    def members(self) -> dict[str, MemberRecord]:
        return {s: MemberRecord(s, f"{s}:1", f"{s}:2") for s in self.servers}


def chunk(i: int) -> tuple[str, bytes, str, int, int]:
    data = f"chunk {i} ".encode() * 100
    return content_id(data), data, "raw", len(data), crc32c(data)


def ids_by_role(peers: Peers, n: int = 40) -> tuple[list[int], list[int]]:
    """Indexes of chunks that ``peers.self_id`` holds as a ring replica, and of those it does not."""
    ring = peers.ring()
    mine, not_mine = [], []
    for i in range(n):
        (mine if peers.self_id in ring.replicas(chunk(i)[0], peers.replication_factor) else not_mine).append(i)
    return mine, not_mine


@pytest.fixture()
def store(tmp_path: Path) -> ChunkStore:
    s = ChunkStore(tmp_path / "store", fsync=False)
    yield s
    s.close()


def holder(store: ChunkStore, clock: Clock, tmp_path: Path, **kw: object) -> HotChunks:
    config = HotConfig(lease_s=5.0, interval_s=1.0, max_extra_chunks=int(kw.get("max_extra_chunks", 100)))
    return HotChunks(config, store, Peers("ps3", ["ps1", "ps2", "ps3"], 2), clock=clock,
                     state_path=tmp_path / "hot_extras.json")


def put_hot(hot: HotChunks, store: ChunkStore, i: int) -> str | None:
    """What ChunkService does with one hot copy; returns the admit decision."""
    cid, data, codec, raw, crc = chunk(i)
    decision = hot.admit(cid, len(data))
    if decision in (HotChunks.ADMIT, HotChunks.PLAIN):
        was_stored = store.put_many(records([(cid, data, codec, raw, crc)]))[0]
        if decision == HotChunks.ADMIT:
            hot.stored(cid, was_stored)
    return decision


def test_a_hot_copy_is_leased_and_dropped_when_no_replica_renews_it(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path)
    mine, not_mine = ids_by_role(hot.peers)
    extra, renewed = not_mine[0], not_mine[1]
    assert put_hot(hot, store, extra) == HotChunks.ADMIT
    assert put_hot(hot, store, renewed) == HotChunks.ADMIT
    assert hot.stats().extra_chunks == 2
    clock.advance(3.0)
    hot.renew([chunk(renewed)[0]])
    clock.advance(2.5)
    assert hot.step().dropped == 1
    assert not store.has(chunk(extra)[0]) and store.has(chunk(renewed)[0])
    clock.advance(3.0)
    assert hot.step().dropped == 1
    assert not store.has(chunk(renewed)[0])
    assert hot.stats().extra_chunks == 0 and hot.stats().dropped_total == 2


def test_never_an_extra_what_the_server_holds_as_replica_or_already(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path)
    mine, not_mine = ids_by_role(hot.peers)
    assert put_hot(hot, store, mine[0]) == HotChunks.PLAIN  # a ring replica here: an ordinary copy
    store.put_many(records([chunk(not_mine[0])]))  # here already (e.g. from before a membership change)
    assert put_hot(hot, store, not_mine[0]) == HotChunks.PLAIN
    assert hot.stats().extra_chunks == 0
    clock.advance(60.0)
    hot.step()
    assert store.has(chunk(mine[0])[0]) and store.has(chunk(not_mine[0])[0])


def test_an_extra_claimed_since_it_arrived_is_kept(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path)
    _mine, not_mine = ids_by_role(hot.peers)
    assert put_hot(hot, store, not_mine[0]) == HotChunks.ADMIT
    cid = chunk(not_mine[0])[0]
    store.claim([cid])  # a push or a commit check relies on this copy now
    clock.advance(10.0)
    assert hot.step().dropped == 0
    assert store.has(cid) and hot.stats().extra_chunks == 0  # forgotten as an extra, kept as a chunk


def test_an_extra_that_became_a_ring_copy_is_kept(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path)
    peers: Peers = hot.peers
    _mine, not_mine = ids_by_role(peers)
    assert put_hot(hot, store, not_mine[0]) == HotChunks.ADMIT
    peers.servers = ["ps3"]  # the others left: ps3 is every chunk's replica now
    clock.advance(10.0)
    assert hot.step().dropped == 0
    assert store.has(chunk(not_mine[0])[0])


def test_extra_bounds_refuse_with_a_reason(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path, max_extra_chunks=1)
    _mine, not_mine = ids_by_role(hot.peers)
    assert put_hot(hot, store, not_mine[0]) == HotChunks.ADMIT
    refused = put_hot(hot, store, not_mine[1])
    assert refused is not None and "bounds" in refused
    assert not store.has(chunk(not_mine[1])[0]) and hot.stats().refused_total == 1


def test_extras_outlive_a_restart_only_until_their_lease_ends(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = holder(store, clock, tmp_path)
    _mine, not_mine = ids_by_role(hot.peers)
    put_hot(hot, store, not_mine[0])
    hot.step()  # writes the state file
    assert (tmp_path / "hot_extras.json").exists()
    again = holder(store, clock, tmp_path)  # "restart": a new HotChunks over the same data dir
    assert again.stats().extra_chunks == 1
    clock.advance(10.0)
    assert again.step().dropped == 1
    assert not store.has(chunk(not_mine[0])[0])


def test_no_extras_where_every_server_is_a_replica(store: ChunkStore, tmp_path: Path) -> None:
    clock = Clock()
    hot = HotChunks(HotConfig(), store, Peers("ps1", ["ps1", "ps2", "ps3"], 3), clock=clock)
    cid, *rest = chunk(0)
    store.put_many(records([(cid, *rest)]))
    for _ in range(100):
        hot.record_read(cid)
    report = hot.step()
    assert report.hot == 0 and hot.advertised() == []


# ------------------------------------------------------------------ the planner


SERVERS = ["ps1", "ps2", "ps3"]


def first_reads(wants: list[Want], salt: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for d in FetchPlanner(wants, SERVERS, salt=salt).start():
        if isinstance(d, Read):
            for slot in d.slots.tolist():
                out[wants[slot].id] = d.server
    return out


def test_cold_chunks_tie_to_the_primary_whatever_the_salt() -> None:
    wants = [Want("a", 10, ("ps2", "ps1"))]
    assert {first_reads(wants, salt)["a"] for salt in range(50)} == {"ps2"}


def test_a_hot_chunk_spreads_over_replicas_and_extra_holders() -> None:
    wants = [Want("a", 10, ("ps2", "ps1"), extras=("ps3",))]
    counts = Counter(first_reads(wants, salt)["a"] for salt in range(300))
    assert set(counts) == set(SERVERS)
    assert min(counts.values()) > 60  # about a third each


def test_least_loaded_still_wins_over_the_salt() -> None:
    wants = [Want(f"c{i}", 10, ("ps1", "ps2"), extras=("ps3",)) for i in range(6)]
    for salt in range(20):
        assert sorted(Counter(first_reads(wants, salt).values()).values()) == [2, 2, 2]


def test_an_extra_holder_that_dropped_its_copy_sends_the_read_to_a_replica() -> None:
    key = int(Wants.of([Want("a", 10, ("ps1",))]).keys[0])  # type: ignore[index]
    p = FetchPlanner([Want("a", 10, ("ps1",), extras=("ps3",))], SERVERS, salt=next(
        s for s in range(100) if spread_rank(s, key, "ps3") < spread_rank(s, key, "ps1")))
    (read,) = p.start()
    assert isinstance(read, Read) and read.server == "ps3"
    (again,) = p.step(Refused(read.read, 0, "MISSING: not on this server"))
    assert isinstance(again, Read) and again.server == "ps1"


def test_spread_rank_is_deterministic() -> None:
    assert spread_rank(7, 12345, "ps1") == spread_rank(7, 12345, "ps1")
    assert len({spread_rank(s, 12345, "ps1") for s in range(20)}) == 20


# ------------------------------------------------------------------ metrics


class _Metadata:
    def is_leader(self) -> bool:
        return False

    def term(self) -> int:
        return 1

    def commit_index(self) -> int:
        return 1

    def status(self) -> dict[str, object]:
        return {"has_quorum": True}


def test_metrics_export_the_hot_chunk_gauges(store: ChunkStore, tmp_path: Path) -> None:
    from paramserver.server.metrics import ServerCollector
    from paramserver.server.repair import RepairQueue

    clock = Clock()
    hot = holder(store, clock, tmp_path)
    _mine, not_mine = ids_by_role(hot.peers)
    put_hot(hot, store, not_mine[0])
    families = {f.name: f for f in ServerCollector("ps3", store, _Metadata(), RepairQueue(), lambda: 3, hot=hot).collect()}
    assert families["paramserver_hot_extra_chunks"].samples[0].value == 1
    assert families["paramserver_hot_extra_bytes"].samples[0].value == len(chunk(not_mine[0])[1])
    for name in ("paramserver_hot_chunks", "paramserver_hot_chunk_bytes", "paramserver_hot_advertised_chunks",
                 "paramserver_hot_tracked_chunks", "paramserver_hot_copies_pushed", "paramserver_hot_extras_dropped",
                 "paramserver_hot_copies_refused"):
        assert name in families, name
    without = {f.name for f in ServerCollector("ps3", store, _Metadata(), RepairQueue(), lambda: 3).collect()}
    assert not any(n.startswith("paramserver_hot_") for n in without)


# ------------------------------------------------------------------ the contract and the CLI


def test_contract_has_the_hot_chunk_messages() -> None:
    from paramserver.wire.proto import pb

    methods = {m.name: m for m in pb.DESCRIPTOR.services_by_name["ParamServer"].methods}
    assert methods["GetHotChunks"].input_type.name == "GetHotChunksRequest"
    assert pb.PutChunksRequest(hot_copy=True).hot_copy and pb.HasChunksRequest(renew_hot=True).renew_hot
    reply = pb.GetHotChunksReply(server_id="ps1")
    reply.chunks.add(id="a" * 64, holders=["ps3"])
    assert pb.GetHotChunksReply.FromString(reply.SerializeToString()).chunks[0].holders == ["ps3"]


def test_cli_flags_reach_the_hot_config(tmp_path: Path) -> None:
    from paramserver.server.cli import _overrides, _parser
    from paramserver.server.config import ServerConfig

    args = _parser().parse_args(["serve", "--id", "ps1", "--data-dir", str(tmp_path), "--hot-chunks", "off", "--hot-rate", "3",
                                 "--hot-extra-copies", "1", "--hot-cool-s", "7", "--hot-lease-s", "9", "--hot-max-mb", "8"])
    hot = HotConfig.from_extra(ServerConfig.from_mapping({}, **_overrides(args)).extra)
    assert (hot.enabled, hot.hot_rate, hot.extra_copies, hot.cool_s, hot.lease_s) == (False, 3.0, 1, 7.0, 9.0)
    assert hot.max_hot_bytes == hot.max_extra_bytes == 8 * MiB
    plain = _parser().parse_args(["serve", "--id", "ps1", "--data-dir", str(tmp_path)])
    assert HotConfig.from_extra(ServerConfig.from_mapping({}, **_overrides(plain)).extra) == HotConfig()
