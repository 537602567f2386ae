"""Measuring helpers the benchmarks share: this process's RSS and its high-water mark (Linux
/proc), and how figures are printed next to a target (truncated toward the failing side)."""
from __future__ import annotations

import math


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


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


__all__ = ["ceil3", "floor3", "hwm_bytes", "proc_status_kib", "reset_hwm", "rss_bytes"]
