"""The bulk read protocol (paramserver.bulk / bulkclient) against a real ChunkStore on loopback."""
from __future__ import annotations

import os
import socket
import struct
from pathlib import Path
from typing import Callable, Iterator

import pytest

from chunking.hashing import content_id, crc32c
from paramserver.server.auth import AuthConfig
from paramserver.server.bulk_port import BulkServer, BulkServerConfig, check_token
from paramserver.wire.bulk_frames import (
    BATCH,
    CORRUPT,
    ERROR,
    HEADER,
    MAGIC,
    MAX_IDS,
    MISSING,
    OK,
    REQUEST,
    VERSION,
    W_BAD_HELLO,
    W_OK,
    WELCOME,
    decode_header,
    ProtocolError,
    decode_headers,
    encode_header,
    encode_hello,
)
from paramserver.client.bulk_transport import BulkClient, BulkPool, BulkProtocolFailure, BulkUnauthenticated, BulkUnavailable
from paramserver.server.segments import corrupt_stored
from paramserver.server.store import ChunkStore

ADMIN, READ = "admin-token-1", "read-token-1"


def chunk(size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    return content_id(data), data


@pytest.fixture
def corrupt_log() -> list[tuple[str, str]]:
    return []


@pytest.fixture
def store(tmp_path: Path, corrupt_log: list[tuple[str, str]]) -> ChunkStore:
    return ChunkStore(tmp_path / "s", cache_bytes=0, fsync=False, on_corrupt=lambda cid, why: corrupt_log.append((cid, why)))


def serve(store: ChunkStore, auth: AuthConfig = AuthConfig(), **kw: object) -> Iterator[BulkServer]:
    server = BulkServer(store, auth, "127.0.0.1:0", BulkServerConfig(**kw)).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(store: ChunkStore) -> Iterator[BulkServer]:
    yield from serve(store)


def put(store: ChunkStore, size: int) -> tuple[str, bytes]:
    cid, data = chunk(size)
    store.put(cid, data, "raw", len(data), crc32c(data))
    return cid, data


def raw_conn(server: BulkServer, token: str = "") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(encode_hello(token))
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return out
        out += part


def test_a_batch_of_headers_decodes_at_once_and_a_bad_one_is_refused() -> None:
    heads = [(OK, "raw", 4096, 4096, 1), (OK, "zstd", 262144, 999, 2), (MISSING, "", 0, 17, 0)]
    packed = b"".join(encode_header(*h) for h in heads)
    assert decode_headers(packed) == heads
    assert decode_headers(b"") == []
    with pytest.raises(ProtocolError, match="bad chunk header"):
        decode_headers(packed + bytes([77]) + packed[1:HEADER.size])
    with pytest.raises(ProtocolError, match="40 bytes"):
        decode_header(packed[:-1][: HEADER.size - 1])


def test_header_round_trip() -> None:
    head = encode_header(OK, "zstd", 262144, 1234, 0xDEADBEEF)
    assert len(head) == HEADER.size == 40
    assert decode_header(head) == (OK, "zstd", 262144, 1234, 0xDEADBEEF)


def test_round_trip_many_chunks_in_order_with_missing(store: ChunkStore, server: BulkServer) -> None:
    chunks = [put(store, 1 + (i * 7919) % (300 << 10)) for i in range(40)]
    missing = content_id(b"never stored")
    ids = [c[0] for c in chunks[:20]] + [missing] + [c[0] for c in chunks[20:]]
    client = BulkClient(server.address)
    got = [(item.id, item.status, bytes(item.data) if item.status == OK else item.message, item.crc32c) for item in client.fetch(ids)]
    assert [g[0] for g in got] == ids
    expected = dict(chunks)
    for cid, status, payload, crc in got:
        if cid == missing:
            assert status == MISSING and "not stored" in payload
        else:
            assert status == OK and payload == expected[cid] and crc == crc32c(expected[cid])
    # the connection went back to the pool and serves the next request
    assert len(client._idle) == 1
    again = list(client.fetch([chunks[0][0]]))
    assert bytes(again[0].data) == chunks[0][1]
    client.close()


def into_by_id(ids: list[str], buffers: dict[str, bytearray]):  # type: ignore[no-untyped-def]
    """An ``into`` that offers each OK raw chunk its caller buffer, by id (None where there is none)."""
    def into(first, ok_raw, sizes):  # type: ignore[no-untyped-def]
        return [memoryview(buffers[ids[first + k]]) if ok_raw[k] and ids[first + k] in buffers else None
                for k in range(len(sizes))]
    return into


def test_into_receives_straight_into_caller_buffers(store: ChunkStore, server: BulkServer) -> None:
    chunks = [put(store, 100_000 + i) for i in range(5)]
    buffers = {cid: bytearray(len(data)) for cid, data in chunks}
    client = BulkClient(server.address)
    ids = [c for c, _ in chunks]
    for item in client.fetch(ids, into=into_by_id(ids, buffers)):
        assert item.data.obj is buffers[item.id]
    assert all(bytes(buffers[cid]) == data for cid, data in chunks)
    client.close()


def test_corrupt_chunk_is_answered_corrupt_and_quarantined(store: ChunkStore, server: BulkServer,
                                                         corrupt_log: list[tuple[str, str]]) -> None:
    cid, data = put(store, 50_000)
    location = store.locate(cid)
    assert location is not None
    corrupt_stored(location, at=10, xor=0xFF)
    items = list(BulkClient(server.address).fetch([cid]))
    assert items[0].status == CORRUPT and "CRC32C" in items[0].message
    assert corrupt_log and corrupt_log[0][0] == cid  # repair queued
    assert not store.has(cid)  # quarantined
    again = list(BulkClient(server.address).fetch([cid]))[0]
    assert again.status in (MISSING, CORRUPT) and len(corrupt_log) == 1  # never sent, repair queued once


def test_wrong_token_refused_with_a_message_naming_the_token(store: ChunkStore) -> None:
    for server in serve(store, AuthConfig(admin_token=ADMIN, read_token=READ)):
        with pytest.raises(BulkUnauthenticated, match="read token or the admin token.*wrong"):
            list(BulkClient(server.address, "nope-nope-nope").fetch([content_id(b"x")]))
        with pytest.raises(BulkUnauthenticated, match="no token was sent"):
            list(BulkClient(server.address).fetch([content_id(b"x")]))
        for token in (READ, ADMIN):
            assert list(BulkClient(server.address, token).fetch([content_id(b"x")]))[0].status == MISSING


def test_token_rules_match_grpc_auth() -> None:
    assert check_token("", AuthConfig()) is None
    assert check_token("", AuthConfig(admin_token=ADMIN)) is None  # reads open without a read token
    assert check_token(READ, AuthConfig(admin_token=ADMIN, read_token=READ)) is None
    assert check_token(ADMIN, AuthConfig(admin_token=ADMIN, read_token=READ)) is None
    message = check_token("wrong-token", AuthConfig(admin_token=ADMIN, read_token=READ))
    assert message is not None and "wrong-token" not in message


def test_bad_magic_gets_a_bad_hello_and_close(server: BulkServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(struct.pack("<4sHH", b"GET ", VERSION, 0))
    reply = read_all(sock)
    magic, status, n = WELCOME.unpack(reply[: WELCOME.size])
    assert magic == MAGIC and status == W_BAD_HELLO and b"bad magic" in reply[WELCOME.size :]


def test_unknown_version_refused(server: BulkServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(struct.pack("<4sHH", MAGIC, VERSION + 1, 0))
    reply = read_all(sock)
    assert WELCOME.unpack(reply[: WELCOME.size])[1] == W_BAD_HELLO and b"version" in reply


def test_an_overlong_token_is_named_not_taken_for_a_version(server: BulkServer) -> None:
    from paramserver.wire.bulk_frames import MAX_TOKEN_BYTES

    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(struct.pack("<4sHH", MAGIC, VERSION, MAX_TOKEN_BYTES + 1))
    reply = read_all(sock)
    assert WELCOME.unpack(reply[: WELCOME.size])[1] == W_BAD_HELLO
    assert f"token of {MAX_TOKEN_BYTES + 1} bytes".encode() in reply and b"version" not in reply


def test_oversized_count_gets_an_error_frame_and_close(server: BulkServer) -> None:
    sock = raw_conn(server)
    sock.sendall(REQUEST.pack(MAX_IDS + 1))
    reply = read_all(sock)
    assert WELCOME.unpack(reply[: WELCOME.size])[1] == W_OK
    rest = reply[WELCOME.size :]
    count, payload = BATCH.unpack(rest[: BATCH.size])
    status, _codec, _raw, n, _crc = decode_header(rest[BATCH.size : BATCH.size + HEADER.size])
    assert count == 1 and payload == n
    assert status == ERROR and b"at most 4096" in rest[BATCH.size + HEADER.size :]


def test_truncated_request_closes_without_an_answer(store: ChunkStore, server: BulkServer) -> None:
    cid, _ = put(store, 1000)
    sock = raw_conn(server)
    sock.sendall(REQUEST.pack(2) + bytes.fromhex(cid) + b"\x00" * 5)  # second id cut short
    sock.shutdown(socket.SHUT_WR)
    reply = read_all(sock)
    assert len(reply) == WELCOME.size  # the welcome, then nothing


def test_client_that_hangs_up_before_its_hello_ends_quietly(server: BulkServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection thread logs the EOF and cleans up: nothing escapes it (the handler's
    exception tuple once named an unimported ProtocolError, so every such end was a NameError)."""
    import threading

    serve_one = server._serve
    done = threading.Event()
    escaped: list[BaseException] = []

    def watched(conn: socket.socket) -> None:
        try:
            serve_one(conn)
        except BaseException as exc:
            escaped.append(exc)
            raise
        finally:
            done.set()

    monkeypatch.setattr(server, "_serve", watched)
    socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    assert done.wait(5)
    assert escaped == []
    assert list(BulkClient(server.address).fetch([content_id(b"x")]))[0].status == MISSING  # still serving


def test_token_longer_than_the_protocol_allows_is_a_config_error() -> None:
    from paramserver.wire.bulk_frames import MAX_TOKEN_BYTES
    from paramserver.wire.errors import ConfigError

    encode_hello("t" * MAX_TOKEN_BYTES)
    with pytest.raises(ConfigError, match=f"at most {MAX_TOKEN_BYTES}"):
        encode_hello("t" * (MAX_TOKEN_BYTES + 1))


def fake_server(reply: bytes) -> tuple[str, Callable[[], None]]:
    """A server that welcomes, reads one request, sends ``reply`` and closes; (address, join)."""
    import threading

    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def fake() -> None:
        conn, _ = lsock.accept()
        conn.recv(64)
        conn.sendall(WELCOME.pack(MAGIC, W_OK, 0))
        conn.recv(4096)
        conn.sendall(reply)
        conn.close()

    t = threading.Thread(target=fake, daemon=True)
    t.start()

    def join() -> None:
        t.join(5)
        lsock.close()

    return f"127.0.0.1:{port}", join


def test_truncated_reply_raises_unavailable(store: ChunkStore) -> None:
    # A batch that declares 1000 bytes and carries 10, then the connection closes.
    address, join = fake_server(BATCH.pack(1, 1000) + encode_header(OK, "raw", 1000, 1000, 0) + b"x" * 10)
    with pytest.raises(BulkUnavailable, match="closed after 10 of 1000"):
        list(BulkClient(address).fetch([content_id(b"a")]))
    join()


@pytest.mark.parametrize("reply, problem", [
    (BATCH.pack(1, 999) + encode_header(OK, "raw", 1000, 1000, 0), "declares 999 payload bytes, its headers 1000"),
    (BATCH.pack(2, 0) + encode_header(MISSING) * 2, "a batch of 2 answers, but 1 ids are unanswered"),
    (BATCH.pack(0, 0), "a batch of 0 answers"),
    (BATCH.pack(1, 66 << 20) + encode_header(OK, "raw", 66 << 20, 66 << 20, 0), "declares 69206016 bytes, over"),
    (BATCH.pack(1, 5000) + encode_header(MISSING, stored_size=5000), "MISSING message declares 5000 bytes"),
    (BATCH.pack(1, 0) + b"\x09" + b"\x00" * 39, "bad chunk header"),
    (BATCH.pack(1, 100 << 20) + encode_header(OK, "raw", 100 << 20, 100 << 20, 0), "declares 104857600 payload bytes, over"),
    (BATCH.pack(1, 5) + encode_header(ERROR, stored_size=5) + b"nope!", "server refused the request: nope!"),
])
def test_malformed_batches_are_refused_naming_the_problem(reply: bytes, problem: str) -> None:
    address, join = fake_server(reply)
    with pytest.raises(BulkProtocolFailure, match=problem):
        list(BulkClient(address).fetch([content_id(b"a")]))
    join()


def test_many_chunks_arrive_in_several_batches_into_caller_buffers_and_scratch(store: ChunkStore, server: BulkServer) -> None:
    # ~9 MiB over 80 chunks: more than one batch by bytes and by count; every other chunk
    # into a caller buffer, the rest into the connection's scratch, one missing in between.
    chunks = [put(store, 100_000 + 37 * i) for i in range(80)]
    missing = content_id(b"not here")
    ids = [c for c, _ in chunks[:40]] + [missing] + [c for c, _ in chunks[40:]]
    want = dict(chunks)
    buffers = {cid: bytearray(len(data)) for i, (cid, data) in enumerate(chunks) if i % 2 == 0}
    client = BulkClient(server.address)
    seen = []
    for item in client.fetch(ids, into=into_by_id(ids, buffers)):
        seen.append(item.id)
        if item.id == missing:
            assert item.status == MISSING
            continue
        assert item.status == OK and bytes(item.data) == want[item.id]
        if item.id in buffers:
            assert item.data.obj is buffers[item.id]
    assert seen == ids
    client.close()


def test_unreachable_address_raises_unavailable_and_pool_remembers() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    with pytest.raises(BulkUnavailable, match="cannot connect"):
        list(BulkClient(address, connect_timeout_s=1).fetch([content_id(b"a")]))
    pool = BulkPool(down_for_s=60)
    assert pool.client(address) is not None
    pool.mark_broken(address)
    assert pool.client(address) is None
    assert pool.client("") is None


def test_connection_limit_refuses_extra_connections(store: ChunkStore) -> None:
    for server in serve(store, max_connections=1):
        first = BulkClient(server.address)
        list(first.fetch([content_id(b"a")]))  # holds the only slot while pooled
        with pytest.raises(BulkProtocolFailure, match="too many bulk connections"):
            list(BulkClient(server.address).fetch([content_id(b"a")]))
        first.close()


def test_idle_connection_is_closed_and_client_reconnects(store: ChunkStore) -> None:
    cid, data = put(store, 1000)
    for server in serve(store, idle_timeout_s=0.2):
        client = BulkClient(server.address)
        assert bytes(list(client.fetch([cid]))[0].data) == data
        assert len(client._idle) == 1
        import time

        time.sleep(0.5)  # the server closed the pooled connection
        items = list(client.fetch([cid]))
        assert bytes(items[0].data) == data
        client.close()


def test_scatter_read_fills_every_buffer_across_partial_reads() -> None:
    import threading
    import time

    from paramserver.wire.bulk_frames import recv_into_all

    a, b = socket.socketpair()
    data = os.urandom(300_000)

    def trickle() -> None:
        for i in range(0, len(data), 7_001):  # pieces that straddle the buffers' edges
            a.sendall(data[i : i + 7_001])
            time.sleep(0.0005)
        a.close()

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    bufs = [bytearray(n) for n in (1, 0, 99_999, 150_000, 50_000)]
    recv_into_all(b, [memoryview(x) for x in bufs])
    assert b"".join(bufs) == data
    with pytest.raises(EOFError, match="closed after 0 of 10"):
        recv_into_all(b, [memoryview(bytearray(10))])
    t.join(5)
    b.close()


def test_version_3_fills_a_batch_with_up_to_512_small_chunks(store: ChunkStore, server: BulkServer) -> None:
    chunks = [put(store, 4096) for _ in range(600)]
    ids = [c for c, _ in chunks]
    client = BulkClient(server.address)
    sizes = [len(b.data) for b in client.fetch_batches(ids)]
    # about 2 MiB of 4 KiB chunks (with their record headers) in the first: more than version 2's 64
    assert len(sizes) == 2 and 64 < sizes[0] <= 512 and sum(sizes) == 600
    assert [bytes(i.data) for i in client.fetch(ids)] == [d for _, d in chunks]
    client.close()


def test_a_server_that_speaks_only_version_2_is_asked_again_in_version_2(store: ChunkStore, server: BulkServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import paramserver.server.bulk_port.listener as bulk_port  # the module that reads the hello

    monkeypatch.setattr(bulk_port, "READ_VERSIONS", (2,))  # a server from before version 3
    chunks = [put(store, 4096) for _ in range(100)]
    ids = [c for c, _ in chunks]
    client = BulkClient(server.address)
    sizes = [len(b.data) for b in client.fetch_batches(ids)]
    assert sizes == [64, 36]  # batches of at most 64, as version 2 has them
    assert [bytes(i.data) for i in client.fetch(ids)] == [d for _, d in chunks]
    client.close()
    # A hello of a version no server speaks is still refused, with the versions it does.
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.sendall(encode_hello(None, 9))
    magic, status, n = WELCOME.unpack(sock.recv(WELCOME.size, socket.MSG_WAITALL))
    assert status == W_BAD_HELLO and b"speaks 2" in sock.recv(n, socket.MSG_WAITALL)
    sock.close()


class _FlakyListener:
    """A listening socket whose next ``failures`` accepts fail as when the process is out of descriptors."""

    def __init__(self, inner: socket.socket, failures: int) -> None:
        self._inner = inner
        self.failures = failures

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(24, "Too many open files")
        return self._inner.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_a_failed_accept_is_retried_not_the_end_of_the_port(store: ChunkStore, caplog: pytest.LogCaptureFixture) -> None:
    """EMFILE from accept() used to end the accept thread for good: the port took connections into
    its backlog and never answered them."""
    cid, data = put(store, 1000)
    server = BulkServer(store, AuthConfig(), "127.0.0.1:0", BulkServerConfig())
    flaky = _FlakyListener(server._sock, failures=3)
    server._sock = flaky  # type: ignore[assignment]
    server.start()
    try:
        client = BulkClient(server.address)  # its connection waits in the backlog through the failures
        assert bytes(list(client.fetch([cid]))[0].data) == data
        client.close()
        assert flaky.failures == 0
        assert any("bulk port accept failed" in r.getMessage() and "Too many open files" in r.getMessage() for r in caplog.records)
    finally:
        server.stop()


def test_connections_owing_their_hello_cannot_fill_the_port(store: ChunkStore) -> None:
    """Silent connections count against max_pending, not max_connections; a new connection pushes
    out the oldest silent one once it has had a second for its hello, so an honest client is served;
    within that second (a burst) the newcomer is refused instead."""
    import time

    cid, data = put(store, 1000)
    for server in serve(store, max_connections=4, max_pending=3, max_per_ip=64):
        silent = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(3)]
        try:
            burst = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            burst.settimeout(5)
            head = burst.recv(WELCOME.size)
            assert head and WELCOME.unpack(head)[1] == W_BAD_HELLO  # refused at once, the silent ones kept
            burst.close()
            time.sleep(1.2)
            clients = [BulkClient(server.address) for _ in range(4)]
            for c in clients:  # the first pushes out the oldest silent connection; each then holds a served slot
                assert bytes(list(c.fetch([cid]))[0].data) == data

            def state(s: socket.socket) -> str:
                s.settimeout(0.3)
                try:
                    return "closed" if s.recv(1) == b"" else "answered"
                except ConnectionError:
                    return "closed"
                except TimeoutError:
                    return "open"

            # Only as many as needed were pushed out: the others wait out their hello timeout.
            assert [state(s) for s in silent] == ["closed", "open", "open"]
            # Served connections still have their own limit (4): a fifth client does not fit.
            with pytest.raises(BulkProtocolFailure, match="too many bulk connections"):
                list(BulkClient(server.address).fetch([cid]))
            for c in clients:
                c.close()
        finally:
            for s in silent:
                s.close()
