"""The bulk write protocol: framing, acks, tokens, per-chunk errors, limits, and SendSession over it.

Servers here are in-process BulkServers over real ChunkStores on loopback (fsync off); gRPC is
replaced by fake PutChunks clients where a fallback is exercised.
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from paramserver.client.bulk_transport import BulkClient
from paramserver.client.bulk_writer import BulkWriteError, BulkWriter, BulkWriteRefused, WriteBatch
from paramserver.client.push_send_plan import ACK_CODES
from paramserver.client.push_plan import AckLedger
from paramserver.client.push_sender import SendOptions, SendSession, send_round
from paramserver.client.rpc import ChunkData
from paramserver.server.auth import AuthConfig
from paramserver.server.bulk_port import BulkServer, BulkServerConfig, check_write_token
from paramserver.server.errors import StoreFullError
from paramserver.server.store import ChunkStore
from paramserver.wire import bulk_frames as bf
from paramserver.wire.proto import pb

ADMIN, READ = "admin-token-w", "read-token-w"


def make_chunk(size: int, seed: int | None = None) -> ChunkData:
    data = os.urandom(size) if seed is None else bytes([seed % 251]) * size
    return ChunkData(content_id(data), "raw", len(data), crc32c(data), data)


def item_of(c: ChunkData) -> bytes:
    return bf.encode_put_item(c.id, c.codec, c.raw_size, len(c.data), c.crc32c)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore(tmp_path / "s", cache_bytes=0, fsync=False)
    yield s
    s.close()


def serve(store: ChunkStore, auth: AuthConfig = AuthConfig(admin_token=ADMIN, read_token=READ), **kw: Any) -> BulkServer:
    extra = {k: kw.pop(k) for k in ("forward_to", "server_id", "repair_queue") if k in kw}
    return BulkServer(store, auth, "127.0.0.1:0", BulkServerConfig(**kw), **extra).start()


class Acks:
    """Collects on_acks calls of a BulkWriter."""

    def __init__(self) -> None:
        self.got: list[tuple[WriteBatch, list[tuple[int, str, int]], int]] = []
        self.lock = threading.Lock()

    def __call__(self, batch: WriteBatch, acks: list[tuple[int, str, int]], replicas: int) -> None:
        with self.lock:
            self.got.append((batch, acks, replicas))

    def statuses(self) -> list[int]:
        return [a[0] for _b, acks, _r in self.got for a in acks]


def put(writer: BulkWriter, chunks: list[ChunkData]) -> WriteBatch:
    return writer.put(chunks, [item_of(c) for c in chunks], [c.data for c in chunks], sum(len(c.data) for c in chunks))


# ------------------------------------------------------------------ framing


def test_put_item_and_batch_round_trip() -> None:
    chunks = [make_chunk(1000 + i) for i in range(5)]
    items = b"".join(item_of(c) for c in chunks)
    assert bf.PUT_ITEM.size == 72 and len(items) == 5 * 72
    batch = bf.PutBatch(7, items, ["127.0.0.1:1"])
    assert batch.ids == [c.id for c in chunks] and batch.codecs == ["raw"] * 5
    assert batch.stored_sizes == [len(c.data) for c in chunks] and batch.crcs == [c.crc32c for c in chunks]
    assert batch.payload_bytes == sum(len(c.data) for c in chunks) and batch.route == ["127.0.0.1:1"]
    batch.buffer = memoryview(bytearray(b"".join(c.data for c in chunks)))
    got = batch.chunks()
    assert [bytes(g.data) for g in got] == [c.data for c in chunks] and all(isinstance(g.data, memoryview) and g.data.readonly for g in got)


def test_put_item_refuses_bad_ids_and_codecs() -> None:
    with pytest.raises(ValueError, match="64 hex"):
        bf.encode_put_item("ab" * 31, "raw", 1, 1, 0)
    with pytest.raises(ValueError, match="codec"):
        bf.encode_put_item("ab" * 32, "z" * 19, 1, 1, 0)


def test_put_batch_refuses_oversized_fields() -> None:
    bad = bytearray(bf.encode_put_item("ab" * 32, "raw", 1, 1, 0))
    bad[33] = 40  # codec_len
    with pytest.raises(bf.ProtocolError, match="codec length 40"):
        bf.PutBatch(1, bytes(bad), [])
    big = bf.encode_put_item("ab" * 32, "raw", 1, bf.MAX_CHUNK_BYTES + 1, 0)
    with pytest.raises(bf.ProtocolError, match="stored_size"):
        bf.PutBatch(1, big, [])


def test_acks_round_trip_and_error_frame() -> None:
    acks = [(bf.STORED, "", 0), (bf.FULL, "disk full", 1234), (bf.CORRUPT_IN_TRANSIT, "crc bad", 0), (bf.ALREADY_PRESENT, "", 0)]
    frame = bf.encode_acks(3, 2, acks)
    kind, replicas, seq, count, msg_bytes = bf.ACK_HEAD.unpack(frame[: bf.ACK_HEAD.size])
    assert (kind, replicas, seq, count) == (bf.A_ACKS, 2, 3, 2)
    items = frame[bf.ACK_HEAD.size : bf.ACK_HEAD.size + 4 * bf.ACK_ITEM.size]
    assert bf.decode_acks(items, frame[bf.ACK_HEAD.size + 4 * bf.ACK_ITEM.size :]) == acks
    with pytest.raises(bf.ProtocolError, match="message bytes"):
        bf.decode_acks(items, b"short")
    err = bf.encode_ack_error(9, "nope", bf.E_BUSY)
    assert bf.ACK_HEAD.unpack(err[: bf.ACK_HEAD.size]) == (bf.A_ERROR, bf.E_BUSY, 9, 0, 4) and err.endswith(b"nope")


def test_route_limits() -> None:
    assert bf.decode_route(bf.encode_route(["a:1", "b:2"])) == ["a:1", "b:2"] and bf.decode_route(b"") == []
    with pytest.raises(ValueError):
        bf.encode_route(["x:1"] * (bf.MAX_ROUTE_HOPS + 1))
    with pytest.raises(bf.ProtocolError):
        bf.decode_route(b"a:1,,b:2")


def test_error_mapping_matches_putchunks_codes() -> None:
    assert ACK_CODES[bf.INVALID] == grpc.StatusCode.INVALID_ARGUMENT
    assert ACK_CODES[bf.CORRUPT_IN_TRANSIT] == grpc.StatusCode.DATA_LOSS
    assert ACK_CODES[bf.FULL] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ACK_CODES[bf.FAILED] == grpc.StatusCode.UNAVAILABLE


def test_write_token_rules() -> None:
    assert check_write_token("", AuthConfig()) is None  # no admin token: writes are open, as over gRPC
    assert check_write_token(ADMIN, AuthConfig(admin_token=ADMIN, read_token=READ)) is None
    for token in (READ, "", "wrong"):
        message = check_write_token(token, AuthConfig(admin_token=ADMIN, read_token=READ))
        assert message is not None and "admin token" in message and (not token or token not in message)


# ------------------------------------------------------------------ one session against a real store


def test_put_stores_durably_then_acks_and_repeats_are_already_present(store: ChunkStore) -> None:
    server = serve(store)
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks)
        chunks = [make_chunk(100_000 + i) for i in range(20)]
        put(w, chunks[:12])
        put(w, chunks[12:])
        assert w.drain(10)
        assert acks.statuses() == [bf.STORED] * 20 and [b.seq for b, _a, _r in acks.got] == [1, 2]
        assert all(bytes(store.get(c.id).data) == c.data for c in chunks)
        put(w, chunks[:3])
        assert w.drain(10) and acks.statuses()[20:] == [bf.ALREADY_PRESENT] * 3
        w.close(goodbye=True)
        assert server.write_stats["chunks"] == 23
    finally:
        server.stop()


def test_read_token_and_wrong_token_cannot_write_and_nothing_is_stored(store: ChunkStore) -> None:
    server = serve(store)
    try:
        for token in (READ, "wrong-token", None):
            with pytest.raises(BulkWriteRefused, match="admin token") as info:
                BulkWriter(server.address, token, Acks())
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert len(store) == 0
        # reads with the read token still work on the same port
        assert list(BulkClient(server.address, READ).fetch(["ab" * 32]))[0].status == bf.MISSING
    finally:
        server.stop()


def test_corrupt_in_transit_chunk_is_refused_by_name_and_the_rest_of_its_put_is_stored(store: ChunkStore) -> None:
    server = serve(store, server_id="ps9")
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks)
        chunks = [make_chunk(50_000 + i) for i in range(5)]
        bad = chunks[2]
        items = [item_of(c) for c in chunks]
        payloads: list[bytes] = [c.data for c in chunks]
        payloads[2] = bytes([bad.data[0] ^ 1]) + bad.data[1:]  # damaged on the way: the declared CRC no longer matches
        w.put(chunks, items, payloads, sum(len(p) for p in payloads))
        assert w.drain(10)
        got = acks.got[0][1]
        assert [a[0] for a in got] == [bf.STORED, bf.STORED, bf.CORRUPT_IN_TRANSIT, bf.STORED, bf.STORED]
        assert bad.id in got[2][1] and "ps9" in got[2][1] and "CRC32C" in got[2][1]
        assert not store.has(bad.id) and all(store.has(c.id) for c in chunks if c is not bad)
    finally:
        server.stop()


def test_bytes_that_do_not_match_their_id_are_invalid(store: ChunkStore) -> None:
    server = serve(store)
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks)
        good = make_chunk(3000)
        forged_data = os.urandom(3000)
        forged = ChunkData("cd" * 32, "raw", 3000, crc32c(forged_data), forged_data)
        put(w, [forged, good])
        assert w.drain(10)
        (s1, m1, _), (s2, _m2, _) = acks.got[0][1]
        assert s1 == bf.INVALID and forged.id in m1 and s2 == bf.STORED
    finally:
        server.stop()


def test_full_disk_is_answered_full_with_free_bytes(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(chunks: Iterable[Any]) -> list[bool]:
        raise StoreFullError("chunk store /x is full: 4096 bytes free", free_bytes=4096)

    monkeypatch.setattr(store, "put_many", full)
    server = serve(store)
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks)
        put(w, [make_chunk(1000), make_chunk(1001)])
        assert w.drain(10)
        assert [(a[0], a[2]) for a in acks.got[0][1]] == [(bf.FULL, 4096)] * 2 and "full" in acks.got[0][1][0][1]
    finally:
        server.stop()


def test_window_blocks_the_sender_until_acks_arrive(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real = store.put_many

    def slow(chunks: Iterable[Any]) -> list[bool]:
        gate.wait(10)
        return real(chunks)

    monkeypatch.setattr(store, "put_many", slow)
    server = serve(store)
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks, window=2)
        put(w, [make_chunk(100)])
        put(w, [make_chunk(101)])
        done = threading.Event()

        def third() -> None:
            put(w, [make_chunk(102)])
            done.set()

        threading.Thread(target=third, daemon=True).start()
        assert not done.wait(0.5)  # window full: the third PUT waits
        gate.set()
        assert done.wait(10) and w.drain(10) and len(acks.got) == 3
    finally:
        server.stop()


def raw_write_conn(server: BulkServer, token: str = ADMIN) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(bf.encode_write_hello(token))
    head = sock.recv(bf.WELCOME.size, socket.MSG_WAITALL)
    assert bf.WELCOME.unpack(head) == (bf.WRITE_MAGIC, bf.W_OK, 0)
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return out
        out += part


@pytest.mark.parametrize("message, problem", [
    (bf.PUT_HEAD.pack(bf.MAX_PUT_ITEMS + 1, 1, 0, 0), "at most 512 chunks"),
    (bf.PUT_HEAD.pack(1, 5, 10, 0), "out of order: expected 1"),
    (bf.PUT_HEAD.pack(1, 1, bf.MAX_PUT_BYTES + 1, 0), "payload bytes"),
    (bf.PUT_HEAD.pack(1, 1, 999, 0) + bf.encode_put_item("ab" * 32, "raw", 10, 10, 0), "declares 999 payload bytes, its chunks 10"),
    (bf.PUT_HEAD.pack(1, 1, 0, bf.MAX_ROUTE_BYTES + 1), "route"),
])  # fmt: skip
def test_malformed_put_gets_an_error_frame_and_close_and_the_server_goes_on(store: ChunkStore, message: bytes, problem: str) -> None:
    server = serve(store)
    try:
        sock = raw_write_conn(server)
        sock.sendall(message)
        reply = read_all(sock)
        kind, _cls, _seq, count, n = bf.ACK_HEAD.unpack(reply[: bf.ACK_HEAD.size])
        assert kind == bf.A_ERROR and count == 0 and problem in reply[bf.ACK_HEAD.size :].decode()
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks)  # still serving
        put(w, [make_chunk(10)])
        assert w.drain(10) and acks.statuses() == [bf.STORED]
    finally:
        server.stop()


def test_truncated_put_is_not_stored_and_the_connection_closes(store: ChunkStore) -> None:
    server = serve(store)
    try:
        c = make_chunk(5000)
        sock = raw_write_conn(server)
        sock.sendall(bf.PUT_HEAD.pack(1, 1, 5000, 0) + item_of(c) + c.data[:100])
        sock.shutdown(socket.SHUT_WR)
        assert read_all(sock) == b""
        assert not store.has(c.id)
    finally:
        server.stop()


def test_a_put_that_never_finishes_times_out(store: ChunkStore) -> None:
    server = serve(store, io_timeout_s=0.3, min_write_rate=1 << 30)
    try:
        c = make_chunk(5000)
        sock = raw_write_conn(server)
        sock.sendall(bf.PUT_HEAD.pack(1, 1, 5000, 0) + item_of(c))  # and then nothing
        reply = read_all(sock)
        assert bf.ACK_HEAD.unpack(reply[: bf.ACK_HEAD.size])[:2] == (bf.A_ERROR, bf.E_BUSY) and b"in time" in reply
        assert server.budget.used == 0  # its buffer was given back
    finally:
        server.stop()


def test_writes_off_and_write_session_limit_refuse_the_hello(store: ChunkStore) -> None:
    server = serve(store, writes=False)
    try:
        with pytest.raises(BulkWriteRefused, match="bulk writes are off") as info:
            BulkWriter(server.address, ADMIN, Acks())
        assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop()
    server = serve(store, max_write_connections=1)
    try:
        first = BulkWriter(server.address, ADMIN, Acks())
        with pytest.raises(BulkWriteRefused, match="too many bulk write sessions"):
            BulkWriter(server.address, ADMIN, Acks())
        first.close(goodbye=True)
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server saw the goodbye
            try:
                BulkWriter(server.address, ADMIN, Acks()).close(goodbye=True)
                break
            except BulkWriteRefused:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        server.stop()


def test_hello_timeout_still_applies_to_write_hellos(store: ChunkStore) -> None:
    server = serve(store, hello_timeout_s=0.3)
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(struct.pack("<4sH", bf.WRITE_MAGIC, bf.WRITE_VERSION))  # half a hello, then silence
        assert read_all(sock) == b""
        assert server.refused >= 1
    finally:
        server.stop()


def test_a_server_that_serves_reads_only_is_told_apart() -> None:
    """A read-only bulk port (an older server) answers a write hello with a read welcome: UNIMPLEMENTED."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def old_server() -> None:
        conn, _ = lsock.accept()
        conn.recv(64)
        conn.sendall(bf.encode_welcome(bf.W_BAD_HELLO, "not a bulk hello (bad magic)"))
        conn.close()

    t = threading.Thread(target=old_server, daemon=True)
    t.start()
    with pytest.raises(BulkWriteRefused, match="bad magic") as info:
        BulkWriter(f"127.0.0.1:{lsock.getsockname()[1]}", ADMIN, Acks())
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    t.join(5)
    lsock.close()


def test_writer_refuses_acks_that_do_not_match_its_puts() -> None:
    a, b = socket.socketpair()
    lsock = socket.create_server(("127.0.0.1", 0))

    def fake() -> None:
        conn, _ = lsock.accept()
        conn.recv(64)
        conn.sendall(bf.encode_write_welcome(bf.W_OK))
        conn.recv(1 << 20)
        conn.sendall(bf.encode_acks(1, 1, [(bf.STORED, "", 0)] * 3))  # 3 acks for a PUT of 1 chunk
        time.sleep(0.5)
        conn.close()

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    w = BulkWriter(f"127.0.0.1:{lsock.getsockname()[1]}", ADMIN, Acks())
    put(w, [make_chunk(10)])
    with pytest.raises(BulkWriteError, match="bad reply") as info:
        w.drain(5)
    assert info.value.code == grpc.StatusCode.INTERNAL
    w.close()
    t.join(5)
    lsock.close()
    a.close()
    b.close()


# ------------------------------------------------------------------ SendSession


class FakeGrpc:
    """A PutChunks client that stores into ``store`` (the fallback path)."""

    def __init__(self, store: ChunkStore | None = None) -> None:
        self.store = store
        self.received: list[str] = []

    def put_chunks(self, chunks: Iterable[ChunkData], batch_bytes: int = 0) -> pb.PutChunksReply:
        reply = pb.PutChunksReply()
        for c in chunks:
            if self.store is not None:
                self.store.put(c.id, c.data, c.codec, c.raw_size, c.crc32c)
            self.received.append(c.id)
            reply.acks.add(id=c.id, status=pb.STORED)
        return reply


def view_of(addresses: dict[str, str], token: str | None = ADMIN, grpc_clients: dict[str, FakeGrpc] | None = None) -> Any:
    members = {s: pb.Member(server_id=s, grpc_address="127.0.0.1:1", bulk_address=a) for s, a in addresses.items()}

    def server_client(s: str) -> Any:
        if grpc_clients is None or s not in grpc_clients:
            raise RuntimeError(f"no gRPC client for {s}")
        return grpc_clients[s]

    return SimpleNamespace(members=members, options=SimpleNamespace(token=token, tls=False, tls_ca=None, tls_cert=None),
                           server_client=server_client)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[tuple[dict[str, ChunkStore], dict[str, BulkServer]]]:
    stores = {f"s{i}": ChunkStore(tmp_path / f"s{i}", cache_bytes=0, fsync=False) for i in range(3)}
    servers: dict[str, BulkServer] = {}
    for sid, st in stores.items():
        servers[sid] = serve(st, server_id=sid, forward_to=lambda: {b.address for b in servers.values()})
    yield stores, servers
    for b in servers.values():
        b.stop()
    for st in stores.values():
        st.close()


def run_session(view: Any, chunks: list[ChunkData], servers: list[str], options: SendOptions) -> tuple[AckLedger, dict, Any, list[int]]:
    ledger = AckLedger({c.id: servers for c in chunks}, 2)
    seen: list[int] = []
    with SendSession(view, ledger, options, seen.append) as session:
        for k, c in enumerate(chunks):
            session.submit(c, servers[k % 3 :] + servers[: k % 3])
        failed = session.finish()
    assert seen == sorted(seen)
    return ledger, failed, session.stats, seen


@pytest.mark.parametrize("chain", [False, True])
def test_session_delivers_every_chunk_to_every_replica(trio: Any, chain: bool) -> None:
    stores, servers = trio
    chunks = [make_chunk(60_000 + 7 * i) for i in range(60)]
    view = view_of({s: b.address for s, b in servers.items()})
    ledger, failed, stats, seen = run_session(view, chunks, list(servers), SendOptions(chain=chain, batch_bytes=256 << 10, window=2))
    assert failed == {} and ledger.short() == [] and all(ledger.count(c.id) == 3 for c in chunks)
    assert all(bytes(st.get(c.id).data) == c.data for st in stores.values() for c in chunks)
    assert stats.bulk_servers == set(servers) and stats.bulk_fallbacks == 0 and stats.grpc_servers == set()
    assert seen[-1] == 3 * sum(len(c.data) for c in chunks)
    if chain:
        assert stats.chain_puts == stats.bulk_puts > 0 and stats.chain_off == ""
        assert sum(b.write_stats["forwarded"] for b in servers.values()) >= 2 * stats.chain_puts
    else:
        assert stats.chain_puts == 0


def test_chain_without_forwarding_servers_degrades_to_direct_sends(tmp_path: Path) -> None:
    stores = {f"s{i}": ChunkStore(tmp_path / f"s{i}", cache_bytes=0, fsync=False) for i in range(3)}
    servers = {sid: serve(st, server_id=sid) for sid, st in stores.items()}  # no forward_to
    try:
        chunks = [make_chunk(20_000 + i) for i in range(30)]
        view = view_of({s: b.address for s, b in servers.items()})
        ledger, failed, stats, _ = run_session(view, chunks, list(servers), SendOptions(chain=True, batch_bytes=64 << 10))
        assert failed == {} and all(ledger.count(c.id) == 3 for c in chunks)
        assert "does not forward" in stats.chain_off and stats.chain_resent > 0
    finally:
        for b in servers.values():
            b.stop()


def test_no_bulk_port_and_refused_bulk_session_fall_back_to_putchunks(trio: Any) -> None:
    stores, servers = trio
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there
    fakes = {"s1": FakeGrpc(stores["s1"]), "s2": FakeGrpc(stores["s2"])}
    view = view_of({"s0": servers["s0"].address, "s1": dead, "s2": ""}, grpc_clients=fakes)
    chunks = [make_chunk(30_000 + i) for i in range(25)]
    ledger, failed, stats, _ = run_session(view, chunks, ["s0", "s1", "s2"], SendOptions(batch_bytes=100_000))
    assert failed == {} and all(ledger.count(c.id) == 3 for c in chunks)
    assert stats.bulk_servers == {"s0"} and stats.grpc_servers == {"s1", "s2"}
    assert stats.bulk_fallbacks == 1 and "cannot connect" in stats.fallback_reasons["s1"]
    assert sorted(fakes["s1"].received) == sorted(c.id for c in chunks) == sorted(fakes["s2"].received)


def test_a_wrong_token_fails_unauthenticated_without_falling_back(trio: Any) -> None:
    stores, servers = trio
    fakes = {s: FakeGrpc() for s in servers}
    view = view_of({s: b.address for s, b in servers.items()}, token=READ, grpc_clients=fakes)
    chunks = [make_chunk(1000 + i) for i in range(5)]
    ledger, failed, stats, _ = run_session(view, chunks, list(servers), SendOptions())
    assert set(failed) == set(servers) and all(code == grpc.StatusCode.UNAUTHENTICATED for code, _m in failed.values())
    assert "admin token" in failed["s0"][1] and stats.bulk_fallbacks == 0
    assert all(not f.received for f in fakes.values()) and all(len(st) == 0 for st in stores.values())
    assert ledger.short() == [c.id for c in chunks]


def test_per_chunk_errors_map_to_grpc_codes_and_spare_the_other_chunks(trio: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stores, servers = trio

    def full(chunks: Iterable[Any]) -> list[bool]:
        raise StoreFullError("disk full under /data", free_bytes=77)

    monkeypatch.setattr(stores["s2"], "put_many", full)
    good = [make_chunk(4000 + i) for i in range(6)]
    forged_data = os.urandom(4000)
    forged = ChunkData("ef" * 32, "raw", 4000, crc32c(forged_data), forged_data)
    view = view_of({s: b.address for s, b in servers.items()})
    ledger = AckLedger({c.id: list(servers) for c in [*good, forged]}, 2)
    with SendSession(view, ledger, SendOptions(), lambda n: None) as session:
        for c in good[:3] + [forged] + good[3:]:
            session.submit(c, list(servers))
        failed = session.finish()
    assert failed["s0"][0] == failed["s1"][0] == grpc.StatusCode.INVALID_ARGUMENT and forged.id in failed["s0"][1]
    assert failed["s2"][0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "77 bytes free" in failed["s2"][1]
    assert all(ledger.holders(c.id) == {"s0", "s1"} for c in good)  # the forged chunk spoiled nothing else


def test_server_dying_after_acks_is_a_failure_of_that_server(trio: Any) -> None:
    stores, servers = trio
    chunks = [make_chunk(50_000 + i) for i in range(80)]
    view = view_of({s: b.address for s, b in servers.items()})
    ledger = AckLedger({c.id: list(servers) for c in chunks}, 2)
    with SendSession(view, ledger, SendOptions(batch_bytes=100_000, window=2), lambda n: None) as session:
        for k, c in enumerate(chunks):
            if k == 40:
                deadline = time.monotonic() + 10
                while not any("s2" in ledger.holders(x.id) for x in chunks[:40]):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                servers["s2"].stop()  # killed mid-push, after it acked something
            session.submit(c, list(servers))
        failed = session.finish()
    assert set(failed) == {"s2"} and failed["s2"][0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert ledger.short() == [] and all({"s0", "s1"} <= ledger.holders(c.id) for c in chunks)


def test_close_aborts_without_waiting_for_acks(trio: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stores, servers = trio
    gate = threading.Event()
    real = stores["s0"].put_many
    monkeypatch.setattr(stores["s0"], "put_many", lambda chunks: (gate.wait(10), real(chunks))[1])
    view = view_of({"s0": servers["s0"].address})
    ledger = AckLedger({}, 1)
    t0 = time.monotonic()
    with SendSession(view, ledger, SendOptions(batch_bytes=1000), lambda n: None) as session:
        session.submit(make_chunk(2000), ["s0"])
        session.submit(make_chunk(2001), ["s0"])
    assert time.monotonic() - t0 < 5
    gate.set()
    assert not [t for t in threading.enumerate() if t.name.startswith("bulk-acks-")]


def test_send_round_uses_bulk_for_a_cluster_view(trio: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.client import push_sender

    stores, servers = trio
    view = view_of({s: b.address for s, b in servers.items()})
    monkeypatch.setattr(push_sender, "_view_for", lambda clients: view)
    chunks = {c.id: c for c in (make_chunk(9000 + i) for i in range(10))}
    ledger = AckLedger({cid: list(servers) for cid in chunks}, 2)
    sends = {s: list(chunks) for s in servers}
    failed = send_round(sends, {cid: list(servers) for cid in chunks}, list(chunks), chunks.__getitem__, lambda s: None,  # type: ignore[arg-type,return-value]
                        ledger, SendOptions(), lambda n: None)
    assert failed == {} and all(ledger.count(cid) == 3 for cid in chunks)
    assert all(st.has(cid) for st in stores.values() for cid in chunks)


def test_send_round_finds_the_view_behind_its_server_client() -> None:
    from paramserver.client.cluster_view import ClusterView
    from paramserver.client.push_sender import _view_for

    view = object.__new__(ClusterView)
    assert _view_for(view.server_client) is view
    other = _view_for(lambda s: None)  # type: ignore[arg-type,return-value]
    assert other is not view and other.members == {}


def test_a_new_session_receives_into_buffers_an_earlier_session_gave_back(store: ChunkStore) -> None:
    server = serve(store)
    try:
        for session in range(3):  # a push opens new sessions: its PUTs still land in warm buffers
            acks = Acks()
            w = BulkWriter(server.address, ADMIN, acks, window=1)
            put(w, [make_chunk(300_000 + session)])
            assert w.drain(10)  # the buffer went back to the server before the ack went out
            w.close(goodbye=True)
        assert server.write_stats["buffers_reused"] >= 2  # the second and third sessions' PUTs
        assert sum(len(a) for a in server._spare) <= 48 << 20  # what is kept stays bounded
    finally:
        server.stop()


def test_receive_buffers_are_reused_only_when_the_store_kept_no_view_of_them(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve(store)
    try:
        acks = Acks()
        w = BulkWriter(server.address, ADMIN, acks, window=1)
        for i in range(4):
            put(w, [make_chunk(200_000 + i)])
            assert w.drain(10)
        assert server.write_stats["buffers_reused"] >= 2  # nothing kept the buffers: they came back
        kept: list[tuple[memoryview, bytes]] = []
        real = store.put_many

        def keeping(chunks: Iterable[Any]) -> list[bool]:
            chunks = list(chunks)
            kept.extend((c[1], bytes(c[1])) for c in chunks)  # a store that holds on to the views it was given
            return real(chunks)

        monkeypatch.setattr(store, "put_many", keeping)
        reused = server.write_stats["buffers_reused"]
        for i in range(4):
            put(w, [make_chunk(200_000 + i, seed=i + 1)])
            assert w.drain(10)
        assert all(bytes(view) == copy for view, copy in kept)  # never overwritten by a later PUT
        assert server.write_stats["buffers_reused"] <= reused + 1  # at most the one spare kept from before
        w.close(goodbye=True)
    finally:
        server.stop()
