"""Workload threads, bounded waits, invariant checks and run_drill, with plain callables (no cluster)."""
from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from deploy.drills.framework import (
    DrillError,
    Loaded,
    Published,
    Workload,
    WorkloadConfig,
    check_converged,
    check_loads_bit_exact,
    check_monotonic_reads,
    check_no_failed_loads,
    check_no_lost_commits,
    check_within,
    run_drill,
    wait_for,
)
from deploy.drills.report import DrillReport, load_report

FAST = WorkloadConfig(loaders=2, publish_interval_s=0.0, load_interval_s=0.0, error_backoff_s=0.0,
                      max_iterations=50, join_timeout_s=5.0)


def test_workload_runs_publisher_and_loaders_until_their_bound_and_records_results() -> None:
    r = DrillReport("d")
    head = {"v": 0}
    lock = threading.Lock()

    def publish(i: int) -> Published:
        with lock:
            head["v"] = i
        return Published("m", i, "prod", nbytes=10)

    def load(k: int, i: int) -> Loaded:
        if i % 10 == 0:
            raise TimeoutError("deadline exceeded")
        with lock:
            return Loaded("m", "prod", head["v"], nbytes=100)

    w = Workload(r, publish=publish, load=load, config=FAST).start()
    wait_for(lambda: not w.running, 10, what="workload reaching max_iterations")
    w.stop()
    assert [p.version for p in w.committed()] == list(range(1, 51))
    assert sum(len(v) for v in w.loads.values()) == 2 * 45
    assert r.counters["bytes_verified"] == 2 * 45 * 100
    assert r.error_counts == {"loader-0:TimeoutError": 5, "loader-1:TimeoutError": 5}
    assert w.failures() == 10 and r.counters["loader-0.failed"] == 5
    assert check_monotonic_reads(r, w) and check_loads_bit_exact(r, w)
    assert not check_no_failed_loads(r, w)
    assert check_no_failed_loads(r, w, allowed_kinds={"TimeoutError"})


def test_stop_ends_threads_promptly_and_wait_success_sees_the_next_success() -> None:
    r = DrillReport("d")
    gate = threading.Event()

    def publish(i: int) -> Published:
        if not gate.is_set():
            raise ConnectionError("no leader")
        return Published("m", i)

    cfg = WorkloadConfig(loaders=0, publish_interval_s=0.01, error_backoff_s=0.01, max_iterations=100_000)
    with Workload(r, publish=publish, config=cfg) as w:
        t_cut = r.now()
        assert w.wait_success("publisher", after=t_cut, timeout=0.2) is None
        gate.set()
        t_ok = w.wait_success("publisher", after=t_cut, timeout=5.0)
        assert t_ok is not None and t_ok > t_cut
        assert w.first_success_after("publisher", t_cut) == t_ok
        started = time.monotonic()
    assert time.monotonic() - started < 2.0 and not w.running
    assert r.error_counts["publisher:ConnectionError"] >= 1
    with pytest.raises(DrillError, match="no workload thread"):
        w.wait_success("loader-9", 0.0, 0.1)


def test_rolled_back_tag_and_wrong_bytes_break_their_invariants() -> None:
    r = DrillReport("d")
    seq = [5, 6, 4, 7]

    def load(k: int, i: int) -> Loaded | None:
        if i > len(seq):
            return None
        return Loaded("m", "prod", seq[i - 1], nbytes=1, verified=i != 4, detail="chunk abc mismatch")

    cfg = WorkloadConfig(loaders=1, load_interval_s=0.0, max_iterations=6)
    w = Workload(r, load=load, config=cfg).start()
    wait_for(lambda: not w.running, 10)
    w.stop()
    assert not check_monotonic_reads(r, w)
    assert "6 -> 4" in r.broken[0].detail
    assert not check_loads_bit_exact(r, w)
    assert r.counters["loads_with_wrong_bytes"] == 1 and r.find_event("wrong_bytes") is not None


def test_invariant_helpers() -> None:
    r = DrillReport("d")
    committed = [Published("m", 1), Published("m", 2)]
    assert check_no_lost_commits(r, committed, lambda p: True)
    assert not check_no_lost_commits(r, committed, lambda p: p.version == 1)
    assert r.broken[-1].detail == "lost: m v2"

    def boom(p: Published) -> bool:
        raise ConnectionError("down")

    assert not check_no_lost_commits(r, committed, boom)
    assert check_converged(r, {"ps1": {"v": [1]}, "ps2": {"v": [1]}})
    assert not check_converged(r, {"ps1": {"v": [1]}, "ps2": {"v": [1, 2]}})
    assert "['ps2'] differ from ps1" in r.broken[-1].detail
    assert not check_converged(r, {})
    assert check_within(r, "failover", 0.4, 1.0)
    assert not check_within(r, "failover", 1.4, 1.0)
    assert not check_within(r, "failover", None, 1.0)


def test_config_validation_and_workload_needs_something_to_run() -> None:
    with pytest.raises(DrillError, match="max_iterations"):
        WorkloadConfig(max_iterations=0).validate()
    with pytest.raises(DrillError, match="loaders"):
        WorkloadConfig(loaders=-1).validate()
    with pytest.raises(DrillError, match="needs a publish"):
        Workload(DrillReport("d"))


def test_wait_for_is_bounded_and_reports_the_last_error() -> None:
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] < 3:
            raise ConnectionError("electing")
        return 7

    assert wait_for(flaky, 5, interval=0.001) == 7
    with pytest.raises(TimeoutError, match="leader not reached within 0.05s"):
        wait_for(lambda: None, 0.05, interval=0.01, what="leader")


def test_run_drill_writes_json_and_a_crash_fails_the_run(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=160, color_system=None)

    def good(r: DrillReport) -> None:
        r.check("no_lost_commits", True, "3 commits")

    rep = run_drill("good", good, out_dir=tmp_path, console=console)
    assert rep.exit_code() == 0 and load_report(tmp_path / "good.json")["ok"]

    def crash(r: DrillReport) -> None:
        raise RuntimeError("cluster did not come up")

    rep = run_drill("crash", crash, out_dir=tmp_path, console=console)
    assert rep.exit_code() != 0
    data = load_report(tmp_path / "crash.json")
    assert data["checks"][-1]["name"] == "drill_completed" and "cluster did not come up" in data["checks"][-1]["detail"]
    assert "BROKEN" in out.getvalue()
