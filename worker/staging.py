"""Reused staging buffers and the copier that moves bytes from them into destination tensors.

With CUDA the buffers are pinned host memory and copies into GPU tensors run ``non_blocking`` on
a side stream; a buffer goes back to the pool only once a CUDA event recorded after its copies has
completed, so a fetch can never overwrite bytes still being copied. Without CUDA the same calls
run on plain memory and copies complete immediately. Everything works on flat ``uint8`` views so
the dtype of the destination does not matter.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from worker.config import PrefetchConfig
from worker.errors import BufferTooSmall, StagingTimeout


class Fence(Protocol):
    """Completion of asynchronous work: a CUDA event, or nothing (already complete)."""

    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class CopyFence:
    """Marks the end of a batch of copies. ``event`` is None when the copies were synchronous."""

    event: Any | None = None  # torch.cuda.Event

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def synchronize(self) -> None:
        """Block the host until the copies are done."""
        if self.event is not None:
            self.event.synchronize()

    def wait_on_stream(self, stream: Any | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait for the copies, without blocking the host."""
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)


COMPLETED = CopyFence()


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's bytes (any dtype, 0-d and empty included)."""
    if not tensor.is_contiguous():
        raise ValueError("destination tensor is not contiguous; allocate it with torch.empty(...) or call .contiguous()")
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(-1).view(torch.uint8)


class StagingBuffer:
    """One fixed-size host buffer on loan from a ``StagingPool``."""

    __slots__ = ("tensor", "_array", "pool", "slot", "_out")

    def __init__(self, tensor: torch.Tensor, pool: StagingPool, slot: int) -> None:
        self.tensor = tensor
        self._array = tensor.numpy()  # shares memory, pinned or not
        self.pool = pool
        self.slot = slot
        self._out = False

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel())

    def view(self, offset: int, length: int) -> torch.Tensor:
        """``uint8`` tensor view of ``length`` bytes at ``offset`` (no copy)."""
        self._check(offset, length)
        return self.tensor[offset : offset + length]

    def array(self, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Writable numpy view, e.g. for ``readinto``/decompressing straight into the buffer."""
        length = self.nbytes - offset if length is None else length
        self._check(offset, length)
        return self._array[offset : offset + length]

    def write(self, offset: int, data: bytes | bytearray | memoryview | np.ndarray) -> int:
        """Copy ``data`` into the buffer at ``offset``; returns the bytes written."""
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
        self._check(offset, src.size)
        self._array[offset : offset + src.size] = src
        return int(src.size)

    def release(self, fence: Fence | None = None) -> None:
        self.pool.release(self, fence)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise BufferTooSmall(
                f"{length} bytes at offset {offset} do not fit a {self.nbytes}-byte staging buffer; "
                "raise PrefetchConfig.staging_buffer_bytes above the chunk size"
            )


class StagingPool:
    """A bounded pool of reused staging buffers; ``acquire`` blocks when all are out (back-pressure).

    Buffers are allocated lazily up to ``count`` and pinned when ``pin`` is True (default: when
    CUDA is available). A buffer released with an unfinished fence is reused only after the fence
    completes; when nothing else is free, ``acquire`` waits for the oldest such fence.
    """

    def __init__(self, buffer_bytes: int, count: int, pin: bool | None = None) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(f"a staging pool needs buffer_bytes > 0 and count > 0, got {buffer_bytes} and {count}")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._cond = threading.Condition()
        self._buffers: list[StagingBuffer] = []
        self._free: list[StagingBuffer] = []
        self._pending: deque[tuple[StagingBuffer, Fence]] = deque()
        self.acquire_waits = 0

    @classmethod
    def from_config(cls, config: PrefetchConfig, pin: bool | None = None) -> StagingPool:
        config.validate()
        return cls(config.staging_buffer_bytes, config.staging_buffers, pin=pin)

    def acquire(self, timeout: float | None = None) -> StagingBuffer:
        deadline = None if timeout is None else time.monotonic() + timeout
        waited = False
        while True:
            with self._cond:
                buf = self._take_locked()
                if buf is not None:
                    return buf
                if not waited:
                    waited = True
                    self.acquire_waits += 1
                oldest = self._pending[0][1] if self._pending else None
                if oldest is None:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise StagingTimeout(timeout or 0.0, self.count, self.buffer_bytes)
                    self._cond.wait(remaining)
                    continue
            # Copies finish in bounded time: block on the oldest outside the lock.
            oldest.synchronize()

    def release(self, buf: StagingBuffer, fence: Fence | None = None) -> None:
        """Return ``buf``; with a fence, it is reused only after the fence completes."""
        if buf.pool is not self:
            raise ValueError("staging buffer released to a pool it does not belong to")
        with self._cond:
            if not buf._out:
                raise ValueError(f"staging buffer {buf.slot} released twice")
            buf._out = False
            if fence is None or fence.done():
                self._free.append(buf)
            else:
                self._pending.append((buf, fence))
            self._cond.notify()

    @property
    def in_use(self) -> int:
        """Buffers on loan or waiting for their copies."""
        with self._cond:
            return len(self._buffers) - len(self._free)

    @property
    def allocated(self) -> int:
        return len(self._buffers)

    def _take_locked(self) -> StagingBuffer | None:
        while self._pending and self._pending[0][1].done():
            self._free.append(self._pending.popleft()[0])
        if not self._free and len(self._buffers) < self.count:
            tensor = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pinned)
            buf = StagingBuffer(tensor, self, len(self._buffers))
            self._buffers.append(buf)
            self._free.append(buf)
        if not self._free:
            return None
        buf = self._free.pop()
        buf._out = True
        return buf


class Copier:
    """Copies staged bytes into destination tensors: async on a side CUDA stream, plain on CPU."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.stream: Any | None = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy ``src`` (uint8 staging view) into ``dst`` (uint8 view of the destination)."""
        self.copy_many(((src, dst),))

    def copy_many(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``copy`` of each ``(src, dst)``, entering the side stream once for all of them (a copy
        into a CUDA tensor is asynchronous there; any other is plain)."""
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for src, dst in pairs:
                if src.numel() != dst.numel():
                    raise BufferTooSmall(f"copy of {src.numel()} bytes into a {dst.numel()}-byte destination")
                dst.copy_(src, non_blocking=dst.is_cuda)

    def fence(self) -> CopyFence:
        """A fence that completes when every copy issued so far has completed."""
        if self.stream is None:
            return COMPLETED
        event = torch.cuda.Event()
        event.record(self.stream)
        return CopyFence(event)

    def copy_from(self, buffer: StagingBuffer, copies: Iterable[tuple[int, torch.Tensor]], release: bool = True) -> CopyFence:
        """Copy ``(offset in buffer, destination uint8 view)`` pairs, then release the buffer
        behind a fence so it is reused only after the copies complete. Returns the fence."""
        if self.stream is not None:
            # Destinations were allocated (and maybe zeroed) on the current stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for offset, dst in copies:
            self.copy(buffer.view(offset, int(dst.numel())), dst)
        fence = self.fence()
        if release:
            buffer.release(fence)
        return fence

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
