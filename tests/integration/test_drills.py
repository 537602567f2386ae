"""The fault drills end to end: real servers, a real publisher and real loaders, one fresh cluster per drill.

Each test runs a drill through ``deploy.drills.run.execute`` (what ``python -m
deploy.drills`` and ``paramctl drill`` run), then checks the verdict, the JSON
report on disk and the figures that matter for that fault. The partition drill
needs root and network namespaces; elsewhere it skips and says why.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.drills.report import DrillReport, load_report
from deploy.drills.run import DrillOptions, execute
from deploy.netns import netns_available

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.serial]  # failover bounds: see [tool.pytest]

# CI runs the full 10 rounds of the issue (about 40 s quiet, about 2 min on a loaded 2-core machine: each
# round waits for the killed server to restart and catch up). Lower it here if CI time gets short.
CI_KILL_LEADER_ROUNDS = 10


def _run(tmp_path: Path, drill: str, **kw: object) -> tuple[DrillReport, dict]:
    opts = DrillOptions(drill=drill, fresh_dir=tmp_path / "cluster", json_path=tmp_path / f"{drill}.json",
                        render=False, **kw)  # type: ignore[arg-type]
    report, path = execute(opts)
    assert path == tmp_path / f"{drill}.json" and path.exists()
    data = load_report(path)
    assert data["drill"] == drill and data["ok"] == report.ok
    return report, data


def _checks(data: dict) -> dict[str, dict]:
    return {c["name"]: c for c in data["checks"]}


def _assert_held(data: dict) -> None:
    broken = {c["name"]: c["detail"] for c in data["checks"] if not c["ok"]}
    assert not broken, f"invariants broken: {json.dumps(broken, indent=1)}"


@pytest.mark.timeout(420)
def test_kill_leader_rounds_under_load(tmp_path: Path) -> None:
    report, data = _run(tmp_path, "kill-leader", rounds=CI_KILL_LEADER_ROUNDS)
    _assert_held(data)
    assert report.exit_code() == 0
    checks = _checks(data)
    for r in range(CI_KILL_LEADER_ROUNDS):
        assert checks[f"round{r}_failover"]["ok"] and checks[f"round{r}_restarted_catches_up"]["ok"]
    for name in ("no_failed_loads", "no_lost_commits", "servers_converged", "monotonic_reads", "loads_bit_exact"):
        assert checks[name]["ok"], checks[name]
    s = data["summary"]
    assert s["time_to_next_commit"]["count"] == CI_KILL_LEADER_ROUNDS
    assert s["time_to_next_commit"]["max"] <= 5.0
    assert data["info"]["failover_median_s"] <= data["info"]["failover_max_s"] <= 5.0
    assert data["counters"]["loader-0.ok"] > 0 and data["counters"]["loader-0.failed"] == 0
    assert data["bytes_verified"] > 0
    kills = [e for e in data["events"] if e["name"] == "leader_killed"]
    assert len(kills) == CI_KILL_LEADER_ROUNDS and len({e["detail"]["leader"] for e in kills}) >= 2


@pytest.mark.timeout(300)
def test_corrupt_chunk_one_replica_every_replica_and_scrubber(tmp_path: Path) -> None:
    report, data = _run(tmp_path, "corrupt-chunk")
    _assert_held(data)
    checks = _checks(data)
    # The fresh drill cluster runs without a hot cache, so the failure paths are really taken:
    assert data["info"]["expect_disk_reads"] is True
    assert "answered DATA_LOSS" in checks["corrupt_replica_never_served"]["detail"]
    no_copy = checks["no_good_copy_load_exact_or_data_loss"]["detail"]
    corrupted = next(e for e in data["events"] if e["name"] == "corrupted_all_replicas")
    assert no_copy.startswith("DATA_LOSS") and corrupted["detail"]["chunk"] in no_copy
    for name in ("one_bad_replica_load_exact", "bad_replica_repaired", "load_exact_after_restore",
                 "scrubber_finds_untouched_corruption", "no_failed_loads", "loads_bit_exact"):
        assert checks[name]["ok"], checks[name]
    assert {"time_to_detect", "time_to_repair", "time_to_scrub_repair"} <= set(data["summary"])
    assert report.exit_code() == 0


@pytest.mark.timeout(240)
def test_restart_one_server_from_its_data_dir(tmp_path: Path) -> None:
    report, data = _run(tmp_path, "restart-server")
    _assert_held(data)
    checks = _checks(data)
    for name in ("commits_while_server_down", "restarted_catches_up", "restarted_serves_its_chunks",
                 "restarted_receives_missed_chunks", "servers_converged", "no_lost_commits", "no_failed_loads"):
        assert checks[name]["ok"], checks[name]
    assert report.exit_code() == 0


@pytest.mark.timeout(240)
def test_restart_whole_cluster_keeps_versions_tags_clocks(tmp_path: Path) -> None:
    report, data = _run(tmp_path, "restart-cluster")
    _assert_held(data)
    checks = _checks(data)
    for name in ("state_intact_after_restart", "no_lost_commits", "versions_bit_exact_after_restart",
                 "tag_load_after_restart", "commits_after_restart", "version_numbers_continue"):
        assert checks[name]["ok"], checks[name]
    assert sum(data["info"]["versions"].values()) >= 3
    assert report.exit_code() == 0


_NETNS_OK, _NETNS_WHY = netns_available()


@pytest.mark.root
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _NETNS_OK, reason=f"partition drill needs root and network namespaces: {_NETNS_WHY}")
def test_partition_leader_cut_off_with_a_minority(tmp_path: Path) -> None:
    report, data = _run(tmp_path, "partition", hold_s=2.0)
    _assert_held(data)
    checks = _checks(data)
    for name in ("majority_elects_leader", "majority_keeps_committing", "majority_next_commit_fast", "minority_commits_nothing",
                 "commits_after_heal", "servers_converged", "no_lost_commits", "monotonic_reads", "loads_bit_exact",
                 "no_failed_loads"):
        assert checks[name]["ok"], checks[name]
    assert data["summary"]["time_to_new_leader"]["max"] <= 5.0
    # Issue #10: the publisher leaves the silent old leader as soon as the majority names a new one:
    # 2 s (two ~1 s call timeouts on the silent replica) plus two of its own pushes as timed just
    # before the cut (issue 41: on a loaded machine a push alone took up to 4.3 s; the election
    # stayed 0.4-1.2 s). Quiet machine: 1.1-1.3 s measured.
    push_s, bound = data["info"]["push_s_before_cut"], data["info"]["next_commit_bound_s"]
    assert bound == pytest.approx(min(10.0, 2.0 + 2 * push_s), abs=0.002)
    assert data["summary"]["time_to_next_commit"]["max"] <= bound
    assert report.exit_code() == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("drill, kw", [
    ("kill-leader", {"rounds": 3}),
    ("corrupt-chunk", {}),  # the probe also writes: it restores a quarantined chunk through PutChunks
    ("restart-cluster", {}),
    pytest.param("partition", {"hold_s": 2.0}, marks=[
        pytest.mark.root,
        pytest.mark.skipif(not _NETNS_OK, reason=f"partition drill needs root and network namespaces: {_NETNS_WHY}")]),
])
def test_drills_run_against_a_mutual_tls_cluster(tmp_path: Path, drill: str, kw: dict) -> None:
    """`--tls`: the servers serve only mutual TLS, and the publisher, the loaders and the probe reach them
    with the cluster's CA and client certificate (partition: on namespace addresses, the certificates'
    SANs)."""
    report, data = _run(tmp_path, drill, tls=True, **kw)
    _assert_held(data)
    assert data["info"]["tls"] is True
    assert data["counters"]["publisher.ok"] > 0 and data["bytes_verified"] > 0
    for log in sorted((tmp_path / "cluster").glob("ps*.log")):
        assert "(mutual TLS), Raft on" in log.read_text(), log
    assert report.exit_code() == 0
