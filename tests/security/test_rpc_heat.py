"""ReportHeat is bounded (issue 11, item 3).

A read call once accepted any model, version and chunk index with no bound: three 22 MiB
calls grew a server by 1.3 GiB for good, and one 1M-entry call held the GIL long enough to
change the leader. Now the version must exist, one call carries at most its chunk count of
entries (indexes below it), an oversized message is refused before it is parsed, and the heat
a server keeps is bounded in entries and versions (least recently reported dropped first).

Unit tests for HeatAggregator and the vectorised codec; a real one-server cluster for the RPC.
"""
from __future__ import annotations

import random
import socket
import time
import urllib.request
from typing import Iterator

import grpc
import numpy as np
import pytest
import torch

from deploy.local import LocalCluster
from tests.conftest import local_cluster
from paramserver.client.push import push
from paramserver.client.rpc import ParamServerClient
from paramserver.server.heat import BYTES_PER_ENTRY, HeatAggregator
from paramserver.wire.heat_entries import (
    HeatArrays, HeatEntry, decode_entries, encode_entries, report_header, report_request, request_arrays,
)  # fmt: skip
from paramserver.server.service import MAX_HEAT_REQUEST_BYTES
from paramserver.wire.auth import token_metadata
from paramserver.wire.grpc_options import channel_options
from paramserver.wire.proto import SERVICE_NAME, pb

ADMIN, READ, SECRET = "admin-token-heat", "read-token-heat", "cluster-secret-heat-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


METRICS_PORT = _free_port()


# ------------------------------------------------------------------ the aggregator, in memory


def reference(reports: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    """The aggregation the server always did (a dict of rows), ranked by mean first-access rank."""
    table: dict[int, list[int]] = {}
    for entries in reports:
        for idx, count, order in entries:
            row = table.setdefault(idx, [0, 0, 0])
            row[0] += count
            row[1] += order
            row[2] += 1
    ranked = sorted(table.items(), key=lambda kv: (kv[1][1] / kv[1][2], kv[0]))
    return [(idx, row[0], rank) for rank, (idx, row) in enumerate(ranked)]


def test_aggregation_matches_the_plain_reference() -> None:
    rng = random.Random(3)
    heat = HeatAggregator()
    reports = []
    for _ in range(30):
        entries = [(rng.randrange(50), rng.randrange(1, 1000), rng.randrange(60)) for _ in range(rng.randrange(0, 40))]
        reports.append(entries)
        heat.report("m", 1, [HeatEntry(*e) for e in entries], size=50)
    got, n = heat.get("m", 1)
    assert n == 30
    assert [(e.chunk_index, e.count, e.first_access_order) for e in got] == reference(reports)


def test_heat_is_bounded_in_entries_and_versions() -> None:
    heat = HeatAggregator(max_versions=4, max_entries=1000)
    for v in range(1, 11):
        heat.report("m", v, [HeatEntry(0, 1, 0)], size=300)
        assert heat.entries <= 1000 and heat.versions <= 4
        assert heat.memory_bytes() <= 1000 * BYTES_PER_ENTRY
    # The least recently reported go first: 3 tables of 300 fit in 1000 slots.
    assert [v for v in range(1, 11) if heat.get("m", v)[1]] == [8, 9, 10]
    heat.report("m", 8, [HeatEntry(1, 1, 0)], size=300)  # a report refreshes its version
    heat.report("n", 1, [HeatEntry(0, 1, 0)], size=300)
    assert heat.get("m", 8)[1] == 2 and heat.get("m", 9)[1] == 0
    # Many small versions: the version cap holds.
    for v in range(100):
        heat.report("small", v, [HeatEntry(0, 1, 0)], size=1)
    assert heat.versions == 4


def test_heat_refuses_out_of_range_and_oversized_tables() -> None:
    heat = HeatAggregator(max_entries=100)
    with pytest.raises(ValueError, match="out of range"):
        heat.report("m", 1, [HeatEntry(10, 1, 0)], size=10)
    with pytest.raises(ValueError, match="more than this server keeps"):
        heat.report("m", 1, [HeatEntry(0, 1, 0)], size=101)
    # Without a known size (no metadata plane) the table follows the largest index, still capped.
    heat.report("m", 2, [HeatEntry(4, 1, 0)])
    heat.report("m", 2, [HeatEntry(40, 1, 1)])
    assert heat.entries == 41
    with pytest.raises(ValueError, match="more than this server keeps"):
        heat.report("m", 2, [HeatEntry(100, 1, 0)])
    assert heat.entries == 41


def test_counts_saturate_instead_of_overflowing() -> None:
    heat = HeatAggregator()
    for _ in range(3):
        heat.report("m", 1, HeatArrays.of([(0, (1 << 64) - 1, (1 << 32) - 1)]), size=1)
    (entry,), _ = heat.get("m", 1)
    assert 0 < entry.count < 1 << 63


def _random_request(rng: random.Random, n: int) -> tuple[pb.ReportHeatRequest, list[tuple[int, int, int]]]:
    def value(bits: int) -> int:
        return rng.choice([0, 1, 127, 128, 16383, 16384, rng.randrange(1 << bits), (1 << bits) - 1])

    rows = [(value(32), value(64), value(32)) for _ in range(n)]
    request = pb.ReportHeatRequest(model="m" * rng.randrange(200), version=rng.randrange(1 << 64), worker="w",
                                   entries=[pb.HeatEntry(chunk_index=a, count=b, first_access_order=c) for a, b, c in rows])
    return request, rows


def test_vectorised_decoding_equals_protobuf() -> None:
    rng = random.Random(11)
    for trial in range(120):
        n = rng.randrange(3000) if trial % 4 == 0 else rng.randrange(30)
        request, rows = _random_request(rng, n)
        parsed = pb.ReportHeatRequest.FromString(request.SerializeToString())
        a = request_arrays(parsed)
        assert list(zip(a.index.tolist(), a.count.tolist(), a.order.tolist())) == rows
        back = pb.GetHeatReply.FromString(encode_entries(a.index, a.count, a.order))
        assert [(e.chunk_index, e.count, e.first_access_order) for e in back.entries] == rows
    # Blocks of whole entries: more than one block of bytes.
    request, rows = _random_request(rng, 150_000)
    a = request_arrays(pb.ReportHeatRequest.FromString(request.SerializeToString()))
    assert list(zip(a.index.tolist(), a.count.tolist(), a.order.tolist())) == rows


def test_a_report_request_encoded_as_arrays_is_what_protobuf_parses() -> None:
    rng = random.Random(12)
    for trial in range(60):
        n = rng.randrange(3000) if trial % 4 == 0 else rng.randrange(30)
        request, rows = _random_request(rng, n)
        arrays = HeatArrays.of(rows)
        raw = report_request("model-x", 7, "worker-9", arrays)
        parsed = pb.ReportHeatRequest.FromString(raw)
        assert (parsed.model, parsed.version, parsed.worker) == ("model-x", 7, "worker-9")
        assert [(e.chunk_index, e.count, e.first_access_order) for e in parsed.entries] == rows
        assert list(arrays) == rows and list(arrays.part(1, 3)) == rows[1:3]
        back = request_arrays(parsed)  # and what the server reads back from it
        assert list(back) == rows
    with pytest.raises(ValueError, match="uint32"):
        report_request("m", 1, "w", HeatArrays.of([(1 << 32, 1, 0)]))  # a server would read chunk 0
    one = HeatArrays.of([(1, 1, 1)])
    with pytest.raises(ValueError):
        encode_entries(one.index, one.count, one.order, 16)  # a two-byte key


def test_unknown_fields_and_bad_streams() -> None:
    entry = pb.HeatEntry(chunk_index=5, count=2, first_access_order=1).SerializeToString()
    # An entry carrying an unknown field (number 9, a string): decoded all the same.
    odd = entry + b"\x4a\x03abc"
    raw = pb.ReportHeatRequest(model="m", version=1).SerializeToString() + b"\x22" + bytes([len(odd)]) + odd
    a = request_arrays(pb.ReportHeatRequest.FromString(raw))
    assert (a.index.tolist(), a.count.tolist(), a.order.tolist()) == ([5], [2], [1])
    with pytest.raises(ValueError):
        decode_entries(b"\x22\x02\x08", 1)  # ends inside an entry
    with pytest.raises(ValueError):
        decode_entries(b"\x22\x02\x08\x05", 2)  # fewer entries than parsed


def test_the_header_is_read_without_the_entries() -> None:
    raw = report_request("model-x", 7, "worker-9", HeatArrays.of([(1, 2, 3)] * 1000))
    assert report_header(raw) == ("model-x", 7)
    assert report_header(pb.ReportHeatRequest(worker="w").SerializeToString()) == ("", 0)
    # entries first (no protobuf writes that): the header reading stops at them, names nothing
    assert report_header(entries_bytes(10) + header("m", 1)) == ("", 0)
    for bad in (b"\x0a\x05ab", b"\x10\xff", b"\x0a\x02\xff\xfe", b"\x0f"):
        with pytest.raises(ValueError):
            report_header(bad)


def test_a_real_report_fits_the_byte_limit() -> None:
    """The largest report a client sends (HEAT_ENTRIES_PER_CALL entries, every value at its widest)
    is under MAX_HEAT_REQUEST_BYTES, which is far below the 24 MiB gRPC limit."""
    from paramserver.wire.limits import HEAT_ENTRIES_PER_CALL

    n = HEAT_ENTRIES_PER_CALL
    wide = HeatArrays(np.full(n, (1 << 32) - 1, np.uint64), np.full(n, (1 << 64) - 1, np.uint64),
                      np.full(n, (1 << 32) - 1, np.uint64))
    raw = report_request("m" * 128, (1 << 64) - 1, "w" * 200, wide)
    assert len(raw) <= MAX_HEAT_REQUEST_BYTES <= 8 << 20


def test_one_report_costs_milliseconds_per_mib() -> None:
    """200k entries (about 2.4 MiB): decoding and aggregating is vectorised, well under the
    seconds a Python step per entry took on this machine under load."""
    n = 200_000
    request = pb.ReportHeatRequest(entries=[pb.HeatEntry(chunk_index=i, count=3, first_access_order=n - i) for i in range(n)])
    parsed = pb.ReportHeatRequest.FromString(request.SerializeToString())
    heat = HeatAggregator()
    t0 = time.process_time()
    heat.report("m", 1, request_arrays(parsed), size=n)
    reply = heat.get_reply("m", 1)
    spent = time.process_time() - t0
    assert len(pb.GetHeatReply.FromString(reply).entries) == n
    assert spent < 1.5, f"{spent:.2f} s of CPU for one 200k-entry report"


# ------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("rpc-heat")
    with local_cluster(root, servers=1, admin_token=ADMIN, read_token=READ, secret=SECRET,
                       extra_args=("--no-fsync", "--metrics-port", str(METRICS_PORT))) as c:
        yield c


@pytest.fixture(scope="module")
def version(cluster: LocalCluster) -> tuple[int, int]:
    """(version number, chunk count) of a small pushed model."""
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(10)}
    from chunking import ChunkingConfig

    report = push(cluster.seed, state, model="hot", token=ADMIN, config=ChunkingConfig(chunk_size=64 * 1024))
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        v = c.get_version("hot", report.version).version
    assert v.chunk_count >= 4
    return int(v.number), int(v.chunk_count)


def raw_report(address: str, body: bytes, timeout: float = 30) -> tuple[grpc.StatusCode, str, float]:
    channel = grpc.insecure_channel(address, options=channel_options())
    try:
        call = channel.unary_unary(f"/{SERVICE_NAME}/ReportHeat", request_serializer=lambda b: b,
                                   response_deserializer=pb.ReportHeatReply.FromString)
        t0 = time.monotonic()
        try:
            call(body, timeout=timeout, metadata=token_metadata(READ))
            return grpc.StatusCode.OK, "", time.monotonic() - t0
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", time.monotonic() - t0
    finally:
        channel.close()


def entries_bytes(n: int) -> bytes:
    """``n`` HeatEntry fields (index 1, count 1, order 1), 8 bytes each: built without protobuf."""
    return b"\x22\x06\x08\x01\x10\x01\x18\x01" * n


def header(model: str, version: int) -> bytes:
    return pb.ReportHeatRequest(model=model, version=version, worker="w").SerializeToString()


def test_report_for_a_version_that_does_not_exist_is_refused(cluster: LocalCluster, version: tuple[int, int]) -> None:
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        for model, number in (("hot", version[0] + 50), ("no-such-model", 1)):
            with pytest.raises(grpc.RpcError) as info:
                c.report_heat(model, number, "w", [(0, 1, 0)])
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
            assert not c.get_heat(model, number).entries


def test_a_million_entries_are_refused_fast_naming_the_limit(cluster: LocalCluster, version: tuple[int, int]) -> None:
    number, chunks = version
    code, details, took = raw_report(cluster.addresses[0], header("hot", number) + entries_bytes(500_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert f"the limit is {chunks}" in details and "chunk count" in details
    assert took < 5.0, f"refusing took {took:.1f} s"
    # Over the byte limit: refused before it is parsed.
    n = MAX_HEAT_REQUEST_BYTES // 8 + 1000
    code, details, took = raw_report(cluster.addresses[0], header("hot", number) + entries_bytes(n))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"the limit is {MAX_HEAT_REQUEST_BYTES}" in details, details
    assert took < 5.0


def test_indexes_must_be_below_the_chunk_count(cluster: LocalCluster, version: tuple[int, int]) -> None:
    number, chunks = version
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        with pytest.raises(grpc.RpcError) as info:
            c.report_heat("hot", number, "w", [(0, 1, 0), (chunks, 1, 1)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"chunk_index {chunks}" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            c.report_heat("m" * 200, 1, "w", [(0, 1, 0)])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_valid_reports_aggregate_and_the_server_keeps_serving(cluster: LocalCluster, version: tuple[int, int]) -> None:
    number, chunks = version
    with ParamServerClient(cluster.addresses[0], token=READ) as c:
        full = [(i, 2, chunks - 1 - i) for i in range(chunks)]  # the largest report allowed
        for _ in range(20):
            c.report_heat("hot", number, "w1", full)
        reply = c.get_heat("hot", number)
        assert reply.reports == 20
        assert [(e.chunk_index, e.count) for e in reply.entries] == [(i, 40) for i in reversed(range(chunks))]
        assert c.server_status().server_id == "ps1"


def heat_metrics(cluster: LocalCluster) -> dict[str, float]:
    host = cluster.addresses[0].rpartition(":")[0]
    req = urllib.request.Request(f"http://{host}:{METRICS_PORT}/metrics", headers={"Authorization": f"Bearer {READ}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition("{")
        if name in ("paramserver_heat_reports_parsed_total", "paramserver_heat_reports_refused_unparsed_total",
                    "paramserver_raft_term", "paramserver_is_leader"):
            values[name.removesuffix("_total")] = float(value.rsplit(" ", 1)[1])
    return values


@pytest.mark.timeout(180)
def test_large_or_unknown_reports_are_refused_before_a_parse(cluster: LocalCluster, version: tuple[int, int]) -> None:
    """Issue 41: reports under the 24 MiB gRPC limit were parsed before their model was checked (a
    flood: 5 elections, RSS doubled for good). 20 MiB reports, and smaller ones for a model the
    server does not have, are refused unparsed (the server's counters say so), the term stays."""
    address = cluster.addresses[0]
    before = heat_metrics(cluster)
    twenty = header("no-such-model", 1) + entries_bytes((20 << 20) // 8)
    for _ in range(5):
        code, details, took = raw_report(address, twenty)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"the limit is {MAX_HEAT_REQUEST_BYTES}" in details, details
        assert took < 10.0
    under_limit = header("no-such-model", 1) + entries_bytes((MAX_HEAT_REQUEST_BYTES - 1024) // 8)
    for _ in range(5):
        code, details, _ = raw_report(address, under_limit)
        assert code == grpc.StatusCode.NOT_FOUND, details
    code, details, _ = raw_report(address, entries_bytes(1000))  # no model, no version
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "model and version" in details, details
    after = heat_metrics(cluster)
    assert after["paramserver_heat_reports_parsed"] == before["paramserver_heat_reports_parsed"], (before, after)
    assert after["paramserver_heat_reports_refused_unparsed"] - before["paramserver_heat_reports_refused_unparsed"] == 11
    assert after["paramserver_raft_term"] == before["paramserver_raft_term"] and after["paramserver_is_leader"] == 1.0
    # a report for the real version is parsed and taken, counted as such
    number, _chunks = version
    code, details, _ = raw_report(address, header("hot", number) + entries_bytes(3))
    assert code == grpc.StatusCode.OK, details
    assert heat_metrics(cluster)["paramserver_heat_reports_parsed"] == before["paramserver_heat_reports_parsed"] + 1
    # a second model field after the entries (it would win in the parse) is refused
    code, details, _ = raw_report(address, header("hot", number) + entries_bytes(3) + b"\x0a\x02zz")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "twice" in details, details
