"""Load a model version from the cluster into tensors: ``load_state_dict``, ``load_into``, ``start_load``.

A model reference is ``MODEL:TAG`` (a tag, resolved with monotonic reads), ``MODEL@N`` (the
exact version number N) or ``MODEL`` (its latest version): ``paramserver.client.refs``.

A client's first resolution of a tag is linearizable (at the leader: ``ClusterClient.resolve``),
so a worker starting up never loads a version the tag had already left; ``LoadReport.resolved_by``
says when no leader answered and a member's answer was taken.

One load pins one manifest: the tag is resolved once, the manifest is proven by its content id,
and every chunk is checked against that manifest before its bytes reach a tensor, so a loaded
model never mixes chunks of two versions and never holds bytes that failed verification.

Loads share with the other workers of the cluster (``worker.peer_link``): a load reads what
peers hold through the process's swarm and serves its own chunks to them as they land
(``peers=False`` or ``PARAMS_PEERS=off``: servers only). A peer's bytes are verified by content
id like any others; ``LoadReport.bytes_peer`` counts them, ``bytes_network`` the servers' share.
"""
from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from chunking.chunk_table import collector_paused
from chunking.dtypes import torch_dtype
from chunking.manifest import Manifest
from paramserver.client.cluster_view import in_thread, start_background
from paramserver.client.config import ClientSettings, split_cluster_arg
from paramserver.client.errors import ConfigError
from paramserver.client.hostmem import Targets, allocate_targets, default_pool, retarget
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient, VersionInfo, client_for
from paramserver.client.session_config import READ_FALLBACK
from worker.config import CacheConfig, PrefetchConfig
from worker.errors import FillError
from worker.heatmap import HeatmapRecorder, HeatReport
from worker.module_fill import FillReport, check_fillable, empty_weights, fill_module, plan_fill
from worker.peer_link import PeerLink, close_link, link_for
from worker.prefetch import LoadCounters, LocalSource, Prefetcher
from worker.tiered_cache import HeldGroup, TieredCache
from worker.upload import DeviceUpload

log = logging.getLogger(__name__)

# Where to load from: a client, settings, seed addresses, or None: then, as for the CLIs, from the
# environment or the PARAMS_CONFIG file. Left out (``load_state_dict("m:prod")``), it is None.
Cluster = ClusterClient | ClientSettings | str | Sequence[str] | None


@dataclass(frozen=True)
class LoadReport:
    """Where the bytes of one load came from and how fast it went."""

    model: str
    version: int
    tag: str
    manifest_id: str
    device: str
    chunks: int
    bytes_total: int
    bytes_network: int
    bytes_network_stored: int
    bytes_memory: int
    bytes_disk: int
    bytes_local: int
    seconds: float
    first_tensor_s: float | None
    failovers: int
    corrupt_reports: int
    # How the tag was resolved (VersionInfo.read: "leader", "member", or "member, no leader reachable"
    # when a first resolution found no leader to ask; "" for MODEL@N and MODEL) and how long that took.
    resolved_by: str = ""
    resolve_s: float = 0.0
    # Raw bytes read from other workers (peers); bytes_network is the servers' share alone.
    bytes_peer: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}

    def summary(self) -> str:
        def gib(n: int) -> str:
            return f"{n / (1 << 30):.3f} GiB"

        ttft = f"{self.first_tensor_s * 1000:.1f} ms" if self.first_tensor_s is not None else "n/a"
        # A resolution without the leader may have missed the last tag move: the report says so.
        warn = f"; tag resolved by a {self.resolved_by}" if self.resolved_by == READ_FALLBACK else ""
        peers = f", peers {gib(self.bytes_peer)}" if self.bytes_peer else ""
        return (
            f"{self.model} v{self.version}{f' ({self.tag})' if self.tag else ''} on {self.device}: {gib(self.bytes_total)} "
            f"in {self.seconds:.3f} s = {self.gbps:.2f} GB/s; network {gib(self.bytes_network)} "
            f"({gib(self.bytes_network_stored)} on the wire){peers}, disk tier {gib(self.bytes_disk)}, memory tier "
            f"{gib(self.bytes_memory)}, reused {gib(self.bytes_local)}; time to first tensor {ttft}; "
            f"{self.chunks} chunks, {self.failovers} failovers, {self.corrupt_reports} corrupt replicas reported{warn}"
        )


def make_report(info: VersionInfo, manifest: Manifest, device: torch.device, c: LoadCounters, seconds: float) -> LoadReport:
    return LoadReport(
        model=info.model, version=info.number, tag=info.tag, manifest_id=info.manifest_id, device=str(device),
        chunks=len(manifest.chunks), bytes_total=sum(c.bytes.values()), bytes_network=c.bytes["network"],
        bytes_network_stored=c.network_stored_bytes, bytes_memory=c.bytes["memory"], bytes_disk=c.bytes["disk"],
        bytes_local=c.bytes["local"], seconds=seconds, first_tensor_s=c.first_tensor_s, failovers=c.failovers,
        corrupt_reports=c.corrupt_reports, resolved_by=info.read, resolve_s=info.resolve_s, bytes_peer=c.bytes["peer"],
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto``/None picks cuda:0 when CUDA is present, else cpu. A bare ``cuda`` gets the calling
    thread's current device as its index: the load's own threads would otherwise use device 0."""
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev: torch.device | None = torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's word for a malformed device string
        dev = None
    # Other torch device types (meta, mps, ...) parse, but the load path only knows host and CUDA copies.
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r} is not one of cpu, cuda, cuda:N or auto; give e.g. --device cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} asked for but CUDA is not available here; use --device cpu")
    index: int | None = dev.index  # None for a bare "cuda" (torch's stubs say int)
    if dev.type == "cuda" and index is not None and index >= (count := torch.cuda.device_count()):
        raise ConfigError(f"device {device} asked for but this machine has {count} CUDA device(s); give cuda:0..cuda:{count - 1}")
    if dev.type == "cuda" and index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def _pin_then_go(host: Targets, upload: DeviceUpload, errors: list[BaseException]) -> None:
    """Page-lock the load's host arena (once per arena), then let its tensors go up. What raises
    is handed to the loading thread (``errors``)."""
    try:
        device = upload.copier.device
        if host.arena is not None and upload.copier.stream is not None:
            why = default_pool().pin(host.arena.view, device.index if device.index is not None else 0)
            if why is not None:
                # Held uploads go at the end, from the loading thread.
                log.warning("host arena not page-locked (%s): copies to %s run from pageable memory", why, device)
                return
        upload.go()
    except BaseException as exc:  # noqa: BLE001 - re-raised by LoadHandle._run
        errors.append(exc)


def host_staged(config: PrefetchConfig, device: torch.device, cache: TieredCache | None, manifest: Manifest) -> bool:
    """Whether a load onto ``device`` lands in a host arena first (``PrefetchConfig.host_staging``;
    "always" stages a cpu load too, into separate tensors: the same path, testable without CUDA)."""
    if config.host_staging == "never":
        return False
    if config.host_staging == "always":
        return True
    return device.type == "cuda" and cache is not None and cache.memory.capacity_bytes >= manifest.raw_bytes


def _adopt(manifest: Manifest, group: HeldGroup) -> tuple[Targets, HeldGroup] | None:
    """Tensors for ``manifest`` on a held group's arena when nothing but the tier uses it."""
    arena = group.arena
    if arena is None or not default_pool().free_but_for(arena.view):
        return None
    return retarget(manifest, arena), group


def make_cache(cache: TieredCache | CacheConfig | None) -> TieredCache | None:
    if cache is None or isinstance(cache, TieredCache):
        return cache
    return TieredCache.from_config(cache)


def empty_targets(manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
    return {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in manifest.tensors}


def resolve_ref(client: ClusterClient, ref: ModelRef) -> VersionInfo:
    return client.resolve_ref(ref)


def _heat_of(client: ClusterClient, info: VersionInfo) -> HeatReport | None:
    try:
        entries = client.get_heat(info.model, info.number)
    except Exception:  # noqa: BLE001 - no heatmap: manifest order
        return None
    return HeatReport.from_entries(info.model, info.number, entries) if entries else None


def _send_heat(client: ClusterClient, model: str, number: int, recorder: HeatmapRecorder | None, owned: bool,
               sent: threading.Event, link: PeerLink | None = None) -> None:
    try:
        if link is not None and not owned:
            link.announce()  # the load ended: peers learn it (complete, or no longer loading) now
        if recorder is not None:
            client.report_heat(model, number, recorder.wire_entries())
    except Exception:  # noqa: BLE001 - heat is advisory; never fail a load for it
        pass
    finally:
        if owned:
            close_link(client)  # its leaving announce, then the port
            client.close()
        sent.set()


class LoadHandle:
    """A load running in the background: ``wait(name)`` for one tensor, ``result()`` for all."""

    def __init__(self, prefetcher: Prefetcher, info: VersionInfo, manifest: Manifest, targets: dict[str, torch.Tensor],
                 device: torch.device, client: ClusterClient, owned: bool, report_heat: bool,
                 host: Targets | None = None, upload: DeviceUpload | None = None, link: PeerLink | None = None) -> None:
        """``upload``: the load lands in ``host`` and each tensor goes up to ``targets`` from there.
        ``link``: the peer runtime the load shares through (announced at its start and end)."""
        self.prefetcher = prefetcher
        self.upload = upload
        self.readiness = upload.readiness if upload is not None else prefetcher.readiness
        self.info = info
        self.manifest = manifest
        self.tensors = targets
        self.device = device
        self._client = client
        self._owned = owned
        self._report_heat = report_heat
        self._host = host
        self._link = link
        self._done = threading.Event()
        self._heat_sent = threading.Event()
        self._error: BaseException | None = None
        self._report: LoadReport | None = None
        self._start = time.perf_counter()
        # Its heat report goes out after result() returns; a process that exits right then waits for it briefly.
        self._thread = start_background(self._run, "paramworker-load")

    def _run(self) -> None:
        upload = self.upload
        prefault = pinner = None
        pin_error: list[BaseException] = []
        if upload is not None and self._host is not None:
            # Pinning faults in the pages the receivers have not touched yet: it is the prefault.
            pinner = start_background(partial(_pin_then_go, self._host, upload, pin_error), "paramworker-pin")
        elif self._host is not None:
            prefault = self._host.prefaulter().start()
        if self._link is not None:
            self._link.announce()  # on this thread: the caller is not held, and peers know before the first read
        try:
            counters = self.prefetcher.run()
            if upload is not None:
                if pinner is not None:
                    pinner.join()
                if pin_error:
                    raise pin_error[0]
                upload.finish()
                if upload.first_at is not None:  # usable on the device, not only on the host
                    counters.first_tensor_s = upload.first_at - self._start
            self._report = make_report(self.info, self.manifest, self.device, counters, time.perf_counter() - self._start)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            # The traceback stays for the caller; its frames' locals (views of the targets) go, or a
            # failed load kept its host arena in use for as long as its handle lives.
            traceback.clear_frames(exc.__traceback__)
            self._error = exc
            if upload is not None:
                if pinner is not None:
                    pinner.join()  # before fail(): it may still be issuing copies
                upload.fail(exc)
        finally:
            if prefault is not None:
                prefault.stop()
            if upload is not None:
                self.prefetcher.release_targets()  # the arena is the memory tier's alone now
            self._host = None
        # The load is done: heat goes out behind it, so it never adds to the load's latency. Its
        # thread holds no reference to this handle, hence none to the tensors: a caller that
        # drops them frees (or lets the memory tier reuse) their memory at once.
        recorder = self.prefetcher.recorder if self._report_heat and self._error is None else None
        start_background(_send_heat, "paramworker-heat", self._client, self.info.model, self.info.number, recorder,
                         self._owned, self._heat_sent, self._link)
        self._done.set()

    def done(self) -> bool:
        """Whether the load has ended (``result()`` then returns at once, or raises its error)."""
        return self._done.is_set()

    def heat_sent(self, timeout: float | None = None) -> bool:
        """Wait until the load's heat report went out (or was skipped)."""
        return self._heat_sent.wait(timeout)

    def wait(self, name: str, timeout: float | None = None) -> torch.Tensor:
        """The tensor ``name`` once its own chunks have landed (raises TensorFailed if they cannot)."""
        self.readiness.wait(name, timeout)
        return self.tensors[name]

    def result(self, timeout: float | None = None) -> tuple[dict[str, torch.Tensor], LoadReport]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"load of {self.info.model} v{self.info.number} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self.tensors, self._report


def start_load(
    cluster: Cluster | ModelRef = None,
    ref: str | ModelRef | None = None,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    *,
    token: str | None = None,
    config: PrefetchConfig = PrefetchConfig(),
    targets: Mapping[str, torch.Tensor] | None = None,
    local: LocalSource | None = None,
    info: VersionInfo | None = None,
    manifest: Manifest | None = None,
    report_heat: bool = True,
    on_progress: Callable[[int], None] | None = None,
    peers: bool | PeerLink | None = None,
) -> LoadHandle:
    """Resolve ``ref``, fetch its manifest and start filling tensors in the background.

    ``start_load(ref, ...)``: the cluster, the read token, TLS and the verify mode come as for
    ``paramworker load`` (arguments > environment > ``PARAMS_CONFIG`` file > defaults).
    ``peers``: share with the cluster's other workers through the client's peer link (None: the
    one attached to the client, else a new one unless ``PARAMS_PEERS=off``; False: servers only).
    """
    at, ref = split_cluster_arg(cluster, ref, what="ref")
    client, owned = client_for(at, token)
    try:
        # The manifest's decode and the load's per-chunk tables make many acyclic objects.
        with collector_paused(config.pause_collector):
            mref = ModelRef.parse(ref) if isinstance(ref, str) else ref
            dev = resolve_device(device)
            info = info or resolve_ref(client, mref)
            # What the fetch needs besides the manifest is asked for while the manifest arrives and the
            # targets are allocated: the heatmap, and the servers' hot chunks (which also connects to
            # every member), so the first read does not wait on either.
            tiered = make_cache(cache)
            local_only = tiered is not None and tiered.holds_whole(info.manifest_id)
            if not local_only:
                client.prepare_fetch()
            asked = (in_thread(partial(_heat_of, client, info), "paramworker-heat-ask")
                     if config.use_heatmap and not local_only else None)
            manifest = manifest or client.manifest(info.manifest_id)
            # Fresh CPU targets come from recycled host arenas (no page zeroing), and only this load
            # writes them until it is done: chunks may be received straight into them. When the
            # memory tier holds this manifest's arena and nothing else uses it, the load gets that.
            host: Targets | None = None
            adopted: HeldGroup | None = None
            staged = targets is None and host_staged(config, dev, tiered, manifest)
            if targets is None and (dev.type == "cpu" or staged):
                taken = tiered.adopt(manifest.id, partial(_adopt, manifest)) if tiered is not None else None
                host, adopted = taken if taken is not None else (allocate_targets(manifest, pinned=staged), None)
            if host is not None and not staged:
                tensors = dict(host.tensors)
            else:
                tensors = dict(targets) if targets is not None else empty_targets(manifest, dev)
            # The heatmap orders the fetch: waited for only when some chunk must come from the network.
            heat = asked.result if asked is not None else None
            prefetcher = Prefetcher(
                manifest, host.tensors if host is not None else tensors, client=client, cache=tiered,
                config=config, version=info.number, heat=heat, local=local,
                recorder=HeatmapRecorder(info.model, info.number), on_progress=on_progress,
                private_targets=host is not None, arena=host.arena if host is not None else None,
                adopted=adopted, private_arena=staged,
            )
            upload = DeviceUpload(host.tensors, tensors, prefetcher.readiness, dev) if staged and host is not None else None
            # Last: nothing after it may fail, or the shelf would keep an entry no run() ever ends.
            link = link_for(client, tiered, peers)
            if link is not None:
                prefetcher.swarm = link.swarm
                prefetcher.shelf_entry = link.begin(manifest, prefetcher.locate)
    except BaseException:
        if owned:
            close_link(client)
            client.close()
        raise
    return LoadHandle(prefetcher, info, manifest, tensors, dev, client, owned, report_heat, host, upload, link)


@dataclass
class LoadedModel:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    info: VersionInfo
    report: LoadReport
    handle: LoadHandle | None = None  # e.g. ``handle.heat_sent(timeout)`` before a process exits


def load(
    cluster: Cluster | ModelRef = None,
    ref: str | ModelRef | None = None,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    **kwargs: Any,
) -> LoadedModel:
    """Load ``ref`` completely; returns tensors, manifest, resolved version and a LoadReport."""
    cluster, ref = split_cluster_arg(cluster, ref, what="ref")
    handle = start_load(cluster, ref, device, cache, **kwargs)
    tensors, report = handle.result()
    return LoadedModel(tensors, handle.manifest, handle.info, report, handle)


def load_state_dict(
    cluster: Cluster | ModelRef = None,
    ref: str | ModelRef | None = None,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``ref`` (``MODEL:TAG`` or ``MODEL@N``), bit-identical to what was pushed.

    ``load_state_dict("m:prod")`` reads the cluster, token and TLS from the environment or the
    ``PARAMS_CONFIG`` file; ``load_state_dict(cluster, "m:prod")`` names the cluster (a ClusterClient,
    ClientSettings or seed addresses). Pass ``device`` by keyword in the short form.
    """
    cluster, ref = split_cluster_arg(cluster, ref, what="ref")
    return load(cluster, ref, device, cache, **kwargs).tensors


def load_into(
    module: torch.nn.Module,
    cluster: Cluster | ModelRef = None,
    ref: str | ModelRef | None = None,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    *,
    strict: bool = True,
    token: str | None = None,
    **kwargs: Any,
) -> LoadReport:
    """Fill ``module`` with ``ref``; build it under ``empty_weights()`` (or ``torch.device('meta')``
    when it has no non-persistent buffers) so no parameter storage is allocated twice.

    The module is checked against the version's manifest before any chunk is fetched (see
    ``fill_module`` for the rules); skipped checkpoint names are logged by ``worker.loader``.
    ``load_into(module, ref)``: the cluster comes from the settings, as for ``load_state_dict``.
    """
    at, ref = split_cluster_arg(cluster, ref, what="ref")
    check_fillable(module)
    dev = resolve_device(device)
    client, owned = client_for(at, token)
    loaded: LoadedModel | None = None
    try:
        mref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        info = kwargs.pop("info", None) or resolve_ref(client, mref)
        manifest = kwargs.pop("manifest", None) or client.manifest(info.manifest_id)
        plan_fill(module, [t.name for t in manifest.tensors], strict)
        loaded = load(client, mref, dev, cache, info=info, manifest=manifest, **kwargs)
        fill_module(module, loaded.tensors, dev, strict)
    finally:
        if owned:
            close_after_heat(client, loaded)
    return loaded.report


def close_after_heat(client: ClusterClient, loaded: LoadedModel | None) -> None:
    """Close a client this module opened once its load's heat report is out (behind the load, never in its way)."""
    handle = loaded.handle if loaded is not None else None
    if handle is None:
        close_link(client)
        client.close()
        return

    def close() -> None:
        handle.heat_sent(10.0)
        close_link(client)
        client.close()

    threading.Thread(target=close, name="paramworker-close", daemon=True).start()


__all__ = [
    "Cluster", "FillError", "FillReport", "LoadHandle", "LoadReport", "LoadedModel", "ModelRef", "check_fillable", "client_for",
    "empty_targets", "empty_weights", "fill_module", "load", "load_into", "load_state_dict", "make_cache", "plan_fill",
    "resolve_device", "resolve_ref", "start_load",
]
