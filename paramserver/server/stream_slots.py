"""Stream slots: who may take one, and which stalled read stream to cut for a stream that waits.

A gRPC stream holds a worker thread of the server for as long as it lasts, so streams share a
fixed number of slots (``paramserver.server.dataplane``). Read-token clients that opened
``GetChunks`` streams and then stopped reading held every slot for the 30 s idle timeout,
renewably: every pull over gRPC failed (issue 41). Two rules now keep one client from that:

- **Per client**: one client identity holds at most ``per_client`` slots of the pool, so other
  clients always find one. The identity is the token class (read, admin, none), the client's
  mutual-TLS certificate identity when it sent one, and its source address: a fleet of workers
  sharing one certificate is not one client, and one host cannot take every slot with it.
  Calls with the admin token (pushes, a peer's repair; trusted with writes anyway) are not capped.
- **Stalled first**: a read stream whose client has taken no message for ``stale_s`` (its
  server thread is blocked on a send the client's flow-control window does not take) is cut, its
  slot given at once to a stream that would otherwise wait or be refused. A stream waits at most
  ``wait_s`` (for a slot to free, or a stream to become stale), then is refused
  RESOURCE_EXHAUSTED: only when no stream is stalled.

:class:`SlotPolicy` is the pure part (the table of holders, the decision, an injected clock);
:class:`StreamSlots` adds the lock, the waiting and the cut itself.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc

from paramserver.server.errors import ConfigError

CONFIG_KEYS = ("read_streams_per_client", "read_stream_stale_s", "stream_wait_s")  # a server config's keys


@dataclass(frozen=True)
class StreamLimits:
    """``per_client`` None: the pool less a quarter of it (at least one slot is always left to others)."""

    per_client: int | None = None
    stale_s: float = 2.0  # a read stream whose client took nothing this long is cut when another stream waits
    wait_s: float = 1.5  # how long a new stream waits for a slot before RESOURCE_EXHAUSTED

    def cap(self, slots: int) -> int:
        if self.per_client is not None:
            return min(self.per_client, slots)
        return max(1, slots - max(1, slots // 4))

    def validate(self) -> StreamLimits:
        if self.per_client is not None and self.per_client < 1:
            raise ConfigError(f"read_streams_per_client must be >= 1, got {self.per_client}")
        if not 0 < self.stale_s <= 600:
            raise ConfigError(f"read_stream_stale_s must be in (0, 600] seconds, got {self.stale_s}")
        if not 0 <= self.wait_s <= 30:
            raise ConfigError(f"stream_wait_s must be in [0, 30] seconds, got {self.wait_s}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> StreamLimits:
        per, stale, wait = (extra.get(k) for k in CONFIG_KEYS)
        if per is not None and (not isinstance(per, int) or isinstance(per, bool)):
            raise ConfigError(f"read_streams_per_client must be an integer, got {per!r}")
        for name, value in (("read_stream_stale_s", stale), ("stream_wait_s", wait)):
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
                raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
        return cls(per, cls.stale_s if stale is None else float(stale),  # type: ignore[arg-type]
                   cls.wait_s if wait is None else float(wait)).validate()  # type: ignore[arg-type]


@dataclass
class Holder:
    identity: str
    read: bool  # a GetChunks stream: may be cut when its client stalls
    capped: bool  # counts against its identity's share
    last: float  # when the client last took a message (or the stream began)
    busy: bool = False  # the server is producing a message: not the client's stall


@dataclass(frozen=True)
class Decision:
    take: bool = False  # a slot is free for it
    victim: int | None = None  # or: cut this stream and take its slot
    reason: str = ""  # else: "client_limit" or "stream_limit"
    retry_in: float | None = None  # when a held read stream can become stale at the earliest


class SlotPolicy:
    """The holders of ``slots`` stream slots and who may take the next one (no threads, no I/O)."""

    def __init__(self, slots: int, limits: StreamLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.limits = limits.validate()
        self.per_client = limits.cap(slots)
        self.clock = clock
        self.holders: dict[int, Holder] = {}

    def held_by(self, identity: str) -> int:
        return sum(1 for h in self.holders.values() if h.identity == identity and h.capped)

    def decide(self, identity: str, capped: bool) -> Decision:
        now = self.clock()
        over = capped and self.held_by(identity) >= self.per_client
        if not over and len(self.holders) < self.slots:
            return Decision(take=True)
        # Over its share, a client makes room among its own streams only; else anyone's stalled one.
        pool = [(k, h) for k, h in self.holders.items() if h.read and not h.busy and (not over or h.identity == identity)]
        stale = [(k, h) for k, h in pool if now - h.last >= self.limits.stale_s]
        if stale:
            # The stalest of the client holding the most slots: the one most likely to be hoarding.
            counts = Counter(h.identity for h in self.holders.values())
            victim, _ = max(stale, key=lambda kh: (counts[kh[1].identity], now - kh[1].last))
            return Decision(victim=victim)
        soonest = min((h.last + self.limits.stale_s - now for _, h in pool), default=None)
        return Decision(reason="client_limit" if over else "stream_limit", retry_in=soonest)

    def hold(self, key: int, identity: str, *, read: bool, capped: bool) -> None:
        self.holders[key] = Holder(identity, read, capped, self.clock())

    def touch(self, key: int, busy: bool) -> None:
        h = self.holders.get(key)
        if h is not None:
            h.last, h.busy = self.clock(), busy

    def release(self, key: int) -> bool:
        """False when ``key`` holds nothing (its slot was given to another stream when it was cut)."""
        return self.holders.pop(key, None) is not None


@dataclass(frozen=True)
class Taken:
    key: int
    victim: object | None  # the cut stream's handle (e.g. its gRPC context), for the caller to end


class StreamSlots:
    """A pool of stream slots under :class:`SlotPolicy`: take (waiting up to ``wait_s``), touch, release.

    ``max_waiters``: streams that may wait at once (each holds a server thread while it waits;
    beyond, a stream that finds no slot is refused at once)."""

    def __init__(self, slots: int, limits: StreamLimits, *, max_waiters: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = SlotPolicy(slots, limits, clock)
        self.max_waiters = max_waiters
        self._cond = threading.Condition()
        self._handles: dict[int, object] = {}
        self._next = 0
        self.waiting = 0
        self.cut = 0  # stalled streams cut for another stream

    @property
    def slots(self) -> int:
        return self.policy.slots

    @property
    def per_client(self) -> int:
        return self.policy.per_client

    def take(self, identity: str, handle: object, *, read: bool, capped: bool, wait_s: float | None = None) -> Taken | str:
        """A slot (and the stalled stream cut for it, if one was), or the refusal's reason."""
        wait = self.policy.limits.wait_s if wait_s is None else wait_s
        deadline = time.monotonic() + wait
        waiter = False
        with self._cond:
            try:
                while True:
                    d = self.policy.decide(identity, capped)
                    victim: object | None = None
                    if d.victim is not None:
                        self.policy.release(d.victim)
                        victim = self._handles.pop(d.victim, None)
                        self.cut += 1
                    if d.take or d.victim is not None:
                        self._next += 1
                        self.policy.hold(self._next, identity, read=read, capped=capped)
                        self._handles[self._next] = handle
                        return Taken(self._next, victim)
                    left = deadline - time.monotonic()
                    if left <= 0 or (not waiter and self.waiting >= self.max_waiters):
                        return d.reason
                    if not waiter:
                        waiter = True
                        self.waiting += 1
                    self._cond.wait(min(left, max(0.01, d.retry_in if d.retry_in is not None else left)))
            finally:
                if waiter:
                    self.waiting -= 1

    def touch(self, key: int, busy: bool) -> None:
        with self._cond:
            self.policy.touch(key, busy)

    def release(self, key: int) -> None:
        with self._cond:
            if self.policy.release(key):
                self._handles.pop(key, None)
                self._cond.notify_all()  # a waiter over its share cannot use every freed slot

    def held(self) -> int:
        with self._cond:
            return len(self.policy.holders)




def source_of_peer(peer: str) -> str | None:
    """The client's address in a gRPC peer string (``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:5000``,
    percent-encoded or not), without the port; None for anything else (a Unix socket)."""
    from urllib.parse import unquote

    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        host = rest.rpartition(":")[0]
        return host.strip("[]") or None
    return None



def cert_identity(context: grpc.ServicerContext) -> str | None:
    """The mutual-TLS client certificate's identity (its SANs, else its common name), None without one."""
    try:
        names = context.peer_identities()
    except Exception:  # noqa: BLE001 - a context without an auth context (tests' fakes)
        return None
    return ",".join(sorted(n.decode("utf-8", "replace") for n in names)) if names else None


class Slot:
    """One taken stream slot: ``touch`` says whether the client is keeping up, ``release`` frees it."""

    __slots__ = ("pool", "key")

    def __init__(self, pool: StreamSlots | threading.BoundedSemaphore, key: int = 0) -> None:
        self.pool, self.key = pool, key

    def touch(self, busy: bool) -> None:
        if isinstance(self.pool, StreamSlots):
            self.pool.touch(self.key, busy)

    def release(self) -> None:
        if isinstance(self.pool, StreamSlots):
            self.pool.release(self.key)
        else:
            self.pool.release()


__all__ = ["CONFIG_KEYS", "Decision", "Holder", "Slot", "SlotPolicy", "StreamLimits", "StreamSlots", "Taken", "cert_identity",
           "source_of_peer"]
