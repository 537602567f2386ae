"""Looking at a LocalCluster from outside, one server at a time, for the drills' checks.

Every read here goes to one named server and asks for its local view (a
local read, ``paramserver.wire.reads``: answered even while that server catches
up), so a drill can compare servers (convergence) or watch one side of a partition.
All calls carry short deadlines: a cut-off server answers nothing, and the
drill must notice that quickly rather than hang. Calls use the cluster's own client
settings (tokens, and the CA and client certificate of a ``--tls`` cluster).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .framework import wait_for

if TYPE_CHECKING:
    from deploy.local import LocalCluster

ServerState = dict[str, Any]  # model -> {"versions": [(number, manifest_id, clock, forced)], "tags": {tag: version}}


@dataclass(frozen=True)
class ProbeConfig:
    timeout_s: float = 2.0  # per RPC; a partitioned server must not stall a drill

    def validate(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class ClusterProbe:
    """Per-server reads of a LocalCluster: leader views, metadata state, chunk files on disk."""

    def __init__(self, cluster: "LocalCluster", config: ProbeConfig | None = None) -> None:
        config = config or ProbeConfig()
        config.validate()
        self.cluster = cluster
        self.config = config
        self.settings = cluster.client_settings()

    def _client(self, server_id: str, write: bool = False) -> Any:
        from paramserver.client.rpc import ParamServerClient

        address = self.cluster.slot(server_id).grpc
        config = self.settings.client_config(address, write=write, timeout_s=self.config.timeout_s)
        return ParamServerClient(replace(config, local_reads=True))

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
        leader = self.cluster.leader_id(timeout=self.config.timeout_s)
        if leader is None:
            raise RuntimeError("no leader answers: cannot read a manifest; is the cluster up?")
        with self._client(leader) as c:
            reply = c.get_manifest(model=model, version=version)
            manifest = c.read_manifest(reply, parallel=1)
        return list(manifest.chunk_ids())

    # ---- chunk records on disk ----------------------------------------------------------------------
    def chunk_path(self, server_id: str, chunk_id: str) -> "ChunkRecord":
        """The chunk's record in that server's segment files (what a chunk file was in the old layout)."""
        return ChunkRecord(Path(self.cluster.slot(server_id).data_dir), chunk_id)

    def replicas_on_disk(self, chunk_id: str) -> list[str]:
        return [s.server_id for s in self.cluster.slots if self.chunk_path(s.server_id, chunk_id).exists()]

    def records_on_disk(self, server_id: str) -> dict[str, Any]:
        """chunk id -> ChunkLocation of every live record in that server's segment files (one read)."""
        from paramserver.server.segments import chunks_on_disk

        return chunks_on_disk(Path(self.cluster.slot(server_id).data_dir))

    def restore_chunk(self, server_id: str, chunk_id: str, record: bytes) -> None:
        """Put a chunk's good record (as ``flip_bytes`` returned it) back on a server: in place while the
        corrupt record is still its live one, and through PutChunks (admin token) once the server
        quarantined it (the server's index, not the file, says what it holds)."""
        from paramserver.client.rpc import make_chunk
        from paramserver.server.records import HEADER_SIZE, parse_header

        restore_record(self.chunk_path(server_id, chunk_id), record)
        h = parse_header(record[:HEADER_SIZE])
        with self._client(server_id, write=True) as c:
            c.put_chunks([make_chunk(chunk_id, record[HEADER_SIZE:], codec=h.codec, raw_size=h.raw_size)])


class ChunkRecord:
    """A chunk's live record in one server's segment files, read from disk (the server holds its index
    in memory): ``exists()``, ``read_bytes()`` (header + stored bytes), ``name`` (the chunk id), as the
    drills used a chunk file of the one-file layout."""

    def __init__(self, data_dir: Path, chunk_id: str) -> None:
        self.data_dir, self.name = data_dir, chunk_id

    def location(self) -> Any:
        from paramserver.server.segments import locate_on_disk

        return locate_on_disk(self.data_dir, self.name)

    def exists(self) -> bool:
        return self.location() is not None

    def read_bytes(self) -> bytes:
        loc = self.location()
        if loc is None:
            raise FileNotFoundError(f"no live record of chunk {self.name} under {self.data_dir}")
        return bytes(loc.read_record())

    def __repr__(self) -> str:
        return f"ChunkRecord({str(self.data_dir)!r}, {self.name!r})"


def flip_bytes(record: ChunkRecord, count: int = 4, offset: int | None = None) -> bytes:
    """Flip count bytes in the stored bytes of a chunk's record in place; returns the original record.

    The 80-byte header is left alone so the corruption is caught by the CRC32C of the data, the check
    every read does. ``offset`` counts from the record's start (as in a chunk file: header first).
    """
    from paramserver.server.records import HEADER_SIZE
    from paramserver.server.segments import replace_stored

    loc = record.location()
    if loc is None:
        raise FileNotFoundError(f"no live record of chunk {record.name} under {record.data_dir}")
    if loc.length == 0:
        raise ValueError(f"chunk {record.name} has no data after its header; pick a non-empty chunk")
    original = loc.read_record()
    data = bytearray(original[HEADER_SIZE:])
    start = 0 if offset is None else min(len(data) - 1, max(0, offset - HEADER_SIZE))
    for k in range(count):
        data[start + (k * 997) % (len(data) - start)] ^= 0xFF
    replace_stored(loc, bytes(data))
    return bytes(original)


def restore_record(record: ChunkRecord, content: bytes) -> bool:
    """Write a record's original bytes back over its live record when that is still there (same size);
    False when the server no longer serves that record (quarantined: restore through the server)."""
    from paramserver.server.segments import restore_record as put_back

    loc = record.location()
    if loc is None or loc.record_length != len(content):
        return False
    put_back(loc, content)
    return True
