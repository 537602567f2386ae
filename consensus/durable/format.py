"""The journal's on-disk format (pysyncobj's ``FileJournal``): header, records, parsing, and the start-up
checks of a journal against its commit index and full dump."""
from __future__ import annotations

import gzip
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from pysyncobj.journal import (APP_NAME, APP_VERSION, FIRST_RECORD_OFFSET, JOURNAL_FORMAT_VERSION, NAME_SIZE,
                               VERSION_SIZE)
from pysyncobj.pickle import load as _pso_load
from pysyncobj.pickle import to_bytes

from ..errors import DamagedState
from .meta import RECOVERY_ADVICE

log = logging.getLogger("consensus.durable")

Entry = tuple[bytes, int, int]  # (command, log index, term), as pysyncobj keeps them

_HEADER = struct.Struct("<II")  # format version, end offset of the last record
_END = struct.Struct("<I")
# Power-fail atomicity of a disk is one sector, commonly 512 bytes.
SECTOR = 512
_RECORD_LEN = struct.Struct("<I")
_RECORD_HEAD = struct.Struct("<QQ")  # index, term


def journal_header(end: int) -> bytes:
    name = bytes(APP_NAME) + b"\0" * (NAME_SIZE - len(APP_NAME))  # pysyncobj's constants are untyped
    version = bytes(APP_VERSION) + b"\0" * (VERSION_SIZE - len(APP_VERSION))
    header: bytes = name + version + _HEADER.pack(JOURNAL_FORMAT_VERSION, end)
    return header


def encode_record(command: bytes, idx: int, term: int) -> bytes:
    body = _RECORD_HEAD.pack(idx, term) + bytes(to_bytes(command))
    size = _RECORD_LEN.pack(len(body))
    return size + body + size


@dataclass
class ParsedJournal:
    entries: list[Entry] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # file offset of each entry's record
    end: int = FIRST_RECORD_OFFSET  # offset just past the last good record
    torn: str | None = None  # why parsing stopped before the header's end, if it did


def parse_journal(data: bytes, path: str) -> ParsedJournal:
    """Records up to the header's end offset; stops at the first incomplete or inconsistent one.

    From this module that is the tail of a sync that a power loss interrupted (never
    acknowledged); from an unsynced writer (pysyncobj's own, --no-fsync) it can also be a tail
    that was acknowledged. The caller drops it and says so.
    """
    if len(data) < FIRST_RECORD_OFFSET:
        raise DamagedState(f"Raft journal {path} is {len(data)} bytes, shorter than its header; refusing to start")
    if data[:len(APP_NAME)] != APP_NAME:
        raise DamagedState(f"{path} is not a pysyncobj journal (header {data[:NAME_SIZE]!r}); refusing to start")
    fmt, last = _HEADER.unpack_from(data, NAME_SIZE + VERSION_SIZE)
    if fmt != JOURNAL_FORMAT_VERSION:
        raise DamagedState(
            f"Raft journal {path} has format {fmt}, expected {JOURNAL_FORMAT_VERSION}; refusing to start")
    if last < FIRST_RECORD_OFFSET:
        raise DamagedState(f"Raft journal {path} header names end offset {last}; refusing to start")
    parsed = ParsedJournal()
    limit = min(last, len(data))
    offset = FIRST_RECORD_OFFSET
    while offset < limit:
        why = None
        if offset + 4 > limit:
            why = "a record length is cut off"
        else:
            (size,) = _RECORD_LEN.unpack_from(data, offset)
            if size < _RECORD_HEAD.size:
                why = f"a record length of {size} (zeros: a sector that never reached the disk)"
            elif offset + 8 + size > limit:
                why = f"a record of {size} bytes runs past the end"
            elif _RECORD_LEN.unpack_from(data, offset + 4 + size)[0] != size:
                why = "a record's two lengths differ"
            else:
                idx, term = _RECORD_HEAD.unpack_from(data, offset + 4)
                if parsed.entries and (idx != parsed.entries[-1][1] + 1 or term < parsed.entries[-1][2]):
                    why = f"entry {idx} (term {term}) does not follow entry {parsed.entries[-1][1]}"
        if why is not None:
            parsed.torn = f"{why} at offset {offset}"
            break
        command = data[offset + 4 + _RECORD_HEAD.size:offset + 4 + size]
        parsed.entries.append((command, idx, term))
        parsed.starts.append(offset)
        offset += size + 8
    if parsed.torn is None and last > len(data):
        parsed.torn = f"the header names {last} bytes but the file has {len(data)}"
    parsed.end = offset
    return parsed


def _check_commit_index(parsed: ParsedJournal, meta: Mapping[str, Any], dump_tail: tuple[Entry, Entry] | None,
                        path: str, meta_path: str) -> None:
    """Refuse a log that ends before the commit index stored beside it.

    The stored commit index only ever covers durable entries (it is stored after a sync), so a
    log that ends before it lost committed entries that this server may have acknowledged: the
    file was cut or damaged, not torn by a power loss. Started on it, the server would hold a
    commit index it cannot apply (pysyncobj keeps it and applies nothing past the log), serve
    an old state, and could vote for a candidate that lacks committed entries.
    """
    stored = int(meta.get("raftCommitIndex", 1))
    entries = parsed.entries
    # pysyncobj starts an empty log with a no-op at index 1. With a full dump it keeps the log
    # only if the dump's last two entries start it (resume_compaction makes them start it if the
    # log holds them further in), and otherwise replaces the log by those two.
    last = entries[-1][1] if entries else 1
    if dump_tail is not None:
        prev, dump_last = dump_tail
        at = prev[1] - entries[0][1] if entries else -1
        if not (0 <= at and at + 1 < len(entries) and _same_entry(entries[at], prev)
                and _same_entry(entries[at + 1], dump_last)):
            last = dump_last[1]
    if stored <= last:
        return
    why = f"the file was cut: {parsed.torn}" if parsed.torn else "entries are missing"
    raise DamagedState(
        f"Raft journal {path} is damaged: its log ends at entry {last}, but {meta_path} records entry {stored} "
        f"as committed ({why}); refusing to start with committed entries missing. {RECOVERY_ADVICE}"
    )


def check_dump(path: str) -> None:
    """Refuse to start on a full dump that cannot be read back (pysyncobj would log and start without it)."""
    if not os.path.exists(path):
        return
    try:
        size = 0
        with gzip.open(path, "rb") as g:
            while chunk := g.read(1 << 20):  # gzip checks its CRC32 and length at the end
                size += len(chunk)
        if size == 0:  # gzip reads an empty file as an empty stream; pysyncobj never writes one
            raise EOFError("the file holds no state (a rename that reached the disk before the data did)")
    except (OSError, EOFError, zlib.error) as exc:
        raise DamagedState(
            f"Raft full dump {path} is damaged ({exc}); refusing to start without the state it holds. Restore it, "
            "or, if the other members are healthy, move this server's raft folder away so that it rejoins empty"
        ) from None


def dump_log_tail(path: str) -> tuple[Entry, Entry] | None:
    """The two log entries a full dump ends with, as pysyncobj stores them; None without a (readable) dump.

    pysyncobj writes ``(state, last applied entry, the entry before it, cluster)``; it starts
    the journal of a compacted log with those two entries.
    """
    if not os.path.exists(path):
        return None
    try:
        with gzip.open(path, "rb") as g:
            data = _pso_load(g)
        last, prev = data[1], data[2]
        tail = (tuple(prev), tuple(last))
        if not all(len(e) == 3 and isinstance(e[1], int) and isinstance(e[2], int) for e in tail):
            raise ValueError(f"unexpected entries {tail!r}")
    except Exception as exc:  # noqa: BLE001 - pysyncobj loads it, or logs why not, itself
        log.warning("Raft full dump %s: cannot read the log position it ends at (%s)", path, exc)
        return None
    return tail


def _same_entry(a: Entry, b: Entry) -> bool:
    return a[1:] == b[1:] and bytes(to_bytes(a[0])) == bytes(to_bytes(b[0]))
