"""Client work behind the caller's back (a load's heat report, a hot-chunks refresh) runs on
daemon threads; the interpreter's exit waits for them, briefly: a daemon thread still inside a
gRPC call when the interpreter finalizes makes gRPC's core abort the process (status 134)."""
from __future__ import annotations

import threading
import time

import pytest

from paramserver.client import cluster_view
from paramserver.client.cluster_view import _let_background_calls_end, start_background


def test_exit_waits_for_background_calls_to_end() -> None:
    ended = threading.Event()

    def call() -> None:
        time.sleep(0.3)
        ended.set()

    start_background(call, "test-background")
    t0 = time.monotonic()
    _let_background_calls_end()
    assert ended.is_set() and time.monotonic() - t0 < cluster_view.EXIT_GRACE_S


def test_exit_waits_no_longer_than_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_view, "EXIT_GRACE_S", 0.2)
    release = threading.Event()
    thread = start_background(release.wait, "test-stuck")
    t0 = time.monotonic()
    _let_background_calls_end()
    assert 0.15 <= time.monotonic() - t0 < 2.0 and thread.is_alive()
    release.set()
    thread.join(2.0)
