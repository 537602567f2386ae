"""Leader changes are logged: one structured INFO line per change, per node, never one per tick."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from consensus import MetadataNode, RaftConfig

from ..integration.consensus_harness import free_port, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
LINE = re.compile(r"^raft leader changed: term=(\d+) leader=(\S+) self=(\S+)$")


def leader_lines(caplog: pytest.LogCaptureFixture) -> dict[str, list[tuple[int, str]]]:
    """self address -> [(term, leader)] in the order logged."""
    seen: dict[str, list[tuple[int, str]]] = {}
    for r in caplog.records:
        m = LINE.match(r.getMessage())
        if m and r.name == "consensus.node":
            assert r.levelno == logging.INFO
            seen.setdefault(m[3], []).append((int(m[1]), m[2]))
    return seen


def test_every_node_logs_each_leader_change_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="consensus.node")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = [MetadataNode(RaftConfig(f"n{i}", a, tuple(p for p in addresses if p != a), tmp_path / f"n{i}",
                                     fsync=False)) for i, a in enumerate(addresses)]
    try:
        for n in nodes:
            n.start()
        assert all(n.wait_ready(30) for n in nodes)
        first = next(n for n in nodes if n.is_leader())
        wait_until(lambda: set(leader_lines(caplog)) == set(addresses), 10, what="a leader line from every node")
        for me, lines in leader_lines(caplog).items():
            assert lines[-1][1] == first.config.raft_address, (me, lines)
        new = first.transfer_leadership()
        wait_until(lambda: all(lines[-1][1] == new for lines in leader_lines(caplog).values()), 10,
                   what="every node logging the new leader")
        for me, lines in leader_lines(caplog).items():
            # Only changes are logged: never the same leader twice in a row, terms never go back.
            assert all(a[1] != b[1] for a, b in zip(lines, lines[1:])), (me, lines)
            assert [t for t, _ in lines] == sorted(t for t, _ in lines), (me, lines)
            assert len(lines) <= 6, (me, lines)  # two changes (and a leaderless moment or two), not a line per tick
    finally:
        for n in nodes:
            n.close()
