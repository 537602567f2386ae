"""The result cache's logic without sockets: keys, entries, XFetch, L1, single-flight, breaker,
admission and the whole request path over an in-memory L2 with injected clocks."""
from __future__ import annotations

import threading
import time

import pytest

from worker.admission import Admission, AdmissionConfig, Shed
from worker.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from worker.errors import ConfigError
from worker.result_cache import CachedResult, ResultCacheConfig, ResultL1, SingleFlight, result_key, xfetch_due
from worker.result_service import Computed, ResultService
from worker.result_store import MemoryResultStore
from worker.serve import parse_request, with_fields, BadRequest
from worker.serve_metrics import ServeMetrics


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ keys and entries


def test_key_depends_on_fingerprint_request_and_params_not_on_field_order() -> None:
    fp1, fp2 = "a" * 64, "b" * 64
    params = {"dtype": "torch.float32", "device": "cpu", "factory": "m:f"}
    k = result_key(fp1, {"input": [1, 2], "opt": {"x": 1, "y": 2}}, params)
    assert k == result_key(fp1, {"opt": {"y": 2, "x": 1}, "input": [1, 2]}, dict(reversed(list(params.items()))))
    assert k != result_key(fp2, {"input": [1, 2], "opt": {"x": 1, "y": 2}}, params)  # another version's weights
    assert k != result_key(fp1, {"input": [1, 3], "opt": {"x": 1, "y": 2}}, params)
    assert k != result_key(fp1, {"input": [1, 2], "opt": {"x": 1, "y": 2}}, {**params, "dtype": "torch.bfloat16"})
    assert k != result_key(fp1, {"input": [1, 2], "opt": {"x": 1, "y": 2}}, {**params, "factory": "m:g"})


def test_entry_round_trips_and_foreign_bytes_are_a_miss() -> None:
    e = CachedResult(200, b'{"output":[1.5]}', 0.02, 1234.5)
    assert CachedResult.decode(e.encode()) == e
    assert CachedResult.decode(b"hello") is None
    assert CachedResult.decode(b"XXXX" + e.encode()[4:]) is None
    assert e.ttl_ms(1234.0) == 500 and e.ttl_ms(2000.0) == 1


def test_xfetch_refreshes_more_often_near_expiry_and_for_costly_results() -> None:
    e = CachedResult(200, b"{}", delta_s=1.0, expires_at=100.0)
    rng = iter([i / 1000 for i in range(1000)] * 8)

    def due_fraction(now: float, entry: CachedResult) -> float:
        return sum(xfetch_due(entry, now, 1.0, lambda: next(rng)) for _ in range(1000)) / 1000

    far, near = due_fraction(90.0, e), due_fraction(99.5, e)
    assert far < 0.001 < near < 1.0  # ln(U) below -10 never happens at 1/1000 steps; half a delta away often does
    assert due_fraction(99.5, CachedResult(200, b"{}", delta_s=0.01, expires_at=100.0)) == 0.0  # cheap: no early refresh
    assert xfetch_due(e, 100.0, 1.0) and not xfetch_due(e, 50.0, 0.0)


def test_l1_is_bounded_drops_expired_entries_and_resists_a_scan() -> None:
    clock = Clock(0.0)
    entry = CachedResult(200, b"x" * 1000, 0.01, 100.0)
    l1 = ResultL1(10 * entry.nbytes, clock)
    for _ in range(2):  # two references: the hot key
        l1.put("hot", entry)
        assert l1.get("hot") is not None
    for i in range(100):  # one-off requests, more than the budget
        l1.put(f"scan{i}", entry)
    assert l1.bytes <= 10 * entry.nbytes
    assert l1.get("hot") is not None  # LRU-2: seen-once keys went first
    clock.t = 100.0
    assert l1.get("hot") is None  # expired: gone


def test_single_flight_runs_once_for_concurrent_callers_and_shares_errors() -> None:
    flights: SingleFlight[int] = SingleFlight()
    release = threading.Event()
    calls = []

    def slow() -> int:
        calls.append(1)
        release.wait(5)
        return 42

    results: list[tuple[int, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(flights.do("k", slow, 5))) for _ in range(20)]
    threads[0].start()
    while not flights.running("k"):
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    time.sleep(0.05)
    release.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1 and sorted(results) == [(42, False)] + [(42, True)] * 19
    assert not flights.running("k") and len(flights) == 0

    def boom() -> int:
        raise ValueError("bad")

    with pytest.raises(ValueError):
        flights.do("k", boom, 1)
    assert flights.do("k", lambda: 7, 1) == (7, False)  # a failed flight is not remembered


# ------------------------------------------------------------------ breaker and admission


def test_breaker_opens_after_failures_probes_once_and_closes() -> None:
    clock = Clock(0.0)
    changes: list[tuple[str, str]] = []
    b = CircuitBreaker(BreakerConfig(failures_to_open=3, open_s=2.0, slow_s=0.1), clock, lambda a, c: changes.append((a, c)))
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == CLOSED
    b.success()  # a success resets the run of failures
    for _ in range(3):
        b.failure()
    assert b.state == OPEN and not b.allow()
    clock.t = 2.5
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.record(True, 0.5)  # too slow counts as a failure
    assert b.state == OPEN
    clock.t = 5.0
    assert b.allow()
    b.record(True, 0.01)
    assert b.state == CLOSED and b.allow()
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]
    assert b.opened == 2 and b.closed == 1


def test_admission_sheds_beyond_the_queue_at_once_and_after_the_queue_timeout() -> None:
    a = Admission(AdmissionConfig(max_concurrency=1, max_queue=1, queue_timeout_s=0.2))
    inside = threading.Event()
    leave = threading.Event()

    def hold() -> None:
        with a.slot():
            inside.set()
            leave.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(5)
    waited: list[BaseException] = []

    def wait_for_slot() -> None:
        try:
            with a.slot():
                pass
        except Shed as exc:
            waited.append(exc)

    waiter = threading.Thread(target=wait_for_slot)
    waiter.start()
    while a.waiting < 1:
        time.sleep(0.001)
    started = time.monotonic()
    with pytest.raises(Shed, match="already queued") as full:
        with a.slot():
            pass
    assert time.monotonic() - started < 0.1 and full.value.retry_after_s >= 1
    waiter.join(5)
    assert len(waited) == 1 and "within 0.2 s" in str(waited[0])
    leave.set()
    holder.join(5)
    with a.slot():
        assert a.running == 1
    assert a.running == 0 and a.waiting == 0 and a.shed_full == 1 and a.shed_timeout == 1


def test_configs_refuse_nonsense() -> None:
    with pytest.raises(ConfigError, match="redis://"):
        ResultCacheConfig(redis_url="http://x").validate()
    with pytest.raises(ConfigError, match="ttl_s"):
        ResultCacheConfig(ttl_s=0).validate()
    with pytest.raises(ConfigError, match="max_concurrency"):
        AdmissionConfig(max_concurrency=0).validate()
    with pytest.raises(ConfigError, match="failures_to_open"):
        BreakerConfig(failures_to_open=0).validate()


# ------------------------------------------------------------------ the request path


KEY = b"k" * 32  # the workers' shared L2 key


def service(store: MemoryResultStore | None, clock: Clock, *, l1: bool = True, rand: float = 0.5,
            admission: Admission | None = None, monotonic: Clock | None = None, **config: object) -> ResultService:
    cfg = ResultCacheConfig(l1_bytes=(1 << 20) if l1 else 0, redis_url="redis://unused" if store else None,
                            lease_wait_s=2.0, l2_key=KEY if store else None, **config)  # type: ignore[arg-type]
    return ResultService(cfg, admission or Admission(AdmissionConfig(max_concurrency=8)), ServeMetrics(), store,
                         clock=clock, rand=lambda: rand, monotonic=monotonic or time.monotonic)


def test_hit_l1_then_l2_from_another_worker_and_opt_out_computes() -> None:
    clock = Clock()
    store = MemoryResultStore(clock)
    a, b = service(store, clock), service(store, clock)
    n = []

    def compute() -> Computed:
        n.append(1)
        return Computed(200, b'{"output":1}')

    assert a.answer("k", compute).outcome == "computed"
    assert a.answer("k", compute).outcome == "hit_l1"
    got = b.answer("k", compute)
    assert got.outcome == "hit_l2" and got.body == b'{"output":1}'
    assert b.answer("k", compute).outcome == "hit_l1"  # L2 hits fill L1
    assert a.answer(None, compute).outcome == "computed"  # "cache": false
    assert len(n) == 2 and a.metrics.forward._value.get() == 2


def test_stampede_across_two_workers_computes_once() -> None:
    clock = Clock()
    store = MemoryResultStore(clock)
    workers = [service(store, clock), service(store, clock)]
    computed = []
    gate = threading.Barrier(40)

    def compute() -> Computed:
        computed.append(1)
        time.sleep(0.05)
        return Computed(200, b'{"output":"same"}')

    outcomes: list[str] = []
    bodies: set[bytes] = set()
    lock = threading.Lock()

    def request(i: int) -> None:
        gate.wait(5)
        got = workers[i % 2].answer("hot", compute)
        with lock:
            outcomes.append(got.outcome)
            bodies.add(got.body)

    threads = [threading.Thread(target=request, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(computed) == 1, outcomes
    assert bodies == {b'{"output":"same"}'} and len(outcomes) == 40
    assert outcomes.count("computed") == 1 and set(outcomes) <= {"computed", "joined", "hit_l2", "hit_l1"}


def test_a_dead_store_never_fails_a_request_and_the_breaker_recovers() -> None:
    clock, ticks = Clock(), Clock(0.0)
    store = MemoryResultStore(clock)
    s = service(store, clock, l1=False, monotonic=ticks)
    compute = lambda: Computed(200, b'{"output":2}')  # noqa: E731
    store.down = True
    for _ in range(10):
        assert s.answer("k", compute).status == 200
    assert s.breaker.state == OPEN
    calls = store.calls
    s.answer("k", compute)
    assert store.calls == calls  # open: Redis is not even asked
    store.down = False
    ticks.t += s.breaker.config.open_s
    assert s.answer("k", compute).outcome == "computed"  # the probe (a miss) succeeded
    assert s.breaker.state == CLOSED
    assert s.answer("k", compute).outcome == "hit_l2"
    assert s.breaker.opened == 1 and s.breaker.closed == 1


def test_request_errors_are_cached_briefly_and_server_errors_never() -> None:
    clock = Clock()
    s = service(None, clock, negative_ttl_s=5.0)
    n = []

    def bad_input() -> Computed:
        n.append(1)
        return Computed(400, b'{"error":"shape"}')

    assert s.answer("bad", bad_input).outcome == "computed"
    assert s.answer("bad", bad_input).outcome == "hit_l1"
    clock.t += 6
    assert s.answer("bad", bad_input).outcome == "computed" and len(n) == 2

    def crash() -> Computed:
        n.append(1)
        raise RuntimeError("device lost")

    for _ in range(2):
        with pytest.raises(RuntimeError):
            s.answer("crash", crash)
    assert len(n) == 4


def test_early_refresh_recomputes_once_before_expiry_and_serves_the_old_entry_when_shed() -> None:
    clock = Clock()
    s = service(None, clock, rand=0.999999, ttl_s=100.0, ttl_jitter=0.0)  # U = 1e-6: -ln U = 13.8 deltas
    n = []

    def compute() -> Computed:
        n.append(1)
        time.sleep(0.02)
        return Computed(200, b'{"output":%d}' % len(n))

    assert s.answer("k", compute).outcome == "computed"
    clock.t += 50  # 50 s before expiry: far more than 13.8 x 0.02 s, so no early refresh
    assert s.answer("k", compute).outcome == "hit_l1"
    clock.t += 49.9  # 0.1 s before expiry: due
    got = s.answer("k", compute)
    assert got.outcome == "computed" and got.body == b'{"output":2}'
    clock.t += 0.05  # the refreshed entry lives another ttl
    assert s.answer("k", compute).outcome == "hit_l1"
    # due again near the new expiry, but the worker is full: the still-valid entry answers
    clock.t += 99.9
    full = Admission(AdmissionConfig(max_concurrency=1, max_queue=0))
    s.admission = full
    with full.slot():
        assert s.answer("k", compute).outcome == "hit_l1"
        with pytest.raises(Shed):
            s.answer("other", compute)
    assert len(n) == 2


def test_parse_request_and_with_fields() -> None:
    assert parse_request(b"[[1, 2]]") == ({"input": [[1, 2]]}, True)
    assert parse_request(b'{"input": [1], "cache": false, "opt": 3}') == ({"input": [1], "opt": 3}, False)
    for bad, why in ((b"{", "not JSON"), (b'{"x": 1}', "expected"), (b'{"input": [1], "cache": "no"}', "true or false"),
                     (b'{"input": [NaN]}', "JSON cannot carry"), (b"[" * 100_000 + b"]" * 100_000, "nests too deeply")):
        with pytest.raises(BadRequest, match=why):
            parse_request(bad)
    assert with_fields(b'{"output":[1]}', version=3, cache="hit_l1") == b'{"output":[1],"cache":"hit_l1","version":3}'
    assert with_fields(b"{}", a=1) == b'{"a":1}'
