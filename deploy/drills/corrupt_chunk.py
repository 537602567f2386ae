"""Drill: flip bytes in chunk files on disk, under load.

1. one replica of a chunk: no read ever returns the bad bytes (loads stay
   bit-exact, a direct read of that replica answers the good bytes or
   DATA_LOSS), and the bad replica is repaired from a good one;
2. every replica of another chunk: loads stay bit-exact or fail with DATA_LOSS
   naming that chunk; the drill then puts the good files back;
3. (with a cold publish callable) one replica of a chunk no load touches: the
   scrubber must find it, and repair must restore it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .framework import (
    DrillError,
    Loaded,
    Published,
    Workload,
    check_loads_bit_exact,
    check_monotonic_reads,
    check_no_failed_loads,
    check_within,
    wait_for,
)
from .probe import ClusterProbe, flip_bytes, restore_file
from .report import DrillReport, error_kind

if TYPE_CHECKING:
    from deploy.local import LocalCluster


@dataclass(frozen=True)
class CorruptChunkConfig:
    flip: int = 4  # bytes flipped per file (in the data area, not the header)
    observe_s: float = 2.0  # load keeps running over the corruption this long
    repair_limit_s: float = 30.0  # corrupt replica -> good copy back on disk (read-triggered repair)
    scrub_limit_s: float = 60.0  # untouched corrupt replica -> repaired (scrubber-triggered); servers' --scrub-mb-per-s matters
    settle_s: float = 30.0

    def validate(self) -> None:
        if not 1 <= self.flip <= 4096:
            raise DrillError(f"flip must be 1..4096 bytes, got {self.flip}")
        for name in ("observe_s", "repair_limit_s", "scrub_limit_s", "settle_s"):
            if getattr(self, name) <= 0:
                raise DrillError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


def _pick_chunk(probe: ClusterProbe, p: Published, min_replicas: int, avoid: set[str]) -> tuple[str, list[str]]:
    for cid in probe.chunk_ids(p.model, p.version):
        replicas = probe.replicas_on_disk(cid)
        if cid not in avoid and len(replicas) >= min_replicas:
            return cid, replicas
    raise DrillError(f"{p.model} v{p.version} has no chunk with {min_replicas}+ replicas on disk; "
                     "push a model with more chunks or use replication >= 2")


def _read_direct(probe: ClusterProbe, server: str, cid: str) -> tuple[str, bytes]:
    """('ok', stored bytes) or (status name, b'') for one chunk read straight from one server."""
    try:
        with probe._client(server) as c:
            got = list(c.get_chunks([cid]))
        return ("ok", got[0].data) if got else ("EMPTY", b"")
    except Exception as exc:  # noqa: BLE001 - the status is the answer we are looking for
        return error_kind(exc), b""


def _wait_restored(path: Path, original: bytes, timeout: float) -> float | None:
    """Seconds until the file holds the original bytes again, None if it does not within timeout."""
    start = time.monotonic()
    try:
        wait_for(lambda: path.exists() and path.read_bytes() == original, timeout, interval=0.1,
                 what=f"{path.name} repaired")
    except TimeoutError:
        return None
    return time.monotonic() - start


def run_corrupt_chunk(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                      config: CorruptChunkConfig = CorruptChunkConfig(), probe: ClusterProbe | None = None,
                      load_once: Callable[[], Loaded] | None = None,
                      publish_cold: Callable[[], Published] | None = None) -> None:
    """load_once: one load by tag (a fresh worker, so no client cache hides the corruption).
    publish_cold: push a version that no loader reads, for the scrubber phase (skipped when None)."""
    from paramserver.store import HEADER_SIZE

    config.validate()
    probe = probe or ClusterProbe(cluster)
    if workload.wait_success("publisher", after=-1e9, timeout=config.settle_s) is None:
        raise DrillError("the publisher never committed; is the cluster healthy?")
    target = workload.committed()[-1]
    used: set[str] = set()

    # ---- 1. one replica ------------------------------------------------------------------------------
    cid, replicas = _pick_chunk(probe, target, 2, used)
    used.add(cid)
    victim = replicas[0]
    path = probe.chunk_path(victim, cid)
    original = flip_bytes(path, config.flip)
    bad = report.event("corrupted_one_replica", chunk=cid, server=victim, replicas=replicas)
    time.sleep(config.observe_s)
    status, data = _read_direct(probe, victim, cid)
    report.check("corrupt_replica_never_served", status != "ok" or data == original[HEADER_SIZE:],
                 f"direct read of {victim} answered {status}" + (" with the good bytes" if status == "ok" else ""))
    took = None
    if _wait_restored(path, original, config.repair_limit_s) is not None:
        took = report.measure("time_to_repair", bad, report.event("replica_repaired", chunk=cid, server=victim)).seconds
    check_within(report, "bad_replica_repaired", took, config.repair_limit_s)

    # ---- 2. every replica -----------------------------------------------------------------------------
    cid2, replicas2 = _pick_chunk(probe, target, 1, used)
    used.add(cid2)
    originals = {s: flip_bytes(probe.chunk_path(s, cid2), config.flip) for s in replicas2}
    all_bad = report.event("corrupted_all_replicas", chunk=cid2, servers=replicas2)
    if load_once is not None:
        try:
            got = load_once()
            report.check("no_good_copy_load_exact_or_data_loss", got.verified,
                         f"load returned v{got.version}, bit-exact={got.verified} (served from a cache)")
        except Exception as exc:  # noqa: BLE001 - the error is what we check
            kind = error_kind(exc)
            report.check("no_good_copy_load_exact_or_data_loss", kind == "DATA_LOSS" and cid2 in str(exc),
                         f"{kind}: {str(exc)[:200]}")
    time.sleep(config.observe_s)
    for server, content in originals.items():
        restore_file(probe.chunk_path(server, cid2), content)
    report.event("restored_by_drill", chunk=cid2)
    # Every DATA_LOSS a loader saw must name the chunk that had no good copy (never another one).
    losses = [e for e in report.errors if e.kind == "DATA_LOSS" and e.t >= all_bad.t]
    wrong = [e for e in losses if cid2 not in e.message]
    report.check("data_loss_names_the_chunk", not wrong,
                 f"{len(losses)} DATA_LOSS errors, all naming {cid2[:16]}" if not wrong else
                 f"{len(wrong)} DATA_LOSS errors not naming {cid2[:16]}: {wrong[0].message[:200]}")

    # ---- 3. scrubber ----------------------------------------------------------------------------------
    if publish_cold is not None:
        cold = publish_cold()
        cid3, replicas3 = _pick_chunk(probe, cold, 2, used)
        path3 = probe.chunk_path(replicas3[0], cid3)
        original3 = flip_bytes(path3, config.flip)
        cold_bad = report.event("corrupted_cold_replica", chunk=cid3, server=replicas3[0], model=cold.model,
                                version=cold.version)
        took3 = None
        if _wait_restored(path3, original3, config.scrub_limit_s) is not None:
            took3 = report.measure("time_to_scrub_repair", cold_bad,
                                   report.event("scrubber_repaired", chunk=cid3)).seconds
        check_within(report, "scrubber_finds_untouched_corruption", took3, config.scrub_limit_s)

    workload.stop()
    check_loads_bit_exact(report, workload)
    check_monotonic_reads(report, workload)
    # Only "no good copy" may fail a load, and only with DATA_LOSS.
    check_no_failed_loads(report, workload, allowed_kinds=("DATA_LOSS",))
