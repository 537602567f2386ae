"""A full disk under the chunk store (issue 11, item 6, the chunk-store half; segments: issue 12).

ENOSPC used to escape as a raw OSError traceback from every write and every re-replication
towards the full server. Now the write is refused with StoreFullError (RESOURCE_EXHAUSTED)
naming the data dir and its free space, no torn record stays in a segment, every stored chunk
stays readable, and the background tasks back off instead of spinning: re-replication leaves a
full target alone for a while, repair pauses on a full local disk; each logs once. In the
append-only store a delete gives space back once compaction rewrote (or dropped) its segment;
the store keeps a small reserve so deletes and compaction still work on a full disk.
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
from pathlib import Path
from typing import Iterable, Iterator

import grpc
import pytest

from chunking.hashing import content_id, crc32c
from consensus.records import MemberRecord
from paramserver.client.rpc import ChunkData
from paramserver.server.cluster import PeerSet
from paramserver.server.errors import StoreFullError
from paramserver.server.repair import RepairQueue, Repairer
from paramserver.server.replication import ReReplicator
from paramserver.server.compaction import Compactor
from paramserver.server.segments import read_view
from paramserver.server.store import ChunkStore, StoreConfig, StoredChunk
from paramserver.wire.proto import pb
from paramserver.wire.ring import RingConfig
from tests.conftest import mounted_tmpfs

KiB, MiB = 1 << 10, 1 << 20


def raw_chunk(size: int = 256 * KiB) -> tuple[str, bytes, str, int, int]:
    data = os.urandom(size)
    return content_id(data), data, "raw", len(data), crc32c(data)


def leftovers(data_dir: Path) -> list[str]:
    """What a refused write may have left: torn bytes at a segment's end, temp files (read from disk)."""
    scans, _view = read_view(data_dir)
    torn = [f"{s.path}: {s.torn} torn bytes" for s in scans.values() if s.torn or s.damaged]
    return torn + [p.name for p in (data_dir / "segments").glob("*.tmp")]


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (root only), unmounted afterwards."""
    with mounted_tmpfs(tmp_path / "small", 4, "a full disk") as mount:
        yield mount


def test_a_full_disk_refuses_the_write_keeps_every_chunk_and_recovers(small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 1 MiB segments: 3 chunks each, so deleting 3 empties a segment compaction can drop
    store = ChunkStore(small_fs / "data", cache_bytes=0, fsync=True, server_id="ps7", config=StoreConfig(segment_bytes=1 << 20))
    caplog.set_level(logging.INFO, logger="paramserver.server.store")
    stored: list[tuple[str, bytes, str, int, int]] = []
    error: StoreFullError | None = None
    for _ in range(64):  # 4 MiB holds fewer than 16 chunks of 256 KiB
        chunk = raw_chunk()
        try:
            store.put(*chunk)
        except StoreFullError as exc:
            error = exc
            break
        stored.append(chunk)
    assert error is not None, "a 4 MiB tmpfs took 64 chunks of 256 KiB"
    assert 8 <= len(stored) < 16
    message = str(error)
    free = os.statvfs(store.data_dir).f_bavail * os.statvfs(store.data_dir).f_frsize
    assert str(store.data_dir) in message and "bytes free" in message
    assert error.free_bytes == free and f"{free} bytes free" in message
    assert leftovers(store.data_dir) == []
    # A second refusal logs nothing new: one WARNING per full episode.
    with pytest.raises(StoreFullError):
        store.put(*raw_chunk())
    full_lines = [r for r in caplog.records if "chunk store full" in r.getMessage()]
    assert len(full_lines) == 1 and full_lines[0].levelno == logging.WARNING
    assert "free_bytes=" in full_lines[0].getMessage() and "server=ps7" in full_lines[0].getMessage()
    # Everything stored before stays readable, bit-exact, and the counts match the disk.
    reopened = ChunkStore(store.data_dir, cache_bytes=0)
    for s in (store, reopened):
        assert [s.verify(cid).data == data for cid, data, *_ in stored] == [True] * len(stored)
        assert s.stats().chunk_count == len(stored)
    reopened.close()  # a read-only view keeps the segment files open: compaction could not give their space back
    # An already stored chunk is still acknowledged (nothing to write).
    assert store.put(*stored[0]) is False
    # Deleting (the store keeps room for its tombstones) and compacting frees space, and writes work again.
    for cid, *_ in stored[:3]:
        assert store.delete(cid)
    with pytest.raises(StoreFullError):
        store.put(*raw_chunk())  # the records are still there until compaction drops their segment
    assert Compactor(store).run_until_idle() >= 1
    again = raw_chunk()
    assert store.put(*again) is True and store.get(again[0]).data == again[1]
    assert any("accepts writes again" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("where", ["pwritev", "fdatasync", "fsync", "open"])
def test_no_space_at_any_step_of_a_write_is_a_clean_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, where: str
) -> None:
    # 16 KiB segments: the second 8 KiB chunk starts a new segment (open + fsync of file and folder),
    # then is appended (pwritev) and made durable (fdatasync, the group commit).
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=True, config=StoreConfig(segment_bytes=16 * KiB))
    kept = raw_chunk(8 * KiB)
    store.put(*kept)
    target = getattr(os, where)

    def no_space(*args: object, **kwargs: object) -> object:
        if where == "open" and not (str(args[0]).endswith(".seg") and int(args[1]) & os.O_CREAT):  # type: ignore[call-overload]
            return target(*args, **kwargs)
        raise OSError(code, os.strerror(code))

    chunk = raw_chunk(8 * KiB)
    monkeypatch.setattr(os, where, no_space)
    with pytest.raises(StoreFullError, match=str(tmp_path)) as info:
        store.put(*chunk)
    monkeypatch.setattr(os, where, target)
    assert os.strerror(code) in str(info.value) and "bytes free" in str(info.value) and chunk[0] in str(info.value)
    assert leftovers(tmp_path) == [] and not store.has(chunk[0])
    assert store.get(kept[0]).data == kept[1] and store.stats().chunk_count == 1
    assert store.put(*chunk) is True and store.stats().chunk_count == 2
    store.close()
    assert sorted(ChunkStore(tmp_path, cache_bytes=0).iter_ids()) == sorted([kept[0], chunk[0]])


def test_other_os_errors_are_not_reported_as_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=True)

    def broken(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(OSError) as info:
        store.put(*raw_chunk(4 * KiB))
    assert not isinstance(info.value, StoreFullError) and info.value.errno == errno.EIO
    assert leftovers(tmp_path) == []


def test_a_reserve_keeps_room_beside_the_store(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, reserve_bytes=1 << 62)  # no write fits
    with pytest.raises(StoreFullError, match="reserve"):
        store.put(*raw_chunk(4 * KiB))
    assert leftovers(tmp_path) == [] and len(store) == 0


# ------------------------------------------------------------------ repair on a full local disk


def test_repair_pauses_on_a_full_local_disk_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    queue = RepairQueue(clock=lambda: now[0])
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    chunks = [raw_chunk(4 * KiB) for _ in range(5)]
    for cid, *_ in chunks:
        queue.add(cid, "lost")
    by_id = {c[0]: StoredChunk(c[0], c[1], "raw", c[3], c[4]) for c in chunks}
    fetched: list[str] = []

    def fetch(cid: str) -> StoredChunk | None:
        fetched.append(cid)
        return by_id[cid]

    full = [True]
    real_put = store.put

    def put(*args: object) -> bool:
        if full[0]:
            raise StoreFullError(f"chunk store {store.data_dir} is full (No space left on device): 0 bytes free", 0)
        return real_put(*args)  # type: ignore[arg-type]

    store.put = put  # type: ignore[assignment]
    repairer = Repairer(store, queue, fetch, clock=lambda: now[0], full_backoff_s=30.0)
    caplog.set_level(logging.INFO, logger="paramserver.server.repair")
    first = repairer.step()
    assert first.store_full and len(first.failed) == 1 and len(fetched) == 1  # stops at the first refusal
    for t in (1.0, 5.0, 29.0):  # while backing off: nothing fetched, nothing logged
        now[0] = t
        assert repairer.step().store_full
    assert len(fetched) == 1
    now[0] = 31.0
    assert repairer.step().store_full and len(fetched) == 2  # one try, still full: back-off doubles
    now[0] = 80.0
    assert repairer.step().store_full and len(fetched) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "repair paused" in warnings[0].getMessage() and str(store.data_dir) in warnings[0].getMessage()
    assert all(item.attempts == 0 for item in queue.due(100)), "a full local disk is not the replicas' fault"
    full[0] = False
    now[0] = 92.0
    report = repairer.step()
    assert not report.store_full and sorted(report.repaired) == sorted(by_id) and len(queue) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("repair resumed" in m for m in messages)
    assert sum("chunk repaired: id=" in m for m in messages) == 5


def test_repair_failures_are_logged_with_the_chunk_and_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    queue = RepairQueue(clock=lambda: now[0])
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    cid = "ab" * 32
    queue.add(cid, "scrub found corruption")
    repairer = Repairer(store, queue, lambda c: None)
    caplog.set_level(logging.INFO, logger="paramserver.server.repair")
    for _ in range(8):
        assert repairer.step().failed == [cid]
        now[0] += 1000.0
    lines = [r for r in caplog.records if "chunk repair failed" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING] * 4  # attempts 1, 2, 4, 8
    assert f"id={cid}" in lines[0].getMessage() and "no replica has an intact copy" in lines[0].getMessage()


# ------------------------------------------------------------------ re-replication towards a full server


class FullDisk(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "chunk store /data/ps2 is full (No space left on device): 0 bytes free"


class FakePeer:
    def __init__(self) -> None:
        self.full = True
        self.has_calls = self.put_calls = 0
        self.stored: set[str] = set()

    def has_chunks(self, ids: list[str]) -> list[bool]:
        self.has_calls += 1
        return [cid in self.stored for cid in ids]

    def put_chunks(self, chunks: Iterable[ChunkData], batch_bytes: int = 0) -> pb.PutChunksReply:
        self.put_calls += 1
        reply = pb.PutChunksReply()
        for c in chunks:
            if self.full:
                raise FullDisk()
            self.stored.add(c.id)
            reply.chunks_stored += 1
        return reply


class FakePeers(PeerSet):
    def __init__(self, peer: FakePeer) -> None:
        members = [MemberRecord("ps1", "127.0.0.1:1", "127.0.0.1:2"), MemberRecord("ps2", "127.0.0.1:3", "127.0.0.1:4")]
        super().__init__("ps1", lambda: members, ring_config=RingConfig(vnodes=16), replication_factor=2)
        self.peer = peer

    def client(self, member: MemberRecord) -> FakePeer:  # type: ignore[override]
        assert member.server_id == "ps2"
        return self.peer


def test_re_replication_backs_off_a_full_target_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    ids = []
    for _ in range(40):
        c = raw_chunk(4 * KiB)
        store.put(*c)
        ids.append(c[0])
    peer = FakePeer()
    now = [0.0]
    rr = ReReplicator(FakePeers(peer), store, batch=8, full_backoff_s=30.0, max_full_backoff_s=120.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="paramserver.server.replication")
    first = rr.step()
    assert first.full == ["ps2"] and not first.unreachable and peer.put_calls == 1  # stops at the first refusal
    assert rr.full_targets() == ["ps2"]
    for t in (1.0, 10.0, 29.0):  # backing off: no HasChunks, no push, a pass that is not "clean"
        now[0] = t
        report = rr.step()
        assert report.full == ["ps2"] and not report.skipped
    assert peer.put_calls == 1 and peer.has_calls == 1
    now[0] = 31.0
    assert rr.step().full == ["ps2"] and peer.put_calls == 2  # retried, still full: 60 s now
    now[0] = 80.0
    rr.step()
    assert peer.put_calls == 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "ps2" in warnings[0].getMessage() and "RESOURCE_EXHAUSTED" in warnings[0].getMessage()
    assert "is full" in warnings[0].getMessage()
    peer.full = False  # space returned
    now[0] = 92.0
    report = rr.step()
    assert report.full == [] and report.copied == len(peer.stored) > 0 and rr.full_targets() == []
    assert any("resumed" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    clean = rr.step()  # everything is there now: a clean pass, and the gate skips the next ones again
    assert clean.missing == 0 and not clean.full and not clean.skipped
    assert rr.step().skipped


# ------------------------------------------------------------------ a real server on a full disk


@pytest.mark.integration
def test_a_server_on_a_full_disk_answers_resource_exhausted_and_keeps_serving_reads(small_fs: Path) -> None:
    import sys
    import time

    from paramserver.client.rpc import ParamServerClient, make_chunk
    from tests.conftest import stop_process

    admin = "admin-token-full"
    port_file = small_fs.parent / "port"
    data_dir = small_fs / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramserver.server.dataplane_dev", "--id", "psfull", "--data-dir", str(data_dir),
         "--port-file", str(port_file), "--listen", "127.0.0.1:0", "--cache-bytes", "0"],
        env={**os.environ, "PARAMS_ADMIN_TOKEN": admin}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "server exited"
            assert time.monotonic() < deadline, "server did not start within 30 s"
            time.sleep(0.05)
        with ParamServerClient(f"127.0.0.1:{port_file.read_text()}", token=admin) as client:
            client.wait_ready(15)
            stored: list[ChunkData] = []
            refusal: grpc.RpcError | None = None
            for _ in range(64):
                data = os.urandom(256 * KiB)
                chunk = make_chunk(content_id(data), data)
                try:
                    client.put_chunks([chunk])
                except grpc.RpcError as exc:
                    refusal = exc
                    break
                stored.append(chunk)
            assert refusal is not None and stored
            assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refusal
            details = refusal.details() or ""
            assert str(data_dir) in details and "bytes free" in details and "psfull" in details
            assert list(client.get_chunks([c.id for c in stored])) == stored  # reads go on, bit-exact
            assert client.server_status().chunk_count == len(stored)
            assert leftovers(data_dir) == []
    finally:
        stop_process(proc)
