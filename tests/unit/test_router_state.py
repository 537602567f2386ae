"""The router's choice logic (worker.router_state) with a fake clock: no sockets, no threads."""
from __future__ import annotations

import random

import pytest

from worker.router_state import Cached, Heartbeat, HeartbeatError, RefCache, RouterConfig, RouterState, VersionKey

A1, A2, B1 = VersionKey("a", 1), VersionKey("a", 2), VersionKey("b", 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(wid: str, serves: str, loaded: tuple[VersionKey, ...], queue: int = 0, running: int = 0,
         cached: tuple[Cached, ...] = (), other_versions: int = 0, any_model: bool = False) -> Heartbeat:
    return Heartbeat(wid, f"http://{wid}:1", serves, loaded, cached, queue=queue, running=running,
                     other_versions=other_versions, any_model=any_model)


def state(clock: Clock, **config: object) -> RouterState:
    return RouterState(clock, RouterConfig(**{"verify_urls": False, **config}), random.Random(1))  # type: ignore[arg-type]


def test_holder_with_the_shortest_queue_is_chosen() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,), queue=3))
    s.heartbeat(beat("w2", "a:prod", (A1,), queue=1))
    s.heartbeat(beat("w3", "b:prod", (B1,)))
    d = s.choose(A1)
    assert (d.worker_id, d.hit, d.spilled) == ("w2", True, False)
    # this router's own requests in flight count before the next beat says so
    for _ in range(4):
        s.started("w2")
    assert s.choose(A1).worker_id == "w1"


def test_a_worker_of_another_model_is_never_chosen_unless_it_loads_on_demand() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w3", "b:prod", (B1,)))
    d = s.choose(A1)
    assert d.worker_id is None and "no live worker" in d.reason
    # A factory worker loads other versions of its own model only: its factory builds one architecture.
    s.heartbeat(beat("w4", "b:prod", (B1,), other_versions=1))
    assert s.choose(A1).worker_id is None
    assert s.choose(VersionKey("b", 7)).worker_id == "w4"
    # A Hugging Face worker builds any model from its folder's config.
    s.heartbeat(beat("w5", "b:prod", (B1,), other_versions=1, any_model=True))
    d = s.choose(A1)
    assert d.worker_id == "w5" and not d.hit


def test_tag_request_may_go_to_a_worker_of_the_model_on_another_version_exact_may_not() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,)))
    assert s.choose(A2, exact=False).worker_id == "w1"
    assert s.choose(A2, exact=True).worker_id is None


def test_no_holder_goes_to_the_worker_with_most_chunks_cached() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,), cached=(Cached("a", 2, 100, 10),)))
    s.heartbeat(beat("w2", "a:prod", (A1,), cached=(Cached("a", 2, 100, 90),), queue=2))
    d = s.choose(A2, exact=False)
    assert d.worker_id == "w2" and not d.hit


def test_spill_past_a_full_holder_to_the_next_worker() -> None:
    clock = Clock()
    s = state(clock, spill_queue=4)
    s.heartbeat(beat("w1", "a:prod", (A1,), queue=5))
    s.heartbeat(beat("w2", "a:canary", (A2,), cached=(Cached("a", 1, 100, 50),)))
    s.heartbeat(beat("w3", "a:canary", (A2,)))
    d = s.choose(A1, exact=False)
    assert (d.worker_id, d.hit, d.spilled) == ("w2", False, True)
    # every worker at the bound: back to the holder, whose queue is still the best place
    s.heartbeat(beat("w2", "a:canary", (A2,), queue=9))
    s.heartbeat(beat("w3", "a:canary", (A2,), queue=9))
    d = s.choose(A1, exact=False)
    assert (d.worker_id, d.hit, d.spilled) == ("w1", True, False)


def test_a_worker_missing_three_beats_is_dropped_and_a_restarted_router_rebuilds_from_beats() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,)))
    s.heartbeat(beat("w2", "a:prod", (A1,)))
    clock.now += 2.0
    s.heartbeat(beat("w2", "a:prod", (A1,)))
    clock.now += 1.5  # w1: 3.5 s since its last beat
    assert [r["worker_id"] for r in s.table()] == ["w2"]
    assert s.choose(A1).worker_id == "w2"
    fresh = state(clock)  # a restarted router: empty until the next beats
    assert fresh.choose(A1).worker_id is None
    fresh.heartbeat(beat("w2", "a:prod", (A1,)))
    assert fresh.choose(A1).worker_id == "w2"


def test_failed_worker_is_left_out_until_it_beats_again_and_retry_excludes_it() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,)))
    s.heartbeat(beat("w2", "a:prod", (A1,), queue=3))
    first = s.choose(A1)
    assert first.worker_id == "w1"
    s.started("w1")
    s.finished("w1", ok=False)
    retry = s.choose(A1, exclude=[first.worker_id])
    assert retry.worker_id == "w2"
    assert s.choose(A1).worker_id == "w2"  # still left out
    clock.now += 1.0
    s.heartbeat(beat("w1", "a:prod", (A1,)))
    assert s.choose(A1).worker_id == "w1"
    assert s.choose(A1, exclude=["w1", "w2"]).worker_id is None


def test_random_choice_spreads_over_every_able_worker() -> None:
    clock = Clock()
    s = state(clock, affinity=False)
    for i in range(4):
        s.heartbeat(beat(f"w{i}", "a:prod" if i < 2 else "b:prod", (A1,) if i < 2 else (B1,), other_versions=1,
                         any_model=True))
    picks = [s.choose(A1) for _ in range(400)]
    counts = {w: sum(1 for p in picks if p.worker_id == w) for w in ("w0", "w1", "w2", "w3")}
    assert all(60 < n < 140 for n in counts.values()), counts
    hits = sum(p.hit for p in picks)
    assert 150 < hits < 250


def test_prewarm_targets_prefer_workers_of_the_model_then_most_cached() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "b:prod", (B1,), cached=(Cached("a", 2, 100, 100),)))
    s.heartbeat(beat("w2", "a:prod", (A1,)))
    s.heartbeat(beat("w3", "a:prod", (A1,), cached=(Cached("a", 2, 100, 40),)))
    assert s.prewarm_targets(A2, 2) == ["w3", "w2"]
    assert s.prewarm_targets(A2, None) == ["w3", "w2", "w1"]
    warm = {wid: (c.complete if c else False) for wid, c, _loaded in s.warm(A2)}
    assert warm == {"w1": True, "w2": False, "w3": False}


def test_version_from_workers_when_the_cluster_is_unreachable() -> None:
    clock = Clock()
    s = state(clock)
    s.heartbeat(beat("w1", "a:prod", (A1,)))
    s.heartbeat(beat("w2", "a:prod", (A2,)))
    s.heartbeat(beat("w3", "a:canary", (VersionKey("a", 3),)))
    assert s.version_from_workers("a", "prod") == 2
    assert s.version_from_workers("a", None) == 3
    assert s.version_from_workers("c", "prod") is None


def test_ref_cache_expires_after_its_ttl() -> None:
    clock = Clock()
    c = RefCache(clock, ttl_s=1.0)
    c.put("a:prod", 2)
    assert c.get("a:prod") == 2
    clock.now += 1.01
    assert c.get("a:prod") is None


def test_heartbeat_parsing_round_trips_and_refuses_bad_fields() -> None:
    b = beat("w1", "a:prod", (A1,), cached=(Cached("a", 1, 10, 10, 10, 0),), queue=2)
    assert Heartbeat.from_json(b.to_json()) == b
    assert b.model == "a" and b.tag == "prod"
    for bad in ({}, {"worker_id": "w", "url": "ftp://x", "serves": "a:prod"},
                {**b.to_json(), "queue": -1}, {**b.to_json(), "loaded": [{"model": "a", "version": 0}]},
                {**b.to_json(), "loaded": "a@1"}, [1, 2]):
        with pytest.raises(HeartbeatError):
            Heartbeat.from_json(bad)


# ------------------------------------------------------------------ identity: instance secrets and URL checks

S1, S2 = "a" * 64, "b" * 64


def test_a_worker_id_is_bound_to_its_first_secret_while_its_lease_lasts() -> None:
    from worker.router_state import Beat

    clock = Clock()
    s = state(clock)
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is Beat.ACCEPTED
    # another process naming w1 (another URL too): refused, and the table keeps the real one
    forged = Heartbeat("w1", "http://attacker:1", "a:prod", (A1,))
    assert s.heartbeat(forged, S2) is Beat.CONFLICT
    assert s.url_of("w1") == "http://w1:1"
    assert not s.leave("w1", S2) and s.choose(A1).worker_id == "w1"
    # once w1's lease ran out, its id is free: a restarted worker (a new secret) comes back
    clock.now += 3.5
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S2) is Beat.ACCEPTED
    assert not s.leave("w1", S1) and s.leave("w1", S2) and len(s) == 0


def test_a_new_url_is_routed_to_only_once_it_answered_as_the_worker() -> None:
    from worker.router_state import Beat

    clock = Clock()
    s = RouterState(clock, RouterConfig(verify_retry_s=5.0), random.Random(1))
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is Beat.VERIFY
    assert s.choose(A1).worker_id is None and s.prewarm_targets(A1, None) == []
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is Beat.ACCEPTED  # the check is under way: not asked twice
    assert [r["verified"] for r in s.table()] == [False]
    s.verified("w1", S1, "http://w1:1", ok=False)
    clock.now += 1.0
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is Beat.ACCEPTED  # retried only after verify_retry_s
    clock.now += 1.0
    s.heartbeat(beat("w1", "a:prod", (A1,)), S1)
    clock.now += 1.0
    s.heartbeat(beat("w1", "a:prod", (A1,)), S1)
    clock.now += 2.5
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is Beat.VERIFY
    s.verified("w1", S2, "http://w1:1", ok=True)  # not the secret it registered with: ignored
    assert s.choose(A1).worker_id is None
    s.verified("w1", S1, "http://w1:1", ok=True)
    assert s.choose(A1).worker_id == "w1" and [r["verified"] for r in s.table()] == [True]
    # a changed URL is checked again before anything goes there
    assert s.heartbeat(Heartbeat("w1", "http://elsewhere:2", "a:prod", (A1,)), S1) is Beat.VERIFY
    assert s.choose(A1).worker_id is None
    s.verified("w1", S1, "http://w1:1", ok=True)  # the old URL's answer does not vouch for the new one
    assert s.choose(A1).worker_id is None


def test_identity_proofs_bind_the_secret_the_worker_id_and_the_nonce() -> None:
    from worker.router_state import check_proof, identity_proof

    good = {"worker_id": "w1", "proof": identity_proof(S1, "w1", "n" * 32)}
    assert check_proof(good, S1, "w1", "n" * 32) is None
    assert check_proof(good, S2, "w1", "n" * 32) is not None
    assert check_proof(good, S1, "w1", "m" * 32) is not None
    assert "answered as worker 'w1'" in str(check_proof(good, S1, "w2", "n" * 32))
    assert check_proof([], S1, "w1", "n") is not None and check_proof({"worker_id": "w1"}, S1, "w1", "n") is not None


def test_workers_whose_url_failed_its_check_make_room_in_a_full_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.router_state as rs

    monkeypatch.setattr(rs, "MAX_WORKERS", 2)
    clock = Clock()
    s = RouterState(clock, RouterConfig(), random.Random(1))
    assert s.heartbeat(beat("fake", "a:prod", (A1,)), S2) is rs.Beat.VERIFY
    assert s.heartbeat(beat("w1", "a:prod", (A1,)), S1) is rs.Beat.VERIFY
    assert s.heartbeat(beat("w2", "a:prod", (A1,)), S1) is rs.Beat.FULL  # both checks under way
    s.verified("fake", S2, "http://fake:1", ok=False)
    s.verified("w1", S1, "http://w1:1", ok=True)
    assert s.heartbeat(beat("w2", "a:prod", (A1,)), S1) is rs.Beat.VERIFY
    assert s.url_of("fake") is None and s.url_of("w1") == "http://w1:1"
