"""The push sending planner (paramserver.client.push_send_plan) against an in-memory transport.

No sockets and no threads: the transport below carries out the planner's decisions into dicts and
answers with the events a real bulk session or PutChunks stream would produce.
"""
from __future__ import annotations

import grpc
import pytest

from paramserver.client.push_plan import AckLedger
from paramserver.client.push_send_plan import (
    Aborted,
    BulkFailed,
    Decision,
    Event,
    Failure,
    Flush,
    NoStream,
    OpenStream,
    Put,
    PutAcked,
    SendPlanner,
    StreamAcked,
    StreamFailed,
    Submit,
)
from paramserver.wire import bulk_frames as bf
from paramserver.wire.chunk_record import ChunkRecord


def chunk(i: int, size: int = 100) -> ChunkRecord:
    return ChunkRecord(f"{i:064x}", "raw", size, 0, bytes(size))


class Memory:
    """An in-memory transport: what each server received, and the PUTs waiting for their acks."""

    def __init__(self, planner: SendPlanner) -> None:
        self.planner = planner
        self.streamed: dict[str, list[str]] = {}  # server -> chunk ids over PutChunks
        self.opened: list[str] = []
        self.puts: list[Put] = []  # every PUT sent
        self.unacked: list[Put] = []
        self.unreachable: set[str] = set()  # OpenStream fails for these (no client)

    def step(self, event: Event) -> list[Decision]:
        decisions = self.planner.step(event)
        self.run(decisions)
        return decisions

    def run(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Put):
                if self.planner.current(d.put):
                    self.puts.append(d)
                    self.unacked.append(d)
            elif isinstance(d, OpenStream):
                if d.server in self.unreachable:
                    self.step(NoStream(d.server, grpc.StatusCode.UNAVAILABLE, f"{d.server} is not a member"))
                else:
                    self.opened.append(d.server)
                    self.streamed.setdefault(d.server, [])
            else:
                if d.server in self.streamed:
                    self.streamed[d.server].append(d.chunk.id)

    def ack(self, put: Put, status: int = bf.STORED, bad: dict[tuple[int, int], tuple[int, str, int]] | None = None) -> None:
        """Answer ``put``: every chunk x replica ``status``, except the (chunk, replica) in ``bad``."""
        replicas = 1 + len(put.route)
        acks = [(bad or {}).get((k, r), (status, "", 0)) for k in range(len(put.chunks)) for r in range(replicas)]
        self.unacked.remove(put)
        assert self.planner.step(PutAcked(put.put, acks, replicas)) == []

    def ack_all(self) -> None:
        for put in list(self.unacked):
            self.ack(put)

    def stream_acks(self) -> None:
        for server, ids in self.streamed.items():
            assert self.planner.step(StreamAcked(server, ids)) == []


ADDRESSES = {"a": "10.0.0.1:7000", "b": "10.0.0.2:7000", "c": "10.0.0.3:7000", "g": ""}


def make(ids: list[str], servers: tuple[str, ...] = ("a", "b", "c"), *, batch_bytes: int = 250, chain: bool = False,
         quorum: int = 2) -> tuple[SendPlanner, Memory, AckLedger]:
    ledger = AckLedger({cid: servers for cid in ids}, quorum)
    planner = SendPlanner(ledger, ADDRESSES.__getitem__, batch_bytes=batch_bytes, chain=chain)
    return planner, Memory(planner), ledger


def ids_of(put: Put) -> list[str]:
    return [e.chunk.id for e in put.chunks]


# ------------------------------------------------------------------ batching and routing


def test_bulk_servers_get_puts_of_about_batch_bytes_and_flush_sends_the_rest() -> None:
    chunks = [chunk(i) for i in range(7)]
    planner, mem, ledger = make([c.id for c in chunks], ("a",), quorum=1)
    for c in chunks[:2]:
        assert mem.step(Submit(c, ["a"])) == []  # 200 bytes: under batch_bytes
    (put,) = mem.step(Submit(chunks[2], ["a"]))  # 300 >= 250: one PUT of three
    assert isinstance(put, Put) and ids_of(put) == [c.id for c in chunks[:3]] and put.nbytes == 300
    assert put.server == "a" and put.address == ADDRESSES["a"] and put.route == () and put.hops == ()
    assert put.chunks[0].item == bf.encode_put_item(chunks[0].id, "raw", 100, 100, 0)
    for c in chunks[3:]:
        mem.step(Submit(c, ["a"]))
    assert [ids_of(p) for p in mem.puts] == [[c.id for c in chunks[:3]], [c.id for c in chunks[3:6]]]
    assert not planner.settled
    mem.step(Flush())
    assert ids_of(mem.puts[-1]) == [chunks[6].id]
    mem.ack_all()
    assert planner.settled and ledger.short() == [] and planner.failures() == {}


def test_a_put_carries_at_most_max_put_items_chunks() -> None:
    chunks = [chunk(i, size=1) for i in range(bf.MAX_PUT_ITEMS + 3)]
    planner, mem, _ = make([c.id for c in chunks], ("a",), batch_bytes=1 << 30, quorum=1)
    for c in chunks:
        mem.step(Submit(c, ["a"]))
    assert [len(p.chunks) for p in mem.puts] == [bf.MAX_PUT_ITEMS]
    mem.step(Flush())
    assert [len(p.chunks) for p in mem.puts] == [bf.MAX_PUT_ITEMS, 3]


def test_each_named_server_gets_the_chunk_once_over_its_transport() -> None:
    chunks = [chunk(i) for i in range(4)]
    planner, mem, ledger = make([c.id for c in chunks], ("a", "b", "g"))
    for c in chunks:
        mem.step(Submit(c, ["a", "g", "a", "b"]))  # a repeated server is sent to once
    mem.step(Flush())
    assert mem.opened == ["g"]  # one PutChunks stream, for the server without a bulk address
    assert mem.streamed["g"] == [c.id for c in chunks]
    for server in ("a", "b"):
        assert [cid for p in mem.puts if p.server == server for cid in ids_of(p)] == [c.id for c in chunks]
    mem.ack_all()
    assert all(ledger.holders(c.id) == {"a", "b"} for c in chunks)
    mem.stream_acks()
    assert all(ledger.count(c.id) == 3 for c in chunks) and planner.settled


def test_acks_count_only_from_the_chunks_ring_replicas() -> None:
    c = chunk(1)
    planner, mem, ledger = make([c.id], ("a", "b"), batch_bytes=1)
    mem.step(Submit(c, ["a", "c"]))  # c is no replica of this chunk: its ack does not count
    mem.ack_all()
    assert ledger.holders(c.id) == {"a"}


# ------------------------------------------------------------------ chains


def test_chain_sends_each_batch_once_with_a_head_that_turns() -> None:
    chunks = [chunk(i) for i in range(9)]
    planner, mem, ledger = make([c.id for c in chunks], chain=True)
    for c in chunks:
        mem.step(Submit(c, ["c", "a", "b"]))
    mem.step(Flush())
    assert [(p.server, p.route) for p in mem.puts] == [("a", ("b", "c")), ("b", ("c", "a")), ("c", ("a", "b"))]
    assert all(p.hops == tuple(ADDRESSES[s] for s in p.route) for p in mem.puts)
    mem.ack_all()
    assert all(ledger.count(c.id) == 3 for c in chunks) and planner.stats.chain_off == ""


def test_chain_is_not_used_when_a_replica_has_no_bulk_address() -> None:
    chunks = [chunk(i) for i in range(3)]
    planner, mem, _ = make([c.id for c in chunks], ("a", "b", "g"), chain=True)
    for c in chunks:
        mem.step(Submit(c, ["a", "b", "g"]))
    assert all(p.route == () for p in mem.puts) and {p.server for p in mem.puts} == {"a", "b"}
    assert mem.streamed["g"] == [c.id for c in chunks]


def test_a_hop_answering_failed_gets_its_chunks_directly_and_chaining_stops() -> None:
    chunks = [chunk(i) for i in range(6)]
    planner, mem, ledger = make([c.id for c in chunks], chain=True)
    for c in chunks[:3]:
        mem.step(Submit(c, ["a", "b", "c"]))
    (first,) = mem.puts
    assert first.route == ("b", "c")
    why = "c does not forward"
    mem.ack(first, bad={(k, 2): (bf.FAILED, why, 0) for k in range(3)})  # the last hop missed every chunk
    assert planner.stats.chain_off == why and planner.stats.chain_resent == 3
    assert all(ledger.holders(c.id) == {"a", "b"} for c in chunks[:3]) and "c" not in planner.failures()
    for c in chunks[3:]:
        mem.step(Submit(c, ["a", "b", "c"]))  # the misses go first, then no more chains
    mem.step(Flush())
    assert all(p.route == () for p in mem.puts[1:])
    to_c = [cid for p in mem.puts[1:] if p.server == "c" for cid in ids_of(p)]
    assert to_c == [c.id for c in chunks]
    mem.ack_all()
    assert all(ledger.count(c.id) == 3 for c in chunks) and planner.settled


# ------------------------------------------------------------------ failures


def test_a_bulk_session_failing_before_any_ack_falls_back_to_putchunks() -> None:
    chunks = [chunk(i) for i in range(6)]
    planner, mem, ledger = make([c.id for c in chunks], ("a", "b"))
    for c in chunks:
        mem.step(Submit(c, ["a", "b"]))
    on_a = [p for p in mem.unacked if p.server == "a"]
    assert len(on_a) == 2
    mem.step(BulkFailed("a", grpc.StatusCode.UNAVAILABLE, "bulk write to a: cannot connect"))
    assert not any(planner.current(p.put) for p in on_a)
    assert mem.opened == ["a"] and mem.streamed["a"] == [c.id for c in chunks]  # every unacked chunk, in order
    assert planner.stats.bulk_fallbacks == 1 and "cannot connect" in planner.stats.fallback_reasons["a"]
    c = chunk(99)
    ledger.add({c.id: ("a", "b")})
    mem.step(Submit(c, ["a", "b"]))  # later chunks for a go over the stream too
    assert mem.streamed["a"][-1] == c.id
    for p in on_a:
        mem.unacked.remove(p)
    mem.step(Flush())
    mem.ack_all()
    mem.stream_acks()
    assert planner.failures() == {} and ledger.short() == [] and planner.settled


def test_a_bulk_session_failing_after_acks_is_a_failure_of_that_server() -> None:
    chunks = [chunk(i) for i in range(6)]
    planner, mem, ledger = make([c.id for c in chunks], ("a", "b"))
    for c in chunks:
        mem.step(Submit(c, ["a", "b"]))
    first_a = next(p for p in mem.unacked if p.server == "a")
    mem.ack(first_a)
    mem.step(BulkFailed("a", grpc.StatusCode.UNAVAILABLE, "connection lost"))
    assert planner.failures()["a"] == Failure(grpc.StatusCode.UNAVAILABLE, "connection lost")
    assert planner.stops("a") and mem.opened == [] and planner.stats.bulk_fallbacks == 0
    mem.step(Submit(chunk(50), ["a", "b"]))
    mem.step(Flush())
    assert all(p.server == "b" for p in mem.puts if 50 == int(ids_of(p)[-1], 16))
    mem.unacked = [p for p in mem.unacked if p.server != "a"]
    mem.ack_all()
    assert planner.settled
    assert [ledger.holders(c.id) for c in chunks] == [{"a", "b"}] * 3 + [{"b"}] * 3


def test_a_failed_chain_head_hands_its_put_to_the_hops() -> None:
    chunks = [chunk(i) for i in range(3)]
    planner, mem, ledger = make([c.id for c in chunks], chain=True)
    for c in chunks:
        mem.step(Submit(c, ["a", "b", "c"]))
    (put,) = mem.unacked
    mem.unacked.clear()
    mem.step(BulkFailed(put.server, grpc.StatusCode.UNAUTHENTICATED, "admin token needed"))
    assert planner.failures() == {"a": Failure(grpc.StatusCode.UNAUTHENTICATED, "admin token needed")}
    assert planner.stats.bulk_fallbacks == 0 and mem.opened == []  # a refused token would be refused over gRPC too
    mem.step(Flush())
    direct = {p.server: ids_of(p) for p in mem.puts[1:]}
    assert direct == {"b": [c.id for c in chunks], "c": [c.id for c in chunks]}
    mem.ack_all()
    assert all(ledger.holders(c.id) == {"b", "c"} for c in chunks) and planner.settled


def test_no_fallback_once_aborted_and_a_fallback_without_a_client_fails_the_server() -> None:
    planner, mem, _ = make([chunk(1).id], ("a", "b"), batch_bytes=1)
    mem.step(Submit(chunk(1), ["a", "b"]))
    mem.step(Aborted())
    mem.step(BulkFailed("a", grpc.StatusCode.UNAVAILABLE, "reset"))
    assert planner.failures()["a"].code == grpc.StatusCode.UNAVAILABLE and mem.opened == []
    planner, mem, _ = make([chunk(1).id], ("a", "b"), batch_bytes=1)
    mem.unreachable.add("a")
    mem.step(Submit(chunk(1), ["a", "b"]))
    mem.step(BulkFailed("a", grpc.StatusCode.UNIMPLEMENTED, "bulk writes are off"))
    assert planner.failures()["a"] == Failure(grpc.StatusCode.UNAVAILABLE, "a is not a member") and planner.stops("a")
    assert "a" not in mem.streamed and planner.stats.bulk_fallbacks == 1


def test_per_chunk_errors_become_grpc_codes_and_only_corrupt_in_transit_lets_the_rest_go_on() -> None:
    chunks = [chunk(i) for i in range(4)]
    planner, mem, ledger = make([c.id for c in chunks], ("a", "b"), batch_bytes=1)
    mem.step(Submit(chunks[0], ["a", "b"]))
    put_a, put_b = mem.unacked
    mem.ack(put_a, bad={(0, 0): (bf.CORRUPT_IN_TRANSIT, "crc bad", 0)})
    mem.ack(put_b, bad={(0, 0): (bf.FULL, "disk full", 77)})
    assert planner.failures() == {"a": Failure(grpc.StatusCode.DATA_LOSS, "crc bad"),
                                  "b": Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "disk full (77 bytes free)")}
    assert not planner.stops("a") and planner.stops("b") and ledger.holders(chunks[0].id) == set()
    mem.step(Submit(chunks[1], ["a", "b"]))
    assert [p.server for p in mem.unacked] == ["a"]
    mem.ack(mem.unacked[0], bad={(0, 0): (bf.INVALID, "bad id", 0)})
    assert planner.failures()["a"].code == grpc.StatusCode.INVALID_ARGUMENT  # a stopping failure replaces the first
    assert planner.stops("a")


def test_a_chunk_no_put_item_can_describe_fails_every_server_before_sending() -> None:
    bad = ChunkRecord("xyz", "raw", 1, 0, b"x")
    planner, mem, _ = make([], ("a", "g"))
    assert mem.step(Submit(bad, ["a", "g"])) == []
    assert {s: f.code for s, f in planner.failures().items()} == {"a": grpc.StatusCode.INVALID_ARGUMENT,
                                                                 "g": grpc.StatusCode.INVALID_ARGUMENT}
    assert mem.step(Submit(chunk(1), ["a", "g"])) == []  # nothing more goes to either


def test_a_broken_stream_stops_its_server_and_shows_in_the_failures() -> None:
    planner, mem, _ = make([chunk(1).id, chunk(2).id], ("g", "a"))
    mem.step(Submit(chunk(1), ["g"]))
    assert planner.step(StreamFailed("g", grpc.StatusCode.UNAVAILABLE, "connection reset")) == []
    assert planner.stops("g") and planner.failures() == {"g": Failure(grpc.StatusCode.UNAVAILABLE, "connection reset")}
    assert mem.step(Submit(chunk(2), ["g"])) == []


def test_a_server_without_a_client_is_failed_and_skipped() -> None:
    planner, mem, ledger = make([chunk(1).id], ("g", "a"), batch_bytes=1)
    mem.unreachable.add("g")
    mem.step(Submit(chunk(1), ["g", "a"]))
    assert planner.failures() == {"g": Failure(grpc.StatusCode.UNAVAILABLE, "g is not a member")}
    mem.ack_all()
    assert ledger.holders(chunk(1).id) == {"a"} and planner.settled


def test_a_late_ack_for_a_put_handed_on_is_not_trusted() -> None:
    planner, mem, ledger = make([chunk(1).id], ("a",), batch_bytes=1, quorum=1)
    mem.step(Submit(chunk(1), ["a"]))
    (put,) = mem.unacked
    mem.step(BulkFailed("a", grpc.StatusCode.UNAVAILABLE, "reset"))
    mem.ack(put)
    assert ledger.holders(chunk(1).id) == set() and mem.streamed["a"] == [chunk(1).id]


@pytest.mark.parametrize("first, then, kept", [
    (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS),
])  # fmt: skip
def test_the_first_failure_stays_unless_a_stopping_one_follows(first: grpc.StatusCode, then: grpc.StatusCode,
                                                                 kept: grpc.StatusCode) -> None:
    planner = SendPlanner(AckLedger({}, 1), ADDRESSES.__getitem__, batch_bytes=1)
    planner.fail("a", first, "one", stop=False)
    planner.fail("a", then, "two", stop=False)
    assert planner.failures()["a"].code == kept and not planner.stops("a")
