"""send_round with in-process fake servers: parallel streams, acks, a server failing mid-stream, aborts."""
from __future__ import annotations

import threading
from typing import Iterable

import grpc
import pytest

from paramserver.client.rpc import ChunkData
from paramserver.wire.proto import pb
from paramserver.client.push_plan import AckLedger
from paramserver.client.push_sender import SendOptions, send_round


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset"


class FakeClient:
    """Consumes the request stream like PutChunks; optionally dies after ``fail_after`` chunks."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.received: list[str] = []
        self.calls = 0

    def put_chunks(self, chunks: Iterable[ChunkData], batch_bytes: int = 0) -> pb.PutChunksReply:
        self.calls += 1
        reply = pb.PutChunksReply()
        for c in chunks:
            if self.fail_after is not None and len(self.received) >= self.fail_after:
                raise FakeRpcError()
            self.received.append(c.id)
            reply.acks.add(id=c.id, status=pb.STORED)
        return reply


IDS = [f"{i:064x}" for i in range(40)]
PLACEMENT = {cid: ["s1", "s2", "s3"] for cid in IDS}


def fetch(cid: str) -> ChunkData:
    return ChunkData(cid, "raw", 1000, 0, b"x" * 1000)


def run(clients: dict[str, FakeClient], options: SendOptions = SendOptions(queue_items=2, stream_bytes=5000)) -> tuple[AckLedger, dict]:
    ledger = AckLedger(PLACEMENT, write_quorum=2)
    sends = {s: list(IDS) for s in clients}
    targets = {cid: list(clients) for cid in IDS}
    seen: list[int] = []
    failed = send_round(sends, targets, IDS, fetch, clients.__getitem__, ledger, options, seen.append)
    assert seen and seen == sorted(seen)
    return ledger, failed


def test_every_server_gets_every_chunk_in_several_calls() -> None:
    clients = {s: FakeClient() for s in ("s1", "s2", "s3")}
    ledger, failed = run(clients)
    assert failed == {}
    assert all(c.received == IDS for c in clients.values())
    assert all(c.calls >= 8 for c in clients.values())  # stream_bytes=5000: a call per ~5 chunks
    assert ledger.short() == [] and all(ledger.count(cid) == 3 for cid in IDS)


def test_server_failing_mid_stream_loses_only_its_unconfirmed_call() -> None:
    clients = {"s1": FakeClient(), "s2": FakeClient(), "s3": FakeClient(fail_after=12)}
    ledger, failed = run(clients)
    assert set(failed) == {"s3"} and failed["s3"][0] == grpc.StatusCode.UNAVAILABLE
    assert clients["s1"].received == IDS and clients["s2"].received == IDS  # the others were not held up
    on_s3 = [cid for cid in IDS if "s3" in ledger.holders(cid)]
    # Calls of 5 chunks: the first two calls (10 chunks) were confirmed; the third died unconfirmed.
    assert on_s3 == IDS[:10]
    assert ledger.short() == []  # W=2 still holds through s1 and s2


def test_exception_in_progress_cancels_every_stream() -> None:
    clients = {s: FakeClient() for s in ("s1", "s2")}
    ledger = AckLedger(PLACEMENT, write_quorum=2)
    calls = 0

    def boom(done: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        send_round({s: list(IDS) for s in clients}, {cid: list(clients) for cid in IDS}, IDS, fetch, clients.__getitem__, ledger,
                   SendOptions(queue_items=2, stream_bytes=1 << 30, progress_interval_s=0.0), boom)  # fmt: skip
    assert ledger.short() == IDS  # nothing confirmed: a single huge call was cancelled
    assert not [t for t in threading.enumerate() if t.name.startswith("push-")]
