"""ENOSPC under the Raft journal (issue 11, item 6, second half).

Before: the write failed with a traceback, the node stayed leader, and later truncated entries it
had already applied. Now: the first failed write or sync of the journal or of the term/vote file
makes the node step down and leave Raft for good; ``MetadataNode.failure()`` names the file and
the error (the server process polls it and exits); writes are refused at once with RaftStopped;
the others elect and go on; restarted with space, the node has every acknowledged commit.

Two ways to fill the disk: the journal's write seam (``consensus.durable.files.write_fault``) for one
server of three, and, as root, a real 1 MiB tmpfs under a single server (skipped elsewhere).
"""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

import consensus.durable as durable
import consensus.durable.files  # noqa: F401 - the write_fault seam lives there
from consensus import MetadataNode, RaftConfig, RaftStopped, Unavailable

from ..integration.consensus_harness import free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
MANIFEST = "ef" * 32


def no_divergence_and_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r.getMessage() for r in caplog.records
           if "already-applied" in r.getMessage() or "diverged" in r.getMessage() or r.exc_info]
    assert not bad, bad


def check_stopped(node: MetadataNode) -> str:
    failure = node.failure()
    assert failure is not None and "No space left on device" in failure and "raft.journal" in failure, failure
    assert "\n" not in failure
    assert not node.is_leader() and node.leader_raft_address() is None and not node.status()["is_leader"]
    assert node.status()["raft_failure"] == failure
    started = time.monotonic()
    with pytest.raises(RaftStopped, match="No space left on device"):
        node.commit_version("m", MANIFEST, None, "p", 1, 1, force=True)
    with pytest.raises(RaftStopped):
        node.list_models()
    assert time.monotonic() - started < 1.0  # refused at once, not at the commit timeout
    return failure


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[MetadataNode]]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = [MetadataNode(RaftConfig(f"n{i}", a, tuple(p for p in addresses if p != a), tmp_path / f"n{i}",
                                     commit_timeout=3.0)) for i, a in enumerate(addresses)]
    try:
        for n in nodes:
            n.start()
        assert all(n.wait_ready(30) for n in nodes)
        yield nodes
    finally:
        durable.files.write_fault = None
        for n in nodes:
            n.close()


def test_enospc_on_the_leaders_journal_makes_it_step_down_and_stop(
        trio: list[MetadataNode], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    leader = next(n for n in trio if n.is_leader())
    others = [n for n in trio if n is not leader]
    acked = [leader.commit_version("m", MANIFEST, None, "p", 1, 1).number]
    assert leader.failure() is None
    full = str(leader.config.data_dir) + os.sep

    def disk_full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(durable.files, "write_fault", disk_full)
    with pytest.raises(Unavailable):  # RaftStopped, or NotLeader if the others were quicker
        leader.commit_version("m", MANIFEST, acked[-1], "p", 1, 1)
    failure = check_stopped(leader)
    assert full in failure
    assert any(r.levelno == logging.CRITICAL and "Raft stopped on this server" in r.getMessage() for r in caplog.records)
    # The other two elect without it and go on committing.
    new_leader = wait_until(lambda: next((n for n in others if n.is_leader()), None), 15, what="a new leader")
    head = new_leader.head("m", linearizable=True).value
    assert head is not None
    acked.append(new_leader.commit_version("m", MANIFEST, head.number, "p", 1, 1).number)
    assert leader.failure() == failure  # sticky: never cleared by a write that happens to work
    monkeypatch.setattr(durable.files, "write_fault", None)
    assert leader.failure() == failure
    # Restarted (space is back), it catches up and has every acknowledged commit.
    leader.close()
    assert leader.failure() == failure  # outlives close(), for the process to report
    restarted = MetadataNode(leader.config)
    trio[trio.index(leader)] = restarted
    restarted.start()
    assert restarted.failure() is None and restarted.wait_ready(30)
    wait_until(lambda: {v.number for v in restarted.list_versions("m").value} >= set(acked), 15,
               what="every acknowledged version on the restarted node")
    no_divergence_and_no_traceback(caplog)


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """None once mounted; else why not."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs"
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=10)
    return None if proc.returncode == 0 else f"cannot mount a tmpfs: {proc.stderr.strip()}"


def _fill(path: Path, limit: int = 4 << 20) -> int:
    """Write a file until the file system is full (at most ``limit`` bytes); the bytes written."""
    written = 0
    block = bytes(4096)
    with open(path, "wb", buffering=0) as f:
        while written < limit:
            try:
                f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
            written += len(block)
    return written


def test_a_real_full_disk_under_a_single_server_stops_it_cleanly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mnt = tmp_path / "tmpfs"
    why = _mount_tmpfs(mnt, "1m")
    if why is not None:
        pytest.skip(why)
    caplog.set_level(logging.WARNING)
    config = RaftConfig("solo", f"127.0.0.1:{free_port()}", (), mnt / "raft", commit_timeout=2.0)
    node: MetadataNode | None = None
    try:
        node = MetadataNode(config)
        node.start()
        assert node.wait_ready(20)
        acked = [node.commit_version("m", MANIFEST, None, "p", 1, 1).number]
        filler = mnt / "filler"
        assert _fill(filler) > 0
        deadline = time.monotonic() + 20
        while node.failure() is None and time.monotonic() < deadline:
            try:  # appends land in the journal's zero-filled space until it must grow; the term file needs a block
                acked.append(node.commit_version("m", MANIFEST, acked[-1], "p", 1, 1).number)
            except Unavailable:
                break
        wait_until(node.failure, 5, what="the node noticing the full disk")
        check_stopped(node)
        node.close()
        filler.unlink()
        node = MetadataNode(config)
        node.start()
        assert node.wait_ready(20)
        numbers = [v.number for v in node.list_versions("m").value]
        # Every acknowledged commit survived; an unconfirmed one may be there or not.
        assert numbers[:len(acked)] == acked and len(numbers) <= len(acked) + 1, (numbers, acked)
        no_divergence_and_no_traceback(caplog)
    finally:
        if node is not None:
            node.close()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)
