"""Push and pull on a real 3-server cluster (deploy.local.LocalCluster) on loopback.

One cluster per module (starting it costs seconds). Tests that stop a server
bring it back before they end, so their order does not matter.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
import torch
from safetensors.torch import load_file

from chunking.hashing import content_id, crc32c
from chunking.config import ChunkingConfig
from chunking.manifest import LAYOUT_SPLIT_FORMAT, Manifest
from chunking.pack import pack
from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.rpc import ChunkData, ParamServerClient, make_chunk
from paramserver.wire.proto import pb
from paramserver.client.pull import pull, pull_tensors
from paramserver.client.push import push
from paramserver.client.errors import ChunkUnavailable, NotFound, PushError, TransferError
from paramserver.server.segments import chunks_on_disk, corrupt_stored
from paramserver.server.store import ChunkStore

pytestmark = pytest.mark.integration

ADMIN, READ = "admin-token-pushpull", "read-token-pushpull"
MiB = 1 << 20
MAX_MESSAGE_MB = 16  # small, so the oversized-message case stays cheap


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("pushpull")
    c = LocalCluster(
        LocalClusterConfig(
            root=root, servers=3, admin_token=ADMIN, read_token=READ,
            extra_args=("--no-fsync", "--anti-entropy-interval", "1", "--max-message-mb", str(MAX_MESSAGE_MB), "--cache-mb", "64"),
        )
    )  # fmt: skip
    try:
        c.up(wait=90)
        yield c
    finally:
        c.down()


def admin(address: str) -> ParamServerClient:
    return ParamServerClient(address, token=ADMIN)


def as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert g.dtype == t.dtype and tuple(g.shape) == tuple(t.shape), name
        assert as_bytes(g) == as_bytes(t), f"tensor {name} differs"


def mixed_state_dict() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "f32.odd": torch.randn(37, 53, generator=gen),
        "f32.big": torch.randn(700, 1001, generator=gen),  # several chunks, not chunk-aligned
        "f16": torch.randn(1000, 3, generator=gen).half(),
        "bf16": torch.randn(300_001, generator=gen).bfloat16(),
        "i8": torch.randint(-128, 127, (7, 11, 13), generator=gen).to(torch.int8),
        "i64.scalar": torch.tensor(42, dtype=torch.int64),
        "f32.scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "empty.bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "bool": torch.rand(17, generator=gen) > 0.5,
    }


def versions(cluster: LocalCluster, model: str) -> list[int]:
    try:
        leader = admin(cluster.addresses[0]).cluster_info().leader_grpc_address or cluster.addresses[0]
        return [v.number for v in admin(leader).list_versions(model).versions]
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND
        return []


def manifest_of(cluster: LocalCluster, model: str, version: int) -> Manifest:
    # Ask the leader: a follower may not have applied a commit that just returned.
    leader = admin(cluster.addresses[0]).cluster_info().leader_grpc_address or cluster.addresses[0]
    c = admin(leader)
    return c.read_manifest(c.get_manifest(model=model, version=version))


# ------------------------------------------------------------------ happy paths


def test_push_and_pull_by_tag_is_bit_exact(cluster: LocalCluster, tmp_path: Path) -> None:
    state = mixed_state_dict()
    report = push(cluster.seed, state, model="mixed", tag="prod", token=ADMIN)
    assert report.version == 1 and report.parent is None and report.tag == "prod"
    assert report.chunks_sent + report.chunks_deduplicated == report.chunks_unique
    assert report.replication == 3 and report.write_quorum == 2 and report.unreachable == ()

    out = tmp_path / "mixed.safetensors"
    pulled = pull(cluster.addresses[1], "mixed:prod", out, token=READ)
    assert pulled.version == 1 and pulled.manifest_id == report.manifest_id and pulled.path == str(out)
    assert_bit_exact(load_file(str(out)), state)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    # Pushing the same weights again (on the head) sends no chunk: everything is deduplicated.
    again = push(cluster.seed, state, model="mixed", token=ADMIN)
    assert again.version == 2 and again.parent == 1 and again.bytes_sent == 0 and again.chunks_sent == 0
    tensors, _ = pull_tensors(cluster.seed, "mixed@2", token=READ)
    assert_bit_exact(tensors, state)


def test_second_version_sharing_90_percent_uploads_only_new_chunks(cluster: LocalCluster) -> None:
    base = synthetic_state_dict(20 * 256 * 1024, tensor_bytes=256 * 1024, seed=11)  # 20 weight tensors of 256 KiB
    first = push(cluster.seed, base, model="ft", tag="prod", token=ADMIN)
    weights = sorted(k for k in base if k.endswith(".weight"))
    tuned = dict(base)
    for name in weights[:2]:  # 10% of the weight tensors change
        tuned[name] = base[name] + 1.0
    second = push(cluster.seed, tuned, model="ft", tag="prod", token=ADMIN)
    assert second.parent == first.version and second.version == first.version + 1

    m1, m2 = manifest_of(cluster, "ft", first.version), manifest_of(cluster, "ft", second.version)
    old = {c.id for c in m1.chunks}
    new = {c.id: c for c in m2.chunks if c.id not in old}
    assert second.chunks_sent == len(new) and second.bytes_sent == sum(c.stored_size for c in new.values())
    assert second.chunks_deduplicated == second.chunks_unique - len(new)
    assert 0 < second.bytes_sent <= 0.15 * second.bytes_stored
    # Unchanged chunks keep the version that introduced them.
    assert all(c.introduced_in == first.version for c in m2.chunks if c.id in old)
    assert all(c.introduced_in == second.version for c in m2.chunks if c.id in new)
    tensors, _ = pull_tensors(cluster.seed, "ft:prod", token=READ)
    assert_bit_exact(tensors, tuned)


def test_a_split_manifest_commits_pulls_and_shares_its_parts_with_a_fine_tune(cluster: LocalCluster) -> None:
    # 4 KiB chunks: 80 tensors of 64 KiB give 1280 chunks, past the split threshold (1024): a part per tensor.
    config = ChunkingConfig(chunk_size=4096)
    base = synthetic_state_dict(80 * 64 * 1024, tensor_bytes=64 * 1024, seed=5)
    first = push(cluster.seed, base, model="split", tag="prod", token=ADMIN, config=config)
    m1 = manifest_of(cluster, "split", first.version)
    assert m1.format_version == LAYOUT_SPLIT_FORMAT and len(m1.parts) > 10 and m1.id == first.manifest_id
    tensors, _ = pull_tensors(cluster.seed, "split:prod", token=READ)
    assert_bit_exact(tensors, base)
    # Parts come many per call, in order; a bad request is refused with what is wrong.
    c = admin(admin(cluster.addresses[0]).cluster_info().leader_grpc_address)
    ids = [p.id for p in m1.parts]
    assert c.get_manifest_parts(ids) == {p.id: p.data for p in m1.parts}
    reply = c.stub.GetManifest(pb.GetManifestRequest(part_ids=ids), timeout=10)
    assert list(reply.parts) == [p.data for p in m1.parts]  # all fit in one reply's budget
    for request, code, words in (
        (pb.GetManifestRequest(part_ids=ids[:1], manifest_id=m1.id), grpc.StatusCode.INVALID_ARGUMENT, "part_ids alone"),
        (pb.GetManifestRequest(part_ids=["xyz"]), grpc.StatusCode.INVALID_ARGUMENT, "not a content id"),
        (pb.GetManifestRequest(part_ids=ids[:1] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "at most 4096"),
        (pb.GetManifestRequest(part_ids=["ab" * 32]), grpc.StatusCode.NOT_FOUND, "ab" * 32),
    ):
        with pytest.raises(grpc.RpcError) as err:
            c.stub.GetManifest(request, timeout=10)
        assert err.value.code() == code and words in (err.value.details() or ""), err.value.details()
    # Every blob of the manifest (root, layout and parts) reached its write quorum.
    for blob_id in m1.blobs():
        assert sum(admin(a).has_chunks([blob_id])[0] for a in cluster.addresses) >= 2, blob_id

    weights = sorted(k for k in base if k.endswith(".weight"))
    tuned = dict(base)
    for name in weights[:: 10]:  # every tenth weight tensor changes
        tuned[name] = base[name] + 1.0
    second = push(cluster.seed, tuned, model="split", tag="prod", token=ADMIN, config=config)
    m2 = manifest_of(cluster, "split", second.version)
    shared = {p.id for p in m1.parts} & {p.id for p in m2.parts}
    assert len(shared) >= 0.8 * len(m2.parts), (len(shared), len(m2.parts))
    assert m2.layout_blob == m1.layout_blob
    new_blob_bytes = sum(len(b) for bid, b in m2.blobs().items() if bid not in m1.blobs())
    assert new_blob_bytes <= 0.15 * sum(len(b) for b in m2.blobs().values())
    tensors, _ = pull_tensors(cluster.seed, "split:prod", token=READ)
    assert_bit_exact(tensors, tuned)
    tensors, _ = pull_tensors(cluster.seed, f"split@{first.version}", token=READ)
    assert_bit_exact(tensors, base)


def test_a_commit_whose_manifest_part_is_missing_is_refused(cluster: LocalCluster) -> None:
    state = synthetic_state_dict(80 * 64 * 1024, tensor_bytes=64 * 1024, seed=6)
    manifest = pack(state, model="partless", config=ChunkingConfig(chunk_size=4096)).manifest
    assert manifest.format_version == LAYOUT_SPLIT_FORMAT
    root = manifest.to_bytes()
    leader = admin(cluster.addresses[0]).cluster_info().leader_grpc_address
    for address in cluster.addresses:  # the root everywhere, no part anywhere
        admin(address).put_chunks([make_chunk(manifest.id, root)])
    with pytest.raises(grpc.RpcError) as err:
        admin(leader).commit_version("partless", manifest.id, publisher="t", nbytes=1, chunk_count=1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "a part of it is not readable" in (err.value.details() or "") and "push the manifest's parts" in (err.value.details() or "")
    assert versions(cluster, "partless") == []


def _leader_and_follower(cluster: LocalCluster) -> tuple[str, str]:
    info = admin(cluster.addresses[0]).cluster_info()
    follower = next(m.server_id for m in info.members if m.server_id != info.leader_id)
    return info.leader_id, follower


def test_push_with_one_server_down_commits_and_repair_restores_three_replicas(cluster: LocalCluster) -> None:
    _, victim = _leader_and_follower(cluster)
    cluster.kill(victim)
    try:
        state = synthetic_state_dict(3 * MiB, tensor_bytes=512 * 1024, seed=21)
        live_seed = ",".join(s.grpc for s in cluster.slots if s.server_id != victim)
        report = push(live_seed, state, model="degraded", tag="prod", token=ADMIN)
        assert report.unreachable == (victim,)
        tensors, pulled = pull_tensors(live_seed, "degraded:prod", token=READ)
        assert_bit_exact(tensors, state)
        assert victim not in pulled.per_server
    finally:
        cluster.restart(victim)
    cluster.wait_ready(90)

    manifest = manifest_of(cluster, "degraded", report.version)
    ids = sorted({c.id for c in manifest.chunks} | {report.manifest_id})
    deadline = time.monotonic() + 90
    missing: dict[str, int] = {}
    while time.monotonic() < deadline:
        missing = {}
        for slot in cluster.slots:
            try:
                flags = admin(slot.grpc).has_chunks(ids)
            except grpc.RpcError:
                flags = [False] * len(ids)
            if not all(flags):
                missing[slot.server_id] = flags.count(False)
        if not missing:
            break
        time.sleep(1.0)
    assert not missing, f"background repair did not restore 3 replicas within 90 s; chunks missing per server: {missing}"


PUSH_SCRIPT = textwrap.dedent(
    """
    import sys
    from chunking.synthetic import synthetic_state_dict
    from paramserver.client.push import push, PushOptions

    def progress(phase, done, total):
        if phase == "upload" and done > 0:
            print("UPLOADING", flush=True)

    state = synthetic_state_dict(96 << 20, tensor_bytes=4 << 20, seed=5)
    push(sys.argv[1], state, model="killed", tag="prod", token=sys.argv[2], progress=progress,
         options=PushOptions(stream_bytes=8 << 20))
    print("COMMITTED", flush=True)
    """
)


def test_push_killed_mid_upload_commits_nothing(cluster: LocalCluster) -> None:
    proc = subprocess.Popen([sys.executable, "-c", PUSH_SCRIPT, cluster.seed, ADMIN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "UPLOADING", f"the pushing process did not start uploading: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    time.sleep(1.0)
    assert versions(cluster, "killed") == []


def test_push_interrupted_in_process_commits_nothing(cluster: LocalCluster) -> None:
    calls = []

    def interrupt(phase: str, done: int, total: int) -> None:
        calls.append(phase)
        if phase == "upload" and done > 0:
            raise KeyboardInterrupt

    state = synthetic_state_dict(24 * MiB, tensor_bytes=2 * MiB, seed=6)
    with pytest.raises(KeyboardInterrupt):
        push(cluster.seed, state, model="interrupted", token=ADMIN, progress=interrupt)
    assert "commit" not in calls
    assert versions(cluster, "interrupted") == []


# ------------------------------------------------------------------ bad input


def test_unknown_model_or_tag_is_not_found(cluster: LocalCluster, tmp_path: Path) -> None:
    c = admin(cluster.addresses[0])
    with pytest.raises(grpc.RpcError) as info:
        c.resolve_tag("no-such-model", "prod")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in info.value.details()
    push(cluster.seed, {"w": torch.ones(4)}, model="tagged", tag="prod", token=ADMIN)
    with pytest.raises(grpc.RpcError) as info:  # linearizable: this member may not have applied the push yet
        c.resolve_tag("tagged", "no-such-tag", linearizable=True)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-tag" in info.value.details()
    with pytest.raises(NotFound) as pulled:
        pull(cluster.seed, "tagged:no-such-tag", tmp_path / "x.safetensors", token=READ)
    assert pulled.value.code == grpc.StatusCode.NOT_FOUND
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("name", ["../x", ""])
def test_bad_model_name_is_invalid_argument(cluster: LocalCluster, name: str) -> None:
    # A real, fully replicated manifest, so the server gets as far as checking the name.
    stored = push(cluster.seed, {"w": torch.arange(3.0)}, model="named", token=ADMIN)
    c = admin(cluster.addresses[0])
    with pytest.raises(grpc.RpcError) as info:
        c.commit_version(name, stored.manifest_id, parent=None, publisher="tests")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model" in info.value.details()
    with pytest.raises(PushError) as pushed:
        push(cluster.seed, {"w": torch.ones(2)}, model=name, token=ADMIN)
    assert pushed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "model name" in str(pushed.value)


def _random_chunk(size: int = 64 * 1024, seed: int = 0) -> ChunkData:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    return make_chunk(content_id(data), data)


def _present_anywhere(cluster: LocalCluster, ids: list[str]) -> bool:
    return any(any(admin(s.grpc).has_chunks(ids)) for s in cluster.slots)


def test_chunk_whose_bytes_do_not_match_its_id_is_rejected(cluster: LocalCluster) -> None:
    good = _random_chunk(seed=1)
    forged = ChunkData(content_id(b"other bytes"), "raw", len(good.data), crc32c(good.data), good.data)
    with pytest.raises(grpc.RpcError) as info:
        admin(cluster.addresses[0]).put_chunks([forged])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert forged.id in info.value.details() and "wrong bytes" in info.value.details()
    assert not _present_anywhere(cluster, [forged.id])


def test_truncated_chunk_and_cut_stream_leave_the_store_consistent(cluster: LocalCluster) -> None:
    c = admin(cluster.addresses[0])
    whole = _random_chunk(seed=2)
    truncated = ChunkData(whole.id, whole.codec, whole.raw_size, whole.crc32c, whole.data[: len(whole.data) // 2])
    with pytest.raises(grpc.RpcError) as info:
        c.put_chunks([truncated])
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert whole.id in info.value.details() and "truncated" in info.value.details()
    assert not _present_anywhere(cluster, [whole.id])

    first, second = _random_chunk(seed=3), _random_chunk(seed=4)

    def cut() -> Iterator[ChunkData]:
        yield first
        yield second
        raise ConnectionError("client went away mid-stream")

    with pytest.raises(grpc.RpcError):
        c.put_chunks(cut(), batch_bytes=64 * 1024)
    # Whatever arrived is either absent or intact: a present chunk reads back and verifies.
    for cid, flag in zip([first.id, second.id], c.has_chunks([first.id, second.id])):
        if flag:
            (got,) = list(c.get_chunks([cid]))
            assert content_id(got.data) == cid
    assert all(ParamServerClient(s.grpc, token=READ).server_status().quarantined == 0 for s in cluster.slots)


def test_oversized_message_is_resource_exhausted(cluster: LocalCluster) -> None:
    big = _random_chunk(size=(MAX_MESSAGE_MB + 2) * MiB, seed=9)
    with pytest.raises(grpc.RpcError) as info:
        admin(cluster.addresses[0]).put_chunks([big], batch_bytes=64 * MiB)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not _present_anywhere(cluster, [big.id])


def test_wrong_token_is_unauthenticated(cluster: LocalCluster) -> None:
    wrong = ParamServerClient(cluster.addresses[0], token="wrong-token-123")
    with pytest.raises(grpc.RpcError) as info:
        wrong.list_models()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token" in info.value.details()
    with pytest.raises(TransferError) as pushed:
        push(cluster.seed, {"w": torch.ones(2)}, model="auth", token="wrong-token-123")
    assert pushed.value.code == grpc.StatusCode.UNAUTHENTICATED
    # The read token may read but not write: the push fails at its dedup check (HasChunks claim) and commits nothing.
    with pytest.raises(PushError) as pushed:
        push(cluster.seed, {"w": torch.ones(2)}, model="auth", token=READ)
    assert pushed.value.code == grpc.StatusCode.UNAUTHENTICATED and "admin token" in str(pushed.value)
    assert versions(cluster, "auth") == []


def test_conflicting_parent_is_aborted_naming_both_versions(cluster: LocalCluster) -> None:
    push(cluster.seed, {"w": torch.zeros(8)}, model="conflict", token=ADMIN)
    push(cluster.seed, {"w": torch.ones(8)}, model="conflict", token=ADMIN)
    with pytest.raises(PushError) as info:
        push(cluster.seed, {"w": torch.full((8,), 2.0)}, model="conflict", parent=1, token=ADMIN)
    assert info.value.code == grpc.StatusCode.ABORTED
    assert "version 1" in str(info.value) and "version 2" in str(info.value)
    assert versions(cluster, "conflict") == [1, 2]


def test_pull_refetches_a_chunk_corrupted_on_one_replica(cluster: LocalCluster) -> None:
    state = synthetic_state_dict(3 * MiB, tensor_bytes=256 * 1024, seed=31)
    report = push(cluster.seed, state, model="rotten", tag="prod", token=ADMIN)
    manifest = manifest_of(cluster, "rotten", report.version)
    _, victim = _leader_and_follower(cluster)
    slot = cluster.slot(victim)
    cluster.kill(victim)  # also drops its in-memory chunk cache
    flipped = 0
    try:
        on_disk = chunks_on_disk(slot.data_dir)  # its records in its segment files
        for ref in manifest.chunks:
            location = on_disk.get(ref.id)
            if location is not None:
                corrupt_stored(location, at=location.length - 100, xor=0xFF)  # inside the chunk bytes, past the header
                flipped += 1
    finally:
        cluster.restart(victim)
    cluster.wait_ready(90)
    assert flipped > 0
    tensors, pulled = pull_tensors(cluster.seed, "rotten:prod", token=READ)
    assert_bit_exact(tensors, state)
    print(f"chunks refetched from another replica: {pulled.retried}; bytes per server: {dict(pulled.per_server)}")


def test_a_failed_pull_to_a_file_leaves_no_file_behind(cluster: LocalCluster, tmp_path: Path) -> None:
    # Chunks are received straight into the output file's pages; when one chunk cannot be had
    # from any replica, neither the file nor its temporary twin may remain.
    state = synthetic_state_dict(2 * MiB, tensor_bytes=512 * 1024, seed=41)
    report = push(cluster.seed, state, model="lost", tag="prod", token=ADMIN)
    manifest = manifest_of(cluster, "lost", report.version)
    victim = manifest.chunks[-1].id
    # The index is in each server's memory: delete the chunk while they are all down (one at a time,
    # re-replication would copy it back from the others).
    for slot in cluster.slots:
        cluster.kill(slot.server_id)
    try:
        for slot in cluster.slots:
            offline = ChunkStore(slot.data_dir, cache_bytes=0)
            offline.delete(victim)
            offline.close()
    finally:
        for slot in cluster.slots:
            cluster.restart(slot.server_id)
    cluster.wait_ready(90)
    out = tmp_path / "pulled" / "lost.safetensors"
    with pytest.raises(ChunkUnavailable, match="could not be read from any replica"):
        pull(cluster.seed, "lost:prod", out, token=READ)
    assert not out.exists()
    assert list(out.parent.iterdir()) == []
