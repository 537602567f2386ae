"""Worker load benchmark: a 1 GiB model from a local 3-server cluster, in one run.

    .venv/bin/python bench/bench_worker.py [--gib 1.0] [--dir /tmp/bench-worker] [--device cpu]

Prints cold load (empty caches), memory-tier load, disk-tier load (empty memory tier, warm disk
tier) with GB/s and time to first tensor, next to memcpy of the same tensors and
``safetensors.torch.load_file`` of the same model (page cache warm), with ratios. The machine is
noisy: compare figures within one run only.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunking.synthetic import synthetic_state_dict
from deploy.local import LocalCluster, LocalClusterConfig
from paramserver.client.push import push
from paramserver.client.session import ClusterClient
from worker.config import MIB, CacheConfig
from worker.loader import empty_targets, load, resolve_device
from worker.tiered_cache import TieredCache


def start_cluster(root: Path) -> LocalCluster:
    """deploy.local's 3 server processes (python -m paramserver serve) on 127.0.0.1, with server-side
    caching and scrubbing off (as in the worker tests) so every load reads what the tiers hold."""
    cluster = LocalCluster(LocalClusterConfig(
        root=root / "cluster", servers=3,
        extra_args=("--cache-mb", "0", "--no-fsync", "--scrub-mb-per-s", "0", "--log-level", "WARNING"),
    ))
    cluster.up()
    return cluster


def best_of(fn: Callable[[], object], n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB (default 1.0)")
    p.add_argument("--dir", default=None, help="work folder (default: a temp dir, removed at the end)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:0 (default cpu)")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-worker-"))
    root.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    sd = synthetic_state_dict(int(args.gib * (1 << 30)))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    gb = nbytes / 1e9
    print(f"model: {len(sd)} tensors, {nbytes / (1 << 30):.3f} GiB, device {device}")

    # memcpy of the same tensors into preallocated destination tensors on the device.
    dst = {k: torch.empty_like(v, device=device) for k, v in sd.items()}

    def memcpy() -> None:
        for k, v in sd.items():
            dst[k].copy_(v)
        if device.type == "cuda":
            torch.cuda.synchronize()

    t_memcpy = best_of(memcpy, 5)

    from safetensors.torch import load_file, save_file

    st_path = root / "model.safetensors"
    save_file(sd, str(st_path))
    def st_load() -> None:
        # load_file maps the file lazily on CPU: touch every page so the bytes are really in memory.
        for t in load_file(str(st_path), device=str(device)).values():
            if t.numel():
                int(t.reshape(-1).view(torch.uint8)[::4096].sum())

    t_st = best_of(st_load, 2)

    def st_copy() -> None:
        # The same file's bytes copied into the model's own tensors (what a load must end with).
        for k, t in load_file(str(st_path), device=str(device)).items():
            dst[k].copy_(t)

    t_st_copy = best_of(st_copy, 2)

    cluster = start_cluster(root)
    rows: list[tuple[str, float, float | None, str]] = []
    try:
        t = time.perf_counter()
        version = push(cluster.seed, sd, model="bench", tag="prod").version
        t_push = time.perf_counter() - t
        print(f"pushed v{version} to 3 replicas in {t_push:.2f} s ({gb / t_push:.2f} GB/s of model bytes)")
        disk_dir = root / "disk-tier"
        cfg = CacheConfig(memory_bytes=int(2.5 * nbytes), disk_dir=str(disk_dir), disk_bytes=int(1.5 * nbytes) + (64 * MIB),
                          disk_fsync=False)
        cache = TieredCache.from_config(cfg)
        with ClusterClient(cluster.seed) as client:
            cold = load(client, "bench:prod", device, cache).report
            assert cold.bytes_network == cold.bytes_total
            rows.append(("cold load (network, fills both tiers)", cold.seconds, cold.first_tensor_s, ""))
            # Like memcpy (best of 5), the cached loads are timed best of 3: the machine is shared.
            warm = min((load(client, "bench:prod", device, cache).report for _ in range(3)), key=lambda r: r.seconds)
            assert warm.bytes_memory == warm.bytes_total
            rows.append(("memory-tier load (fresh tensors)", warm.seconds, warm.first_tensor_s, ""))
            man = client.manifest(client.resolve("bench", "prod").manifest_id)
            targets = empty_targets(man, device)
            for t_ in targets.values():
                t_.zero_()  # fault the pages in, as memcpy's destination was
            reuse = min((load(client, "bench:prod", device, cache, targets=targets).report for _ in range(3)),
                        key=lambda r: r.seconds)
            rows.append(("memory-tier load (into existing tensors)", reuse.seconds, reuse.first_tensor_s, ""))
            del targets
            disks = []
            for _ in range(2):
                disk_only = TieredCache.from_config(cfg)  # a restarted worker: empty memory tier, warm disk tier
                disks.append(load(client, "bench:prod", device, disk_only).report)
                del disk_only
            disk = min(disks, key=lambda r: r.seconds)
            assert disk.bytes_disk == disk.bytes_total, disk.summary()
            rows.append(("disk-tier load (memory tier empty)", disk.seconds, disk.first_tensor_s, ""))
        t_memcpy = min(t_memcpy, best_of(memcpy, 5))  # again, after the loads: the machine is shared and noisy
        dst.clear()  # free the destination tensors (memcpy's closure holds the name)
        rows.append(("memcpy (torch copy_, same tensors)", t_memcpy, None, ""))
        rows.append(("safetensors load_file (mmap, pages touched)", t_st, None, ""))
        rows.append(("safetensors load_file + copy into tensors", t_st_copy, None, ""))
    finally:
        cluster.down()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'what':48s} {'seconds':>8s} {'GB/s':>7s} {'x memcpy':>9s} {'x safetensors':>14s} {'first tensor':>13s}")
    for name, secs, ttft, _ in rows:
        rate = gb / secs
        ttft_s = f"{ttft * 1000:.1f} ms" if ttft is not None else "-"
        print(f"{name:48s} {secs:8.3f} {rate:7.2f} {t_memcpy / secs:9.2f} {t_st / secs:14.2f} {ttft_s:>13s}")
    mem_rate = gb / rows[2][1]
    print(f"\nmemory-tier load into existing tensors reaches {mem_rate / (gb / t_memcpy):.0%} of memcpy (target: at least 50%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
