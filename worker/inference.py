"""One inference request of ``paramworker serve`` through the result cache (``worker.result_service``).

Results are keyed by the version's model fingerprint, the request and what else changes the
output (dtype, device, factory), so a request after a swap never gets the old version's answer;
a cold start's answers are never kept. A request the model cannot run is a 400 answer (cached
briefly like any other), not an error.
"""
from __future__ import annotations

from typing import Any

import torch

from worker.errors import BadRequest, ConfigError
from worker.model_lifecycle import ModelLifecycle, Serving
from worker.outputs import json_values
from worker.loader import LoadedModel
from worker.result_cache import ResultCacheConfig, canonical_json, result_key
from worker.result_service import Answer, Computed, ResultService
from worker.result_store import RedisResultStore, ResultStore


def open_result_store(config: ResultCacheConfig, max_connections: int) -> ResultStore | None:
    """The Redis store (L2 and leases) the config names, or None (none named)."""
    if config.redis_url is None:
        return None
    try:
        return RedisResultStore(config.redis_url, timeout_s=config.redis_timeout_s, max_connections=max_connections,
                                password=config.redis_password)
    except (ValueError, TypeError) as exc:  # redis-py's word for a malformed URL
        raise ConfigError(f"--result-cache-redis: {exc}; give redis://HOST:PORT/DB") from None


def dtype_of(module: torch.nn.Module) -> torch.dtype:
    """The dtype a request's input is made in: the module's first parameter's, if floating."""
    params = list(module.parameters())
    return params[0].dtype if params and params[0].is_floating_point() else torch.float32


class Inference:
    """Forward passes on the lifecycle's modules, answered through the result cache.

    ``factory_name`` is part of every result key (two factories over the same weights are two models).
    """

    def __init__(self, models: ModelLifecycle, results: ResultService, factory_name: str) -> None:
        self.models = models
        self.results = results
        self.factory_name = factory_name

    def _forward(self, module: torch.nn.Module, data: Any, request: dict[str, Any] | None = None) -> Computed:
        """One forward pass; a request the model cannot run is a 400 (cached briefly), not an error."""
        device = self.models.swapper.device
        try:
            if self.models.hf is not None:
                return Computed(200, canonical_json(self.models.hf.forward(module, request or {"input": data}, device)))
            x = torch.tensor(data, dtype=dtype_of(module), device=device)
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
        models = self.models
        module, loaded, heat = target if target is not None else models.serving()
        try:
            key = None
            keyed = request if request is not None else {"input": data}
            try:  # one canonical pass over the request: the key's, or (no key) a check that JSON can carry it
                if use_cache and self.results.config.enabled and not models.is_cold(module):
                    params = {"dtype": str(dtype_of(module)), "device": models.swapper.device.type, "factory": self.factory_name}
                    key = result_key(loaded.manifest.fingerprint, keyed, params)
                else:
                    canonical_json(keyed)
            except ValueError as exc:  # a number out of float range (1e999): not JSON we can key
                raise BadRequest(f"the request holds a number JSON cannot carry ({exc})") from None
            except RecursionError:
                raise BadRequest("the body nests too deeply to be an input; send a JSON list of numbers") from None
            return self.results.answer(key, lambda: self._forward(module, data, request)), loaded
        finally:
            models.release(heat)


__all__ = ["Inference", "dtype_of", "open_result_store"]
