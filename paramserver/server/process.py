"""The paramserver process: chunk store + metadata node + gRPC service + the
background tasks (self-registration, repair, scrub, re-replication, orphan GC, hot-chunk copies).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from consensus.config import RaftConfig
from consensus.errors import MetadataError
from consensus.node import MetadataNode
from consensus.records import MemberRecord
from consensus.state import CLOCK_RULE

from paramserver.server.auth import AuthConfig
from paramserver.server.background import Periodic
from paramserver.server.bulk_port import BulkServer, BulkServerConfig
from paramserver.server.compaction import Compactor
from paramserver.server.cluster import (
    MemberCheck, PeerSet, QuorumVersionCheck, ReplicaFetcher, cluster_blob_fetcher, reported_cluster_id,
)
from paramserver.server.config import ServerConfig, is_loopback_host
from paramserver.server.data_dir import check_identity, lock_data_dir, record_identity
from paramserver.server.gc import OrphanCollector, References
from paramserver.server.heat import SAVE_INTERVAL_S, HeatAggregator, HeatSnapshots
from paramserver.server.hot_chunks import STATE_FILE, HotChunks, HotConfig
from paramserver.server.metrics import MetricsServer, ServerCollector, serve_metrics
from paramserver.server.peer_service import EXPIRE_INTERVAL_S, PeerService
from paramserver.server.repair import RepairQueue, Repairer, Scrubber, TrafficWatch
from paramserver.server.replication import ReReplicator
from paramserver.server.served_bytes import ServedBytes
from paramserver.wire.ring import RingConfig
from paramserver.server.metaservice import cluster_id
from paramserver.server.service import RunningServer, start_server
from paramserver.server.store import ChunkStore, StoreConfig

log = logging.getLogger(__name__)

# A server that sees no leader this long is told, once, how it joins a running cluster.
JOIN_HINT_AFTER_S = 15.0


@dataclass
class ParamServer:
    config: ServerConfig
    metrics_port: int | None = None
    node: MetadataNode | None = None
    store: ChunkStore | None = None
    running: RunningServer | None = None
    bulk: BulkServer | None = None
    peers: PeerSet | None = None
    hot: HotChunks | None = None
    heat: HeatSnapshots | None = None
    metrics: MetricsServer | None = None
    _tasks: list[Periodic] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _registered: threading.Event = field(default_factory=threading.Event)
    _dir_lock: int = -1  # the descriptor that holds the data dir (data_dir.lock_data_dir)
    _identity_recorded: bool = False  # raft/cluster.id names this cluster (data_dir.record_identity)
    refused: str | None = None  # why this server must not serve this cluster (serve_forever exits 2)

    def start(self) -> None:
        """Start every part; a part that fails to start stops those already started (and frees the
        data dir), so a caller that catches the error may start another server on it."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        cfg = self.config.validate()
        if cfg.insecure:
            # The one safe-default rule (wire/exposure.py): a warning per open listener, on every start.
            for gap in cfg.check_exposure(self.metrics_port) or ["nothing is open to the network (every port is loopback "
                                                                 "or has its credential)"]:
                log.warning("started with --insecure: %s", gap)
        else:
            cfg.check_exposure(self.metrics_port)
        if not cfg.insecure and cfg.read_token is None and not is_loopback_host(cfg.listen.rpartition(":")[0]):
            log.info("reads are open on %s (no read token): anyone who reaches it can read every model", cfg.listen)
        self._dir_lock = lock_data_dir(cfg.data_dir)  # before anything in it is opened
        self._identity_recorded = check_identity(cfg.data_dir / "raft", cluster_id(cfg.cluster_secret, cfg.vnodes))
        queue = RepairQueue()
        self.store = store = ChunkStore(cfg.data_dir, cache_bytes=cfg.cache_bytes, fsync=cfg.fsync, on_corrupt=queue.add,
                                         config=StoreConfig.from_extra(cfg.extra),
                                         server_id=cfg.server_id)
        self.node = node = MetadataNode(RaftConfig(
            server_id=cfg.server_id, raft_address=cfg.raft, peers=tuple(cfg.peers),
            data_dir=cfg.data_dir / "raft", secret=cfg.cluster_secret, fsync=cfg.fsync,
        ))
        node.start()

        def members() -> list[MemberRecord]:
            try:
                return list(node.members().value)
            except MetadataError:
                return []

        peers = PeerSet(cfg.server_id, members, ring_config=RingConfig(vnodes=cfg.vnodes),
                        replication_factor=cfg.replication_factor, write_quorum=cfg.write_quorum, token=cfg.admin_token,
                        tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_ca=cfg.tls_ca)
        self.peers = peers
        fetcher = ReplicaFetcher(peers, store)
        fetch_blob = cluster_blob_fetcher(store, fetcher)
        hot_config = HotConfig.from_extra(cfg.extra)
        self.hot = hot = HotChunks(hot_config, store, peers, state_path=cfg.data_dir / STATE_FILE) if hot_config.enabled else None
        self.heat = heat = HeatSnapshots(HeatAggregator(), cfg.data_dir)
        heat.restore()
        references = References(node, fetch_blob)
        rereplicator = ReReplicator(peers, store, references=references,
                                    keep=hot.extras.__contains__ if hot is not None else None)
        served = ServedBytes()  # GetChunks and the bulk port's reads: one count (ServerStatus, metrics)
        worker_peers = PeerService(cfg.server_id)  # worker-peer soft state (AnnouncePeer / FindPeers)
        self.running = start_server(cfg, store, metadata=node, repair_queue=queue, fetch_blob=fetch_blob,
                                    version_check=QuorumVersionCheck(peers, store, fetch_blob=fetch_blob),
                                    member_probe=MemberCheck(peers, cluster_id(cfg.cluster_secret, cfg.vnodes)), hot=hot,
                                    heat=heat.heat, placement=rereplicator.placement, served=served, peers=worker_peers)
        transport = "plaintext" if cfg.tls_cert is None else "TLS" if cfg.tls_ca is None else "mutual TLS"
        log.info("%s serving gRPC on %s (%s), Raft on %s; chunk writes %s", cfg.server_id, self.running.address, transport,
                 cfg.raft, ("fsynced" if cfg.fsync else "not fsynced (--no-fsync)")
                 + (", around the page cache (O_DIRECT)" if store.direct_writes else ", through the page cache"))
        if cfg.bulk_enabled:
            self.bulk = BulkServer(store, AuthConfig(cfg.admin_token, cfg.read_token), cfg.bulk_listen_address,
                                   BulkServerConfig.from_extra(cfg.extra), server_id=cfg.server_id,
                                   repair_queue=queue, on_read=hot.record_read if hot is not None else None,
                                   served=served).start()
            log.info("%s serving bulk chunk reads and writes on %s", cfg.server_id, self.bulk.address)

        threading.Thread(target=self._register_loop, name="register", daemon=True).start()
        self._tasks = [
            Periodic("repair", cfg.repair_interval_s, Repairer(store, queue, fetcher).step),
            Periodic("re-replicate", cfg.anti_entropy_interval_s, rereplicator.step),
            Periodic("compact", store.config.compact_interval_s, Compactor(store).step),
            Periodic("heat-save", SAVE_INTERVAL_S, heat.step),
            Periodic("peer-expire", EXPIRE_INTERVAL_S, worker_peers.step),  # silent workers leave the gauge too
        ]
        scrubber: Scrubber | None = None
        if cfg.scrub_bytes_per_s:
            scrubber = Scrubber(store, queue, traffic=TrafficWatch(lambda: store.traffic, cfg.scrub_quiet_s),
                                busy_fraction=cfg.scrub_busy_fraction)
            self._tasks.append(Periodic("scrub", 1.0, lambda: scrubber.step(cfg.scrub_bytes_per_s)))
        if cfg.gc_interval_s:
            gc = OrphanCollector(references, store, grace_s=cfg.orphan_grace_s, in_sync=node.in_sync)
            self._tasks.append(Periodic("orphan-gc", cfg.gc_interval_s, gc.step))
        if hot is not None:
            self._tasks.append(Periodic("hot-chunks", hot.config.interval_s, hot.step))
        for task in self._tasks:
            task.start()
        if self.metrics_port is not None:
            host = cfg.listen.rpartition(":")[0]
            # Metrics need the read token when one is set (the admin token works too); open otherwise.
            self.metrics = serve_metrics(self.metrics_port, host, ServerCollector(
                cfg.server_id, store, node, queue, lambda: len(members()), scrubber=scrubber, hot=hot, heat=heat.heat,
                served=served, peers=worker_peers),
                tokens=(cfg.read_token, cfg.admin_token) if cfg.read_token else ())

    def _register_loop(self) -> None:
        """Publish this server's member record once a leader exists; retry until it sticks."""
        assert self.node is not None
        cfg = self.config
        me = MemberRecord(cfg.server_id, self.grpc_advertise_address, cfg.raft, "up", cfg.zone, self.bulk_advertise_address,
                          CLOCK_RULE)
        delay = 0.1
        checked = False
        unverified = False  # members answered nothing: the id is recorded at a later start, once one does
        hint_at: float | None = time.monotonic() + JOIN_HINT_AFTER_S
        while not self._stopped.is_set():
            try:
                if self.node.wait_ready(1.0):
                    members = self.node.members().value
                    if not self._identity_recorded and not checked:
                        checked = True
                        self.refused, unverified = self._identity_conflict(members)
                        if self.refused is not None:
                            log.error("%s", self.refused)
                            self._stopped.set()
                            return
                    current = {m.server_id: m for m in members}.get(cfg.server_id)
                    if current is not None and current.state == "leaving":
                        me = replace(me, state="leaving")  # drained by an operator: a restart must not undo it
                    if current == me:
                        if not self._identity_recorded and not unverified:  # joined: this journal is this cluster's now
                            self._record_identity()
                        self._registered.set()
                        return
                    self.node.add_member(me)
                    log.info("%s registered as a member (%s)", cfg.server_id, me.grpc_address)
                elif hint_at is not None and time.monotonic() >= hint_at:
                    hint_at = None
                    log.warning("%s has seen no Raft leader for %.0f s. If it is new to a running cluster, add it from "
                                "a client: paramctl member add %s --grpc %s --raft %s%s", cfg.server_id, JOIN_HINT_AFTER_S,
                                cfg.server_id, me.grpc_address, cfg.raft, f" --zone {cfg.zone}" if cfg.zone else "")
            except MetadataError as exc:
                log.info("registration of %s not done yet: %s", cfg.server_id, exc)
            self._stopped.wait(delay)
            delay = min(2.0, delay * 2)

    def _identity_conflict(self, members: Sequence[MemberRecord]) -> tuple[str | None, bool]:
        """Raft proves the cluster secret, not --vnodes: a server without raft/cluster.id (a first
        start, or a data dir from before the file) asks its peers for the cluster id before it
        registers or records one, so it never serves this cluster with another ring. Returns why it
        must not serve (None: it may), and whether no other member answered (then nothing is
        recorded: the next start asks again)."""
        cfg = self.config
        others = [m for m in members if m.server_id != cfg.server_id]
        if self.peers is None or not others:
            return None, False
        mine = cluster_id(cfg.cluster_secret, cfg.vnodes)
        for m in others:
            theirs = reported_cluster_id(self.peers, m.grpc_address)
            if theirs is None:
                continue  # down, or from before the id: ask another
            if theirs == mine:
                return None, False
            return (f"{cfg.server_id} refuses to serve: member {m.server_id} reports cluster id {theirs[:12]}..., this "
                    f"server's is {mine[:12]}... (its --cluster-secret-file and --vnodes {cfg.vnodes}); start it with "
                    "the cluster's --vnodes"), False
        log.info("%s could not check its cluster id with another member (none answered); it records the id at a "
                 "later start", cfg.server_id)
        return None, True

    def _record_identity(self) -> None:
        cfg = self.config
        try:
            record_identity(cfg.data_dir / "raft", cluster_id(cfg.cluster_secret, cfg.vnodes), fsync=cfg.fsync)
            self._identity_recorded = True
        except OSError as exc:  # not fatal: the journal is unchanged; the next start tries again
            log.warning("%s could not record its cluster id in %s (%s); it is tried again at the next start",
                        cfg.server_id, cfg.data_dir / "raft", exc)

    @property
    def grpc_advertise_address(self) -> str:
        """--advertise, else the bound gRPC address (--listen with port 0 names a port only once bound)."""
        if self.config.advertise or self.running is None:
            return self.config.advertise_address
        return self.running.address

    @property
    def bulk_advertise_address(self) -> str:
        """Host of the advertised gRPC address + the bound bulk port; "" without a bulk port."""
        if self.bulk is None:
            return ""
        return f"{self.config.advertise_address.rpartition(':')[0]}:{self.bulk.port}"

    def wait_registered(self, timeout: float) -> bool:
        return self._registered.wait(timeout)

    def stop(self) -> None:
        self._stopped.set()
        for task in self._tasks:
            task.stop(timeout=5.0)
        if self.bulk is not None:
            self.bulk.stop()
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
            self.metrics = None
        if self.running is not None:
            self.running.stop(grace=1.0)
        if self.heat is not None:
            self.heat.step()  # after the last report this server took
        if self.node is not None:
            self.node.close()
        if self.peers is not None:
            self.peers.close()
        if self.store is not None:  # its segments/LOCK too: another server in this process may open the dir
            self.store.close()
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1

    def serve_forever(self) -> int:
        """Serve until stopped (0), until the Raft journal cannot be written (1, logged), or until
        the server refused to serve the cluster it found (2, ``refused``, logged).

        A journal that cannot be written (disk full, I/O error) would make this server acknowledge
        entries it cannot keep: it stops instead, and the others go on without it.
        """
        while not self._stopped.wait(0.5):
            failure = self.node.failure() if self.node is not None else None
            if failure is not None:
                log.error("stopping: the Raft journal cannot be written: %s; free space or fix the disk under %s, "
                          "then start the server again", failure, self.config.data_dir / "raft")
                return 1
        return 2 if self.refused is not None else 0


__all__ = ["ParamServer"]
