from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import ReadinessTimeout, TensorFailed, UnknownTensor
from worker.readiness import TensorReadiness


def tracker() -> TensorReadiness:
    return TensorReadiness({"embed": [0, 1], "layer0": [1, 2], "head": [3], "empty": []})


def test_tensor_ready_when_its_own_chunks_land() -> None:
    r = tracker()
    assert r.is_ready("empty")
    assert r.mark_landed(0) == []
    assert r.mark_landed(1) == ["embed"]
    r.wait("embed", timeout=0)  # usable before the rest arrives
    assert not r.is_ready("layer0")
    with pytest.raises(ReadinessTimeout, match="layer0"):
        r.wait("layer0", timeout=0)
    assert r.mark_landed(1) == []  # duplicates count once
    assert r.pending() == ["layer0", "head"]
    assert r.mark_landed(2) == ["layer0"]
    with pytest.raises(ReadinessTimeout, match="head"):
        r.wait_all(timeout=0)
    r.mark_landed(3)
    r.wait_all(timeout=0)
    assert r.landed == 4


def test_wait_wakes_when_another_thread_lands_the_chunk() -> None:
    r = tracker()
    done = threading.Event()

    def waiter() -> None:
        r.wait("head", timeout=30)
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    r.mark_landed(3)
    t.join(timeout=30)
    assert done.is_set()


def test_failed_chunk_fails_the_tensors_it_feeds() -> None:
    r = tracker()
    r.mark_landed(0)
    assert sorted(r.mark_failed(1, RuntimeError("no replica can serve chunk 1"))) == ["embed", "layer0"]
    with pytest.raises(TensorFailed, match="no replica"):
        r.wait("embed", timeout=0)
    r.mark_landed(3)
    r.wait("head", timeout=0)
    with pytest.raises(TensorFailed):
        r.wait_all(timeout=0)


def test_on_ready_callbacks_and_unknown_names() -> None:
    r = tracker()
    seen: list[str] = []
    r.on_ready("head", seen.append)
    r.on_ready("empty", seen.append)
    assert seen == ["empty"]
    r.mark_landed(3)
    assert seen == ["empty", "head"]
    with pytest.raises(UnknownTensor, match="not part of this load"):
        r.wait("nope")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=12), max_size=8))
def test_index_sets_are_each_tensors_distinct_sorted_chunks(chunks: list[list[int]]) -> None:
    from worker.readiness import _index_sets

    got = _index_sets([tuple(c) for c in chunks] + [range(3, 9)])
    want = [sorted(set(c)) for c in chunks] + [list(range(3, 9))]
    assert [g.tolist() for g in got] == want
