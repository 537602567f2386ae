"""``ClusterClient``: the one client session every user path goes through, for reads and writes.

``paramctl``, ``push``, ``pull``, ``paramworker load`` and ``serve``, the demo, the drills and the
benchmarks all reach a cluster through this: one cluster view (seeds, ClusterInfo, ring, leader,
refresh, leader failover: ``paramserver.client.cluster_view``, the session's internal part), one
tag resolution with monotonic reads, the one manifest reader and its cache
(``paramserver.client.manifests``), the writes through the leader (``paramserver.client.writes``:
head, commit, tag moves), and one chunk-fetch engine (``paramserver.client.fetch``) over the bulk
and gRPC transports, verifying each chunk as the mode asks. ``push`` sends its chunks through the
session's view (``push_sender``).
"""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import grpc

from chunking.chunk_table import ChunkRows
from chunking.manifest import Manifest
from paramserver.client.cluster_view import RETRYABLE, ClusterOptions, ClusterView, start_background
from paramserver.client.config import ClientSettings, resolve_settings
from paramserver.client.errors import (
    ClientClosed,
    ClientError,
    ClusterUnreachable,
    ConfigError,
    NotFound,
    StaleRead,
    TransferError,
    from_rpc,
    rpc_code,
    rpc_details,
)
from paramserver.client.fetch import PEER_LANES, ChunkSink, EngineOptions, FetchEngine, FetchStats
from paramserver.client.fetch_plan import Wants, is_peer
from paramserver.client.manifests import read_manifest
from paramserver.client.monotonic import MonotonicReads, Resolution
from paramserver.client.refs import ModelRef
from paramserver.client.rpc import ParamServerClient
# SessionConfig and VersionInfo: re-exported, the session's value types
from paramserver.client.session_config import READ_FALLBACK, READ_LEADER, READ_MEMBER, SessionConfig, VersionInfo
from paramserver.client.transport import ClusterTransport
from paramserver.client.verify import VERIFY_MODES, Verifier
from paramserver.client.writes import fetch_manifest, head_version, write_once
from paramserver.wire.heat_entries import HeatArrays, report_request
from paramserver.wire.limits import DEFAULT_MAX_MESSAGE_BYTES, HEAT_ENTRIES_PER_CALL
from paramserver.wire.proto import pb

T = TypeVar("T")
log = logging.getLogger(__name__)

# A heat report refused with one of these is sent again after each delay (a lagging follower, a busy one).
HEAT_RETRY_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
HEAT_RETRY_DELAYS_S = (0.2, 0.5, 1.0)
# A metadata read refused with one of these fails at once: no other server would answer otherwise.
FINAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT})


def _default_worker_id() -> str:
    return f"client-{socket.gethostname()}-{os.getpid()}"


class ClusterClient:
    """Thread-safe; one per process is enough. Close it (or use ``with``) to free channels.

    ``seeds``: any members' gRPC addresses. ``verify``: "crc" (size and CRC32C from the manifest,
    no BLAKE3) or "content" (also each chunk's content id, once). ``bulk``: read chunk bytes over
    the servers' bulk ports when they advertise one (never with TLS), GetChunks otherwise.
    ``settings`` (``paramserver.client.config.ClientSettings``) gives all of these, and TLS; without
    it or ``cluster``, what is not given here comes as for the CLIs (:meth:`from_config`).
    """

    def __init__(self, seeds: str | Sequence[str] | None = None, token: str | None = None,
                 config: SessionConfig | None = None, *, bulk: bool = True, verify: str | None = None,
                 settings: ClientSettings | None = None, cluster: ClusterOptions | None = None) -> None:
        config = (config or SessionConfig()).validate()
        if verify is not None and verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
        self.settings = settings
        if cluster is None:
            if settings is None:
                settings = self.settings = resolve_settings(seeds, token=token, verify=verify)
            cluster = settings.cluster_options(write=False)
            token = token if token is not None else cluster.token
            bulk = bulk and settings.bulk
            verify = verify or settings.verify
        verify = verify or "crc"
        if token is not None and cluster.token != token:
            cluster = replace(cluster, token=token)
        cluster = replace(cluster, timeout_s=config.call_timeout_s).validate()
        self.options = cluster
        self.config = config
        self.seeds = cluster.seeds
        self.verify = verify
        self.worker_id = config.worker_id or _default_worker_id()
        self.monotonic = MonotonicReads(config.monotonic_path, allow_rollback=config.allow_rollback)
        self.stats = FetchStats()
        self.corrupt_reports_sent = 0
        self._lock = threading.Lock()
        self._view: ClusterView | None = None
        self._spare: dict[str, ParamServerClient] = {}
        self._refreshed_at = -1e9
        self._hot: dict[str, tuple[str, ...]] = {}
        self._hot_at = -1.0  # never asked
        self._hot_busy = False
        self._hot_first = threading.Event()  # set once the first answer (or its failure) is in
        self.transport = ClusterTransport(
            self._members, token=cluster.token, tls=cluster.tls, tls_ca=cluster.tls_ca,
            tls_cert=getattr(cluster, "tls_cert", None), tls_key=getattr(cluster, "tls_key", None), bulk=bulk,
            bulk_down_s=config.bulk_down_s, max_message_bytes=cluster.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES,
            get_message_bytes=config.get_message_bytes, io_timeout_s=config.call_timeout_s,
        )
        self.engine = FetchEngine(
            self.transport, Verifier(verify),
            options=EngineOptions(max_read_bytes=config.max_read_bytes, call_timeout_s=config.call_timeout_s,
                                  min_bytes_per_s=config.min_stream_bytes_per_s),
            reads_per_server=self._lanes, report=self._report_bad,
        )
        self._closed = False

    @classmethod
    def from_config(cls, path: str | os.PathLike[str] | None = None, *, config: SessionConfig | None = None,
                    **overrides: Any) -> ClusterClient:
        """The CLIs' settings: ``overrides`` (``cluster=``, ``token=``, ``tls_ca=``, ... any ClientSettings
        field) > environment > the config file ``path`` (default ``$PARAMS_CONFIG``) > defaults."""
        return cls(settings=resolve_settings(config_file=path, **overrides), config=config)

    @classmethod
    def for_options(cls, cluster: ClusterOptions) -> ClusterClient:
        """A session on ``cluster`` as given, its unary timeout included (push and paramctl:
        their timeouts and notices are the options', not SessionConfig's default)."""
        cluster.validate()
        return cls(cluster=cluster, config=SessionConfig(call_timeout_s=cluster.timeout_s))

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        # Background work (a load's heat report, a corrupt report) may still call server() or
        # view() while this runs: the lock hands each map over once, and later calls get ClientClosed.
        with self._lock:
            if self._closed:
                return
            self._closed = True
            view, self._view = self._view, None
            spares, self._spare = list(self._spare.values()), {}
        self.transport.close()
        if view is not None:
            view.close()
        for spare in spares:
            spare.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed("this ClusterClient is closed; make a new one (or keep it open while loads run)")

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ membership

    def view(self) -> ClusterView:
        """The cluster view, connected on first use and refreshed every ``refresh_interval_s``."""
        with self._lock:
            self._check_open()
            view = self._view
            stale = time.monotonic() - self._refreshed_at >= self.config.refresh_interval_s
        if view is None:
            view = ClusterView.connect(self.options)
            with self._lock:
                if self._closed:
                    view.close()
                    self._check_open()
                if self._view is None:
                    self._view, self._refreshed_at = view, time.monotonic()
                else:
                    view.close()
                    view = self._view
            return view
        if stale:
            try:
                view.refresh(deadline_s=self.options.discovery_timeout_s)
            except TransferError:
                pass  # keep the last view; calls fail over on their own
            with self._lock:
                self._refreshed_at = time.monotonic()
        return view

    def refresh(self, force: bool = True) -> None:
        if force:
            with self._lock:
                self._refreshed_at = -1e9
        self.view()

    def _members(self) -> dict[str, pb.Member]:
        # The transport asks this per read, under the fetch's lock: the current view, never a
        # refresh (fetch() refreshes a stale view once, before the fetch starts).
        with self._lock:
            view = self._view
        return (view or self.view()).members

    def members(self) -> dict[str, pb.Member]:
        return dict(self._members())

    @property
    def leader(self) -> str:
        return self.view().info.leader_id

    def replicas(self, chunk_id: str) -> list[str]:
        return self.view().replicas(chunk_id)

    def server(self, address: str) -> ParamServerClient:
        with self._lock:
            view = self._view
        if view is not None:
            return view.client(address)
        with self._lock:  # no view yet (no seed answered ClusterInfo): a client of our own
            self._check_open()
            found = self._spare.get(address)
            if found is None:
                found = self._spare[address] = ParamServerClient(self.options.client_config(address))
            return found

    def _lanes(self, server: str) -> int:
        if is_peer(server):  # a worker's peer port: few connections (a fleet on one host shares its per-source cap)
            return PEER_LANES
        if self.transport.uses_bulk(server):
            return self.config.bulk_streams_per_server
        return self.config.grpc_streams_per_server

    def _metadata_order(self) -> list[str]:
        """Addresses to ask for metadata: the seeds in the order given (a worker's nearby
        servers), then the other members that are up. With no view (no seed answered
        ClusterInfo) the seeds alone: each call then fails or succeeds on its own."""
        try:
            view = self.view()
        except ClientError:
            return list(self.seeds)
        members = [m.grpc_address for m in view.members.values() if m.state == "up"]
        return list(dict.fromkeys([*self.seeds, *members]))

    def _leader_first(self) -> list[str]:
        """``_metadata_order`` with the leader (when known) moved to the front."""
        order = self._metadata_order()
        leader = self._leader_address()
        return [leader, *(a for a in order if a != leader)] if leader else order

    def _leader_address(self) -> str | None:
        try:
            view = self.view()
        except ClientError:
            return None
        return view.info.leader_grpc_address or None

    # ------------------------------------------------------------ writes (through the leader)

    def leader_call(self, fn: Callable[[ParamServerClient], T], deadline_s: float | None = None) -> T:
        """``fn(leader client)``, following the leader through an election (``ClusterView.leader_call``)."""
        return self.view().leader_call(fn, deadline_s)

    def head_version(self, model: str) -> int | None:
        """The latest version number of ``model``, as the leader has it; None for a new model."""
        return head_version(self.view(), model)

    def manifest_of(self, model: str, version: int) -> Manifest:
        """The manifest of ``model`` v``version``, named by the leader (``manifest`` reads it)."""
        return fetch_manifest(self.view(), model, version)

    def set_tag(self, model: str, tag: str, version: int, who: str = "") -> pb.TagReply:
        return write_once(self.view(), lambda c: c.set_tag(model, tag, version, who=who))

    def rollback_tag(self, model: str, tag: str, who: str = "") -> pb.TagReply:
        return write_once(self.view(), lambda c: c.rollback_tag(model, tag, who=who))

    def delete_tag(self, model: str, tag: str, who: str = "") -> pb.DeleteTagReply:
        return write_once(self.view(), lambda c: c.delete_tag(model, tag, who=who))

    # ------------------------------------------------------------ metadata

    def _ask(self, what: str, call: Callable[[ParamServerClient], T], order: Iterable[str] | None = None) -> tuple[T, str]:
        """``call`` on the first server that answers (NOT_FOUND, a bad token and bad input end it);
        when every one refused (catching up, an election), at the leader (``_leader_read``)."""
        errors: list[str] = []
        for address in order if order is not None else self._metadata_order():
            try:
                return call(self.server(address)), address
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
                    raise from_rpc(exc, what) from None
                errors.append(f"{address}: {code.name}")
        if self._view is not None:  # without a view no seed answered: asking for a leader again would only wait
            got = self._leader_read(what, call)
            if not isinstance(got, str):
                return got
            errors.append(got)
        raise ClusterUnreachable(f"{what}: no server answered ({'; '.join(errors)}); check that the cluster is up")

    def _leader_read(self, what: str, call: Callable[[ParamServerClient], T]) -> tuple[T, str] | str:
        """``(call(leader), its address)``, following the leader through an election for up to
        ``leader_read_wait_s``; or, when no leader answered, why. NOT_FOUND and the like raise."""
        def at(client: ParamServerClient) -> tuple[T, str]:
            return call(client), client.address

        view = self._view_within(self.config.leader_read_wait_s)
        if isinstance(view, str):
            return view
        try:
            return view.leader_call(at, self.config.leader_read_wait_s)
        except ClusterUnreachable as exc:
            return str(exc)
        except grpc.RpcError as exc:
            if rpc_code(exc) == grpc.StatusCode.NOT_FOUND or rpc_code(exc) in FINAL_CODES:
                raise from_rpc(exc, what) from None
            return f"the leader: {rpc_code(exc).name} ({rpc_details(exc)[:200]})"

    def _view_within(self, wait_s: float) -> ClusterView | str:
        """The view, asked again for up to ``wait_s`` while the cluster forms (a member answers, none
        is up yet); else why not (no seed answered, a bad token: the members' answers say so)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.view()
            except ClusterUnreachable as exc:  # no seed answered at all: fail as fast as before
                return str(exc)
            except TransferError as exc:
                if exc.code not in RETRYABLE or time.monotonic() >= deadline:
                    return str(exc)
            time.sleep(0.1)

    def resolve(self, model: str, tag: str, *, linearizable: bool | None = None) -> VersionInfo:
        """The version ``model:tag`` points at, never older than one resolved before (monotonic reads).

        ``linearizable`` (default: the first resolution of ``model:tag``, nothing in monotonic memory)
        asks the leader, followed through an election for up to ``leader_read_wait_s``: every tag move
        acknowledged before the call is seen; a member's answer only when no leader answers (logged,
        and said in ``VersionInfo.read``). Else the members in order (each answers only while in sync,
        a heartbeat behind at most), an answer older than one seen refused, then the leader; then ``StaleRead``.
        """
        started = time.monotonic()
        at_leader = self.monotonic.seen(model, tag) is None if linearizable is None else linearizable
        stale: list[str] = []
        got = self._resolve_at_leader(model, tag, stale) if at_leader else None
        if isinstance(got, VersionInfo):
            return replace(got, resolve_s=time.monotonic() - started)
        why = got or ""  # why no leader answered, if one was asked
        # no leader answered (lost quorum, client cut off): each member's own state (a local read), marked below
        info = self._resolve_at_members(model, tag, stale, [why] if why else [], leader_last=not at_leader, local=bool(why))
        if why and info.read == READ_MEMBER:
            log.warning("%s resolved to v%d by member %s without the leader (%s): a tag move of the last moments may be "
                        "missing; it is followed once a leader answers", f"{model}:{tag}", info.number, info.server, why)
            info = replace(info, read=READ_FALLBACK)
        return replace(info, resolve_s=time.monotonic() - started)

    def _resolve_at_leader(self, model: str, tag: str, stale: list[str]) -> VersionInfo | str | None:
        """The leader's answer once monotonic reads accept it; why no leader answered; or None (stale: why added to ``stale``)."""
        got = self._leader_read(f"{model}:{tag}", lambda c: c.resolve_tag(model, tag, linearizable=True))
        if isinstance(got, str):
            return got
        info, refused = self._judged(model, tag, *got, READ_LEADER)
        if info is None:
            stale.append(refused)
        return info

    def _judged(self, model: str, tag: str, reply: pb.VersionReply, address: str, read: str) -> tuple[VersionInfo | None, str]:
        """The resolution ``reply`` as a VersionInfo once monotonic reads accept it; else (None, why not)."""
        v = reply.version
        res = Resolution(model, tag, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index),
                         reply.read.server_id or address)
        try:
            self.monotonic.accept(res)
        except StaleRead as exc:  # older than one seen (perhaps recorded by another thread meanwhile)
            return None, str(exc)
        return VersionInfo(model, res.version, v.manifest_id, dict(v.clock), res.commit_index, address, tag, read=read), ""

    def _resolve_at_members(self, model: str, tag: str, stale: list[str], errors: list[str], *, leader_last: bool,
                            local: bool = False) -> VersionInfo:
        """Serializable resolution at the members in order (``local``: their own state); then (``leader_last``) the leader."""
        what = f"{model}:{tag}"
        missing: TransferError | None = None
        for address in self._metadata_order():
            try:
                reply = self.server(address).resolve_tag(model, tag, local=local)
            except grpc.RpcError as exc:
                code = rpc_code(exc)
                if code == grpc.StatusCode.NOT_FOUND:  # a lagging member: only the leader's linearizable answer decides
                    missing = from_rpc(exc, what)
                    continue
                if code in FINAL_CODES:
                    raise from_rpc(exc, what) from None
                errors.append(f"{address}: {code.name}")  # UNAVAILABLE: down, or catching up (it says why)
                continue
            info, refused = self._judged(model, tag, reply, address, READ_MEMBER)
            if info is not None:
                return info
            stale.append(refused)
        if leader_last:
            got = self._resolve_at_leader(model, tag, stale)
            if isinstance(got, VersionInfo):
                return got
            errors += [got] if got else []
        if missing is not None and not stale:
            raise missing
        if stale:
            raise StaleRead(
                f"every server answered {what} with an older version than this client already saw: "
                + " | ".join(stale[:3]) + ". A partitioned or lagging server cannot roll it back; retry once the cluster heals"
            )
        raise ClusterUnreachable(f"resolving {what}: no server answered ({'; '.join(errors)}); check that the cluster is up")

    def version(self, model: str, number: int, *, linearizable: bool = False) -> VersionInfo:
        leader = self._leader_address()
        order = self._leader_first() if linearizable else self._metadata_order()
        try:
            reply, address = self._ask(f"{model}@{number}", lambda c: c.get_version(model, number, linearizable=linearizable), order)
        except NotFound:
            if linearizable or not leader:
                raise
            # A lagging member may not have applied it yet: the leader's linearizable answer decides.
            reply, address = self._ask(f"{model}@{number}", lambda c: c.get_version(model, number, linearizable=True), [leader])
        v = reply.version
        return VersionInfo(model, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index), address)

    def latest(self, model: str) -> VersionInfo:
        # The leader has applied every committed version; a follower may lag.
        reply, address = self._ask(model, lambda c: c.list_versions(model), self._leader_first())
        if not reply.versions:
            raise NotFound(f"model {model} has no versions; push one first")
        v = max(reply.versions, key=lambda x: x.number)
        return VersionInfo(model, int(v.number), v.manifest_id, dict(v.clock), int(reply.read.commit_index), address)

    def resolve_ref(self, ref: ModelRef | str, *, linearizable: bool | None = None) -> VersionInfo:
        """``MODEL:TAG`` (monotonic; linearizable the first time, see ``resolve``), ``MODEL@N`` or
        ``MODEL`` (its latest version)."""
        mref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        if mref.tag is not None:
            return self.resolve(mref.model, mref.tag, linearizable=linearizable)
        if mref.version is not None:
            return self.version(mref.model, mref.version, linearizable=bool(linearizable))
        return self.latest(mref.model)

    def manifest(self, manifest_id: str) -> Manifest:
        """The manifest named ``manifest_id``, proven by its content id: the client's one manifest
        reader (``paramserver.client.manifests``), cached for the process; the leader is asked
        first, then every other server."""
        return read_manifest(manifest_id, self._leader_first(), self.server)

    # ------------------------------------------------------------ heat and corruption

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

    def report_heat(self, model: str, version: int, entries: HeatArrays | Sequence[tuple[int, int, int]]) -> int:
        """Send a heat report to every up member (each aggregates on its own). Best effort: a member
        that refuses with a transient code is tried again a few times (bounded), since a follower
        that has not applied a just-committed version yet answers NOT_FOUND for it."""
        arrays = HeatArrays.of(entries)
        if not len(arrays):
            return 0
        # Servers refuse oversized reports (paramserver.wire.limits): slices that always fit, each
        # encoded once for every member.
        requests = [report_request(model, version, self.worker_id, arrays.part(start, start + HEAT_ENTRIES_PER_CALL))
                    for start in range(0, len(arrays), HEAT_ENTRIES_PER_CALL)]
        ok = 0
        for m in self.members().values():
            if m.state != "up":
                continue
            sent = 0  # slices already accepted by this member: a retry resends only the rest
            for delay in (*HEAT_RETRY_DELAYS_S, None):
                try:
                    for k in range(sent, len(requests)):
                        self.server(m.grpc_address).report_heat_encoded(requests[k])
                        sent = k + 1
                    ok += 1
                    break
                except grpc.RpcError as exc:
                    if delay is None or self._closed or exc.code() not in HEAT_RETRY_CODES:
                        break
                    time.sleep(delay)
        return ok

    def report_corrupt(self, chunk_ids: Sequence[str], server_id: str, reason: str) -> bool:
        """Tell the replica that served bad bytes, so it re-verifies and queues a repair."""
        member = self._members().get(server_id)
        order = [member.grpc_address] if member is not None else []
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

    def _report_bad(self, server: str, ids: tuple[str, ...], reason: str) -> None:
        if not self._closed:
            self.report_corrupt(ids, server, f"client verification failed: {reason}")

    # ------------------------------------------------------------ chunks

    def fetch(self, chunks: ChunkRows, sink: ChunkSink, *, algorithm: str = "blake3",
              tensors_of: Callable[[int], Sequence[str]] | None = None,
              with_peers: Callable[[Wants], Wants] | None = None) -> FetchStats:
        """Fetch and verify ``chunks`` (distinct ids: rows of a proven manifest's table) into ``sink``.

        Raises ChunkDataLoss / ChunkUnavailable naming the first chunk that no replica could serve
        intact; an exception from the sink aborts the fetch and is re-raised. ``tensors_of(row)``
        names a failed chunk's tensors in that error; ``with_peers(wants)`` adds the worker peers to
        ask first (paramserver.client.swarm_fetch).
        """
        view = self.view()
        members = sorted(sid for sid, m in view.members.items() if m.state == "up")
        others = sorted(sid for sid in view.members if sid not in members)
        verifier = Verifier(self.verify, algorithm)
        hot = self.hot_chunks(view) if self.config.hot_chunks else {}
        wants = view.wants(chunks, hot)
        stats = self.engine.fetch(chunks, with_peers(wants) if with_peers else wants, members + others, sink,
                                  verifier=verifier, tensors_of=tensors_of, salt=random.getrandbits(32))
        with self._lock:
            self.stats.add(stats)
        return stats

    def hot_chunks(self, view: ClusterView | None = None, *, wait: bool = True) -> dict[str, tuple[str, ...]]:
        """The hot chunks the servers advertise (id -> members with an extra copy).

        Asked of every member on a background thread whenever the last answer is older than
        ``hot_refresh_s``; a call returns the last answer at once, except that the first ask of
        this client is waited for, up to twice ``hot_timeout_s`` (``wait=False``: never), so a
        load never waits long on a member that is down or cut off."""
        with self._lock:
            if self._closed:
                return self._hot
            first = self._hot_at < 0
            started = False
            if (first or time.monotonic() - self._hot_at >= self.config.hot_refresh_s) and not self._hot_busy:
                self._hot_busy = started = True
        if started:
            try:
                start_background(self._refresh_hot, "hot-chunks-refresh", view)
            except BaseException:
                with self._lock:
                    self._hot_busy = False
                raise
        if first and wait:
            self._hot_first.wait(2 * self.config.hot_timeout_s)
        with self._lock:
            return self._hot

    def prepare_fetch(self) -> None:
        """Ask for hot chunks now, in the background, so the fetch that follows finds the answer
        (and the connections to every member that asking opened) ready instead of waiting."""
        if self.config.hot_chunks:
            self.hot_chunks(wait=False)

    def _refresh_hot(self, view: ClusterView | None) -> None:
        found: dict[str, tuple[str, ...]] = {}
        try:
            found = (view or self.view()).hot_chunks(self.config.hot_timeout_s)
        except Exception:  # noqa: BLE001 - advisory (a closed client, a member gone): no hot copies
            pass
        finally:
            with self._lock:
                self._hot, self._hot_at, self._hot_busy = found, time.monotonic(), False
            self._hot_first.set()


def client_for(cluster: ClusterClient | ClientSettings | str | Sequence[str] | None,
               token: str | None = None) -> tuple[ClusterClient, bool]:
    """``(client, owned)``: an existing client, or a new one (to be closed) for settings or seed addresses;
    what is not given (None: even the addresses) comes as for the CLIs: from PARAMS_* or PARAMS_CONFIG."""
    if isinstance(cluster, ClusterClient):
        return cluster, False
    return ClusterClient(settings=resolve_settings(cluster, token=token)), True


__all__ = ["ClientError", "ClusterClient", "SessionConfig", "VersionInfo", "client_for"]
