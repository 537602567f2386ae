"""Host memory for pulled tensors: one huge-page arena per pull, prefaulted, recycled once released.

Why: a pull writes every byte of a model into memory nobody has touched yet, and the kernel
zeroes each fresh page on first touch. Measured here (1 GiB, loopback, 2 cores) that zeroing
was the largest single cost of the client, about 0.25 ns/B (a third of its CPU), more than
receiving and CRC-checking the bytes together. So:

* the tensors of one pull are carved out of one anonymous mapping (an *arena*), on
  transparent huge pages where the OS offers them (a 2 MiB fault and zeroing instead of 512),
  except in a virtual machine whose balloon reports free pages to the host in blocks of a huge
  page or less (``free_page_reporting``): there the kernel hands a huge-page fault a block the
  host has already taken back, and every such fault waits for the host to supply 2 MiB again,
  while small pages mostly come from recently freed memory that was never reported;
* a fresh arena is faulted in ahead of the receivers by a thread that holds no GIL
  (``MADV_POPULATE_WRITE``), so zeroing overlaps the network;
* when every tensor of an arena is gone (the caller dropped them), the arena goes back to a
  small pool; the next pull of a model that fits reuses it and skips the zeroing altogether,
  the way a caching allocator does (PyTorch's CUDA allocator keeps freed blocks for the same
  reason). A rolling update pulls version after version of the same shapes, so it hits.

Reuse is safe because a pull overwrites every byte of every tensor before returning them
(the assembler refuses to finish otherwise) and the arena was this process's own memory.
Released arenas are kept at most ``keep_bytes`` in all and ``keep_seconds`` each, then
unmapped, so dropping a model gives its memory back to the OS within about that time.

An arena is "in use" while any tensor (or view) made from it is alive: each holds a buffer
export of the arena's ``mmap`` object, hence a reference to it. The pool holds exactly one;
an arena whose reference count is back to the pool's own is free.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from chunking.dtypes import torch_dtype
from chunking.manifest import Manifest

from paramserver.client.errors import ConfigError

# Tensors at least this large start on a page boundary (so prefaulting and huge pages line up);
# smaller ones are packed at cache-line alignment.
PAGE_ALIGNED_BYTES = 1 << 20
SMALL_ALIGN = 64
# An arena is only reused for a request at least this fraction of its size: a small model
# must not pin a huge arena that a large one could use.
MIN_FILL = 0.5

_VIRTIO_ID_BALLOON = 0x0005
_VIRTIO_BALLOON_F_REPORTING = 5  # feature bit: the guest reports free page blocks, the host discards them


def free_page_reporting(sys_root: Path = Path("/sys")) -> str | None:
    """Why huge pages do not pay off on this machine, or None.

    A virtio balloon with free page reporting (Firecracker, QEMU ``free-page-reporting=on``)
    hands every free block of ``page_reporting_order`` or more back to the host. A huge-page fault
    takes exactly such a block, so each one waits for the host to back 2 MiB again; small pages
    mostly come from memory freed recently and never reported. Measured on such a VM (2 cores,
    512 MiB cold load): system time 0.47-1.51 s with huge pages against 0.30-0.48 s without.
    """
    try:
        order = int((sys_root / "module/page_reporting/parameters/page_reporting_order").read_text())
    except (OSError, ValueError):
        return None  # no page reporting in this kernel
    huge_order = _huge_page_order(sys_root)
    if order > huge_order:
        return None  # only blocks larger than a huge page go back to the host
    try:
        devices = sorted((sys_root / "bus/virtio/devices").iterdir())
    except OSError:
        return None
    for dev in devices:
        try:
            if int((dev / "device").read_text(), 16) != _VIRTIO_ID_BALLOON or not (dev / "driver").exists():
                continue
            features = (dev / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if len(features) > _VIRTIO_BALLOON_F_REPORTING and features[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return (f"the virtio balloon {dev.name} reports free pages to the host in blocks of order {order} "
                    f"(a huge page is order {huge_order}): a huge-page fault would wait for the host")
    return None


def _huge_page_order(sys_root: Path) -> int:
    """The buddy order of a transparent huge page: 9 with 4 KiB base pages (x86-64), more with
    arm64's 16 or 64 KiB ones."""
    try:
        size = int((sys_root / "kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 9
    return max(0, size // mmap.PAGESIZE).bit_length() - 1


# Linux 5.14+: fault in (and zero) a range of pages in one call. Measured here on 1 GiB of
# huge-page memory: 0.26 ns/B, against 0.7-1.4 ns/B when the first write to each page faults.
_MADV_POPULATE_WRITE = 23
_PREFAULT_STEP = 2 << 20  # short calls: each holds the mmap lock that every allocation of the process waits on


@dataclass(frozen=True)
class HostMemoryConfig:
    keep_bytes: int = 4 << 30  # released arenas kept for reuse, in all
    keep_seconds: float = 30.0  # a released arena not reused within this is unmapped
    huge_pages: bool | None = None  # MADV_HUGEPAGE; None: yes unless free_page_reporting() says why not

    def validate(self) -> HostMemoryConfig:
        if self.keep_bytes < 0:
            raise ConfigError(f"keep_bytes must be >= 0 (0 keeps nothing), got {self.keep_bytes}")
        if self.keep_seconds <= 0:
            raise ConfigError(f"keep_seconds must be > 0, got {self.keep_seconds}")
        return self


def _align(offset: int, nbytes: int) -> int:
    a = mmap.PAGESIZE if nbytes >= PAGE_ALIGNED_BYTES else SMALL_ALIGN
    return -(-offset // a) * a


def arena_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets for tensors of ``sizes`` bytes in one arena, and the arena's size (whole pages)."""
    offsets: list[int] = []
    end = 0
    for n in sizes:
        start = _align(end, n)
        offsets.append(start)
        end = start + n
    return offsets, max(mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)


class _Arena:
    __slots__ = ("area", "size", "free_since", "address", "pinned_on", "_baseline")

    def __init__(self, size: int) -> None:
        self.area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.size = size
        self.free_since: float | None = None
        export = ctypes.c_char.from_buffer(self.area)  # a buffer export: released before the baseline is read
        self.address = ctypes.addressof(export)
        del export
        self.pinned_on: int | None = None  # the CUDA device it is registered (page-locked) with: ArenaPool.pin
        # The count while only this slot holds the mapping, read the same way is_free() reads
        # it (interpreters differ in how many references the call itself adds).
        self._baseline = sys.getrefcount(self.area)

    def is_free(self) -> bool:
        # Every tensor carved out of the arena holds a buffer export, hence one more reference,
        # until its storage is freed.
        return sys.getrefcount(self.area) <= self._baseline

    @property
    def pinned(self) -> bool:
        return self.pinned_on is not None

    def close(self) -> None:
        """Unpin and unmap (called without the pool's lock: unregistering a large arena takes a while)."""
        if self.pinned_on is not None:
            _cuda_unregister(self.address, self.pinned_on)
            self.pinned_on = None
        self.area.close()


def _cuda_register(address: int, size: int, device: int) -> str | None:
    """Page-lock ``size`` bytes at ``address`` for CUDA; None when done, else why not. On
    ``device``'s context: a fresh thread's current device is 0."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostRegister(address, size, 0)  # the binding releases the GIL
    except Exception as exc:  # noqa: BLE001 - a torch without the binding: copies stay pageable
        return f"cudaHostRegister unavailable: {exc}"
    if int(getattr(err, "value", err)) != 0:
        # The failure is this thread's "last error" too; take it, so no later check here reports it.
        clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
        if clear is not None:
            clear()
        return f"cudaHostRegister failed: {err}"
    return None


def _cuda_unregister(address: int, device: int) -> None:
    try:
        with torch.cuda.device(device):
            torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - the process is going away, or CUDA with it
        pass


class ArenaPool:
    """Arenas handed out to pulls, and the released ones kept for the next pull."""

    def __init__(self, config: HostMemoryConfig = HostMemoryConfig()) -> None:
        self.config = config.validate()
        self._arenas: list[_Arena] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self.reused = 0  # arenas handed out again (for tests and reports)
        self.mapped = 0  # arenas mapped fresh
        why_not = free_page_reporting() if config.huge_pages is None else None
        self.huge_pages = config.huge_pages if config.huge_pages is not None else why_not is None
        self.huge_pages_off_because = why_not  # None: huge pages as configured (or nothing said against them)

    def allocate(self, sizes: Sequence[int], pinned: bool = False) -> tuple[mmap.mmap, list[int], bool]:
        """An arena holding ``sizes`` bytes at the returned offsets, and whether it is fresh.

        A fresh arena has never been touched (prefault it); a reused one is already resident.
        ``pinned``: prefer a released arena that is page-locked already (``pin``).
        """
        offsets, need = arena_layout(sizes)
        with self._lock:
            gone = self._sweep(time.monotonic())
            best: _Arena | None = None
            for arena in self._arenas:
                if need <= arena.size and need >= MIN_FILL * arena.size and arena.is_free():
                    if best is None or (arena.pinned == pinned, -arena.size) > (best.pinned == pinned, -best.size):
                        best = arena
            taken = None
            if best is not None:
                best.free_since = None
                self.reused += 1
                taken = best.area  # a reference held from here on: no other caller sees it free
        _close(gone)
        if taken is not None:
            return taken, offsets, False
        arena = _Arena(need)
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                arena.area.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP off or not supported: plain pages still work
        with self._lock:
            self.mapped += 1
            # An arena to be pinned is tracked whatever its size: only the pool may unpin it, and
            # the sweep unmaps it once released if it is over keep_bytes.
            if pinned or (self.config.keep_bytes and need <= self.config.keep_bytes):
                self._arenas.append(arena)
                self._schedule()
        return arena.area, offsets, True

    def _sweep(self, now: float) -> list[_Arena]:
        """Drop released arenas kept too long or beyond keep_bytes (oldest release first); returns
        them, for the caller to ``_close`` once it has let go of the lock. Lock held."""
        free: list[_Arena] = []
        for arena in self._arenas:
            if arena.is_free():
                if arena.free_since is None:
                    arena.free_since = now
                free.append(arena)
            else:
                arena.free_since = None
        free.sort(key=lambda a: a.free_since or now)
        kept = sum(a.size for a in free)
        gone: list[_Arena] = []
        for arena in free:
            assert arena.free_since is not None
            if now - arena.free_since >= self.config.keep_seconds or kept > self.config.keep_bytes:
                kept -= arena.size
                self._arenas.remove(arena)
                gone.append(arena)
        return gone

    def _tick(self) -> None:
        with self._lock:
            self._timer = None
            gone = self._sweep(time.monotonic())
            if self._arenas:
                self._schedule()
        _close(gone)

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(max(0.5, self.config.keep_seconds / 3), self._tick)
            self._timer.daemon = True
            self._timer.start()

    def free_but_for(self, view: memoryview) -> bool:
        """Whether ``view`` (one memoryview of a whole arena) is all that still uses that arena:
        no tensor carved out of it is alive. False for memory this pool does not know."""
        with self._lock:
            for arena in self._arenas:
                if view.obj is arena.area:
                    # The view's buffer export is one more reference; any live tensor is another.
                    return sys.getrefcount(arena.area) <= arena._baseline + 1
        return False

    def held_bytes(self) -> tuple[int, int]:
        """(bytes in arenas still in use, bytes of released arenas kept for reuse)."""
        with self._lock:
            used = sum(a.size for a in self._arenas if not a.is_free())
            return used, sum(a.size for a in self._arenas) - used

    def release_all(self) -> None:
        """Unmap every released arena now (arenas in use stay with their tensors)."""
        with self._lock:
            gone = [a for a in self._arenas if a.is_free()]
            for arena in gone:
                self._arenas.remove(arena)
        _close(gone)

    def pin(self, view: memoryview, device: int) -> str | None:
        """Page-lock the arena ``view`` is of, for asynchronous copies to CUDA ``device`` (once: a
        released arena stays pinned for the next load, and is unpinned when it is unmapped).
        Returns None when the arena is pinned, else why not (its copies then run from pageable
        memory: correct, about 8x slower). Registering faults in every page it has not touched:
        call it off the loading thread, while ``view``'s tensors are alive (an arena in use is
        never swept)."""
        with self._lock:
            arena = next((a for a in self._arenas if view.obj is a.area), None)
            if arena is None:
                return "the arena was not allocated by this pool with pinned=True"
            if arena.pinned:
                return None
        why = _cuda_register(arena.address, arena.size, device)
        if why is None:
            with self._lock:
                arena.pinned_on = device
        return why

    def is_pinned(self, view: memoryview) -> bool:
        with self._lock:
            return any(view.obj is a.area and a.pinned for a in self._arenas)

    def pinned_bytes(self) -> int:
        """Bytes of arenas page-locked for CUDA (in use, or released and kept)."""
        with self._lock:
            return sum(a.size for a in self._arenas if a.pinned)


def _close(arenas: list[_Arena]) -> None:
    for arena in arenas:
        arena.close()


_POOL: ArenaPool | None = None
_POOL_LOCK = threading.Lock()


def _forget_timer_after_fork() -> None:
    # A forked child inherits the pool but not the timer thread: let it schedule its own.
    if _POOL is not None:
        _POOL._timer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_timer_after_fork)


def default_pool() -> ArenaPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ArenaPool()
        return _POOL


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # a ctypes CDLL call releases the GIL


class Prefaulter:
    """Faults in the pages of fresh target tensors, in manifest order, ahead of the receivers.

    Runs on its own thread without the GIL. Receivers that overtake it just fault as before;
    where the kernel lacks MADV_POPULATE_WRITE it stops at the first refusal.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = [t for t in tensors if t.numel() and t.data_ptr() % mmap.PAGESIZE == 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pull-prefault", daemon=True)

    def start(self) -> Prefaulter:
        if self.tensors and sys.platform == "linux":
            self._thread.start()
        return self

    def _run(self) -> None:
        madvise = _libc_madvise()
        if madvise is None:
            return
        for t in self.tensors:
            base, n = t.data_ptr(), t.numel() * t.element_size()
            for off in range(0, n, _PREFAULT_STEP):
                if self._stop.is_set() or madvise(base + off, min(_PREFAULT_STEP, n - off), _MADV_POPULATE_WRITE) != 0:
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


@dataclass(frozen=True)
class ArenaView:
    """Where the tensors of one manifest lie in one arena: a memoryview of the whole arena and
    each tensor's byte offset in it. A cache may keep slices of ``view`` after the tensors are
    gone, and hand the same memory to a later load of that manifest (``retarget``)."""

    view: memoryview
    offsets: dict[str, int]  # tensor name -> offset; tensors of no bytes are not in the arena


@dataclass
class Targets:
    tensors: dict[str, torch.Tensor]  # name -> empty tensor, manifest order
    fresh: list[torch.Tensor]  # large tensors on never-touched memory: prefault these
    arena: ArenaView | None = None

    def prefaulter(self) -> Prefaulter:
        return Prefaulter(self.fresh)


def allocate_targets(manifest: Manifest, pool: ArenaPool | None = None, pinned: bool = False) -> Targets:
    """Uninitialised CPU tensors for every tensor of ``manifest``, carved out of one arena.

    ``pool`` None: the process-wide pool. The caller must overwrite every byte (a pull does).
    ``pinned``: prefer an arena already page-locked for CUDA (``ArenaPool.pin`` pins one).
    """
    pool = pool or default_pool()
    sized = [t for t in manifest.tensors if t.nbytes]
    area, offsets, fresh = pool.allocate([t.nbytes for t in sized], pinned=pinned)
    view = memoryview(area)
    del area
    return _carve(manifest, ArenaView(view, {t.name: off for t, off in zip(sized, offsets)}), fresh)


def retarget(manifest: Manifest, arena: ArenaView) -> Targets:
    """New tensors for ``manifest`` on the memory of ``arena``, which already holds their bytes
    (the caller checked that no earlier tensor on it is alive: ``ArenaPool.free_but_for``)."""
    return _carve(manifest, arena, False)


def _carve(manifest: Manifest, arena: ArenaView, fresh: bool) -> Targets:
    out: dict[str, torch.Tensor] = {}
    large: list[torch.Tensor] = []
    for entry in manifest.tensors:
        dtype = torch_dtype(entry.dtype)
        off = arena.offsets.get(entry.name)
        if off is None:
            out[entry.name] = torch.empty(entry.shape, dtype=dtype)
            continue
        # A storage of its own per tensor (not slices of one): torch.save of one tensor writes its bytes only.
        t = torch.frombuffer(arena.view.obj, dtype=torch.uint8, count=entry.nbytes, offset=off)
        t = t.view(dtype).reshape(entry.shape)
        out[entry.name] = t
        if fresh and entry.nbytes >= PAGE_ALIGNED_BYTES:
            large.append(t)
    return Targets(out, large, arena)


__all__ = ["ArenaPool", "ArenaView", "HostMemoryConfig", "Prefaulter", "Targets", "allocate_targets", "arena_layout", "default_pool",
           "free_page_reporting", "retarget"]
