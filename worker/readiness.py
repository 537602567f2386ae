"""Per-tensor readiness: each tensor becomes usable as soon as its own chunks have landed.

The loader marks chunk indices as landed (with the fence of the copy that wrote them); a tensor
is ready once every chunk feeding it has landed. ``wait`` blocks the host until then and, on
CUDA, also orders the caller's stream after the copy stream, so a model can run its first
layers while later chunks are still in flight.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from worker.errors import ReadinessTimeout, TensorFailed, UnknownTensor
from worker.staging import CopyFence


def _index_sets(chunks: list[Iterable[int]]) -> list[np.ndarray]:
    """Each tensor's distinct chunk indices, sorted. A tensor's chunks are almost always one
    increasing run (``ChunkPlan.tensor_chunks``): those are taken as they are, from one array of
    all of them, and only the others go through ``np.unique``."""
    seqs = [c if isinstance(c, (tuple, list, range, np.ndarray)) else list(c) for c in chunks]
    lens = np.fromiter((len(c) for c in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    if not len(flat):
        return [flat for _ in seqs]
    ends = np.cumsum(lens)
    starts = ends - lens
    # breaks[i]: how many steps other than +1 lie before position i
    breaks = np.zeros(len(flat), dtype=np.int64)
    np.cumsum(np.diff(flat) != 1, out=breaks[1:])
    top = len(flat) - 1
    run = (lens <= 1) | (breaks[np.minimum(ends - 1, top)] == breaks[np.minimum(starts, top)])
    return [flat[s:e] if r else np.unique(flat[s:e]) for s, e, r in zip(starts.tolist(), ends.tolist(), run.tolist())]


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
        self._callbacks: dict[str, list[Callable[[str], None]]] = {}
        self._listeners: list[Callable[[list[str]], None]] = []
        # Which tensors each chunk feeds, without a list per chunk (a model of 4 KiB chunks has half
        # a million): a tensor's chunks are a run of indices, so a chunk that feeds one tensor
        # names it in ``_owner``; the few shared by several (-2 there) are listed in ``_shared``.
        self._names = list(tensor_chunks)
        sets = _index_sets([tensor_chunks[name] for name in self._names])
        for name, indices in zip(self._names, sets):
            if len(indices) and indices[0] < 0:
                raise ValueError(f"tensor {name!r} names a negative chunk index")
            self._tensors[name] = _TensorState(len(indices))
        n = max((int(ix[-1]) + 1 for ix in sets if len(ix)), default=0)
        count = np.zeros(n, dtype=np.int32)
        owner = np.full(n, -1, dtype=np.int64)
        for k, ix in enumerate(sets):
            if len(ix) and int(ix[-1]) - int(ix[0]) + 1 == len(ix):
                count[ix[0] : ix[-1] + 1] += 1
                owner[ix[0] : ix[-1] + 1] = k
            else:
                count[ix] += 1
                owner[ix] = k
        self._shared: dict[int, list[str]] = {}
        if n and (count > 1).any():
            shared = count > 1
            owner[shared] = -2
            for k, ix in enumerate(sets):
                for index in ix[shared[ix]].tolist():
                    self._shared.setdefault(index, []).append(self._names[k])
        self._owner = owner
        self._landed = np.zeros(n, dtype=bool)
        self._landed_count = 0

    def _feeds(self, index: int) -> list[str] | tuple[str, ...]:
        """The tensors chunk ``index`` feeds (called with the lock held)."""
        if not 0 <= index < len(self._owner):
            return ()
        k = int(self._owner[index])
        if k >= 0:
            return (self._names[k],)
        return self._shared.get(index, ()) if k == -2 else ()

    def mark_landed(self, index: int, fence: CopyFence | None = None) -> list[str]:
        """Record that chunk ``index`` is in place; returns the tensors that became ready."""
        return self.mark_landed_many((index,), fence)

    def mark_landed_many(self, indices: Iterable[int] | np.ndarray, fence: CopyFence | None = None) -> list[str]:
        """``mark_landed`` of each index (a batch that landed together) under one acquisition of the
        lock, counted per tensor with array operations."""
        rows = indices if isinstance(indices, np.ndarray) else np.fromiter(indices, dtype=np.int64)
        rows = rows[(rows >= 0) & (rows < len(self._owner))]
        ready: list[str] = []
        with self._lock:
            tensors, names = self._tensors, self._names
            new = rows[~self._landed[rows]]  # a duplicate landing (retry, or a chunk id used twice) counts once
            if len(new) > 1:
                new = np.unique(new)
            self._landed[new] = True
            self._landed_count += len(new)
            owners = self._owner[new]
            fed: dict[str, int] = {}
            single = owners[owners >= 0]
            if len(single):
                if int(single.min()) == int(single.max()):
                    fed[names[int(single[0])]] = len(single)
                else:
                    counts = np.bincount(single)
                    for k in np.flatnonzero(counts).tolist():
                        fed[names[k]] = int(counts[k])
            for index in new[owners == -2].tolist():
                for name in self._shared.get(index, ()):
                    fed[name] = fed.get(name, 0) + 1
            fenced = fence is not None and fence.event is not None
            for name, n in fed.items():
                state = tensors[name]
                if fenced:
                    state.fence = fence
                state.remaining -= n
                if state.remaining == 0 and state.error is None:
                    ready.append(name)
            callbacks = [(name, cb) for name in ready for cb in self._callbacks.pop(name, ())] if ready else []
            # Set under the lock so on_ready cannot register a callback that is never run.
            for name in ready:
                tensors[name].event.set()
        for name, cb in callbacks:
            cb(name)
        if ready:
            for listener in self._listeners:
                listener(ready)
        return ready

    def mark_failed(self, index: int, error: BaseException) -> list[str]:
        """Chunk ``index`` cannot be delivered: every tensor it feeds fails with ``error``."""
        with self._lock:
            names = [n for n in self._feeds(index) if self._tensors[n].error is None]
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

    def listen(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener(names)`` with the tensors each landing made ready, all of them at once
        (register it before anything lands: tensors ready before are not reported)."""
        self._listeners.append(listener)

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
        return self._landed_count

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
