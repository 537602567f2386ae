"""Parallel PutChunks streams, one per server, fed from bounded queues.

The caller's thread produces chunk bytes (lazily, once per chunk, shared by
every queue it goes to) and reports progress; one thread per server drains its
queue into PutChunks calls of about ``stream_bytes`` each, so acks arrive (and
count towards W) call by call, and a server failing late loses only its last
call's acks. A bounded queue makes a slow server slow the producer instead of
letting chunks pile up in memory: a 1 GiB model is never held twice.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import grpc

from paramserver.client.rpc import ChunkData, ParamServerClient
from paramserver.wire.proto import pb
from paramserver.client.push_plan import AckLedger
from paramserver.client.errors import rpc_code, rpc_details

_END = object()
_POLL_S = 0.2
ACKED = frozenset({pb.STORED, pb.ALREADY_PRESENT})


class _Aborted(Exception):
    """Raised inside a request iterator to cancel its PutChunks call."""


@dataclass(frozen=True)
class SendOptions:
    queue_items: int = 64  # per server; 64 x 256 KiB = 16 MiB in flight per stream
    stream_bytes: int = 512 << 20
    batch_bytes: int = 4 << 20
    progress_interval_s: float = 0.1


class ServerStream:
    """Everything sent to one server in one send round."""

    def __init__(self, server: str, client: ParamServerClient, ledger: AckLedger, options: SendOptions, abort: threading.Event) -> None:
        self.server = server
        self.client = client
        self.ledger = ledger
        self.options = options
        self.abort = abort
        self.queue: queue.Queue[object] = queue.Queue(maxsize=max(2, options.queue_items))
        self.error: str | None = None
        self.code: grpc.StatusCode | None = None
        self.yielded_bytes = 0
        self.thread = threading.Thread(target=self._run, name=f"push-{server}", daemon=True)

    def offer(self, item: object) -> bool:
        """Queue an item; False once this stream has failed (the item is then dropped)."""
        while True:
            if self.error is not None or self.abort.is_set():
                return False
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue

    def _requests(self, state: dict[str, bool]) -> Iterator[ChunkData]:
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
            if item is _END:
                state["ended"] = True
                return
            assert isinstance(item, ChunkData)
            yield item
            sent += len(item.data)
            self.yielded_bytes += len(item.data)
            if sent >= self.options.stream_bytes:
                return

    def _run(self) -> None:
        state = {"ended": False}
        while not state["ended"] and not self.abort.is_set():
            try:
                reply = self.client.put_chunks(self._requests(state), batch_bytes=self.options.batch_bytes)
            except grpc.RpcError as exc:
                self.code, self.error = rpc_code(exc), rpc_details(exc)
                return
            except Exception as exc:  # noqa: BLE001 - a bug must not hang the producer: it sees the error and stops feeding us
                self.code, self.error = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
                return
            for ack in reply.acks:
                if ack.status in ACKED:
                    self.ledger.ack(ack.id, self.server)


def send_round(
    sends: Mapping[str, Sequence[str]],
    targets: Mapping[str, Sequence[str]],
    order: Sequence[str],
    fetch: Callable[[str], ChunkData],
    clients: Callable[[str], ParamServerClient],
    ledger: AckLedger,
    options: SendOptions,
    progress: Callable[[int], None],
) -> dict[str, tuple[grpc.StatusCode | None, str]]:
    """Stream every item of ``order`` that has targets to those servers; return failed servers' errors.

    ``progress(bytes handed to gRPC so far)`` is called from this thread, which
    also runs ``fetch``; an exception from either cancels every stream.
    """
    abort = threading.Event()
    streams = {s: ServerStream(s, clients(s), ledger, options, abort) for s in sends}
    for st in streams.values():
        st.thread.start()
    last = 0.0

    def report(force: bool = False) -> None:
        nonlocal last
        now = time.monotonic()
        if force or now - last >= options.progress_interval_s:
            last = now
            progress(sum(st.yielded_bytes for st in streams.values()))

    try:
        for cid in order:
            servers = [s for s in targets.get(cid, ()) if streams[s].error is None]
            if not servers:
                continue
            chunk = fetch(cid)
            for s in servers:
                streams[s].offer(chunk)
            report()
        for st in streams.values():
            st.offer(_END)
        for st in streams.values():
            while st.thread.is_alive():
                st.thread.join(timeout=options.progress_interval_s)
                report()
        report(force=True)
    except BaseException:
        abort.set()
        for st in streams.values():
            st.thread.join(timeout=10)
        raise
    return {s: (st.code, st.error) for s, st in streams.items() if st.error is not None}


__all__ = ["SendOptions", "ServerStream", "send_round", "ACKED"]
