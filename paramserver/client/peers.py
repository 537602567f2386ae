"""Worker peers through the servers: announce what this worker holds or loads, find who else does.

The record of which worker holds which version is soft state on the servers, never in Raft
(``AnnouncePeer`` / ``FindPeers``, paramserver.server.peer_directory). A version's entries live
on the servers that own its manifest id on the ring, R of them, as its chunks do: no new single
point of failure and no Raft write per worker; the loss of any one server leaves R-1 copies, and
a worker that goes silent drops out when its lease ends. Each owner is sent only its share of a
worker's versions; FindPeers asks the owners in ring order until one answers.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from paramserver.wire.limits import MAX_PEER_VERSIONS, MAX_PEERS_FOUND
from paramserver.wire.proto import pb

if TYPE_CHECKING:
    from paramserver.client.session import ClusterClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerVersion:
    """A version this worker holds whole (``complete``) or is loading, since ``started_at`` (unix s)."""

    manifest_id: str
    complete: bool
    started_at: float


@dataclass(frozen=True)
class PeerEntry:
    """Another worker, as a server answered for one version."""

    worker_id: str
    address: str
    complete: bool
    started_at: float
    host_id: str


@dataclass(frozen=True)
class PeerView:
    """A FindPeers answer: the other workers, and this worker's rank in the version's swarm (0: the
    earliest to start; None when the servers have no entry of it, e.g. it serves nobody)."""

    peers: list[PeerEntry]
    rank: int | None = None


def host_id() -> str:
    """This machine: its boot id (a loopback address of a peer is reachable only on the same machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class PeerDirectory:
    """Announce and find through the ring owners of each version. Thread-safe."""

    def __init__(self, client: ClusterClient, worker_id: str, *, lease_s: float = 10.0, timeout_s: float = 2.0) -> None:
        self.client = client
        self.worker_id = worker_id
        self.instance = os.urandom(8).hex()
        self.host_id = host_id()
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="peer-directory")
        self._lock = threading.Lock()
        self._told: set[str] = set()  # servers announced to (a leave goes to each)

    def owners(self, manifest_id: str) -> list[str]:
        """The servers that keep the peers of ``manifest_id``: its replicas on the ring."""
        return self.client.view().replicas(manifest_id)

    def _call_at(self, server_id: str) -> pb.Member | None:
        return self.client.members().get(server_id)

    def announce(self, address: str, versions: Sequence[PeerVersion], *, leaving: bool = False) -> int:
        """Tell each owner its share of ``versions`` (the most recent MAX_PEER_VERSIONS); with ``leaving``
        tell every server told before to forget this worker. Returns how many servers took it."""
        recent = sorted(versions, key=lambda v: v.started_at, reverse=True)[:MAX_PEER_VERSIONS]
        share: dict[str, list[PeerVersion]] = {}
        if not leaving:
            for v in recent:
                for server in self.owners(v.manifest_id):
                    share.setdefault(server, []).append(v)
        with self._lock:
            targets = set(share) | self._told  # a server that owns none of them any more gets an empty list
            if leaving:
                self._told = set()
            else:
                self._told |= set(share)
        futures = [self._pool.submit(self._announce_at, server, address, share.get(server, []), leaving)
                   for server in sorted(targets)]
        done, _ = wait(futures, timeout=self.timeout_s + 1.0)
        return sum(1 for f in done if f.exception() is None and f.result())

    def _announce_at(self, server: str, address: str, versions: list[PeerVersion], leaving: bool) -> bool:
        member = self._call_at(server)
        if member is None:
            return False
        request = pb.AnnouncePeerRequest(
            worker_id=self.worker_id, address=address, instance=self.instance, host_id=self.host_id,
            versions=[pb.PeerVersion(manifest_id=v.manifest_id, complete=v.complete, started_at=v.started_at)
                      for v in versions],
            lease_s=self.lease_s, leaving=leaving)
        try:
            self.client.server(member.grpc_address).announce_peer(request, timeout=self.timeout_s)
            return True
        except grpc.RpcError as exc:
            log.debug("peer announce to %s failed: %s", server, exc)
            return False

    def find(self, manifest_id: str, limit: int = MAX_PEERS_FOUND) -> PeerView:
        """Other workers that hold or load ``manifest_id``: the first owner that answers (ring order);
        none when none does (then every chunk comes from the servers)."""
        for server in self.owners(manifest_id):
            member = self._call_at(server)
            if member is None:
                continue
            try:
                reply = self.client.server(member.grpc_address).find_peers(
                    manifest_id, limit=limit, exclude_worker=self.worker_id, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                log.debug("FindPeers at %s failed: %s", server, exc)
                continue
            peers = [PeerEntry(p.worker_id, p.address, p.complete, p.started_at, p.host_id) for p in reply.peers
                     if p.worker_id != self.worker_id]
            return PeerView(peers, reply.rank if reply.HasField("rank") else None)
        return PeerView([])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["PeerDirectory", "PeerEntry", "PeerVersion", "PeerView", "host_id"]
