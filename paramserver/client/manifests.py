"""The client's one manifest reader: pull, load, push and ``paramctl`` all read manifests here.

A manifest is named by its content id and immutable, so what was read once is kept (a small
process-wide LRU: a reload, a rollback, a push on the version just pulled reuse the parsed one).
A read asks the servers in the caller's order: the root from one, its parts from the first that
answers (``read_from``), every blob proven by its id (``Manifest.read``); a server that fails or
serves bytes that do not prove out is left for the next. Who to ask, and in which order, is the
caller's: the session asks the leader first (``ClusterClient.manifest``, ``writes.fetch_manifest``),
``ParamServerClient.read_manifest`` one server only, with no cache (a probe of that server).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import grpc

from chunking.errors import ManifestError
from chunking.manifest import Manifest
from paramserver.client.errors import ClusterUnreachable, from_rpc, rpc_code

T = TypeVar("T")

# A bad token fails the same way on every server: asking the next one would only repeat it.
_AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class _Blob(Protocol):
    @property
    def data(self) -> bytes: ...


class ManifestSource(Protocol):
    """What a manifest is read from: one server's client (``ParamServerClient``)."""

    def get_manifest(self, *, manifest_id: str = ...) -> _Blob: ...

    def get_manifest_parts(self, part_ids: Sequence[str]) -> dict[str, bytes]: ...


class ManifestCache:
    """The last ``kept`` manifests read, by id (thread-safe)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Manifest] = OrderedDict()

    def get(self, manifest_id: str) -> Manifest | None:
        with self._lock:
            found = self._items.get(manifest_id)
            if found is not None:
                self._items.move_to_end(manifest_id)
            return found

    def put(self, manifest_id: str, manifest: Manifest) -> None:
        with self._lock:
            self._items[manifest_id] = manifest
            while len(self._items) > self.kept:
                self._items.popitem(last=False)


# Shared by every client of the process.
MANIFESTS = ManifestCache(8)


def read_from(manifest_id: str, order: Sequence[str], source: Callable[[str], ManifestSource], *,
              root: bytes | None = None, parallel: int = 8) -> Manifest:
    """``Manifest.read`` with each blob (the root too, unless given) from the first of ``order`` that
    answers. A bad token raises at once; with every server failing, the last one's error is raised
    (with one server, its own error: what a probe of that server wants to see)."""

    def first(call: Callable[[ManifestSource], T]) -> T:
        failure: grpc.RpcError | None = None
        for address in order:
            try:
                return call(source(address))
            except grpc.RpcError as exc:
                if rpc_code(exc) in _AUTH_CODES:
                    raise
                failure = exc
        assert failure is not None
        raise failure

    def get_blob(blob_id: str) -> bytes:
        return bytes(first(lambda c: c.get_manifest(manifest_id=blob_id).data))

    def get_parts(part_ids: Sequence[str]) -> dict[str, bytes]:
        return first(lambda c: c.get_manifest_parts(part_ids))

    return Manifest.read(manifest_id, get_blob, get_parts=get_parts, root=root, parallel=parallel)


def read_manifest(manifest_id: str, order: Sequence[str], source: Callable[[str], ManifestSource], *,
                  root: bytes | None = None, cache: ManifestCache | None = MANIFESTS) -> Manifest:
    """The manifest named ``manifest_id``: from ``cache``, else read intact from the first server of
    ``order`` that can (its parts from it, then the others). ``root``: its root blob, already in
    hand (proven here like any other). Raises AuthFailed at once for a refused token, else
    ClusterUnreachable naming why each server failed."""
    cached = cache.get(manifest_id) if cache is not None else None
    if cached is not None:
        return cached
    errors: list[str] = []
    for k, address in enumerate(order):
        try:
            data = root if k == 0 and root is not None else source(address).get_manifest(manifest_id=manifest_id).data
            manifest = read_from(manifest_id, [address, *(a for a in order if a != address)], source, root=data)
        except grpc.RpcError as exc:
            code = rpc_code(exc)
            if code in _AUTH_CODES:
                raise from_rpc(exc, f"manifest {manifest_id}") from None
            errors.append(f"{address}: {code.name}")
            continue
        except ManifestError as exc:
            errors.append(f"{address}: {exc}")
            continue
        manifest.plan  # noqa: B018 - plan once, here, rather than on every load
        if cache is not None:
            cache.put(manifest_id, manifest)
        return manifest
    raise ClusterUnreachable(
        f"manifest {manifest_id} could not be read intact from any server ({'; '.join(errors)}); "
        "check the servers or re-push the version"
    )


__all__ = ["MANIFESTS", "ManifestCache", "ManifestSource", "read_from", "read_manifest"]
