"""The connection-limit policy (paramserver.wire.conn_limits): pure, with a fake clock."""
from __future__ import annotations

import pytest

from paramserver.wire.conn_limits import ConnectionLimits, ConnectionTable
from paramserver.wire.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(per_source: int, total: int) -> tuple[ConnectionTable[str], Clock]:
    clock = Clock()
    return ConnectionTable(ConnectionLimits(per_source, total), clock), clock


def test_limits_validate_and_cap() -> None:
    for bad in (ConnectionLimits(0, 10), ConnectionLimits(1, 0), ConnectionLimits(-1, 10)):
        with pytest.raises(ConfigError, match="connection limit"):
            bad.validate()
    assert ConnectionLimits(256, 4096).within(1000) == ConnectionLimits(256, 1000)
    assert ConnectionLimits(256, 4096).within(100) == ConnectionLimits(100, 100)
    assert ConnectionLimits(256, 4096).within(0) == ConnectionLimits(1, 1)


def test_admits_below_the_caps() -> None:
    t, _ = table(2, 10)
    assert t.offer("a1", "A").admit and t.offer("a2", "A").admit and t.offer("b1", "B").admit
    assert len(t) == 3 and t.count("A") == 2 and t.idle_count() == 3


def test_per_source_cap_evicts_the_oldest_idle_of_that_source() -> None:
    t, clock = table(3, 100)
    for i in range(3):
        t.offer(f"a{i}", "A")
        clock.now += 1
    t.offer("b0", "B")  # older idle connections of other sources are not touched
    t.useful("a0")
    decision = t.offer("a3", "A")
    assert decision.admit and decision.evict == ("a1",) and decision.reason == "per_source"
    assert "a1" not in t and t.count("A") == 3 and t.evicted == 1
    assert t.offer("a4", "A").evict == ("a2",)
    assert t.offer("a5", "A").evict == ("a3",)  # the newest are evicted last


def test_useful_connections_are_never_evicted() -> None:
    t, _ = table(2, 100)
    t.offer("a0", "A")
    t.offer("a1", "A")
    t.useful("a0")
    t.useful("a1")
    decision = t.offer("a2", "A")
    assert not decision.admit and decision.reason == "per_source" and decision.evict == ()
    assert t.refused == 1 and "a0" in t and "a1" in t and "a2" not in t
    assert t.offer("b0", "B").admit  # another source still gets in


def test_total_cap_evicts_the_oldest_idle_from_anyone() -> None:
    t, _ = table(10, 4)
    t.offer("a0", "A")
    t.offer("b0", "B")
    t.offer("a1", "A")
    t.offer("c0", "C")
    t.useful("a0")
    decision = t.offer("d0", "D")
    assert decision.admit and decision.evict == ("b0",) and decision.reason == "total"
    for key in ("a1", "c0", "d0"):
        t.useful(key)
    refused = t.offer("e0", "E")
    assert not refused.admit and refused.reason == "total"
    assert len(t) == 4


def test_a_flood_from_one_source_cannot_lock_out_a_client() -> None:
    """The issue's attack in small: a source opens connections that never send anything useful,
    forever; a client from the same source and one from another are admitted between them, and
    survive as long as they become useful before being the oldest idle ones."""
    t, clock = table(8, 16)
    flood = 0

    def attack(n: int) -> None:
        nonlocal flood
        for _ in range(n):
            assert t.offer(f"f{flood}", "10.0.0.1").admit  # never refused: its own oldest give way
            flood += 1
            clock.now += 0.001

    attack(100)
    assert t.count("10.0.0.1") == 8
    assert t.offer("same", "10.0.0.1").admit
    assert t.offer("other", "10.0.0.2").admit
    t.useful("same")
    t.useful("other")
    attack(1000)
    assert "same" in t and "other" in t and t.count("10.0.0.1") == 8
    assert t.evicted == 1100 - 7  # every flood connection but the 7 left beside "same"


def test_remove_is_idempotent_and_frees_the_slot() -> None:
    t, clock = table(1, 1)
    t.offer("a0", "A")
    clock.now += 5
    assert t.age("a0") == 5
    t.useful("a0")
    assert t.is_useful("a0") and t.source_of("a0") == "A"
    assert not t.offer("a1", "A").admit
    t.remove("a0")
    t.remove("a0")
    t.useful("a0")  # a late mark for a closed connection is ignored
    assert len(t) == 0 and t.count("A") == 0 and t.idle_count() == 0
    assert t.offer("a1", "A").admit
    with pytest.raises(ValueError):
        t.offer("a1", "A")


# ---------------------------------------------------------------- what the gRPC gate calls useful

from paramserver.server.grpc_gate import PREFACE, TLS_USEFUL_BYTES, FirstCall  # noqa: E402


def frame(kind: int, payload: bytes = b"", stream: int = 0) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + stream.to_bytes(4, "big") + payload


def test_a_call_is_useful_a_preface_and_settings_are_not() -> None:
    flood = FirstCall()
    assert not flood.feed(PREFACE + frame(4))  # the 33 bytes
    assert not flood.feed(frame(4) + frame(6, b"12345678") + frame(8, b"\0\0\0\1"))  # an ack, a ping, a window update
    client = FirstCall()
    first = PREFACE + frame(4, b"\0\4\0\0\0\0") + frame(8, b"\0\1\0\0")
    assert not client.feed(first)
    headers = frame(1, b"x" * 200, stream=1)
    assert client.feed(headers[:5]) is False and client.feed(headers[5:]) is True
    assert client.feed(b"anything") is True


def test_bytes_split_anywhere_are_read_the_same() -> None:
    data = PREFACE + frame(4, b"\0" * 12) + frame(0, b"d" * 30_000, stream=1) + frame(1, b"h", 3)
    # a DATA frame's payload is skipped, not read: its size does not count as headers
    for step in (1, 7, 9, 4096, len(data)):
        sniff = FirstCall()
        results = [sniff.feed(data[i:i + step]) for i in range(0, len(data), step)]
        first = results.index(True)  # the piece holding the last byte of the HEADERS frame's header
        assert first == (len(data) - 2) // step and all(results[first:]), step


def test_tls_is_useful_after_enough_application_data() -> None:
    def record(kind: int, n: int) -> bytes:
        return bytes([kind, 3, 3]) + n.to_bytes(2, "big") + b"\0" * n

    sniff = FirstCall()
    assert not sniff.feed(record(0x16, 1400))  # a ClientHello, however large
    assert not sniff.feed(record(0x14, 1) + record(0x17, 53) + record(0x17, 55))  # Finished, preface + SETTINGS
    assert sniff.feed(record(0x17, TLS_USEFUL_BYTES))


def test_not_http2_is_never_useful() -> None:
    sniff = FirstCall()
    assert not sniff.feed(b"GET / HTTP/1.1\r\n\r\n")
    assert not sniff.feed(frame(1, b"h", 1))
    big = FirstCall()
    assert not big.feed(PREFACE)
    for _ in range(100):  # pings only, past the inspection limit: it stays not useful
        big.feed(frame(6, b"12345678") * 100)
    assert not big.feed(frame(1, b"h", 1))
