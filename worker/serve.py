"""``paramworker serve``: keep a module loaded, follow its tag, answer inference over HTTP.

Endpoints (stdlib ``http.server``, HTTP/1.1 keep-alive, JSON):
- ``POST /infer`` with a JSON list (nested lists of numbers) or ``{"input": [...], "cache": true}``:
  runs the module on ``torch.tensor(input)`` and answers ``{"output": [...], "model", "version",
  "fingerprint", "cache"}``; ``cache`` says how it was answered (``hit_l1``, ``hit_l2``,
  ``computed``, ``joined``). ``"cache": false`` skips the result cache for that request.
  503 with ``Retry-After`` when the worker sheds load; 400 for a request the model cannot run.
- ``GET /healthz``: ``{"model", "tag", "version", "swaps", "last_error", ...}``.
- ``GET /metrics``: Prometheus text (``worker.serve_metrics``).

Connection bounds: one request's request line, headers and body must arrive within
``request_read_timeout_s`` of its first byte (a client trickling bytes cannot hold a connection);
between keep-alive requests a connection may idle ``idle_timeout_s``. Request bodies being read and
parsed share a byte budget (``body_budget_bytes``, default 4x ``max_body_bytes``): a request that
cannot get its share within ``body_budget_wait_s`` is a 503 with ``Retry-After``.

A tag move loads the new version beside the old one (only changed chunks travel), builds a new
module from the factory (under ``worker.loader.empty_weights``: parameters on meta, buffers as the
constructor makes them), and swaps the module reference; requests in flight finish on the old one.
With ``--hf`` (``worker.hf.HFServing``) there is no factory: each version's ``config.json`` builds a
transformers model, and ``/infer`` takes token ids (``paramworker serve --help`` has the JSON contract).
Results are cached by the version's model fingerprint (``worker.result_service``), so a request
after the swap never gets the old version's answer; each answer names the version it came from.
"""
from __future__ import annotations

import errno
import functools
import importlib
import io
import json
import logging
import socket as socketlib
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import socket
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from paramserver.client.session import ClusterClient
from paramserver.wire.auth import token_metadata
from worker.admission import Admission, AdmissionConfig, ByteBudget, Refuser, Shed
from worker.config import MAX_BODY_BYTES, PrefetchConfig
from worker.outputs import json_values
from worker.errors import ConfigError, WorkerError
from worker.forward_heat import ForwardHeat
from worker.hf import HFServing
from chunking.manifest import Manifest
from paramserver.client.errors import ClientError, NotFound
from paramserver.client.refs import ModelRef
from worker.cold_start import ColdStart, start_cold
from worker.loader import LoadedModel, LoadReport, empty_weights, fill_module, load, make_report, start_load
from worker.prefetch import LoadCounters
from worker.result_cache import ResultCacheConfig, canonical_json, result_key
from worker.result_service import Answer, Computed, ResultService
from worker.result_store import RedisResultStore, ResultStore
from worker.router_state import EXACT_HEADER, HEARTBEAT_S, MISDIRECTED, WANT_HEADER
from worker.serve_metrics import CONTENT_TYPE, ServeMetrics
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache

MAX_BODY = MAX_BODY_BYTES  # the default of ServeConfig.max_body_bytes
BODY_CHUNK = 64 << 10  # a body is read (and its budget taken) this many bytes at a time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How ``paramworker serve`` answers: result cache, admission, connection and time bounds."""

    result_cache: ResultCacheConfig = field(default_factory=ResultCacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_connections: int = 512  # open HTTP connections (one thread each); beyond: 503 at once
    request_timeout_s: float = 60.0  # a request waiting on an identical one gives up after this
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request is closed after this
    max_body_bytes: int = MAX_BODY
    request_read_timeout_s: float = 10.0  # request line + headers + body, from its first byte
    body_budget_bytes: int = 0  # request body bytes read/parsed at once over all connections; 0: 4x max_body_bytes
    body_budget_wait_s: float = 1.0  # longest wait for body budget before a 503

    @property
    def body_budget(self) -> int:
        return self.body_budget_bytes or 4 * self.max_body_bytes

    def validate(self) -> ServeConfig:
        self.result_cache.validate()
        self.admission.validate()
        if not 1 <= self.max_connections <= 100_000:
            raise ConfigError(f"max_connections must be 1..100000, got {self.max_connections}")
        for name in ("request_timeout_s", "idle_timeout_s", "request_read_timeout_s", "body_budget_wait_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"{name} must be in (0, 3600] seconds, got {value}")
        if not 1 <= self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be 1 B..1 GiB, got {self.max_body_bytes}")
        if self.body_budget_bytes and not self.max_body_bytes <= self.body_budget_bytes <= 64 << 30:
            raise ConfigError(f"body_budget_bytes must be 0 (4x max_body_bytes) or max_body_bytes..64 GiB, "
                              f"got {self.body_budget_bytes}")
        return self


class BadRequest(WorkerError, ValueError):
    """The request body is not something the model can run; answered 400."""


class Misdirected(WorkerError):
    """A router asked for a version this worker neither holds nor loads on demand; answered 421."""


class UnknownVersion(WorkerError):
    """A request named a version of this worker's model that the cluster does not have; answered 404."""


MAX_PREWARMED = 16  # versions a worker keeps track of pre-warming (the oldest finished one is forgotten first)


class Serving(NamedTuple):
    """What one request runs on: the module, its version, and the heat its passes record (None: none)."""

    module: torch.nn.Module
    loaded: LoadedModel
    heat: ForwardHeat | None


@dataclass
class _Prewarm:
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
            out["bytes"] = _tiers(self.report)
        return out


def _tiers(r: LoadReport) -> dict[str, Any]:
    """Where one load's bytes came from (``/healthz``: a swap with ``network == 0`` was fully pre-warmed)."""
    return {"version": r.version, "total": r.bytes_total, "network": r.bytes_network, "disk": r.bytes_disk,
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


class ModelServer:
    """The serving composition root: hot swapper, result cache, admission, metrics, HTTP.

    ``factory_name`` is part of every result key (two factories over the same weights are two
    models); ``store`` overrides the Redis store the config names (tests pass an in-memory one).
    ``hf`` instead of a factory serves a transformers model built from each version's config.json.
    """

    def __init__(self, client: ClusterClient, ref: str, factory: Callable[[], torch.nn.Module] | None,
                 device: str | torch.device | None = "cpu", cache: TieredCache | None = None,
                 config: PrefetchConfig = PrefetchConfig(), heat_report_s: float = 60.0,
                 serve: ServeConfig = ServeConfig(), factory_name: str = "", store: ResultStore | None = None,
                 hf: HFServing | None = None, other_versions: int = 0, cold_start: bool = True) -> None:
        self.serve_config = serve.validate()
        # Answer while the first load is still arriving (worker.cold_start); a factory's modules only:
        # an --hf model is built from its version's config.json once loaded.
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
        self.factory_name = hf.name if hf is not None else factory_name or getattr(factory, "__qualname__", repr(factory))
        self.heat_report_s = heat_report_s
        self._heat: ForwardHeat | None = None  # the heat of self._module; requests hold it (forward_heat)
        self._heat_due: list[ForwardHeat] = []  # retired heats whose last holder is done: the heat loop reports them
        self._heat_wake = threading.Event()
        self._lock = threading.Lock()
        self._module: torch.nn.Module | None = None
        self._loaded: LoadedModel | None = None
        self.metrics = ServeMetrics()
        rc = serve.result_cache
        if store is None and rc.redis_url is not None:
            try:
                store = RedisResultStore(rc.redis_url, timeout_s=rc.redis_timeout_s, max_connections=serve.max_connections)
            except (ValueError, TypeError) as exc:  # redis-py's word for a malformed URL
                raise ConfigError(f"--result-cache-redis: {exc}; give redis://HOST:PORT/DB") from None
        self.admission = Admission(serve.admission)
        self.results = ResultService(rc, self.admission, self.metrics, store, request_timeout_s=serve.request_timeout_s)
        self.swapper = HotSwapper(client, ref, device, cache, config=config, on_swap=self._on_swap)
        self._stop = threading.Event()
        self._loaded_event = threading.Event()
        self._http: _Server | None = None
        # Registration with routers, pre-warm, versions loaded on demand (--router, POST /prewarm, --other-versions)
        if not 0 <= other_versions <= 64:
            raise ConfigError(f"other_versions must be 0..64, got {other_versions}")
        self.other_versions = other_versions
        self._others: OrderedDict[tuple[str, int], Serving] = OrderedDict()
        self._others_lock = threading.Lock()
        self._others_loading: dict[tuple[str, int], threading.Lock] = {}
        self._prewarms: OrderedDict[tuple[str, int], _Prewarm] = OrderedDict()
        self._prewarm_lock = threading.Lock()
        self.last_load: LoadReport | None = None
        self.last_swap: LoadReport | None = None
        self.routers: tuple[str, ...] = ()
        self.worker_id = ""
        self.advertise = ""
        self.router_error: str | None = None
        self.beats_sent = 0
        self._router_token: str | None = None

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
        self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network)
        self.metrics.version.labels(new.info.model).set(new.info.number)
        if old_heat is not None and old_heat.retire():  # else the last request still on the old module reports it
            self._report_final(old_heat)

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

    def _release(self, heat: ForwardHeat | None) -> None:
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
        served = self._serving(hold=False)
        return served.module, served.loaded

    def _serving(self, hold: bool = True) -> Serving:
        """The module served now, its version and (held, when ``hold``: release it with ``_release``) its heat."""
        with self._lock:
            if self._module is None or self._loaded is None:
                if self.load_error is not None:
                    raise WorkerError(f"the model could not be loaded: {self.load_error}")
                raise WorkerError("no model loaded yet")
            heat = self._heat if hold else None
            if heat is not None:
                heat.hold()
            return Serving(self._module, self._loaded, heat)

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

    # ------------------------------------------------------------------ answering

    def _dtype(self, module: torch.nn.Module) -> torch.dtype:
        params = list(module.parameters())
        return params[0].dtype if params and params[0].is_floating_point() else torch.float32

    def _forward(self, module: torch.nn.Module, data: Any, request: dict[str, Any] | None = None) -> Computed:
        """One forward pass; a request the model cannot run is a 400 (cached briefly), not an error."""
        try:
            if self.hf is not None:
                return Computed(200, canonical_json(self.hf.forward(module, request or {"input": data}, self.swapper.device)))
            x = torch.tensor(data, dtype=self._dtype(module), device=self.swapper.device)
            with torch.no_grad():
                y = module(x)
            output = json_values(y) if isinstance(y, torch.Tensor) else y
            return Computed(200, canonical_json({"output": output}))
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            return Computed(400, canonical_json({"error": f"the model cannot run this input: {str(exc)[:500]}"}))

    def infer(self, data: Any, use_cache: bool = True, request: dict[str, Any] | None = None,
              target: Serving | None = None) -> tuple[Answer, LoadedModel]:
        """Answer one request on the version loaded now (or on ``target``, from ``target_for``, whose heat
        this releases). ``request``: every field that may change the output (the key's request part;
        default ``{"input": data}``)."""
        module, loaded, heat = target if target is not None else self._serving()
        try:
            key = None
            keyed = request if request is not None else {"input": data}
            try:  # one canonical pass over the request: the key's, or (no key) a check that JSON can carry it
                if use_cache and self.results.config.enabled and not self._is_cold(module):
                    params = {"dtype": str(self._dtype(module)), "device": self.swapper.device.type, "factory": self.factory_name}
                    key = result_key(loaded.manifest.fingerprint, keyed, params)
                else:
                    canonical_json(keyed)
            except ValueError as exc:  # a number out of float range (1e999): not JSON we can key
                raise BadRequest(f"the request holds a number JSON cannot carry ({exc})") from None
            except RecursionError:
                raise BadRequest("the body nests too deeply to be an input; send a JSON list of numbers") from None
            return self.results.answer(key, lambda: self._forward(module, data, request)), loaded
        finally:
            self._release(heat)

    def _is_cold(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is a cold start's, still being filled: its answers are not cached, as
        a forward that reads a weight past the pre-hooks (outside its owner's forward) could read
        bytes not landed yet, and a cached answer would outlive the load."""
        with self._lock:
            return self._cold is not None and module is self._cold.module

    def handle_infer(self, raw: bytes | bytearray, want: str | None = None, exact: bool = False) -> tuple[int, bytes, dict[str, str]]:
        """HTTP status, body and extra headers for one ``POST /infer`` body; counts it in the metrics.

        ``want`` (a router's ``X-Pdparams-Want: MODEL@N``): the version asked for; with ``exact`` False
        (a tag request) the version of that model loaded now does as well."""
        started = time.monotonic()
        outcome = "error"
        try:
            request, use_cache = parse_request(raw)
            target = self.target_for(want, exact) if want else None
            answer, loaded = self.infer(request["input"], use_cache, request, target)
            outcome = answer.outcome
            body = with_fields(answer.body, model=loaded.info.model, version=loaded.info.number,
                               fingerprint=loaded.manifest.fingerprint, cache=answer.outcome)
            return answer.status, body, {}
        except BadRequest as exc:
            return 400, canonical_json({"error": str(exc)}), {}
        except Misdirected as exc:
            return MISDIRECTED, canonical_json({"error": str(exc)}), {}
        except UnknownVersion as exc:
            return 404, canonical_json({"error": str(exc)}), {}
        except Shed as exc:
            outcome = "shed"
            return 503, canonical_json({"error": str(exc)}), {"Retry-After": str(exc.retry_after_s)}
        except TimeoutError as exc:
            return 504, canonical_json({"error": str(exc)}), {}
        except WorkerError as exc:
            return 503, canonical_json({"error": str(exc)}), {"Retry-After": "1"}
        except Exception as exc:  # noqa: BLE001 - one failed request must not take the worker down
            return 500, canonical_json({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}), {}
        finally:
            self.metrics.requests.labels(outcome).inc()
            self.metrics.seconds.observe(time.monotonic() - started)

    def health(self) -> dict[str, Any]:
        with self._lock:
            loaded, cold = self._loaded, self._cold
        err = self.swapper.last_error
        state = "loading" if cold is not None else "failed" if self.load_error else "ready" if loaded else "starting"
        return {"state": state, "progress": round(cold.progress(), 4) if cold is not None else (1.0 if loaded else 0.0),
                "load_error": self.load_error,
                "model": self.swapper.ref.model, "tag": self.swapper.ref.tag, "version": loaded.info.number if loaded else None,
                "fingerprint": loaded.manifest.fingerprint if loaded else None,
                "swaps": self.swapper.swaps, "last_error": str(err) if err else None,
                "result_cache": {"l1_bytes": self.results.l1.bytes if self.results.l1 else 0,
                                 "redis": self.results.store is not None, "breaker": self.results.breaker.state},
                "queue": self.admission.waiting, "running": self.admission.running,
                "last_load": _tiers(self.last_load) if self.last_load is not None else None,
                "last_swap": _tiers(self.last_swap) if self.last_swap is not None else None,
                "prewarm": [p.to_json() for p in self._prewarm_list()],
                "other_versions": [f"{m}@{v}" for m, v in self._other_keys()],
                "router": {"urls": list(self.routers), "worker_id": self.worker_id, "beats": self.beats_sent,
                           "last_error": self.router_error} if self.routers else None}

    # ------------------------------------------------------------------ other versions, pre-warm, heartbeats

    def _other_keys(self) -> list[tuple[str, int]]:
        with self._others_lock:
            return list(self._others)

    def _prewarm_list(self) -> list[_Prewarm]:
        with self._prewarm_lock:
            return list(self._prewarms.values())

    def target_for(self, want: str, exact: bool) -> Serving:
        """The module to answer a request for ``want`` (``MODEL@N``): the one served (its heat held for
        ``infer``), a version loaded on demand (``other_versions`` > 0, least recently used dropped
        first), else Misdirected."""
        try:
            ref = ModelRef.parse(want)
        except ClientError:
            raise BadRequest(f"{WANT_HEADER} {want!r} is not MODEL@N") from None
        if ref.version is None:
            raise BadRequest(f"{WANT_HEADER} {want!r} is not MODEL@N")
        served = self._serving()
        loaded = served.loaded
        if loaded.info.model == ref.model and (not exact or loaded.info.number == ref.version):
            return served
        self._release(served.heat)
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
                self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network)
                with self._others_lock:
                    self._others[key] = built
                    while len(self._others) > self.other_versions:
                        self._others.popitem(last=False)
                return built
            finally:  # loaded or failed: the gate goes (a failed version must not leave one behind)
                with self._others_lock:
                    if self._others_loading.get(key) is gate:
                        del self._others_loading[key]

    def prewarm(self, model: str, version: int) -> _Prewarm:
        """Fetch ``model@version`` into the cache tiers in the background (throwaway CPU tensors, no swap);
        a later swap to it then reads its chunks from the tiers, not the network."""
        if self.swapper.cache is None:
            raise ConfigError("this worker has no cache tiers (--cache-mb 0 and no --disk-cache): nothing to pre-warm into")
        key = (model, version)
        with self._prewarm_lock:
            current = self._prewarms.get(key)
            if current is not None and current.state != "failed":
                return current
            entry = self._prewarms[key] = _Prewarm(model, version)
            while len(self._prewarms) > MAX_PREWARMED:
                oldest = next((k for k, p in self._prewarms.items() if p.state != "loading"), None)
                if oldest is None:
                    break
                del self._prewarms[oldest]
        threading.Thread(target=self._run_prewarm, args=(entry,), name="paramworker-prewarm", daemon=True).start()
        return entry

    def _run_prewarm(self, entry: _Prewarm) -> None:
        client = self.swapper.client
        try:
            info = client.resolve_ref(ModelRef(entry.model, None, entry.version))
            entry.manifest = client.manifest(info.manifest_id)
            handle = start_load(client, ModelRef(entry.model, None, entry.version), "cpu", self.swapper.cache,
                                config=self.swapper.config, info=info, manifest=entry.manifest, report_heat=False)
            _tensors, entry.report = handle.result()
            r = entry.report
            self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network)
            entry.state = "done"
        except Exception as exc:  # noqa: BLE001 - reported in /healthz and the heartbeat; serving goes on
            entry.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            entry.state = "failed"

    def _cached(self, model: str, version: int, manifest: Manifest) -> dict[str, Any]:
        # Every second, for every model held: from the manifest's columns, with one lock
        # acquisition per tier, not a ChunkRef and two lookups per chunk (half a million for a
        # big checkpoint at small chunks).
        cache = self.swapper.cache
        table = manifest.chunks
        rows = table.first_rows
        sizes = table.raw_size[rows].astype(np.int64)
        total = int(sizes.sum())
        cached = memory = disk = 0
        if cache is not None:
            all_ids = table.ids
            ids = [all_ids[k] for k in rows.tolist()]
            in_memory = np.asarray(cache.in_memory_many(ids), dtype=bool)
            on_disk = (np.asarray(cache.disk.contains_many(ids), dtype=bool) if cache.disk is not None
                       else np.zeros(len(ids), dtype=bool))
            memory, disk = int(sizes[in_memory].sum()), int(sizes[on_disk].sum())
            cached = int(sizes[in_memory | on_disk].sum())
        # the version number is the cluster's (a manifest is packed before its version is committed)
        return {"model": model, "version": version, "bytes_total": total, "bytes_cached": cached,
                "bytes_memory": memory, "bytes_disk": disk}

    def heartbeat(self) -> dict[str, Any]:
        """What this worker tells its routers every second (``worker.router_state.Heartbeat``)."""
        with self._lock:
            loaded = self._loaded
        with self._others_lock:
            others = [served.loaded for served in self._others.values()]
        held = ([loaded] if loaded is not None else []) + others
        manifests: dict[tuple[str, int], Manifest] = {(lm.info.model, lm.info.number): lm.manifest for lm in held}
        for p in self._prewarm_list():
            if p.manifest is not None:
                manifests.setdefault((p.model, p.version), p.manifest)
        free: int | None = None
        if self.swapper.device.type == "cuda":
            try:
                free = int(torch.cuda.mem_get_info(self.swapper.device)[0])
            except RuntimeError:
                free = None
        return {"worker_id": self.worker_id, "url": f"http://{self.advertise}", "serves": str(self.swapper.ref),
                "loaded": [{"model": lm.info.model, "version": lm.info.number} for lm in held],
                "cached": [self._cached(mv[0], mv[1], m) for mv, m in list(manifests.items())[:64]],
                "queue": self.admission.waiting, "running": self.admission.running,
                "max_queue": self.serve_config.admission.max_queue, "other_versions": self.other_versions,
                "any_model": self.hf is not None,
                "device_free_bytes": free}

    def _post_router(self, url: str, path: str, body: dict[str, Any], timeout: float) -> None:
        # Routers take beats only from holders of the cluster's read token.
        headers = {"Content-Type": "application/json", **dict(token_metadata(self._router_token))}
        request = urllib.request.Request(f"{url.rstrip('/')}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()

    def _beat_loop(self, url: str) -> None:
        """Beat to one router every second (one thread per router: a dead one never delays the others)."""
        while True:
            try:
                self._post_router(url, "/heartbeat", self.heartbeat(), timeout=HEARTBEAT_S)
                self.beats_sent += 1
            except (OSError, urllib.error.URLError, ValueError) as exc:
                self.router_error = f"{url}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a beat is skipped, the next one tries again
                self.router_error = f"heartbeat: {type(exc).__name__}: {exc}"
            if self._stop.wait(HEARTBEAT_S):
                return

    def register(self, routers: Sequence[str], advertise: str, worker_id: str | None = None, token: str | None = None) -> None:
        """Beat to every router in ``routers`` each second from now on (``advertise``: HOST:PORT they reach us at;
        ``token``: the read token the routers check beats against)."""
        for url in routers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--router {url!r} must be http://HOST:PORT")
        self.routers = tuple(u.rstrip("/") for u in routers)
        self._router_token = token
        self.advertise = advertise
        self.worker_id = worker_id or f"{socketlib.gethostname()}:{advertise.rpartition(':')[2]}"
        for url in self.routers:
            threading.Thread(target=self._beat_loop, args=(url,), name="paramworker-heartbeat", daemon=True).start()

    # ------------------------------------------------------------------ lifecycle

    def start(self, listen: str, poll_s: float) -> str:
        # Bound before the first load starts: a port taken is reported at once, not after the weights arrive.
        http = self._bind(listen)
        try:
            if self.cold_start:
                self._start_cold()
            else:
                self.swapper.start()
                self._loaded_event.set()
        except BaseException:
            http.server_close()
            raise
        threading.Thread(target=self._heat_loop, name="paramworker-heat", daemon=True).start()
        if self.swapper.ref.tag is not None and poll_s > 0:
            def follow_after_load() -> None:  # tag checks begin once the first version is in
                self._loaded_event.wait()
                if self.load_error is None:
                    self.swapper.follow(poll_s, self._stop)
            threading.Thread(target=follow_after_load, name="paramworker-follow-start", daemon=True).start()
        self._http = http
        threading.Thread(target=http.serve_forever, name="paramworker-http", daemon=True).start()
        h, p = http.socket.getsockname()[:2]
        return f"{h}:{p}"

    def _bind(self, listen: str) -> _Server:
        host, _, port = listen.rpartition(":")
        try:
            port_no = int(port or 0)
        except ValueError:
            raise ConfigError(f"--listen {listen!r} must be HOST:PORT") from None
        if not 0 <= port_no <= 65535:
            raise ConfigError(f"--listen {listen!r}: port must be 0..65535 (0 picks a free one)")
        try:
            return _Server((host or "127.0.0.1", port_no), _handler(self), self.serve_config.max_connections)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"--listen {listen}: port {port_no} is in use; pick another --listen "
                                  "(port 0 picks a free one)") from None
            raise ConfigError(f"--listen {listen}: cannot listen there ({exc.strerror or exc}); give a local "
                              "HOST:PORT") from None

    def stop(self) -> None:
        self._stop.set()
        for url in self.routers:
            try:
                self._post_router(url, "/leave", {"worker_id": self.worker_id}, timeout=1.0)
            except (OSError, urllib.error.URLError, ValueError):
                pass  # the router drops us when the lease runs out
        self._heat_wake.set()
        self._report_due()
        self._report_heat(self._heat, force=True)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.results.close()


def _no_constant(name: str) -> Any:
    raise BadRequest(f"the request holds a number JSON cannot carry ({name})")


def parse_request(raw: bytes | bytearray) -> tuple[dict[str, Any], bool]:
    """(request without its ``cache`` field, whether to use the cache) of a ``POST /infer`` body.

    NaN and Infinity are refused here; a number that overflows to infinity (``1e999``) is refused by
    the one canonical pass over the request that ``ModelServer.infer`` makes (the result key's)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except BadRequest:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc}); send a JSON list or {{\"input\": [...]}}") from None
    except RecursionError:
        raise BadRequest("the body nests too deeply to be an input; send a JSON list of numbers") from None
    if isinstance(body, list):
        body = {"input": body}
    if not isinstance(body, dict) or body.get("input") is None:
        raise BadRequest('expected a JSON list or {"input": [...]}')
    use_cache = body.pop("cache", True)
    if not isinstance(use_cache, bool):
        raise BadRequest(f'"cache" must be true or false, got {use_cache!r}')
    return body, use_cache


def with_fields(body: bytes, **fields: Any) -> bytes:
    """A JSON object's bytes with ``fields`` added (without parsing the cached result again)."""
    extra = canonical_json(fields)[1:-1]
    if body.strip() in (b"{}", b""):
        return b"{" + extra + b"}"
    if not body.endswith(b"}"):
        raise ValueError("cached result is not a JSON object")
    return body[:-1] + b"," + extra + b"}"


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections``: beyond, a 503 is written at once."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        self.max_connections = max_connections
        self._active = 0
        self._count_lock = threading.Lock()
        self.refused = 0
        self._refuser = Refuser()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            self.refused += 1
            self._refuser.refuse(cast(socket, request))
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._active -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, not a traceback: a client that went away (or was too slow) is routine."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):  # BrokenPipeError, ConnectionResetError, ...
            log.debug("HTTP connection from %s ended: %s: %s", client_address, type(exc).__name__, exc)
        else:
            log.warning("HTTP connection from %s failed: %s: %s", client_address, type(exc).__name__, exc)


class _DeadlineReader(io.RawIOBase):
    """A connection's socket reads, each under the idle timeout and, once a request's first byte has
    arrived (``deadline`` set), under the time left before its read deadline: trickling one byte at
    a time does not restart the clock."""

    def __init__(self, sock: socket, idle_s: float, request_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_s
        self._request_s = request_s
        self.deadline: float | None = None  # None: waiting for a request's first byte

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout = self._idle_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not arrive within {self._request_s:g} s")
            timeout = min(timeout, left)
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._idle_s)  # writes keep the idle timeout
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self._request_s
        return n


def _handler(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    config = server.serve_config
    budget = ByteBudget(config.body_budget)
    chunk = min(BODY_CHUNK, budget.capacity)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = config.idle_timeout_s
        # Headers and body leave in two writes: without TCP_NODELAY, Nagle holds the body back
        # until the client's delayed ACK (about 40 ms per answer on a keep-alive connection).
        disable_nagle_algorithm = True

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection, config.idle_timeout_s, config.request_read_timeout_s)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.deadline = None  # the clock starts with this request's first byte
            super().handle_one_request()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, data: bytes, headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, json.dumps(body).encode())

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (a malformed request line, headers too long or too many) as
            JSON like every other answer, not an HTML page; the connection ends with them."""
            self.close_connection = True
            reason = message or self.responses.get(code, ("error",))[0]
            data = canonical_json({"error": f"{reason}; send POST /infer, POST /prewarm, GET /healthz or GET /metrics"})
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if getattr(self, "command", None) != "HEAD":
                self.wfile.write(data)

        def _not_allowed(self) -> None:
            self.close_connection = True  # a body, if any, is not read
            data = canonical_json({"error": f"method {self.command} is not served here; "
                                            "send POST /infer, POST /prewarm, GET /healthz or GET /metrics"})
            self.send_response(405)
            self.send_header("Allow", "GET, POST")
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 - http.server's method names

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/healthz", ""):
                self._json(200, server.health())
            elif path == "/metrics":
                self._send(200, server.metrics.render(), content_type=CONTENT_TYPE)
            else:
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer, GET /healthz or GET /metrics"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") == "/prewarm":
                self._prewarm()
                return
            if self.path.rstrip("/") not in ("/infer", ""):
                self._discard_body()
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer or POST /prewarm"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length <= 0 or length > config.max_body_bytes:
                self.close_connection = True  # the body (if any) is not read: this connection cannot go on
                self._json(400 if length <= config.max_body_bytes else 413,
                           {"error": f"send a JSON body of 1 to {config.max_body_bytes} bytes with a Content-Length"})
                return
            held = 0
            try:
                raw = bytearray(length)
                view = memoryview(raw)
                pos = 0
                while pos < length:  # the budget is taken as the bytes arrive, not for a Content-Length alone
                    n = min(chunk, length - pos)
                    if not budget.acquire(n, config.body_budget_wait_s):
                        self._shed_body()
                        return
                    held += n
                    end = pos + n
                    while pos < end:
                        got = self.rfile.readinto(view[pos:end])
                        if not got:  # the client went away mid-body
                            self.close_connection = True
                            return
                        pos += got
                view.release()
                want = self.headers.get(WANT_HEADER)
                code, data, headers = server.handle_infer(raw, want, self.headers.get(EXACT_HEADER, "1") != "0")
                del raw
            finally:
                budget.release(held)
            self._send(code, data, headers)

        def _shed_body(self) -> None:
            self.close_connection = True  # the rest of the body is not read
            server.metrics.requests.labels("shed").inc()
            retry = max(1, server.admission.retry_after_s())
            self._send(503, canonical_json({"error": f"overloaded: request bodies being read use the whole body budget "
                                                     f"({budget.capacity} bytes); retry after {retry} s"}),
                       {"Retry-After": str(retry), "Connection": "close"})

        def _prewarm(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 < length <= 4096:
                self.close_connection = True
                self._json(400, {"error": 'send {"model": NAME, "version": N} with a Content-Length'})
                return
            try:
                body = json.loads(self.rfile.read(length))
                model, version = body["model"], body["version"]
                if not isinstance(model, str) or isinstance(version, bool) or not isinstance(version, int) or version < 1:
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                self._json(400, {"error": 'send {"model": NAME, "version": N} (N >= 1)'})
                return
            try:
                entry = server.prewarm(model, version)
            except ConfigError as exc:
                self._json(409, {"error": str(exc)})
                return
            self._json(202, entry.to_json())

        def _discard_body(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            if 0 < length <= config.max_body_bytes:
                while length > 0:  # read and dropped a chunk at a time: no memory for a body nobody needs
                    got = len(self.rfile.read(min(chunk, length)))
                    if not got:
                        self.close_connection = True
                        return
                    length -= got
            elif length:
                self.close_connection = True

    return Handler


__all__ = ["BadRequest", "ModelServer", "ServeConfig", "load_factory", "parse_request", "with_fields"]
