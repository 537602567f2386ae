"""A follower's Raft journal cut mid-record (issue 11, item 5).

Before: the server started on whatever records were left, held a commit index its log could not
reach, and answered reads from an old state (NOT_FOUND for a tag that exists). Now: a cut that
reaches entries the server knew were committed stops start-up with one message naming the file,
and leaves the file as it found it; a torn tail past the commit index (a power loss during a
sync) is cut off with a WARNING naming the file and the records kept, and the server catches up.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from pysyncobj.syncobj import _COMMAND_TYPE, _bchr

from consensus import DamagedState, MetadataNode, RaftConfig
from consensus.durable import DurableJournal, parse_journal

from ..integration.consensus_harness import REPO_ROOT, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
MANIFEST = "ab" * 32


class Trio:
    def __init__(self, root: Path) -> None:
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
        self.root = root
        self.nodes: list[MetadataNode | None] = [None, None, None]

    def config(self, i: int) -> RaftConfig:
        a = self.addresses[i]
        return RaftConfig(f"n{i}", a, tuple(p for p in self.addresses if p != a), self.root / f"n{i}", fsync=False)

    def start(self, i: int) -> MetadataNode:
        node = MetadataNode(self.config(i))
        node.start()
        self.nodes[i] = node
        return node

    def stop(self, i: int) -> None:
        node, self.nodes[i] = self.nodes[i], None
        if node is not None:
            node.close()

    def close(self) -> None:
        for i in range(3):
            self.stop(i)


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[tuple[Trio, int]]:
    """Three nodes with a tagged model at version 3, and the index of a follower, stopped, fully caught up."""
    t = Trio(tmp_path)
    try:
        for i in range(3):
            t.start(i)
        nodes = [n for n in t.nodes if n is not None]
        assert all(n.wait_ready(30) for n in nodes)
        parent = None
        for _ in range(3):
            parent = nodes[0].commit_version("m", MANIFEST, parent, "p", 1, 1, tag="prod").number
        follower = next(i for i, n in enumerate(nodes) if not n.is_leader())
        f = nodes[follower]
        wait_until(lambda: f.resolve_tag("m", "prod").value.number == 3 and f.status()["last_applied"]
                   >= nodes[0].commit_index(), 10, what="the follower applying everything")
        t.stop(follower)  # close() stores the commit index it knows
        yield t, follower
    finally:
        t.close()


def cut_mid_record(journal: Path, record: int) -> bytes:
    """Cut the file in the middle of record number ``record`` (0-based); the bytes left."""
    parsed = parse_journal(journal.read_bytes(), str(journal))
    start = parsed.starts[record]
    end = parsed.starts[record + 1] if record + 1 < len(parsed.starts) else parsed.end
    with open(journal, "r+b") as f:
        f.truncate((start + end) // 2)
    return journal.read_bytes()


def test_a_journal_cut_below_its_commit_index_stops_start_up_naming_the_file(trio: tuple[Trio, int]) -> None:
    t, follower = trio
    journal = t.config(follower).journal_file
    entries = len(parse_journal(journal.read_bytes(), str(journal)).entries)
    left = cut_mid_record(journal, entries // 2)  # committed entries (the later versions) are gone
    with pytest.raises(DamagedState) as info:
        t.start(follower)
    message = str(info.value)
    assert str(journal) in message and "committed" in message and "\n" not in message
    assert journal.read_bytes() == left  # refused before anything in the file changed
    # The same as a process: one line naming the file, exit 1, no traceback.
    cfg = t.config(follower)
    proc = subprocess.run(
        [sys.executable, "-m", "consensus.devnode", "--id", cfg.server_id, "--raft", cfg.raft_address,
         "--data-dir", str(cfg.data_dir), "--no-fsync", *[a for p in cfg.peers for a in ("--peer", p)]],
        cwd=REPO_ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert str(journal) in proc.stderr and "Traceback" not in proc.stderr and "EOFError" not in proc.stderr
    assert journal.read_bytes() == left


def test_a_torn_tail_past_the_commit_index_is_cut_with_a_warning_and_the_follower_catches_up(
        trio: tuple[Trio, int], caplog: pytest.LogCaptureFixture) -> None:
    t, follower = trio
    journal = t.config(follower).journal_file
    # An entry appended after the last one this follower knew committed (the tail of a sync that a
    # power loss interrupted), then cut mid-record.
    j = DurableJournal(str(journal), fsync=False)
    kept = len(j)
    last = j[-1]
    j.add(_bchr(_COMMAND_TYPE.NO_OP), last[1] + 1, last[2])
    j.sync()
    j._destroy()
    cut_mid_record(journal, kept)
    caplog.set_level(logging.WARNING)
    node = t.start(follower)
    warnings = [r.getMessage() for r in caplog.records if r.name == "consensus.durable" and "torn tail" in r.getMessage()]
    assert len(warnings) == 1 and str(journal) in warnings[0] and f"kept {kept} records" in warnings[0], warnings
    assert node.wait_ready(30)
    wait_until(lambda: node.resolve_tag("m", "prod").value.number == 3, 10, what="the tag on the restarted follower")
    assert node.resolve_tag("m", "prod", linearizable=True).value.number == 3
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
