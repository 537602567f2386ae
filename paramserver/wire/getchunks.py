"""Hand-encoded GetChunksReply messages: the data plane's hot path.

Measured here, protobuf's SerializeToString of a 2 MiB GetChunksReply runs at
about 0.7 GB/s, slower than the loopback link, while joining the chunk bytes
with hand-written field headers runs at about 8 GB/s. The output is the exact
protobuf encoding of pdparams.v1.GetChunksReply (fields in number order,
proto3 defaults omitted), so clients parse it with the generated class; a unit
test checks byte equality against SerializeToString.
"""
from __future__ import annotations

from typing import Iterable

from paramserver.wire.proto import pb

# Field keys: (number << 3) | wire type (0 = varint, 2 = length-delimited).
_REPLY_CHUNKS = b"\x0a"  # GetChunksReply.chunks = 1
_REPLY_ERRORS = b"\x12"  # GetChunksReply.errors = 2
_ID, _DATA, _CODEC, _RAW_SIZE, _CRC = b"\x0a", b"\x12", b"\x1a", b"\x20", b"\x28"


def varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


BytesLike = bytes | bytearray | memoryview


def chunk_parts(chunk_id: str, data: BytesLike, codec: str, raw_size: int, crc: int) -> list[BytesLike]:
    """The encoding of one ``chunks`` entry of a GetChunksReply, as parts to join."""
    head = b""
    if chunk_id:
        cid = chunk_id.encode()
        head = _ID + varint(len(cid)) + cid
    if data:
        head += _DATA + varint(len(data))
    tail = b""
    if codec:
        c = codec.encode()
        tail = _CODEC + varint(len(c)) + c
    if raw_size:
        tail += _RAW_SIZE + varint(raw_size)
    if crc:
        tail += _CRC + varint(crc)
    size = len(head) + len(data) + len(tail)
    return [_REPLY_CHUNKS + varint(size) + head, data, tail]


def error_parts(acks: Iterable[pb.ChunkAck]) -> list[bytes]:
    parts = []
    for ack in acks:
        body = ack.SerializeToString()
        parts.append(_REPLY_ERRORS + varint(len(body)) + body)
    return parts


class ReplyBuilder:
    """Accumulates chunks (and per-chunk errors) of one GetChunksReply."""

    __slots__ = ("_parts", "_errors", "payload_bytes", "error_bytes", "count")

    def __init__(self) -> None:
        self._parts: list[BytesLike] = []
        self._errors: list[pb.ChunkAck] = []
        self.payload_bytes = 0
        self.error_bytes = 0  # about what the errors add to the message (their ids and messages)
        self.count = 0

    @property
    def size(self) -> int:
        """About the encoded size so far, errors included: what a sender splits messages by."""
        return self.payload_bytes + self.error_bytes

    def add_chunk(self, chunk_id: str, data: BytesLike, codec: str, raw_size: int, crc: int) -> None:
        self._parts += chunk_parts(chunk_id, data, codec, raw_size, crc)
        self.payload_bytes += len(data)
        self.count += 1

    def add_error(self, chunk_id: str, status: pb.ChunkStatus, message: str) -> None:
        self._errors.append(pb.ChunkAck(id=chunk_id, status=status, message=message))
        self.error_bytes += len(chunk_id) + len(message.encode()) + 8

    def __bool__(self) -> bool:
        return bool(self.count or self._errors)

    def encode(self) -> bytes:
        return b"".join([*self._parts, *error_parts(self._errors)])


def passthrough_serializer(message: bytes | pb.GetChunksReply) -> bytes:
    """Response serializer for GetChunks: pre-encoded bytes pass through unchanged."""
    return message if isinstance(message, bytes) else message.SerializeToString()


__all__ = ["ReplyBuilder", "chunk_parts", "varint", "passthrough_serializer"]
