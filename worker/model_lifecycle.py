"""The models ``paramworker serve`` holds: which version is current, how it arrives and is replaced.

- The first load, answered from while it arrives (``worker.cold_start``) or waited for.
- A tag move (``worker.swap.HotSwapper``) loads the new version beside the old one (only changed
  chunks travel), builds a new module from the factory (under ``worker.loader.empty_weights``:
  parameters on meta, buffers as the constructor makes them) and swaps the module reference;
  requests in flight finish on the old one. With ``--hf`` (``worker.hf.HFServing``) each version's
  ``config.json`` builds a transformers model instead.
- The heat of the module served (``worker.forward_heat``): held by each request, reported once
  the last request on a retired module is done.
- Other versions loaded on demand for a router (``--other-versions``) and pre-warms (``POST
  /prewarm``): a version fetched into the cache tiers without a swap.

Nothing here speaks HTTP or knows the result cache: ``worker.serve_app`` composes them.
"""
from __future__ import annotations

import functools
import importlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from chunking.manifest import Manifest
from paramserver.client.errors import ClientError, NotFound
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient
from worker.cold_start import ColdStart, start_cold
from worker.config import PrefetchConfig
from worker.errors import BadRequest, ConfigError, Misdirected, UnknownVersion, WorkerError
from worker.forward_heat import ForwardHeat
from worker.hf import HFServing
from worker.loader import LoadedModel, LoadReport, empty_weights, fill_module, load, make_report, start_load
from worker.prefetch import LoadCounters
from worker.router_state import WANT_HEADER
from worker.serve_metrics import ServeMetrics
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache

MAX_PREWARMED = 16  # versions a worker keeps track of pre-warming (the oldest finished one is forgotten first)


class Serving(NamedTuple):
    """What one request runs on: the module, its version, and the heat its passes record (None: none)."""

    module: torch.nn.Module
    loaded: LoadedModel
    heat: ForwardHeat | None


@dataclass
class Prewarm:
    """One pre-warm: a version fetched into the cache tiers, into throwaway tensors, without a swap."""

    model: str
    version: int
    state: str = "loading"  # loading, done, failed
    manifest: Manifest | None = None
    report: LoadReport | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "version": self.version, "state": self.state}
        if self.error:
            out["error"] = self.error
        if self.report is not None:
            out["bytes"] = tiers(self.report)
        return out


def tiers(r: LoadReport) -> dict[str, Any]:
    """Where one load's bytes came from (``/healthz``: a swap with ``network == 0`` was fully pre-warmed)."""
    return {"version": r.version, "total": r.bytes_total, "network": r.bytes_network, "peer": r.bytes_peer, "disk": r.bytes_disk,
            "memory": r.bytes_memory, "local": r.bytes_local, "seconds": round(r.seconds, 4)}


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """``package.module:function`` -> the function (called with no arguments, returns an nn.Module)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--factory {spec!r} must be package.module:function")
    try:
        fn: object = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--factory {spec!r} cannot be imported ({exc}); is the package on PYTHONPATH?") from None
    if not callable(fn):
        raise ConfigError(f"--factory {spec!r} is not callable; name a function that returns the nn.Module")

    # What the factory does is only known once it runs (under empty_weights, possibly after the
    # load has started), so its failures are turned into the same configuration error there.
    @functools.wraps(fn)
    def build() -> torch.nn.Module:
        try:
            module = fn()
        except Exception as exc:  # the user's code: one line naming it, not its traceback
            raise ConfigError(f"--factory {spec!r} failed ({type(exc).__name__}: {exc}); it must build the model "
                              "when called with no arguments") from exc
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"--factory {spec!r} returned {type(module).__name__}, not a torch.nn.Module; "
                              "make it return the model")
        return module

    return build


class ModelLifecycle:
    """The module served now and the versions beside it; see the module docstring.

    ``factory`` or ``hf`` (exactly one) builds a version's module; ``cold_start`` answers while
    the first load arrives (a factory's modules only: an --hf model is built from its version's
    config.json once loaded); ``stop`` (shared with the router link) ends following the tag.
    """

    def __init__(self, client: ClusterClient, ref: str, factory: Callable[[], torch.nn.Module] | None,
                 device: str | torch.device | None, cache: TieredCache | None, config: PrefetchConfig,
                 metrics: ServeMetrics, heat_report_s: float = 60.0, hf: HFServing | None = None,
                 other_versions: int = 0, cold_start: bool = True, stop: threading.Event | None = None) -> None:
        self.cold_start = cold_start and hf is None
        self._cold: ColdStart | None = None
        self.load_error: str | None = None
        self.load_exception: BaseException | None = None
        if (factory is None) == (hf is None):
            raise ConfigError("serve needs exactly one of a factory (--factory) and a Hugging Face model (--hf)")
        if hf is not None:
            hf.check()
        self.factory = factory
        self.hf = hf
        self.metrics = metrics
        self.heat_report_s = heat_report_s
        self._heat: ForwardHeat | None = None  # the heat of self._module; requests hold it (forward_heat)
        self._heat_due: list[ForwardHeat] = []  # retired heats whose last holder is done: the heat loop reports them
        self._heat_wake = threading.Event()
        self._lock = threading.Lock()
        self._module: torch.nn.Module | None = None
        self._loaded: LoadedModel | None = None
        self.swapper = HotSwapper(client, ref, device, cache, config=config, on_swap=self._on_swap)
        self._stop = stop if stop is not None else threading.Event()
        self._loaded_event = threading.Event()
        # Versions loaded on demand and pre-warms (--other-versions, POST /prewarm)
        if not 0 <= other_versions <= 64:
            raise ConfigError(f"other_versions must be 0..64, got {other_versions}")
        self.other_versions = other_versions
        self._others: OrderedDict[tuple[str, int], Serving] = OrderedDict()
        self._others_lock = threading.Lock()
        self._others_loading: dict[tuple[str, int], threading.Lock] = {}
        self._prewarms: OrderedDict[tuple[str, int], Prewarm] = OrderedDict()
        self._prewarm_lock = threading.Lock()
        self.last_load: LoadReport | None = None
        self.last_swap: LoadReport | None = None

    # ------------------------------------------------------------------ the version served

    def _build(self, new: LoadedModel) -> torch.nn.Module:
        if self.hf is not None:
            module = self.hf.build(self.swapper.client, new, self.swapper.device)
        else:
            assert self.factory is not None
            with empty_weights():  # parameters on meta; buffers keep the constructor's values
                module = self.factory()
            fill_module(module, new.tensors, self.swapper.device)
        module.eval()
        return module

    def _on_swap(self, new: LoadedModel, old: LoadedModel | None) -> None:
        module = self._build(new)
        heat = ForwardHeat(module, new.manifest, version=new.info.number, sink=self.swapper.client, report_every_s=self.heat_report_s)
        with self._lock:  # readers take the reference under this lock: they see old or new, never a mix
            self._module, self._loaded = module, new
            old_heat, self._heat = self._heat, heat
        r = new.report
        self.last_load = r
        if old is not None:
            self.last_swap = r
        self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network, r.bytes_peer)
        self.metrics.version.labels(new.info.model).set(new.info.number)
        if old_heat is not None and old_heat.retire():  # else the last request still on the old module reports it
            # By the heat loop, not here: the swap is complete (and counted) without waiting on an RPC.
            with self._lock:
                self._heat_due.append(old_heat)
            self._heat_wake.set()

    def _report_heat(self, heat: ForwardHeat | None, force: bool = False) -> None:
        if heat is None:
            return
        try:
            heat.report_if_due(force=force)
        except Exception:  # noqa: BLE001 - heat is advisory; serving must not suffer from a failed report
            pass

    def _report_final(self, heat: ForwardHeat) -> None:
        heat.detach()
        self._report_heat(heat, force=True)

    def release(self, heat: ForwardHeat | None) -> None:
        """A request is done with the module whose heat it held (``serving``, ``target_for``)."""
        if heat is not None and heat.release():  # reported by the heat loop, not on this request's time
            with self._lock:
                self._heat_due.append(heat)
            self._heat_wake.set()

    def _report_due(self) -> None:
        with self._lock:
            due, self._heat_due = self._heat_due, []
        for heat in due:
            self._report_final(heat)

    def _heat_loop(self) -> None:
        while not self._stop.is_set():
            self._heat_wake.wait(min(5.0, self.heat_report_s))
            self._heat_wake.clear()
            self._report_due()
            self._report_heat(self._heat)

    def snapshot(self) -> tuple[torch.nn.Module, LoadedModel]:
        served = self.serving(hold=False)
        return served.module, served.loaded

    def serving(self, hold: bool = True) -> Serving:
        """The module served now, its version and (held, when ``hold``: release it with ``release``) its heat."""
        with self._lock:
            if self._module is None or self._loaded is None:
                if self.load_error is not None:
                    raise WorkerError(f"the model could not be loaded: {self.load_error}")
                raise WorkerError("no model loaded yet")
            heat = self._heat if hold else None
            if heat is not None:
                heat.hold()
            return Serving(self._module, self._loaded, heat)

    def current(self) -> tuple[LoadedModel | None, ColdStart | None]:
        """The version served now (None: none yet or its load failed) and the cold start still filling it."""
        with self._lock:
            return self._loaded, self._cold

    def is_cold(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is a cold start's, still being filled: its answers are not cached, as
        a forward that reads a weight past the pre-hooks (outside its owner's forward) could read
        bytes not landed yet, and a cached answer would outlive the load."""
        with self._lock:
            return self._cold is not None and module is self._cold.module

    # ------------------------------------------------------------------ first load, following the tag

    def _start_cold(self) -> None:
        """Serve the first version while it arrives: requests run on a module whose layers each wait
        for their own weights; once the load is complete the normal swap installs the full module."""
        sw = self.swapper
        assert self.factory is not None
        cold = start_cold(sw.client, str(sw.ref), self.factory, sw.device, sw.cache, config=sw.config)
        h = cold.handle
        loading = LoadedModel(h.tensors, h.manifest, h.info, make_report(h.info, h.manifest, sw.device, LoadCounters(), 0.0), h)
        # Forward passes while loading count as heat too (the swap after the load reports them).
        heat = ForwardHeat(cold.module, h.manifest, version=h.info.number, sink=sw.client, report_every_s=self.heat_report_s)
        self.metrics.version.labels(h.info.model).set(h.info.number)  # set before the first request can be answered
        with self._lock:
            self._module, self._loaded, self._cold = cold.module, loading, cold
            self._heat = heat
        threading.Thread(target=self._finish_cold, args=(cold,), name="paramworker-cold-start", daemon=True).start()

    def _finish_cold(self, cold: ColdStart) -> None:
        try:
            loaded = cold.finish()
            self.swapper.install(loaded)  # on_swap: the full module (no waiting hooks), heat, metrics
        except Exception as exc:  # noqa: BLE001 - kept for /healthz, the answers and the CLI's exit code
            self.load_exception = exc
            self.load_error = f"{type(exc).__name__}: {str(exc)[:300]}"
            with self._lock:
                self._module = self._loaded = None
            self.metrics.version.remove(cold.handle.info.model)  # nothing is served any more
        finally:
            with self._lock:
                self._cold = None
            self._loaded_event.set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """True once the first load is complete (or failed: see ``load_error``)."""
        return self._loaded_event.wait(timeout)

    def start(self, poll_s: float) -> None:
        """The first load (cold, or waited for), the heat loop, and (a tag) following it every ``poll_s``."""
        if self.cold_start:
            self._start_cold()
        else:
            self.swapper.start()
            self._loaded_event.set()
        threading.Thread(target=self._heat_loop, name="paramworker-heat", daemon=True).start()
        if self.swapper.ref.tag is not None and poll_s > 0:
            def follow_after_load() -> None:  # tag checks begin once the first version is in
                self._loaded_event.wait()
                if self.load_error is None:
                    self.swapper.follow(poll_s, self._stop)
            threading.Thread(target=follow_after_load, name="paramworker-follow-start", daemon=True).start()

    def stop(self) -> None:
        """Stop following (``stop`` is set, if the composition did not already) and report the heat held back."""
        self._stop.set()
        self._heat_wake.set()
        self._report_due()
        self._report_heat(self._heat, force=True)

    # ------------------------------------------------------------------ other versions, pre-warm

    def other_keys(self) -> list[tuple[str, int]]:
        with self._others_lock:
            return list(self._others)

    def prewarm_list(self) -> list[Prewarm]:
        with self._prewarm_lock:
            return list(self._prewarms.values())

    def held(self) -> list[LoadedModel]:
        """Every version held in memory: the one served first, then those loaded on demand."""
        with self._lock:
            loaded = self._loaded
        with self._others_lock:
            others = [served.loaded for served in self._others.values()]
        return ([loaded] if loaded is not None else []) + others

    def target_for(self, want: str, exact: bool) -> Serving:
        """The module to answer a request for ``want`` (``MODEL@N``): the one served (its heat held for
        the request), a version loaded on demand (``other_versions`` > 0, least recently used dropped
        first), else Misdirected."""
        try:
            ref = ModelRef.parse(want)
        except ClientError:
            raise BadRequest(f"{WANT_HEADER} {want!r} is not MODEL@N") from None
        if ref.version is None:
            raise BadRequest(f"{WANT_HEADER} {want!r} is not MODEL@N")
        served = self.serving()
        loaded = served.loaded
        if loaded.info.model == ref.model and (not exact or loaded.info.number == ref.version):
            return served
        self.release(served.heat)
        if loaded.info.model != ref.model and self.hf is None:  # a factory builds its one model: never another's weights
            raise Misdirected(f"this worker serves model {loaded.info.model}, not {ref.model} ({want})")
        key = (ref.model, ref.version)
        with self._others_lock:
            hit = self._others.get(key)
            if hit is not None:
                self._others.move_to_end(key)
                return hit
            if self.other_versions <= 0:
                raise Misdirected(f"this worker serves {loaded.info.model} v{loaded.info.number}, not {want}, and loads no "
                                  "other version on demand (paramworker serve --other-versions N)")
            gate = self._others_loading.setdefault(key, threading.Lock())
        with gate:  # one load per version; requests for it meanwhile wait for that load
            try:
                with self._others_lock:
                    hit = self._others.get(key)
                if hit is not None:
                    return hit
                try:
                    new = load(self.swapper.client, ref, self.swapper.device, self.swapper.cache,
                               config=self.swapper.config, report_heat=False)
                except NotFound as exc:
                    raise UnknownVersion(f"{want}: the cluster has no such version ({exc})") from None
                built = Serving(self._build(new), new, None)  # versions on demand record no heat
                r = new.report
                self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network, r.bytes_peer)
                with self._others_lock:
                    self._others[key] = built
                    while len(self._others) > self.other_versions:
                        self._others.popitem(last=False)
                return built
            finally:  # loaded or failed: the gate goes (a failed version must not leave one behind)
                with self._others_lock:
                    if self._others_loading.get(key) is gate:
                        del self._others_loading[key]

    def prewarm(self, model: str, version: int) -> Prewarm:
        """Fetch ``model@version`` into the cache tiers in the background (throwaway CPU tensors, no swap);
        a later swap to it then reads its chunks from the tiers, not the network."""
        if self.swapper.cache is None:
            raise ConfigError("this worker has no cache tiers (--cache-mb 0 and no --disk-cache): nothing to pre-warm into")
        key = (model, version)
        with self._prewarm_lock:
            current = self._prewarms.get(key)
            if current is not None and current.state != "failed":
                return current
            entry = self._prewarms[key] = Prewarm(model, version)
            while len(self._prewarms) > MAX_PREWARMED:
                oldest = next((k for k, p in self._prewarms.items() if p.state != "loading"), None)
                if oldest is None:
                    break
                del self._prewarms[oldest]
        threading.Thread(target=self._run_prewarm, args=(entry,), name="paramworker-prewarm", daemon=True).start()
        return entry

    def _run_prewarm(self, entry: Prewarm) -> None:
        client = self.swapper.client
        try:
            info = client.resolve_ref(ModelRef(entry.model, None, entry.version))
            entry.manifest = client.manifest(info.manifest_id)
            handle = start_load(client, ModelRef(entry.model, None, entry.version), "cpu", self.swapper.cache,
                                config=self.swapper.config, info=info, manifest=entry.manifest, report_heat=False)
            _tensors, entry.report = handle.result()
            r = entry.report
            self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network, r.bytes_peer)
            entry.state = "done"
        except Exception as exc:  # noqa: BLE001 - reported in /healthz and the heartbeat; serving goes on
            entry.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            entry.state = "failed"


__all__ = ["MAX_PREWARMED", "ModelLifecycle", "Prewarm", "Serving", "load_factory", "tiers"]
