"""Chain replication on the bulk port: a PUT whose route names next hops goes on to the first of them.

A write session keeps one :class:`Chain`: per next hop one :class:`Forwarder`, this server's own
write session there (opened with the client's token, with the same hello and ACK reader as a
client's, ``paramserver.wire.bulk_write_session``). The PUT is forwarded before it is stored
here, so the next hop receives while this one stores; its ACKS (every hop after this one) are
merged after this server's own. A hop that cannot be reached, or fails, is answered FAILED for
every chunk ("send it there directly") and is not tried again by this session.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Collection

from paramserver.wire.address import split_host_port
from paramserver.wire.bulk_frames import FAILED, ProtocolError, PutBatch, encode_put, encode_route, send_all
from paramserver.wire.bulk_write_session import Ack, SessionEnded, open_write_session, read_ack_frame
from paramserver.server.errors import ForwardFailed
from paramserver.wire.errors import WriteSessionError


class Forwarder:
    """This server's write session to the next hop of a chain: PUTs out (in order), ACKS back by seq."""

    def __init__(self, address: str, token: str, io_timeout_s: float, ack_timeout_s: float) -> None:
        self.address = address
        self.ack_timeout_s = ack_timeout_s
        try:
            host, port = split_host_port(address)
        except ValueError as exc:
            raise ForwardFailed(f"cannot connect to {address}: {exc}") from None
        try:
            self.sock = open_write_session(address, host, port, token, connect_timeout_s=min(3.0, io_timeout_s),
                                           io_timeout_s=io_timeout_s)
        except WriteSessionError as exc:
            if exc.stage == "connect":
                raise ForwardFailed(f"cannot connect to {address}: {exc.detail}") from None
            if exc.stage == "handshake":
                raise ForwardFailed(f"handshake with {address} failed: {exc.detail}") from None
            raise ForwardFailed(f"{address} refused the write session: {exc.detail or exc.status}") from None
        self._rsock = self.sock.dup()  # the reader's own object: timeouts are per object
        self.seq = 0
        self.error: str | None = None
        self._results: dict[int, list[Ack]] = {}
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="bulk-forward-acks", daemon=True)
        self._reader.start()

    def send(self, batch: PutBatch, rest: list[str]) -> int:
        assert batch.buffer is not None
        with self._send_lock:
            if self.error is not None:
                raise ForwardFailed(self.error)
            self.seq += 1
            seq = self.seq
            try:
                send_all(self.sock, encode_put(seq, [batch.items], [batch.buffer], len(batch.buffer), encode_route(rest),
                                               count=len(batch.ids)))
            except (OSError, ValueError) as exc:
                self._fail(f"sending to {self.address} failed: {exc}")
                raise ForwardFailed(f"sending to {self.address} failed: {exc}") from None
        return seq

    def wait(self, seq: int) -> list[Ack]:
        deadline = time.monotonic() + self.ack_timeout_s
        with self._cond:
            while seq not in self._results:
                if self.error is not None:
                    raise ForwardFailed(self.error)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ForwardFailed(f"{self.address} sent no acks within {self.ack_timeout_s:g} s")
                self._cond.wait(min(left, 1.0))
            return self._results.pop(seq)

    def _fail(self, message: str) -> None:
        with self._cond:
            if self.error is None:
                self.error = message
            self._cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                got = read_ack_frame(self._rsock, self.ack_timeout_s, lambda: self.error is not None)
                if got is None:
                    return
                if isinstance(got, SessionEnded):
                    raise ProtocolError(f"{self.address} ended the forwarded session: {got.message}")
                with self._cond:
                    self._results[got.seq] = got.acks
                    self._cond.notify_all()
        except (OSError, EOFError, ProtocolError) as exc:
            self._fail(f"forwarding to {self.address} failed: {exc}")

    def close(self) -> None:
        self._fail("closed")
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._reader.join(timeout=5)
        self._rsock.close()


Waiter = tuple[Forwarder, int] | str  # the forwarder and the PUT's seq there, or why it was not forwarded


class Chain:
    """One write session's forwarding: next hop -> its Forwarder, or why that hop failed."""

    def __init__(self, *, token: str, own_address: str, where: str, forward_to: Callable[[], Collection[str]] | None,
                 io_timeout_s: float, on_forwarded: Callable[[], None]) -> None:
        self.token = token  # forwarded hops are opened with the client's own token
        self.own_address = own_address
        self.where = where
        self.forward_to = forward_to
        self.io_timeout_s = io_timeout_s
        self.on_forwarded = on_forwarded
        self._forwarders: dict[str, Forwarder | str] = {}
        self._lock = threading.Lock()

    def forward(self, batch: PutBatch) -> Waiter:
        hop, rest = batch.route[0], batch.route[1:]
        allowed = self.forward_to
        if allowed is None:
            return "this server does not forward bulk writes (chain replication is off here)"
        if hop in (self.own_address,) or hop in rest or hop not in allowed():
            return f"{hop} is not the bulk address of another member"
        with self._lock:
            found = self._forwarders.get(hop)
            if found is None:
                try:
                    found = Forwarder(hop, self.token, self.io_timeout_s, ack_timeout_s=max(60.0, 2 * self.io_timeout_s))
                except ForwardFailed as exc:
                    found = str(exc)
                self._forwarders[hop] = found
        if isinstance(found, str):
            return found
        try:
            seq = found.send(batch, rest)
        except ForwardFailed as exc:
            self._drop(hop, str(exc))
            return str(exc)
        self.on_forwarded()
        return found, seq

    def merge(self, batch: PutBatch, waiter: Waiter | None, local: list[Ack]) -> list[Ack]:
        """This server's acks with the next hops' (chunk-major: this server's first), once they came."""
        hops = batch.route
        n = len(batch.ids)
        down: list[Ack]
        if isinstance(waiter, tuple):
            forwarder, fseq = waiter
            try:
                down = forwarder.wait(fseq)
                if len(down) != n * len(hops):
                    raise ForwardFailed(f"{forwarder.address} answered {len(down)} acks for {n} chunks x {len(hops)} replicas")
            except ForwardFailed as exc:
                self._drop(hops[0], str(exc))
                down = self._failed(hops, n, str(exc))
        else:
            down = self._failed(hops, n, waiter or "not forwarded")
        merged: list[Ack] = []
        for k in range(n):
            merged.append(local[k])
            merged.extend(down[k * len(hops) : (k + 1) * len(hops)])
        return merged

    def _failed(self, hops: list[str], n: int, why: str) -> list[Ack]:
        return [(FAILED, f"{self.where} could not forward to {hop}: {why}; send it there directly", 0)
                for _k in range(n) for hop in hops]

    def _drop(self, hop: str, why: str) -> None:
        with self._lock:
            found = self._forwarders.get(hop)
            self._forwarders[hop] = why  # this session does not try that hop again
        if isinstance(found, Forwarder):
            found.close()

    def close(self) -> None:
        with self._lock:
            forwarders = [f for f in self._forwarders.values() if isinstance(f, Forwarder)]
            self._forwarders.clear()
        for f in forwarders:
            f.close()


__all__ = ["Chain", "ForwardFailed", "Forwarder", "Waiter"]
