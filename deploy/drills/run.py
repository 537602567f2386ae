"""Run a fault drill under load and report: ``python -m deploy.drills DRILL [options]``.

Drills: kill-leader, partition, corrupt-chunk, restart-server, restart-cluster.

By default the drill starts a fresh local cluster (``deploy.local.LocalCluster``;
in network-namespace mode for ``partition``, which needs root) in a temporary
folder and stops it afterwards (``--tls``: with mutual TLS). With ``--cluster-dir DIR`` it drives a cluster
already started by ``python -m deploy.local up --dir DIR`` (the drill needs
its pids and data dirs to kill, restart and corrupt; the cluster is left
running). It runs a real publisher (``paramserver.client.push``) and real loaders
(``worker.loader``), prints the report tables, writes a JSON report and
exits 0 when every invariant held, 1 when one broke, 2 when the drill could
not run (no cluster, not root for ``partition``, bad options, a ``--json`` path
that cannot be written), 130 when interrupted.

``main(argv)`` is the entry point ``paramctl drill ...`` calls; ``execute``
is the same as a library call (the tests use it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from paramserver.wire.cli_args import OneLineParser

from .framework import DrillError, Workload, WorkloadConfig, run_drill
from .report import DrillReport

if TYPE_CHECKING:
    from deploy.local import LocalCluster

    from .framework import Loaded

DRILLS = ("kill-leader", "partition", "corrupt-chunk", "restart-server", "restart-cluster")
EXIT_CANNOT_RUN = 2
EXIT_INTERRUPTED = 130

# Server options of a fresh drill cluster, per drill (every drill adds --no-fsync: kill -9 keeps the page cache).
FRESH_SERVER_ARGS: dict[str, tuple[str, ...]] = {
    # No hot cache, so reads reach the corrupt files; quick repair; a slow scrubber, so the
    # read-path phases are not raced by it (one pass over a drill's data takes ~10 s at 1 MB/s),
    # kept at that rate while the drill's loads run (it would slow to an eighth under traffic).
    "corrupt-chunk": ("--cache-mb", "0", "--repair-interval", "0.5", "--scrub-mb-per-s", "1", "--scrub-busy-fraction", "1"),
    "restart-server": ("--anti-entropy-interval", "2"),
}


@dataclass(frozen=True)
class DrillOptions:
    drill: str
    rounds: int = 10  # kill-leader
    hold_s: float = 3.0  # partition: seconds in each partitioned phase
    down_s: float = 2.0  # restart-server: seconds the server stays down under load
    server: str | None = None  # restart-server: which server (default: a follower)
    loaders: int = 2
    publish_interval_s: float | None = None  # None: the drill's default
    servers: int = 3  # fresh cluster size
    cluster_dir: Path | None = None  # drive this running cluster instead of a fresh one
    fresh_dir: Path | None = None  # folder for the fresh cluster (default: a new temporary folder)
    json_path: Path | None = None  # default: <cluster folder>/<drill>-<UTC time>.json
    render: bool = True
    tls: bool = False  # the fresh cluster runs mutual TLS (a --cluster-dir cluster keeps its own setting)
    ready_timeout_s: float = 90.0

    def validate(self) -> None:
        if self.drill not in DRILLS:
            raise DrillError(f"unknown drill {self.drill!r}; choose one of {', '.join(DRILLS)}")
        if not 1 <= self.rounds <= 1000:
            raise DrillError(f"--rounds must be 1..1000, got {self.rounds}")
        if not 0 <= self.loaders <= 64:
            raise DrillError(f"--loaders must be 0..64, got {self.loaders}")
        if self.hold_s <= 0 or self.down_s <= 0:
            raise DrillError("--hold and --down must be > 0 seconds")
        if self.publish_interval_s is not None and self.publish_interval_s < 0:
            raise DrillError(f"--publish-interval must be >= 0, got {self.publish_interval_s}")
        if not 3 <= self.servers <= 15:
            raise DrillError(f"--servers must be 3..15 (a drill needs a majority that survives), got {self.servers}")
        if self.cluster_dir is not None and self.fresh_dir is not None:
            raise DrillError("give either --cluster-dir (a running cluster) or --dir (a fresh one), not both")
        if self.cluster_dir is not None and self.tls:
            raise DrillError("--tls starts a fresh cluster with mutual TLS; a --cluster-dir cluster keeps its own "
                             "setting (start it with 'python -m deploy.local up --tls'): drop --tls")
        if self.json_path is not None:
            check_report_path(self.json_path)

    @property
    def interval(self) -> float:
        if self.publish_interval_s is not None:
            return self.publish_interval_s
        return 1.0 if self.drill == "corrupt-chunk" else 0.2  # corrupt-chunk: few versions, so the scrubber keeps up


def check_report_path(path: Path) -> None:
    """Refuse a --json path the report could not be written to, before a drill runs for minutes and
    its report is lost. It is probed, not judged by mode bits (root passes those even on /proc)."""
    path = Path(path)
    if path.is_dir():
        raise DrillError(f"--json {path} is a folder: give a file name for the report, e.g. {path / 'report.json'}")
    # The report is written as a temporary file beside it, then renamed; missing folders are made.
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
        os.rmdir(tempfile.mkdtemp(prefix=".drill-probe-", dir=folder))
    except OSError as exc:
        reason = exc.strerror if exc.strerror else str(exc)
        raise DrillError(f"--json {path}: the report cannot be written there ({reason} in {folder}); "
                         f"give a file in a folder you can write") from None


def _open_cluster(opts: DrillOptions) -> tuple["LocalCluster", bool]:
    """(cluster, owned): a running one from --cluster-dir, or a fresh one this call starts (and must stop)."""
    from deploy.local import LauncherError, LocalCluster, LocalClusterConfig

    if opts.cluster_dir is not None:
        cluster = LocalCluster.load_state(opts.cluster_dir)
        if not cluster.running():
            raise LauncherError(f"no server of the cluster under {opts.cluster_dir} is running; "
                                f"start it with 'python -m deploy.local up --dir {opts.cluster_dir}'")
        cluster.wait_ready(opts.ready_timeout_s)
        return cluster, False
    root = opts.fresh_dir or Path(tempfile.mkdtemp(prefix=f"drill-{opts.drill}-"))
    extra = ("--no-fsync", *FRESH_SERVER_ARGS.get(opts.drill, ()))
    cluster = LocalCluster(LocalClusterConfig(root=root, servers=opts.servers, netns=opts.drill == "partition",
                                              extra_args=extra, tls=opts.tls))
    cluster.up(wait=opts.ready_timeout_s)
    return cluster, True


def _cache_off(cluster: "LocalCluster") -> bool:
    """True when every server runs with --cache-mb 0, so chunk reads reach the disk."""
    def off(args: list[str]) -> bool:
        return any(a == "--cache-mb" and i + 1 < len(args) and float(args[i + 1]) == 0 for i, a in enumerate(args))

    return all(off(s.args) for s in cluster.slots)


def default_json_path(cluster: "LocalCluster", drill: str) -> Path:
    return cluster.root / f"{drill}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"


def execute(opts: DrillOptions) -> tuple[DrillReport, Path]:
    """Run one drill; returns its report and where the JSON went. Raises DrillError / LauncherError
    when the drill cannot run at all (no cluster, no namespaces)."""
    from .adapters import LoaderPool, ModelSpec, Publisher

    opts.validate()
    cluster, owned = _open_cluster(opts)
    try:
        settings = cluster.client_settings()  # addresses, tokens and, under --tls, the CA and client certificate
        addresses = cluster.addresses
        spec = ModelSpec()
        publisher = Publisher(settings, spec)
        loaders = LoaderPool(settings, spec)
        json_path = opts.json_path or default_json_path(cluster, opts.drill)
        try:
            body = _body(opts, cluster, spec, publisher)

            def run(report: DrillReport) -> None:
                report.info.update(cluster=str(cluster.root), fresh_cluster=owned, addresses=addresses,
                                   tls=cluster.config.tls,
                                   workload={"loaders": opts.loaders, "publish_interval_s": opts.interval,
                                             "model": spec.model, "tag": spec.tag})
                w = Workload(report, publish=publisher, load=loaders if opts.loaders else None,
                             config=WorkloadConfig(loaders=opts.loaders, publish_interval_s=opts.interval))
                w.start()
                try:
                    body(report, w)
                finally:
                    w.stop()

            report = run_drill(opts.drill, run, render=opts.render)
            return report, _write_report(report, json_path, opts.drill)
        finally:
            loaders.close()
    finally:
        if owned:
            cluster.down()


def _write_report(report: DrillReport, path: Path, drill: str) -> Path:
    """Write the JSON report to ``path``; if that fails after all (the folder went away, the disk filled), to
    a temporary file instead, so a drill's minutes of results are not lost. Returns where it went."""
    try:
        return report.write_json(path)
    except OSError as exc:
        fd, spare = tempfile.mkstemp(prefix=f"{drill}-", suffix=".json")
        os.close(fd)
        report.write_json(spare)
        print(f"warning: cannot write the report to {path} ({exc.strerror or exc}); wrote it to {spare}", file=sys.stderr)
        return Path(spare)


def _body(opts: DrillOptions, cluster: "LocalCluster", spec: object,
          publisher: object) -> Callable[[DrillReport, Workload], None]:
    """The drill body for opts.drill, closed over the cluster and the real client operations."""
    from .adapters import LoaderPool, ModelSpec, Publisher, load_version

    assert isinstance(spec, ModelSpec) and isinstance(publisher, Publisher)
    settings = publisher.settings

    def load_once() -> Loaded:
        fresh = LoaderPool(settings, spec)  # a new worker: no client cache hides anything
        try:
            return fresh(0, 0)
        finally:
            fresh.close()

    if opts.drill == "partition":
        from .partition import PartitionDrillConfig, run_partition

        return lambda r, w: run_partition(cluster, r, w, PartitionDrillConfig(hold_s=opts.hold_s),
                                          steer=publisher.prefer)
    if opts.drill == "kill-leader":
        from .kill_leader import KillLeaderConfig, run_kill_leader

        return lambda r, w: run_kill_leader(cluster, r, w, KillLeaderConfig(rounds=opts.rounds))
    if opts.drill == "corrupt-chunk":
        from .corrupt_chunk import CorruptChunkConfig, run_corrupt_chunk

        # One tensor whose weights no other model or version shares, and that no loader reads.
        cold = Publisher(settings, ModelSpec(model="drill-cold", tensors=1), publisher.config)
        cold_seed = 10_000_000 + int(time.time() * 1000) % 10_000_000
        cfg = CorruptChunkConfig(expect_disk_reads=_cache_off(cluster))
        return lambda r, w: run_corrupt_chunk(cluster, r, w, cfg, load_once=load_once,
                                              publish_cold=lambda: cold(cold_seed))
    from .restart import RestartConfig, run_restart_cluster, run_restart_server

    if opts.drill == "restart-server":
        return lambda r, w: run_restart_server(cluster, r, w, RestartConfig(down_s=opts.down_s), server=opts.server)
    return lambda r, w: run_restart_cluster(
        cluster, r, w, RestartConfig(),
        load_version=lambda p: load_version(settings, spec, p.version, p.seed),
        load_once=load_once, publish_once=lambda: publisher(900_001))


def build_parser(prog: str = "python -m deploy.drills") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Run a fault drill under load (a publisher and loaders) "
                                "and check the invariants: no committed version lost, no wrong bytes, no rolled-back tag.")
    p.add_argument("drill", choices=DRILLS, help="which fault to inject")
    where = p.add_argument_group("cluster (default: a fresh local cluster in a temporary folder, stopped afterwards)")
    where.add_argument("--cluster-dir", type=Path, default=None, metavar="DIR",
                       help="drive the running cluster started with 'python -m deploy.local up --dir DIR' "
                            "(partition needs one started with --netns); it is left running")
    where.add_argument("--dir", type=Path, default=None, help="folder for the fresh cluster (kept afterwards, with logs)")
    where.add_argument("--servers", type=int, default=3, help="fresh cluster size (default 3)")
    where.add_argument("--tls", action="store_true",
                       help="the fresh cluster runs mutual TLS (a private CA and per-server certificates, as "
                            "'python -m deploy.local up --tls'); a --cluster-dir cluster keeps its own setting")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="write the JSON report here (default: <cluster folder>/<drill>-<UTC time>.json)")
    p.add_argument("--rounds", type=int, default=10, help="kill-leader: kill/restart rounds (default 10)")
    p.add_argument("--hold", type=float, default=3.0, help="partition: seconds in each partitioned phase (default 3)")
    p.add_argument("--down", type=float, default=2.0, help="restart-server: seconds the server stays down (default 2)")
    p.add_argument("--server", default=None, metavar="ID",
                   help="restart-server: the server to restart, e.g. ps2 (default: a follower)")
    p.add_argument("--loaders", type=int, default=2, help="loader threads loading the model by tag (default 2)")
    p.add_argument("--publish-interval", type=float, default=None,
                   help="seconds between publishes (default 0.2; corrupt-chunk 1.0)")
    p.add_argument("--quiet", action="store_true", help="no tables, only the verdict line and the JSON path")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m deploy.drills") -> int:
    from deploy.local import LauncherError

    args = build_parser(prog).parse_args(argv)
    opts = DrillOptions(drill=args.drill, rounds=args.rounds, hold_s=args.hold, down_s=args.down, server=args.server,
                        loaders=args.loaders, publish_interval_s=args.publish_interval, servers=args.servers,
                        cluster_dir=args.cluster_dir, fresh_dir=args.dir, json_path=args.json, render=not args.quiet,
                        tls=args.tls)
    try:
        report, path = execute(opts)
    except (DrillError, LauncherError) as exc:
        print(f"error: drill {args.drill} could not run: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt:
        print(f"error: drill {args.drill} interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.quiet:
        broken = ", ".join(c.name for c in report.broken)
        print(f"drill {args.drill}: " + (f"invariant broken: {broken}" if broken else "every invariant held"))
    print(f"report: {path}")
    return report.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
