"""Cluster-side helpers the server plugs into its services: placement over the
current members, the pre-commit quorum check (invariant 2), the check that a new
member answers and runs this cluster (AddMember), and fetching a chunk from
another replica for repair or for a manifest this server lacks.

All of them take the member list as a callable (the metadata plane's
``members().value``), so they follow membership changes without restarts.
"""
from __future__ import annotations

import hmac
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import grpc
import numpy as np

from chunking.errors import ManifestError
from chunking.hashing import hex_ids
from chunking.manifest import Manifest
from consensus.records import MemberRecord

from paramserver.server import codecs
# The server's one way into the client stack: its peer clients (tests/unit/test_layers.py).
from paramserver.client.rpc import ClientConfig, ParamServerClient
from paramserver.server.errors import ChunkNotFoundError, InvalidChunkError, ParamServerError
from paramserver.server.metaservice import CLUSTER_ID_KEY, VersionFacts
from paramserver.wire.chunk_record import ChunkRecord
from paramserver.wire.proto import pb
from paramserver.wire.ring import Ring, RingConfig, replication_and_quorum
from paramserver.server.rpc_errors import PreconditionFailed
from paramserver.server.store import ChunkStore, StoredChunk

T = TypeVar("T")


MembersFn = Callable[[], Sequence[MemberRecord]]
# What one replica holds of the ids asked, row for row: present; the CRC32C its copy declares and
# whether that copy is raw (both None when the replica did not say).
Held = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]
HEDGE_S, HEDGE_S_PER_ID = 0.3, 2e-6  # when the commit check asks the other replicas of chunks still short
HAS_BATCH = 1 << 15  # ids per HasChunks call of the commit check: 1 MiB packed, 2.2 MB as strings (under 4 MiB)


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

    def reconnect(self, member: MemberRecord, failed: ParamServerClient) -> ParamServerClient:
        """A fresh client for a peer in place of ``failed``, whose call just failed UNAVAILABLE.

        A gRPC channel that could not connect while its peer was down stays in reconnect back-off
        (1 s, growing to 2 min) and fails calls at once with the old "connection refused" long after
        the peer came back; a new channel connects at once. Another thread may have reconnected
        first: then its client is returned. The failed one is closed (its connection is gone)."""
        with self._lock:
            current = self._clients.get(member.grpc_address)
            if current is not None and current is not failed:
                return current
            client = ParamServerClient(self.client_config(member.grpc_address))
            self._clients[member.grpc_address] = client
        failed.close()
        return client

    def call(self, member: MemberRecord, fn: Callable[[ParamServerClient], T]) -> T:
        """``fn(client)`` for a peer; when it fails UNAVAILABLE, once more on a fresh client: the failure
        may be only the old channel's reconnect back-off from while that peer was down (``reconnect``),
        and a peer just restarted would otherwise get no calls from us until it ends."""
        client = self.client(member)
        try:
            return fn(client)
        except grpc.RpcError as exc:
            if (exc.code() if hasattr(exc, "code") else None) != grpc.StatusCode.UNAVAILABLE:
                raise
            return fn(self.reconnect(member, client))

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
    """CommitVersion's ``version_check``: every chunk of the manifest (and the manifest
    itself) must be on at least W of its R replicas, and the stored copies must agree with the
    manifest's CRC32C. The facts returned name the manifest's model, which CommitVersion
    compares with the request's.

    A chunk has one raw encoding: a raw copy with another CRC than a raw manifest entry means the
    manifest describes bytes no server holds (a reader would refuse every copy), so
    InvalidChunkError (INVALID_ARGUMENT) naming the chunk. A copy in another encoding (pushed
    earlier with another codec or zstd level; the content id was proven on ingest) differs
    legitimately: readers prove such a copy by its content id (paramserver.client.verify)."""

    def __init__(self, peers: PeerSet, local: ChunkStore, *, max_parallel: int = 8, peer_timeout_s: float = 3.0,
                 fetch_blob: Callable[[str], bytes] | None = None) -> None:
        self.peers = peers
        self.fetch_blob = fetch_blob  # a split manifest's parts (cluster_blob_fetcher); None reads only whole ones
        self.peer_timeout_s = peer_timeout_s
        self.local = local
        self.max_parallel = max_parallel

    def __call__(self, manifest_id: str, manifest: bytes) -> VersionFacts:
        def no_parts(blob_id: str) -> bytes:
            raise ChunkNotFoundError(blob_id, "this server reads no manifest parts")

        try:
            parsed = Manifest.read(manifest_id, self.fetch_blob or no_parts, root=manifest)
        except ManifestError as exc:
            raise InvalidChunkError(manifest_id, f"manifest {manifest_id} cannot be committed: {exc}") from None
        except ParamServerError as exc:
            raise PreconditionFailed(f"manifest {manifest_id} cannot be committed: a part of it is not readable ({exc}); "
                                     "push the manifest's parts with PutChunks before CommitVersion") from None
        # Each distinct id once, as its 32-byte digest, with the CRC32C a raw copy must have.
        # Columns and arrays, no hex string or ChunkRef per chunk: a big checkpoint has half a million.
        table = parsed.chunks
        raw_rows = np.asarray([c == "raw" for c in table.codecs], dtype=bool)[table.codec_index]
        first = table.first_of
        clash = np.flatnonzero(raw_rows & raw_rows[first] & (table.crc32c != table.crc32c[first]))
        if len(clash):
            row = int(clash[0])
            cid = table.digests[row].tobytes().hex()
            raise InvalidChunkError(cid, f"manifest {manifest_id} gives chunk {cid} two CRC32Cs "
                                         f"({int(table.crc32c[first[row]]):08x} and {int(table.crc32c[row]):08x}); pack the model again")
        rows = table.first_rows
        # The manifest's own blobs (its root, or sole blob, and its parts) lead; their CRCs are not in it.
        blob_ids = list(parsed.blobs())
        head = len(blob_ids)
        digests = [np.frombuffer(bytes.fromhex("".join(blob_ids)), np.uint8).reshape(-1, 32), table.digests[rows]]
        crcs = np.concatenate([np.zeros(head, np.uint32), table.crc32c[rows]])
        is_raw = np.concatenate([np.zeros(head, bool), raw_rows[rows]])
        file_refs = parsed.file_chunks()  # a model folder's files are chunks too
        if file_refs:
            at = {cid: i for i, cid in enumerate([*blob_ids, *(table.ids[k] for k in rows.tolist())])}
            extra = []
            for ref in file_refs:
                i = at.get(ref.id)
                if i is None:
                    extra.append(ref)
                elif i >= head and is_raw[i] and ref.codec == "raw" and int(crcs[i]) != ref.crc32c:
                    raise InvalidChunkError(ref.id, f"manifest {manifest_id} gives chunk {ref.id} two CRC32Cs "
                                                    f"({int(crcs[i]):08x} and {ref.crc32c:08x}); pack the model again")
            if extra:
                digests.append(np.frombuffer(bytes.fromhex("".join(r.id for r in extra)), np.uint8).reshape(-1, 32))
                crcs = np.concatenate([crcs, np.asarray([r.crc32c for r in extra], np.uint32)])
                is_raw = np.concatenate([is_raw, np.asarray([r.codec == "raw" for r in extra], bool)])
        every = np.ascontiguousarray(np.concatenate(digests))
        points = every[:, :8].copy().view(">u8").reshape(-1)  # a content id's ring point: its first 8 bytes

        def hex_id(k: int) -> str:
            return bytes(every[k]).hex()

        ring = self.peers.ring()
        r = min(self.peers.replication_factor, len(ring))
        w = self.peers.quorum(r)
        wave1, wave2 = self._waves(ring.placement_groups_by_point(points, r), w)
        members = self.peers.members()
        copies = np.zeros(len(every), dtype=np.int32)
        wrong: list[tuple[int, str, int]] = []  # (row of the chunk, server, the CRC it holds)

        def record(server: str, here: np.ndarray, held: Held) -> None:
            present, crc, raw_copy = held
            if crc is not None and raw_copy is not None:
                # A raw copy with another CRC than a raw manifest entry: the manifest describes bytes no server holds.
                bad = present & raw_copy & is_raw[here] & (crc != crcs[here])
                if bad.any():
                    k = int(np.argmax(bad))
                    wrong.append((int(here[k]), server, int(crc[k])))
                    present = present & ~bad
            copies[here[present]] += 1

        # Each chunk is first asked of W of its replicas (this server's store first, then the others
        # in turn), a third fewer lookups than asking all R: the servers share two cores with the
        # pushes and Raft. The other replicas are asked only for the chunks still short of W: a
        # replica once it has answered all it was asked (every replica, once all have answered);
        # and after HEDGE_S plus a share per id, the replicas sharing the chunks of one that has not
        # answered a single batch, so a replica that is down or cut off costs that wait, not its
        # deadline. Batches of at most HAS_BATCH ids, several at once: half a million ids in one
        # message would pass the message limit and the deadline, and one lookup that long in the
        # local store would hold the GIL from this server's Raft ticks. A batch that fails counts as
        # absent; the others still count.
        pool = ThreadPoolExecutor(max_workers=self.max_parallel)
        try:
            pending: dict[Future[Held], tuple[str, np.ndarray]] = {}

            def submit(wave: dict[str, np.ndarray]) -> None:
                for server, here in wave.items():
                    for start in range(0, len(here), HAS_BATCH):
                        rows = here[start : start + HAS_BATCH]
                        pending[pool.submit(self._present_on, members.get(server), server, every[rows])] = (server, rows)

            submit(wave1)
            hedge_at = time.monotonic() + HEDGE_S + len(every) * HEDGE_S_PER_ID
            timer_spent = False
            answered: set[str] = set()  # servers that gave at least one real answer
            left = dict(wave2)  # rows not yet asked of each server

            def hedge(rows_wanted: np.ndarray, only: set[str] | None = None) -> None:
                out = {}
                for server, rows in list(left.items()):
                    if only is not None and server not in only:
                        continue
                    pick = rows_wanted[rows]
                    if pick.any():
                        out[server] = rows[pick]
                        left[server] = rows[~pick]
                        if not len(left[server]):
                            del left[server]
                submit(out)

            while (copies < w).any() and not wrong:
                if left:
                    busy = {server for server, _ in pending.values()}
                    ready = set(left) if not pending else {server for server in left if server in answered} - busy
                    if ready:
                        hedge(copies < w, only=ready)
                if left and not timer_spent and time.monotonic() >= hedge_at:
                    # A replica that has not answered one batch by now is down or cut off: its chunks go
                    # to the others at once; the ones it shares with replicas that answer wait for them.
                    silent = np.zeros(len(every), dtype=bool)
                    for server, rows in wave1.items():
                        if server not in answered:
                            silent[rows] = True
                    hedge((copies < w) & silent)
                    timer_spent = True
                if not pending:
                    break
                timeout = None if timer_spent or not left else max(0.0, hedge_at - time.monotonic())
                done, _ = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
                for future in done:
                    server, rows = pending.pop(future)
                    held = future.result()
                    if held[1] is not None:
                        answered.add(server)
                    record(server, rows, held)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        if wrong:
            row, server, crc = wrong[0]
            cid, want = hex_id(row), int(crcs[row])
            raise InvalidChunkError(
                cid, f"chunk {cid} of manifest {manifest_id}: the manifest says CRC32C {want:08x} but server {server} "
                     f"stores it with CRC32C {crc:08x}; the manifest does not describe the stored chunk, pack and push again",
            )
        short = np.flatnonzero(copies < w)
        if len(short):
            k = int(short[0])
            raise PreconditionFailed(
                f"{len(short)} of {len(every)} chunks of manifest {manifest_id} have not reached their write quorum "
                f"(W={w} of R={r}); e.g. chunk {hex_id(k)} is on {int(copies[k])}. Push the missing chunks again, then commit"
            )
        return VersionFacts(nbytes=parsed.raw_bytes, chunk_count=len(parsed.chunks), model=parsed.model)

    def _waves(self, groups: dict[tuple[str, ...], np.ndarray], w: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Rows to ask of each server first (W replicas per chunk: this server when it is one, then
        the others in turn by row), and the rest of each server's rows, asked only for chunks still short."""
        first: dict[str, list[np.ndarray]] = {}
        later: dict[str, list[np.ndarray]] = {}
        me = self.peers.self_id
        for placed, group in groups.items():
            others = [s for s in placed if s != me]
            if len(others) < len(placed):
                first.setdefault(me, []).append(group)
            turns = w - (len(placed) - len(others))  # copies still to ask of the others
            row = np.arange(len(group))
            for i, server in enumerate(others):
                mine = ((i - row) % len(others)) < turns
                first.setdefault(server, []).append(group[mine])
                later.setdefault(server, []).append(group[~mine])

        def merged(waves: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
            out = {server: np.sort(np.concatenate(parts)) for server, parts in waves.items()}
            return {server: rows for server, rows in out.items() if len(rows)}

        return merged(first), merged(later)

    def _present_on(self, member: MemberRecord | None, server: str, digests: np.ndarray) -> Held:
        n = len(digests)
        if server == self.peers.self_id:
            return self.local.held(hex_ids(digests), claim=True)  # the store is keyed by hex ids
        if member is None:
            return np.zeros(n, dtype=bool), None, None
        # A batch answered without CRCs (a server from before with_crc) counts its copies as not
        # raw: present, never compared (record); the CRC check holds for the batches that said.
        return self._ask(member, digests)

    def _ask(self, member: MemberRecord, digests: np.ndarray) -> Held:
        n = len(digests)
        absent = np.zeros(n, dtype=bool)
        request = pb.HasChunksRequest(packed_ids=digests.tobytes(), claim=True, with_crc=True)
        deadline = time.monotonic() + self.peer_timeout_s
        try:
            # One deadline for both tries (PeerSet.call retries UNAVAILABLE on a fresh channel).
            reply = self.peers.call(member, lambda c: c.stub.HasChunks(request, timeout=max(0.001, deadline - time.monotonic())))
        except grpc.RpcError:
            return absent, None, None  # an unreachable replica holds nothing we can count on
        if len(reply.packed_present) == n:
            present = np.frombuffer(reply.packed_present, np.uint8).astype(bool)
            if len(reply.packed_crc32c) == 4 * n and len(reply.packed_raw) == n:
                return present, np.frombuffer(reply.packed_crc32c, "<u4").astype(np.uint32), \
                    np.frombuffer(reply.packed_raw, np.uint8).astype(bool)
            return present, None, None
        if n:
            # A server from before packed_ids answers nothing: ask it again with the ids as strings.
            request = pb.HasChunksRequest(ids=hex_ids(digests), claim=True, with_crc=True)
            try:
                reply = self.peers.client(member).stub.HasChunks(request, timeout=max(0.1, deadline - time.monotonic()))
            except grpc.RpcError:
                return absent, None, None
        if len(reply.present) != n:
            return absent, None, None  # not an answer to what was asked
        present = np.fromiter(reply.present, bool, n)
        if len(reply.crc32c) == len(reply.codec) == n:
            return (present, np.fromiter(reply.crc32c, np.uint32, n),
                    np.fromiter((c == "raw" for c in reply.codec), bool, n))
        return present, None, None  # a server from before with_crc: presence only


class MemberCheck:
    """AddMember's ``member_probe``: the new member must answer ServerStatus (with this server's
    peer credentials: its admin token and, under TLS, its certificate) as the server id it is
    added under, and report this cluster's id. Raises PreconditionFailed naming the address."""

    def __init__(self, peers: PeerSet, cluster_id: str, *, timeout_s: float = 3.0) -> None:
        self.peers = peers
        self.cluster_id = cluster_id
        self.timeout_s = timeout_s

    def __call__(self, member: MemberRecord) -> None:
        address = member.grpc_address
        try:
            status = _server_status(self.peers, address, self.timeout_s)
        except ValueError as exc:
            raise PreconditionFailed(f"new member {member.server_id}: its address {address!r} is not usable ({exc})") from None
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNAVAILABLE"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise PreconditionFailed(
                f"new member {member.server_id} at {address} does not answer ServerStatus ({code}: {str(details)[:200]}); "
                "start it with this cluster's secret and tokens, check that this server can reach that address, then add it"
            ) from None
        if status.server_id != member.server_id:
            raise PreconditionFailed(f"the server at {address} is {status.server_id!r}, not {member.server_id!r}: "
                                     "add it under its own id, or fix the address")
        theirs = status.extra.get(CLUSTER_ID_KEY, "")
        if not hmac.compare_digest(theirs.encode(), self.cluster_id.encode()):
            raise PreconditionFailed(
                f"new member {member.server_id} at {address} runs cluster id {theirs[:40] or '(none)'}, this cluster's is "
                f"{self.cluster_id}: start it with this cluster's --cluster-secret-file and --vnodes"
            )


def _server_status(peers: PeerSet, address: str, timeout_s: float) -> pb.ServerStatusReply:
    """ServerStatus of the server at ``address``, asked with this server's peer credentials.
    Raises ValueError for an unusable address, grpc.RpcError when it does not answer."""
    client = ParamServerClient(replace(peers.client_config(address), timeout_s=timeout_s))
    try:
        return client.server_status()
    finally:
        client.close()


def reported_cluster_id(peers: PeerSet, address: str, *, timeout_s: float = 3.0) -> str | None:
    """The cluster id the server at ``address`` reports in ServerStatus; None when it does not
    answer or reports none (a server from before the id)."""
    try:
        return _server_status(peers, address, timeout_s).extra.get(CLUSTER_ID_KEY, "") or None
    except (ValueError, grpc.RpcError):
        return None


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
                    if not isinstance(item, ChunkRecord):
                        break  # MISSING / CORRUPT there
                    data = bytes(item.data)  # a read's ChunkRecord already holds bytes: no copy
                    self.local.validate_incoming(item.id, data, item.codec, item.raw_size, item.crc32c)
                    return StoredChunk(item.id, data, item.codec, item.raw_size, item.crc32c)
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


__all__ = ["MemberCheck", "MembersFn", "ParamServerClient", "PeerSet", "QuorumVersionCheck", "ReplicaFetcher",
           "cluster_blob_fetcher"]
