"""Looking at a LocalCluster from outside, one server at a time, for the drills' checks.

Every read here goes to one named server and asks for its local view, so a
drill can compare servers (convergence) or watch one side of a partition.
All calls carry short deadlines: a cut-off server answers nothing, and the
drill must notice that quickly rather than hang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .framework import wait_for

if TYPE_CHECKING:
    from deploy.local import LocalCluster

ServerState = dict[str, Any]  # model -> {"versions": [(number, manifest_id, clock, forced)], "tags": {tag: version}}


@dataclass(frozen=True)
class ProbeConfig:
    timeout_s: float = 2.0  # per RPC; a partitioned server must not stall a drill
    token: str | None = None

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class ClusterProbe:
    """Per-server reads of a LocalCluster: leader views, metadata state, chunk files on disk."""

    def __init__(self, cluster: "LocalCluster", config: ProbeConfig | None = None) -> None:
        config = config or ProbeConfig(token=cluster.config.admin_token or cluster.config.read_token)
        config.validate()
        self.cluster = cluster
        self.config = config

    def _client(self, server_id: str) -> Any:
        from paramserver.client.rpc import ClientConfig, ParamServerClient

        return ParamServerClient(ClientConfig(self.cluster.slot(server_id).grpc, token=self.config.token,
                                              timeout_s=self.config.timeout_s))

    # ---- leadership ---------------------------------------------------------------------------
    def leader_view(self, server_id: str) -> str | None:
        info = self.cluster.cluster_info(server_id, timeout=self.config.timeout_s)
        return (info or {}).get("leader_id") or None

    def agreed_leader(self, servers: Iterable[str], exclude: Iterable[str] = ()) -> str | None:
        """The leader every one of servers names, if they agree and it is not excluded (e.g. the old one)."""
        views = {self.leader_view(s) for s in servers}
        if len(views) != 1:
            return None
        (leader,) = views
        return leader if leader is not None and leader not in set(exclude) else None

    def wait_leader(self, servers: Iterable[str], timeout: float, exclude: Iterable[str] = ()) -> str:
        servers, exclude = list(servers), list(exclude)
        return wait_for(lambda: self.agreed_leader(servers, exclude), timeout, interval=0.02,
                        what=f"one leader agreed by {servers}" + (f" other than {exclude}" if exclude else ""))

    # ---- metadata state -------------------------------------------------------------------------
    def state_of(self, server_id: str) -> ServerState:
        """Versions (with vector clocks) and tags of every model, as this one server holds them."""
        with self._client(server_id) as c:
            state: ServerState = {}
            for model in sorted(c.list_models().models):
                versions = [(int(v.number), v.manifest_id, tuple(sorted(v.clock.items())), bool(v.forced))
                            for v in c.list_versions(model).versions]
                tags = {t.tag: int(t.version) for t in c.list_tags(model).tags}
                state[model] = {"versions": sorted(versions), "tags": dict(sorted(tags.items()))}
            return state

    def states(self, servers: Iterable[str] | None = None) -> dict[str, ServerState]:
        """state_of for each server that answers (the ones that do not are left out)."""
        out = {}
        for sid in list(servers) if servers is not None else self.cluster.running():
            try:
                out[sid] = self.state_of(sid)
            except Exception:  # noqa: BLE001 - an unreachable server simply has no state to compare
                continue
        return out

    def has_version(self, server_id: str, model: str, version: int) -> bool:
        st = self.state_of(server_id).get(model)
        return st is not None and any(v[0] == version for v in st["versions"])

    def chunk_ids(self, model: str, version: int) -> list[str]:
        """The chunk ids a version names (from its manifest, read through the leader)."""
        from chunking.manifest import Manifest

        leader = self.cluster.leader_id(timeout=self.config.timeout_s)
        if leader is None:
            raise RuntimeError("no leader answers: cannot read a manifest; is the cluster up?")
        with self._client(leader) as c:
            reply = c.get_manifest(model=model, version=version)
        return list(Manifest.from_bytes(reply.data, expected_id=reply.manifest_id).chunk_ids())

    # ---- chunk files ------------------------------------------------------------------------------
    def chunk_path(self, server_id: str, chunk_id: str) -> Path:
        # Layout of paramserver.server.store.ChunkStore.path: chunks/ab/cd/<id>.
        return Path(self.cluster.slot(server_id).data_dir) / "chunks" / chunk_id[0:2] / chunk_id[2:4] / chunk_id

    def replicas_on_disk(self, chunk_id: str) -> list[str]:
        return [s.server_id for s in self.cluster.slots if self.chunk_path(s.server_id, chunk_id).exists()]


def flip_bytes(path: Path, count: int = 4, offset: int | None = None) -> bytes:
    """Flip count bytes in the data area of a chunk file in place; returns the original file bytes.

    The header (48 bytes) is left alone so the corruption is caught by the
    CRC32C of the data, the check every read does.
    """
    from paramserver.server.store import HEADER_SIZE

    original = path.read_bytes()
    if len(original) <= HEADER_SIZE:
        raise ValueError(f"{path} has no data after its header; pick a non-empty chunk")
    start = HEADER_SIZE if offset is None else max(HEADER_SIZE, offset)
    data = bytearray(original)
    for k in range(count):
        i = start + (k * 997) % (len(data) - start)
        data[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
        f.flush()
        os.fsync(f.fileno())
    return original


def restore_file(path: Path, content: bytes) -> None:
    """Put a chunk file back atomically (temp file + rename), as the store itself writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-drill-{path.name}")
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
