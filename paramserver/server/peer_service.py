"""AnnouncePeer and FindPeers: the worker-peer directory (``peer_directory``) behind gRPC.

Any valid token may call them (the token interceptor treats both as reads: the read token is
enough, as for ReportHeat). Input is checked here, each refusal one INVALID_ARGUMENT line that
says what to send instead. The server keeps what it is sent: the client sends each of a
version's ring owners its share of the worker's versions, and this server does not check that
it owns them (an entry it does not own is never asked for, and expires).

The table is soft state in memory, never in Raft: a server that restarts learns its entries
back within one announce period. It is expired on every call and by ``step`` (a Periodic of the
server process), so the ``paramserver_peer_entries`` gauge counts only live workers.
"""
from __future__ import annotations

import math
import random
import threading
import time
from typing import Callable

from chunking.hashing import is_content_id
from paramserver.server.peer_directory import Announcement, Limits, PeerDirectory, Version
from paramserver.wire.address import split_host_port
from paramserver.wire.proto import pb

MAX_WORKER_ID = 256  # characters of a worker id (and of an instance or host id)
EXPIRE_INTERVAL_S = 2.0  # how often the server process expires silent workers (peer_service.step)


class BadRequest(ValueError):
    """A request this service refuses (INVALID_ARGUMENT), with the one-line reason."""


def _manifest_id(value: str, what: str) -> str:
    if not is_content_id(value):
        raise BadRequest(f"{what} {value[:80]!r} is not a manifest id (64 lowercase hex digits); send the version's "
                         "manifest id")
    return value


def _text(value: str, what: str, *, required: bool = False) -> str:
    if required and not value:
        raise BadRequest(f"{what} is empty; send the worker's id (1 to {MAX_WORKER_ID} characters)")
    if len(value) > MAX_WORKER_ID:
        raise BadRequest(f"{what} is {len(value)} characters; at most {MAX_WORKER_ID}")
    if not value.isprintable():
        raise BadRequest(f"{what} {value[:80]!r} has control characters; send printable text")
    return value


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise BadRequest(f"{what} is {value}; send a finite number")
    return value


def announcement(request: pb.AnnouncePeerRequest, max_versions: int) -> Announcement:
    """The checked fields of an AnnouncePeer request; BadRequest says what is wrong."""
    worker_id = _text(request.worker_id, "worker_id", required=True)
    instance = _text(request.instance, "instance")
    host_id = _text(request.host_id, "host_id")
    lease = _finite(request.lease_s, "lease_s")
    if lease < 0:
        raise BadRequest(f"lease_s is {lease:g}; send seconds >= 0 (0: the server's default)")
    if request.leaving:  # a goodbye names the worker (and its instance), nothing else is read
        return Announcement(worker_id, instance=instance, lease_s=lease, leaving=True)
    try:
        _host, port = split_host_port(request.address)
    except ValueError as exc:
        raise BadRequest(f"address: {exc}; send the address other workers dial for the peer port") from None
    if port == 0:
        raise BadRequest(f"address {request.address!r} has port 0; send the peer port's bound port")
    if len(request.versions) > max_versions:
        raise BadRequest(f"the announce lists {len(request.versions)} versions; at most {max_versions} (the worker's most "
                         "recent ones that this server owns)")
    versions: list[Version] = []
    seen: set[str] = set()
    for v in request.versions:
        mid = _manifest_id(v.manifest_id, "versions.manifest_id")
        if mid in seen:
            raise BadRequest(f"version {mid} is listed twice; list each version once")
        seen.add(mid)
        versions.append(Version(mid, v.complete, _finite(v.started_at, f"started_at of version {mid[:16]}")))
    return Announcement(worker_id, request.address, instance, host_id, tuple(versions), lease)


class PeerService:
    """The directory with its lock, clock and random source; the servicer's AnnouncePeer and FindPeers
    call ``announce`` and ``find`` and answer a BadRequest INVALID_ARGUMENT."""

    def __init__(self, server_id: str, limits: Limits | None = None, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.server_id = server_id
        self.directory = PeerDirectory(limits or Limits())
        self.clock = clock
        self.rng = rng or random.Random()
        self._lock = threading.Lock()

    def announce(self, request: pb.AnnouncePeerRequest) -> pb.AnnouncePeerReply:
        """BadRequest when the request is refused."""
        a = announcement(request, self.directory.limits.max_versions)
        with self._lock:
            lease, kept = self.directory.announce(a, self.clock())
        return pb.AnnouncePeerReply(lease_s=lease, versions=kept)

    def find(self, request: pb.FindPeersRequest) -> pb.FindPeersReply:
        """BadRequest when the request is refused."""
        mid = _manifest_id(request.manifest_id, "manifest_id")
        exclude = _text(request.exclude_worker, "exclude_worker")
        with self._lock:
            now = self.clock()
            found = self.directory.find(mid, request.limit, exclude, now, self.rng)
            known = self.directory.known(mid, now)
            rank = self.directory.rank(mid, exclude)
        reply = pb.FindPeersReply(server_id=self.server_id, known=known)
        if rank is not None:
            reply.rank = rank
        for e in found:
            reply.peers.add(worker_id=e.worker_id, address=e.address, complete=e.complete, started_at=e.started_at,
                            host_id=e.host_id, lease_left_s=e.lease_left_s)
        return reply

    def step(self) -> int:
        """Expire silent workers now (a Periodic of the server process); how many were dropped."""
        with self._lock:
            return self.directory.expire(self.clock())

    def entries(self) -> int:
        with self._lock:
            return self.directory.entries()


__all__ = ["EXPIRE_INTERVAL_S", "MAX_WORKER_ID", "BadRequest", "PeerService", "announcement"]
