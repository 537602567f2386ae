"""One PutChunks stream of a push: the chunks the sender queues for one server, on their own thread.

A :class:`ServerStream` feeds the server's ``PutChunks`` from a bounded queue (``offer`` blocks
while it is full: the backpressure of a slow server), closes each call after about
``stream_bytes`` so that its acks come back as the push goes, and reports both to the sender:
``on_acks(ids)`` with the chunks each call stored durably, ``on_failed(code, message)`` once
when a call broke (nothing more is taken after that).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from paramserver.client.errors import rpc_code, rpc_details
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.proto import pb

END = object()  # queued by ``end``: the last call ends once it has sent everything before it
_POLL_S = 0.2
ACKED = frozenset({pb.STORED, pb.ALREADY_PRESENT})


class _Aborted(Exception):
    """Raised inside a request iterator to cancel its PutChunks call."""


class ServerStream:
    """Everything sent to one server in one send round over PutChunks."""

    def __init__(self, server: str, client: ParamServerClient, *, queue_items: int, stream_bytes: int, batch_bytes: int,
                 abort: threading.Event, on_acks: Callable[[Sequence[str]], None],
                 on_failed: Callable[[grpc.StatusCode, str], None]) -> None:
        self.server = server
        self.client = client
        self.stream_bytes = stream_bytes
        self.batch_bytes = batch_bytes
        self.abort = abort
        self.on_acks = on_acks
        self.on_failed = on_failed
        self.queue: queue.Queue[object] = queue.Queue(maxsize=max(2, queue_items))
        self.error: str | None = None
        self.code: grpc.StatusCode | None = None
        self.yielded_bytes = 0
        self.thread = threading.Thread(target=self._run, name=f"push-{server}", daemon=True)

    def offer(self, item: ChunkRecord | object) -> bool:
        """Queue a chunk (or END); False once this stream has failed (the item is then dropped)."""
        while True:
            if self.error is not None or self.abort.is_set():
                return False
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue

    def end(self) -> None:
        self.offer(END)

    def _requests(self, state: dict[str, bool]) -> Iterator[ChunkRecord]:
        sent = 0
        while True:
            if self.abort.is_set():
                raise _Aborted()
            if self.error is not None:
                return
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is END:
                state["ended"] = True
                return
            assert isinstance(item, ChunkRecord)
            yield item
            sent += len(item.data)
            self.yielded_bytes += len(item.data)
            if sent >= self.stream_bytes:
                return

    def _run(self) -> None:
        state = {"ended": False}
        while not state["ended"] and not self.abort.is_set():
            try:
                reply = self.client.put_chunks(self._requests(state), batch_bytes=self.batch_bytes)
            except grpc.RpcError as exc:
                self._failed(rpc_code(exc), rpc_details(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a bug must not hang the producer: it sees the error and stops feeding us
                self._failed(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
                return
            self.on_acks([ack.id for ack in reply.acks if ack.status in ACKED])

    def _failed(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.error = code, message
        self.on_failed(code, message)


__all__ = ["ACKED", "END", "ServerStream"]
