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

# The package's jobs, one module each: files (durable writes), meta (term/vote file), format
# (journal records and start-up checks), journal (DurableJournal), syncobj (the pysyncobj hooks).
# Every name below was importable from consensus.durable when it was one module; the error
# classes live in consensus.errors. The test seam ``write_fault`` lives in .files, where it is read.
from ..errors import DamagedState, JournalFailure
from .files import fsync_dir, fsync_path_and_ancestors, replace_durably, write_file_durably
from .format import (SECTOR, Entry, ParsedJournal, check_dump, dump_log_tail, encode_record, journal_header,
                     parse_journal)
from .journal import GROW_MAX, GROW_MIN, DurableJournal
from .meta import META_FORMAT, RECOVERY_ADVICE, MetaFile, decode_meta, encode_meta
from .syncobj import (ACK_MESSAGE_TYPES, SUPPORTED_PYSYNCOBJ, AckGate, DurableSyncObj, _atomic_replace, _create_journal,
                      _durable_dumps, check_pysyncobj_version, install)

__all__ = [
    "ACK_MESSAGE_TYPES", "GROW_MAX", "GROW_MIN", "META_FORMAT", "RECOVERY_ADVICE", "SECTOR", "SUPPORTED_PYSYNCOBJ",
    "AckGate", "DamagedState", "DurableJournal", "DurableSyncObj", "Entry", "JournalFailure", "MetaFile",
    "ParsedJournal", "_atomic_replace", "_create_journal", "_durable_dumps", "check_dump", "check_pysyncobj_version",
    "decode_meta", "dump_log_tail", "encode_meta", "encode_record", "fsync_dir", "fsync_path_and_ancestors",
    "install", "journal_header", "parse_journal", "replace_durably", "write_file_durably",
]
