"""The worker's view of the cluster: members, ring, tag resolution and verified chunk reads.

``ClusterClient`` learns the members and the placement ring from any seed, reads each chunk from
one of its replicas in coalesced GetChunks streams (many ids per call, grouped per server), fails
over to another replica on UNAVAILABLE, DATA_LOSS, a timeout or bytes that fail verification
against the manifest, and reports corrupt replicas. Tag resolutions pass the monotonic-read guard.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from chunking.errors import ManifestError
from chunking.manifest import ChunkRef, Manifest
from paramserver.bulkclient import BulkPool
from paramserver.client import ClientConfig, ParamServerClient
from paramserver.proto import pb
from paramserver.ring import Ring, RingConfig, replication_and_quorum
from worker.config import ClusterClientConfig
from worker.errors import (
    ClusterUnavailable,
    ManifestUnavailable,
    ModelNotFound,
    StaleRead,
    WorkerError,
)
from worker.fetch import RETRYABLE, VERIFY_MODES, ChunkFetch, FetchStats, OnChunk

BULK_DOWN_S = 30.0  # after a bulk failure, that address is read over GetChunks this long
from worker.monotonic import MonotonicReads, Resolution
from worker.replicas import ReplicaSelector

@dataclass(frozen=True)
class Member:
    server_id: str
    address: str
    zone: str = ""
    up: bool = True
    bulk_address: str = ""  # the server's plain-TCP bulk read port (paramserver.bulk); "" when none


@dataclass(frozen=True)
class VersionInfo:
    """A resolved model version (the wire's Version plus where it came from)."""

    model: str
    number: int
    manifest_id: str
    clock: dict[str, int]
    commit_index: int = 0
    server: str = ""
    tag: str = ""


def _default_worker_id() -> str:
    return f"worker-{socket.gethostname()}-{os.getpid()}"


def _parse_seeds(seeds: str | Sequence[str]) -> list[str]:
    items = seeds.split(",") if isinstance(seeds, str) else list(seeds)
    out = [s.strip() for s in items if s and s.strip()]
    if not out:
        raise ClusterUnavailable("no seed address given: pass --cluster HOST:PORT[,HOST:PORT...]")
    return out


class ClusterClient:
    """Thread-safe; one per worker process. Close it (or use ``with``) to free channels and threads."""

    def __init__(self, seeds: str | Sequence[str], token: str | None = None, config: ClusterClientConfig | None = None,
                 *, bulk: bool = True, verify: str = "crc") -> None:
        """``bulk``: read chunk bytes over the servers' bulk ports when they advertise one (GetChunks
        otherwise and on any bulk failure). ``verify``: "crc" checks every chunk's size and CRC32C
        from the manifest (authentic: the manifest is checked by its content id); "content" also
        checks each chunk's BLAKE3/SHA-256 content id (~0.4 ns/B more)."""
        if verify not in VERIFY_MODES:
            raise WorkerError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        config = config or ClusterClientConfig()
        if token is not None:
            from dataclasses import replace
            config = replace(config, token=token)
        self.config = config.validate()
        self.worker_id = config.worker_id or _default_worker_id()
        self.seeds = _parse_seeds(seeds)
        self.selector = ReplicaSelector(config.ewma_alpha, config.down_backoff_s)
        self.monotonic = MonotonicReads(config.monotonic_path, allow_rollback=config.allow_rollback)
        self.stats = FetchStats()
        self.corrupt_reports_sent = 0  # ReportCorrupt calls a server accepted
        self._lock = threading.Lock()
        self._clients: dict[str, ParamServerClient] = {}
        self._members: dict[str, Member] = {}
        self._by_address: dict[str, str] = {}
        self._ring: Ring | None = None
        self._r = 1
        self._leader: str = ""
        self._term = 0
        self._refreshed_at = -1e9
        self._pool = ThreadPoolExecutor(max_workers=config.max_streams, thread_name_prefix="paramworker-fetch")
        self.verify = verify
        # Connections to bulk ports, pooled; an address that failed is left alone for a while.
        self.bulk: BulkPool | None = BulkPool(self.config.token, down_for_s=BULK_DOWN_S, io_timeout_s=self.config.call_timeout_s) if bulk else None
        self._side = ThreadPoolExecutor(max_workers=2, thread_name_prefix="paramworker-report")
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._side.shutdown(wait=True, cancel_futures=True)
        if self.bulk is not None:
            self.bulk.close()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server(self, address: str) -> ParamServerClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = ParamServerClient(ClientConfig(address, token=self.config.token, timeout_s=self.config.call_timeout_s))
                self._clients[address] = client
            return client

    # ------------------------------------------------------------ membership

    def refresh(self, force: bool = True) -> None:
        """Re-read members, leader and ring from the first server that answers."""
        if not force and time.monotonic() - self._refreshed_at < self.config.refresh_interval_s:
            return
        errors: list[str] = []
        for address in self._metadata_order():
            try:
                info = self.server(address).cluster_info()
            except grpc.RpcError as exc:
                errors.append(f"{address}: {exc.code().name} {exc.details()}")
                continue
            self._apply_info(info)
            return
        raise ClusterUnavailable(
            f"no server of the cluster answered ClusterInfo ({'; '.join(errors)}); check --cluster addresses and that servers run"
        )

    def _apply_info(self, info: pb.ClusterInfoReply) -> None:
        members = {m.server_id: Member(m.server_id, m.grpc_address, m.zone, m.state == "up", m.bulk_address) for m in info.members}
        if not members:
            raise ClusterUnavailable(f"server {info.server_id} reports no members; the cluster is not initialised yet")
        up = {sid: m.zone for sid, m in members.items() if m.up}
        ring = Ring(up, RingConfig(vnodes=info.ring.vnodes or 128))
        with self._lock:
            self._members = members
            self._by_address = {m.address: sid for sid, m in members.items()}
            self._ring = ring
            self._r = replication_and_quorum(int(info.ring.replication_factor or 3), None, len(up))[0]
            self._leader = info.leader_id
            self._term = int(info.term)
            self._refreshed_at = time.monotonic()

    def _ensure_ring(self) -> Ring:
        if self._ring is None or time.monotonic() - self._refreshed_at >= self.config.refresh_interval_s:
            try:
                self.refresh()
            except ClusterUnavailable:
                if self._ring is None:
                    raise
        assert self._ring is not None
        return self._ring

    def members(self) -> dict[str, Member]:
        self._ensure_ring()
        with self._lock:
            return dict(self._members)

    @property
    def leader(self) -> str:
        return self._leader

    def replicas(self, chunk_id: str) -> list[str]:
        """Server ids holding ``chunk_id`` per the ring, primary first."""
        ring = self._ensure_ring()
        return ring.replicas(chunk_id, self._r)

    def _address(self, server_id: str) -> str:
        with self._lock:
            m = self._members.get(server_id)
        if m is None:
            raise ClusterUnavailable(f"server {server_id} is not a member any more; refresh the cluster view")
        return m.address

    def _bulk_address(self, server_id: str) -> str:
        with self._lock:
            m = self._members.get(server_id)
        return m.bulk_address if m is not None else ""

    def _name(self, address: str) -> str:
        return self._by_address.get(address, address)

    def _metadata_order(self) -> list[str]:
        """Addresses to ask for metadata: the seeds in the order given (a worker's nearby servers),
        then the other members; servers recently seen down go last."""
        with self._lock:
            members = [m.address for m in self._members.values() if m.up]
        out: list[str] = []
        for a in self.seeds + members:
            if a and a not in out:
                out.append(a)
        live = [a for a in out if not self.selector.is_down(self._name(a))]
        return live + [a for a in out if a not in live]

    def _leader_address(self) -> str | None:
        with self._lock:
            m = self._members.get(self._leader)
        return m.address if m is not None else None

    # ------------------------------------------------------------ metadata

    def _unary(self, what: str, call: Callable[[ParamServerClient], object], order: Iterable[str] | None = None) -> tuple[object, str]:
        errors: list[str] = []
        for address in order if order is not None else self._metadata_order():
            try:
                return call(self.server(address)), address
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND:
                    raise ModelNotFound(f"{what}: {exc.details()}; check the name with 'paramctl ls'") from None
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise WorkerError(f"{what}: {exc.details()}; pass --token or set PARAMS_READ_TOKEN") from None
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise WorkerError(f"{what}: {exc.details()}") from None
                errors.append(f"{address}: {code.name} {exc.details()}")
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.selector.mark_down(self._name(address))
        raise ClusterUnavailable(f"{what}: no server answered ({'; '.join(errors)}); check that the cluster is up")

    def resolve(self, model: str, tag: str) -> VersionInfo:
        """The version ``model:tag`` points at, never older than one resolved before (monotonic reads).

        A stale answer is refused and the next server asked; if every server is stale the leader
        is asked for a linearizable read; if that is stale too, ``StaleRead`` is raised.
        """
        stale: list[str] = []
        errors: list[str] = []
        order = self._metadata_order()
        attempts = [(a, False) for a in order]
        last = self._leader_address() or (order[0] if order else None)
        if last:
            attempts.append((last, True))  # a linearizable read, confirmed by the leader
        for address, linearizable in attempts:
            try:
                reply = self.server(address).resolve_tag(model, tag, linearizable=linearizable)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise ModelNotFound(f"{model}:{tag}: {exc.details()}") from None
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise WorkerError(f"{model}:{tag}: {exc.details()}; pass --token or set PARAMS_READ_TOKEN") from None
                errors.append(f"{address}: {exc.code().name}")
                continue
            res = self._resolution(model, tag, reply, address)
            verdict = self.monotonic.check(res)
            if verdict.accepted:
                try:
                    self.monotonic.accept(res)
                except StaleRead as exc:  # another thread recorded something newer meanwhile
                    stale.append(str(exc))
                    continue
                v = reply.version
                return VersionInfo(model, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index), address, tag)
            stale.append(verdict.reason)
        if stale:
            raise StaleRead(
                f"every server answered {model}:{tag} with an older version than this worker already saw: "
                + " | ".join(stale[:3]) + ". A partitioned or lagging server cannot roll the worker back; retry once the cluster heals"
            )
        raise ClusterUnavailable(f"resolving {model}:{tag}: no server answered ({'; '.join(errors)})")

    def _resolution(self, model: str, tag: str, reply: pb.VersionReply, address: str) -> Resolution:
        v = reply.version
        return Resolution(model, tag, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index),
                          reply.read.server_id or address)

    def version(self, model: str, number: int) -> VersionInfo:
        reply, address = self._unary(f"{model}@{number}", lambda c: c.get_version(model, number))
        assert isinstance(reply, pb.VersionReply)
        v = reply.version
        return VersionInfo(model, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index), address)

    def manifest(self, manifest_id: str) -> Manifest:
        """The manifest named ``manifest_id``, proven by its content id; tries every server."""
        errors: list[str] = []
        for address in self._metadata_order():
            try:
                reply = self.server(address).get_manifest(manifest_id=manifest_id)
                return Manifest.from_bytes(reply.data, expected_id=manifest_id)
            except grpc.RpcError as exc:
                errors.append(f"{address}: {exc.code().name} {exc.details()}")
            except ManifestError as exc:
                errors.append(f"{address}: {exc}")
                self._report_async([manifest_id], self._name(address), f"manifest failed verification: {exc}")
        raise ManifestUnavailable(
            f"manifest {manifest_id} could not be read intact from any server ({'; '.join(errors)}); "
            "check the servers or re-push the version"
        )

    # ------------------------------------------------------------ heat

    def get_heat(self, model: str, version: int) -> list[tuple[int, int, int]] | None:
        """Aggregated heat entries ``(index, count, first_access_order)`` from the first server that has any."""
        for address in self._metadata_order():
            try:
                reply = self.server(address).get_heat(model, version)
            except grpc.RpcError:
                continue
            if reply.reports and reply.entries:
                return [(e.chunk_index, e.count, e.first_access_order) for e in reply.entries]
        return None

    def report_heat(self, model: str, version: int, entries: Sequence[tuple[int, int, int]]) -> int:
        """Send a heat report to every up member (servers aggregate in memory, each on its own, so
        any of them can answer GetHeat). Best effort; returns how many accepted it."""
        if not entries:
            return 0
        ok = 0
        for m in self.members().values():
            if not m.up:
                continue
            try:
                self.server(m.address).report_heat(model, version, self.worker_id, entries)
                ok += 1
            except grpc.RpcError:
                continue
        return ok

    # ------------------------------------------------------------ corruption

    def report_corrupt(self, chunk_ids: Sequence[str], server_id: str, reason: str) -> bool:
        """Tell the replica that served bad bytes (so it re-verifies and queues a repair)."""
        order = []
        try:
            order.append(self._address(server_id))
        except ClusterUnavailable:
            pass
        order += [a for a in self._metadata_order() if a not in order]
        for address in order:
            try:
                self.server(address).report_corrupt(list(chunk_ids), server_id, self.worker_id, reason[:500])
                with self._lock:
                    self.corrupt_reports_sent += 1
                return True
            except grpc.RpcError:
                continue
        return False

    def _report_async(self, chunk_ids: Sequence[str], server_id: str, reason: str) -> None:
        if not self._closed:
            try:
                self._side.submit(self.report_corrupt, list(chunk_ids), server_id, reason)
            except RuntimeError:
                pass

    # ------------------------------------------------------------ chunks

    def fetch(
        self,
        refs: Sequence[ChunkRef],
        on_chunk: OnChunk,
        *,
        algorithm: str = "blake3",
        tensors_of: Callable[[ChunkRef], Sequence[str]] | None = None,
    ) -> FetchStats:
        """Fetch and verify ``refs`` (distinct ids, taken from a trusted manifest), in order.

        ``on_chunk(ref, raw, server_id)`` runs on a fetch thread with the verified raw bytes, as soon
        as each chunk arrives; ``raw`` may be a view of a receive buffer that is reused once the
        call returns, so copy what must outlive it. Raises ChunkDataLoss / ChunkUnavailable naming the first chunk that
        no replica could serve; an exception from ``on_chunk`` aborts the fetch and is re-raised.
        """
        return ChunkFetch(self, refs, on_chunk, algorithm, tensors_of).run()


__all__ = ["ClusterClient", "FetchStats", "Member", "VersionInfo", "RETRYABLE"]
