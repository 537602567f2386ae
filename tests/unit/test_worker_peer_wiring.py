"""The worker's side of fleet fan-out (issue 42) without a network: bytes from peers counted as
tier "peer" (never as the servers' share), every landed chunk told to the peer shelf, the shelf
entry ended with the load, the swarm used instead of the client's fetch, the peer flags and
environment, the peer link's start and close, LoadReport.bytes_peer and the /metrics families.
The peer parts themselves are stand-ins (tests/peer_standins.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from chunking.chunk_table import ChunkRows
from chunking.hashing import content_id
from chunking.pack import pack
from paramserver.client.fetch import ChunkSink, FetchStats
from tests import peer_standins
from tests.unit.test_worker_loader_plan import FakeClient, model, same
from worker.config import CacheConfig
from worker.errors import ConfigError
from worker.loader import empty_targets, make_report
from worker.peer_link import PeerLink, PeerLinkConfig, PeerStats, attach, close_link, link_for, peers_enabled
from worker.prefetch import TIERS, LoadCounters, Prefetcher
from worker.serve_metrics import ServeMetrics
from worker.tiered_cache import TieredCache


class FromPeers:
    """A sink in front of the prefetcher: the chunks of ``peer_rows`` are said to come from a peer."""

    def __init__(self, sink: Any, peer_rows: set[int]) -> None:
        self.sink, self.peer_rows = sink, peer_rows

    def regions(self, rows: np.ndarray) -> Any:
        return self.sink.regions(rows)

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:
        peer = np.array([r in self.peer_rows for r in rows.tolist()], dtype=bool)
        if peer.any():
            self.sink.landed_in_place(rows[peer], source="peer")
        if (~peer).any():
            self.sink.landed_in_place(rows[~peer], source="network")

    def write(self, row: int, raw: Any, source: str = "network") -> None:
        self.sink.write(row, raw, source="peer" if row in self.peer_rows else "network")


class HalfFromPeers:
    """A swarm whose every other distinct chunk comes from a peer (the servers' fetch engine underneath)."""

    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.calls: list[str] = []
        self.peer_rows: set[int] = set()

    def fetch(self, manifest_id: str, chunks: ChunkRows, sink: ChunkSink, *, algorithm: str = "blake3",
              tensors_of: Any = None) -> FetchStats:
        self.calls.append(manifest_id)
        self.peer_rows = set(chunks.rows.tolist()[::2])
        return self.client.fetch(chunks, FromPeers(sink, self.peer_rows), algorithm=algorithm, tensors_of=tensors_of)


class NoFetch:
    def fetch(self, *args: Any, **kwargs: Any) -> FetchStats:
        raise AssertionError("the client's fetch was used although a swarm was given")


def _targets(packed: Any, private: bool) -> dict[str, torch.Tensor]:
    if private:
        from paramserver.client.hostmem import allocate_targets

        return dict(allocate_targets(packed.manifest).tensors)
    return empty_targets(packed.manifest, torch.device("cpu"))


@pytest.mark.parametrize("private", [True, False], ids=["received-in-place", "written"])
def test_peer_bytes_count_as_tier_peer_and_every_landed_chunk_reaches_the_shelf(private: bool) -> None:
    sd = model()
    packed = pack(sd, model="m")
    table = packed.manifest.chunks
    targets = _targets(packed, private)
    swarm = HalfFromPeers(FakeClient(packed.source()))
    entry = peer_standins.LoadEntry(packed.manifest, lambda row: None, 0.0)
    p = Prefetcher(packed.manifest, targets, client=NoFetch(), swarm=swarm, shelf_entry=entry,
                   cache=TieredCache.from_config(CacheConfig(memory_bytes=64 << 20)), private_targets=private)
    counters = p.run()
    assert all(same(targets[k], v) for k, v in sd.items())
    assert swarm.calls == [packed.manifest.id]
    peer, net = sorted(swarm.peer_rows), sorted(set(table.first_rows.tolist()) - swarm.peer_rows)
    assert peer and net
    raw_of = {row: int(table.raw_size[table.rows_of(row)].sum()) for row in table.first_rows.tolist()}  # repeats too
    assert counters.bytes["peer"] == sum(raw_of[r] for r in peer)
    assert counters.bytes["network"] == sum(raw_of[r] for r in net)
    # The servers' share on the wire is theirs alone.
    assert counters.network_stored_bytes == int(table.stored_size[net].sum())
    assert sum(counters.bytes.values()) == packed.manifest.raw_bytes
    # Every distinct chunk was told once; those not lying whole in one CPU region came with a copy of its bytes.
    assert sorted(entry.landed_rows) == sorted(table.first_rows.tolist())
    not_in_place = [r for r in table.first_rows.tolist() if p.locate(r) is None]
    assert not_in_place and sorted(entry.kept) == not_in_place
    assert all(content_id(raw) == table.ids[row] for row, raw in entry.kept.items())
    assert all(content_id(bytes(p.locate(r))) == table.ids[r] for r in set(entry.landed_rows) - set(entry.kept))  # type: ignore[arg-type]
    assert entry.ended == [True]


def test_hits_and_local_chunks_reach_the_shelf_too_and_a_failed_load_ends_its_entry_incomplete() -> None:
    sd = model()
    packed = pack(sd, model="m")
    table = packed.manifest.chunks
    cache = TieredCache.from_config(CacheConfig(memory_bytes=64 << 20))
    Prefetcher(packed.manifest, empty_targets(packed.manifest, torch.device("cpu")), client=FakeClient(packed.source()),
               cache=cache).run()
    entry = peer_standins.LoadEntry(packed.manifest, lambda row: None, 0.0)
    targets = empty_targets(packed.manifest, torch.device("cpu"))
    counters = Prefetcher(packed.manifest, targets, client=NoFetch(), cache=cache, shelf_entry=entry).run()
    assert counters.bytes["memory"] == packed.manifest.raw_bytes and counters.bytes["peer"] == 0
    assert sorted(entry.landed_rows) == sorted(table.first_rows.tolist()) and entry.ended == [True]

    class Broken:
        def fetch(self, *args: Any, **kwargs: Any) -> FetchStats:
            raise ConnectionError("every peer and server gone")

    failed = peer_standins.LoadEntry(packed.manifest, lambda row: None, 0.0)
    p = Prefetcher(packed.manifest, empty_targets(packed.manifest, torch.device("cpu")), swarm=Broken(), shelf_entry=failed)
    with pytest.raises(ConnectionError):
        p.run()
    assert failed.ended == [False]  # peers waiting on its chunks are answered MISSING at once


def test_load_report_says_bytes_peer_apart_from_the_servers_share() -> None:
    assert "peer" in TIERS
    c = LoadCounters()
    c.bytes.update(network=1 << 30, peer=3 << 30)
    c.network_stored_bytes = 1 << 30

    class Info:
        model, number, tag, manifest_id, read, resolve_s = "m", 3, "prod", "ab" * 32, "leader", 0.0

    packed = pack({"w": torch.zeros(4)}, model="m")
    report = make_report(Info(), packed.manifest, torch.device("cpu"), c, 2.0)  # type: ignore[arg-type]
    assert (report.bytes_peer, report.bytes_network, report.bytes_total) == (3 << 30, 1 << 30, 4 << 30)
    assert report.to_dict()["bytes_peer"] == 3 << 30
    assert "peers 3.000 GiB" in report.summary()
    assert "peers" not in replace(report, bytes_peer=0).summary()  # nothing from peers: not mentioned


def test_metrics_have_tier_peer_and_the_peer_families() -> None:
    m = ServeMetrics()
    stats = [PeerStats(served_bytes=12345, connections=3, dropped={"corrupt": 2, "refused": 1})]
    m.watch_peers(lambda: stats[0])
    m.loaded(10, 20, 30, 40)
    text = m.render().decode()
    assert 'pdparams_load_bytes_total{tier="peer"} 40.0' in text
    assert 'pdparams_load_bytes_total{tier="network"} 30.0' in text
    assert "pdparams_peer_served_bytes_total 12345.0" in text
    assert 'pdparams_peer_dropped_total{reason="corrupt"} 2.0' in text
    assert "pdparams_peer_connections 3.0" in text
    stats[0] = PeerStats()  # no link: the families are there, at zero
    assert "pdparams_peer_served_bytes_total 0.0" in m.render().decode()


# ---------------------------------------------------------------------------- flags, environment, link


def test_peers_env_and_config_refuse_bad_values_in_one_line() -> None:
    assert peers_enabled({}) and peers_enabled({"PARAMS_PEERS": "on"})
    assert not peers_enabled({"PARAMS_PEERS": "off"}) and not peers_enabled({"PARAMS_PEERS": "OFF"})
    with pytest.raises(ConfigError, match="PARAMS_PEERS=off"):
        peers_enabled({"PARAMS_PEERS": "maybe"})
    assert PeerLinkConfig.from_env({"PARAMS_PEER_LISTEN": "127.0.0.2:7070"}).listen == "127.0.0.2:7070"
    assert PeerLinkConfig.from_env({"PARAMS_PEER_LISTEN": "127.0.0.2:7070"}, listen="127.0.0.3:0").listen == "127.0.0.3:0"
    assert not PeerLinkConfig.from_env({"PARAMS_PEERS": "off"}).enabled
    assert not PeerLinkConfig.from_env({}, enabled=False).enabled
    with pytest.raises(ConfigError, match="--peer-listen: 'nonsense'"):
        PeerLinkConfig.from_env({}, listen="nonsense")
    with pytest.raises(ConfigError, match="--peer-advertise"):
        PeerLinkConfig.from_env({}, listen="0.0.0.0:7070")  # a wildcard bind needs an address peers can dial
    assert PeerLinkConfig.from_env({}, listen="0.0.0.0:7070", advertise="10.0.0.5:7070").advertise == "10.0.0.5:7070"
    with pytest.raises(ConfigError, match="wildcard"):
        PeerLinkConfig(advertise="0.0.0.0:7070").validate()
    # Port 0: this host with the port the listener bound (several workers of one host on 0.0.0.0:0).
    zero = PeerLinkConfig.from_env({"PARAMS_PEER_LISTEN": "0.0.0.0:0", "PARAMS_PEER_ADVERTISE": "10.0.0.5:0"})
    assert (zero.listen, zero.advertise) == ("0.0.0.0:0", "10.0.0.5:0")
    assert PeerLink(object(), None, zero).advertised("0.0.0.0:41234") == "10.0.0.5:41234"
    assert PeerLink(object(), None, PeerLinkConfig(advertise="[fd00::5]:0")).advertised("[::]:7") == "[fd00::5]:7"
    assert PeerLink(object(), None, PeerLinkConfig()).advertised("127.0.0.1:9") == "127.0.0.1:9"
    assert PeerLinkConfig.from_env({"PARAMS_PEER_ADVERTISE": "10.0.0.5:1"}, advertise="10.0.0.6:2").advertise == "10.0.0.6:2"
    with pytest.raises(ConfigError, match="--peer-max-connections-per-source"):
        PeerLinkConfig(max_connections_per_source=0).validate()
    listener = PeerLinkConfig(listen="0.0.0.0:7070", advertise="10.0.0.5:7070").listener(None)
    assert listener.open and listener.flag == "--peer-listen"
    assert not PeerLinkConfig(listen="0.0.0.0:7070", advertise="10.0.0.5:7070").listener("tok").open


class Options:
    token: str | None = "read-token"
    tls, tls_ca, tls_cert, tls_key = False, None, None, None


class Client:
    """What the link reads of a ClusterClient: its options (token, TLS) and worker id."""

    options = Options()
    worker_id = "client-test-1"

    def fetch(self, chunks: Any, sink: Any, **kwargs: Any) -> FetchStats:
        return FetchStats()


def test_the_link_serves_the_shelf_announces_the_port_and_closes_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    peer_standins.install(monkeypatch)
    client = Client()
    link = PeerLink(client, None, PeerLinkConfig(max_connections_per_source=7)).start()
    try:
        (port,), (swarm,), (shelf,) = peer_standins.PeerPort.made, peer_standins.Swarm.made, peer_standins.PeerShelf.made
        assert port.shelf is shelf and port.token == "read-token" and port.tls is None
        assert port.config.max_connections_per_source == 7 and port.config.listen == "127.0.0.1:0"
        assert swarm.client is client and swarm.worker_id == "client-test-1"
        assert swarm.address == port.address == link.address and swarm.address.startswith("127.0.0.1:")
        assert swarm.versions == shelf.versions  # what the announces say is what the shelf holds
        packed = pack({"w": torch.zeros(4)}, model="m")
        entry = link.begin(packed.manifest, lambda row: None)
        link.announce()
        assert swarm.announced[-1][0].manifest_id == packed.manifest.id and not swarm.announced[-1][0].complete
        entry.end(True)
        swarm.counters.peers_dropped["corrupt"] = 1
        swarm.counters.peer_bytes = 99
        port.counters.served_bytes = 5
        port.connections = 2
        stats = link.stats()
        assert (stats.served_bytes, stats.connections, dict(stats.dropped), stats.peer_bytes) == (5, 2, {"corrupt": 1}, 99)
    finally:
        link.close()
    assert swarm.closed and port.stopped
    link.close()  # twice is harmless


def test_an_advertised_address_is_what_peers_are_told(monkeypatch: pytest.MonkeyPatch) -> None:
    peer_standins.install(monkeypatch)
    link = PeerLink(Client(), None, PeerLinkConfig(listen="127.0.0.1:0", advertise="10.1.2.3:7070")).start()
    try:
        assert peer_standins.Swarm.made[0].address == "10.1.2.3:7070"
    finally:
        link.close()


def test_link_for_follows_peers_false_attach_none_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    peer_standins.install(monkeypatch)
    monkeypatch.delenv("PARAMS_PEERS", raising=False)
    a, b, c = Client(), Client(), Client()
    assert link_for(a, None, peers=False) is None and not peer_standins.Swarm.made
    attach(b, None)  # --no-peers
    assert link_for(b, None) is None and not peer_standins.Swarm.made
    monkeypatch.setenv("PARAMS_PEERS", "off")
    assert link_for(c, None) is None and not peer_standins.Swarm.made
    monkeypatch.delenv("PARAMS_PEERS")
    first = link_for(c, None)
    assert first is not None and link_for(c, None) is first  # one per client
    close_link(c)
    assert peer_standins.Swarm.made[0].closed


def test_a_library_load_gets_no_open_peer_port_off_loopback_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # No CLI checked the flags first (a library or vLLM load, PARAMS_PEER_LISTEN=0.0.0.0:0): the link
    # applies the listeners' safe default itself, so peers go off with one warning, no port opens.
    peer_standins.install(monkeypatch)

    class NoToken(Options):
        token = None

    client = Client()
    client.options = NoToken()  # type: ignore[assignment]
    warned: list[str] = []
    wide = PeerLinkConfig(listen="0.0.0.0:0", advertise="10.0.0.5:0")
    assert link_for(client, None, config=wide, warn=warned.append) is None
    assert len(warned) == 1 and "read token" in warned[0] and not peer_standins.PeerPort.made
    with_token = Client()  # the same address with the cluster's read token: the port opens
    link = link_for(with_token, None, config=wide)
    try:
        assert link is not None and peer_standins.PeerPort.made
    finally:
        close_link(with_token)


def test_tls_without_a_certificate_turns_peers_off_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    peer_standins.install(monkeypatch)

    class TlsOptions(Options):
        tls, tls_ca = True, "/ca.pem"

    client = Client()
    client.options = TlsOptions()  # type: ignore[assignment]
    warned: list[str] = []
    assert link_for(client, None, warn=warned.append) is None
    assert len(warned) == 1 and "--tls-cert" in warned[0] and not peer_standins.PeerPort.made
    assert link_for(client, None, warn=warned.append) is None and len(warned) == 1  # said once

    class Mutual(Options):
        tls, tls_ca, tls_cert, tls_key = True, "/ca.pem", "/w.pem", "/w.key"

    client.options = Mutual()  # type: ignore[assignment]
    link = PeerLink(client, None).start()
    try:
        assert [str(p) for p in peer_standins.PeerPort.made[0].tls] == ["/ca.pem", "/w.pem", "/w.key"]
    finally:
        link.close()
