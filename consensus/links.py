"""A pysyncobj TCP transport that keeps every peer link busy.

pysyncobj drops a link when nothing was read on it for ``connectionTimeout``,
and it checks that only when it next sends. Between two followers nothing
flows in normal operation, so the first message after a quiet spell, the
vote request of the next election, found the link expired and was dropped:
every election lost a round (bakwc/PySyncObj issue 172). Sending a tiny
message on every link each ``keepalive_period`` keeps links fresh, and a link
that stays silent despite it is really dead and still gets dropped.

The same transport is where a follower's AppendEntries answers wait for its
journal to be durable (``consensus.durable.AckGate``): pysyncobj sends them
from inside the message handler, right after appending, with no hook between.

It is also where connections that are not a member's are refused. pysyncobj's
TCPTransport reads the first message of an incoming connection as either a
utility command (``syncobj_admin``: status, add, remove, set_version, transfer),
the literal 'readonly' (a read-only node: it receives the whole log and may
submit commands), or a member's Raft address. Without a cluster secret nothing
authenticates that message, so utility commands and read-only nodes are
refused outright (this cluster uses neither); with a secret, the connection
only gets that far if its frames decrypt with it, which pysyncobj checks
silently: a frame that does not decrypt is logged here. Every refusal is one
WARNING line naming the remote address, at most one per remote host per
``REFUSAL_LOG_INTERVAL``. What no transport check can fix: without a secret,
pysyncobj unpickles every frame before any of this, so the port must only be
reachable by members (loopback, or a secret; the server refuses otherwise).
These hooks override TCPTransport methods of pysyncobj 0.3.17 (install() in
consensus/durable refuses other versions) and read the peer address from
TcpConnection's private socket.
"""
from __future__ import annotations

import logging
import reprlib
import struct
import time
from typing import Any, Callable

from pysyncobj.monotonic import monotonic
from pysyncobj.transport import TCPTransport

from .durable import AckGate, JournalFailure

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL = 10.0  # seconds: at most one WARNING line per remote host in this time
REFUSAL_LOG_HOSTS = 256  # remote hosts remembered at once; bounds memory and lines per interval
_UNKNOWN_PEER = "an unknown address"
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60  # a refused message is named, never dumped: it is the sender's text

# SyncObj ignores message types it does not know, so peers only see a read.
KEEPALIVE_MESSAGE = {"type": "pdparams_keepalive"}

# pysyncobj buffers a frame of any declared length (up to 2 GiB), copying the buffer on every read,
# and checks nothing until the frame is whole. Before a connection is a member's link its frames
# are the key exchange and an address; after, pysyncobj batches entries and snapshot parts in 64 KiB.
MAX_HANDSHAKE_FRAME = 64 << 10
MAX_LINK_FRAME = 64 << 20

# pysyncobj checks a connection's read timeout only when the connection has an event, so a silent
# connection that never sent its first message was held forever, one file descriptor each. Before
# the handshake ends a connection has this long, and at most this many wait at once (past it the
# oldest goes: a member's handshake takes milliseconds, a flood's connections are the old ones).
HANDSHAKE_TIMEOUT_S = 10.0
MAX_HANDSHAKING = 64
# pysyncobj listens with a backlog of 5; members reconnecting at once after a partition need more.
LISTEN_BACKLOG = 128


class RefusalLog:
    """WARNING lines for refused Raft connections: one per remote host per ``interval``, with a count of the rest.

    A flood from one host, or from many, yields at most ``max_hosts`` lines per interval.
    Called from the SyncObj's tick thread only.
    """

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL, max_hosts: int = REFUSAL_LOG_HOSTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_hosts = max_hosts
        self._clock = clock
        self._hosts: dict[str, tuple[float, int]] = {}  # host -> (time of its last line, refusals since)
        self._unlogged = 0  # refusals from hosts that found the table full

    def refuse(self, address: str, reason: str) -> bool:
        """Record one refusal of ``address`` ("host:port"); True if it was logged."""
        host = address.rsplit(":", 1)[0] if address != _UNKNOWN_PEER else address
        now = self._clock()
        last = self._hosts.get(host)
        if last is not None and now - last[0] < self.interval:
            self._hosts[host] = (last[0], last[1] + 1)
            return False
        if last is None and len(self._hosts) >= self.max_hosts:
            for stale in [h for h, (t, _) in self._hosts.items() if now - t >= self.interval]:
                del self._hosts[stale]
            if len(self._hosts) >= self.max_hosts:
                self._unlogged += 1
                return False
        self._hosts[host] = (now, 0)
        more = []
        if last is not None and last[1]:
            more.append(f"{last[1]} more from {host} not logged")
        if self._unlogged:
            more.append(f"{self._unlogged} from other hosts not logged")
            self._unlogged = 0
        log.warning("refused Raft connection from %s: %s%s", address, reason,
                    f" ({'; '.join(more)})" if more else "")
        return True


class _CheckedEncryptor:
    """pysyncobj's Fernet encryptor of one incoming connection, reporting frames that fail the secret check.

    TcpConnection drops such a connection without a word; this says so (and re-raises, so it still drops it).
    """

    def __init__(self, inner: Any, on_failure: Callable[[], None]) -> None:
        self._inner = inner
        self._on_failure = on_failure

    def encrypt_at_time(self, data: bytes, current_time: int) -> bytes:
        return bytes(self._inner.encrypt_at_time(data, current_time))

    def extract_timestamp(self, token: bytes) -> int:
        try:
            return int(self._inner.extract_timestamp(token))
        except Exception:
            self._on_failure()
            raise

    def decrypt(self, token: bytes) -> bytes:
        try:
            return bytes(self._inner.decrypt(token))
        except Exception:
            self._on_failure()
            raise


def _peer_address(conn: Any) -> str:
    sock = getattr(conn, "_TcpConnection__socket", None)  # pysyncobj keeps no peer address of its own
    try:
        host, port = sock.getpeername()[:2] if sock is not None else (None, None)
    except OSError:
        return _UNKNOWN_PEER
    if host is None:
        return _UNKNOWN_PEER
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class KeepaliveTCPTransport(TCPTransport):  # type: ignore[misc]
    """TCPTransport plus a periodic keepalive on every connected peer link, refusing non-members."""

    keepalive_period: float = 0.3
    ack_gate: AckGate | None = None  # None: answers go out at once (in-memory or legacy use)

    def __init__(self, syncObj: Any, selfNode: Any, otherNodes: Any) -> None:  # noqa: N803 - pysyncobj's names
        self._next_keepalive = 0.0
        self._listening: Any = None  # the listening socket whose backlog was raised
        self._rebind_at = 0.0
        self.refusals = RefusalLog()
        super().__init__(syncObj, selfNode, otherNodes)
        if self.ack_gate is not None:
            self.ack_gate.attach(lambda node, message: TCPTransport.send(self, node, message))

    def send(self, node: Any, message: Any) -> bool:
        gate = self.ack_gate
        if gate is not None and gate.holds(message):
            gate.hold(node, message)
            return True  # as far as pysyncobj can tell, sent: it never reads the outcome of an answer
        return bool(super().send(node, message))

    def _onTick(self) -> None:  # noqa: N802 - overrides pysyncobj
        if self.ack_gate is not None:
            # Runs right before pysyncobj polls: the sync of what this tick appended overlaps
            # with the followers' syncs of the entries just sent to them.
            try:
                self.ack_gate.flush()
            except JournalFailure:
                return  # logged by the journal; DurableSyncObj stops the node at its next tick
        self._rebind_if_closed()
        super()._onTick()
        self._widen_backlog()
        now = monotonic()
        if now < self._next_keepalive:
            return
        self._expire_handshakes(now)
        self._next_keepalive = now + self.keepalive_period
        for node in list(self._nodes):
            # Only links past the handshake (and the key exchange, with a secret):
            # a message sent earlier would break the exchange. send() also checks
            # the read timeout, so a silent link is detected here.
            if self._syncObj.isNodeConnected(node):
                self.send(node, KEEPALIVE_MESSAGE)

    # ------------------------------------------------------------- the listening socket
    def _rebind_if_closed(self) -> None:
        """pysyncobj's TcpServer closes its listening socket on any accept error but EAGAIN (EMFILE
        when descriptors run out, ECONNABORTED) and never binds again: the node then took no link
        from a peer for good. It is bound again here, at most once per bindRetryTime, while the node
        goes on (marking the transport not ready would stop pysyncobj's whole tick until a bind
        succeeds: no heartbeats, no elections, no expiry of the connections that hold descriptors)."""
        server = self._server
        if server is None or getattr(server, "_TcpServer__fileno", 0) is not None:
            return
        now = monotonic()
        if now < self._rebind_at:
            return
        self._rebind_at = now + float(self._syncObj.conf.bindRetryTime)
        try:
            server.bind()
        except OSError as exc:
            log.warning("the Raft port stopped listening after an accept error and cannot be bound again yet (%s); "
                        "retrying", exc)
            return
        log.warning("the Raft port stopped listening after an accept error (out of file descriptors?); it listens again")
        self._listening = None

    def _widen_backlog(self) -> None:
        ready = bool(getattr(self, "_ready", False))
        sock = getattr(self._server, "_TcpServer__socket", None) if ready else None
        if sock is not None and sock is not self._listening:
            try:
                sock.listen(LISTEN_BACKLOG)
            except OSError:
                pass
            self._listening = sock

    def _expire_handshakes(self, now: float) -> None:
        for conn in list(self._unknownConnections):
            if now - getattr(conn, "pdparams_since", now) > HANDSHAKE_TIMEOUT_S:
                self._refuse(conn, f"no handshake within {HANDSHAKE_TIMEOUT_S:.0f} s")

    # ------------------------------------------------------------- refusing non-members
    def _onNewIncomingConnection(self, conn: Any) -> None:  # noqa: N802 - overrides pysyncobj
        waiting = sorted(self._unknownConnections, key=lambda c: getattr(c, "pdparams_since", 0.0))
        for old in waiting[: max(0, len(waiting) - MAX_HANDSHAKING + 1)]:
            self._refuse(old, f"more than {MAX_HANDSHAKING} connections were waiting for their handshake")
        super()._onNewIncomingConnection(conn)
        conn.pdparams_since = monotonic()
        conn.pdparams_peer = address = _peer_address(conn)
        self._cap_frames(conn)
        if conn.encryptor is not None:
            def failed() -> None:
                what = "a frame" if conn in self._unknownConnections else "a frame of an established link"
                self.refusals.refuse(address, f"{what} that does not decrypt with the cluster secret (a client "
                                              "without it, or a server with another --cluster-secret)")
            conn.encryptor = _CheckedEncryptor(conn.encryptor, failed)

    def _cap_frames(self, conn: Any) -> None:
        """Refuse an incoming frame declared over the limit as soon as its length arrives, and stop
        reading while a whole frame's worth is buffered (the rest waits in the socket)."""
        read = getattr(conn, "_TcpConnection__processRead", None)
        if read is None:
            return  # not pysyncobj 0.3.17's TcpConnection (install() refuses other versions)

        def capped_read() -> bool:
            more = bool(read())
            buffered = getattr(conn, "_TcpConnection__readBuffer", b"")
            if len(buffered) < 4:
                return more
            limit = MAX_HANDSHAKE_FRAME if conn in self._unknownConnections else MAX_LINK_FRAME
            (declared,) = struct.unpack("i", buffered[:4])
            if not 0 <= declared <= limit:
                self._refuse(conn, f"a frame declared {declared} bytes long, over the limit of {limit} "
                                   f"({'before' if limit == MAX_HANDSHAKE_FRAME else 'on'} a member's link)")
                return False
            return more and len(buffered) <= limit + 4

        conn._TcpConnection__processRead = capped_read

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:  # noqa: N802 - overrides pysyncobj
        """The first messages of an incoming connection: key exchange, then a member's address; nothing else."""
        secret = self._syncObj.encryptor is not None
        if secret and not conn.sendRandKey:
            super()._onIncomingMessageReceived(conn, message)  # the key exchange; its frame decrypted already
            return
        if isinstance(message, list):
            command = message[0] if message else None
            if not secret:
                self._refuse(conn, f"pysyncobj utility command {_short.repr(command)} refused: with no cluster "
                                   "secret nothing authenticates it (set --cluster-secret to use syncobj_admin)")
                return
            if not isinstance(command, str) or command not in self._onUtilityMessageCallbacks:
                self._refuse(conn, f"unknown pysyncobj utility command {_short.repr(command)}")
                return
            # Sent by someone holding the cluster secret, i.e. trusted like a member.
            log.info("pysyncobj utility command %r from %s (with the cluster secret)", command,
                     getattr(conn, "pdparams_peer", _UNKNOWN_PEER))
            super()._onIncomingMessageReceived(conn, message)
            return
        if isinstance(message, str) and message in self._nodeAddrToNode:
            super()._onIncomingMessageReceived(conn, message)
            return
        if message == "readonly":
            reason = "a pysyncobj read-only node; this cluster has none"
        else:
            reason = (f"its first message {_short.repr(message)} is not the Raft address of a member (a server "
                      "being added is refused until its addition commits)")
        self._refuse(conn, reason)

    def _refuse(self, conn: Any, reason: str) -> None:
        self.refusals.refuse(getattr(conn, "pdparams_peer", _UNKNOWN_PEER), reason)
        self._unknownConnections.discard(conn)
        conn.disconnect()


def transport_class(keepalive_period: float, ack_gate: AckGate | None = None) -> type[KeepaliveTCPTransport]:
    """A transport class bound to one period and gate (pysyncobj instantiates the class itself)."""
    return type("KeepaliveTCPTransport", (KeepaliveTCPTransport,),
                {"keepalive_period": keepalive_period, "ack_gate": ack_gate})
