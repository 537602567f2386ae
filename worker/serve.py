"""``paramworker serve``: keep a module loaded, follow its tag, answer inference over HTTP.

Endpoints (stdlib ``http.server``, JSON):
- ``POST /infer`` with a JSON list (nested lists of numbers) or ``{"input": [...]}``: runs the
  module on ``torch.tensor(input)`` and answers ``{"output": [...], "model", "version"}``.
- ``GET /healthz``: ``{"model", "tag", "version", "swaps", "last_error"}``.

A tag move loads the new version beside the old one (only changed chunks travel), builds a new
module from the factory, and swaps the module reference; requests in flight finish on the old one.
"""
from __future__ import annotations

import importlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import torch

from paramserver.client.session import ClusterClient
from worker.config import PrefetchConfig
from worker.errors import WorkerError
from worker.loader import LoadedModel, fill_module
from worker.forward_heat import ForwardHeat
from worker.swap import HotSwapper
from worker.tiered_cache import TieredCache

MAX_BODY = 64 << 20


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
    def __init__(self, client: ClusterClient, ref: str, factory: Callable[[], torch.nn.Module],
                 device: str | torch.device | None = "cpu", cache: TieredCache | None = None,
                 config: PrefetchConfig = PrefetchConfig(), heat_report_s: float = 60.0) -> None:
        self.factory = factory
        self.heat_report_s = heat_report_s
        self._heat: ForwardHeat | None = None
        self._lock = threading.Lock()
        self._module: torch.nn.Module | None = None
        self._loaded: LoadedModel | None = None
        self.swapper = HotSwapper(client, ref, device, cache, config=config, on_swap=self._on_swap)
        self._stop = threading.Event()
        self._http: ThreadingHTTPServer | None = None

    def _on_swap(self, new: LoadedModel, _old: LoadedModel | None) -> None:
        with torch.device("meta"):
            module = self.factory()
        fill_module(module, new.tensors, self.swapper.device)
        module.eval()
        heat = ForwardHeat(module, new.manifest, version=new.info.number, sink=self.swapper.client, report_every_s=self.heat_report_s)
        with self._lock:  # readers take the reference under this lock: they see old or new, never a mix
            self._module, self._loaded = module, new
            old_heat, self._heat = self._heat, heat
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

    def infer(self, data: Any) -> dict[str, Any]:
        module, loaded = self.snapshot()
        params = list(module.parameters())
        dtype = params[0].dtype if params and params[0].is_floating_point() else torch.float32
        x = torch.tensor(data, dtype=dtype, device=self.swapper.device)
        with torch.no_grad():
            y = module(x)
        return {"output": y.float().cpu().tolist(), "model": loaded.info.model, "version": loaded.info.number}

    def health(self) -> dict[str, Any]:
        with self._lock:
            loaded = self._loaded
        err = self.swapper.last_error
        return {"model": self.swapper.ref.model, "tag": self.swapper.ref.tag, "version": loaded.info.number if loaded else None,
                "swaps": self.swapper.swaps, "last_error": str(err) if err else None}

    def start(self, listen: str, poll_s: float) -> str:
        self.swapper.start()
        threading.Thread(target=self._heat_loop, name="paramworker-heat", daemon=True).start()
        if self.swapper.ref.tag is not None and poll_s > 0:
            self.swapper.follow(poll_s, self._stop)
        host, _, port = listen.rpartition(":")
        self._http = ThreadingHTTPServer((host or "127.0.0.1", int(port or 0)), _handler(self))
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="paramworker-http", daemon=True).start()
        h, p = self._http.socket.getsockname()[:2]
        return f"{h}:{p}"

    def stop(self) -> None:
        self._stop.set()
        self._report_heat(self._heat, force=True)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _handler(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/healthz", ""):
                self._send(200, server.health())
            else:
                self._send(404, {"error": f"no endpoint {self.path}; use POST /infer or GET /healthz"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") not in ("/infer", ""):
                self._send(404, {"error": f"no endpoint {self.path}; use POST /infer"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length <= 0 or length > MAX_BODY:
                self._send(400, {"error": f"send a JSON body of 1 to {MAX_BODY} bytes"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                data = body.get("input") if isinstance(body, dict) else body
                if data is None:
                    raise ValueError('expected a JSON list or {"input": [...]}')
                self._send(200, server.infer(data))
            except (ValueError, TypeError, RuntimeError) as exc:
                self._send(400, {"error": str(exc)})
            except WorkerError as exc:
                self._send(503, {"error": str(exc)})

    return Handler


__all__ = ["ModelServer", "load_factory"]
