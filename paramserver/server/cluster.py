"""Cluster-side helpers the server plugs into its services: placement over the
current members, the pre-commit quorum check (invariant 2), and fetching a
chunk from another replica for repair or for a manifest this server lacks.

All of them take the member list as a callable (the metadata plane's
``members().value``), so they follow membership changes without restarts.
"""
from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Sequence

import grpc

from chunking.errors import ManifestError
from chunking.manifest import Manifest
from consensus.records import MemberRecord

from paramserver.server import codecs
# The server's one way into the client stack: its peer clients (tests/unit/test_layers.py).
from paramserver.client.rpc import ChunkData, ClientConfig, ParamServerClient
from paramserver.server.errors import ChunkNotFoundError, InvalidChunkError, ParamServerError
from paramserver.server.metaservice import VersionFacts
from paramserver.wire.ring import Ring, RingConfig, replication_and_quorum
from paramserver.server.rpc_errors import PreconditionFailed
from paramserver.server.store import ChunkStore, StoredChunk

MembersFn = Callable[[], Sequence[MemberRecord]]


class PeerSet:
    """The members, their ring (rebuilt when the member set changes) and one client per peer."""

    def __init__(
        self,
        self_id: str,
        members: MembersFn,
        *,
        ring_config: RingConfig = RingConfig(),
        replication_factor: int = 3,
        write_quorum: int | None = None,
        token: str | None = None,
        timeout_s: float = 10.0,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        tls_ca: Path | None = None,
    ) -> None:
        """``tls_cert``/``tls_key``: this server's own certificate, presented to its peers as a client
        certificate (mutual TLS); with them every peer call goes over TLS, checking the peer's
        certificate against ``tls_ca`` (the system roots when None)."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        self.self_id = self_id
        self._members = members
        self.ring_config = ring_config
        self.replication_factor = replication_factor
        self.write_quorum = write_quorum
        self.token = token
        self.timeout_s = timeout_s
        self.tls_cert, self.tls_key, self.tls_ca = tls_cert, tls_key, tls_ca
        self._lock = threading.Lock()
        self._ring_key: tuple[tuple[str, str], ...] | None = None
        self._ring: Ring | None = None
        self._clients: dict[str, ParamServerClient] = {}

    def members(self) -> dict[str, MemberRecord]:
        return {m.server_id: m for m in self._members()}

    def ring(self) -> Ring:
        up = tuple(sorted((m.server_id, m.zone) for m in self._members() if m.state == "up"))
        with self._lock:
            if up != self._ring_key:
                self._ring, self._ring_key = Ring(dict(up), self.ring_config), up
            assert self._ring is not None
            return self._ring

    def quorum(self, replicas: int) -> int:
        return replication_and_quorum(self.replication_factor, self.write_quorum, replicas)[1]

    def client(self, member: MemberRecord) -> ParamServerClient:
        """The client for a peer (made once, reused): every server-to-server call goes through here."""
        with self._lock:
            client = self._clients.get(member.grpc_address)
            if client is None:
                client = ParamServerClient(self.client_config(member.grpc_address))
                self._clients[member.grpc_address] = client
            return client

    def client_config(self, address: str) -> ClientConfig:
        """The one peer-client factory's settings: admin token, and mutual TLS when this server has a certificate."""
        return ClientConfig(
            address, token=self.token, timeout_s=self.timeout_s, tls=self.tls_cert is not None, tls_ca=self.tls_ca,
            client_cert=self.tls_cert, client_key=self.tls_key,
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


class QuorumVersionCheck:
    """CommitVersion's ``version_check``: every chunk of the manifest (and the
    manifest itself) must be on at least W of its R replicas."""

    def __init__(self, peers: PeerSet, local: ChunkStore, *, max_parallel: int = 8, peer_timeout_s: float = 3.0) -> None:
        self.peers = peers
        self.peer_timeout_s = peer_timeout_s
        self.local = local
        self.max_parallel = max_parallel

    def __call__(self, manifest_id: str, manifest: bytes) -> VersionFacts:
        try:
            parsed = Manifest.from_bytes(manifest, expected_id=manifest_id)
        except ManifestError as exc:
            raise InvalidChunkError(manifest_id, f"manifest {manifest_id} cannot be committed: {exc}") from None
        ids = [manifest_id, *dict.fromkeys(parsed.chunk_ids())]
        ring = self.peers.ring()
        r = min(self.peers.replication_factor, len(ring))
        placement = {cid: ring.replicas(cid, r) for cid in ids}
        by_server: dict[str, list[str]] = {}
        for cid, servers in placement.items():
            for server in servers:
                by_server.setdefault(server, []).append(cid)
        members = self.peers.members()
        w = self.peers.quorum(r)
        present: dict[str, set[str]] = {server: set() for server in by_server}

        def short_of_quorum() -> list[tuple[str, int]]:
            counts = ((cid, sum(cid in present[s] for s in servers)) for cid, servers in placement.items())
            return [(cid, n) for cid, n in counts if n < w]

        # Answers are awaited only until every chunk has W copies: a replica that is down or cut
        # off must not hold a commit for its full deadline when the others already prove the quorum.
        pool = ThreadPoolExecutor(max_workers=self.max_parallel)
        try:
            pending = {pool.submit(self._present_on, members.get(server), server, wanted): server for server, wanted in by_server.items()}
            while pending and short_of_quorum():
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    present[pending.pop(future)] = future.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        short = short_of_quorum()
        if short:
            cid, n = short[0]
            raise PreconditionFailed(
                f"{len(short)} of {len(ids)} chunks of manifest {manifest_id} have not reached their write quorum "
                f"(W={w} of R={r}); e.g. chunk {cid} is on {n}. Push the missing chunks again, then commit"
            )
        return VersionFacts(nbytes=parsed.raw_bytes, chunk_count=len(parsed.chunks))

    def _present_on(self, member: MemberRecord | None, server: str, ids: list[str]) -> set[str]:
        if server == self.peers.self_id:
            return {cid for cid, ok in zip(ids, self.local.claim(ids)) if ok}
        if member is None:
            return set()
        try:
            flags = self.peers.client(member).has_chunks(ids, claim=True, timeout=self.peer_timeout_s)
        except grpc.RpcError:
            return set()  # an unreachable replica holds nothing we can count on
        return {cid for cid, ok in zip(ids, flags) if ok}


class ReplicaFetcher:
    """Fetch a verified copy of a chunk from another server: its ring replicas
    first, then every other member. Usable as Repairer's fetcher."""

    def __init__(self, peers: PeerSet, local: ChunkStore) -> None:
        self.peers = peers
        self.local = local

    def __call__(self, chunk_id: str) -> StoredChunk | None:
        members = self.peers.members()
        ring = self.peers.ring()
        preferred = ring.replicas(chunk_id, len(ring)) if len(ring) else []
        order = [s for s in dict.fromkeys([*preferred, *sorted(members)]) if s != self.peers.self_id and s in members]
        for server in order:
            try:
                for item in self.peers.client(members[server]).get_chunks_partial([chunk_id]):
                    if not isinstance(item, ChunkData):
                        break  # MISSING / CORRUPT there
                    self.local.validate_incoming(item.id, item.data, item.codec, item.raw_size, item.crc32c)
                    return StoredChunk(item.id, item.data, item.codec, item.raw_size, item.crc32c)
            except (grpc.RpcError, InvalidChunkError):
                continue
        return None


def cluster_blob_fetcher(local: ChunkStore, fetch: ReplicaFetcher) -> Callable[[str], bytes]:
    """Manifest bytes by id: this server's copy, else a verified copy from a replica."""

    def fetch_blob(blob_id: str) -> bytes:
        try:
            chunk = local.get(blob_id)
        except ParamServerError:
            found = fetch(blob_id)
            if found is None:
                raise ChunkNotFoundError(blob_id, f"manifest {blob_id} is on no reachable server; push it again") from None
            chunk = found
        return bytes(codecs.decode(chunk.codec, chunk.data, chunk.raw_size))

    return fetch_blob


__all__ = ["ChunkData", "PeerSet", "QuorumVersionCheck", "ReplicaFetcher", "cluster_blob_fetcher", "MembersFn"]
