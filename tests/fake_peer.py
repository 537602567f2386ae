"""A lying worker peer for tests/integration/test_fanout.py (issue 42): it announces itself to the
cluster as a complete holder of some versions and serves every chunk of them with a bit flipped, the
last four bytes changed so that the CRC32C of the bad bytes EQUALS the good bytes' (the manifest's),
and that CRC in its headers: a reader that checked CRCs alone would take them; only the content id
(BLAKE3) catches the lie.

    PARAMS_CONFIG=... python -m tests.fake_peer MODEL@N [MODEL@N ...]

It reads the real chunks of each version from the servers, serves them through the real
``worker.peer_port.PeerPort`` (the cluster's token, loopback), announces through the real
``paramserver.client.peers.PeerDirectory`` (worker id ``fake-peer``, started long ago: every reader
takes it for the seed), prints ``FAKE ADDRESS`` once serving and ``SERVED CHUNKS BYTES`` whenever its
counters change; SIGTERM: a leaving announce, then exit 0.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from chunking.chunk_table import ChunkRows
from chunking.hashing import crc32c
from paramserver.client.peers import PeerDirectory, PeerVersion
from paramserver.client.session import ClusterClient
from worker.peer_common import PeerPortConfig
from worker.peer_port import PeerPort
from worker.peer_shelf import Found, PeerShelf

WORKER_ID = "fake-peer"


class Collect:
    """A fetch sink keeping each chunk's verified raw bytes by id."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = ids
        self.data: dict[str, bytes] = {}

    def regions(self, rows: np.ndarray) -> None:
        return None

    def landed_in_place(self, rows: np.ndarray, source: str = "network") -> None:
        raise AssertionError("no regions were given")

    def write(self, row: int, raw: object, source: str = "network") -> None:
        self.data[self.ids[row]] = bytes(memoryview(raw))  # type: ignore[arg-type]


def _linear(data: bytes) -> int:
    """The linear part of CRC32C: for buffers of one length, _linear(a ^ b) == _linear(a) ^ _linear(b)."""
    return crc32c(data) ^ crc32c(bytes(len(data)))


def crc_keeping_delta() -> bytes:
    """Five bytes to XOR onto the end of any buffer: the first flips a bit, the other four cancel its
    effect on the CRC32C (leading bytes add nothing to the linear part, so this holds for every buffer)."""
    target = _linear(b"\x01" + bytes(4))
    columns = [_linear(bytes(1) + (1 << j).to_bytes(4, "little")) for j in range(32)]
    # Solve sum(x_j * columns[j]) == target over GF(2) (Gauss-Jordan on 32 x 32 bits).
    pivots: list[tuple[int, int, int]] = []  # (pivot bit, combined column value, combination of unknowns)
    for j, col in enumerate(columns):
        combo = 1 << j
        for bit, value, mix in pivots:
            if col >> bit & 1:
                col, combo = col ^ value, combo ^ mix
        if col:
            pivots.append((col.bit_length() - 1, col, combo))
    rest, solution = target, 0
    for bit, value, mix in pivots:
        if rest >> bit & 1:
            rest, solution = rest ^ value, solution ^ mix
    assert rest == 0, "CRC32C cannot be kept with four bytes (impossible)"
    delta = b"\x01" + solution.to_bytes(4, "little")
    assert _linear(delta) == 0
    return delta


class FlippedShelf(PeerShelf):
    """Every chunk it knows with a bit flipped and its CRC32C kept (see crc_keeping_delta)."""

    def __init__(self, chunks: dict[str, bytes]) -> None:
        super().__init__(None)
        delta = crc_keeping_delta()
        self.flipped: dict[str, bytes] = {}
        for cid, data in chunks.items():
            bad = bytearray(data)
            if len(bad) >= len(delta):
                for k, d in enumerate(delta):
                    bad[len(bad) - len(delta) + k] ^= d
                assert crc32c(bytes(bad)) == crc32c(data) and bytes(bad) != data
            else:  # too short to keep its CRC: a plain flip
                bad[0] ^= 0x01
            self.flipped[cid] = bytes(bad)

    def find(self, ids: Sequence[str], deadline: float) -> list[Found | None]:
        out: list[Found | None] = []
        for cid in ids:
            data = self.flipped.get(cid)
            out.append(None if data is None else Found(memoryview(data), crc32c(data)))
        return out

    def raw_sizes(self, ids: Sequence[str]) -> np.ndarray:
        return np.array([len(self.flipped.get(cid, b"")) for cid in ids], dtype=np.int64)


def main(argv: Sequence[str]) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = ClusterClient.from_config()
    chunks: dict[str, bytes] = {}
    manifest_ids: list[str] = []
    for ref in argv:
        manifest = client.manifest(client.resolve_ref(ref).manifest_id)
        table = manifest.chunks
        sink = Collect(list(table.ids))
        client.fetch(ChunkRows.of(table), sink)
        chunks.update(sink.data)
        manifest_ids.append(manifest.id)
    shelf = FlippedShelf(chunks)
    port = PeerPort(shelf, PeerPortConfig(), client.options.token).start()
    directory = PeerDirectory(client, WORKER_ID, lease_s=10.0)
    versions = [PeerVersion(mid, True, time.time() - 3600.0) for mid in manifest_ids]
    directory.announce(port.address, versions)
    print(f"FAKE {port.address}", flush=True)
    last = (-1, -1)
    next_announce = time.monotonic() + 2.0
    try:
        while not stop.is_set():
            if time.monotonic() >= next_announce:
                directory.announce(port.address, versions)
                next_announce = time.monotonic() + 2.0
            now = (port.served_chunks, port.served_bytes)
            if now != last:
                print(f"SERVED {now[0]} {now[1]}", flush=True)
                last = now
            stop.wait(0.05)
    finally:
        directory.announce(port.address, [], leaving=True)
        directory.close()
        port.stop()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
