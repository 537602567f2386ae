"""Load a model version from the cluster into tensors: ``load_state_dict``, ``load_into``, ``start_load``.

A model reference is ``MODEL:TAG`` (a tag, resolved with monotonic reads), ``MODEL@N`` (the
exact version number N) or ``MODEL`` (its latest version): ``paramserver.client.refs``.

One load pins one manifest: the tag is resolved once, the manifest is proven by its content id,
and every chunk is checked against that manifest before its bytes reach a tensor, so a loaded
model never mixes chunks of two versions and never holds bytes that failed verification.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from chunking.dtypes import torch_dtype
from chunking.manifest import Manifest
from paramserver.client.errors import ConfigError
from paramserver.client.hostmem import Targets, allocate_targets
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient, VersionInfo, client_for
from worker.config import CacheConfig, PrefetchConfig
from worker.heatmap import HeatmapRecorder, HeatReport
from worker.prefetch import LoadCounters, LocalSource, Prefetcher
from worker.tiered_cache import TieredCache

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

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}

    def summary(self) -> str:
        def gib(n: int) -> str:
            return f"{n / (1 << 30):.3f} GiB"

        ttft = f"{self.first_tensor_s * 1000:.1f} ms" if self.first_tensor_s is not None else "n/a"
        return (
            f"{self.model} v{self.version}{f' ({self.tag})' if self.tag else ''} on {self.device}: {gib(self.bytes_total)} "
            f"in {self.seconds:.3f} s = {self.gbps:.2f} GB/s; network {gib(self.bytes_network)} "
            f"({gib(self.bytes_network_stored)} on the wire), disk tier {gib(self.bytes_disk)}, memory tier "
            f"{gib(self.bytes_memory)}, reused {gib(self.bytes_local)}; time to first tensor {ttft}; "
            f"{self.chunks} chunks, {self.failovers} failovers, {self.corrupt_reports} corrupt replicas reported"
        )


def make_report(info: VersionInfo, manifest: Manifest, device: torch.device, c: LoadCounters, seconds: float) -> LoadReport:
    return LoadReport(
        model=info.model, version=info.number, tag=info.tag, manifest_id=info.manifest_id, device=str(device),
        chunks=len(manifest.chunks), bytes_total=sum(c.bytes.values()), bytes_network=c.bytes["network"],
        bytes_network_stored=c.network_stored_bytes, bytes_memory=c.bytes["memory"], bytes_disk=c.bytes["disk"],
        bytes_local=c.bytes["local"], seconds=seconds, first_tensor_s=c.first_tensor_s, failovers=c.failovers,
        corrupt_reports=c.corrupt_reports,
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto``/None picks cuda:0 when CUDA is present, else cpu."""
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} asked for but CUDA is not available here; use --device cpu")
    return dev


def make_cache(cache: TieredCache | CacheConfig | None) -> TieredCache | None:
    if cache is None or isinstance(cache, TieredCache):
        return cache
    return TieredCache.from_config(cache)


def empty_targets(manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
    return {t.name: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device) for t in manifest.tensors}


def resolve_ref(client: ClusterClient, ref: ModelRef) -> VersionInfo:
    return client.resolve_ref(ref)


class LoadHandle:
    """A load running in the background: ``wait(name)`` for one tensor, ``result()`` for all."""

    def __init__(self, prefetcher: Prefetcher, info: VersionInfo, manifest: Manifest, targets: dict[str, torch.Tensor],
                 device: torch.device, client: ClusterClient, owned: bool, report_heat: bool,
                 host: Targets | None = None) -> None:
        self.prefetcher = prefetcher
        self.readiness = prefetcher.readiness
        self.info = info
        self.manifest = manifest
        self.tensors = targets
        self.device = device
        self._client = client
        self._owned = owned
        self._report_heat = report_heat
        self._host = host
        self._done = threading.Event()
        self._heat_sent = threading.Event()
        self._error: BaseException | None = None
        self._report: LoadReport | None = None
        self._thread = threading.Thread(target=self._run, name="paramworker-load", daemon=True)
        self._start = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        prefault = self._host.prefaulter().start() if self._host is not None else None
        try:
            counters = self.prefetcher.run()
            self._report = make_report(self.info, self.manifest, self.device, counters, time.perf_counter() - self._start)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc
        finally:
            if prefault is not None:
                prefault.stop()
            self._host = None
            # The load is done: heat goes out behind it, so it never adds to the load's latency.
            self._done.set()
        try:
            if self._report_heat and self._error is None:
                entries = self.prefetcher.recorder.snapshot().entries()
                self._client.report_heat(self.info.model, self.info.number, entries)
        except Exception:  # noqa: BLE001 - heat is advisory; never fail a load for it
            pass
        finally:
            if self._owned:
                self._client.close()
            self._heat_sent.set()

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
    cluster: ClusterClient | str | Sequence[str],
    ref: str | ModelRef,
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
) -> LoadHandle:
    """Resolve ``ref``, fetch its manifest and start filling tensors in the background."""
    client, owned = client_for(cluster, token)
    try:
        mref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        dev = resolve_device(device)
        info = info or resolve_ref(client, mref)
        manifest = manifest or client.manifest(info.manifest_id)
        # Fresh CPU targets come from recycled host arenas (no page zeroing), and only this load
        # writes them until it is done: chunks may be received straight into them.
        host: Targets | None = allocate_targets(manifest) if targets is None and dev.type == "cpu" else None
        if host is not None:
            tensors = dict(host.tensors)
        else:
            tensors = dict(targets) if targets is not None else empty_targets(manifest, dev)
        heat = None
        if config.use_heatmap:
            try:
                entries = client.get_heat(info.model, info.number)
                heat = HeatReport.from_entries(info.model, info.number, entries) if entries else None
            except Exception:  # noqa: BLE001 - no heatmap: manifest order
                heat = None
        prefetcher = Prefetcher(
            manifest, tensors, client=client, cache=make_cache(cache), config=config, version=info.number, heat=heat,
            local=local, recorder=HeatmapRecorder(info.model, info.number), on_progress=on_progress,
            private_targets=host is not None,
        )
    except BaseException:
        if owned:
            client.close()
        raise
    return LoadHandle(prefetcher, info, manifest, tensors, dev, client, owned, report_heat, host)


@dataclass
class LoadedModel:
    tensors: dict[str, torch.Tensor]
    manifest: Manifest
    info: VersionInfo
    report: LoadReport
    handle: LoadHandle | None = None  # e.g. ``handle.heat_sent(timeout)`` before a process exits


def load(
    cluster: ClusterClient | str | Sequence[str],
    ref: str | ModelRef,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    **kwargs: Any,
) -> LoadedModel:
    """Load ``ref`` completely; returns tensors, manifest, resolved version and a LoadReport."""
    handle = start_load(cluster, ref, device, cache, **kwargs)
    tensors, report = handle.result()
    return LoadedModel(tensors, handle.manifest, handle.info, report, handle)


def load_state_dict(
    cluster: ClusterClient | str | Sequence[str],
    ref: str | ModelRef,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``ref`` (``MODEL:TAG`` or ``MODEL@N``), bit-identical to what was pushed."""
    return load(cluster, ref, device, cache, **kwargs).tensors


def fill_module(module: torch.nn.Module, tensors: Mapping[str, torch.Tensor], device: torch.device, strict: bool = True) -> None:
    """Put ``tensors`` into ``module`` (which may live on the meta device) without copying them."""
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # Buffers the state dict does not carry (non-persistent ones) need real storage too.
        module.to_empty(device=device)
    module.load_state_dict(dict(tensors), strict=strict, assign=True)


def load_into(
    module: torch.nn.Module,
    cluster: ClusterClient | str | Sequence[str],
    ref: str | ModelRef,
    device: str | torch.device | None = "cpu",
    cache: TieredCache | CacheConfig | None = None,
    *,
    strict: bool = True,
    **kwargs: Any,
) -> LoadReport:
    """Fill ``module`` (built on the meta device, e.g. under ``torch.device('meta')``) with ``ref``."""
    dev = resolve_device(device)
    loaded = load(cluster, ref, dev, cache, **kwargs)
    fill_module(module, loaded.tensors, dev, strict)
    return loaded.report


__all__ = [
    "LoadHandle", "LoadReport", "LoadedModel", "ModelRef", "client_for", "empty_targets", "fill_module", "load",
    "load_into", "load_state_dict", "make_cache", "resolve_device", "resolve_ref", "start_load",
]
