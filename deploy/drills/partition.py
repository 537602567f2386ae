"""Drill: cut the leader off with a minority, under load, then heal.

Phases (the cluster must run in namespace mode, ``LocalClusterConfig(netns=True)``):

1. majority view: root-namespace clients (publisher, loaders) sit with the
   majority. The majority must elect a new leader and keep committing.
2. minority view (optional): the clients move to the minority side. Nothing may
   commit there; loaders get current data or a clear staleness error, never an
   older version of the tag (the worker's monotonic reads).
3. heal: every server converges to the same versions, tags and vector clocks,
   and no version the publisher saw committed is missing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .framework import (
    check_positive_seconds,
    DrillError,
    Workload,
    check_converged,
    check_no_lost_commits,
    check_within,
    check_workload,
    committed_present,
    wait_for,
)
from .probe import ClusterProbe
from .report import DrillReport

if TYPE_CHECKING:
    from deploy.local import LocalCluster


@dataclass(frozen=True)
class PartitionDrillConfig:
    hold_s: float = 3.0  # time spent in each partitioned phase under load
    minority_clients: bool = True  # run phase 2 (clients attached to the minority side)
    # A new leader needs the election timeout (0.3-0.6 s) plus the time to notice the
    # silent link; 5 s is "a few election timeouts" with room for a loaded CI machine.
    election_limit_s: float = 5.0
    commit_limit_s: float = 10.0  # cut -> first committed write on the majority side, at all
    # ... and fast: the publisher leaves the silent old leader as soon as a member names the new one
    # (ClusterView.leader_call) instead of waiting out a deadline (issue #10). Measured 1.1-1.3 s on
    # a quiet machine: the election (0.35-0.9 s) overlaps the push's own calls to the silent
    # replica, which fail about 1 s after they are sent (the client channels' keepalive timeout,
    # TCP_USER_TIMEOUT). When they do not overlap, the fault costs two such timeouts (the push in
    # flight at the cut, then the next push's HasChunks to the silent replica): 2 s. The bound is
    # that plus two of the publisher's own pushes as timed just before the cut
    # (next_commit_bound_s): the one in flight finishes or fails before the next one runs. Issue 41,
    # beside two CPU-bound processes on 2 cores (load 9-10): a push alone took 0.1-4.3 s, cut -> next
    # commit 0.02-5.1 s, the election 0.4-1.2 s: the time is scheduling, not the election timeouts.
    failover_limit_s: float = 2.0
    settle_s: float = 30.0  # heal -> every server converged
    commit_grace_s: float = 1.0  # a publish already in flight when the clients move may still land
    # Errors a loader may see while the cluster elects or while it only reaches the minority.
    allowed_load_errors: tuple[str, ...] = ("StaleRead", "UNAVAILABLE", "DEADLINE_EXCEEDED")

    def validate(self) -> None:
        check_positive_seconds(self, ("hold_s", "election_limit_s", "commit_limit_s", "failover_limit_s", "settle_s"))
        if self.commit_grace_s < 0:
            raise DrillError(f"commit_grace_s must be >= 0, got {self.commit_grace_s}")


def split(servers: list[str], leader: str) -> tuple[list[str], list[str]]:
    """(minority with the leader, majority): the largest minority, (n-1)//2 servers, so the cut is the hardest."""
    if leader not in servers:
        raise DrillError(f"leader {leader} is not among the running servers {servers}")
    if len(servers) < 3:
        raise DrillError(f"a partition drill needs at least 3 servers (have {len(servers)}): a smaller cluster has no majority to cut")
    size = (len(servers) - 1) // 2
    others = [s for s in servers if s != leader]
    minority = [leader, *others[: size - 1]]
    return minority, [s for s in servers if s not in minority]


def wait_converged(probe: ClusterProbe, servers: list[str], timeout: float) -> dict[str, Any] | None:
    """The servers' states once all answer and agree; None if they do not within timeout."""
    def agreed() -> dict[str, Any] | None:
        states = probe.states(servers)
        return states if len(states) == len(servers) and len({repr(v) for v in states.values()}) == 1 else None

    try:
        return wait_for(agreed, timeout, interval=0.2, what="every server holding the same versions and tags")
    except TimeoutError:
        return None


def judge_final(report: DrillReport, workload: Workload, probe: ClusterProbe, servers: list[str], settle_s: float,
                allowed_kinds: Sequence[str], reference: str | None = None) -> None:
    """A drill's closing checks on a quiet cluster: the servers converge, no committed version is
    missing from ``reference``'s state (default: the first to answer), and the loaders' invariants."""
    final = wait_converged(probe, servers, settle_s) or probe.states(servers)
    check_converged(report, final)
    state = final.get(reference, {}) if reference is not None else next(iter(final.values()), {})
    check_no_lost_commits(report, workload.committed(), committed_present(state))
    check_workload(report, workload, allowed_kinds)


def wait_steady(report: DrillReport, workload: Workload, probe: ClusterProbe, servers: list[str],
                timeout: float) -> None:
    """Start a fault from a steady state: a commit made, every loader served once, and every server
    holding the latest commit (so a lagging follower's "no such model yet" is not blamed on the fault)."""
    if workload.wait_success("publisher", after=-1e9, timeout=timeout) is None:
        raise DrillError("the publisher never committed before the fault; is the cluster healthy?")
    for name in sorted(n for n in workload.stats if n.startswith("loader-")):
        if workload.wait_success(name, after=-1e9, timeout=timeout) is None:
            raise DrillError(f"{name} never loaded the model before the fault; is the cluster healthy?")
    last = workload.committed()[-1]
    try:
        wait_for(lambda: all(probe.has_version(s, last.model, last.version) for s in servers), timeout,
                 interval=0.1, what=f"every server holding {last.model} v{last.version}")
    except TimeoutError as exc:
        raise DrillError(f"the cluster is not steady before the fault: {exc}") from None
    report.event("steady", servers=servers, version=last.version)


def run_partition(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                  config: PartitionDrillConfig = PartitionDrillConfig(), probe: ClusterProbe | None = None,
                  steer: Callable[[Sequence[str] | None], None] | None = None) -> None:
    """The drill body; the workload must be started (the publisher is needed, loaders are optional).

    steer(addresses): told which servers the root-namespace clients can reach after each cut (None: all),
    so the publisher asks those first (``adapters.Publisher.prefer``).
    """
    def aim(ids: Sequence[str] | None) -> None:
        if steer is not None:
            steer(None if ids is None else [cluster.slot(s).grpc for s in ids])

    config.validate()
    if cluster.topology is None:
        raise DrillError("the partition drill needs a cluster in namespace mode: LocalClusterConfig(netns=True) "
                         "or 'python -m deploy.local up --netns' (root on Linux, iproute2)")
    probe = probe or ClusterProbe(cluster)
    servers = cluster.running()
    old = probe.wait_leader(servers, config.settle_s)
    minority, majority = split(servers, old)
    report.info.update(servers=servers, old_leader=old, minority=minority, majority=majority)
    wait_steady(report, workload, probe, servers, config.settle_s)

    # ---- phase 1: clients with the majority ------------------------------------------------------
    cut = report.event("partitioned", minority=minority, majority=majority, clients="majority")
    aim(majority)
    cluster.partition([minority, majority], host_side=1)
    report.info["cuts"] = cluster.topology.cuts()
    new: str | None = None
    try:
        new = probe.wait_leader(majority, config.election_limit_s * 2, exclude=[old])
        report.event("new_leader", leader=new)
        iv = report.measure("time_to_new_leader", cut, "new_leader").seconds
    except TimeoutError:
        iv = None
    check_within(report, "majority_elects_leader", iv, config.election_limit_s)
    t_commit = workload.wait_success("publisher", after=cut.t, timeout=config.commit_limit_s)
    if t_commit is not None:
        report.event("first_commit_after_cut", at=round(t_commit, 3))
        report.interval("time_to_next_commit", t_commit - cut.t, "partitioned", "first_commit_after_cut")
    to_commit = None if t_commit is None else t_commit - cut.t
    check_within(report, "majority_keeps_committing", to_commit, config.commit_limit_s)
    push_s = max(workload.publish_seconds(before=cut.t), default=0.0)
    bound = min(config.commit_limit_s, config.failover_limit_s + 2 * push_s)
    report.info.update(push_s_before_cut=round(push_s, 3), next_commit_bound_s=round(bound, 3))
    check_within(report, "majority_next_commit_fast", to_commit, bound)
    time.sleep(config.hold_s)

    # ---- phase 2: clients with the minority --------------------------------------------------------
    if config.minority_clients:
        moved = report.event("clients_moved", side="minority")
        aim(minority)
        cluster.partition([minority, majority], host_side=0)
        before = probe.states(minority)
        time.sleep(config.hold_s)
        after = probe.states(minority)
        landed = [t for t in workload.successes("publisher") if t > moved.t + config.commit_grace_s]
        report.check("minority_commits_nothing", not landed and bool(before) and before == after,
                     f"{len(landed)} publishes committed via the minority" if landed else
                     ("the minority did not answer the probe" if not before else
                      "minority state changed while cut off" if before != after else
                      f"no commit in {config.hold_s:.1f}s on the minority side"))

    # ---- heal --------------------------------------------------------------------------------------
    healed = report.event("healed")
    cluster.heal()
    aim(None)
    report.info["cuts"] = {}
    if wait_converged(probe, servers, config.settle_s) is not None:
        report.event("converged")
        report.measure("time_to_converge", healed, "converged")
    t_after = workload.wait_success("publisher", after=healed.t, timeout=config.commit_limit_s)
    check_within(report, "commits_after_heal", None if t_after is None else t_after - healed.t, config.commit_limit_s)
    workload.stop()
    # Judged again after the workload stopped: on a quiet cluster every server must hold the same.
    judge_final(report, workload, probe, servers, config.settle_s, config.allowed_load_errors)
