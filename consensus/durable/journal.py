"""``DurableJournal``: pysyncobj's journal interface written with pwrite and group commit (see the
package docstring for the invariants)."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from pysyncobj.journal import FIRST_RECORD_OFFSET, LAST_RECORD_OFFSET_OFFSET, NAME_SIZE, VERSION_SIZE, Journal

from ..errors import DamagedState, JournalFailure
from .files import _write_all, write_file_durably
from .format import (_END, _HEADER, SECTOR, Entry, _check_commit_index, _same_entry, encode_record, journal_header,
                     parse_journal)
from .meta import MetaFile

log = logging.getLogger("consensus.durable")

# The journal grows by zero-filled steps. Records then always land on zeros (part of the
# torn-tail argument, see DurableJournal), and an fdatasync of records written over
# allocated blocks is one disk flush, while one that also extends the file commits the file
# system's journal too, and the three servers' syncs then queue behind each other.
GROW_MIN, GROW_MAX = 64 << 10, 1 << 20  # a step doubles the file, within these bounds
_ZEROS = bytes(64 << 10)



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
