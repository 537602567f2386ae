"""Shared fixtures: free loopback ports and per-test data directories."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

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


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, wait, and SIGKILL if it has not exited by then."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)
