"""The hand-encoded GetChunks replies are exactly what protobuf would produce."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.wire.proto import pb
from paramserver.wire.getchunks import ReplyBuilder, passthrough_serializer, varint

chunks_strategy = st.lists(
    st.tuples(
        st.text(alphabet="0123456789abcdef", max_size=64),
        st.binary(max_size=2048),
        st.sampled_from(["", "raw", "zstd", "zstd+shuffle4"]),
        st.integers(min_value=0, max_value=(1 << 64) - 1),
        st.integers(min_value=0, max_value=(1 << 32) - 1),
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(chunks=chunks_strategy,
       errors=st.lists(st.tuples(st.text(max_size=70), st.sampled_from([pb.MISSING, pb.CORRUPT]), st.text(max_size=40)), max_size=3))
def test_encoding_matches_protobuf(chunks: list[tuple[str, bytes, str, int, int]], errors: list[tuple[str, int, str]]) -> None:
    builder = ReplyBuilder()
    expected = pb.GetChunksReply()
    for cid, data, codec, raw_size, crc in chunks:
        builder.add_chunk(cid, data, codec, raw_size, crc)
        expected.chunks.add(id=cid, data=data, codec=codec, raw_size=raw_size, crc32c=crc)
    for cid, status, message in errors:
        builder.add_error(cid, status, message)
        expected.errors.add(id=cid, status=status, message=message)
    encoded = builder.encode()
    assert encoded == expected.SerializeToString()
    assert pb.GetChunksReply.FromString(encoded) == expected
    assert builder.count == len(chunks) and builder.payload_bytes == sum(len(c[1]) for c in chunks)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, (1 << 32) - 1, (1 << 64) - 1])
def test_varint(n: int) -> None:
    from google.protobuf.internal import encoder  # the reference implementation

    out: list[bytes] = []
    encoder._VarintEncoder()(out.append, n, True)  # type: ignore[attr-defined]
    assert varint(n) == b"".join(out)


def test_large_chunk_and_passthrough() -> None:
    data = os.urandom(300 * 1024)
    builder = ReplyBuilder()
    builder.add_chunk("ab" * 32, data, "raw", len(data), 0xFFFFFFFF)
    encoded = builder.encode()
    assert passthrough_serializer(encoded) is encoded
    parsed = pb.GetChunksReply.FromString(encoded)
    assert parsed.chunks[0].data == data and parsed.chunks[0].crc32c == 0xFFFFFFFF
    assert passthrough_serializer(parsed) == encoded
