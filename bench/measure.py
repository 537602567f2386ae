"""Measuring helpers the benchmarks share: this process's RSS and its high-water mark, CPU time of
any process or thread (Linux /proc), and how figures are printed next to a target (truncated toward the failing side)."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def stat_cpu_s(path: str) -> float:
    """utime + stime in seconds from a /proc ``stat`` file (``/proc/PID/stat``: every thread of the
    process; ``/proc/PID/task/TID/stat``: one thread). OSError once it is gone."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14 and 15: utime, stime


def rss_bytes() -> int:
    return proc_status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    return proc_status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def floor3(x: float) -> str:
    return f"{math.floor(x * 1000) / 1000:.3f}"


def ceil3(x: float) -> str:
    return f"{math.ceil(x * 1000) / 1000:.3f}"


__all__ = ["balanced_orders", "ceil3", "floor3", "hwm_bytes", "proc_status_kib", "reset_hwm", "rss_bytes", "stat_cpu_s"]


def balanced_orders(kinds: Sequence[T], rounds: int) -> list[list[T]]:
    """One order of ``kinds`` per round, from a Williams design: over every ``len(kinds)`` rounds
    (``2 * len(kinds)`` when odd) each method runs in every position and right after every other
    method equally often. A plain rotation keeps each method's predecessor the same in every round,
    so whatever one leaves behind (memory for the kernel to reclaim, servers still busy) always
    falls on the same next one and biases that row."""
    n = len(kinds)
    if n == 0:
        return [[] for _ in range(rounds)]
    first: list[int] = []
    lo, hi = 0, n - 1
    for i in range(n):
        if i % 2 == 0:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    square = [[(x + r) % n for x in first] for r in range(n)]
    if n % 2:
        square += [row[::-1] for row in square]
    return [[kinds[i] for i in square[r % len(square)]] for r in range(rounds)]
