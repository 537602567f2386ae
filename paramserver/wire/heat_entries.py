"""The ``repeated HeatEntry entries`` of heat messages, encoded and decoded as arrays.

A heat report of a model of half a million chunks is half a million entries; protobuf's own
message objects cost about 2 us each to build in Python (a second of a worker's GIL per server
for one report) and a Python step each to read. Both ends here work on the protobuf encoding
directly, with a few numpy passes: ``decode_entries``/``request_arrays`` read a
``ReportHeatRequest``'s entries, ``encode_entries`` writes a ``GetHeatReply``'s (field 3, on the
servers) or a ``ReportHeatRequest``'s (field 4, on the workers). The bytes are what protobuf
itself writes for the same entries, so either side may be protobuf's own code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
from numpy.typing import NDArray

from paramserver.wire.proto import pb

U64 = NDArray[np.uint64]

_KEY_INDEX, _KEY_COUNT, _KEY_ORDER, _KEY_ENTRY = 0x08, 0x10, 0x18, 0x22  # HeatEntry fields 1-3, ReportHeatRequest.entries = 4
_DECODE_BLOCK = 1 << 20  # bytes tokenised per numpy pass: bounds the temporaries (~30 bytes per byte)
_FULL_ENTRY = np.array([_KEY_ENTRY, _KEY_INDEX, _KEY_COUNT, _KEY_ORDER], np.uint64)


@dataclass(frozen=True)
class HeatEntry:
    chunk_index: int
    count: int
    first_access_order: int


@dataclass(frozen=True)
class HeatArrays:
    """A report's entries as arrays (aligned): chunk index, count, first-access order."""

    index: U64
    count: U64
    order: U64

    def __len__(self) -> int:
        return int(self.index.size)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return zip(self.index.tolist(), self.count.tolist(), self.order.tolist())

    def part(self, start: int, stop: int) -> HeatArrays:
        return HeatArrays(self.index[start:stop], self.count[start:stop], self.order[start:stop])

    @classmethod
    def of(cls, entries: HeatArrays | Iterable[HeatEntry | tuple[int, int, int]]) -> HeatArrays:
        """``entries`` as arrays (arrays as they are). ValueError for a negative value; values past
        uint64 are clamped to its largest."""
        if isinstance(entries, HeatArrays):
            return entries
        rows = [(e.chunk_index, e.count, e.first_access_order) if isinstance(e, HeatEntry) else tuple(e) for e in entries]
        if not rows:
            empty = np.zeros(0, np.uint64)
            return cls(empty, empty.copy(), empty.copy())
        if any(int(v) < 0 for row in rows for v in row):
            raise ValueError("heat entries are (chunk index, count, first-access order), none of them negative")
        a = np.array([[min(int(v), (1 << 64) - 1) for v in row] for row in rows], dtype=np.uint64)
        return cls(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())


# ------------------------------------------------------------------ protobuf varints, vectorised


def _varints(seg: NDArray[np.uint8], ends: NDArray[np.intp]) -> U64:
    """The values of the varints in ``seg`` (which ends with the last one; ``ends``: their last bytes)."""
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > 10:
        raise ValueError("a varint is longer than 10 bytes")
    values = (seg[starts] & 0x7F).astype(np.uint64)
    for k in range(1, int(lengths.max())):
        longer = np.flatnonzero(lengths > k)
        values[longer] |= (seg[starts[longer] + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    return values


def decode_entries(buf: bytes, count: int) -> HeatArrays:
    """The ``count`` entries of a serialised ``ReportHeatRequest`` that holds nothing but them.

    The caller clears the other fields and unknown fields and re-serialises (protobuf's C
    code), so ``buf`` is a stream of (key, varint) pairs: an entry's key 0x22 and length,
    then its fields 0x08/0x10/0x18 with their values (proto3 leaves out zeros). Decoded a
    block of whole entries at a time; ValueError for anything else.
    """
    index = np.zeros(count, np.uint64)
    counts = np.zeros(count, np.uint64)
    order = np.zeros(count, np.uint64)
    data = np.frombuffer(buf, dtype=np.uint8)
    done = 0  # entries decoded
    pos = 0  # always the start of an entry
    while pos < data.size:
        seg = data[pos : pos + _DECODE_BLOCK]
        last = pos + seg.size == data.size
        ends = np.flatnonzero(seg < 0x80)
        if ends.size < 2 or (last and int(ends[-1]) != seg.size - 1):
            raise ValueError("the entries end inside a varint")
        tokens = _varints(seg[: int(ends[-1]) + 1], ends)
        if last:
            if tokens.size % 2:
                raise ValueError("a key without a value")
            step = data.size - pos
        else:  # the block's last entry may run past it: leave it to the next block
            starts = np.flatnonzero(tokens[0 : tokens.size - 1 : 2] == _KEY_ENTRY)
            if starts.size < 2:
                raise ValueError("no whole entry in a block")
            cut = 2 * int(starts[-1])
            tokens, step = tokens[:cut], int(ends[cut - 1]) + 1
        keys, values = tokens[0::2], tokens[1::2]
        if keys.size % 4 == 0 and bool((keys.reshape(-1, 4) == _FULL_ENTRY).all()):
            rows = values.reshape(-1, 4)  # every field set: no scatter needed
            n = rows.shape[0]
            if done + n > count:
                raise ValueError(f"more than the {count} entries parsed")
            index[done : done + n], counts[done : done + n], order[done : done + n] = rows[:, 1], rows[:, 2], rows[:, 3]
            done += n
        else:
            is_start = keys == _KEY_ENTRY
            if keys.size and not bool(is_start[0]):
                raise ValueError("a field before the first entry")
            owner = np.cumsum(is_start, dtype=np.int64) + (done - 1)
            n = int(is_start.sum())
            if done + n > count:
                raise ValueError(f"more than the {count} entries parsed")
            known = is_start.copy()
            for key, out in ((_KEY_INDEX, index), (_KEY_COUNT, counts), (_KEY_ORDER, order)):
                mask = keys == key
                known |= mask
                out[owner[mask]] = values[mask]
            if not bool(known.all()):
                raise ValueError("a field that is not part of a HeatEntry")
            done += n
        pos += step
    if done != count:
        raise ValueError(f"{done} entries decoded, {count} parsed")
    return HeatArrays(index, counts, order)


def request_arrays(request: pb.ReportHeatRequest) -> HeatArrays:
    """The entries of ``request`` as arrays. Clears the request's other fields (read them first)."""
    n = len(request.entries)
    if n == 0:
        return HeatArrays.of(())
    for name in ("model", "version", "worker"):
        request.ClearField(name)
    try:
        return decode_entries(request.SerializeToString(), n)
    except ValueError:
        pass
    request.DiscardUnknownFields()  # a sender's unknown fields (costly: only when there are some)
    try:
        return decode_entries(request.SerializeToString(), n)
    except ValueError:  # never seen: protobuf writes exactly the shape decode_entries reads
        return HeatArrays.of((e.chunk_index, e.count, e.first_access_order) for e in request.entries)


_VARINT_LIMITS = np.array([1 << (7 * k) for k in range(1, 10)], np.uint64)


def _varint_sizes(values: U64) -> NDArray[np.int64]:
    return np.searchsorted(_VARINT_LIMITS, values, side="right").astype(np.int64) + 1


def _put_varints(out: NDArray[np.uint8], at: NDArray[np.int64], values: U64, sizes: NDArray[np.int64]) -> None:
    for k in range(int(sizes.max()) if sizes.size else 0):
        rows = np.flatnonzero(sizes > k)
        byte = (values[rows] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (sizes[rows] > k + 1).astype(np.uint64) << np.uint64(7)
        out[at[rows] + k] = (byte | more).astype(np.uint8)


_UINT32_MAX = (1 << 32) - 1
GET_REPLY_ENTRIES, REPORT_REQUEST_ENTRIES = 3, 4  # the field number of ``entries`` in each message


def encode_entries(index: U64, count: U64, order: U64, field: int = GET_REPLY_ENTRIES) -> bytes:
    """``repeated HeatEntry entries = field`` (every HeatEntry field written, zeros too, which
    protobuf itself leaves out: every parser reads both)."""
    if not 1 <= field <= 15:
        raise ValueError(f"field {field}: only fields 1-15 have the one-byte key written here")
    if index.size == 0:
        return b""
    si, sc, so = _varint_sizes(index), _varint_sizes(count), _varint_sizes(order)
    body = 3 + si + sc + so  # three keys + values: at most 3 + 5 + 10 + 5 < 128, a one-byte length
    total = 2 + body
    start = np.zeros(index.size, np.int64)
    np.cumsum(total[:-1], out=start[1:])
    out = np.empty(int(total.sum()), np.uint8)
    out[start] = (field << 3) | 2  # length-delimited
    out[start + 1] = body.astype(np.uint8)
    out[start + 2] = _KEY_INDEX
    _put_varints(out, start + 3, index, si)
    at = start + 3 + si
    out[at] = _KEY_COUNT
    _put_varints(out, at + 1, count, sc)
    at = at + 1 + sc
    out[at] = _KEY_ORDER
    _put_varints(out, at + 1, order, so)
    return out.tobytes()


HEADER_FIELDS = 8  # top-level fields report_header reads before it gives up


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(raw) and shift < 70:
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("the message ends inside a varint, or a varint is longer than 10 bytes")


def report_header(raw: bytes) -> tuple[str, int]:
    """(model, version) of a serialised ``ReportHeatRequest``, read without parsing its entries.

    A server checks them before it parses the (megabytes of) entries: a report for a version it
    does not have is refused unparsed. Protobuf writes fields in number order, so model (1) and
    version (2) come before the entries (4); reading stops at the first entry or after
    HEADER_FIELDS fields. Missing ones are "" and 0. ValueError for bytes that are not a message.
    The caller checks that the parsed message names the same (a later duplicate field would win).
    """
    model, version, pos = "", 0, 0
    for _ in range(HEADER_FIELDS):
        if pos >= len(raw):
            break
        key, pos = _varint(raw, pos)
        number, wire = key >> 3, key & 7
        if number == 4:
            break
        if wire == 0:
            value, pos = _varint(raw, pos)
            if number == 2:
                version = value
        elif wire == 2:
            length, end = _varint(raw, pos)
            pos = end + length
            if pos > len(raw):
                raise ValueError("a field runs past the end of the message")
            if number == 1:
                model = raw[end:pos].decode("utf-8")  # UnicodeDecodeError is a ValueError
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"field {number} has wire type {wire}, which a ReportHeatRequest does not use")
    return model, version


def report_request(model: str, version: int, worker: str, entries: HeatArrays) -> bytes:
    """A serialised ``ReportHeatRequest``: its scalar fields through protobuf, its entries here.

    ValueError for a chunk index or an order past ``uint32`` (a server would read their low bits:
    another chunk's heat)."""
    for name, values in (("chunk index", entries.index), ("first-access order", entries.order)):
        if values.size and int(values.max()) > _UINT32_MAX:
            raise ValueError(f"a heat entry's {name} {int(values.max())} does not fit the wire's uint32")
    head = pb.ReportHeatRequest(model=model, version=version, worker=worker).SerializeToString()
    return head + encode_entries(entries.index, entries.count, entries.order, REPORT_REQUEST_ENTRIES)


__all__ = ["GET_REPLY_ENTRIES", "REPORT_REQUEST_ENTRIES", "HeatArrays", "HeatEntry", "decode_entries", "encode_entries",
           "report_header", "report_request", "request_arrays"]
