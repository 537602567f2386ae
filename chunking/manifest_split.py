"""Manifest format 3: a root that names parts, so versions that share tensors share manifest bytes.

A root is ``ROOT_MAGIC`` followed by canonical JSON: everything a format-2 header holds
(tensors, files, names) and ``parts``, a list of ``[part id, chunk count]`` in chunk order. A
part is the format-2 column container (``chunking.manifest_binary``) of a run of consecutive
chunk rows, with a header of its own (``kind: "part"``, its codec table); it names neither the
model, the version nor its position, so a fine-tune that leaves a tensor group alone leaves its
part byte for byte, and its id, unchanged. The root's id is the version's manifest id; every
part is a blob of its own, stored, replicated, checked at commit and kept by GC like a chunk.

Where parts are cut is a function of the tensor layout alone (``part_bounds``): at the first
chunk of a tensor that starts on a chunk boundary (a tensor of at least a chunk always does),
once the part so far has ``PART_MIN_CHUNKS``; and wherever a part would pass
``PART_MAX_CHUNKS``. Two versions with the same layout therefore cut alike, and the bytes of a
manifest are again unique: ``Manifest.from_bytes`` proves each part canonical as it reads it
(``manifest_binary.decode(canonical=True)``), checks the cuts, and re-encodes the root.

Format 4 keeps the parts and moves what does not change between the versions of a model out
of the root, so a fine-tune adds little more than the rows of the tensors it changed:

- the **layout** blob (``LAYOUT_MAGIC`` + canonical JSON, ``kind: "layout"``): the tensors,
  the files and the shards. It names neither the model nor the version, so a fine-tune (or
  another model of the same architecture and files) shares it;
- the **root** (``ROOT4_MAGIC``): a canonical JSON header (model, version, chunk size, hash,
  fingerprint, the layout's id and the part count), then the part ids as 32-byte digests and
  their chunk counts as u32, 36 bytes a part instead of about 75 in JSON;
- cuts by ``part_bounds(..., rule=4)``: every tensor of ``PART_MIN_CHUNKS`` chunks or more
  starts a part of its own, so a changed norm or bias no longer rewrites the rows of the large
  tensor whose part it joined; small tensors are still grouped with each other.

``part_ids`` gives every blob a root names besides itself (format 4: the layout first).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunking import manifest_binary
from chunking.hashing import content_id, is_content_id

ROOT_MAGIC = b"\x89PDMR\r\n\x1a"
ROOT4_MAGIC = b"\x89PDMS\r\n\x1a"
LAYOUT_MAGIC = b"\x89PDML\r\n\x1a"
PART_KIND = "part"
LAYOUT_KIND = "layout"
ROOT_FORMATS = (3, 4)
ROOT4_KEYS = frozenset({"layout", "part_count"})  # besides the manifest's own header keys
_ROOT4_PREFIX = len(ROOT4_MAGIC) + 4  # the magic and the u32 header length
MAX_HEADER_BYTES = 1 << 20
PART_KEYS = frozenset({"kind", "chunk_count", "runs", "codecs"})
PART_MIN_CHUNKS = 16  # a part of fewer rows would cost more as a blob than it saves
PART_MAX_CHUNKS = 1 << 16  # at most 2.6 MB of columns per part blob
SPLIT_FROM_CHUNKS = 1024  # pack writes a split manifest from this many chunks up (256 MiB at 256 KiB)
MAX_PARTS = 1 << 20

@dataclass(frozen=True)
class Part:
    """One part blob: its content id, bytes, and the chunk rows ``[start, stop)`` it holds."""

    id: str
    data: bytes
    start: int
    stop: int


@dataclass(frozen=True)
class Root:
    """A parsed root: its format (3 or 4), its JSON object, its parts ``(id, chunk count)`` in
    chunk order, and (format 4) the id of its layout blob."""

    format: int
    doc: dict[str, Any]
    parts: list[tuple[str, int]]
    layout: str | None

    @property
    def blob_ids(self) -> tuple[str, ...]:
        """Every blob this root names besides itself, each once: the layout first, then the parts."""
        return tuple(dict.fromkeys([*([self.layout] if self.layout else []), *(pid for pid, _count in self.parts)]))


def root_format(data: bytes | bytearray | memoryview) -> int | None:
    """3 or 4 for the root of a split manifest, None for anything else."""
    head = bytes(data[: len(ROOT_MAGIC)])
    return 3 if head == ROOT_MAGIC else 4 if head == ROOT4_MAGIC else None


def is_root(data: bytes | bytearray | memoryview) -> bool:
    return root_format(data) is not None


def part_bounds(ranges: Sequence[tuple[int, int]], chunk_size: int, count: int, *, rule: int = 3
                ) -> list[tuple[int, int]]:
    """Chunk row ranges ``[start, stop)`` of the parts of a manifest whose tensors lie at ``ranges``.

    ``rule`` is the manifest format: 3 cuts at an aligned tensor once the part so far has
    ``PART_MIN_CHUNKS``; 4 also cuts before every tensor of ``PART_MIN_CHUNKS`` chunks or more."""
    cuts = [0]
    for offset, nbytes in ranges:
        if nbytes == 0:
            continue
        first, last = offset // chunk_size, (offset + nbytes - 1) // chunk_size
        so_far = first - cuts[-1]
        if offset % chunk_size == 0 and so_far > 0 and (
                so_far >= PART_MIN_CHUNKS or (rule >= 4 and last + 1 - first >= PART_MIN_CHUNKS)):
            cuts.append(first)
        while last + 1 - cuts[-1] > PART_MAX_CHUNKS:
            cuts.append(cuts[-1] + PART_MAX_CHUNKS)
    if count:
        cuts.append(count)
    return list(zip(cuts[:-1], cuts[1:]))


def encode_part(columns: manifest_binary.Columns, codecs: Sequence[str]) -> bytes:
    """A part's bytes; ``columns.codec_index`` indexes ``codecs`` (the part keeps only those it uses)."""
    order = manifest_binary.first_use_order(columns.codec_index)
    remap = np.zeros(max(len(codecs), 1), np.uint8)
    remap[order] = np.arange(len(order), dtype=np.uint8)
    local = manifest_binary.Columns(columns.digests, columns.crc32c, columns.stored_size, remap[columns.codec_index],
                                    columns.introduced_in, columns.created_at)
    return manifest_binary.encode({"kind": PART_KIND, "codecs": [codecs[i] for i in order.tolist()]}, local)


def decode_part(data: bytes) -> tuple[list[str], manifest_binary.Columns]:
    """Codec table and columns of a part; ValueError says what is wrong."""
    doc, columns = manifest_binary.decode(data, canonical=True)
    if set(doc) != PART_KEYS or doc.get("kind") != PART_KIND:
        raise ValueError("it is not a manifest part (its header keys differ)")
    if not all(isinstance(name, str) for name in doc["codecs"]):
        raise ValueError("its codec table holds something other than names")
    return doc["codecs"], columns


def root_doc(data: bytes) -> dict[str, Any]:
    """The JSON object of a root's bytes; ValueError says what is wrong."""
    if not is_root(data):
        raise ValueError("it does not start with the format-3 root magic bytes")
    try:
        doc = json.loads(data[len(ROOT_MAGIC):].decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"its root is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("its root is not an object")
    return doc


def root_parts(doc: dict[str, Any]) -> list[tuple[str, int]]:
    """``(part id, chunk count)`` of a root's object, validated; ValueError says what is wrong."""
    parts = doc.get("parts")
    if not isinstance(parts, list) or len(parts) > MAX_PARTS:
        raise ValueError("its root lacks the part list")
    out = []
    for i, item in enumerate(parts):
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str) or not is_content_id(item[0])
                or not isinstance(item[1], int) or isinstance(item[1], bool) or not 1 <= item[1] <= PART_MAX_CHUNKS):
            raise ValueError(f"part #{i} is not [content id, chunk count 1..{PART_MAX_CHUNKS}]")
        out.append((item[0], item[1]))
    return out


def parse_root(data: bytes) -> Root:
    """A format-3 or format-4 root, validated as far as the root alone allows; ValueError says what is wrong."""
    fmt = root_format(data)
    if fmt == 3:
        doc = root_doc(data)
        return Root(3, doc, root_parts(doc), None)
    if fmt != 4:
        raise ValueError("it does not start with the magic bytes of a format-3 or format-4 root")
    if len(data) < _ROOT4_PREFIX:
        raise ValueError(f"it is {len(data)} bytes, shorter than a root's prefix (truncated?)")
    doc, start, end = manifest_binary.read_header(data, len(ROOT4_MAGIC), max_bytes=MAX_HEADER_BYTES)
    manifest_binary.check_header(data, doc, start, end)
    n, layout = doc.get("part_count"), doc.get("layout")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_PARTS:
        raise ValueError(f"its part_count must be an integer 0..{MAX_PARTS}")
    if not isinstance(layout, str) or not is_content_id(layout):
        raise ValueError("its layout is not a content id")
    pos = end + manifest_binary.pad8(end)
    ids_end = pos + n * 32
    counts_end = ids_end + n * 4
    if counts_end + manifest_binary.pad8(counts_end) != len(data):
        raise ValueError(f"it is {len(data)} bytes but its header describes {counts_end + manifest_binary.pad8(counts_end)} "
                         f"({n} parts)")
    if data[counts_end:].count(0) != len(data) - counts_end:
        raise ValueError("its padding is not zeros")
    counts = np.frombuffer(data, "<u4", n, ids_end)
    if n and (int(counts.min()) < 1 or int(counts.max()) > PART_MAX_CHUNKS):
        raise ValueError(f"a part's chunk count is not 1..{PART_MAX_CHUNKS}")
    ids = data[pos:ids_end].hex()
    parts = [(ids[64 * i : 64 * (i + 1)], c) for i, c in enumerate(counts.tolist())]
    return Root(4, doc, parts, layout)


def part_ids(data: bytes | bytearray | memoryview) -> tuple[str, ...]:
    """The ids of the blobs a manifest's root names besides itself (format 4: its layout first, then
    its parts; format 3: its parts): () for a format-1 or format-2 manifest, a blob of its own.

    A caller that fetches manifests asks for these blobs too, then passes them to
    ``Manifest.from_bytes(root, parts=...)``. Raises ValueError for a damaged root."""
    raw = bytes(data)
    if not is_root(raw):
        return ()
    return parse_root(raw).blob_ids


def encode_root(header: dict[str, Any], parts: Sequence[Part]) -> bytes:
    """A format-3 root."""
    return ROOT_MAGIC + manifest_binary.canonical_json(dict(header, parts=[[p.id, p.stop - p.start] for p in parts]))


def encode_root4(header: dict[str, Any], layout_id: str, parts: Sequence[Part]) -> bytes:
    """A format-4 root: ``header`` (without tensors and files, which are in the layout blob), the
    layout's id, then the part table as binary columns."""
    head = manifest_binary.encode_header(ROOT4_MAGIC, dict(header, layout=layout_id, part_count=len(parts)))
    ids = bytes.fromhex("".join(p.id for p in parts))
    counts = np.asarray([p.stop - p.start for p in parts], "<u4").tobytes()
    return b"".join([head, ids, counts, bytes(manifest_binary.pad8(len(counts)))])  # head and ids are whole 8s


def encode_layout(layout: dict[str, Any]) -> bytes:
    """The layout blob of a format-4 manifest: its tensors, files and shards."""
    return LAYOUT_MAGIC + manifest_binary.canonical_json(dict(layout, kind=LAYOUT_KIND))


def decode_layout(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The JSON object of a layout blob, without its ``kind``; ValueError says what is wrong."""
    data = bytes(data)
    if data[: len(LAYOUT_MAGIC)] != LAYOUT_MAGIC:
        raise ValueError("it does not start with the layout magic bytes")
    try:
        doc = json.loads(data[len(LAYOUT_MAGIC):].decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"it is not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("kind") != LAYOUT_KIND:
        raise ValueError("it is not a layout (its kind differs)")
    if not manifest_binary.is_canonical_json(doc, data[len(LAYOUT_MAGIC):]):
        raise ValueError("it is not canonical JSON (sorted keys, no spaces)")
    del doc["kind"]
    return doc


def split_columns(columns: manifest_binary.Columns, codecs: Sequence[str], bounds: Sequence[tuple[int, int]],
                  algorithm: str) -> tuple[Part, ...]:
    out = []
    for start, stop in bounds:
        rows = slice(start, stop)
        data = encode_part(manifest_binary.Columns(
            columns.digests[rows], columns.crc32c[rows], columns.stored_size[rows], columns.codec_index[rows],
            columns.introduced_in[rows], columns.created_at[rows]), codecs)
        out.append(Part(content_id(data, algorithm), data, start, stop))
    return tuple(out)


MAX_REPEAT_ROWS = 1 << 20  # rows a root may list beyond REPEAT_FACTOR times its distinct parts' rows
REPEAT_FACTOR = 64


def check_repeats(listed: Sequence[tuple[str, int]]) -> None:
    """Refuse a root that lists the same parts so often that joining them would take far more
    memory than their bytes: identical tensors share a part, so some repetition is legitimate,
    but a forged root of a million listings of one 65,536-row part would ask for 4 TB."""
    total = sum(count for _pid, count in listed)
    distinct = sum(dict(reversed(listed)).values())  # the first listing of each id
    if total > max(MAX_REPEAT_ROWS, REPEAT_FACTOR * distinct):
        raise ValueError(f"it lists {total} chunk rows made of {distinct} distinct ones; a manifest may repeat its parts "
                         f"to at most {REPEAT_FACTOR}x (or {MAX_REPEAT_ROWS} rows). Pack the model again")


def join_parts(listed: Sequence[tuple[str, int]], blobs: Mapping[str, bytes], algorithm: str
               ) -> tuple[tuple[str, ...], manifest_binary.Columns, tuple[Part, ...]]:
    """One codec table (in order of first use), the columns of all parts end to end, and the parts.

    Each part must be in ``blobs``, hash to its id, be in canonical form and hold the chunk
    count the root gives it. Raises ValueError naming the part that is wrong."""
    check_repeats(listed)
    codecs: dict[str, int] = {}
    pieces: list[manifest_binary.Columns] = []
    parts: list[Part] = []
    decoded: dict[str, tuple[list[str], manifest_binary.Columns]] = {}  # a part listed again is decoded once
    for i, (pid, count) in enumerate(listed):
        data = blobs.get(pid)
        if data is None:
            raise ValueError(f"part #{i} ({pid}) was not supplied")
        if pid not in decoded:
            if content_id(data, algorithm) != pid:
                raise ValueError(f"part #{i} ({pid}): its bytes do not match its id (corrupted, or another part)")
            try:
                decoded[pid] = decode_part(data)
            except ValueError as exc:
                raise ValueError(f"part #{i} ({pid}) is damaged: {exc}") from None
        names, cols = decoded[pid]
        if len(cols.digests) != count:
            raise ValueError(f"part #{i} ({pid}) holds {len(cols.digests)} chunks; the root says {count}")
        start = parts[-1].stop if parts else 0
        parts.append(Part(pid, data, start, start + count))
        remap = np.asarray([codecs.setdefault(name, len(codecs)) for name in names] or [0], np.uint8)
        pieces.append(manifest_binary.Columns(cols.digests, cols.crc32c, cols.stored_size, remap[cols.codec_index],
                                              cols.introduced_in, cols.created_at))
    if len(codecs) > 255:
        raise ValueError("its parts use more than 255 codecs")

    def cat(name: str, empty: np.ndarray) -> np.ndarray:
        arrays = [getattr(p, name) for p in pieces]
        return np.concatenate(arrays) if arrays else empty

    joined = manifest_binary.Columns(
        cat("digests", np.zeros((0, 32), np.uint8)), cat("crc32c", np.zeros(0, np.uint32)),
        cat("stored_size", np.zeros(0, np.uint32)), cat("codec_index", np.zeros(0, np.uint8)),
        cat("introduced_in", np.zeros(0, np.int64)), cat("created_at", np.zeros(0, np.float64)),
    )
    return tuple(codecs), joined, tuple(parts)


__all__ = ["LAYOUT_MAGIC", "Part", "ROOT4_MAGIC", "ROOT_MAGIC", "Root", "SPLIT_FROM_CHUNKS", "PART_MAX_CHUNKS",
           "PART_MIN_CHUNKS", "is_root", "parse_root", "part_bounds", "part_ids", "root_format"]
