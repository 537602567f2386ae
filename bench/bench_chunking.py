"""Benchmark chunking: pack / unpack throughput next to a plain memcpy of the same bytes.

    .venv/bin/python bench/bench_chunking.py                 # 1 GiB model
    .venv/bin/python bench/bench_chunking.py --size-gib 0.125  # quick run

Every figure is measured in this run; ratios are against memcpy of the same
number of bytes into memory of the same kind (fresh pages vs already touched).
Transparent huge pages for torch allocations are enabled unless --no-thp,
because first-touch page faults otherwise dominate both unpack and memcpy
into fresh memory on VMs.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

if "--no-thp" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read once by torch's CPU allocator

import numpy as np
import torch

from chunking import ChunkingConfig, content_id, crc32c, pack, unpack
from chunking.synthetic import synthetic_state_dict
from chunking.manifest import Manifest
from chunking.unpack import empty_like_manifest

T = TypeVar("T")


def timed(fn: Callable[[], T], repeat: int) -> tuple[float, T]:
    """Best seconds of ``repeat`` (at least one) calls of ``fn``, and the last call's result."""
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    best = time.perf_counter() - t0
    for _ in range(repeat - 1):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def memcpy_seconds(nbytes: int, repeat: int) -> tuple[float, float]:
    """Seconds to copy ``nbytes`` random bytes into fresh memory and into memory already touched."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    t_fresh, _ = timed(lambda: np.copyto(np.asarray(torch.empty(nbytes, dtype=torch.uint8).numpy()), src), repeat)
    warm = np.ones(nbytes, dtype=np.uint8)
    t_warm, _ = timed(lambda: np.copyto(warm, src), repeat)
    return t_fresh, t_warm


def touched_target(manifest: Manifest) -> dict[str, torch.Tensor]:
    target = empty_like_manifest(manifest)
    for t in target.values():
        t.reshape(-1).view(torch.uint8).fill_(1)
    return target


def verify_floor(manifest: Manifest, source: Mapping[str, bytes], dest: np.ndarray) -> None:
    """The least work unpack must do: CRC32C, BLAKE3 and one copy of each chunk, in a bare loop."""
    pos = 0
    for ref in manifest.chunks:
        data = source[ref.id]
        assert crc32c(data) == ref.crc32c and content_id(data) == ref.id
        dest[pos : pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
        pos += len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--chunk-size", type=int, default=262144)
    ap.add_argument("--threads", type=int, default=None, help="pack/unpack threads (default: library default)")
    ap.add_argument("--repeat", type=int, default=2, help="best of N for each figure")
    ap.add_argument("--no-thp", action="store_true")
    args = ap.parse_args()
    size = int(args.size_gib * (1 << 30))
    rows: list[tuple[str, float, float, str]] = []

    print(f"cpus={os.cpu_count()} torch={torch.__version__} threads={args.threads or 'default'} "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}")
    sd = synthetic_state_dict(size, dtype=torch.float32, seed=0)
    nbytes = sum(v.nbytes for v in sd.values())
    print(f"model: {len(sd)} float32 tensors, {nbytes / 2**30:.3f} GiB, chunk size {args.chunk_size}")

    t_fresh, t_warm = memcpy_seconds(nbytes, args.repeat)
    memcpy_fresh, memcpy_warm = gbps(nbytes, t_fresh), gbps(nbytes, t_warm)
    rows.append(("memcpy into fresh memory (np.copyto)", memcpy_fresh, 1.0, "baseline for *fresh*"))
    rows.append(("memcpy into touched memory (np.copyto)", memcpy_warm, 1.0, "baseline for *target*"))

    def bench_codec(label: str, model: dict[str, torch.Tensor], codec: str) -> None:
        cfg = ChunkingConfig(chunk_size=args.chunk_size, codec=codec)
        t_pack, result = timed(lambda: pack(model, model="bench", config=cfg, threads=args.threads), 1)
        m = result.manifest
        saving = 1 - m.stored_bytes / m.raw_bytes
        rows.append((f"pack {label}", gbps(nbytes, t_pack), gbps(nbytes, t_pack) / memcpy_warm,
                     f"stored {m.stored_bytes / m.raw_bytes:.3f} of raw ({saving:.1%} saved)"))
        source = result.source()
        if codec == "off":
            flat = np.ones(m.raw_bytes, dtype=np.uint8)
            t_floor, _ = timed(lambda: verify_floor(m, source, flat), args.repeat)
            del flat
            rows.append(("  floor: CRC32C+BLAKE3+copy per chunk, 1 thread", gbps(nbytes, t_floor),
                         gbps(nbytes, t_floor) / memcpy_warm, "the checks every raw chunk needs"))
            t_unp, out = timed(lambda: unpack(m, source, threads=args.threads), args.repeat)
            rows.append((f"unpack {label} -> fresh tensors", gbps(nbytes, t_unp), gbps(nbytes, t_unp) / memcpy_fresh, "vs memcpy fresh"))
            assert all(torch.equal(out[k].view(torch.uint8), model[k].view(torch.uint8)) for k in model)
            del out
        target = touched_target(m)
        t_unp, out = timed(lambda: unpack(m, source, target=target, threads=args.threads), args.repeat)
        rows.append((f"unpack {label} -> target tensors", gbps(nbytes, t_unp), gbps(nbytes, t_unp) / memcpy_warm, "vs memcpy touched"))
        assert all(torch.equal(target[k].view(torch.uint8), model[k].view(torch.uint8)) for k in model)

    # each run's packed chunks and tensors die when bench_codec returns; collect them before the next
    bench_codec("raw (codec off)", sd, "off")
    gc.collect()
    bench_codec("fp32 zstd (codec on)", sd, "on")
    gc.collect()
    del sd
    gc.collect()
    bf16 = synthetic_state_dict(size, dtype=torch.bfloat16, seed=0)
    bench_codec("bf16 shuffle+zstd (codec on)", bf16, "on")

    width = max(len(r[0]) for r in rows)
    print(f"\n{'operation'.ljust(width)}   GB/s   ratio   note")
    for name, rate, ratio, note in rows:
        print(f"{name.ljust(width)} {rate:6.2f}  {ratio:6.2f}   {note}")


if __name__ == "__main__":
    main()
