"""DrillReport: events, intervals, checks, client errors, JSON and table output."""
from __future__ import annotations

import io
import threading
from pathlib import Path

import pytest
from rich.console import Console

from deploy.drills.report import EXIT_INVARIANT_BROKEN, EXIT_OK, DrillReport, error_kind, load_report


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_events_and_measured_intervals_use_drill_relative_monotonic_time() -> None:
    clock = FakeClock()
    r = DrillReport("kill-leader", clock=clock, wall_clock=lambda: 1_700_000_000.0)
    clock.t += 1.0
    r.event("leader_killed", leader="ps1")
    clock.t += 0.25
    r.event("new_leader", leader="ps2")
    clock.t += 0.25
    r.event("new_leader", leader="ps3")
    iv = r.measure("time_to_new_leader", "leader_killed", "new_leader")
    assert iv.seconds == pytest.approx(0.25) and (iv.start, iv.end) == ("leader_killed", "new_leader")
    assert r.events[0].t == pytest.approx(1.0) and r.events[0].wall == 1_700_000_000.0
    assert r.events[0].detail == {"leader": "ps1"}
    with pytest.raises(KeyError, match="record it"):
        r.measure("x", "never", "new_leader")


def test_summary_gives_median_and_max_per_interval_name() -> None:
    r = DrillReport("d")
    for s in (0.3, 0.5, 0.4, 2.0):
        r.interval("failover", s)
    r.interval("recovery", 1.0)
    s = r.summary()
    assert s["failover"] == {"count": 4, "median": pytest.approx(0.45), "max": 2.0, "min": 0.3}
    assert s["recovery"]["count"] == 1


def test_exit_code_is_non_zero_when_any_invariant_broke() -> None:
    r = DrillReport("d")
    assert r.ok and r.exit_code() == EXIT_OK  # no checks yet: nothing broke
    assert r.check("a", True)
    assert not r.check("b", False, "v3 lost")
    assert not r.ok and r.exit_code() == EXIT_INVARIANT_BROKEN
    assert [c.name for c in r.broken] == ["b"]


def test_client_errors_are_counted_by_source_and_kind_and_samples_are_bounded() -> None:
    r = DrillReport("d")
    for _ in range(600):
        r.client_error("loader-0", TimeoutError("slow"))
    r.client_error("publisher", "no leader", kind="UNAVAILABLE")
    assert r.error_counts == {"loader-0:TimeoutError": 600, "publisher:UNAVAILABLE": 1}
    assert len(r.errors) == 500


def test_error_kind_prefers_a_grpc_status_name() -> None:
    class Code:
        name = "DATA_LOSS"

    class FakeRpcError(Exception):
        def code(self) -> Code:
            return Code()

    assert error_kind(FakeRpcError("bad chunk")) == "DATA_LOSS"
    assert error_kind(ValueError("x")) == "ValueError"


def test_json_round_trip_and_rendered_tables(tmp_path: Path) -> None:
    r = DrillReport("partition")
    r.event("partitioned", minority=["ps1"])
    r.interval("time_to_new_leader", 0.42)
    r.add_bytes_verified(1024)
    r.add_bytes_verified(1024)
    r.info["servers"] = 3
    r.check("minority_commits_nothing", True, "0 commits")
    r.check("converged", False, "ps2 differs")
    r.finish()
    path = r.write_json(tmp_path / "out" / "partition.json")
    data = load_report(path)
    assert data["ok"] is False and data["bytes_verified"] == 2048 and data["info"] == {"servers": 3}
    assert data["summary"]["time_to_new_leader"]["median"] == pytest.approx(0.42)
    assert [c["name"] for c in data["checks"]] == ["minority_commits_nothing", "converged"]
    buf = io.StringIO()
    r.render(Console(file=buf, width=160, color_system=None))
    text = buf.getvalue()
    for word in ("partitioned", "time_to_new_leader", "BROKEN", "converged", "bytes_verified"):
        assert word in text
    (tmp_path / "other.json").write_text('{"schema": "x"}')
    with pytest.raises(ValueError, match="not a drill report"):
        load_report(tmp_path / "other.json")


def test_recording_from_many_threads_loses_nothing() -> None:
    r = DrillReport("d")

    def work() -> None:
        for _ in range(200):
            r.count("loads")
            r.event("tick")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert r.counters["loads"] == 800 and len(r.events) == 800
