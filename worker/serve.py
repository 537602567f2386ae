"""``paramworker serve``: keep a module loaded, follow its tag, answer inference over HTTP.

Endpoints (stdlib ``http.server``, HTTP/1.1 keep-alive, JSON):
- ``POST /infer`` with a JSON list (nested lists of numbers) or ``{"input": [...], "cache": true}``:
  runs the module on ``torch.tensor(input)`` and answers ``{"output": [...], "model", "version",
  "fingerprint", "cache"}``; ``cache`` says how it was answered (``hit_l1``, ``hit_l2``,
  ``computed``, ``joined``). ``"cache": false`` skips the result cache for that request.
  503 with ``Retry-After`` when the worker sheds load; 400 for a request the model cannot run.
- ``POST /prewarm`` with ``{"model", "version"}``: fetch that version into the cache tiers.
- ``GET /healthz``: ``{"model", "tag", "version", "swaps", "last_error", ...}``.
- ``GET /metrics``: Prometheus text (``worker.serve_metrics``).
- ``GET /weights/digest?model=NAME[&version=N]`` (admin token): per-tensor BLAKE3 of the tensors
  held (``worker.weights_digest``), to check them against the pushed file.

This module is the facade of the names callers import; the work is split by job:

- ``worker.serve_app``: ``ModelServer``, the composition root.
- ``worker.serve_http``: the HTTP front (connections and their bounds, request parsing, answers).
- ``worker.model_lifecycle``: the version served, hot swaps following a tag, cold start, versions
  loaded on demand, pre-warm; ``load_factory``.
- ``worker.inference``: a request through the result cache (keyed by the version's model
  fingerprint, so a request after a swap never gets the old version's answer).
- ``worker.router_link``: heartbeats to ``paramrouter``.

Modules of the package import those, never this facade.
"""
from __future__ import annotations

from worker.errors import BadRequest, Misdirected, UnknownVersion
from worker.model_lifecycle import MAX_PREWARMED, Serving, load_factory
from worker.serve_app import ModelServer
from worker.serve_http import BODY_CHUNK, MAX_BODY, ServeConfig, parse_request, with_fields

__all__ = ["BODY_CHUNK", "MAX_BODY", "MAX_PREWARMED", "BadRequest", "Misdirected", "ModelServer", "ServeConfig",
           "Serving", "UnknownVersion", "load_factory", "parse_request", "with_fields"]
