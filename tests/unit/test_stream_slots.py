"""The stream-slot policy: a client's share, which stalled reader is cut, waiting and refusing (issue 41)."""
from __future__ import annotations

import threading
import time

import pytest

from paramserver.server.errors import ConfigError
from paramserver.server.stream_slots import SlotPolicy, StreamLimits, StreamSlots, Taken, source_of_peer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(slots: int = 6, **limits: object) -> tuple[SlotPolicy, Clock]:
    clock = Clock()
    return SlotPolicy(slots, StreamLimits(**limits), clock), clock  # type: ignore[arg-type]


def test_default_share_leaves_slots_to_others() -> None:
    assert StreamLimits().cap(11) == 9 and StreamLimits().cap(6) == 5 and StreamLimits().cap(1) == 1
    assert StreamLimits(per_client=3).cap(11) == 3 and StreamLimits(per_client=30).cap(11) == 11
    for bad in ({"per_client": 0}, {"stale_s": 0}, {"wait_s": -1}):
        with pytest.raises(ConfigError):
            StreamLimits(**bad).validate()
    assert StreamLimits.from_extra({"read_streams_per_client": 4, "read_stream_stale_s": 1}).per_client == 4
    with pytest.raises(ConfigError):
        StreamLimits.from_extra({"read_streams_per_client": "4"})


def test_one_client_cannot_take_every_slot() -> None:
    p, _ = policy(6)
    for k in range(5):
        assert p.decide("a", capped=True).take
        p.hold(k, "a", read=True, capped=True)
    d = p.decide("a", capped=True)
    assert not d.take and d.victim is None and d.reason == "client_limit"
    assert p.decide("b", capped=True).take  # another client finds the slot left
    assert p.decide("admin", capped=False).take  # the admin token is not held to a share


def test_a_full_pool_cuts_the_stalest_stalled_reader_of_the_biggest_holder() -> None:
    p, clock = policy(4, per_client=3, stale_s=2.0)
    p.hold(1, "a", read=True, capped=True)
    clock.now += 1
    p.hold(2, "a", read=True, capped=True)
    p.hold(3, "b", read=True, capped=True)
    p.hold(4, "w", read=False, capped=True)  # a write stream is never cut here (it has its own idle timeout)
    d = p.decide("c", capped=True)
    assert not d.take and d.victim is None and d.reason == "stream_limit" and d.retry_in == pytest.approx(1.0)
    clock.now += 5  # all stale now: b's is the stalest of its client, but a holds more
    assert p.decide("c", capped=True).victim == 1
    p.touch(1, busy=False)  # a's first stream took a message just now: a's other one goes
    assert p.decide("c", capped=True).victim == 2


def test_busy_or_reading_streams_are_not_cut() -> None:
    p, clock = policy(2, stale_s=2.0)
    p.hold(1, "a", read=True, capped=True)
    p.hold(2, "b", read=True, capped=True)
    p.touch(1, busy=True)  # the server is reading from its store
    clock.now += 10
    p.touch(2, busy=False)  # b's client keeps taking messages
    d = p.decide("c", capped=True)
    assert d.victim is None and d.reason == "stream_limit"
    clock.now += 2
    assert p.decide("c", capped=True).victim == 2


def test_over_its_share_a_client_cuts_only_its_own_stalled_streams() -> None:
    p, clock = policy(6, per_client=2, stale_s=2.0)
    p.hold(1, "b", read=True, capped=True)
    p.hold(2, "a", read=True, capped=True)
    p.hold(3, "a", read=True, capped=True)
    clock.now += 1
    p.touch(2, busy=False)
    clock.now += 1.5
    p.touch(3, busy=False)
    assert p.decide("a", capped=True).victim is None  # b's is the stalest, but not a's to cut; a's are fresh
    clock.now += 1
    assert p.decide("a", capped=True).victim == 2
    assert p.release(2) and not p.release(2)


def test_slots_wait_then_refuse_and_hand_a_stalled_slot_over() -> None:
    clock = Clock()
    slots = StreamSlots(2, StreamLimits(stale_s=2.0, wait_s=0.2), max_waiters=1, clock=clock)
    a = slots.take("a", "ctx-a", read=True, capped=True)
    b = slots.take("b", "ctx-b", read=True, capped=True)
    assert isinstance(a, Taken) and isinstance(b, Taken) and a.victim is None
    t0 = time.monotonic()
    assert slots.take("c", "ctx-c", read=True, capped=True) == "stream_limit"
    assert 0.15 < time.monotonic() - t0 < 2.0  # it waited, bounded
    clock.now += 3  # a and b's clients took nothing since: c gets one of their slots at once, told whose
    c = slots.take("c", "ctx-c", read=True, capped=True)
    assert isinstance(c, Taken) and c.victim in ("ctx-a", "ctx-b") and slots.cut == 1 and slots.held() == 2
    slots.release(a.key)
    slots.release(b.key)  # one of them no longer held: a no-op
    assert slots.held() == 1


def test_a_waiter_gets_a_released_slot_and_waiters_are_bounded() -> None:
    slots = StreamSlots(1, StreamLimits(wait_s=5.0), max_waiters=1)
    a = slots.take("a", None, read=False, capped=True)
    assert isinstance(a, Taken)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(slots.take("b", None, read=True, capped=True)))
    waiter.start()
    deadline = time.monotonic() + 5
    while slots.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert slots.take("c", None, read=True, capped=True) == "stream_limit"  # no second waiter: refused at once
    assert time.monotonic() - t0 < 0.5
    slots.release(a.key)
    waiter.join(5)
    assert isinstance(got[0], Taken)


def test_source_of_peer() -> None:
    assert source_of_peer("ipv4:127.0.0.2:41234") == "127.0.0.2"
    assert source_of_peer("ipv6:[::1]:5000") == "::1"
    assert source_of_peer("ipv6:%5B::1%5D:5000") == "::1"
    assert source_of_peer("unix:/tmp/sock") is None
