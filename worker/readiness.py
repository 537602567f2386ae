"""Per-tensor readiness: each tensor becomes usable as soon as its own chunks have landed.

The loader marks chunk indices as landed (with the fence of the copy that wrote them); a tensor
is ready once every chunk feeding it has landed. ``wait`` blocks the host until then and, on
CUDA, also orders the caller's stream after the copy stream, so a model can run its first
layers while later chunks are still in flight.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping

from worker.errors import ReadinessTimeout, TensorFailed, UnknownTensor
from worker.staging import CopyFence


class _TensorState:
    __slots__ = ("remaining", "event", "fence", "error")

    def __init__(self, chunks: int) -> None:
        self.remaining = chunks
        self.event = threading.Event()
        self.fence: CopyFence | None = None  # latest copy fence; copies on one stream complete in order
        self.error: BaseException | None = None
        if chunks == 0:
            self.event.set()


class TensorReadiness:
    """Tracks which tensors of one load are complete. Thread-safe."""

    def __init__(self, tensor_chunks: Mapping[str, Iterable[int]]) -> None:
        self._lock = threading.Lock()
        self._tensors: dict[str, _TensorState] = {}
        self._feeds: dict[int, list[str]] = {}
        self._landed: set[int] = set()
        self._callbacks: dict[str, list[Callable[[str], None]]] = {}
        for name, chunks in tensor_chunks.items():
            indices = set(chunks)
            self._tensors[name] = _TensorState(len(indices))
            for index in indices:
                self._feeds.setdefault(index, []).append(name)

    def mark_landed(self, index: int, fence: CopyFence | None = None) -> list[str]:
        """Record that chunk ``index`` is in place; returns the tensors that became ready."""
        ready: list[str] = []
        with self._lock:
            if index in self._landed:
                return ready  # a duplicate landing (retry, or a chunk id used twice) counts once
            self._landed.add(index)
            for name in self._feeds.get(index, ()):
                state = self._tensors[name]
                if fence is not None and fence.event is not None:
                    state.fence = fence
                state.remaining -= 1
                if state.remaining == 0 and state.error is None:
                    ready.append(name)
            callbacks = [(name, cb) for name in ready for cb in self._callbacks.pop(name, ())]
            # Set under the lock so on_ready cannot register a callback that is never run.
            for name in ready:
                self._tensors[name].event.set()
        for name, cb in callbacks:
            cb(name)
        return ready

    def mark_failed(self, index: int, error: BaseException) -> list[str]:
        """Chunk ``index`` cannot be delivered: every tensor it feeds fails with ``error``."""
        with self._lock:
            names = [n for n in self._feeds.get(index, ()) if self._tensors[n].error is None]
            for name in names:
                self._tensors[name].error = error
                self._callbacks.pop(name, None)
                self._tensors[name].event.set()
        return names

    def on_ready(self, name: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(name)`` once the tensor is ready (immediately if it already is)."""
        state = self._state(name)
        with self._lock:
            if not state.event.is_set():
                self._callbacks.setdefault(name, []).append(callback)
                return
            if state.error is not None:
                return
        callback(name)

    def is_ready(self, name: str) -> bool:
        state = self._state(name)
        return state.event.is_set() and state.error is None

    def wait(self, name: str, timeout: float | None = None, stream: object | None = None) -> None:
        """Block until ``name`` is ready; on CUDA the caller's stream (or ``stream``) is ordered
        after its copies. Raises ``ReadinessTimeout`` or ``TensorFailed``."""
        state = self._state(name)
        if not state.event.wait(timeout):
            raise ReadinessTimeout([name], timeout, state.remaining)
        self._finish(name, state, stream)

    def wait_all(self, timeout: float | None = None, stream: object | None = None) -> None:
        """Block until every tensor is ready, with one overall deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name, state in self._tensors.items():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not state.event.wait(remaining):
                late = [n for n, s in self._tensors.items() if not s.event.is_set()]
                missing = sum(s.remaining for s in self._tensors.values() if not s.event.is_set())
                raise ReadinessTimeout(late, timeout, missing)
            self._finish(name, state, stream)

    def pending(self) -> list[str]:
        """Tensors not ready yet, in mapping order."""
        return [n for n, s in self._tensors.items() if not s.event.is_set()]

    @property
    def landed(self) -> int:
        return len(self._landed)

    def _state(self, name: str) -> _TensorState:
        state = self._tensors.get(name)
        if state is None:
            raise UnknownTensor(name)
        return state

    def _finish(self, name: str, state: _TensorState, stream: object | None) -> None:
        if state.error is not None:
            raise TensorFailed(name, state.error)
        if state.fence is not None:
            state.fence.wait_on_stream(stream)
