"""consensus/durable/ without processes: journal format and group commit, term/vote file, gate, patches."""
from __future__ import annotations

import dataclasses
import gzip
import logging
import os
import pickle
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pysyncobj.journal import FileJournal, MemoryJournal

import consensus.durable as durable
from consensus.config import ConfigError, RaftConfig
from consensus.durable import (SECTOR, AckGate, DamagedState, DurableJournal, JournalFailure, check_dump,
                               check_pysyncobj_version, decode_meta, encode_meta, install)
from consensus.node import MetadataNode

HEADER_END_OFFSET = 36  # pysyncobj's LAST_RECORD_OFFSET_OFFSET


def entries(n: int, first: int = 1, term: int = 1) -> list[tuple[bytes, int, int]]:
    return [(b"cmd-%d" % i * 5, i, term) for i in range(first, first + n)]


def reopen(path: Path, fsync: bool = True) -> DurableJournal:
    return DurableJournal(str(path), fsync=fsync)


def fresh(path: Path, fsync: bool = True, term: int = 2) -> DurableJournal:
    """A new journal whose node has adopted ``term`` (which pysyncobj stores before appending in it)."""
    j = reopen(path, fsync)
    j.setCurrentTerm(term, None)
    return j


def crash(journal: DurableJournal) -> None:
    """What a power loss or kill -9 leaves: the fd goes, nothing is flushed or stored on the way out."""
    os.close(journal._fd)


def disk_end(path: Path) -> int:
    return int(struct.unpack_from("<I", path.read_bytes(), HEADER_END_OFFSET)[0])


@pytest.fixture
def jpath(tmp_path: Path) -> Path:
    return tmp_path / "raft.journal"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Record the sync-relevant syscalls made through the os module, in order."""
    log: list[tuple[Any, ...]] = []
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "pwrite", "replace", "open")}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = real[name](*args, **kwargs)
            if name == "pwrite":
                log.append(("pwrite", args[0], args[2], len(args[1])))
            elif name == "replace":
                log.append(("replace", os.path.basename(args[0]), os.path.basename(args[1])))
            elif name == "open":
                log.append(("open", os.path.basename(str(args[0])), result))
            else:
                log.append((name, args[0]))
            return result
        return call

    for name in real:
        monkeypatch.setattr(os, name, spy(name))
    yield log


# ---------------------------------------------------------------- version guard and patches
def test_version_guard_accepts_the_pin_and_refuses_others() -> None:
    check_pysyncobj_version("0.3.17")
    with pytest.raises(RuntimeError, match=r"patches pysyncobj 0\.3\.17.*0\.3\.18 is installed"):
        check_pysyncobj_version("0.3.18")


def test_patches_fall_through_for_files_they_were_not_told_about(tmp_path: Path) -> None:
    import pysyncobj.serializer as ser
    import pysyncobj.syncobj as so
    install()
    install()  # idempotent
    assert so.createJournal is durable._create_journal and ser.atomicReplace is durable._atomic_replace
    assert isinstance(so.createJournal(None), MemoryJournal)
    other = so.createJournal(str(tmp_path / "other.journal"))
    assert isinstance(other, FileJournal)  # pysyncobj's own, for a SyncObj that is not ours
    other._destroy()
    (tmp_path / "a").write_bytes(b"x")
    ser.atomicReplace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (tmp_path / "b").read_bytes() == b"x"


def test_the_dump_of_a_registered_node_is_replaced_durably(tmp_path: Path, calls: list[tuple[Any, ...]]) -> None:
    import pysyncobj.serializer as ser
    install()
    dump = str(tmp_path / "raft.dump")
    (tmp_path / "raft.dump.tmp").write_bytes(b"state")
    durable._durable_dumps[dump] = 1
    try:
        calls.clear()
        ser.atomicReplace(dump + ".tmp", dump)
    finally:
        durable._durable_dumps.pop(dump)
    kinds = [c[0] for c in calls]
    assert kinds == ["open", "fsync", "replace", "open", "fsync"]  # file synced, renamed, folder synced
    assert calls[1][1] == calls[0][2] and calls[4][1] == calls[3][2]


# ---------------------------------------------------------------- journal
def test_records_are_in_the_log_only_after_a_sync(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(3):
        j.add(*e)
    assert j.dirty
    j.sync()
    assert not j.dirty and j.sync_count == 1
    for e in entries(2, first=4):
        j.add(*e)
    crash(j)  # the last two were never synced, so never acknowledged
    j = reopen(jpath)
    assert list(j) == entries(3)
    j._destroy()


def test_without_fsync_every_append_survives_a_kill(jpath: Path, calls: list[tuple[Any, ...]]) -> None:
    j = fresh(jpath, fsync=False)
    for e in entries(4):
        j.add(*e)
    assert not j.dirty  # nothing waits: --no-fsync sends answers at once
    crash(j)
    assert list(reopen(jpath, fsync=False)) == entries(4)
    assert not [c for c in calls if c[0] in ("fsync", "fdatasync")]


def journal_calls(calls: list[tuple[Any, ...]], fd: int) -> list[tuple[str, int | None]]:
    return [(c[0], c[2] if c[0] == "pwrite" else None) for c in calls if c[1] == fd]


def test_sync_is_one_group_commit_of_one_fdatasync_after_the_header(jpath: Path, calls: list[tuple[Any, ...]]) -> None:
    j = reopen(jpath)
    calls.clear()
    for e in entries(10):
        j.add(*e)
    j.sync()
    j.sync()  # clean: no syscall at all
    kinds = journal_calls(calls, j._fd)
    assert [k for k in kinds if k[0] == "fdatasync"] == [("fdatasync", None)] and j.sync_count == 1
    assert kinds[-2:] == [("pwrite", HEADER_END_OFFSET), ("fdatasync", None)]
    assert all(k[0] == "pwrite" and k[1] != HEADER_END_OFFSET for k in kinds[:-2])  # records (and growth)
    j._destroy()


def test_a_record_longer_than_two_sectors_is_whole_on_disk_before_the_header_names_it(
        jpath: Path, calls: list[tuple[Any, ...]]) -> None:
    j = reopen(jpath)
    j.add(b"small", 1, 0)
    j.sync()
    calls.clear()
    j.add(b"x" * 1500, 2, 0)  # spans at least three 512-byte sectors: a torn middle would go unseen
    j.sync()
    kinds = journal_calls(calls, j._fd)
    assert kinds[-3:] == [("fdatasync", None), ("pwrite", HEADER_END_OFFSET), ("fdatasync", None)]
    calls.clear()
    j.add(b"small again", 3, 0)
    j.sync()
    assert [k for k in journal_calls(calls, j._fd) if k[0] == "fdatasync"] == [("fdatasync", None)]
    j._destroy()


def test_a_sync_torn_by_a_power_loss_leaves_the_log_of_the_last_completed_one(jpath: Path) -> None:
    big = [(b"v" * 300 + b"%d" % i, i, 1) for i in range(1, 8)]  # each within two sectors, the group over several
    j = fresh(jpath)
    for e in big[:3]:
        j.add(*e)
    j.sync()
    durable = j._end
    for e in big[3:]:
        j.add(*e)
    j.sync()
    crash(j)
    # The power failed during the second sync: its header sector and some record sectors
    # reached the disk, one record sector did not (it reads as the zeros that were there).
    data = bytearray(jpath.read_bytes())
    sector = (durable + 400) // 512 * 512
    data[sector:sector + 512] = bytes(512)
    jpath.write_bytes(bytes(data))
    j = reopen(jpath)
    kept = list(j)
    assert 3 <= len(kept) < 7 and kept == big[:len(kept)]  # a prefix of what was written, nothing wrong in it
    assert not any(jpath.read_bytes()[j._end:])  # the torn tail is gone, so new records land on zeros
    j._destroy()


@settings(max_examples=150, deadline=None)
@given(before=st.lists(st.integers(0, 1500), min_size=1, max_size=6),
       group=st.lists(st.integers(0, 1500), min_size=1, max_size=8),
       torn=st.lists(st.booleans(), min_size=64, max_size=64), phase_two=st.booleans())
def test_any_torn_sync_leaves_a_prefix_holding_every_completed_sync(
        before: list[int], group: list[int], torn: list[bool], phase_two: bool) -> None:
    """Sector by sector, a power loss during a sync keeps the old or the new content of each.

    With a long record in the group the records were whole before the header was written
    (phase one completed), so then only the header sector may be old or new."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "raft.journal"
        j = fresh(path, term=1)
        log = [(b"c" * size + b"%d" % i, i, 1) for i, size in enumerate(before + group, start=1)]
        for e in log[:len(before)]:
            j.add(*e)
        j.sync()
        old = path.read_bytes()
        for e in log[len(before):]:
            j.add(*e)
        barrier = j._barrier
        j.sync()
        crash(j)
        new = path.read_bytes()
        assert len(old) == len(new)  # one growth step holds both
        changed = [k for k in range(0, len(new), SECTOR) if old[k:k + SECTOR] != new[k:k + SECTOR]]
        image = bytearray(new)
        for n, k in enumerate(changed):
            if barrier and phase_two:
                keep_new = k != 0 or torn[0]  # records all there; the header's sector maybe
            elif barrier:
                keep_new = k != 0 and torn[n % len(torn)]  # header untouched; records mixed
            else:
                keep_new = torn[n % len(torn)]
            if not keep_new:
                image[k:k + SECTOR] = old[k:k + SECTOR]
        path.write_bytes(bytes(image))
        kept = list(reopen(path))
        assert kept == log[:len(kept)] and len(kept) >= len(before)


def test_stale_bytes_past_the_log_are_cut_off_at_start(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(3):
        j.add(*e)
    j.sync()
    j.add(*entries(1, first=4)[0])  # written (and here on disk), never synced
    crash(j)
    j = reopen(jpath)
    assert list(j) == entries(3) and os.path.getsize(jpath) == j._end
    j._destroy()


def test_format_is_pysyncobjs_both_ways(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs.journal"
    fj = FileJournal(str(theirs))
    for e in entries(5):
        fj.add(*e)
    fj.setCurrentTerm(3, "127.0.0.1:7002")
    fj._destroy()
    j = reopen(theirs)
    assert list(j) == entries(5)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (3, "127.0.0.1:7002")  # pysyncobj's pickled meta
    j._destroy()

    ours = tmp_path / "ours.journal"
    j = fresh(ours)
    for e in entries(7, term=2):
        j.add(*e)
    j.sync()
    j._destroy()
    fj = FileJournal(str(ours))
    assert [(bytes(c), i, t) for c, i, t in (fj[k] for k in range(len(fj)))] == entries(7, term=2)
    fj._destroy()


def test_truncation_stops_the_header_naming_records_before_they_are_overwritten(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(5):
        j.add(*e)
    j.sync()
    j.deleteEntriesFrom(2)
    j.add(b"new-3", 3, 2)  # a different entry 3: the truncation reaches the disk before its record
    assert list(j) == entries(2) + [(b"new-3", 3, 2)] and j.dirty
    crash(j)
    j = reopen(jpath)
    assert list(j) == entries(2)  # the unsynced new entry is gone, and the truncated ones stay gone
    j.add(b"new-3", 3, 2)
    j.sync()
    crash(j)
    assert list(reopen(jpath))[-1] == (b"new-3", 3, 2)


def test_truncation_zeroes_the_dropped_records_on_disk(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(2):
        j.add(*e)
    j.sync()
    for e in entries(3, first=3):
        j.add(*e)  # unsynced, but the kernel may have written them back already
    old_end = j._dropped_end
    j.deleteEntriesFrom(3)
    j.add(b"new-4", 4, 3)
    kept_end = j._starts[-1]
    assert disk_end(jpath) == kept_end  # the kept prefix is durable before the new record lands
    assert not any(jpath.read_bytes()[kept_end + len(durable.encode_record(b"new-4", 4, 3)):old_end])
    j.sync()
    crash(j)
    assert list(reopen(jpath)) == entries(3) + [(b"new-4", 4, 3)]


def test_entries_the_leader_re_sends_stay_durable_while_pysyncobj_deletes_and_re_adds_them(
        jpath: Path, calls: list[tuple[Any, ...]]) -> None:
    """pysyncobj's follower deletes every entry after prevLogIdx and appends what came, even the same ones.

    The leader re-sends entries whose answers are still on the way (common, since answers wait for
    the sync). Those were synced and acknowledged: a power loss right after the deletion, or
    after the re-add and before the next sync, must still find them on this server."""
    j = fresh(jpath)
    for e in entries(5):
        j.add(*e)
    j.sync()  # acknowledged from here on
    j.deleteEntriesFrom(2)  # append_entries with prevLogIdx 2
    assert list(j) == entries(2) and not j.dirty  # pysyncobj's view; nothing for the gate to hold
    before = len(calls)
    for e in entries(3, first=3):
        j.add(*e)  # the same entries again
    assert list(j) == entries(5) and not j.dirty  # the answer goes out at once: nothing new to sync
    assert [c for c in calls[before:] if c[0] in ("pwrite", "fdatasync", "fsync")] == []
    crash(j)
    assert list(reopen(jpath)) == entries(5)

    j = reopen(jpath)
    j.deleteEntriesFrom(1)
    crash(j)  # the power fails between the deletion and the re-add
    assert list(reopen(jpath)) == entries(5)

    j = reopen(jpath)
    j.deleteEntriesFrom(1)
    j.add(*entries(1, first=2)[0])  # only part of them came back (a batch cut short by its size limit)
    j.sync()
    crash(j)
    assert list(reopen(jpath)) == entries(5)

    j = reopen(jpath)
    j.deleteEntriesFrom(2)
    j.add(b"other-3", 3, 2)  # a conflicting entry (a later term): now 3..5 go, as Raft wants
    j.sync()
    crash(j)
    assert list(reopen(jpath)) == entries(2) + [(b"other-3", 3, 2)]


def test_dropped_entries_kept_on_disk_follow_a_sync_and_a_compaction(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(6):
        j.add(*e)
    j.sync()
    j.deleteEntriesFrom(3)  # 4..6 dropped by pysyncobj, still in the file
    j.add(*entries(1, first=4)[0])  # one re-sent
    assert not j.dirty
    j.deleteEntriesTo(2)  # compaction: the new file keeps the dropped ones after the log
    assert list(j) == entries(2, first=3) and not j.dirty
    j.add(*entries(1, first=5)[0])  # still restorable in the new file
    assert list(j) == entries(3, first=3)
    crash(j)
    assert list(reopen(jpath)) == entries(4, first=3)  # 3..6: nothing acknowledged went


def test_a_dropped_entry_that_was_never_synced_is_synced_before_its_answer(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(2):
        j.add(*e)
    j.sync()
    for e in entries(2, first=3):
        j.add(*e)  # not synced yet: not acknowledged
    j.deleteEntriesFrom(2)
    assert not j.dirty  # what pysyncobj holds now (1..2) is durable
    j.add(*entries(1, first=3)[0])
    assert j.dirty  # entry 3 is back, and its answer waits for the sync
    j.sync()
    assert disk_end(jpath) == j._dropped_end  # the header names the whole file log, 4 too
    crash(j)
    assert list(reopen(jpath)) == entries(4)


def test_compaction_swaps_in_a_new_file(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(6):
        j.add(*e)
    j.sync()
    j.deleteEntriesTo(4)
    assert list(j) == entries(2, first=5) and not j.dirty
    assert not (jpath.parent / "raft.journal.tmp").exists()
    j.add(b"after", 7, 1)
    j.sync()
    crash(j)
    assert list(reopen(jpath)) == entries(2, first=5) + [(b"after", 7, 1)]


def test_clear_is_durable_before_new_records(jpath: Path) -> None:
    j = fresh(jpath)
    for e in entries(4):
        j.add(*e)
    j.sync()
    j.clear()
    j.add(b"snap-a", 10, 3)
    crash(j)
    assert list(reopen(jpath)) == []


@pytest.mark.parametrize("damage", ["cut_record", "garbage_tail", "short_file"])
def test_a_torn_tail_is_dropped_with_a_warning(jpath: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    fj = FileJournal(str(jpath))  # pysyncobj's unsynced writer is what leaves torn tails
    for e in entries(4):
        fj.add(*e)
    fj.setCurrentTerm(1, None)
    fj._destroy()
    data = bytearray(jpath.read_bytes())
    end = disk_end(jpath)
    if damage == "cut_record":
        data = data[:end - 5]
    elif damage == "garbage_tail":
        data[end - 4:end] = b"\xff\xff\xff\x7f"  # the record's closing length
    else:
        data = data[:end - 3]
    jpath.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="consensus.durable"):
        j = reopen(jpath)
    assert list(j) == entries(3)
    assert "torn tail dropped" in caplog.text and str(jpath) in caplog.text
    j.add(b"next", 4, 1)
    j.sync()
    crash(j)
    assert list(reopen(jpath)) == entries(3) + [(b"next", 4, 1)]


@pytest.mark.parametrize("content,needle", [
    (b"", "shorter than its header"),
    (b"NOTPYSYNCOBJ" + bytes(40), "not a pysyncobj journal"),
])
def test_a_journal_that_is_not_one_refuses_to_open(jpath: Path, content: bytes, needle: str) -> None:
    jpath.write_bytes(content)
    with pytest.raises(DamagedState, match=needle) as err:
        reopen(jpath)
    assert str(jpath) in str(err.value)


def test_a_failed_sync_is_never_retried(jpath: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = reopen(jpath)
    j.add(*entries(1)[0])

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(JournalFailure, match="sync of Raft journal"):
        j.sync()
    monkeypatch.undo()
    with pytest.raises(JournalFailure):  # the kernel may have dropped the pages: a retry could lie
        j.sync()
    with pytest.raises(JournalFailure):
        j.setCurrentTerm(2, "x:1")
    assert j.failure is not None and j.dirty
    j._destroy()


# ---------------------------------------------------------------- term / vote file
def test_term_and_vote_are_stored_durably_before_set_current_term_returns(
        jpath: Path, calls: list[tuple[Any, ...]]) -> None:
    j = reopen(jpath)
    calls.clear()
    j.setCurrentTerm(7, "127.0.0.1:7003")
    kinds = [c[0] for c in calls]
    assert kinds == ["open", "pwrite", "fsync", "replace", "open", "fsync"]
    assert calls[0][1] == "raft.journal.meta.tmp" and calls[2][1] == calls[0][2]  # the temp file is synced
    assert calls[3][1:] == ("raft.journal.meta.tmp", "raft.journal.meta")
    assert calls[4][1] == jpath.parent.name and calls[5][1] == calls[4][2]  # then its folder
    crash(j)
    j = reopen(jpath)
    assert (j.getCurrentTerm(), j.getVotedForNodeId()) == (7, "127.0.0.1:7003")
    j._destroy()


def test_commit_index_is_stored_once_a_second_after_the_journal_sync(jpath: Path) -> None:
    j = reopen(jpath)
    j.setCurrentTerm(1, None)
    j.add(*entries(1)[0])
    j.setRaftCommitIndex(1)
    j.onOneSecondTimer()
    assert not j.dirty  # the stored commit index never runs ahead of the durable log
    crash(j)
    assert reopen(jpath).getRaftCommitIndex() == 1


def test_meta_encoding_round_trips_and_carries_a_checksum() -> None:
    meta = {"currentTerm": 4, "votedForNodeId": "127.0.0.1:1", "raftCommitIndex": 9}
    raw = encode_meta(meta)
    assert decode_meta(raw, "m") == meta
    assert b"crc32" in raw and raw.endswith(b"\n")
    legacy = pickle.dumps({"currentTerm": 2, "votedForNodeId": None})
    assert decode_meta(legacy, "m") == {"currentTerm": 2, "votedForNodeId": None}


def _flip_term(raw: bytes) -> bytes:
    return raw.replace(b'"currentTerm":4', b'"currentTerm":5')


@pytest.mark.parametrize("make,needle", [
    (lambda raw: b"", "neither"),
    (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
    (_flip_term, "checksum mismatch"),
    (lambda raw: b"\x00\x01garbage", "neither"),
    (lambda raw: pickle.dumps(["not", "a", "dict"]), "not a dict"),
    (lambda raw: pickle.dumps({"currentTerm": "4"}), "currentTerm"),
    (lambda raw: raw.replace(b"pdparams-raft-meta/1", b"pdparams-raft-meta/9"), "unknown format"),
])
def test_a_damaged_term_vote_file_refuses_start_up_naming_it(jpath: Path, make: Any, needle: str) -> None:
    meta = jpath.parent / "raft.journal.meta"
    meta.write_bytes(make(encode_meta({"currentTerm": 4, "votedForNodeId": "a:1", "raftCommitIndex": 2})))
    with pytest.raises(DamagedState, match=needle) as err:
        reopen(jpath)
    message = str(err.value)
    assert str(meta) in message and "\n" not in message and "refusing to start" in message


def test_an_unreadable_term_vote_file_refuses_start_up(jpath: Path) -> None:
    (jpath.parent / "raft.journal.meta").mkdir()
    with pytest.raises(DamagedState, match="cannot read Raft term/vote file"):
        reopen(jpath)


def test_a_missing_term_vote_file_is_fine_for_a_fresh_log_but_not_after_a_term(jpath: Path) -> None:
    j = reopen(jpath)
    j.add(b"noop", 1, 0)  # what pysyncobj writes first, before any term
    j.sync()
    j._destroy()
    reopen(jpath)._destroy()
    j = reopen(jpath)
    j.setCurrentTerm(2, None)
    j.add(b"x", 2, 2)
    j._destroy()
    (jpath.parent / "raft.journal.meta").unlink()
    with pytest.raises(DamagedState, match="is missing, but the journal .* term 2"):
        reopen(jpath)


# ---------------------------------------------------------------- full dump
def test_a_damaged_dump_refuses_start_up(tmp_path: Path) -> None:
    dump = tmp_path / "raft.dump"
    check_dump(str(dump))  # absent: fine
    with gzip.open(dump, "wb") as g:
        g.write(b"x" * 10000)
    check_dump(str(dump))
    good = dump.read_bytes()
    dump.write_bytes(good[:-6])
    with pytest.raises(DamagedState, match="raft.dump is damaged"):
        check_dump(str(dump))
    dump.write_bytes(b"")  # what an undurable rename leaves: the name, not the data
    with pytest.raises(DamagedState, match="raft.dump is damaged .*holds no state"):
        check_dump(str(dump))


# ---------------------------------------------------------------- acknowledgement gate
class FakeJournal:
    def __init__(self, fsync: bool = True) -> None:
        self.fsync = fsync
        self.dirty = False
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1
        self.dirty = False


ACK = {"type": "next_node_idx", "next_node_idx": 5, "reset": False, "success": True}


def test_gate_holds_answers_while_the_journal_is_dirty_and_releases_them_in_order() -> None:
    journal = FakeJournal()
    sent: list[tuple[str, dict[str, Any]]] = []
    gate = AckGate(journal)  # type: ignore[arg-type]
    gate.attach(lambda node, msg: sent.append((node, msg)))
    assert not gate.holds(ACK)  # clean: straight out
    journal.dirty = True
    for msg in ({"type": "append_entries"}, {"type": "response_vote"}, {"type": "pdparams_keepalive"}, "handshake"):
        assert not gate.holds(msg)  # only acknowledgements of appended entries wait
    assert gate.holds(ACK)
    gate.hold("a", dict(ACK, next_node_idx=5))
    gate.hold("a", dict(ACK, next_node_idx=6))
    journal.dirty = False
    assert gate.holds(ACK)  # queues behind the held ones, never overtakes them
    gate.flush()
    assert journal.syncs == 1 and [m["next_node_idx"] for _, m in sent] == [5, 6] and gate.held == 0


def test_gate_without_fsync_never_holds() -> None:
    journal = FakeJournal(fsync=False)
    journal.dirty = True
    assert not AckGate(journal).holds(ACK)  # type: ignore[arg-type]


# ---------------------------------------------------------------- config and node start-up
def test_fsync_must_be_a_bool(tmp_path: Path) -> None:
    base = RaftConfig("n1", "127.0.0.1:7001", ("127.0.0.1:7002",), tmp_path / "n1")
    assert base.fsync is True and base.meta_file == tmp_path / "n1" / "raft.journal.meta"
    with pytest.raises(ConfigError, match="fsync"):
        dataclasses.replace(base, fsync="no").validate()  # type: ignore[arg-type]


def test_node_start_refuses_a_damaged_vote_file_before_binding(tmp_path: Path) -> None:
    config = RaftConfig("n1", "127.0.0.1:1", ("127.0.0.1:2",), tmp_path / "n1")
    config.data_dir.mkdir()
    config.meta_file.write_bytes(b"\x80\x04garbage")
    node = MetadataNode(config)
    with pytest.raises(DamagedState) as err:
        node.start()
    assert str(config.meta_file) in str(err.value)
    node.close()
