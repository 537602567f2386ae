"""Data plane against a real server process (python -m paramserver.server.dataplane_dev) on loopback."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import zstandard
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunking.hashing import content_id, crc32c
from paramserver.client.rpc import ChunkData, ParamServerClient, make_chunk
from paramserver.wire.proto import pb
from paramserver.server.segments import ChunkLocation, corrupt_stored, locate_on_disk
from tests.conftest import stop_process

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-abc", "read-token-xyz"
KiB, MiB = 1024, 1 << 20
MAX_MESSAGE = 4 * MiB


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], address: str, data_dir: Path) -> None:
        self.proc, self.address, self.data_dir = proc, address, data_dir

    def chunk_at(self, cid: str) -> ChunkLocation:
        loc = locate_on_disk(self.data_dir, cid)  # from the segment files: the server holds the index
        assert loc is not None, f"chunk {cid} is not on disk"
        return loc


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("dataplane")
    port_file = root / "port"
    env = {**os.environ, "PARAMS_ADMIN_TOKEN": ADMIN, "PARAMS_READ_TOKEN": READ}
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.server.dataplane_dev", "--data-dir", str(root / "data"), "--port-file", str(port_file),
         "--cache-bytes", "0", "--max-message-bytes", str(MAX_MESSAGE), "--get-message-bytes", str(1 * MiB), "--no-fsync"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early: {proc.stdout.read().decode() if proc.stdout else ''}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start within 30 s")
            time.sleep(0.05)
        yield Server(proc, f"127.0.0.1:{port_file.read_text()}", root / "data")
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def admin(server: Server) -> Iterator[ParamServerClient]:
    with ParamServerClient(server.address, token=ADMIN) as client:
        client.wait_ready(10)
        yield client


@pytest.fixture(scope="module")
def reader(server: Server) -> Iterator[ParamServerClient]:
    with ParamServerClient(server.address, token=READ) as client:
        yield client


def random_chunks(n: int, size: int) -> list[ChunkData]:
    out = []
    for _ in range(n):
        data = os.urandom(size)
        out.append(make_chunk(content_id(data), data))
    return out


def test_put_has_get_round_trip_with_coalesced_messages(admin: ParamServerClient, reader: ParamServerClient) -> None:
    chunks = random_chunks(96, 64 * KiB)
    raw = bytes(300 * KiB)
    zstored = zstandard.ZstdCompressor().compress(raw)
    chunks.append(make_chunk(content_id(raw), zstored, codec="zstd", raw_size=len(raw)))
    reply = admin.put_chunks(chunks, batch_bytes=1 * MiB)
    assert reply.chunks_stored == len(chunks) and reply.chunks_present == 0
    assert reply.bytes_stored == sum(len(c.data) for c in chunks)
    assert [a.status for a in reply.acks] == [pb.STORED] * len(chunks)
    again = admin.put_chunks(chunks[:10])
    assert again.chunks_present == 10 and again.chunks_stored == 0 and again.bytes_stored == 0

    ids = [c.id for c in chunks]
    unknown = "0" * 64
    assert reader.has_chunks(ids + [unknown]) == [True] * len(ids) + [False]

    got = list(reader.get_chunks(ids))
    assert [g.id for g in got] == ids
    assert all(g == c for g, c in zip(got, chunks))  # stored bytes, codec, sizes and CRC as pushed

    # Many chunks per message, never more than the requested target (plus one chunk).
    messages = list(reader.stub.GetChunks(pb.GetChunksRequest(ids=ids[:96], max_message_bytes=512 * KiB)))
    per_message = [len(m.chunks) for m in messages]
    assert sum(per_message) == 96 and len(messages) == 12 and max(per_message) == 8
    assert all(sum(len(c.data) for c in m.chunks) <= 512 * KiB for m in messages)


def test_unknown_chunk_not_found_or_listed_missing(admin: ParamServerClient, reader: ParamServerClient) -> None:
    [chunk] = random_chunks(1, 4 * KiB)
    admin.put_chunks([chunk])
    unknown = "ab" * 32
    with pytest.raises(grpc.RpcError) as info:
        list(reader.get_chunks([chunk.id, unknown]))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and unknown in info.value.details()
    items = list(reader.get_chunks_partial([chunk.id, unknown]))
    assert items[0] == chunk
    assert isinstance(items[1], pb.ChunkAck) and items[1].id == unknown and items[1].status == pb.MISSING


def test_corrupt_file_gives_data_loss_naming_the_chunk(server: Server, admin: ParamServerClient, reader: ParamServerClient) -> None:
    a, b = random_chunks(2, 32 * KiB)
    admin.put_chunks([a, b])
    before = reader.server_status().quarantined
    for victim in (a, b):
        corrupt_stored(server.chunk_at(victim.id), at=123, xor=0x01)
    with pytest.raises(grpc.RpcError) as info:
        list(reader.get_chunks([a.id]))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert a.id in info.value.details() and "corrupt" in info.value.details()
    items = list(reader.get_chunks_partial([b.id]))
    assert len(items) == 1 and isinstance(items[0], pb.ChunkAck) and items[0].status == pb.CORRUPT
    status = reader.server_status()
    assert status.quarantined == before + 2 and status.repair_queue >= 2
    assert reader.has_chunks([a.id, b.id]) == [False, False]
    # Re-pushing good bytes repairs the copy.
    assert admin.put_chunks([a]).chunks_stored == 1
    assert list(reader.get_chunks([a.id])) == [a]


def test_bytes_not_matching_id_are_invalid_and_store_unchanged(admin: ParamServerClient, reader: ParamServerClient) -> None:
    [good] = random_chunks(1, 16 * KiB)
    wrong = os.urandom(16 * KiB)
    liar = ChunkData(good.id, "raw", len(wrong), crc32c(wrong), wrong)
    count = reader.server_status().chunk_count
    with pytest.raises(grpc.RpcError) as info:
        admin.put_chunks([liar])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert good.id in info.value.details() and "not to its id" in info.value.details()
    bad_id = ChunkData("../../etc/passwd", "raw", len(wrong), crc32c(wrong), wrong)
    with pytest.raises(grpc.RpcError) as info:
        admin.put_chunks([bad_id])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a content id" in info.value.details()
    assert reader.has_chunks([good.id]) == [False]
    assert reader.server_status().chunk_count == count


def test_truncated_chunk_is_data_loss(admin: ParamServerClient) -> None:
    [chunk] = random_chunks(1, 16 * KiB)
    truncated = ChunkData(chunk.id, chunk.codec, chunk.raw_size, chunk.crc32c, chunk.data[:-100])
    with pytest.raises(grpc.RpcError) as info:
        admin.put_chunks([truncated])
    assert info.value.code() == grpc.StatusCode.DATA_LOSS and chunk.id in info.value.details()


def test_oversized_message_is_resource_exhausted(admin: ParamServerClient, reader: ParamServerClient) -> None:
    [big] = random_chunks(1, MAX_MESSAGE + 64 * KiB)
    with pytest.raises(grpc.RpcError) as info:
        admin.put_chunks([big], batch_bytes=16 * MiB)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reader.has_chunks([big.id]) == [False]


def test_tokens(server: Server, reader: ParamServerClient) -> None:
    [chunk] = random_chunks(1, 4 * KiB)
    with pytest.raises(grpc.RpcError) as info:
        reader.put_chunks([chunk])  # read token cannot write
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "admin token" in info.value.details()
    assert READ not in info.value.details()
    with ParamServerClient(server.address, token="not-the-token") as wrong, ParamServerClient(server.address) as anonymous:
        for client in (wrong, anonymous):
            with pytest.raises(grpc.RpcError) as info:
                client.has_chunks([chunk.id])
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "read token" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                list(client.get_chunks([chunk.id]))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The health service is open to probes without a token.
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdparams.v1.ParamServer"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_metadata_rpcs_unavailable_without_a_metadata_plane(reader: ParamServerClient) -> None:
    with pytest.raises(grpc.RpcError) as info:
        reader.resolve_tag("m", "prod")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_heat_reports_aggregate(reader: ParamServerClient) -> None:
    reader.report_heat("m", 1, "w1", [(0, 3, 1), (1, 5, 0)])
    reader.report_heat("m", 1, "w2", [(0, 1, 1), (1, 1, 0), (2, 1, 2)])
    reply = reader.get_heat("m", 1)
    assert reply.reports == 2
    assert [(e.chunk_index, e.count) for e in reply.entries] == [(1, 6), (0, 4), (2, 1)]
