"""Run per-chunk work on a few threads in contiguous blocks.

BLAKE3, zstd and numpy copies release the GIL, so a couple of threads scale;
blocks of several chunks keep the pool's per-task cost off the per-chunk path.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_BLOCK_BYTES = 4 << 20


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def blocks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    block: list[T] = []
    for item in items:
        block.append(item)
        if len(block) >= size:
            yield block
            block = []
    if block:
        yield block


def map_blocks(fn: Callable[[list[T]], R], items: Iterable[T], *, threads: int, block: int) -> Iterator[R]:
    """``fn`` over blocks of ``items``, results in input order, at most 2 blocks per thread in flight."""
    if threads <= 1:
        for b in blocks(items, block):
            yield fn(b)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="chunking") as pool:
        pending: list[Future[R]] = []
        try:
            for b in blocks(items, block):
                pending.append(pool.submit(fn, b))
                if len(pending) >= 2 * threads:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for f in pending:
                f.cancel()


def chunks_per_block(chunk_size: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> int:
    return max(1, block_bytes // chunk_size)

