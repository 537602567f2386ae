"""``paramworker serve``: keep a module loaded, follow its tag, answer inference over HTTP.

Endpoints (stdlib ``http.server``, HTTP/1.1 keep-alive, JSON):
- ``POST /infer`` with a JSON list (nested lists of numbers) or ``{"input": [...], "cache": true}``:
  runs the module on ``torch.tensor(input)`` and answers ``{"output": [...], "model", "version",
  "fingerprint", "cache"}``; ``cache`` says how it was answered (``hit_l1``, ``hit_l2``,
  ``computed``, ``joined``). ``"cache": false`` skips the result cache for that request.
  503 with ``Retry-After`` when the worker sheds load; 400 for a request the model cannot run.
- ``GET /healthz``: ``{"model", "tag", "version", "swaps", "last_error", ...}``.
- ``GET /metrics``: Prometheus text (``worker.serve_metrics``).

A tag move loads the new version beside the old one (only changed chunks travel), builds a new
module from the factory (under ``worker.loader.empty_weights``: parameters on meta, buffers as the
constructor makes them), and swaps the module reference; requests in flight finish on the old one.
With ``--hf`` (``worker.hf.HFServing``) there is no factory: each version's ``config.json`` builds a
transformers model, and ``/infer`` takes token ids (``paramworker serve --help`` has the JSON contract).
Results are cached by the version's model fingerprint (``worker.result_service``), so a request
after the swap never gets the old version's answer; each answer names the version it came from.
"""
from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import socket
from typing import Any, cast

import torch

from paramserver.client.session import ClusterClient
from worker.admission import Admission, AdmissionConfig, Shed
from worker.config import PrefetchConfig
from worker.errors import ConfigError, WorkerError
from worker.forward_heat import ForwardHeat
from worker.hf import HFServing
from worker.loader import LoadedModel, empty_weights, fill_module
from worker.result_cache import ResultCacheConfig, canonical_json, result_key
from worker.result_service import Answer, Computed, ResultService
from worker.result_store import RedisResultStore, ResultStore
from worker.serve_metrics import CONTENT_TYPE, ServeMetrics
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache

MAX_BODY = 64 << 20


@dataclass(frozen=True)
class ServeConfig:
    """How ``paramworker serve`` answers: result cache, admission, connection and time bounds."""

    result_cache: ResultCacheConfig = field(default_factory=ResultCacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_connections: int = 512  # open HTTP connections (one thread each); beyond: 503 at once
    request_timeout_s: float = 60.0  # a request waiting on an identical one gives up after this
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request is closed after this
    max_body_bytes: int = MAX_BODY

    def validate(self) -> ServeConfig:
        self.result_cache.validate()
        self.admission.validate()
        if not 1 <= self.max_connections <= 100_000:
            raise ConfigError(f"max_connections must be 1..100000, got {self.max_connections}")
        for name in ("request_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"{name} must be in (0, 3600] seconds, got {value}")
        if not 1 <= self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be 1 B..1 GiB, got {self.max_body_bytes}")
        return self


class BadRequest(WorkerError, ValueError):
    """The request body is not something the model can run; answered 400."""


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """``package.module:function`` -> the function (called with no arguments, returns an nn.Module)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise WorkerError(f"--factory {spec!r} must be package.module:function")
    try:
        fn: object = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise WorkerError(f"--factory {spec!r} cannot be imported ({exc}); is the package on PYTHONPATH?") from None
    if not callable(fn):
        raise WorkerError(f"--factory {spec!r} is not callable")
    return cast("Callable[[], torch.nn.Module]", fn)  # what it returns is checked where it is called


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
                 hf: HFServing | None = None) -> None:
        self.serve_config = serve.validate()
        if (factory is None) == (hf is None):
            raise ConfigError("serve needs exactly one of a factory (--factory) and a Hugging Face model (--hf)")
        if hf is not None:
            hf.check()
        self.factory = factory
        self.hf = hf
        self.factory_name = hf.name if hf is not None else factory_name or getattr(factory, "__qualname__", repr(factory))
        self.heat_report_s = heat_report_s
        self._heat: ForwardHeat | None = None
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
        self._http: _Server | None = None

    def _on_swap(self, new: LoadedModel, _old: LoadedModel | None) -> None:
        if self.hf is not None:
            module = self.hf.build(self.swapper.client, new, self.swapper.device)
        else:
            assert self.factory is not None
            with empty_weights():  # parameters on meta; buffers keep the constructor's values
                module = self.factory()
            fill_module(module, new.tensors, self.swapper.device)
        module.eval()
        heat = ForwardHeat(module, new.manifest, version=new.info.number, sink=self.swapper.client, report_every_s=self.heat_report_s)
        with self._lock:  # readers take the reference under this lock: they see old or new, never a mix
            self._module, self._loaded = module, new
            old_heat, self._heat = self._heat, heat
        r = new.report
        self.metrics.loaded(r.bytes_memory, r.bytes_disk, r.bytes_network)
        self.metrics.version.labels(new.info.model).set(new.info.number)
        if old_heat is not None:
            old_heat.detach()
            self._report_heat(old_heat, force=True)

    def _report_heat(self, heat: ForwardHeat | None, force: bool = False) -> None:
        if heat is None:
            return
        try:
            heat.report_if_due(force=force)
        except Exception:  # noqa: BLE001 - heat is advisory; serving must not suffer from a failed report
            pass

    def _heat_loop(self) -> None:
        while not self._stop.wait(min(5.0, self.heat_report_s)):
            self._report_heat(self._heat)

    def snapshot(self) -> tuple[torch.nn.Module, LoadedModel]:
        with self._lock:
            if self._module is None or self._loaded is None:
                raise WorkerError("no model loaded yet")
            return self._module, self._loaded

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
            output = y.float().cpu().tolist() if isinstance(y, torch.Tensor) else y
            return Computed(200, canonical_json({"output": output}))
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            return Computed(400, canonical_json({"error": f"the model cannot run this input: {str(exc)[:500]}"}))

    def infer(self, data: Any, use_cache: bool = True, request: dict[str, Any] | None = None) -> tuple[Answer, LoadedModel]:
        """Answer one request on the version loaded now. ``request``: every field that may change
        the output (the key's request part; default ``{"input": data}``)."""
        module, loaded = self.snapshot()
        key = None
        if use_cache and self.results.config.enabled:
            params = {"dtype": str(self._dtype(module)), "device": self.swapper.device.type, "factory": self.factory_name}
            key = result_key(loaded.manifest.fingerprint, request if request is not None else {"input": data}, params)
        return self.results.answer(key, lambda: self._forward(module, data, request)), loaded

    def handle_infer(self, raw: bytes) -> tuple[int, bytes, dict[str, str]]:
        """HTTP status, body and extra headers for one ``POST /infer`` body; counts it in the metrics."""
        started = time.monotonic()
        outcome = "error"
        try:
            request, use_cache = parse_request(raw)
            answer, loaded = self.infer(request["input"], use_cache, request)
            outcome = answer.outcome
            body = with_fields(answer.body, model=loaded.info.model, version=loaded.info.number,
                               fingerprint=loaded.manifest.fingerprint, cache=answer.outcome)
            return answer.status, body, {}
        except BadRequest as exc:
            return 400, canonical_json({"error": str(exc)}), {}
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
            loaded = self._loaded
        err = self.swapper.last_error
        return {"model": self.swapper.ref.model, "tag": self.swapper.ref.tag, "version": loaded.info.number if loaded else None,
                "fingerprint": loaded.manifest.fingerprint if loaded else None,
                "swaps": self.swapper.swaps, "last_error": str(err) if err else None,
                "result_cache": {"l1_bytes": self.results.l1.bytes if self.results.l1 else 0,
                                 "redis": self.results.store is not None, "breaker": self.results.breaker.state},
                "queue": self.admission.waiting, "running": self.admission.running}

    # ------------------------------------------------------------------ lifecycle

    def start(self, listen: str, poll_s: float) -> str:
        host, _, port = listen.rpartition(":")
        try:
            port_no = int(port or 0)
        except ValueError:
            raise ConfigError(f"--listen {listen!r} must be HOST:PORT") from None
        self.swapper.start()
        threading.Thread(target=self._heat_loop, name="paramworker-heat", daemon=True).start()
        if self.swapper.ref.tag is not None and poll_s > 0:
            self.swapper.follow(poll_s, self._stop)
        self._http = _Server((host or "127.0.0.1", port_no), _handler(self), self.serve_config.max_connections)
        threading.Thread(target=self._http.serve_forever, name="paramworker-http", daemon=True).start()
        h, p = self._http.socket.getsockname()[:2]
        return f"{h}:{p}"

    def stop(self) -> None:
        self._stop.set()
        self._report_heat(self._heat, force=True)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.results.close()


def parse_request(raw: bytes) -> tuple[dict[str, Any], bool]:
    """(request without its ``cache`` field, whether to use the cache) of a ``POST /infer`` body."""
    try:
        body = json.loads(raw)
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
    try:
        canonical_json(body)
    except ValueError as exc:  # NaN or Infinity: not JSON we can key
        raise BadRequest(f"the request holds a number JSON cannot carry ({exc})") from None
    except RecursionError:
        raise BadRequest("the body nests too deeply to be an input; send a JSON list of numbers") from None
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
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            self.refused += 1
            body = b'{"error":"overloaded: too many open connections; retry later"}'
            try:
                cast(socket, request).sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._active -= 1


def _handler(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    config = server.serve_config

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = config.idle_timeout_s
        # Headers and body leave in two writes: without TCP_NODELAY, Nagle holds the body back
        # until the client's delayed ACK (about 40 ms per answer on a keep-alive connection).
        disable_nagle_algorithm = True

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

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path in ("/healthz", ""):
                self._json(200, server.health())
            elif path == "/metrics":
                self._send(200, server.metrics.render(), content_type=CONTENT_TYPE)
            else:
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer, GET /healthz or GET /metrics"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("/infer", ""):
                self._discard_body()
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer"})
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
            code, data, headers = server.handle_infer(self.rfile.read(length))
            self._send(code, data, headers)

        def _discard_body(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            if 0 < length <= config.max_body_bytes:
                self.rfile.read(length)
            elif length:
                self.close_connection = True

    return Handler


__all__ = ["BadRequest", "ModelServer", "ServeConfig", "load_factory", "parse_request", "with_fields"]
