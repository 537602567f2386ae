"""Shared fixtures: free loopback ports and per-test data directories."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.local import free_port  # the one helper; tests import it from here too


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
