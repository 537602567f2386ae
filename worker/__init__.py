"""GPU workers: load model versions from the cluster into tensors, cache their chunks, serve them.

- ``worker.loader``: ``load_state_dict(cluster, "resnet50:prod", device=...)``,
  ``load_into(module, cluster, ref)``, ``start_load`` (tensors usable as their chunks land).
- ``worker.tiered_cache`` / ``worker.lru_k`` / ``worker.disk_cache``: the memory and disk tiers.
- ``worker.prefetch``, ``worker.staging``, ``worker.readiness``: filling tensors, pinned staging;
  ``worker.upload``: a host-staged load's tensors going up to the device whole.
- ``worker.swap`` (follow a tag), ``worker.serve`` and ``worker.cli`` (``paramworker``).

The cluster client itself is ``paramserver.client.session.ClusterClient``. Nothing is imported
here, so importing the cache algorithms does not import torch or gRPC.
"""
