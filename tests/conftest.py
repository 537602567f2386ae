"""Shared fixtures: free loopback ports and per-test data directories."""
from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago; callers bind it soon after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def port_factory() -> Iterator[object]:
    taken: set[int] = set()

    def make() -> int:
        for _ in range(100):
            p = free_port()
            if p not in taken:
                taken.add(p)
                return p
        raise RuntimeError("no free loopback port found after 100 tries")

    yield make
