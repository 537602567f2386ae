"""kill -9 of a process writing to the segment store, at random moments, ten times (issue 12).

A child process runs concurrent put_many batches (group commit, fsync on), deletes of chunks it was
told are stored, and compaction steps, on small segments so that roll-overs, seals and segment
removals happen too; it prints each acknowledgement once the call returned. The parent kills it
with SIGKILL at a random moment, reopens the data dir and checks: every acknowledged chunk reads
bit-exact (and every acknowledged delete stays deleted), across all the earlier rounds too (a chunk
whose delete was in flight may be either); the
index matches an independent scan of the segment files with every record's CRC checked (and each
sealed segment's .idx lists what the scan found; ``tests.store_checks``); no
segment keeps a torn tail or a damaged region; nothing half-written is served.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chunking.hashing import content_id, crc32c
from tests.store_checks import records

KiB = 1 << 10
ROUNDS = 10


def chunk_of(seed: int) -> tuple[str, bytes, str, int, int]:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 16 * KiB))
    return content_id(data), data, "raw", len(data), crc32c(data)


# ------------------------------------------------------------------ the child


def child(data_dir: str, round_no: int) -> None:
    from paramserver.server.compaction import Compactor
    from paramserver.server.store import ChunkStore, StoreConfig

    config = StoreConfig(segment_bytes=128 * KiB, compact_bytes_per_s=64 << 20, compact_live_fraction=0.7)
    store = ChunkStore(data_dir, cache_bytes=0, fsync=True, config=config)
    out = sys.stdout
    lock = threading.Lock()
    acked: list[int] = []

    def say(line: str) -> None:
        with lock:
            out.write(line + "\n")
            out.flush()

    def writer(k: int) -> None:
        for i in range(100_000):
            seeds = [round_no * 10_000_000 + k * 1_000_000 + i * 8 + j for j in range(4)]
            store.put_many(records([chunk_of(s) for s in seeds]))
            say("P " + " ".join(map(str, seeds)))  # acknowledged: only now may the deleter pick them
            with lock:
                acked.extend(seeds)

    def deleter() -> None:
        rng = random.Random(round_no)
        while True:
            time.sleep(0.01)
            with lock:
                pick = acked.pop(rng.randrange(len(acked))) if len(acked) > 8 else None
            if pick is not None and rng.random() < 0.5:
                say(f"d {pick}")  # from here on it may be gone: a kill may come before the "D"
                assert store.delete(chunk_of(pick)[0])
                say(f"D {pick}")

    def compactor() -> None:
        c = Compactor(store)
        while True:
            c.step()
            time.sleep(0.02)

    threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(2)]
    threads += [threading.Thread(target=deleter, daemon=True), threading.Thread(target=compactor, daemon=True)]
    for t in threads:
        t.start()
    say("READY")
    threads[0].join()


# ------------------------------------------------------------------ the parent


def run_round(data_dir: Path, round_no: int, rng: random.Random) -> list[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.test_store_crash", "child", str(data_dir), str(round_no)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, b"")) if proc.stdout else None)  # type: ignore[func-returns-value]
    reader.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith(b"P ") for line in list(lines)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"child round {round_no} did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.01)
    time.sleep(rng.uniform(0.05, 0.6))
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    reader.join(30)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "Traceback" not in err, err
    return [line.decode() for line in lines if line.endswith(b"\n")]


@pytest.mark.integration
def test_kill_9_while_writing_deleting_and_compacting_loses_no_acknowledged_chunk(tmp_path: Path) -> None:
    from paramserver.server.store import ChunkStore
    from tests.store_checks import assert_index_matches_segments, scan_segments

    rng = random.Random(int(os.environ.get("STORE_CRASH_SEED", "1234")))  # another seed: other kill moments
    data_dir = tmp_path / "data"
    alive: set[int] = set()
    deleted: set[int] = set()
    totals = {"puts": 0, "deletes": 0, "segments_seen": 0}
    for round_no in range(1, ROUNDS + 1):
        for line in run_round(data_dir, round_no, rng):
            kind, _, rest = line.strip().partition(" ")
            if kind == "P":
                alive.update(int(s) for s in rest.split())
                totals["puts"] += len(rest.split())
            elif kind == "d":
                alive.discard(int(rest))  # being deleted: either outcome is right
            elif kind == "D":
                alive.discard(int(rest))
                deleted.add(int(rest))
                totals["deletes"] += 1
        store = ChunkStore(data_dir, cache_bytes=0)  # the reopen truncates torn tails
        try:
            assert not store.read_only
            ids = set(store.iter_ids())
            for seed in alive:
                cid, data, *_ = chunk_of(seed)
                assert cid in ids, f"round {round_no}: acknowledged chunk {cid} (seed {seed}) lost"
                assert store.verify(cid).data == data
            for seed in deleted:
                assert chunk_of(seed)[0] not in ids, f"round {round_no}: deleted chunk (seed {seed}) came back"
            for cid in ids:  # unacknowledged ones may be there, but only whole and correct
                store.verify(cid)
            # the index matches an independent scan of every segment, each record's CRC checked
            scans = scan_segments(data_dir)
            totals["segments_seen"] = max(totals["segments_seen"], max(scans, default=0))
            assert_index_matches_segments(store, scans)
        finally:
            store.close()
    assert totals["puts"] > 100 and totals["deletes"] > 5 and totals["segments_seen"] > 3, totals


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "child":
    child(sys.argv[2], int(sys.argv[3]))
