"""The client's one manifest reader (paramserver.client.manifests): servers asked in order, a
failing or lying one left for the next, a refused token fatal at once, the cache by content id."""
from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import grpc
import pytest
import torch

from chunking.config import ChunkingConfig
from chunking.manifest import LAYOUT_SPLIT_FORMAT, Manifest
from chunking.pack import pack
from paramserver.client.errors import AuthFailed, ClusterUnreachable
from paramserver.client.manifests import ManifestCache, read_from, read_manifest
from tests.conftest import FakeRpcError


class Server:
    """A fake member: serves ``blobs``, or fails every call with ``fail``."""

    def __init__(self, blobs: dict[str, bytes], fail: grpc.StatusCode | None = None) -> None:
        self.blobs, self.fail, self.calls = blobs, fail, 0

    def get_manifest(self, *, manifest_id: str = "") -> SimpleNamespace:
        self.calls += 1
        if self.fail is not None:
            raise FakeRpcError(self.fail)
        return SimpleNamespace(data=self.blobs[manifest_id])

    def get_manifest_parts(self, part_ids: Sequence[str]) -> dict[str, bytes]:
        self.calls += 1
        if self.fail is not None:
            raise FakeRpcError(self.fail)
        return {p: self.blobs[p] for p in part_ids}


def _manifest() -> Manifest:
    gen = torch.Generator().manual_seed(1)
    state = {f"w{i:02d}": torch.randn(64, 257, generator=gen) for i in range(20)}
    m = pack(state, model="m", config=ChunkingConfig(chunk_size=4096)).manifest
    return m if m.format_version == LAYOUT_SPLIT_FORMAT else m.in_format(LAYOUT_SPLIT_FORMAT)


def test_a_down_or_lying_server_is_left_for_the_next_and_the_result_is_cached() -> None:
    m = _manifest()
    blobs = m.blobs()
    assert len(blobs) > 2  # a split manifest: its parts are asked too
    forged = dict(blobs)
    forged[m.parts[0].id] = b"not the part"
    servers = {"a": Server(blobs, grpc.StatusCode.UNAVAILABLE), "b": Server(forged), "c": Server(blobs)}
    cache = ManifestCache(2)
    got = read_manifest(m.id, ["a", "b", "c"], servers.__getitem__, cache=cache)
    assert got == m and cache.get(m.id) is got
    calls = {k: s.calls for k, s in servers.items()}
    assert read_manifest(m.id, ["a", "b", "c"], servers.__getitem__, cache=cache) is got  # no server asked again
    assert {k: s.calls for k, s in servers.items()} == calls


def test_a_refused_token_ends_the_read_and_nothing_answering_is_unreachable() -> None:
    m = _manifest()
    blobs = m.blobs()
    refused = {"a": Server(blobs, grpc.StatusCode.UNAUTHENTICATED), "b": Server(blobs)}
    with pytest.raises(AuthFailed):
        read_manifest(m.id, ["a", "b"], refused.__getitem__, cache=None)
    assert refused["b"].calls == 0
    down = {"a": Server(blobs, grpc.StatusCode.UNAVAILABLE), "b": Server(blobs, grpc.StatusCode.DEADLINE_EXCEEDED)}
    with pytest.raises(ClusterUnreachable, match="a: UNAVAILABLE; b: DEADLINE_EXCEEDED"):
        read_manifest(m.id, ["a", "b"], down.__getitem__, cache=None)


def test_a_root_in_hand_is_proven_and_one_server_raises_its_own_error() -> None:
    m = _manifest()
    blobs = m.blobs()
    one = Server(blobs)
    assert read_manifest(m.id, ["a"], lambda _a: one, root=blobs[m.id], cache=None) == m
    assert read_from(m.id, ["a"], lambda _a: one, root=blobs[m.id], parallel=1) == m
    with pytest.raises(FakeRpcError):
        read_from(m.id, ["a"], lambda _a: Server(blobs, grpc.StatusCode.NOT_FOUND), root=blobs[m.id])


def test_the_cache_keeps_the_last_ones_used() -> None:
    cache = ManifestCache(2)
    a, b, c = (SimpleNamespace(name=n) for n in "abc")
    cache.put("a", a)  # type: ignore[arg-type]
    cache.put("b", b)  # type: ignore[arg-type]
    assert cache.get("a") is a  # now the most recent
    cache.put("c", c)  # type: ignore[arg-type]
    assert cache.get("b") is None and cache.get("a") is a and cache.get("c") is c
