"""The pull's zero-copy GetChunksReply parser agrees with protobuf and with paramserver.wire.getchunks."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.wire.proto import pb
from paramserver.client.getchunks_transport import parse_reply
from paramserver.wire.getchunks import ReplyBuilder

chunk = st.tuples(
    st.text(alphabet="0123456789abcdef", min_size=0, max_size=64),
    st.binary(max_size=2000),
    st.sampled_from(["raw", "zstd", "zstd+shuffle4", ""]),
    st.integers(min_value=0, max_value=(1 << 40)),
    st.integers(min_value=0, max_value=(1 << 32) - 1),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(chunk, max_size=6), st.lists(st.text(alphabet="0123456789abcdef", min_size=1, max_size=64), max_size=3))
def test_parse_matches_protobuf(chunks: list[tuple[str, bytes, str, int, int]], missing: list[str]) -> None:
    builder = ReplyBuilder()
    for cid, data, codec, raw_size, crc in chunks:
        builder.add_chunk(cid, data, codec, raw_size, crc)
    for cid in missing:
        builder.add_error(cid, pb.MISSING, "not here")
    encoded = builder.encode()
    reference = pb.GetChunksReply.FromString(encoded)
    got, errors = parse_reply(encoded)
    assert [(c.id, bytes(c.data), c.codec, c.raw_size, c.crc32c) for c in got] == [
        (c.id, c.data, c.codec, c.raw_size, c.crc32c) for c in reference.chunks
    ]
    assert [(e.id, e.status, e.message) for e in errors] == [(e.id, e.status, e.message) for e in reference.errors]


def test_parse_skips_unknown_fields_and_reads_protobuf_output() -> None:
    msg = pb.GetChunksReply(chunks=[pb.Chunk(id="ab", data=b"xyz", codec="raw", raw_size=3, crc32c=7)])
    encoded = msg.SerializeToString() + b"\x18\x05"  # an unknown varint field 3
    (c,), errors = parse_reply(encoded)
    assert (c.id, bytes(c.data), c.codec, c.raw_size, c.crc32c) == ("ab", b"xyz", "raw", 3, 7) and errors == []


def test_truncated_reply_is_refused() -> None:
    builder = ReplyBuilder()
    builder.add_chunk("ab", b"x" * 100, "raw", 100, 1)
    encoded = builder.encode()
    for cut in (1, 3, 50, len(encoded) - 1):
        with pytest.raises(ValueError):
            parse_reply(encoded[:cut])
