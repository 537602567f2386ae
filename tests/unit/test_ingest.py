"""paramserver.server.ingest: the one way a bulk PUT and a PutChunks message reach the store."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import pytest

from chunking.hashing import content_id, crc32c
from paramserver.server.errors import StoreFullError
from paramserver.server.ingest import Kind, ingest
from paramserver.server.store import ChunkStore
from paramserver.wire.chunk_record import ChunkRecord


def chunk(size: int = 3000) -> ChunkRecord:
    data = os.urandom(size)
    return ChunkRecord(content_id(data), "raw", len(data), crc32c(data), data)


def forged() -> ChunkRecord:
    data = os.urandom(3000)
    return ChunkRecord("ef" * 32, "raw", len(data), crc32c(data), data)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    s = ChunkStore(tmp_path / "s", cache_bytes=0, fsync=False)
    yield s
    s.close()


class Repairs:
    def __init__(self) -> None:
        self.done_ids: list[str] = []

    def done(self, chunk_id: str) -> None:
        self.done_ids.append(chunk_id)


def test_stored_then_present_and_a_repeat_is_stored_once(store: ChunkStore) -> None:
    a, b = chunk(), chunk()
    repairs = Repairs()
    got = ingest(store, [a, b, a], where="server ps1", repair_queue=repairs)  # type: ignore[arg-type]
    assert [o.kind for o in got.outcomes] == [Kind.STORED, Kind.STORED, Kind.PRESENT]
    assert (got.stored, got.present, got.stored_bytes) == (2, 1, 6000) and got.accepted_bytes == 9000
    assert sorted(repairs.done_ids) == sorted([a.id, b.id]) and got.first_error() is None
    again = ingest(store, [b], where="server ps1")
    assert [o.kind for o in again.outcomes] == [Kind.PRESENT] and again.stored == 0


def test_an_invalid_chunk_spares_the_others_before_and_after_it(store: ChunkStore) -> None:
    good = [chunk() for _ in range(4)]
    bad = forged()
    got = ingest(store, [*good[:2], bad, *good[2:]], where="server ps1")
    kinds = [o.kind for o in got.outcomes]
    assert kinds == [Kind.STORED, Kind.STORED, Kind.INVALID, Kind.STORED, Kind.STORED]
    error = got.first_error()
    assert error is not None and error.message.startswith("server ps1: ") and bad.id in error.message
    assert all(store.has(c.id) for c in good) and not store.has(bad.id)


def test_a_full_disk_and_a_failing_store_answer_every_chunk(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(chunks: Iterable[Any]) -> list[bool]:
        raise StoreFullError("disk full under /data", free_bytes=77)

    monkeypatch.setattr(store, "put_many", full)
    got = ingest(store, [chunk(), chunk()], where="server ps1")
    assert [(o.kind, o.free_bytes) for o in got.outcomes] == [(Kind.FULL, 77)] * 2

    def broken(chunks: Iterable[Any]) -> list[bool]:
        raise OSError(errno.EROFS, "read only")

    monkeypatch.setattr(store, "put_many", broken)
    c = chunk()
    got = ingest(store, [c], where="server ps1")
    assert got.outcomes[0].kind is Kind.FAILED and f"could not store chunk {c.id}" in got.outcomes[0].message


class Hot:
    ADMIT, PLAIN = "admit", "plain"

    def __init__(self, decisions: dict[str, str]) -> None:
        self.decisions = decisions
        self.told: list[tuple[str, bool]] = []

    def admit(self, chunk_id: str, size: int) -> str:
        return self.decisions[chunk_id]

    def stored(self, chunk_id: str, was_stored: bool) -> None:
        self.told.append((chunk_id, was_stored))


def test_hot_copies_are_admitted_refused_or_stored_plainly(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    import paramserver.server.ingest as ingest_module

    monkeypatch.setattr(ingest_module, "HotChunks", Hot)
    extra, plain, over = chunk(), chunk(), chunk()
    hot = Hot({extra.id: Hot.ADMIT, plain.id: Hot.PLAIN, over.id: "extra-copy bounds reached"})
    got = ingest(store, [extra, plain, over, extra], where="server ps1", hot=hot, hot_copy=True)  # type: ignore[arg-type]
    assert [o.kind for o in got.outcomes] == [Kind.STORED, Kind.STORED, Kind.REFUSED, Kind.PRESENT]
    assert got.outcomes[2].message == "server ps1: hot copy refused: extra-copy bounds reached"
    assert hot.told == [(extra.id, True)]  # told once, though sent twice
    assert got.first_error() is None and not store.has(over.id)
    off = ingest(store, [chunk()], where="server ps1", hot=None, hot_copy=True)
    assert off.outcomes[0].kind is Kind.REFUSED and "--hot-chunks off" in off.outcomes[0].message
