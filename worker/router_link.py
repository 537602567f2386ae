"""A serving worker's link to its routers (``paramworker serve --router URL``, ``worker.router``).

Every second, one thread per router (a dead one never delays the others) posts what the worker
holds and has cached (``worker.router_state.Heartbeat``); on stop it says ``/leave``. Beats and
leaves carry the worker token (``--worker-token-file``; not the cluster's read token, which every
reader holds) and this process's instance secret, made at start: a router binds the worker id to
it, and asks ``GET /identity?nonce=N`` (``identity``) before it routes to the URL a beat names.
"""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from chunking.manifest import Manifest
from paramserver.wire.auth import token_metadata
from worker.admission import Admission
from worker.errors import ConfigError
from worker.model_lifecycle import ModelLifecycle
from worker.router_auth import new_instance_secret
from worker.router_state import HEARTBEAT_S, INSTANCE_HEADER, identity_proof


class RouterLink:
    """Heartbeats of one worker to its routers; ``register`` starts them, ``leave`` ends them.

    ``stop`` is the worker's stop event (shared with its model lifecycle): once set, beats end.
    """

    def __init__(self, models: ModelLifecycle, admission: Admission, max_queue: int, stop: threading.Event) -> None:
        self.models = models
        self.admission = admission
        self.max_queue = max_queue
        self._stop = stop
        self.routers: tuple[str, ...] = ()
        self.worker_id = ""
        self.advertise = ""
        self.router_error: str | None = None
        self.beats_sent = 0
        self._token: str | None = None
        self._secret = new_instance_secret()

    def _cached(self, model: str, version: int, manifest: Manifest) -> dict[str, Any]:
        # Every second, for every model held: from the manifest's columns, with one lock
        # acquisition per tier, not a ChunkRef and two lookups per chunk (half a million for a
        # big checkpoint at small chunks).
        cache = self.models.swapper.cache
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
        models = self.models
        held = models.held()
        manifests: dict[tuple[str, int], Manifest] = {(lm.info.model, lm.info.number): lm.manifest for lm in held}
        for p in models.prewarm_list():
            if p.manifest is not None:
                manifests.setdefault((p.model, p.version), p.manifest)
        device = models.swapper.device
        free: int | None = None
        if device.type == "cuda":
            try:
                free = int(torch.cuda.mem_get_info(device)[0])
            except RuntimeError:
                free = None
        return {"worker_id": self.worker_id, "url": f"http://{self.advertise}", "serves": str(models.swapper.ref),
                "loaded": [{"model": lm.info.model, "version": lm.info.number} for lm in held],
                "cached": [self._cached(mv[0], mv[1], m) for mv, m in list(manifests.items())[:64]],
                "queue": self.admission.waiting, "running": self.admission.running,
                "max_queue": self.max_queue, "other_versions": models.other_versions,
                "any_model": models.hf is not None,
                "device_free_bytes": free}

    def _post(self, url: str, path: str, body: dict[str, Any], timeout: float) -> None:
        # The worker token says "a worker of this deployment", the instance secret "this worker".
        headers = {"Content-Type": "application/json", INSTANCE_HEADER: self._secret, **dict(token_metadata(self._token))}
        request = urllib.request.Request(f"{url.rstrip('/')}{path}", data=json.dumps(body).encode(), method="POST",
                                         headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()

    def _beat_loop(self, url: str) -> None:
        """Beat to one router every second (one thread per router: a dead one never delays the others)."""
        while True:
            try:
                self._post(url, "/heartbeat", self.heartbeat(), timeout=HEARTBEAT_S)
                self.beats_sent += 1
            except (OSError, urllib.error.URLError, ValueError) as exc:
                self.router_error = f"{url}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a beat is skipped, the next one tries again
                self.router_error = f"heartbeat: {type(exc).__name__}: {exc}"
            if self._stop.wait(HEARTBEAT_S):
                return

    def register(self, routers: Sequence[str], advertise: str, worker_id: str | None = None, token: str | None = None) -> None:
        """Beat to every router in ``routers`` each second from now on (``advertise``: HOST:PORT they reach us at;
        ``token``: the worker token the routers check beats against, None when they have none)."""
        for url in routers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--router {url!r} must be http://HOST:PORT")
        self.routers = tuple(u.rstrip("/") for u in routers)
        self._token = token
        self.advertise = advertise
        self.worker_id = worker_id or f"{socket.gethostname()}:{advertise.rpartition(':')[2]}"
        for url in self.routers:
            threading.Thread(target=self._beat_loop, args=(url,), name="paramworker-heartbeat", daemon=True).start()

    def leave(self) -> None:
        """Tell every router this worker is gone (the stop event, set before, ends the beats)."""
        for url in self.routers:
            try:
                self._post(url, "/leave", {"worker_id": self.worker_id}, timeout=1.0)
            except (OSError, urllib.error.URLError, ValueError):
                pass  # the router drops us when the lease runs out

    def identity(self, nonce: str) -> dict[str, Any] | None:
        """``GET /identity?nonce=N``: this worker's id and its proof of the instance secret its beats carry
        (None before it registered with a router: nobody can ask it to vouch for a URL yet)."""
        if not self.worker_id:
            return None
        return {"worker_id": self.worker_id, "proof": identity_proof(self._secret, self.worker_id, nonce)}

    def health(self) -> dict[str, Any] | None:
        """``/healthz``'s ``router`` field (None: no router)."""
        if not self.routers:
            return None
        return {"urls": list(self.routers), "worker_id": self.worker_id, "beats": self.beats_sent,
                "last_error": self.router_error}


__all__ = ["RouterLink"]
