"""A follower keeps the entries a leader re-sends (issue 41): no truncation of applied entries, so no
false CRITICAL "state machine may have diverged" on a healthy cluster.

pysyncobj deleted every entry after ``prevLogIdx`` whenever the follower's log was longer, even
when the message carried those same entries again (a leader re-sends what it has no answer for
yet: the acknowledgement gate holds answers until the journal is synced). The real follower
(DurableSyncObj, no tick thread) is fed the messages here directly.
"""
from __future__ import annotations

import logging
import socket
import struct
from pathlib import Path
from typing import Any

import pytest
from pysyncobj import SyncObjConf

from consensus.durable import AckGate, DurableJournal
from consensus.durable.append_entries import trim
from consensus.durable.syncobj import DurableSyncObj

NO_OP = struct.pack("B", 1)  # pysyncobj's _COMMAND_TYPE.NO_OP: applied as nothing


def log_of(pairs: list[tuple[int, int]]) -> tuple[Any, int]:
    terms = dict(pairs)
    return (lambda i: terms.get(i)), max(terms)


def msg(prev: int, prev_term: int, entries: list[tuple[int, int]], term: int = 2) -> dict[str, Any]:
    return {"type": "append_entries", "term": term, "commit_index": 0, "prevLogIdx": prev, "prevLogTerm": prev_term,
            "entries": [(NO_OP, i, t) for i, t in entries]}


def test_trim_keeps_held_entries_and_passes_conflicts_on() -> None:
    term_at, last = log_of([(1, 0), (2, 2), (3, 2), (4, 2), (5, 2)])
    # every entry held, the log goes on with the sender's term: a heartbeat at the last entry
    out = trim(msg(1, 0, [(2, 2), (3, 2)]), term_at, last)
    assert (out["prevLogIdx"], out["prevLogTerm"], out["entries"]) == (5, 2, [])
    # held prefix dropped, the new entry appended after the last held one
    out = trim(msg(3, 2, [(4, 2), (5, 2), (6, 2)]), term_at, last)
    assert (out["prevLogIdx"], out["prevLogTerm"], [e[1] for e in out["entries"]]) == (5, 2, [6])
    # a conflicting entry (index 4 of term 3): cut there, as Raft does
    out = trim(msg(2, 2, [(3, 2), (4, 3)], term=3), term_at, last)
    assert (out["prevLogIdx"], [e[1] for e in out["entries"]]) == (3, [4])
    # a tail of an older term than the sender's: not vouched for, left to pysyncobj
    m = msg(3, 2, [], term=3)
    assert trim(m, term_at, last) is m
    # a mismatch at prevLogIdx, a longer leader log, snapshots and other messages: unchanged
    for m in (msg(2, 1, [(3, 2)]), msg(5, 2, [(6, 2)]), {"type": "append_entries", "term": 2, "serialized": b""},
              {"type": "request_vote", "term": 3}, {**msg(1, 0, [(2, 2)]), "transmission": "start"}):
        assert trim(m, term_at, last) is m


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_re_sent_append_entries_leaves_applied_entries_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    journal = DurableJournal(str(tmp_path / "journal"), fsync=False)
    conf = SyncObjConf(autoTick=False, journalFile=str(tmp_path / "journal"), fullDumpFile=str(tmp_path / "dump"),
                       dynamicMembershipChange=True, useFork=False, bindAddress=f"127.0.0.1:{_port()}")
    leader = f"127.0.0.1:{_port()}"  # nobody listens there: messages come from the test
    so = DurableSyncObj(conf.bindAddress, [leader], conf, journal=journal, gate=AckGate(journal))
    try:
        node = next(n for n in so._SyncObj__otherNodes)
        receive = so._SyncObj__onMessageReceived
        first = so._SyncObj__raftLog[-1][1]
        batch = [(first + k, 1) for k in range(1, 6)]
        receive(node, {**msg(first, so._SyncObj__raftLog[-1][2], batch, term=1), "commit_index": first + 5})
        for _ in range(5):
            so.doTick(0.0)
        assert so.raftLastApplied == first + 5
        caplog.clear()
        # The leader re-sends the first three (their answer not seen yet), then a heartbeat from that point.
        with caplog.at_level(logging.WARNING, logger="pysyncobj"):
            receive(node, {**msg(first, so._SyncObj__raftLog[0][2] if first == so._SyncObj__raftLog[0][1] else 0,
                                 batch[:3], term=1), "commit_index": first + 5})
            receive(node, {**msg(first + 2, 1, [], term=1), "commit_index": first + 5})
            so.doTick(0.0)
        critical = [r.getMessage() for r in caplog.records if r.levelno >= logging.CRITICAL]
        assert not critical, critical
        assert so._SyncObj__raftLog[-1][1] == first + 5 and so.raftLastApplied == first + 5
        assert so.raftCommitIndex == first + 5
    finally:
        so.destroy()
