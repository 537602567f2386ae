"""ClusterClient.hot_chunks: asked in the background; only a client's first ask is waited for, and
only briefly; prepare_fetch starts that ask early. No sockets: a stand-in view answers."""
from __future__ import annotations

import threading
import time

from paramserver.client.session import ClusterClient, SessionConfig


class View:
    def __init__(self, delay_s: float, answer: dict[str, tuple[str, ...]]) -> None:
        self.delay_s = delay_s
        self.answer = answer
        self.asked = 0
        self.lock = threading.Lock()

    def hot_chunks(self, timeout_s: float) -> dict[str, tuple[str, ...]]:
        with self.lock:
            self.asked += 1
        time.sleep(self.delay_s)
        return self.answer


def client(**kw: float) -> ClusterClient:
    # A seed nobody listens on: nothing here connects (the stand-in view answers).
    return ClusterClient("127.0.0.1:9", config=SessionConfig(hot_timeout_s=0.2, **kw))


def test_the_first_answer_is_waited_for_and_later_ones_come_from_the_last_ask() -> None:
    c = client(hot_refresh_s=60.0)
    view = View(0.02, {"c1": ("ps2",)})
    try:
        assert c.hot_chunks(view) == {"c1": ("ps2",)}
        view.answer = {"c2": ("ps3",)}
        assert c.hot_chunks(view) == {"c1": ("ps2",)}  # fresh enough: not asked again
        assert view.asked == 1
    finally:
        c.close()


def test_a_slow_first_ask_costs_a_load_at_most_twice_the_timeout() -> None:
    c = client()
    view = View(1.5, {"c1": ("ps2",)})
    try:
        t0 = time.monotonic()
        assert c.hot_chunks(view) == {}
        assert time.monotonic() - t0 < 1.0
        assert c.hot_chunks(view, wait=False) == {}  # still asking: no second ask, no wait
        assert view.asked == 1
    finally:
        c.close()


def test_prepare_fetch_asks_early_so_the_fetch_finds_the_answer() -> None:
    c = client(hot_refresh_s=60.0)
    view = View(0.05, {"c1": ("ps2",)})
    try:
        assert c.hot_chunks(view, wait=False) == {}  # what prepare_fetch does: start, do not wait
        time.sleep(0.2)
        t0 = time.monotonic()
        assert c.hot_chunks(view) == {"c1": ("ps2",)}
        assert time.monotonic() - t0 < 0.15  # no wait (the first-ask wait is 0.4 s)
        assert view.asked == 1
    finally:
        c.close()


def test_a_stale_answer_is_returned_at_once_while_a_new_ask_runs() -> None:
    c = client(hot_refresh_s=0.05)
    view = View(0.0, {"c1": ("ps2",)})
    try:
        assert c.hot_chunks(view) == {"c1": ("ps2",)}
        time.sleep(0.1)
        view.answer, view.delay_s = {"c2": ("ps3",)}, 0.3
        t0 = time.monotonic()
        assert c.hot_chunks(view) == {"c1": ("ps2",)}
        assert time.monotonic() - t0 < 0.25  # the new ask takes 0.3 s; this call did not wait for it
        deadline = time.monotonic() + 3.0
        while c.hot_chunks(view, wait=False) != {"c2": ("ps3",)} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.hot_chunks(view, wait=False) == {"c2": ("ps3",)}
    finally:
        c.close()


def test_a_closed_client_neither_asks_nor_waits() -> None:
    c = client()
    c.close()
    view = View(1.0, {"c1": ("ps2",)})
    t0 = time.monotonic()
    assert c.hot_chunks(view) == {}
    c.prepare_fetch()
    assert time.monotonic() - t0 < 0.3  # a first ask would have waited 0.4 s
    assert view.asked == 0


def test_a_failing_ask_counts_as_no_hot_chunks_and_is_retried_later() -> None:
    class Broken(View):
        def hot_chunks(self, timeout_s: float) -> dict[str, tuple[str, ...]]:
            super().hot_chunks(timeout_s)
            raise RuntimeError("member gone")

    c = client(hot_refresh_s=0.05)
    view = Broken(0.0, {})
    try:
        assert c.hot_chunks(view) == {}
        time.sleep(0.1)
        c.hot_chunks(view)
        deadline = time.monotonic() + 3.0
        while view.asked < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert view.asked >= 2
    finally:
        c.close()
