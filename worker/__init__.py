"""GPU workers: load model versions from the cluster into tensors, cache their chunks, serve them.

The public Python API (docs/python-api.md)::

    from worker import load_state_dict, load_into, empty_weights, start_load, stream_weights

- ``worker.loader``: ``load_state_dict("resnet50:prod", device=...)`` (cluster, token and TLS from
  the environment or ``PARAMS_CONFIG``, as for the CLIs) or ``load_state_dict(cluster, ref, ...)``,
  ``load_into(module, ref)``, ``start_load`` (tensors usable as their chunks land).
- ``worker.weight_stream``: ``stream_weights(ref)``, ``(name, tensor)`` pairs as each tensor
  completes, for an engine's own weight loading (vLLM's ``--load-format pdparams``:
  ``worker.vllm_loader``).
- ``worker.module_fill``: ``empty_weights`` (modules built without parameter storage) and
  ``fill_module`` (loaded tensors put in place).
- ``worker.tiered_cache`` / ``worker.lru_k`` / ``worker.disk_cache``: the memory and disk tiers.
- ``worker.prefetch``, ``worker.staging``, ``worker.readiness``: filling tensors, pinned staging;
  ``worker.upload``: a host-staged load's tensors going up to the device whole.
- ``worker.swap`` (follow a tag), ``worker.serve`` and ``worker.cli`` (``paramworker``).

The cluster client itself is ``paramserver.client.ClusterClient``. The five names above are
imported on first use (module ``__getattr__``), so importing ``worker`` or the cache algorithms
does not import torch or gRPC.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.loader import load_into as load_into
    from worker.loader import load_state_dict as load_state_dict
    from worker.loader import start_load as start_load
    from worker.module_fill import empty_weights as empty_weights
    from worker.weight_stream import stream_weights as stream_weights

# public name -> the module that defines it
_LAZY = {"load_state_dict": "worker.loader", "load_into": "worker.loader", "start_load": "worker.loader",
         "empty_weights": "worker.module_fill", "stream_weights": "worker.weight_stream"}

__all__ = ["empty_weights", "load_into", "load_state_dict", "start_load", "stream_weights"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
