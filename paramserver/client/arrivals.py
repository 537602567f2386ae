"""What a chunk transport is asked and what it delivers, as columns: the contract between the
fetch engine (``paramserver.client.fetch``) and its transports (``paramserver.client.transport``).

A read asks one server for chunks named by :class:`ReadIds` (binary digests, the bulk port's
form; hex on demand, gRPC's). The answers come in :class:`Arrivals` batches -- what arrived
together: one bulk batch, one GetChunks message -- each item naming its position in the read,
so a batch of 64 chunks of 4 KiB is handled with a few array operations rather than an object
and a dict look-up per chunk. ``Into`` lets the engine offer, before a batch's bytes arrive, the
final destination of each raw chunk, so its bytes are received straight there.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import NamedTuple

import numpy as np

from chunking.hashing import Buffer, hex_ids

DIGEST_BYTES = 32

# (position of the batch's first item in the read, per item: OK and stored raw, per item: stored
# size) -> per item the buffer of exactly that size to receive it into, or None; or None for none.
Into = Callable[[int, np.ndarray, np.ndarray], "Sequence[memoryview | None] | None"]


class ReadIds:
    """The chunk ids of one read, in order."""

    def __init__(self, digests: np.ndarray) -> None:
        if digests.ndim != 2 or digests.shape[1] != DIGEST_BYTES or digests.dtype != np.uint8:
            raise ValueError(f"chunk digests must be an (n, {DIGEST_BYTES}) uint8 array, got {digests.shape} {digests.dtype}")
        self.digests = digests

    @classmethod
    def of_hex(cls, ids: Sequence[str]) -> ReadIds:
        """From hex content ids (64 digits each); ValueError otherwise."""
        if any(len(cid) != 2 * DIGEST_BYTES for cid in ids):
            raise ValueError(f"chunk ids are {DIGEST_BYTES}-byte content ids (64 hex digits)")
        try:
            raw = bytes.fromhex("".join(ids))
        except ValueError:
            raise ValueError(f"chunk ids are {DIGEST_BYTES}-byte content ids (64 hex digits)") from None
        made = cls(np.frombuffer(raw, dtype=np.uint8).reshape(-1, DIGEST_BYTES))
        made.__dict__["hex"] = list(ids)
        return made

    @cached_property
    def hex(self) -> list[str]:
        return hex_ids(self.digests)

    def __len__(self) -> int:
        return len(self.digests)

    def __getitem__(self, index: slice) -> ReadIds:
        part = ReadIds(self.digests[index])
        if "hex" in self.__dict__:
            part.__dict__["hex"] = self.__dict__["hex"][index]
        return part


class Arrivals(NamedTuple):
    """Chunks that arrived together, one entry per item in every column."""

    positions: np.ndarray  # int64: each item's position in the read's ids
    ok: np.ndarray  # bool: the stored bytes are in ``data``; else refused, ``messages`` says why
    corrupt: np.ndarray  # bool: refused because the server's copy failed its own check
    codecs: Sequence[str]  # stored encoding ("" when refused)
    crcs: np.ndarray  # uint32: the server's CRC32C of the stored bytes
    data: Sequence[Buffer]  # stored bytes: views that may be reused once the batch is consumed
    in_place: np.ndarray  # bool: ``data`` is the destination ``into`` gave for that item
    messages: Sequence[str]

    @classmethod
    def of(cls, items: Sequence[tuple[int, bool, bool, str, int, Buffer, bool, str]]) -> Arrivals:
        """From ``(position, ok, corrupt, codec, crc, data, in_place, message)`` per item (a transport
        that gets its answers one at a time: gRPC, the in-memory one of the tests)."""
        n = len(items)
        return cls(
            np.fromiter((i[0] for i in items), dtype=np.int64, count=n),
            np.fromiter((i[1] for i in items), dtype=bool, count=n),
            np.fromiter((i[2] for i in items), dtype=bool, count=n),
            [i[3] for i in items],
            np.fromiter((i[4] for i in items), dtype=np.uint32, count=n),
            [i[5] for i in items],
            np.fromiter((i[6] for i in items), dtype=bool, count=n),
            [i[7] for i in items],
        )


__all__ = ["Arrivals", "Into", "ReadIds"]
