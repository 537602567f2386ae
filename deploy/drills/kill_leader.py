"""Drill: SIGKILL the leader under load, N rounds; measure failover; restart it and check it catches up.

Per round: time to a new leader (agreed by the survivors), time to the next
committed write (the publisher's first success after the kill), and time for
the restarted server to hold every version committed so far. Over all rounds:
zero failed worker loads, zero lost commits, median and max failover.
"""
from __future__ import annotations

import signal
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from .framework import (
    check_positive_seconds,
    DrillError,
    Published,
    Workload,
    check_within,
    wait_for,
)
from .partition import judge_final, wait_steady
from .probe import ClusterProbe
from .report import DrillReport

if TYPE_CHECKING:
    from deploy.local import LocalCluster


@dataclass(frozen=True)
class KillLeaderConfig:
    rounds: int = 10
    pause_s: float = 1.0  # load keeps running between rounds
    failover_limit_s: float = 5.0  # per round, kill -> next committed write ("a few election timeouts")
    catch_up_limit_s: float = 30.0  # restart -> the restarted server holds every committed version
    target_median_s: float = 0.6  # the target for kill -> next commit; reported, checked if enforce_target
    enforce_target: bool = False  # a noisy CI machine should not fail a correctness drill on speed alone
    allowed_load_errors: tuple[str, ...] = ()  # the bar: zero failed worker loads
    settle_s: float = 30.0

    def validate(self) -> None:
        if not 1 <= self.rounds <= 1000:
            raise DrillError(f"rounds must be 1..1000, got {self.rounds}")
        check_positive_seconds(self, ("failover_limit_s", "catch_up_limit_s", "target_median_s", "settle_s"))
        if self.pause_s < 0:
            raise DrillError(f"pause_s must be >= 0, got {self.pause_s}")


def run_kill_leader(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                    config: KillLeaderConfig = KillLeaderConfig(), probe: ClusterProbe | None = None) -> None:
    config.validate()
    probe = probe or ClusterProbe(cluster)
    if len(cluster.running()) < 3:
        raise DrillError(f"kill-leader needs at least 3 running servers, have {cluster.running()}")
    report.info.update(rounds=config.rounds, servers=cluster.running())
    wait_steady(report, workload, probe, cluster.running(), config.settle_s)
    failovers: list[float] = []
    for r in range(config.rounds):
        servers = cluster.running()
        old = probe.wait_leader(servers, config.settle_s)
        survivors = [s for s in servers if s != old]
        killed = report.event("leader_killed", round=r, leader=old)
        cluster.kill(old, signal.SIGKILL)
        try:
            new = probe.wait_leader(survivors, config.failover_limit_s * 2, exclude=[old])
            report.measure("time_to_new_leader", killed, report.event("new_leader", round=r, leader=new))
        except TimeoutError:
            report.event("no_new_leader", round=r)
        t_commit = workload.wait_success("publisher", after=killed.t, timeout=config.failover_limit_s * 2)
        if t_commit is not None:
            failovers.append(t_commit - killed.t)
            report.interval("time_to_next_commit", t_commit - killed.t, "leader_killed", "next_commit")
        check_within(report, f"round{r}_failover", None if t_commit is None else t_commit - killed.t,
                     config.failover_limit_s)
        # Restart the killed server from its data dir; it must catch up with everything committed.
        restarted = report.event("restarted", round=r, server=old)
        cluster.restart(old)
        want = workload.committed()
        try:
            wait_for(partial(_holds, probe, old, want[-5:]), config.catch_up_limit_s, interval=0.2, what=f"{old} catching up")
            report.measure("time_to_catch_up", restarted, report.event("caught_up", round=r, server=old))
            caught = True
        except TimeoutError:
            caught = False
        report.check(f"round{r}_restarted_catches_up", caught,
                     f"{old} holds the last {min(5, len(want))} committed versions" if caught else
                     f"{old} still missing versions after {config.catch_up_limit_s:.0f}s")
        time.sleep(config.pause_s)

    workload.stop()
    if failovers:
        med, worst = statistics.median(failovers), max(failovers)
        report.info.update(failover_median_s=round(med, 3), failover_max_s=round(worst, 3),
                           failover_target_median_s=config.target_median_s)
        if config.enforce_target:
            report.check("failover_median_under_target", med <= config.target_median_s,
                         f"median {med:.3f}s, max {worst:.3f}s (target {config.target_median_s}s)")
    judge_final(report, workload, probe, cluster.running(), config.settle_s, config.allowed_load_errors)


def _holds(probe: ClusterProbe, server: str, versions: list[Published]) -> bool:
    """``server`` holds every one of ``versions`` (the restarted server has caught up)."""
    return all(probe.has_version(server, p.model, p.version) for p in versions)
