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
    assert t.offer("a3", "A").admit  # idle connections count against the total only
    assert len(t) == 4 and t.count("A") == 3 and t.idle_count() == 4


def test_the_total_cap_evicts_the_oldest_idle_of_the_largest_idle_holder() -> None:
    t, clock = table(10, 5)
    for key, source in (("b0", "B"), ("a0", "A"), ("a1", "A"), ("a2", "A"), ("c0", "C")):
        assert t.offer(key, source).admit
        clock.now += 1
    decision = t.offer("d0", "D")
    assert decision.admit and decision.evict == ("a0",) and decision.reason == "total"  # A holds the most, b0 is older
    assert t.offer("d1", "D").evict == ("a1",)
    # A and D now hold 1 and 2 idle ones; B and C 1 each: D's oldest goes
    assert t.offer("e0", "E").evict == ("d0",)
    assert "b0" in t and "c0" in t and t.evicted == 3 and len(t) == 5


def test_useful_connections_are_never_evicted() -> None:
    t, _ = table(10, 3)
    for key in ("a0", "a1", "b0"):
        t.offer(key, key[0].upper())
        assert t.useful(key)
    decision = t.offer("c0", "C")
    assert not decision.admit and decision.reason == "total" and decision.evict == ()
    assert t.refused == 1 and len(t) == 3 and "c0" not in t


def test_a_source_holds_at_most_per_source_useful_connections() -> None:
    t, _ = table(2, 100)
    for key in ("a0", "a1", "a2"):
        assert t.offer(key, "A").admit
    assert t.useful("a0") and t.useful("a1")
    assert t.useful("a1")  # a repeat changes nothing
    assert not t.useful("a2")  # its source's useful share is full: refused at its first call
    assert "a2" not in t and t.refused == 1
    refused = t.offer("a3", "A")
    assert not refused.admit and refused.reason == "per_source"
    assert t.offer("b0", "B").admit  # another source still gets in
    t.remove("a0")
    assert t.offer("a4", "A").admit and t.useful("a4")


def test_a_flood_from_one_source_cannot_lock_out_a_client() -> None:
    """The issue's attack in small: a source opens connections that never send anything useful,
    forever; a client from the same source and one from another are admitted between them, and
    survive: the same-source one for ``total`` newer arrivals, the other for good."""
    t, clock = table(8, 64)
    flood = 0

    def attack(n: int) -> None:
        nonlocal flood
        for _ in range(n):
            assert t.offer(f"f{flood}", "10.0.0.1").admit  # never refused: its own oldest give way
            flood += 1
            clock.now += 0.001

    attack(1000)
    assert t.count("10.0.0.1") == 64
    assert t.offer("same", "10.0.0.1").admit
    assert t.offer("other", "10.0.0.2").admit
    attack(62)  # the same-source client has this many newer arrivals' time to make its first call
    assert "same" in t and "other" in t
    assert t.useful("same")
    attack(1000)
    assert "same" in t and "other" in t  # the other one never made a call: the flood gives way first
    assert t.useful("other")
    assert t.evicted == 2062 - 62


def test_remove_is_idempotent_and_frees_the_slot() -> None:
    t, clock = table(1, 1)
    t.offer("a0", "A")
    clock.now += 5
    assert t.age("a0") == 5
    assert t.useful("a0")
    assert t.is_useful("a0") and t.source_of("a0") == "A" and t.useful_count("A") == 1
    assert not t.offer("a1", "A").admit
    t.remove("a0")
    t.remove("a0")
    assert t.useful("a0")  # a late mark for a closed connection is ignored
    assert len(t) == 0 and t.count("A") == 0 and t.idle_count() == 0 and t.useful_count("A") == 0
    assert t.offer("a1", "A").admit
    with pytest.raises(ValueError):
        t.offer("a1", "A")


def test_the_largest_holder_is_tracked_through_every_change() -> None:
    """The O(1) buckets agree with a brute-force count after a random sequence of operations."""
    import random

    rng = random.Random(41)
    t, _ = table(3, 20)
    keys: list[str] = []
    for i in range(5000):
        op = rng.random()
        if op < 0.5:
            key, source = f"k{i}", f"s{rng.randrange(6)}"
            decision = t.offer(key, source)
            if decision.admit:
                keys.append(key)
        elif op < 0.7 and keys:
            t.useful(rng.choice(keys))
        elif keys:
            t.remove(keys.pop(rng.randrange(len(keys))))
        keys = [k for k in keys if k in t]
        idle: dict[str, int] = {}
        for k in keys:
            if not t.is_useful(k):
                source = t.source_of(k)
                assert source is not None
                idle[source] = idle.get(source, 0) + 1
        assert t._most_idle == max(idle.values(), default=0)
        assert t.idle_count() == sum(idle.values()) and len(t) == len(keys) <= 20


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
