"""Read sessions of the bulk port: requests of chunk ids answered in batches (the read protocol of
``paramserver.wire.bulk_frames``).

Reads go through ``ChunkStore.get_many`` (hot cache, CRC32C checked on every disk read): a
corrupt chunk is answered CORRUPT and never sent, and the store quarantines it and queues its
repair exactly as on the gRPC path.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import numpy as np

from paramserver.server.bulk_port.config import BulkServerConfig
from paramserver.server.errors import ChunkCorruptError, ChunkError
from paramserver.server.served_bytes import ServedBytes
from paramserver.server.store import ChunkStore
from paramserver.wire.bulk_frames import (
    CORRUPT, MISSING, OK, SEND_BATCH_BYTES, encode_batch, encode_header, encode_message,
    next_request, recv_by, send_all,
)


class ReadSessions:
    """Serves the read connections of one bulk server (one ``serve`` call per connection, on its thread)."""

    def __init__(self, store: ChunkStore, config: BulkServerConfig, stopped: threading.Event,
                 on_read: Callable[[str], None] | None, served: ServedBytes | None = None) -> None:
        self.store = store
        self.served = served or ServedBytes()  # chunk bytes sent (paramserver_served_bytes_total{path="bulk"})
        self.config = config
        self.stopped = stopped
        self.on_read = on_read  # told the id of every chunk served (hot-chunk read rates)

    def serve(self, conn: socket.socket, max_items: int) -> None:
        while not self.stopped.is_set():
            ids = next_request(conn, self.config.idle_timeout_s, self.config.io_timeout_s)
            if ids is None:
                return
            self._answer(conn, ids, max_items)

    def _answer(self, conn: socket.socket, ids: list[str], max_items: int) -> None:
        # Each batch is read from the store in one call (adjacent small records in one pread), so
        # it is cut first, by the records' sizes: at most ``max_items``, closed once it holds
        # SEND_BATCH_BYTES, as a batch of chunks read one by one would be.
        ends = np.cumsum(self.store.record_sizes(ids))
        start = 0
        while start < len(ids):
            # the first id that brings the batch to SEND_BATCH_BYTES closes it
            before = int(ends[start - 1]) if start else 0
            stop = min(int(np.searchsorted(ends, before + SEND_BATCH_BYTES, side="left")) + 1, start + max_items, len(ids))
            block = ids[start:stop]
            headers: list[bytes] = []
            payloads: list[bytes | memoryview] = []
            sent = 0  # chunk bytes in this batch (not error messages)
            for chunk_id, chunk in zip(block, self.store.get_many(block)):
                if isinstance(chunk, ChunkCorruptError):  # the store quarantined it and queued a repair
                    payload = encode_message(str(chunk))
                    head = encode_header(CORRUPT, stored_size=len(payload))
                elif isinstance(chunk, ChunkError):  # not stored here, or not a content id
                    payload = encode_message(str(chunk))
                    head = encode_header(MISSING, stored_size=len(payload))
                else:
                    payload = chunk.data
                    head = encode_header(OK, chunk.codec, chunk.raw_size, len(payload), chunk.crc32c)
                    sent += len(payload)
                    if self.on_read is not None:
                        self.on_read(chunk_id)
                headers.append(head)
                payloads.append(payload)
            send_all(conn, encode_batch(headers, payloads))
            self.served.add("bulk", sent)  # once the batch is out: a reader that went away mid-send counts nothing
            start = stop


__all__ = ["ReadSessions", "recv_by"]
