"""Decoders the store uses to prove a chunk's content id on ingest and scrub.

The server never needs to *encode*; it only decodes to check that the stored
bytes expand to exactly ``raw_size`` bytes whose hash is the chunk id. Each
decoder must refuse to produce more than ``raw_size`` bytes (decompression
bombs), and :func:`decode` refuses a ``raw_size`` above its ``limit`` (by default
chunking's largest chunk, 64 MiB) before any decoder runs, so decoding one chunk
never allocates more than that limit per output buffer. Besides "raw" and "zstd" it knows chunking's "zstd+shuffleN" (zstd
after a byte shuffle by element width N); others are added with
:func:`register_codec`.
"""
from __future__ import annotations

import threading
from typing import Callable, Union

import numpy as np
import zstandard

from chunking.config import MAX_CHUNK_SIZE

from paramserver.server.errors import DecodeError as DecodeError  # re-exported: its old home
from paramserver.server.errors import UnknownCodecError

Decoded = Union[bytes, bytearray, memoryview]
Decoder = Callable[[bytes, int], Decoded]

# The largest raw size decode() accepts unless told otherwise: chunking's largest chunk.
DEFAULT_MAX_RAW_BYTES = MAX_CHUNK_SIZE

_registry: dict[str, Decoder] = {}
_lock = threading.Lock()
_tls = threading.local()


def _raw(data: bytes, raw_size: int) -> Decoded:
    if len(data) != raw_size:
        raise DecodeError(f"raw chunk has {len(data)} bytes but declares raw_size {raw_size}")
    return data


def _zstd(data: bytes, raw_size: int) -> Decoded:
    dctx = getattr(_tls, "dctx", None)
    if dctx is None:
        dctx = _tls.dctx = zstandard.ZstdDecompressor()
    try:
        # zstandard allocates a frame's *declared* content size and ignores
        # max_output_size when one is present, so check the header first; a
        # frame without a declared size (-1) gets a buffer of exactly raw_size
        # (max_output_size) and fails when its content does not fit in it.
        declared = zstandard.frame_content_size(data)
        if declared > raw_size:
            raise DecodeError(f"zstd frame declares {declared} bytes, more than raw_size {raw_size}: refusing a decompression bomb")
        out = dctx.decompress(data, max_output_size=raw_size)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"zstd frame does not decode within raw_size {raw_size}: {exc}") from exc
    if len(out) != raw_size:
        raise DecodeError(f"zstd frame decodes to {len(out)} bytes, declared raw_size {raw_size}")
    return out


def register_codec(name: str, decoder: Decoder) -> None:
    """Teach the store a codec; ``decoder(stored, raw_size)`` returns the raw bytes."""
    with _lock:
        _registry[name] = decoder


def get_decoder(name: str) -> Decoder:
    found = _registry.get(name)
    if found is not None:
        return found
    width = _shuffle_width(name)
    if width is None:
        raise UnknownCodecError("", f"unknown codec {name!r}: this server decodes {sorted(_registry)} and zstd+shuffleN; "
                                    "upgrade the server or push with codec 'raw'")
    decoder = _shuffled(width)
    register_codec(name, decoder)
    return decoder


SHUFFLE_PREFIX = "zstd+shuffle"  # chunking.codec: zstd after a byte shuffle by element width


def _shuffle_width(name: str) -> int | None:
    if not name.startswith(SHUFFLE_PREFIX):
        return None
    digits = name[len(SHUFFLE_PREFIX):]
    return int(digits) if digits.isdigit() and 1 < int(digits) <= 64 else None


def _shuffled(width: int) -> Decoder:
    def decode_shuffled(data: bytes, raw_size: int) -> Decoded:
        from chunking.codec import unshuffle_into  # the inverse of chunking's own encoder

        if raw_size % width:
            raise DecodeError(f"raw_size {raw_size} is not a multiple of the shuffle width {width}")
        shuffled = _zstd(data, raw_size)  # bounded by raw_size like plain zstd; then one raw_size output
        out = np.empty(raw_size, dtype=np.uint8)
        unshuffle_into(shuffled, width, out)
        return out.data

    return decode_shuffled


def decode(name: str, data: bytes, raw_size: int, *, limit: int = DEFAULT_MAX_RAW_BYTES) -> Decoded:
    """Raw bytes of a stored chunk. Raises DecodeError or UnknownCodecError.

    A ``raw_size`` below 0 or above ``limit`` is refused before anything is decoded or allocated.
    """
    decoder = get_decoder(name)
    if raw_size < 0 or raw_size > limit:
        raise DecodeError(f"raw_size {raw_size} is outside 0..{limit} (the largest chunk this server decodes): "
                          "refusing a decompression bomb")
    try:
        return decoder(data, raw_size)
    except DecodeError:
        raise
    except UnknownCodecError:
        raise
    except Exception as exc:  # a foreign decoder's own error types
        raise DecodeError(f"codec {name!r} failed: {exc}") from exc


register_codec("raw", _raw)
register_codec("zstd", _zstd)

__all__ = ["DEFAULT_MAX_RAW_BYTES", "DecodeError", "Decoder", "register_codec", "get_decoder", "decode"]
