"""Appends whose whole blocks go around the page cache (``O_DIRECT``), the rest through it.

A segment append is a batch of records at an arbitrary offset. Its whole 4 KiB blocks are copied
into one reused, aligned staging buffer and written with ``O_DIRECT`` on a second descriptor of
the file; the partial block at each end goes through the page cache on the file's own
descriptor, so no block is ever written both ways and a block holding an earlier batch's tail is
never rewritten from a stale copy. The file's bytes are exactly what a buffered ``pwritev``
would have left, and ``fdatasync`` on the file's descriptor covers both kinds of write.

Why: a chunk is written once and read back through the server's own cache, so filling the page
cache with it costs kernel time per byte (page allocation, dirty accounting, writeback) and
evicts pages that reads need; ``bench/bench_push.py`` shows what it saves. A file system without
``O_DIRECT`` (tmpfs on older kernels) makes the appender fall back to buffered writes, logged once.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import weakref
from collections.abc import Sequence
from typing import cast

log = logging.getLogger(__name__)

ALIGN = 4096  # covers devices with 512-byte and 4 KiB logical blocks
STAGE_BYTES = 4 << 20  # the aligned staging buffer; a batch's middle goes out in pieces of this
MIN_DIRECT_BYTES = 64 << 10  # batches with fewer whole blocks than this go through the page cache
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def pwrite_all(fd: int, bufs: Sequence[bytes | memoryview], offset: int) -> None:
    """pwritev ``bufs`` at ``offset`` (in groups of IOV_MAX), finishing short writes."""
    i = 0
    while i < len(bufs):
        group: list[bytes | memoryview] = list(bufs[i:i + _IOV_MAX])
        i += len(group)
        while group:
            n = os.pwritev(fd, group, offset)
            offset += n
            while group and n >= len(group[0]):
                n -= len(group[0])
                group.pop(0)
            if group and n:
                group[0] = memoryview(group[0])[n:]


class _Gather:
    """Reads the concatenation of ``bufs`` front to back without joining them."""

    def __init__(self, bufs: Sequence[bytes | memoryview]) -> None:
        self._bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
        self._i = 0
        self._off = 0

    def take(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes as views of the buffers."""
        out: list[memoryview] = []
        while n:
            buf = self._bufs[self._i]
            k = min(n, len(buf) - self._off)
            out.append(buf[self._off:self._off + k])
            n -= k
            self._advance(k)
        return out

    def copy_into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next ``len(dest)`` bytes."""
        pos = 0
        for view in self.take(len(dest)):
            dest[pos:pos + len(view)] = view
            pos += len(view)

    def _advance(self, k: int) -> None:
        self._off += k
        if self._off == len(self._bufs[self._i]):
            self._i += 1
            self._off = 0


def _release(state: list[object]) -> None:
    fd, stage = state
    if isinstance(fd, int) and fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    if isinstance(stage, mmap.mmap):
        try:
            stage.close()
        except BufferError:
            pass  # a view is still alive (an exception's frames hold one): freed with the last of them
    state[0], state[1] = -1, None


class DirectAppender:
    """Writes appends to one file at a time (the active segment); ``enabled`` False: all buffered."""

    def __init__(self, enabled: bool = True, where: str = "") -> None:
        self.enabled = enabled and hasattr(os, "O_DIRECT")
        self.where = where
        self._path: str | None = None
        self._state: list[object] = [-1, None]  # the O_DIRECT descriptor, the staging buffer
        self._finalizer = weakref.finalize(self, _release, self._state)

    def write(self, fd: int, path: str, bufs: Sequence[bytes | memoryview], offset: int) -> None:
        """Write ``bufs`` at ``offset`` of the file open as ``fd`` (named ``path``)."""
        total = sum(len(b) for b in bufs)
        first = -(-offset // ALIGN) * ALIGN
        last = (offset + total) // ALIGN * ALIGN
        if not self.enabled or last - first < MIN_DIRECT_BYTES:
            pwrite_all(fd, bufs, offset)
            return
        dfd = self._descriptor(path)
        if dfd is None:
            pwrite_all(fd, bufs, offset)
            return
        data = _Gather(bufs)
        if first > offset:
            pwrite_all(fd, data.take(first - offset), offset)
        stage = self._stage()
        pos = first
        while pos < last:
            n = min(last - pos, len(stage))
            piece = stage[:n]
            data.copy_into(piece)
            done, refused = self._write_direct(dfd, piece, pos)
            if done < n:  # refused or short: the rest of this piece through the page cache
                pwrite_all(fd, [piece[done:]], pos + done)
            pos += n
            if refused and pos < last:  # its descriptor is closed: the rest of the batch goes buffered
                pwrite_all(fd, data.take(last - pos), pos)
                pos = last
        if offset + total > last:
            pwrite_all(fd, data.take(offset + total - last), last)

    def forget(self, path: str) -> None:
        """Close the O_DIRECT descriptor of ``path`` (sealed, or about to be removed)."""
        if self._path == path:
            self._close_descriptor()

    def close(self) -> None:
        self._path = None
        self._finalizer()

    def _descriptor(self, path: str) -> int | None:
        if self._path == path:  # set only while its descriptor is open
            return cast(int, self._state[0])
        self._close_descriptor()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                self._disable(exc)
                return None
            raise
        self._path, self._state[0] = path, fd
        return fd

    def _stage(self) -> memoryview:
        stage = self._state[1]
        if not isinstance(stage, mmap.mmap):
            stage = mmap.mmap(-1, STAGE_BYTES)  # page-aligned, reused for every append
            self._state[1] = stage
        return memoryview(stage)

    def _write_direct(self, dfd: int, piece: memoryview, pos: int) -> tuple[int, bool]:
        """Bytes of ``piece`` written at ``pos`` with O_DIRECT (whole blocks only), and whether the
        file system refused it (O_DIRECT is then off for good)."""
        done = 0
        try:
            while done < len(piece):
                n = os.pwrite(dfd, piece[done:], pos + done)
                if n <= 0 or n % ALIGN:
                    return done + max(n, 0), False
                done += n
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
            self._disable(exc)
            return done, True
        return done, False

    def _disable(self, exc: OSError) -> None:
        self.enabled = False
        self._close_descriptor()
        log.warning("chunk store: O_DIRECT appends are not supported here (%s); they go through the page cache %s",
                    exc.strerror or exc, self.where)

    def _close_descriptor(self) -> None:
        fd = self._state[0]
        self._path, self._state[0] = None, -1
        if isinstance(fd, int) and fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
