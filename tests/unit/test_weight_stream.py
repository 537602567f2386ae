"""worker.weight_stream: tensors handed over in the order they complete, each once, failures raised.

Pure logic over the real readiness tracker (worker.readiness.TensorReadiness) and a stand-in for
the load handle; the real load path is covered by tests/integration/test_vllm.py."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from worker.errors import TensorFailed
from worker.readiness import TensorReadiness
from worker.weight_stream import WeightStream


class FakeHandle:
    """What WeightStream uses of a LoadHandle: readiness, manifest.tensors, tensors, done(), result(), info."""

    def __init__(self, chunks: dict[str, list[int]]) -> None:
        self.readiness = TensorReadiness(chunks)
        self.manifest = SimpleNamespace(tensors=[SimpleNamespace(name=n) for n in chunks])
        self.tensors = {n: torch.full((2,), float(i)) for i, n in enumerate(chunks)}
        self.info = SimpleNamespace(model="m", number=1)
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def result(self, timeout: float | None = None) -> tuple[dict[str, torch.Tensor], Any]:
        self.finished.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.tensors, "report"


def land_later(handle: FakeHandle, order: list[int], fail: int | None = None) -> threading.Thread:
    def go() -> None:
        for index in order:
            time.sleep(0.01)
            if index == fail:
                handle.readiness.mark_failed(index, OSError("no replica"))
                handle.error = OSError("no replica")
                break
            handle.readiness.mark_landed(index)
        handle.finished.set()

    t = threading.Thread(target=go)
    t.start()
    return t


def test_tensors_come_in_the_order_their_chunks_land_each_once() -> None:
    # b's chunks land first (the heatmap said so), then c, then a; "empty" has no chunk: ready at once.
    handle = FakeHandle({"a": [0, 1], "b": [2], "c": [3, 4], "empty": []})
    stream = WeightStream(handle)  # type: ignore[arg-type]
    t = land_later(handle, [2, 3, 4, 0, 1])
    got = [name for name, _ in stream]
    t.join()
    assert got == ["empty", "b", "c", "a"]
    assert stream.report == "report"


def test_a_tensor_that_completed_before_the_iteration_is_not_lost() -> None:
    handle = FakeHandle({"a": [0], "b": [1]})
    stream = WeightStream(handle)  # type: ignore[arg-type]
    handle.readiness.mark_landed(1)  # before anyone iterates
    t = land_later(handle, [0])
    got = dict(stream)
    t.join()
    assert list(got) == ["b", "a"] and got["a"] is handle.tensors["a"]


def test_a_failed_chunk_ends_the_iteration_with_the_loads_error() -> None:
    handle = FakeHandle({"a": [0], "b": [1], "c": [2]})
    stream = WeightStream(handle)  # type: ignore[arg-type]
    t = land_later(handle, [0, 1, 2], fail=1)
    got = []
    with pytest.raises((OSError, TensorFailed)):
        for name, _ in stream:
            got.append(name)
    t.join()
    assert got == ["a"]


def test_it_iterates_once() -> None:
    handle = FakeHandle({"a": []})
    handle.finished.set()
    stream = WeightStream(handle)  # type: ignore[arg-type]
    assert [n for n, _ in stream] == ["a"]
    with pytest.raises(RuntimeError, match="iterated once"):
        list(stream)


def test_a_stuck_load_times_out_with_what_is_left() -> None:
    handle = FakeHandle({"a": [0], "b": [1]})
    stream = WeightStream(handle, timeout_s=0.5)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError, match="2 of 2 still loading"):
        list(stream)
