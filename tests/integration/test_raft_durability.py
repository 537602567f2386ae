"""Raft durability seen from outside: syscall traces of real servers, and refusal of damaged state.

The trace test attaches strace to every server of a 3-node cluster while 40 sequential commits
are acknowledged, then kills the leader so that the other two elect. From the trace it checks
that every server synced its journal inside every commit's window (submit -> acknowledgement),
and, by decoding the Raft messages the servers sent (zlib + pickle on the wire, no secret), that
each vote request and each granted vote went out only after the term and vote had been written
to a temporary file, fsynced, renamed and the folder fsynced.
"""
from __future__ import annotations

import codecs
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from consensus.errors import Conflict

from .consensus_harness import REPO_ROOT, Cluster, DevNode, free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(240)]
MANIFEST = "cd" * 32
SYNCS = {"fsync", "fdatasync", "msync"}


def _strace_unavailable() -> str | None:
    if shutil.which("strace") is None:
        return "strace is not installed (Debian: apt-get install strace)"
    if os.geteuid() != 0:
        return "attaching strace to running servers needs root (ptrace)"
    return None


needs_strace = pytest.mark.skipif(_strace_unavailable() is not None, reason=str(_strace_unavailable()))


# ------------------------------------------------------------------ strace output
@dataclass
class Call:
    tid: int
    t: float  # when the call started (strace -ttt: the same wall clock as time.time())
    name: str
    fd_path: str  # the file or socket of the first argument (strace -yy), "" if none
    strings: list[bytes]
    ret: int
    offset: int | None  # pwrite64's file offset


_LINE = re.compile(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")
_FD = re.compile(r"^-?\d+<((?:[^>\\]|\\.)*)>")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')
_PWRITE_OFFSET = re.compile(r",\s*\d+,\s*(\d+)$")
HEADER_END_OFFSET = 36  # where pysyncobj's journal header keeps the end of the last record


def _unescape(text: str) -> bytes:
    return codecs.escape_decode(text.encode("latin-1"))[0]  # type: ignore[no-any-return]


def parse_strace(path: Path) -> list[Call]:
    """Completed calls in the order each thread made them (unfinished/resumed pairs joined)."""
    pending: dict[int, tuple[float, str]] = {}
    calls: list[Call] = []
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        tid, t, rest = int(m.group(1)), float(m.group(2)), m.group(3)
        if rest.startswith("<... "):
            if tid not in pending:
                continue
            t, head = pending.pop(tid)
            rest = head + rest.split("resumed>", 1)[1]
        elif rest.endswith("<unfinished ...>"):
            pending[tid] = (t, rest[: -len("<unfinished ...>")].rstrip())
            continue
        c = _CALL.match(rest)
        if not c:
            continue
        args = c.group(2)
        fd = _FD.match(args)
        fd_path = _unescape(fd.group(1)).decode("utf-8", "replace") if fd else ""
        strings = [_unescape(s) for s in _STR.findall(args[fd.end():] if fd else args)]
        off = _PWRITE_OFFSET.search(args) if c.group(1) == "pwrite64" else None
        calls.append(Call(tid, t, c.group(1), fd_path, strings, int(c.group(3)), int(off.group(1)) if off else None))
    return calls


def sent_messages(calls: list[Call]) -> list[tuple[int, Any]]:
    """(index into calls, message) for each pysyncobj message sent: int32 length + zlib(pickle)."""
    streams: dict[str, bytes] = {}
    out: list[tuple[int, Any]] = []
    for i, call in enumerate(calls):
        if call.name != "sendto" or not call.fd_path.startswith("TCP:") or call.ret <= 0 or not call.strings:
            continue
        buf = streams.get(call.fd_path, b"") + call.strings[0][: call.ret]
        while len(buf) >= 4:
            (size,) = struct.unpack("i", buf[:4])
            if size <= 0 or len(buf) < 4 + size:
                break
            try:
                out.append((i, pickle.loads(zlib.decompress(buf[4:4 + size]))))
            except Exception:  # noqa: BLE001 - a stream we joined mid-frame: resynchronise on the next send
                buf = b""
                break
            buf = buf[4 + size:]
        streams[call.fd_path] = buf
    return out


def durable_meta_writes(calls: list[Call], raft_dir: str) -> list[tuple[int, dict[str, Any]]]:
    """(index of the closing folder fsync, stored state) for each complete durable term/vote store:
    pwrite of raft.journal.meta.tmp -> fsync of it -> rename onto raft.journal.meta -> fsync of the folder,
    in that order on one thread."""
    tmp, final = f"{raft_dir}/raft.journal.meta.tmp", f"{raft_dir}/raft.journal.meta"
    done: list[tuple[int, dict[str, Any]]] = []
    state: dict[int, tuple[str, dict[str, Any]]] = {}  # tid -> (step reached, meta)
    for i, call in enumerate(calls):
        step, meta = state.get(call.tid, ("", {}))
        if call.name == "pwrite64" and call.fd_path == tmp and call.strings:
            state[call.tid] = ("written", json.loads(call.strings[0])["state"])
        elif step == "written" and call.name in SYNCS and call.fd_path == tmp and call.ret == 0:
            state[call.tid] = ("synced", meta)
        elif step == "synced" and call.name.startswith("rename") and call.ret == 0 \
                and [s.decode() for s in call.strings[-2:]] == [tmp, final]:
            state[call.tid] = ("renamed", meta)
        elif step == "renamed" and call.name == "fsync" and call.fd_path == raft_dir and call.ret == 0:
            done.append((i, meta))
            state.pop(call.tid)
    return done


def acks_sent_unsynced(calls: list[Call], journal: str) -> list[Any]:
    """AppendEntries answers sent while journal records were written but not yet committed to disk.

    A commit to disk is what consensus/durable/ does: the header's end offset written after
    the records, then an fdatasync (with a record longer than two sectors, one more before).
    """
    messages = dict(sent_messages(calls))
    pending, header_written, bad = False, False, []
    for i, call in enumerate(calls):
        if call.fd_path == journal and call.name == "pwrite64":
            if call.offset == HEADER_END_OFFSET:
                header_written = True
            else:
                pending, header_written = True, False
        elif call.fd_path == journal and call.name in SYNCS and call.ret == 0 and header_written:
            pending, header_written = False, False
        message = messages.get(i)
        if pending and isinstance(message, dict) and message.get("type") == "next_node_idx":
            bad.append(message)
    return bad


# ------------------------------------------------------------------ helpers
class Tracer:
    def __init__(self, node: DevNode, out: Path) -> None:
        self.node, self.out = node, out
        assert node.proc is not None
        self.proc = subprocess.Popen(
            ["strace", "-f", "-qq", "-ttt", "-yy", "-xx", "-s", "65536",
             "-e", "trace=fsync,fdatasync,msync,pwrite64,rename,renameat,renameat2,sendto",
             "-o", str(out), "-p", str(node.proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )

    def wait_attached(self) -> None:
        # Every link carries a keepalive each 0.3 s, so an attached tracer soon writes a line.
        def attached() -> bool:
            return self.out.exists() and self.out.stat().st_size > 0
        wait_until(attached, 20, what=f"strace on {self.node.server_id}")

    def stop(self) -> list[Call]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # detaches, the traced server keeps running
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return parse_strace(self.out)


def commit(node: DevNode, model: str, parent: int | None) -> int:
    return int(node.call("commit_version", model=model, manifest_id=MANIFEST, parent=parent, publisher="t",
                         nbytes=1, chunk_count=1)["number"])


def commit_once(node: DevNode, model: str) -> bool:
    """Version 1 of ``model`` is committed (by this call, or by an earlier try whose answer was lost)."""
    try:
        commit(node, model, None)
    except Conflict:
        pass
    return True


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "cluster", size=3)
    try:
        c.start()
        yield c
    finally:
        c.close()


# ------------------------------------------------------------------ tests
@needs_strace
def test_every_server_syncs_each_acknowledged_commit_and_stores_votes_before_sending_them(
        cluster: Cluster, tmp_path: Path) -> None:
    leader = cluster.leader()
    parent = None
    for _ in range(5):  # links up, files grown
        parent = commit(leader, "warm", parent)
    tracers = {n.server_id: Tracer(n, tmp_path / f"{n.server_id}.strace") for n in cluster.nodes}
    try:
        for t in tracers.values():
            t.wait_attached()
        windows = []
        parent = None
        for _ in range(40):
            t0 = time.time()
            parent = commit(leader, "traced", parent)
            windows.append((t0, time.time()))
        assert parent == 40

        # An election under the tracers: the leader dies, the other two must vote.
        leader.kill()
        survivor = next(n for n in cluster.alive())
        wait_until(lambda: commit_once(survivor, "after-election"), 60, interval=0.2, what="a commit after election")
    finally:
        traces = {sid: t.stop() for sid, t in tracers.items()}

    def journal_syncs(node: DevNode) -> list[float]:
        journal = str(node.data_dir / "raft.journal")
        return [c.t for c in traces[node.server_id] if c.name in SYNCS and c.fd_path == journal and c.ret == 0]

    def synced_within(node: DevNode, t0: float, t1: float) -> bool:
        return any(t0 <= t <= t1 for t in journal_syncs(node))

    followers = [n for n in cluster.nodes if n is not leader]
    for i, (t0, t1) in enumerate(windows):
        # The leader counts itself only once synced; the quorum's other half acked only once synced.
        assert synced_within(leader, t0, t1), f"leader {leader.server_id} did not sync for commit {i}"
        assert any(synced_within(f, t0, t1) for f in followers), f"no follower synced before commit {i} was acked"
    for node in cluster.nodes:
        # The third server may trail the quorum, but it syncs each commit too.
        during = [t for t in journal_syncs(node) if windows[0][0] <= t <= windows[-1][1] + 1.0]
        assert len(during) >= len(windows), (node.server_id, len(during))
    for node in followers:
        bad = acks_sent_unsynced(traces[node.server_id], str(node.data_dir / "raft.journal"))
        assert not bad, f"{node.server_id} acknowledged entries that were not on disk yet: {bad[:3]}"
        acks = [m for _, m in sent_messages(traces[node.server_id]) if isinstance(m, dict)
                and m.get("type") == "next_node_idx" and m.get("success")]
        assert len(acks) >= len(windows), (node.server_id, len(acks))

    votes_granted = votes_requested = 0
    for node in cluster.nodes:
        if node is leader:
            continue
        calls = traces[node.server_id]
        stored = durable_meta_writes(calls, str(node.data_dir))
        for i, message in sent_messages(calls):
            if not isinstance(message, dict) or message.get("type") not in ("request_vote", "response_vote"):
                continue
            term = message["term"]
            before = [meta for j, meta in stored if j < i and calls[j].tid == calls[i].tid]
            assert before, f"{node.server_id} sent {message['type']} for term {term} before any durable term/vote store"
            last = before[-1]
            assert last["currentTerm"] == term, (node.server_id, message, last)
            if message["type"] == "request_vote":
                votes_requested += 1
                assert last["votedForNodeId"] == node.raft, (node.server_id, last)
            else:
                votes_granted += 1
                assert last["votedForNodeId"] not in (None, node.raft), (node.server_id, last)
    assert votes_requested >= 1 and votes_granted >= 1, "no election was traced"


@needs_strace
def test_no_fsync_makes_no_sync_of_the_raft_state(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster", size=3, extra_args=["--no-fsync"])
    try:
        cluster.start()
        leader = cluster.leader()
        commit(leader, "warm", None)
        tracers = [Tracer(n, tmp_path / f"{n.server_id}.strace") for n in cluster.nodes]
        try:
            for t in tracers:
                t.wait_attached()
            parent = None
            for _ in range(10):
                parent = commit(leader, "fast", parent)
        finally:
            traces = [t.stop() for t in tracers]
    finally:
        cluster.close()
    for calls in traces:
        assert not [c for c in calls if c.name in SYNCS and "raft" in c.fd_path], "--no-fsync still syncs"


def _garbage_meta(data_dir: Path) -> Path:
    data_dir.mkdir(parents=True)
    meta = data_dir / "raft.journal.meta"
    meta.write_bytes(b"\x80\x04\x95garbage that is not a vote")
    return meta


def _one_error_line(stderr: str, meta: Path) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if str(meta) in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_damaged_vote_file_stops_a_devnode_naming_the_file(tmp_path: Path) -> None:
    meta = _garbage_meta(tmp_path / "n0")
    proc = subprocess.run(
        [sys.executable, "-m", "consensus.devnode", "--id", "n0", "--raft", f"127.0.0.1:{free_port()}",
         "--peer", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "n0")],
        cwd=REPO_ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr, meta)
    assert "is damaged" in line and "refusing to start" in line
    assert meta.read_bytes().startswith(b"\x80\x04\x95garbage")  # left as it was, for the operator


def test_a_damaged_vote_file_stops_paramserver_serve_with_exit_1(tmp_path: Path) -> None:
    data = tmp_path / "ps1"
    meta = _garbage_meta(data / "raft")
    proc = subprocess.run(
        [sys.executable, "-m", "paramserver", "serve", "--id", "ps1", "--data-dir", str(data),
         "--listen", f"127.0.0.1:{free_port()}", "--raft", f"127.0.0.1:{free_port()}", "--no-bulk"],
        cwd=REPO_ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1, proc.stderr  # 1: start-up failed (2 is for bad options)
    line = _one_error_line(proc.stderr, meta)
    assert "start-up failed" in line and "is damaged" in line


def test_a_failed_sync_stops_the_node_instead_of_acknowledging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO from fdatasync: the write is not confirmed, the node says why and leaves Raft (no retry)."""
    from consensus import MetadataNode, RaftConfig
    from consensus.errors import Unavailable

    node = MetadataNode(RaftConfig("solo", f"127.0.0.1:{free_port()}", (), tmp_path / "solo", commit_timeout=2.0))
    node.start()
    try:
        assert node.wait_ready(30)
        node.commit_version("m", MANIFEST, None, "p", 1, 1)
        real = os.fdatasync

        def eio(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}").endswith("raft.journal"):
                raise OSError(5, "Input/output error")
            real(fd)

        monkeypatch.setattr(os, "fdatasync", eio)
        with pytest.raises(Unavailable):
            node.commit_version("m", MANIFEST, 1, "p", 1, 1)
        monkeypatch.undo()
        failure = str(node.status()["raft_failure"])
        assert "raft.journal" in failure and "until it is restarted" in failure
        with pytest.raises(Unavailable):  # still stopped: a retried fsync could lie
            node.commit_version("m", MANIFEST, 1, "p", 1, 1)
    finally:
        node.close()
    restarted = MetadataNode(RaftConfig("solo", node.config.raft_address, (), tmp_path / "solo"))
    restarted.start()
    try:
        assert restarted.wait_ready(30)
        numbers = [v.number for v in restarted.list_versions("m").value]
        # The acknowledged write is there; the unconfirmed one may be or not (CommitTimeout says so).
        assert numbers[:1] == [1] and len(numbers) <= 2
    finally:
        restarted.close()


def test_a_compaction_cut_between_the_dump_and_the_journal_keeps_the_entries_after_the_dump(tmp_path: Path) -> None:
    """Log compaction renames the full dump in one tick and rewrites the journal in the next.

    A power loss in between leaves the new dump next to the old journal, which starts before the
    dump's entries; pysyncobj then throws the journal away for the dump's two entries, and with it
    every entry after the dump, acknowledged ones too. Start-up finishes the compaction instead.
    """
    from pysyncobj.syncobj import _COMMAND_TYPE, _bchr

    from consensus import MetadataNode, RaftConfig
    from consensus.durable import DurableJournal, dump_log_tail, parse_journal

    data = tmp_path / "solo"
    address = f"127.0.0.1:{free_port()}"

    def run(compact_after: int, commits: int, parent: int | None) -> int | None:
        node = MetadataNode(RaftConfig("solo", address, (), data, log_compaction_min_entries=compact_after))
        node.start()
        try:
            assert node.wait_ready(30)
            for _ in range(commits):
                parent = node.commit_version("m", MANIFEST, parent, "p", 1, 1).number
            if compact_after < 100:
                journal = data / "raft.journal"  # read, not opened: a DurableJournal would cut the live tail
                wait_until(lambda: (data / "raft.dump").exists()
                           and parse_journal(journal.read_bytes(), str(journal)).entries[0][1] > 1,
                           30, what="a log compaction")
        finally:
            node.close()
        return parent

    parent = run(3, 6, None)  # compacts: a dump, and a journal that starts with its last two entries
    parent = run(10_000, 3, parent)  # three more commits, after the dump, in the journal only
    tail = dump_log_tail(str(data / "raft.dump"))
    assert tail is not None
    j = DurableJournal(str(data / "raft.journal"))
    log = list(j)
    assert log[:2] == list(tail) and log[-1][1] >= tail[1][1] + 3
    # What the power loss leaves: the journal from before its rewrite, starting before the dump.
    j.clear()
    j.add(_bchr(_COMMAND_TYPE.NO_OP), log[0][1] - 1, log[0][2])
    for e in log:
        j.add(*e)
    j.sync()
    j._destroy()

    node = MetadataNode(RaftConfig("solo", address, (), data, log_compaction_min_entries=10_000))
    node.start()
    try:
        assert node.wait_ready(30)
        assert [v.number for v in node.list_versions("m").value] == list(range(1, 10))
    finally:
        node.close()
    final = data / "raft.journal"
    assert parse_journal(final.read_bytes(), str(final)).entries[:2] == list(tail)  # the compaction, finished
