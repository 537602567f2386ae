"""Drill: flip bytes inside chunk records of the servers' segment files, under load.

1. one replica of a chunk: no read ever returns the bad bytes (loads stay
   bit-exact, a direct read of that replica answers the good bytes or
   DATA_LOSS), and the bad replica is repaired from a good one;
2. every replica of another chunk: loads stay bit-exact or fail with DATA_LOSS
   naming that chunk; the drill then puts the good records back;
3. (with a cold publish callable) one replica of a chunk no load touches: the
   scrubber must find it, and repair must restore it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .framework import (
    check_positive_seconds,
    DrillError,
    Loaded,
    Published,
    Workload,
    check_loads_bit_exact,
    check_monotonic_reads,
    check_within,
    wait_for,
)
from .probe import ChunkRecord, ClusterProbe, flip_bytes
from .report import DrillReport, Event, error_kind

if TYPE_CHECKING:
    from deploy.local import LocalCluster

NO_GOOD_COPY_KINDS = ("DATA_LOSS", "ChunkUnavailable")


@dataclass(frozen=True)
class CorruptChunkConfig:
    flip: int = 4  # bytes flipped per record (in its stored bytes, not the header)
    observe_s: float = 2.0  # load keeps running over the no-good-copy corruption this long
    repair_limit_s: float = 30.0  # corrupt replica -> good copy back on disk (read-triggered repair)
    scrub_limit_s: float = 60.0  # untouched corrupt replica -> repaired (scrubber-triggered); servers' --scrub-mb-per-s matters
    settle_s: float = 30.0
    # True when the servers run with --cache-mb 0 (a fresh drill cluster): the reads must then reach the
    # disk, so the bad replica must answer DATA_LOSS and the no-good-copy load must fail with DATA_LOSS.
    # False (a running cluster with a hot cache): good bytes from a cache are accepted too.
    expect_disk_reads: bool = True

    def validate(self) -> None:
        if not 1 <= self.flip <= 4096:
            raise DrillError(f"flip must be 1..4096 bytes, got {self.flip}")
        check_positive_seconds(self, ("observe_s", "repair_limit_s", "scrub_limit_s", "settle_s"))


def stable_chunks(probe: ClusterProbe, committed: list[Published]) -> tuple[Published, list[str]]:
    """The latest version, and its chunks that the version before it shares (newer versions keep them,
    so a load by tag keeps reading them while the publisher runs)."""
    if len(committed) < 2:
        raise DrillError("corrupt-chunk needs two committed versions of the model to find chunks that stay in use")
    last, prev = committed[-1], committed[-2]
    shared = set(probe.chunk_ids(prev.model, prev.version))
    ids = [c for c in probe.chunk_ids(last.model, last.version) if c in shared]
    if not ids:
        raise DrillError(f"{last.model} v{last.version} shares no chunk with v{prev.version}; "
                         "use a ModelSpec with unchanged tensors (changed_per_version < tensors)")
    return last, list(dict.fromkeys(ids))


def _pick_chunk(probe: ClusterProbe, candidates: list[str], min_replicas: int, avoid: set[str]) -> tuple[str, list[str]]:
    for cid in candidates:
        replicas = probe.replicas_on_disk(cid)
        if cid not in avoid and len(replicas) >= min_replicas:
            return cid, replicas
    raise DrillError(f"no chunk among {len(candidates)} candidates has {min_replicas}+ replicas on disk; "
                     "push a model with more chunks or use replication >= 2")


def _read_direct(probe: ClusterProbe, server: str, cid: str) -> tuple[str, bytes]:
    """('ok', stored bytes) or (status name, b'') for one chunk read straight from one server."""
    try:
        with probe._client(server) as c:
            got = list(c.get_chunks([cid]))
        return ("ok", got[0].data) if got else ("EMPTY", b"")
    except Exception as exc:  # noqa: BLE001 - the status is the answer we are looking for
        return error_kind(exc), b""


def _wait_file(path: ChunkRecord, pred: Callable[[bytes | None], bool], timeout: float, what: str) -> float | None:
    """Seconds until pred(the live record's bytes, or None when none) holds; None if it does not within timeout."""
    start = time.monotonic()

    def now() -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    try:
        wait_for(lambda: pred(now()), timeout, interval=0.05, what=what)
    except TimeoutError:
        return None
    return time.monotonic() - start


def _detect_and_repair(report: DrillReport, path: ChunkRecord, original: bytes, corrupt: bytes, since: Event,
                       limit: float, prefix: str, cid: str, server: str) -> float | None:
    """Measure <prefix>detect (the corrupt record is quarantined or replaced) and <prefix>repair (good bytes back)."""
    if _wait_file(path, lambda b: b != corrupt, limit, f"{path.name} quarantined") is not None:
        report.measure(f"time_to_{prefix}detect", since, report.event(f"{prefix}detected", chunk=cid, server=server))
    took = None
    if _wait_file(path, lambda b: b == original, limit, f"{path.name} repaired") is not None:
        took = report.measure(f"time_to_{prefix}repair", since,
                              report.event(f"{prefix}repaired", chunk=cid, server=server)).seconds
    return took


def run_corrupt_chunk(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                      config: CorruptChunkConfig = CorruptChunkConfig(), probe: ClusterProbe | None = None,
                      load_once: Callable[[], Loaded] | None = None,
                      publish_cold: Callable[[], Published] | None = None) -> None:
    """load_once: one load by tag (a fresh worker, so no client cache hides the corruption).
    publish_cold: push a version that no loader reads, for the scrubber phase (skipped when None)."""
    from paramserver.server.store import HEADER_SIZE

    config.validate()
    probe = probe or ClusterProbe(cluster)
    report.info.update(expect_disk_reads=config.expect_disk_reads)
    deadline = time.monotonic() + config.settle_s
    while len(workload.committed()) < 2 and time.monotonic() < deadline:
        workload.wait_success("publisher", after=report.now(), timeout=1.0)
    target, candidates = stable_chunks(probe, workload.committed())
    used: set[str] = set()

    # ---- 1. one replica: never served, a load stays exact, repaired from a good copy ------------------
    cid, replicas = _pick_chunk(probe, candidates, 2, used)
    used.add(cid)
    victim = replicas[0]
    path = probe.chunk_path(victim, cid)
    # The direct read must be the first read of the bad copy (a loader's read would quarantine it first).
    quiet = workload.pause_loaders()
    try:
        original = flip_bytes(path, config.flip)
        corrupt = path.read_bytes()
        bad = report.event("corrupted_one_replica", chunk=cid, server=victim, replicas=replicas,
                           version=target.version, loaders_quiet=quiet)
        status, data = _read_direct(probe, victim, cid)  # at once: before the scrubber or repair get to it
    finally:
        workload.resume_loaders()
    report.event("direct_read_of_bad_replica", server=victim, status=status)
    served_good = status == "ok" and data == original[HEADER_SIZE:]
    if config.expect_disk_reads:
        report.check("corrupt_replica_never_served", status == "DATA_LOSS" or served_good,
                     f"direct read of {victim} answered {status}" + (" with the good bytes" if served_good else ""))
    else:
        report.check("corrupt_replica_never_served", status != "ok" or served_good,
                     f"direct read of {victim} answered {status}" + (" with the good bytes (cache)" if served_good else ""))
    if load_once is not None:
        try:
            got = load_once()
            report.check("one_bad_replica_load_exact", got.verified,
                         f"load of v{got.version} bit-exact={got.verified} ({got.nbytes:,} bytes)")
            if got.verified:
                report.add_bytes_verified(got.nbytes)
        except Exception as exc:  # noqa: BLE001 - a good copy exists: any error breaks the invariant
            report.check("one_bad_replica_load_exact", False, f"{error_kind(exc)}: {str(exc)[:200]}")
    took = _detect_and_repair(report, path, original, corrupt, bad, config.repair_limit_s, "", cid, victim)
    check_within(report, "bad_replica_repaired", took, config.repair_limit_s)

    # ---- 2. every replica: the load is exact or fails with DATA_LOSS naming the chunk -----------------
    cid2, replicas2 = _pick_chunk(probe, candidates, 1, used)
    used.add(cid2)
    # The drill's own load must be the first read of the corrupt copies: a read quarantines a corrupt
    # file, and a later reader then finds no copy at all rather than a corrupt one.
    quiet = workload.pause_loaders()
    originals = {s: flip_bytes(probe.chunk_path(s, cid2), config.flip) for s in replicas2}
    all_bad = report.event("corrupted_all_replicas", chunk=cid2, servers=replicas2, loaders_quiet=quiet)
    try:
        if load_once is not None:
            try:
                got = load_once()
                ok = got.verified and not config.expect_disk_reads
                report.check("no_good_copy_load_exact_or_data_loss", ok,
                             f"load returned v{got.version}, bit-exact={got.verified} (served from a cache)")
            except Exception as exc:  # noqa: BLE001 - the error is what we check
                kind = error_kind(exc)
                report.event("no_good_copy_load_failed", kind=kind)
                report.check("no_good_copy_load_exact_or_data_loss", kind == "DATA_LOSS" and cid2 in str(exc),
                             f"{kind}: {str(exc)[:240]}")
    finally:
        workload.resume_loaders()
    time.sleep(config.observe_s)
    for server, content in originals.items():
        probe.restore_chunk(server, cid2, content)
    restored = report.event("restored_by_drill", chunk=cid2, servers=list(originals))
    if load_once is not None:
        try:
            got = load_once()
            report.check("load_exact_after_restore", got.verified, f"v{got.version} bit-exact={got.verified}")
            if got.verified:
                report.add_bytes_verified(got.nbytes)
        except Exception as exc:  # noqa: BLE001 - a failed check, reported with its kind
            report.check("load_exact_after_restore", False, f"{error_kind(exc)}: {str(exc)[:200]}")
    # While no good copy existed, a loader may fail only on that chunk: DATA_LOSS (it read a corrupt copy),
    # or ChunkUnavailable (an earlier read had quarantined every copy). Never another chunk, never later.
    window = [e for e in report.errors if e.source.startswith("loader-") and all_bad.t <= e.t <= restored.t + 1.0]
    wrong = [e for e in window if cid2 not in e.message or e.kind not in NO_GOOD_COPY_KINDS]
    kinds = sorted({e.kind for e in window})
    report.check("no_good_copy_errors_name_the_chunk", not wrong,
                 f"{len(window)} loader errors while no good copy existed ({', '.join(kinds) or 'none'}), "
                 f"all naming {cid2[:16]}" if not wrong else
                 f"{len(wrong)} loader errors not naming {cid2[:16]} or of another kind: "
                 f"{wrong[0].kind}: {wrong[0].message[:200]}")
    window_ids = {id(e) for e in window}

    # ---- 3. scrubber: corruption no read touches is found and repaired ---------------------------------
    if publish_cold is not None:
        cold = publish_cold()
        cold_ids = probe.chunk_ids(cold.model, cold.version)
        cid3, replicas3 = _pick_chunk(probe, cold_ids, 2, used)
        path3 = probe.chunk_path(replicas3[0], cid3)
        original3 = flip_bytes(path3, config.flip)
        corrupt3 = path3.read_bytes()
        cold_bad = report.event("corrupted_cold_replica", chunk=cid3, server=replicas3[0], model=cold.model,
                                version=cold.version)
        took3 = _detect_and_repair(report, path3, original3, corrupt3, cold_bad, config.scrub_limit_s, "scrub_",
                                   cid3, replicas3[0])
        check_within(report, "scrubber_finds_untouched_corruption", took3, config.scrub_limit_s)

    workload.stop()
    check_loads_bit_exact(report, workload)
    check_monotonic_reads(report, workload)
    # Only the no-good-copy window may fail a load (judged above); any other failed load breaks the drill.
    outside = [e for e in report.errors if e.source.startswith("loader-") and id(e) not in window_ids]
    counts = {k: v for k, v in report.error_counts.items() if k.startswith("loader-")}
    report.check("no_failed_loads", not outside,
                 f"{len(outside)} loads failed outside the no-good-copy window: {outside[0].kind}: "
                 f"{outside[0].message[:200]}" if outside else
                 f"0 failed loads outside the no-good-copy window (inside it: {counts or 'none'})")
