"""Drills: restart one server from its data dir, and restart the whole cluster.

restart-server (under load): stop one follower with SIGKILL, keep publishing
while it is down, start it again from the same data dir. Check: it catches up
(the same versions, tags and vector clocks as the others), it serves every chunk
it held before the stop (read straight from it, CRC-checked by the server and
compared with what it held), and no committed version is lost.

restart-cluster: after a load, SIGKILL every server at once, start them all
again from their data dirs. Check: every committed version, tag and vector
clock is intact (the same state as before, on every server), loads of the tag
and of every committed version are bit-exact, and the cluster commits again.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .framework import (
    check_positive_seconds,
    DrillError,
    Loaded,
    Published,
    Workload,
    check_no_lost_commits,
    check_within,
    check_workload,
    committed_present,
    wait_for,
)
from .partition import judge_final, wait_converged
from .probe import ClusterProbe
from .report import DrillReport, error_kind

if TYPE_CHECKING:
    from deploy.local import LocalCluster


@dataclass(frozen=True)
class RestartConfig:
    down_s: float = 2.0  # restart-server: the publisher keeps committing this long while the server is down
    catch_up_limit_s: float = 60.0  # start -> the restarted server(s) hold everything (includes process start-up)
    commit_limit_s: float = 30.0  # restart-cluster: start -> the first committed write
    settle_s: float = 30.0
    max_verified_versions: int = 20  # restart-cluster: load at most this many committed versions (newest first)
    load_s: float = 3.0  # load runs this long before the fault (restart-cluster) / before the kill (restart-server)
    min_versions: int = 3  # committed versions before the fault, so there is history to lose
    replicate_limit_s: float = 60.0  # restart-server: versions committed while down -> their chunks on the server
    allowed_load_errors: tuple[str, ...] = ()  # the bar: zero failed worker loads

    def validate(self) -> None:
        check_positive_seconds(self, ("down_s", "catch_up_limit_s", "commit_limit_s", "settle_s", "load_s", "replicate_limit_s"))
        if self.min_versions < 1:
            raise DrillError(f"min_versions must be >= 1, got {self.min_versions}")
        if self.max_verified_versions < 1:
            raise DrillError(f"max_verified_versions must be >= 1, got {self.max_verified_versions}")


def _wait_history(report: DrillReport, workload: Workload, config: RestartConfig) -> None:
    """Let the load run load_s and until min_versions are committed (bounded by settle_s)."""
    if workload.wait_success("publisher", after=-1e9, timeout=config.settle_s) is None:
        raise DrillError("the publisher never committed; is the cluster healthy?")
    end = time.monotonic() + config.settle_s
    until = time.monotonic() + config.load_s
    while time.monotonic() < end and (time.monotonic() < until or len(workload.committed()) < config.min_versions):
        time.sleep(0.1)
    if len(workload.committed()) < config.min_versions:
        raise DrillError(f"only {len(workload.committed())} versions committed in {config.settle_s:.0f}s "
                         f"(want {config.min_versions}); is the cluster healthy?")
    report.event("history_ready", versions=len(workload.committed()))


def _chunks_held(probe: ClusterProbe, server: str, committed: list[Published]) -> dict[str, bytes]:
    """Chunk records of committed versions that server holds on disk: id -> record bytes (header + data)."""
    held: dict[str, bytes] = {}
    seen: set[tuple[str, int]] = set()
    for p in committed:
        if (p.model, p.version) in seen:
            continue
        seen.add((p.model, p.version))
        on_disk = probe.records_on_disk(server)  # one read of its segment files
        for cid in probe.chunk_ids(p.model, p.version):
            loc = on_disk.get(cid)
            if cid not in held and loc is not None:
                held[cid] = loc.read_record()
    return held


def check_serves_chunks(report: DrillReport, probe: ClusterProbe, server: str, held: dict[str, bytes]) -> bool:
    """server answers every chunk in held with the bytes it held (the data after the record header)."""
    from paramserver.server.store import HEADER_SIZE

    bad: list[str] = []
    nbytes = 0
    ids = list(held)
    try:
        with probe._client(server) as c:
            got = {ch.id: ch.data for ch in c.get_chunks(ids)}
    except Exception as exc:  # noqa: BLE001 - an error here is the finding
        return report.check("restarted_serves_its_chunks", False, f"{server}: {error_kind(exc)}: {str(exc)[:200]}")
    for cid, content in held.items():
        data = got.get(cid)
        if data is None or bytes(data) != content[HEADER_SIZE:]:
            bad.append(cid[:16])
        else:
            nbytes += len(data)
    report.add_bytes_verified(nbytes)
    return report.check("restarted_serves_its_chunks", bool(held) and not bad,
                        f"{server} served {len(held) - len(bad)}/{len(held)} chunks it held ({nbytes:,} bytes)"
                        + (f"; wrong or missing: {bad[:5]}" if bad else ""))


def run_restart_server(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                       config: RestartConfig = RestartConfig(), probe: ClusterProbe | None = None,
                       server: str | None = None) -> None:
    """Kill one follower (or server), publish while it is down, restart it from its data dir."""
    config.validate()
    probe = probe or ClusterProbe(cluster)
    servers = cluster.running()
    if len(servers) < 3:
        raise DrillError(f"restart-server needs at least 3 running servers (a majority must stay), have {servers}")
    _wait_history(report, workload, config)
    leader = probe.wait_leader(servers, config.settle_s)
    if server is not None and server not in servers:
        raise DrillError(f"--server {server!r} is not a running server of this cluster (running: {servers})")
    victim = server or next(s for s in servers if s != leader)
    report.info.update(servers=servers, leader=leader, restarted=victim)
    held = _chunks_held(probe, victim, workload.committed())
    before = len(workload.committed())
    stopped = report.event("server_killed", server=victim, chunks_on_disk=len(held))
    cluster.kill(victim, signal.SIGKILL)
    time.sleep(config.down_s)
    while_down = len(workload.committed()) - before
    report.check("commits_while_server_down", while_down > 0,
                 f"{while_down} versions committed while {victim} was down")
    started = report.event("server_restarted", server=victim)
    cluster.restart(victim)
    others = [s for s in servers if s != victim]
    want = workload.committed()
    try:
        wait_for(lambda: all(probe.has_version(victim, p.model, p.version) for p in want[-5:]),
                 config.catch_up_limit_s, interval=0.2, what=f"{victim} catching up")
        took = report.measure("time_to_catch_up", started, report.event("caught_up", server=victim)).seconds
    except TimeoutError:
        took = None
    check_within(report, "restarted_catches_up", took, config.catch_up_limit_s)
    report.interval("time_down", started.t - stopped.t, "server_killed", "server_restarted")
    check_serves_chunks(report, probe, victim, held)
    missed = workload.committed()[before:]
    if cluster.config.replication >= len(servers) and missed:
        # Every server holds every chunk (R >= N): re-replication must bring what was pushed while it was down.
        def has_missed() -> bool:
            on_disk = probe.records_on_disk(victim)
            return all(cid in on_disk for p in missed for cid in probe.chunk_ids(p.model, p.version))
        t0 = report.now()
        try:
            wait_for(has_missed, config.replicate_limit_s, interval=0.5, what=f"{victim} receiving missed chunks")
            got = report.now() - t0
            report.interval("time_to_rereplicate", got, "caught_up", "missed_chunks_on_disk")
        except TimeoutError:
            got = None
        check_within(report, "restarted_receives_missed_chunks", got, config.replicate_limit_s)
    workload.stop()
    judge_final(report, workload, probe, [victim, *others], config.settle_s, config.allowed_load_errors, reference=victim)


def run_restart_cluster(cluster: "LocalCluster", report: DrillReport, workload: Workload,
                        config: RestartConfig = RestartConfig(), probe: ClusterProbe | None = None,
                        load_version: Callable[[Published], Loaded] | None = None,
                        load_once: Callable[[], Loaded] | None = None,
                        publish_once: Callable[[], Published] | None = None) -> None:
    """SIGKILL every server, start them again; the state and the bytes must be exactly as before.

    load_version(p): load p.model@p.version with a fresh worker and verify it; load_once(): load by tag;
    publish_once(): one more push after the restart (the cluster must commit again).
    """
    config.validate()
    probe = probe or ClusterProbe(cluster)
    servers = cluster.running()
    if not servers:
        raise DrillError("restart-cluster needs a running cluster")
    _wait_history(report, workload, config)
    workload.stop()  # quiet, so 'before' is the final state
    committed = workload.committed()
    before = wait_converged(probe, servers, config.settle_s)
    if before is None:
        raise DrillError(f"the servers did not agree before the restart: {probe.states(servers)}")
    reference = next(iter(before.values()))
    report.info.update(servers=servers, models=sorted(reference),
                       versions={m: len(v["versions"]) for m, v in reference.items()},
                       tags={m: v["tags"] for m, v in reference.items()})
    killed = report.event("cluster_killed", servers=servers)
    for sid in servers:
        cluster.kill(sid, signal.SIGKILL)
    report.check("all_servers_down", not cluster.running(), f"running after kill: {cluster.running()}")
    started = report.event("cluster_restarted", servers=servers)
    for sid in servers:
        cluster.restart(sid)
    try:
        leader = probe.wait_leader(servers, config.catch_up_limit_s)
        report.measure("time_to_leader", started, report.event("leader_elected", leader=leader))
    except TimeoutError:
        report.event("no_leader", after_s=config.catch_up_limit_s)
    after = wait_converged(probe, servers, config.catch_up_limit_s)
    if after is not None:
        report.measure("time_to_state_back", started, report.event("state_back"))
    after = after or probe.states(servers)
    differ = sorted(sid for sid in servers if after.get(sid) != reference)
    report.check("state_intact_after_restart", len(after) == len(servers) and not differ,
                 f"{len(servers)} servers hold the same {sum(len(v['versions']) for v in reference.values())} versions, "
                 f"tags and vector clocks as before" if not differ and len(after) == len(servers) else
                 f"differ from before: {differ}; answered: {sorted(after)}")
    check_no_lost_commits(report, committed, committed_present(next(iter(after.values()), {})))
    if load_version is not None:
        newest = sorted({(p.model, p.version): p for p in committed}.values(), key=lambda p: -p.version)
        sample = newest[: config.max_verified_versions]
        bad: list[str] = []
        nbytes = 0
        for p in sample:
            try:
                got = load_version(p)
                if got.verified:
                    nbytes += got.nbytes
                else:
                    bad.append(f"v{p.version}: {got.detail}")
            except Exception as exc:  # noqa: BLE001 - an error is a failed check, with the reason
                bad.append(f"v{p.version}: {error_kind(exc)}: {str(exc)[:120]}")
                report.client_error("verifier", exc)
        report.add_bytes_verified(nbytes)
        report.check("versions_bit_exact_after_restart", not bad and bool(sample),
                     f"{len(sample)} committed versions loaded bit-exact ({nbytes:,} bytes)" if not bad else
                     f"{len(bad)}/{len(sample)} bad: {'; '.join(bad[:3])}")
    if load_once is not None:
        try:
            got = load_once()
            tag_version = max((v for v in reference.get(got.model, {}).get("tags", {}).values()), default=None)
            report.check("tag_load_after_restart", got.verified and got.version == tag_version,
                         f"{got.model}:{got.tag} -> v{got.version} (before the restart: v{tag_version}), "
                         f"bit-exact={got.verified}")
            if got.verified:
                report.add_bytes_verified(got.nbytes)
        except Exception as exc:  # noqa: BLE001 - a failed check, reported with its kind
            report.check("tag_load_after_restart", False, f"{error_kind(exc)}: {str(exc)[:200]}")
    if publish_once is not None:
        t0 = time.monotonic()
        deadline = t0 + config.commit_limit_s
        done: Published | None = None
        while done is None and time.monotonic() < deadline:
            try:
                done = publish_once()
            except Exception as exc:  # noqa: BLE001 - retried until the limit; each failure is recorded
                report.client_error("publisher", exc)
                time.sleep(0.2)
        if done is not None:
            report.event("committed_after_restart", version=done.version)
        check_within(report, "commits_after_restart", None if done is None else time.monotonic() - t0,
                     config.commit_limit_s)
        if done is not None:
            top = max((p.version for p in committed if p.model == done.model), default=0)
            report.check("version_numbers_continue", done.version > top,
                         f"new v{done.version} after the last committed v{top}")
    report.interval("restart_total", report.now() - killed.t, "cluster_killed", "drill_end")
    check_workload(report, workload, config.allowed_load_errors)
