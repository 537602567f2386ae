"""Drill modules without a cluster: configs, the partition split, loader warm-up, chunk-file corruption helpers."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from deploy.drills.corrupt_chunk import CorruptChunkConfig
from deploy.drills.framework import DrillError, Loaded, Published, Workload, WorkloadConfig, wait_for
from deploy.drills.kill_leader import KillLeaderConfig
from deploy.drills.partition import PartitionDrillConfig, run_partition, split
from deploy.drills.probe import ChunkRecord, flip_bytes, restore_record
from deploy.drills.report import DrillReport
from deploy.local import LocalCluster, LocalClusterConfig


def test_split_puts_the_leader_in_the_largest_minority() -> None:
    assert split(["ps1", "ps2", "ps3"], "ps2") == (["ps2"], ["ps1", "ps3"])
    minority, majority = split(["a", "b", "c", "d", "e"], "c")
    assert minority[0] == "c" and len(minority) == 2 and len(majority) == 3
    assert not set(minority) & set(majority)
    with pytest.raises(DrillError, match="at least 3"):
        split(["a", "b"], "a")
    with pytest.raises(DrillError, match="not among"):
        split(["a", "b", "c"], "z")


@pytest.mark.parametrize("cfg, match", [
    (PartitionDrillConfig(hold_s=0), "hold_s"),
    (PartitionDrillConfig(commit_grace_s=-1), "commit_grace_s"),
    (PartitionDrillConfig(failover_limit_s=0), "failover_limit_s"),
    (KillLeaderConfig(rounds=0), "rounds"),
    (KillLeaderConfig(pause_s=-1), "pause_s"),
    (CorruptChunkConfig(flip=0), "flip"),
    (CorruptChunkConfig(scrub_limit_s=0), "scrub_limit_s"),
])
def test_drill_configs_say_what_to_fix(cfg: object, match: str) -> None:
    with pytest.raises(DrillError, match=match):
        cfg.validate()  # type: ignore[attr-defined]


def test_partition_drill_refuses_a_cluster_without_namespaces(tmp_path: Path) -> None:
    cluster = LocalCluster(LocalClusterConfig(root=tmp_path))
    w = Workload(DrillReport("p"), publish=lambda i: None)
    with pytest.raises(DrillError, match="namespace mode"):
        run_partition(cluster, DrillReport("p"), w)


def test_loaders_wait_for_the_first_publish() -> None:
    r = DrillReport("d")
    gate = threading.Event()
    loads_before_publish = []
    published = threading.Event()

    def publish(i: int) -> Published:
        gate.wait(5)
        published.set()
        return Published("m", i)

    def load(k: int, i: int) -> Loaded:
        if not published.is_set():
            loads_before_publish.append(i)
        return Loaded("m", "prod", 1)

    cfg = WorkloadConfig(loaders=2, publish_interval_s=0.01, load_interval_s=0.0, max_iterations=20)
    with Workload(r, publish=publish, load=load, config=cfg) as w:
        assert w.wait_success("loader-0", after=-1.0, timeout=0.2) is None
        gate.set()
        wait_for(lambda: len(w.loads[0]) >= 5, 10, what="loads after the first publish")
    assert loads_before_publish == []


def test_flip_bytes_keeps_the_header_and_restore_puts_the_record_back(tmp_path: Path) -> None:
    from chunking.hashing import content_id, crc32c
    from paramserver.server.errors import ChunkCorruptError
    from paramserver.server.store import HEADER_SIZE, ChunkStore

    store = ChunkStore(tmp_path, cache_bytes=0, fsync=False)
    content = bytes(range(256)) * 4
    cid = content_id(content)
    store.put(cid, content, "raw", len(content), crc32c(content))
    record = ChunkRecord(tmp_path, cid)
    assert record.exists() and record.name == cid
    before = record.read_bytes()
    original = flip_bytes(record, count=4)
    assert original == before and original[HEADER_SIZE:] == content
    flipped = record.read_bytes()
    assert flipped[:HEADER_SIZE] == original[:HEADER_SIZE] and flipped != original
    assert sum(a != b for a, b in zip(flipped, original)) == 4
    assert restore_record(record, original) and record.read_bytes() == original  # still the live record: in place
    assert store.get(cid).data == content
    flip_bytes(record)
    with pytest.raises(ChunkCorruptError):
        store.get(cid)  # a server quarantines the corrupt record
    assert not record.exists() and not restore_record(record, original)  # then only the server can take it back
    empty = content_id(b"")
    store.put(empty, b"", "raw", 0, crc32c(b""))
    with pytest.raises(ValueError, match="no data"):
        flip_bytes(ChunkRecord(tmp_path, empty))


