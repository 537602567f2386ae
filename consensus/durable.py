"""Durable Raft state on pysyncobj 0.3.17: nothing is acknowledged before it is on disk.

pysyncobj 0.3.17 keeps its Raft log in an mmap'd file that it never msyncs, stores term and
vote with a rename but no fsync, and returns an empty vote when that file cannot be read. A
power loss of a majority could therefore lose acknowledged commits, and a forgotten vote could
let two leaders win one term. This module replaces those pieces, one SyncObj at a time:

- ``DurableJournal`` implements pysyncobj's journal interface on the on-disk format of its
  ``FileJournal`` (existing data dirs load, and pysyncobj can still read ours), written with
  pwrite instead of mmap so that the order of writes is ours. Group commit: ``sync()`` moves
  the header's end offset past every record appended since the last sync and fdatasyncs once.
  A power loss during that sync can leave a torn tail, never a wrong record: past the durable
  end there are only zeros and records appended since, and a sector that missed the disk
  zeroes a length field that parsing checks (the class docstring has the argument); the torn
  tail, never acknowledged, is cut off at the next start.
  Truncation reaches the disk only when a different entry takes a dropped one's place: pysyncobj
  deletes and re-adds the entries a leader re-sends, and a power loss in between must not take
  entries this server acknowledged. After a crash between the full dump's rename and the journal's
  compaction a tick later, start-up finishes that compaction (``resume_compaction``), since
  pysyncobj would otherwise replace the journal by the dump's last two entries.
- ``MetaFile`` holds term, vote and commit index (``raft.journal.meta``): written to a temporary
  file, fsynced, renamed, folder fsynced, with a CRC; a damaged file stops start-up.
- ``AckGate`` holds a follower's AppendEntries answers while its journal has unsynced records
  and sends them right after the next sync, so one sync covers every entry that came meanwhile.
- ``DurableSyncObj`` syncs at the start of every tick and before every poll, so the leader never
  counts its own unsynced entries toward the commit quorum while its disk write still runs in
  parallel with the followers'.

Where pysyncobj offers no hook, two of its module globals are patched, once, and only on the
version this was written against (``install()`` refuses any other): ``pysyncobj.syncobj.createJournal``
(to hand a SyncObj the journal opened for it) and ``pysyncobj.serializer.atomicReplace`` (to fsync
the full dump before and after its rename). Both fall through to pysyncobj's own code for every
file this module was not told about.

A journal whose log ends before the commit index its meta file records lost entries this server
knew were committed (the file was cut or damaged, not torn by a power loss: the commit index is
stored only after the entries it covers are durable). Opened with ``check_commit_index`` (as a
server does), such a journal is refused before anything in it changes, since the server could
neither apply its own commit index nor vote safely; a torn tail past the commit index is cut
off with a WARNING naming the file and the records kept.

A write or sync that fails (ENOSPC, EIO) sets ``DurableJournal.failure`` for good: the SyncObj
steps down and stops ticking (``DurableSyncObj._onTick``), so it never acknowledges, votes or
truncates again, and the process is expected to exit (``MetadataNode.failure()``).

With ``fsync=False`` (``--no-fsync``: tests and drills only, unsafe for real data) the same code
runs without any fsync and without holding answers: a kill -9 loses nothing, a power loss can.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import pysyncobj.serializer as _pso_serializer
import pysyncobj.syncobj as _pso_syncobj
from pysyncobj import SyncObj
from pysyncobj.journal import (APP_NAME, APP_VERSION, FIRST_RECORD_OFFSET, JOURNAL_FORMAT_VERSION,
                               LAST_RECORD_OFFSET_OFFSET, NAME_SIZE, VERSION_SIZE, Journal)
from pysyncobj.pickle import load as _pso_load
from pysyncobj.pickle import loads as _pso_loads
from pysyncobj.pickle import to_bytes
from pysyncobj.syncobj import _RAFT_STATE
from pysyncobj.version import VERSION as PYSYNCOBJ_VERSION

from .errors import DamagedState

log = logging.getLogger(__name__)

# The patches below rely on pysyncobj internals (module globals, tick order, message names);
# re-read syncobj.py, journal.py and serializer.py of a new version before adding it here.
SUPPORTED_PYSYNCOBJ = ("0.3.17",)

Entry = tuple[bytes, int, int]  # (command, log index, term), as pysyncobj keeps them
ACK_MESSAGE_TYPES = frozenset({"next_node_idx"})  # a follower's answer to AppendEntries

# The journal grows by zero-filled steps. Records then always land on zeros (part of the
# torn-tail argument, see DurableJournal), and an fdatasync of records written over
# allocated blocks is one disk flush, while one that also extends the file commits the file
# system's journal too, and the three servers' syncs then queue behind each other.
GROW_MIN, GROW_MAX = 64 << 10, 1 << 20  # a step doubles the file, within these bounds
_ZEROS = bytes(64 << 10)
_HEADER = struct.Struct("<II")  # format version, end offset of the last record
_END = struct.Struct("<I")
# Power-fail atomicity of a disk is one sector, commonly 512 bytes.
SECTOR = 512
_RECORD_LEN = struct.Struct("<I")
_RECORD_HEAD = struct.Struct("<QQ")  # index, term
META_FORMAT = "pdparams-raft-meta/1"
_META_TYPES: dict[str, tuple[type, ...]] = {
    "currentTerm": (int,), "votedForNodeId": (str, type(None)), "raftCommitIndex": (int,),
}


class JournalFailure(RuntimeError):
    """A write or sync of the Raft state failed; the node stops taking part in Raft until restarted.

    After a failed fsync the kernel may have dropped the dirty pages and a retry could report
    success for data that never reached the disk, so there is no retry.
    """


# What a damaged-state message tells the operator. An older copy of the journal is no safer than
# none: either way this server forgets entries it acknowledged, which is harmless only while the
# rest of the cluster holds them (a push acknowledged by it and one other member was lost so).
RECOVERY_ADVICE = (
    "If every other member is up and follows the leader ('paramctl status'), move this server's raft folder away "
    "so that it rejoins empty and catches up. Do not restore an older copy, and do neither while another member "
    "is down: a majority without the entries this server acknowledged could then drop them"
)


# ------------------------------------------------------------------ file system helpers
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path_and_ancestors(path: str) -> None:
    """Make ``path``'s own entry, and each ancestor's, durable.

    Whoever created the folders (the operator, a launcher, mkdir -p) may never have synced them,
    and a journal in a folder that a power loss takes away is lost with it. Folders above the
    parent may sit on file systems that refuse a directory fsync; those are skipped.
    """
    path = os.path.abspath(path)
    fsync_dir(path)
    parent = os.path.dirname(path)
    fsync_dir(parent)
    while True:
        above = os.path.dirname(parent)
        if above == parent:
            return
        parent = above
        try:
            fsync_dir(parent)
        except OSError as exc:
            log.debug("cannot fsync folder %s (%s); skipped", parent, exc)


def write_file_durably(path: str, data: bytes, *, fsync: bool) -> None:
    """Temporary file, fsync, rename over ``path``, fsync of the folder: all or nothing, and durable."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def replace_durably(src: str, dst: str) -> None:
    """rename(src, dst) with src fsynced before and the folder after."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


# A seam for tests: called with the file descriptor before every write of the Raft state
# (journal, term/vote file), it raises the OSError a failing disk would (ENOSPC, EIO), so a
# test can fail one server's files without patching os for the whole process.
write_fault: Callable[[int], None] | None = None


def _write_all(fd: int, data: bytes, offset: int) -> None:
    if write_fault is not None:
        write_fault(fd)
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# ------------------------------------------------------------------ term / vote file
def encode_meta(meta: Mapping[str, Any]) -> bytes:
    state = {k: meta[k] for k in _META_TYPES if k in meta}
    body = json.dumps(state, sort_keys=True, separators=(",", ":"))
    return json.dumps({"format": META_FORMAT, "crc32": zlib.crc32(body.encode()), "state": state},
                      sort_keys=True, separators=(",", ":")).encode() + b"\n"


def decode_meta(raw: bytes, path: str) -> dict[str, Any]:
    """The meta dict in ``raw``; DamagedState naming ``path`` if it is not exactly what was written.

    Also reads the pickle that pysyncobj's own MetaStorer wrote, so that data dirs from before
    this module keep their vote.
    """
    def damaged(why: str) -> DamagedState:
        return DamagedState(
            f"Raft term/vote file {path} is damaged ({why}); refusing to start, since starting without it "
            f"could forget this server's vote. {RECOVERY_ADVICE}"
        )

    if raw.startswith(b"{"):
        try:
            doc = json.loads(raw)
            state = doc["state"]
            crc = doc["crc32"]
            fmt = doc["format"]
        except (ValueError, KeyError, TypeError) as exc:
            raise damaged(f"not valid JSON: {exc}") from None
        if fmt != META_FORMAT:
            raise damaged(f"unknown format {fmt!r}")
        if not isinstance(state, dict):
            raise damaged("no state object")
        body = json.dumps(state, sort_keys=True, separators=(",", ":"))
        if zlib.crc32(body.encode()) != crc:
            raise damaged("checksum mismatch")
    else:
        try:
            state = _pso_loads(raw)  # pysyncobj's own format: a pickled dict in our own data dir
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing here
            raise damaged(f"neither pdparams' JSON meta format nor pysyncobj's pickle: {type(exc).__name__}") from None
        if not isinstance(state, dict):
            raise damaged(f"pysyncobj pickle holds a {type(state).__name__}, not a dict")
    for key, types in _META_TYPES.items():
        if key in state and (not isinstance(state[key], types) or isinstance(state[key], bool)):
            raise damaged(f"{key} is {state[key]!r}")
    if state.get("currentTerm", 0) < 0 or state.get("raftCommitIndex", 1) < 1:
        raise damaged(f"impossible values {state!r}")
    return {k: state[k] for k in _META_TYPES if k in state}


class MetaFile:
    """Term, vote and commit index of one node, stored the way pysyncobj's MetaStorer names them."""

    def __init__(self, path: str, *, fsync: bool) -> None:
        self.path = path
        self.fsync = fsync

    def load(self) -> dict[str, Any] | None:
        """The stored meta; None if there is no file (a node that never stored a term)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DamagedState(
                f"cannot read Raft term/vote file {self.path}: {exc.strerror or exc}; refusing to start without it"
            ) from None
        return decode_meta(raw, self.path)

    def store(self, meta: Mapping[str, Any]) -> None:
        write_file_durably(self.path, encode_meta(meta), fsync=self.fsync)


# ------------------------------------------------------------------ journal format
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


class DurableJournal(Journal):  # type: ignore[misc]
    """pysyncobj's journal interface with group commit; see the module docstring.

    Invariant that makes one fdatasync per group safe: every byte past the durable end of the
    log is zero or belongs to a record appended since, at its final place. A power loss in
    the middle of a sync can then leave only a torn tail, which parsing finds: each record
    spans at most two disk sectors, so any sector that did not reach the disk zeroes its
    leading or trailing length. A group with a longer record is synced in two steps
    (records, then the header). Every method runs on the SyncObj's tick thread, as pysyncobj
    calls them; only ``dirty`` and the counters are read from elsewhere.
    """

    def __init__(self, path: str, *, fsync: bool = True, dump_tail: tuple[Entry, Entry] | None = None,
                 check_commit_index: bool = False) -> None:
        """Open (or create) the journal at ``path`` and its meta file; DamagedState naming the file if unusable.

        With ``check_commit_index`` (a server's start-up), a log that ends before the commit index
        stored beside it is refused before anything in the file changes; ``dump_tail`` is
        ``dump_log_tail``'s answer for the full dump beside it (None: no dump).
        """
        self.path = path
        self.fsync = fsync
        self.sync_count = 0
        self.sync_seconds = 0.0  # time spent in group commits, for status and benchmarks
        self._failure: str | None = None
        self._meta_file = MetaFile(path + ".meta", fsync=fsync)
        stored = self._meta_file.load()
        self._meta: dict[str, Any] = dict(stored or {})
        self._meta_saved = True
        if not os.path.exists(path):
            write_file_durably(path, journal_header(FIRST_RECORD_OFFSET), fsync=fsync)
        with open(path, "rb") as f:
            data = f.read()
        parsed = parse_journal(data, path)
        if stored is None and parsed.entries and parsed.entries[-1][2] >= 1:
            # Every term >= 1 in the log was adopted, and stored, before its entries arrived.
            raise DamagedState(
                f"Raft term/vote file {self._meta_file.path} is missing, but the journal {path} holds entries of "
                f"term {parsed.entries[-1][2]}; refusing to start, since the vote this server cast may be lost. "
                "Restore the file, or, if the other members are healthy, move this server's raft folder away so "
                "that it rejoins empty and catches up"
            )
        if check_commit_index and stored is not None:
            _check_commit_index(parsed, stored, dump_tail, path, self._meta_file.path)
        self._fd = os.open(path, os.O_RDWR)
        self._entries = parsed.entries
        self._starts = parsed.starts
        self._end = parsed.end
        self._disk_end = parsed.end
        self._allocated = len(data)
        self._barrier = False  # the pending group holds a record longer than two sectors
        # Records pysyncobj deleted (deleteEntriesFrom) that are still in the file, right after
        # the log, and stay there until a different entry takes the place of the first of them.
        self._dropped: list[Entry] = []
        self._dropped_starts: list[int] = []
        self._dropped_end = self._end  # end of the file's log: the last dropped record, or _end
        if parsed.torn is not None:
            # A cut that reaches entries this server knew were committed was refused above
            # (with check_commit_index); what is left is a tail past the stored commit index.
            log.warning("Raft journal %s: torn tail dropped (%s); kept %d records (entries up to index %s). "
                        "A power loss during a sync leaves such a tail, which was never acknowledged; the "
                        "leader sends this server whatever it misses",
                        path, parsed.torn, len(self._entries), self._entries[-1][1] if self._entries else "-")
        header_end = _HEADER.unpack_from(data, NAME_SIZE + VERSION_SIZE)[1]
        if data.count(0, parsed.end) != len(data) - parsed.end or header_end != parsed.end:
            # A torn tail, records of a sync that never finished, or pysyncobj's leftovers
            # after a truncation: cut them off so that the invariant holds from here on.
            self._cut_tail(parsed.end)

    # ---------------------------------------------------------------- durability
    @property
    def dirty(self) -> bool:
        """Records are appended that a power loss would still take away."""
        return self._end > self._disk_end

    @property
    def failure(self) -> str | None:
        return self._failure

    def sync(self) -> None:
        """Group commit: make every record appended since the last sync durable (no-op when clean).

        The header names the end of the file's log: with records that pysyncobj deleted but no
        different entry has replaced yet, that is past the last entry pysyncobj holds."""
        if not self.dirty:
            return
        self._usable()
        started = time.perf_counter()
        end = self._dropped_end
        try:
            if self._barrier:
                os.fdatasync(self._fd)  # a long record must be whole before the header names it
            _write_all(self._fd, _END.pack(end), LAST_RECORD_OFFSET_OFFSET)
            os.fdatasync(self._fd)
        except OSError as exc:
            self._fail(f"sync of Raft journal {self.path} failed: {exc}")
        self._disk_end = end
        self._barrier = False
        self.sync_count += 1
        self.sync_seconds += time.perf_counter() - started

    def flush(self) -> None:  # FileJournal's name for it
        self.sync()

    # ---------------------------------------------------------------- pysyncobj's journal interface
    def add(self, command: bytes, idx: int, term: int) -> None:
        self._usable()
        record = encode_record(command, idx, term)
        if self._dropped:
            if _same_entry(self._dropped[0], (command, idx, term)):
                # pysyncobj re-adds an entry it deleted a moment ago (the leader re-sent it): the
                # record is still in its place, durable if it was, and never stopped being so.
                assert self._dropped_starts[0] == self._end
                self._entries.append(self._dropped.pop(0))
                self._starts.append(self._dropped_starts.pop(0))
                self._end += len(record)
                return
            self._truncate_dropped()  # a different entry: now the dropped ones really go
        try:
            if self._end + len(record) > self._allocated:
                self._grow(self._end + len(record))
            _write_all(self._fd, record, self._end)
        except OSError as exc:
            self._fail(f"append to Raft journal {self.path} failed: {exc}")
        self._entries.append((command, idx, term))
        self._starts.append(self._end)
        if (self._end + len(record) - 1) // SECTOR - self._end // SECTOR > 1:
            self._barrier = True
        self._end += len(record)
        self._dropped_end = self._end
        if not self.fsync:
            self._set_disk_end(self._end)  # what a kill -9 must still find

    def clear(self) -> None:
        self._rewrite([], [])

    def deleteEntriesFrom(self, entryFrom: int) -> None:  # noqa: N802, N803 - pysyncobj's names
        """Drop the entries from position ``entryFrom`` on, on disk only once a different one takes their place.

        pysyncobj deletes every entry after the leader's prevLogIdx and appends what the message
        carries, also when those are the very entries it just deleted: the leader re-sends
        entries whose answer is still on its way, which holding answers until the sync makes
        common. Those entries may be acknowledged and committed; truncated on disk, even just
        until they are synced again, a power loss would take them from this server. Raft drops
        entries only for a conflicting one, so the file keeps them until ``add`` brings another.
        """
        if entryFrom >= len(self._entries):
            return
        self._usable()
        self._dropped[:0] = self._entries[entryFrom:]
        self._dropped_starts[:0] = self._starts[entryFrom:]
        self._end = self._starts[entryFrom]
        del self._entries[entryFrom:]
        del self._starts[entryFrom:]

    def deleteEntriesTo(self, entryTo: int) -> None:  # noqa: N802, N803 - pysyncobj's names
        """Log compaction (the full dump is already durable): a new journal file, swapped in atomically."""
        self._rewrite(self._entries[entryTo:], self._dropped)

    def resume_compaction(self, dump_tail: tuple[Entry, Entry] | None) -> None:
        """Finish a log compaction that a crash cut between the full dump's rename and the journal's.

        pysyncobj keeps the journal only if its first two entries are the two a full dump ends
        with, and otherwise replaces it by those two. After a power loss between the dump's
        rename and the journal rewrite that follows it (a tick later), the journal still starts
        earlier: every entry after the dump, acknowledged ones included, would go. Call before
        the SyncObj starts, with ``dump_log_tail``'s answer.
        """
        if dump_tail is None or len(self._entries) < 2:
            return
        prev, last = dump_tail
        at = prev[1] - self._entries[0][1]
        if at <= 0 or at + 1 >= len(self._entries):
            return  # already compacted, or the dump is past this log (an installed snapshot): pysyncobj's case
        if not (_same_entry(self._entries[at], prev) and _same_entry(self._entries[at + 1], last)):
            return  # this log diverges from the dump's: pysyncobj replaces it, as Raft would
        log.warning("Raft journal %s: finishing the log compaction a crash interrupted (the full dump ends at "
                    "entry %d); keeping entries %d-%d", self.path, last[1], prev[1], self._entries[-1][1])
        self._rewrite(self._entries[at:], self._dropped)

    def __getitem__(self, item: Any) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        try:
            if self._failure is None:
                self.sync()
                if not self._meta_saved:
                    self._store_meta()
        except (JournalFailure, OSError) as exc:
            log.error("closing Raft journal %s: %s", self.path, exc)
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass

    def setRaftCommitIndex(self, raftCommitIndex: int) -> None:  # noqa: N802, N803
        self._meta["raftCommitIndex"] = raftCommitIndex
        self._meta_saved = False

    def getRaftCommitIndex(self) -> int:  # noqa: N802
        return int(self._meta.get("raftCommitIndex", 1))

    def setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:  # noqa: N802, N803
        # pysyncobj sends the vote, or acts on the new term, right after this returns.
        self._usable()
        # The meta file also carries the commit index, which may already cover entries appended
        # since the last sync: sync them first, so that a stored commit index never runs ahead of
        # the durable log (_check_commit_index relies on it).
        self.sync()
        self._meta["currentTerm"] = term
        self._meta["votedForNodeId"] = votedForNodeId
        self._store_meta()

    def getCurrentTerm(self) -> int:  # noqa: N802
        return int(self._meta.get("currentTerm", 0))

    def getVotedForNodeId(self) -> Any:  # noqa: N802
        return self._meta.get("votedForNodeId")

    def onOneSecondTimer(self) -> None:  # noqa: N802
        if not self._meta_saved and self._failure is None:
            self.sync()  # a stored commit index never runs ahead of this node's durable log
            self._store_meta()

    # ---------------------------------------------------------------- internals
    def _rewrite(self, kept: list[Entry], dropped: list[Entry]) -> None:
        """Replace the file by one holding ``kept`` (and after it ``dropped``, still dropped).

        Temporary file, fsync, rename, folder fsync."""
        self._usable()
        kept, dropped = list(kept), list(dropped)
        records = [encode_record(*e) for e in kept + dropped]
        starts, offset = [], FIRST_RECORD_OFFSET
        for r in records:
            starts.append(offset)
            offset += len(r)
        try:
            write_file_durably(self.path, journal_header(offset) + b"".join(records), fsync=self.fsync)
            new_fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            self._fail(f"rewrite of Raft journal {self.path} failed: {exc}")
        os.close(self._fd)
        self._fd = new_fd
        self._allocated = offset
        self._entries, self._starts = kept, starts[:len(kept)]
        self._dropped, self._dropped_starts = dropped, starts[len(kept):]
        self._end = self._dropped_starts[0] if dropped else offset
        self._dropped_end = self._disk_end = offset
        self._barrier = False

    def _truncate_dropped(self) -> None:
        """The dropped records go for good: zeroed, then the header names the log's end (synced)."""
        old_end = self._dropped_end
        self._dropped, self._dropped_starts = [], []
        self._dropped_end = self._end
        try:
            if self.fsync:
                # The dropped records may be on disk (synced, or written back by the kernel);
                # zeroed, they cannot pass for the records that will take their place.
                _write_all(self._fd, bytes(old_end - self._end), self._end)
        except OSError as exc:
            self._fail(f"truncation of Raft journal {self.path} failed: {exc}")
        self._set_disk_end(self._end)

    def _cut_tail(self, end: int) -> None:
        try:
            os.ftruncate(self._fd, end)
            _write_all(self._fd, _END.pack(end), LAST_RECORD_OFFSET_OFFSET)
            if self.fsync:
                os.fsync(self._fd)  # fsync, not fdatasync: the size shrinks
        except OSError as exc:
            os.close(self._fd)
            raise DamagedState(
                f"cannot repair the tail of Raft journal {self.path}: {exc}; refusing to start") from None
        self._allocated = self._disk_end = end

    def _grow(self, needed: int) -> None:
        """Zero-fill past ``needed`` by one growth step (made durable by the next sync).

        Small after a compaction rewrite, which leaves a file of just its records."""
        step = min(max(self._allocated, GROW_MIN), GROW_MAX)
        new_size = (needed + step + 4095) // 4096 * 4096
        offset = self._allocated
        while offset < new_size:
            chunk = _ZEROS[:min(len(_ZEROS), new_size - offset)]
            _write_all(self._fd, chunk, offset)
            offset += len(chunk)
        self._allocated = new_size

    def _store_meta(self) -> None:
        try:
            self._meta_file.store(self._meta)
        except OSError as exc:
            self._fail(f"storing Raft term/vote file {self._meta_file.path} failed: {exc}")
        self._meta_saved = True

    def _set_disk_end(self, end: int) -> None:
        try:
            _write_all(self._fd, _END.pack(end), LAST_RECORD_OFFSET_OFFSET)
            if self.fsync:
                os.fdatasync(self._fd)
        except OSError as exc:
            self._fail(f"header write of Raft journal {self.path} failed: {exc}")
        self._disk_end = end

    def _usable(self) -> None:
        if self._failure is not None:
            raise JournalFailure(self._failure)

    def _fail(self, message: str) -> None:
        self._failure = message + "; this server stops taking part in Raft until it is restarted"
        log.critical("%s", self._failure)
        raise JournalFailure(self._failure)


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


# ------------------------------------------------------------------ acknowledgement gate
class AckGate:
    """Holds AppendEntries answers until the journal records they acknowledge are durable."""

    def __init__(self, journal: DurableJournal) -> None:
        self.journal = journal
        self._held: list[tuple[Any, Any]] = []
        self._send: Callable[[Any, Any], Any] | None = None

    def attach(self, send: Callable[[Any, Any], Any]) -> None:
        self._send = send

    def holds(self, message: Any) -> bool:
        """Whether ``message`` must wait; later answers queue behind held ones to keep their order."""
        if not self.journal.fsync:
            return False
        is_ack = isinstance(message, dict) and message.get("type") in ACK_MESSAGE_TYPES
        return is_ack and (self.journal.dirty or bool(self._held))

    def hold(self, node: Any, message: Any) -> None:
        self._held.append((node, message))

    @property
    def held(self) -> int:
        return len(self._held)

    def flush(self) -> None:
        """Sync the journal, then send what was held (in order). Raises JournalFailure, holding on."""
        self.journal.sync()
        if not self._held or self._send is None:
            return
        held, self._held = self._held, []
        for node, message in held:
            self._send(node, message)  # a link that broke meanwhile drops it, like any lost message


# ------------------------------------------------------------------ pysyncobj patches
_lock = threading.Lock()
_installed = False
_pending_journals: dict[str, DurableJournal] = {}
_durable_dumps: dict[str, int] = {}
_original_create_journal: Callable[..., Any] | None = None
_original_atomic_replace: Callable[[str, str], Any] | None = None
# pysyncobj's private state setter and pending-reply failer (name-mangled), used to step down once
# the journal failed; install() checks that they exist on this version.
_STEP_DOWN = "_SyncObj__setState"
_LEADER_CHANGED = "_SyncObj__onLeaderChanged"


def check_pysyncobj_version(version: str = PYSYNCOBJ_VERSION) -> None:
    if version not in SUPPORTED_PYSYNCOBJ:
        raise RuntimeError(
            f"consensus/durable.py patches pysyncobj {', '.join(SUPPORTED_PYSYNCOBJ)} to make Raft state durable, "
            f"but pysyncobj {version} is installed: pin pysyncobj==0.3.17, or re-check the patches against the "
            "new version's syncobj.py, journal.py and serializer.py and add it to SUPPORTED_PYSYNCOBJ"
        )


def install() -> None:
    """Patch pysyncobj's journal factory and dump rename (idempotent; refuses unknown versions)."""
    global _installed, _original_create_journal, _original_atomic_replace
    with _lock:
        if _installed:
            return
        check_pysyncobj_version()
        for module, name in ((_pso_syncobj, "createJournal"), (_pso_serializer, "atomicReplace")):
            if not callable(getattr(module, name, None)):
                raise RuntimeError(f"pysyncobj {PYSYNCOBJ_VERSION} has no {module.__name__}.{name} to patch")
        for cls, name in ((SyncObj, "_onTick"), (SyncObj, "_doDestroy"), (SyncObj, _STEP_DOWN),
                          (SyncObj, _LEADER_CHANGED)):
            if not callable(getattr(cls, name, None)):
                raise RuntimeError(f"pysyncobj {PYSYNCOBJ_VERSION} has no SyncObj.{name} to extend")
        _original_create_journal = _pso_syncobj.createJournal
        _original_atomic_replace = _pso_serializer.atomicReplace
        _pso_syncobj.createJournal = _create_journal
        _pso_serializer.atomicReplace = _atomic_replace
        _installed = True


def _create_journal(journalFile: str | None = None) -> Any:  # noqa: N803 - pysyncobj's name
    with _lock:
        journal = _pending_journals.pop(journalFile, None) if journalFile is not None else None
    if journal is not None:
        return journal
    assert _original_create_journal is not None
    return _original_create_journal(journalFile)


def _atomic_replace(oldPath: str, newPath: str) -> Any:  # noqa: N803 - pysyncobj's names
    with _lock:
        durable = newPath in _durable_dumps
    if durable:
        replace_durably(oldPath, newPath)
        return True
    assert _original_atomic_replace is not None
    return _original_atomic_replace(oldPath, newPath)


class DurableSyncObj(SyncObj):  # type: ignore[misc]
    """A SyncObj whose journal is ``journal`` and whose ticks keep the Raft state durable."""

    def __init__(self, self_node: str, other_nodes: list[str], conf: Any, *, journal: DurableJournal,
                 gate: AckGate, **kwargs: Any) -> None:
        install()
        if conf.journalFile != journal.path:
            raise ValueError(f"conf.journalFile {conf.journalFile!r} is not the journal's path {journal.path!r}")
        # Set before SyncObj.__init__, whose tick thread starts inside it, and which leaves
        # attributes that exist by then out of its full dumps.
        self._pdparams_journal = journal
        self._pdparams_gate = gate
        self._pdparams_dump = conf.fullDumpFile if journal.fsync else None
        self._pdparams_stopped_logged = False
        with _lock:
            _pending_journals[journal.path] = journal
            if self._pdparams_dump is not None:
                _durable_dumps[self._pdparams_dump] = _durable_dumps.get(self._pdparams_dump, 0) + 1
        try:
            super().__init__(self_node, other_nodes, conf, **kwargs)
        except BaseException:
            self._pdparams_release()
            raise
        finally:
            with _lock:
                _pending_journals.pop(journal.path, None)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 - overrides pysyncobj
        journal = self._pdparams_journal
        if journal.failure is None:
            try:
                # Entries added during the last poll (a new leader's no-op, a follower's appends)
                # are durable before this tick's commit count includes this node.
                self._pdparams_gate.flush()
            except JournalFailure:
                pass
        if journal.failure is None:
            try:
                super()._onTick(timeToWait)
            except JournalFailure:
                # Raised from inside pysyncobj (an append, a vote's term, the meta timer), which
                # left that step half done: the branch below stops the node before anything more
                # of it runs. The journal logged why; a traceback per tick would add nothing.
                pass
            else:
                return
        # Fail-stop: no votes, no acknowledgements, no heartbeats, no more truncation; the others
        # elect without us, and the process exits (it polls MetadataNode.failure()).
        if not self._pdparams_stopped_logged:
            self._pdparams_stopped_logged = True
            log.critical("Raft stopped on this server: %s", journal.failure)
            self._pdparams_step_down()
        time.sleep(timeToWait)

    def _pdparams_step_down(self) -> None:
        """Leave the leader (or candidate) role: callers stop seeing this node as leader.

        pysyncobj has no public way to do it; its own step-down (leaderFallbackTimeout) is these
        two steps, and pending forwarded commands fail as on any leader change."""
        try:
            self._SyncObj__raftLeader = None
            getattr(self, _STEP_DOWN)(_RAFT_STATE.FOLLOWER)
            getattr(self, _LEADER_CHANGED)()
        except Exception:  # a callback of pysyncobj's (onStateChanged); the node is stopped regardless
            log.exception("stepping down after a Raft journal failure")

    def _doDestroy(self) -> None:  # noqa: N802 - overrides pysyncobj
        try:
            super()._doDestroy()
        finally:
            self._pdparams_release()

    def _pdparams_release(self) -> None:
        dump = self._pdparams_dump
        if dump is None:
            return
        self._pdparams_dump = None
        with _lock:
            left = _durable_dumps.get(dump, 0) - 1
            if left > 0:
                _durable_dumps[dump] = left
            else:
                _durable_dumps.pop(dump, None)
