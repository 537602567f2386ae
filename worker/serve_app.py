"""``ModelServer``: the composition root of ``paramworker serve``.

It wires the model lifecycle (``worker.model_lifecycle``: the version served, swaps, cold start,
other versions, pre-warm), inference through the result cache (``worker.inference``), admission,
metrics, the router link (``worker.router_link``) and the HTTP front (``worker.serve_http``), and
answers what the front asks of it (``serve_http.App``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paramserver.client.session import ClusterClient
from worker.admission import Admission
from worker.config import PrefetchConfig
from worker.errors import ConfigError, UnknownVersion
from worker.hf import HFServing
from worker.inference import Inference, open_result_store
from worker.loader import LoadedModel
from worker.model_lifecycle import ModelLifecycle, Prewarm, Serving, tiers
from worker.peer_link import PeerLink, PeerStats, link_of
from worker.result_service import Answer, ResultService
from worker.result_store import ResultStore
from worker.router_link import RouterLink
from worker.serve_http import HTTPFront, ServeConfig, answer_infer, bind
from worker.serve_metrics import ServeMetrics
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache
from worker.weights_digest import digest_answer

DEFAULT_SERVE = ServeConfig()  # frozen: one shared default is safe


class ModelServer:
    """The serving composition root: model lifecycle, result cache, admission, metrics, router link, HTTP.

    ``factory_name`` is part of every result key (two factories over the same weights are two
    models); ``store`` overrides the Redis store the config names (tests pass an in-memory one).
    ``hf`` instead of a factory serves a transformers model built from each version's config.json.
    ``admin_token``: what ``POST /prewarm`` and ``GET /weights/digest`` must carry (None: refused).
    ``peers``: the process's peer link (``worker.peer_link``; None: the one its client's loads
    start, if any): its counters are on /metrics, its address in /healthz.
    """

    def __init__(self, client: ClusterClient, ref: str, factory: Callable[[], torch.nn.Module] | None,
                 device: str | torch.device | None = "cpu", cache: TieredCache | None = None,
                 config: PrefetchConfig = PrefetchConfig(), heat_report_s: float = 60.0,
                 serve: ServeConfig = DEFAULT_SERVE, factory_name: str = "", store: ResultStore | None = None,
                 hf: HFServing | None = None, other_versions: int = 0, cold_start: bool = True,
                 admin_token: str | None = None, peers: PeerLink | None = None) -> None:
        self.serve_config = serve.validate()
        self._admin_token = admin_token
        self._client = client
        self._peers = peers
        self.metrics = ServeMetrics()
        self.metrics.watch_peers(self._peer_stats)
        # One stop for the whole worker: it ends following the tag and beating to routers at once.
        self._stop = threading.Event()
        self.models = ModelLifecycle(client, ref, factory, device, cache, config, self.metrics,
                                     heat_report_s=heat_report_s, hf=hf, other_versions=other_versions,
                                     cold_start=cold_start, stop=self._stop)
        self.factory_name = hf.name if hf is not None else factory_name or getattr(factory, "__qualname__", repr(factory))
        if store is None:
            store = open_result_store(serve.result_cache, serve.max_connections)
        self.admission = Admission(serve.admission)
        self.results = ResultService(serve.result_cache, self.admission, self.metrics, store,
                                     request_timeout_s=serve.request_timeout_s)
        self.inference = Inference(self.models, self.results, self.factory_name)
        self.link = RouterLink(self.models, self.admission, serve.admission.max_queue, self._stop)
        self._http: HTTPFront | None = None

    # ------------------------------------------------------------------ what callers ask of the parts

    @property
    def peers(self) -> PeerLink | None:
        return self._peers or link_of(self._client)

    def _peer_stats(self) -> PeerStats | None:
        link = self.peers
        return link.stats() if link is not None else None

    def weights_digest(self, model: str, version: int | None) -> dict[str, Any]:
        """Per-tensor BLAKE3 of the tensors of ``model`` (``version``, else the one served) this worker
        holds, to check them bit for bit against the pushed file (``worker.weights_digest``)."""
        loading, cold = self.models.current()
        for loaded in self.models.held():
            if loaded.info.model != model or (version is not None and loaded.info.number != version):
                continue
            if cold is not None and loaded is loading:
                raise ConfigError(f"{model} v{loaded.info.number} is still loading ({cold.progress():.0%}); ask again "
                                  "once /healthz says ready")
            return digest_answer(model, loaded.info.number, loaded.info.manifest_id, loaded.tensors)
        want = f"{model}@{version}" if version is not None else model
        raise UnknownVersion(f"this worker holds no {want}; GET /healthz says what it serves")

    @property
    def swapper(self) -> HotSwapper:
        return self.models.swapper

    @property
    def load_error(self) -> str | None:
        return self.models.load_error

    @property
    def load_exception(self) -> BaseException | None:
        return self.models.load_exception

    def snapshot(self) -> tuple[torch.nn.Module, LoadedModel]:
        return self.models.snapshot()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """True once the first load is complete (or failed: see ``load_error``)."""
        return self.models.wait_loaded(timeout)

    def target_for(self, want: str, exact: bool) -> Serving:
        return self.models.target_for(want, exact)

    def prewarm(self, model: str, version: int) -> Prewarm:
        return self.models.prewarm(model, version)

    def infer(self, data: Any, use_cache: bool = True, request: dict[str, Any] | None = None,
              target: Serving | None = None) -> tuple[Answer, LoadedModel]:
        return self.inference.infer(data, use_cache, request, target)

    def heartbeat(self) -> dict[str, Any]:
        return self.link.heartbeat()

    @property
    def admin_token(self) -> str | None:
        return self._admin_token

    def identity(self, nonce: str) -> dict[str, Any] | None:
        return self.link.identity(nonce)

    def register(self, routers: Sequence[str], advertise: str, worker_id: str | None = None, token: str | None = None) -> None:
        """Beat to every router in ``routers`` each second from now on (``worker.router_link``); ``token``:
        the worker token the routers check beats against."""
        self.link.register(routers, advertise, worker_id, token)

    def handle_infer(self, raw: bytes | bytearray, want: str | None = None, exact: bool = False) -> tuple[int, bytes, dict[str, str]]:
        """HTTP status, body and extra headers for one ``POST /infer`` body (``serve_http.answer_infer``)."""
        return answer_infer(raw, want, exact, self.metrics, self.models.target_for, self.inference.infer)

    def health(self) -> dict[str, Any]:
        models = self.models
        loaded, cold = models.current()
        err = models.swapper.last_error
        state = "loading" if cold is not None else "failed" if models.load_error else "ready" if loaded else "starting"
        return {"state": state, "progress": round(cold.progress(), 4) if cold is not None else (1.0 if loaded else 0.0),
                "load_error": models.load_error,
                "model": models.swapper.ref.model, "tag": models.swapper.ref.tag, "version": loaded.info.number if loaded else None,
                "fingerprint": loaded.manifest.fingerprint if loaded else None,
                "swaps": models.swapper.swaps, "last_error": str(err) if err else None,
                "result_cache": {"l1_bytes": self.results.l1.bytes if self.results.l1 else 0,
                                 "redis": self.results.store is not None, "breaker": self.results.breaker.state},
                "queue": self.admission.waiting, "running": self.admission.running,
                "last_load": tiers(models.last_load) if models.last_load is not None else None,
                "last_swap": tiers(models.last_swap) if models.last_swap is not None else None,
                "prewarm": [p.to_json() for p in models.prewarm_list()],
                "other_versions": [f"{m}@{v}" for m, v in models.other_keys()],
                "router": self.link.health(),
                "peers": {"address": self.peers.address} if self.peers is not None else None}

    # ------------------------------------------------------------------ lifecycle

    def start(self, listen: str, poll_s: float) -> str:
        # Bound before the first load starts: a port taken is reported at once, not after the weights arrive.
        http = bind(listen, self, self.serve_config)
        try:
            self.models.start(poll_s)
        except BaseException:
            http.server_close()
            raise
        self._http = http
        threading.Thread(target=http.serve_forever, name="paramworker-http", daemon=True).start()
        h, p = http.socket.getsockname()[:2]
        return f"{h}:{p}"

    def stop(self) -> None:
        self._stop.set()
        self.link.leave()
        self.models.stop()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.results.close()


__all__ = ["ModelServer"]
