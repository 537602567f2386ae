"""Push bookkeeping without sockets: dedup, replica assignment, W-quorum accounting."""
from __future__ import annotations

import threading

import pytest

from paramserver.client.push_plan import AckLedger, Item, placement_of, plan_uploads, wanted_by_server
from paramserver.wire.ring import Ring

PLACEMENT = {"a": ["s1", "s2", "s3"], "b": ["s2", "s3", "s1"], "c": ["s3", "s1", "s2"]}
ITEMS = [Item("a", 10), Item("b", 20), Item("c", 30)]


def test_placement_follows_the_ring() -> None:
    ring = Ring(["s1", "s2", "s3"])
    ids = [f"{i:064x}" for i in range(50)]
    placement = placement_of([Item(c, 1) for c in ids], lambda c: ring.replicas(c, 2))
    assert all(placement[c] == ring.replicas(c, 2) for c in ids)
    by_server = wanted_by_server(placement)
    assert sum(len(v) for v in by_server.values()) == 100
    assert all(c in by_server[s] for c in ids for s in placement[c])


def test_nothing_present_sends_everything_to_every_replica() -> None:
    plan = plan_uploads(ITEMS, PLACEMENT, {"s1": set(), "s2": set(), "s3": set()})
    assert plan.deduplicated == ()
    assert plan.bytes_to_send == 60 and plan.wire_bytes == 180
    assert plan.sends == {"s1": ["a", "b", "c"], "s2": ["a", "b", "c"], "s3": ["a", "b", "c"]}


def test_dedup_only_sends_to_replicas_that_lack_a_chunk() -> None:
    present = {"s1": {"a", "b"}, "s2": {"a", "b"}, "s3": {"a"}}
    plan = plan_uploads(ITEMS, PLACEMENT, present)
    assert plan.deduplicated == ("a",)
    assert plan.targets == {"b": ["s3"], "c": ["s3", "s1", "s2"]}
    assert plan.bytes_to_send == 50 and plan.wire_bytes == 20 + 90


def test_unreachable_server_gets_nothing_and_a_chunk_on_no_reachable_replica_is_not_deduplicated() -> None:
    present: dict[str, set[str] | None] = {"s1": None, "s2": {"a"}, "s3": {"a"}}
    plan = plan_uploads(ITEMS, PLACEMENT, present)
    assert "s1" not in plan.sends
    assert plan.deduplicated == ("a",)
    nobody = plan_uploads([Item("a", 1)], {"a": ["s1"]}, {"s1": None})
    assert nobody.deduplicated == () and nobody.sends == {}


def test_ledger_counts_present_and_acked_replicas_against_w() -> None:
    ledger = AckLedger(PLACEMENT, write_quorum=2)
    ledger.record_present({"s1": {"a"}, "s2": None, "s3": {"a", "b"}})
    assert ledger.count("a") == 2 and ledger.count("b") == 1 and ledger.count("c") == 0
    assert ledger.short() == ["b", "c"]
    ledger.ack("b", "s1")
    ledger.ack("c", "s3")
    ledger.ack("c", "s3")  # duplicate acks count once
    assert ledger.short() == ["c"]
    assert ledger.lacking("c") == ["s1", "s2"]
    assert ledger.lacking("c", exclude=["s2"]) == ["s1"]
    ledger.ack("c", "s2")
    assert ledger.short() == [] and ledger.holders("c") == {"s2", "s3"}


def test_ledger_ignores_acks_from_servers_outside_the_replica_set() -> None:
    ledger = AckLedger({"a": ["s1", "s2"]}, write_quorum=2)
    ledger.ack("a", "s1")
    ledger.ack("a", "s9")  # the quorum check never asks s9, so it must not count here either
    ledger.ack("zz", "s1")  # unknown ids are ignored
    assert ledger.short() == ["a"]


def test_failed_stream_counts_nothing_it_did_not_confirm() -> None:
    ledger = AckLedger(PLACEMENT, write_quorum=2)
    for cid in ("a", "b", "c"):
        ledger.ack(cid, "s1")  # s1's call returned acks
    # s2's stream failed mid-way: its reply never arrived, so none of its chunks count.
    assert ledger.short() == ["a", "b", "c"]
    ledger.ack("a", "s3")
    assert ledger.short() == ["b", "c"]


def test_ledger_is_thread_safe() -> None:
    ids = [f"{i:064x}" for i in range(2000)]
    ledger = AckLedger({c: ["s1", "s2", "s3"] for c in ids}, write_quorum=3)
    threads = [threading.Thread(target=lambda s=s: [ledger.ack(c, s) for c in ids]) for s in ("s1", "s2", "s3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.short() == []


def test_ledger_rejects_zero_quorum() -> None:
    with pytest.raises(ValueError, match="write quorum"):
        AckLedger({}, write_quorum=0)
