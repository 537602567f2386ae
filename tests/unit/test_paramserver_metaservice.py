"""The metadata RPCs over a stand-in MetadataPlane: status-code mapping, clocks, read info.

The real plane (consensus.MetadataNode) is exercised by integration tests; here a
small in-memory stand-in lets us check the gRPC boundary quickly.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import grpc
import pytest

from chunking.hashing import content_id
from consensus.errors import Conflict, Invalid, NotFound, NotLeader
from consensus.records import MemberRecord, ReadResult, TagMove, TagRecord, VersionRecord
from consensus.sync import IN_SYNC, SyncVerdict
from paramserver.client.rpc import ClientConfig, ParamServerClient, make_chunk
from paramserver.server.config import ServerConfig
from paramserver.server.metaservice import VersionFacts
from paramserver.server.rpc_errors import LEADER_METADATA_KEY, PreconditionFailed
from paramserver.server.service import RunningServer, start_server


class FakePlane:
    server_id = "ps1"

    def __init__(self) -> None:
        self.versions: dict[str, list[VersionRecord]] = {}
        self.tags: dict[tuple[str, str], TagRecord] = {}
        self.index = 7
        self.leader = True
        self.sync = IN_SYNC

    def _r(self, value: Any) -> ReadResult[Any]:
        return ReadResult(value, self.index, self.server_id)

    def is_leader(self) -> bool:
        return self.leader

    def sync_state(self) -> SyncVerdict:
        return self.sync

    def leader_raft_address(self) -> str | None:
        return "127.0.0.1:7100"

    def term(self) -> int:
        return 3

    def commit_index(self) -> int:
        return self.index

    def members(self) -> ReadResult[Sequence[MemberRecord]]:
        return self._r([MemberRecord("ps1", "127.0.0.1:7000", "127.0.0.1:7100"), MemberRecord("ps2", "127.0.0.1:7001", "127.0.0.1:7101")])

    def commit_version(self, model: str, manifest_id: str, parent: int | None, publisher: str, nbytes: int, chunk_count: int, *,
                       force: bool = False, tag: str | None = None, created_at: float | None = None) -> VersionRecord:
        if not self.leader:
            raise NotLeader("not the leader; retry on 127.0.0.1:7101", leader="127.0.0.1:7101")
        if "/" in model:
            raise Invalid(f"model name {model!r} must not contain '/'")
        versions = self.versions.setdefault(model, [])
        head = versions[-1].number if versions else None
        if head != parent and not force:
            raise Conflict(f"{model}: parent {parent} is not the head {head}; pull version {head} and push again")
        self.index += 1
        record = VersionRecord(model, len(versions) + 1, manifest_id, {publisher: len(versions) + 1}, parent, 1.0, nbytes, chunk_count,
                               publisher)
        versions.append(record)
        if tag:
            self.set_tag(model, tag, record.number, publisher)
        return record

    def set_tag(self, model: str, tag: str, version: int, who: str) -> TagRecord:
        if not any(v.number == version for v in self.versions.get(model, [])):
            raise NotFound(f"{model} has no version {version}")
        old = self.tags.get((model, tag))
        record = TagRecord(model, tag, version, (old.history if old else ()) + (TagMove(old.version if old else None, version, who, 2.0),))
        self.tags[(model, tag)] = record
        return record

    def resolve_tag(self, model: str, tag: str, *, linearizable: bool = False) -> ReadResult[VersionRecord]:
        record = self.tags.get((model, tag))
        if record is None:
            raise NotFound(f"{model} has no tag {tag!r}; list tags with paramctl ls {model}")
        return self._r(self.versions[model][record.version - 1])

    def get_version(self, model: str, number: int, *, linearizable: bool = False) -> ReadResult[VersionRecord]:
        try:
            return self._r(self.versions[model][number - 1])
        except (KeyError, IndexError):
            raise NotFound(f"{model} has no version {number}") from None

    def list_models(self) -> ReadResult[Sequence[str]]:
        return self._r(sorted(self.versions))

    def list_versions(self, model: str) -> ReadResult[Sequence[VersionRecord]]:
        return self._r(self.versions.get(model, []))

    def list_tags(self, model: str) -> ReadResult[Sequence[TagRecord]]:
        return self._r([t for (m, _), t in self.tags.items() if m == model])


@pytest.fixture
def plane() -> FakePlane:
    return FakePlane()


@pytest.fixture
def checks() -> list[str]:
    return []


@pytest.fixture
def running(tmp_path: Path, plane: FakePlane, checks: list[str]) -> Iterator[RunningServer]:
    def version_check(manifest_id: str, manifest: bytes) -> VersionFacts:
        checks.append(manifest_id)
        if manifest.startswith(b"incomplete"):
            raise PreconditionFailed(f"chunk 3 of manifest {manifest_id} has 1 of 2 required replicas; finish the push")
        return VersionFacts(nbytes=len(manifest) * 10, chunk_count=4)

    cfg = ServerConfig(server_id="ps1", data_dir=tmp_path, listen="127.0.0.1:0", fsync=False, workers=4)
    server = start_server(cfg, metadata=plane, version_check=version_check)  # type: ignore[arg-type]
    yield server
    server.stop(0)


@pytest.fixture
def client(running: RunningServer) -> Iterator[ParamServerClient]:
    with ParamServerClient(running.address) as c:
        yield c


def push_manifest(client: ParamServerClient, body: bytes) -> str:
    chunk = make_chunk(content_id(body), body)
    client.put_chunks([chunk])
    return chunk.id


def code_of(fn: Any, *args: Any, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    return info.value


def test_commit_resolve_and_manifest(client: ParamServerClient, checks: list[str]) -> None:
    mid = push_manifest(client, b'{"manifest": 1}' + os.urandom(16))
    reply = client.commit_version("resnet", mid, publisher="alice", tag="prod")
    assert reply.version.number == 1 and not reply.version.HasField("parent")
    assert dict(reply.version.clock) == {"alice": 1} and reply.read.commit_index == 8
    assert reply.version.chunk_count == 4 and checks == [mid]  # facts from the version check
    resolved = client.resolve_tag("resnet", "prod")
    assert resolved.version.manifest_id == mid and resolved.read.server_id == "ps1"
    by_tag = client.get_manifest(model="resnet", tag="prod")
    assert content_id(by_tag.data) == mid == by_tag.manifest_id and by_tag.version.number == 1
    assert client.get_manifest(manifest_id=mid).data == by_tag.data
    mid2 = push_manifest(client, b"second" + os.urandom(8))
    v2 = client.commit_version("resnet", mid2, parent=1, publisher="bob")
    assert v2.version.parent == 1
    assert [v.number for v in client.list_versions("resnet").versions] == [1, 2]
    assert list(client.list_models().models) == ["resnet"]
    moved = client.set_tag("resnet", "prod", 2, who="bob")
    assert [(m.from_version, m.to_version) for m in moved.tag.history] == [(0, 1), (1, 2)]
    assert not moved.tag.history[0].HasField("from_version")


def test_a_member_catching_up_refuses_serializable_reads_only(client: ParamServerClient, plane: FakePlane,
                                                               running: RunningServer) -> None:
    """Issue 47: a restarted member answered tag reads from its state before the restart. Now every
    serializable metadata read is refused with UNAVAILABLE, saying why; linearizable reads, reads of
    a manifest by id, ClusterInfo and a probe's local reads are still answered."""
    mid = push_manifest(client, b'{"manifest": 47}' + os.urandom(16))
    client.commit_version("m", mid, publisher="alice", tag="prod")
    plane.sync = SyncVerdict(False, "it has applied 3 of the leader's 9 committed entries", behind=6)
    refused = [
        lambda: client.resolve_tag("m", "prod"), lambda: client.get_version("m", 1), lambda: client.get_manifest(model="m", tag="prod"),
        lambda: client.get_manifest(model="m", version=1), client.list_models, lambda: client.list_versions("m"),
        lambda: client.list_tags("m"),
    ]
    for read in refused:
        err = code_of(read)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, read
        assert "ps1 is catching up" in err.details() and "3 of the leader's 9" in err.details() and "another member" in err.details()
    assert client.resolve_tag("m", "prod", linearizable=True).version.number == 1
    assert client.get_manifest(model="m", tag="prod", linearizable=True).manifest_id == mid
    assert client.get_manifest(manifest_id=mid).manifest_id == mid
    assert client.cluster_info().server_id == "ps1"
    with ParamServerClient(ClientConfig(running.address, local_reads=True)) as probe:
        assert [t.tag for t in probe.list_tags("m").tags] == ["prod"] and probe.resolve_tag("m", "prod").version.number == 1


def test_a_member_a_moment_from_in_sync_answers_after_a_short_wait(client: ParamServerClient, plane: FakePlane) -> None:
    """A new leader's first commit, or a follower a heartbeat behind: the read waits for it (briefly)."""
    mid = push_manifest(client, b"m" + os.urandom(8))
    client.commit_version("m", mid, publisher="a", tag="prod")
    plane.sync = SyncVerdict(False, "it has not applied an entry of the current term 5 yet")
    timer = threading.Timer(0.05, lambda: setattr(plane, "sync", IN_SYNC))
    timer.start()
    try:
        assert client.resolve_tag("m", "prod").version.number == 1
    finally:
        timer.cancel()


def test_errors_map_to_status_codes(client: ParamServerClient, plane: FakePlane) -> None:
    err = code_of(client.resolve_tag, "resnet", "nope")
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no tag" in err.details()
    assert code_of(client.resolve_tag, "", "prod").code() == grpc.StatusCode.INVALID_ARGUMENT
    mid = push_manifest(client, b"m" + os.urandom(8))
    client.commit_version("m", mid, publisher="a")
    err = code_of(client.commit_version, "m", mid, publisher="b")  # parent None is not the head
    assert err.code() == grpc.StatusCode.ABORTED and "head 1" in err.details()
    assert code_of(client.commit_version, "../x", mid, publisher="a").code() == grpc.StatusCode.INVALID_ARGUMENT
    err = code_of(client.commit_version, "m", "f" * 64, parent=1, publisher="a")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "push the manifest" in err.details()
    assert code_of(client.commit_version, "m", "xyz", publisher="a").code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = push_manifest(client, b"incomplete" + os.urandom(8))
    err = code_of(client.commit_version, "m", bad, parent=1, publisher="a")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "replicas" in err.details()
    plane.leader = False
    err = code_of(client.commit_version, "m", mid, parent=1, publisher="a")
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert (LEADER_METADATA_KEY, "127.0.0.1:7101") in err.trailing_metadata()


def test_cluster_info_and_status(client: ParamServerClient) -> None:
    info = client.cluster_info()
    assert [m.server_id for m in info.members] == ["ps1", "ps2"]
    assert info.leader_id == "ps1" and info.leader_grpc_address == "127.0.0.1:7000" and info.term == 3
    assert info.ring.replication_factor == 2 and info.ring.write_quorum == 2 and info.ring.vnodes == 128
    status = client.server_status()
    assert status.is_leader and status.term == 3 and status.server_id == "ps1"
