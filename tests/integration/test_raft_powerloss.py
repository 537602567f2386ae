"""Power loss of the whole metadata cluster, on a file system that drops every unsynced write.

The three servers keep their Raft state on tests/powerloss (FUSE, in memory; only fsync and
folder fsync make data durable). Each round: start the cluster from whatever survived, check
that every commit ever acknowledged is on every server, commit from two writers, then cut the
power at a random moment, kill -9 all three and unmount. Ten rounds, then a last check.
Log compaction is set low so the full dump, the journal rewrite and snapshot installs are cut
through too. Root only (FUSE mount), skipped with the reason elsewhere.

A missing commit is reported as lost (missing on a majority: no server can bring it back) or
as not caught up (on a majority, so the leader replicates it; only this server lags, e.g. on a
loaded machine), with what each server holds. POWERLOSS_SEED=N repeats a run's cut moments
(the seed is printed); the interleaving of the servers still differs from run to run.
"""
from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from consensus.errors import Conflict, MetadataError, NotFound
from tests.powerloss import PowerLossMount, unavailable_reason

from .consensus_harness import Cluster, DevNode, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.root,
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
]
MANIFEST = "ef" * 32
ROUNDS = 10
CATCH_UP = 30.0  # for all three servers to hold every acknowledged commit
SLOW_CATCH_UP = 60.0  # more, for one that lags while a majority holds everything

Acked = dict[str, set[int]]  # model -> version numbers whose commit was acknowledged


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[PowerLossMount]:
    m = PowerLossMount(tmp_path / "mnt", tmp_path / "fs")
    try:
        yield m
    finally:
        m.close()


def start_all(cluster: Cluster) -> None:
    """Start the three at once (a restart after a power loss is that, too)."""
    errors: list[BaseException] = []

    def start(node: DevNode) -> None:
        try:
            node.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,)) for n in cluster.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    cluster.wait_ready(60)


def missing_on(node: DevNode, acked: Acked) -> dict[str, set[int]]:
    missing = {}
    for model, numbers in acked.items():
        if not numbers:
            continue
        try:
            versions = node.call("list_versions", model=model, wait=10)["value"]
        except NotFound:
            versions = []
        assert all(v["manifest_id"] == MANIFEST for v in versions)
        lost = numbers - {v["number"] for v in versions}
        if lost:
            missing[model] = lost
    return missing


def check_all_present(cluster: Cluster, acked: Acked, when: str) -> None:
    """Every acknowledged commit on every server; a failure says whether it is lost or lagging."""
    def holdings() -> dict[str, dict[str, set[int]] | str]:
        held: dict[str, dict[str, set[int]] | str] = {}
        for n in cluster.nodes:
            try:
                held[n.server_id] = missing_on(n, acked)
            except (MetadataError, TimeoutError) as exc:  # a server that cannot answer: nothing we know of
                held[n.server_id] = f"no answer: {exc!r}"
        return held

    def all_there() -> bool:
        return all(not m for m in holdings().values())

    try:
        wait_until(all_there, CATCH_UP, interval=0.2, what="catch-up")
        return
    except TimeoutError:
        pass
    held = holdings()
    lost = {(model, number) for model, numbers in acked.items() for number in numbers
            if sum(1 for m in held.values() if isinstance(m, str) or number in m.get(model, ())) * 2
            > len(cluster.nodes)}
    if lost:
        raise AssertionError(f"{when}: acknowledged commits LOST (missing on a majority): {sorted(lost)}; "
                             f"missing per server: {held}")
    try:  # on a majority: the leader brings them to the others, given time
        wait_until(all_there, SLOW_CATCH_UP, interval=0.5, what="slow catch-up")
    except TimeoutError:
        raise AssertionError(f"{when}: acknowledged commits on a majority but not caught up on every server "
                             f"after {CATCH_UP + SLOW_CATCH_UP:.0f}s: missing per server {holdings()}") from None


class Writer(threading.Thread):
    """Commits versions of its own model one after another; records each acknowledged one."""

    def __init__(self, node: DevNode, model: str, acked: Acked, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.node, self.model, self.acked, self.stop = node, model, acked, stop
        self.acked.setdefault(model, set())

    def run(self) -> None:
        parent = None
        while not self.stop.is_set():
            try:
                number = int(self.node.call("commit_version", wait=10, model=self.model, manifest_id=MANIFEST,
                                            parent=parent, publisher=self.model, nbytes=1, chunk_count=1)["number"])
            except (MetadataError, TimeoutError) as exc:
                if self.stop.is_set():
                    return
                if isinstance(exc, Conflict):  # an earlier try committed but its answer was lost
                    head = self.node.call("head", model=self.model, wait=10)["value"]
                    parent = head["number"] if head else None
                time.sleep(0.05)
                continue
            self.acked[self.model].add(number)  # only now is it acknowledged
            parent = number


@pytest.mark.timeout(360)
def test_acknowledged_commits_survive_ten_power_losses_of_the_whole_cluster(
        mount: PowerLossMount, tmp_path: Path) -> None:
    seed = int(os.environ.get("POWERLOSS_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    (tmp_path / "logs").mkdir()
    mount.start()
    cluster = Cluster(mount.mountpoint, size=3, log_dir=tmp_path / "logs",
                      extra_args=["--log-compaction-min-entries", "40"])
    acked: Acked = {}
    report = []
    started = time.monotonic()
    try:
        for round_no in range(ROUNDS):
            start_all(cluster)
            check_all_present(cluster, acked, f"round {round_no} start (seed {seed})")
            stop = threading.Event()
            leader = cluster.leader()
            writers = [Writer(leader if k == 0 else next(n for n in cluster.nodes if n is not leader),
                              f"r{round_no}w{k}", acked, stop) for k in range(2)]
            for w in writers:
                w.start()
            time.sleep(rng.uniform(0.3, 1.5))  # the random moment
            before = sum(len(v) for v in acked.values())
            cut = mount.cut()
            for node in cluster.nodes:
                node.kill()
            stop.set()
            for w in writers:
                w.join(timeout=20)
            # A writer still running could record a commit after the check began.
            assert not any(w.is_alive() for w in writers), "a writer did not stop within 20s of the cut"
            mount.unmount()
            report.append((round_no, before, cut["files_changed_unsynced"], cut["names_changed_unsynced"]))
            mount.start()
        start_all(cluster)
        check_all_present(cluster, acked, f"after round {ROUNDS} (seed {seed})")
        # Log compaction ran under the cuts too: every server restarted from a full dump.
        assert all((n.data_dir / "raft.dump").exists() for n in cluster.nodes)
    finally:
        cluster.close()
        print(f"power-loss rounds (seed {seed}, {time.monotonic() - started:.1f}s): "
              + "; ".join(f"#{r} acked {a} unsynced files {f} names {n}" for r, a, f, n in report))
    total = sum(len(v) for v in acked.values())
    assert total >= ROUNDS * 5, f"only {total} commits were acknowledged in {ROUNDS} rounds"
    # Not vacuous: cuts did find unsynced writes to throw away (a cut can also land between two syncs).
    assert sum(f for _, _, f, _ in report) > 0, report


@pytest.mark.timeout(60)
def test_without_fsync_a_power_loss_loses_acknowledged_commits(mount: PowerLossMount, tmp_path: Path) -> None:
    """The control: the same cut with --no-fsync loses what was acknowledged, so the test above can fail."""
    (tmp_path / "logs").mkdir()
    mount.start()
    cluster = Cluster(mount.mountpoint, size=3, log_dir=tmp_path / "logs", extra_args=["--no-fsync"])
    try:
        start_all(cluster)
        leader = cluster.leader()
        parent = None
        for _ in range(5):
            parent = int(leader.call("commit_version", model="m", manifest_id=MANIFEST, parent=parent,
                                     publisher="p", nbytes=1, chunk_count=1)["number"])
        mount.cut()
        for node in cluster.nodes:
            node.kill()
        mount.unmount()
        mount.start()
        start_all(cluster)
        assert all(missing_on(n, {"m": set(range(1, 6))}) for n in cluster.nodes)
    finally:
        cluster.close()
