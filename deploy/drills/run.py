"""Run a drill end to end on a fresh local cluster: ``python -m deploy.drills partition|kill-leader|corrupt-chunk``.

This is the harness ``paramctl drill ...`` can wrap: it starts a LocalCluster
(in namespace mode for the partition drill), runs the real publisher and
loaders from ``adapters``, prints the report tables, writes ``<out>/<drill>.json``
and exits 1 when an invariant broke (2 when the cluster could not start).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from .framework import Workload, WorkloadConfig, run_drill
from .report import DrillReport

DRILLS = ("partition", "kill-leader", "corrupt-chunk")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.drills", description=__doc__.split("\n")[0])
    p.add_argument("drill", choices=DRILLS)
    p.add_argument("--servers", type=int, default=3, help="cluster size (default 3)")
    p.add_argument("--dir", type=Path, default=None, help="cluster folder (default: a new temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON report (default: the cluster folder)")
    p.add_argument("--rounds", type=int, default=10, help="kill-leader: rounds (default 10)")
    p.add_argument("--loaders", type=int, default=2, help="loader threads (default 2)")
    p.add_argument("--hold", type=float, default=3.0, help="partition: seconds in each partitioned phase (default 3)")
    args = p.parse_args(argv)

    from deploy.local import LauncherError, LocalCluster, LocalClusterConfig

    from .adapters import LoaderPool, ModelSpec, make_publisher

    root = args.dir or Path(tempfile.mkdtemp(prefix=f"drill-{args.drill}-"))
    extra = ("--no-fsync", "--repair-interval", "0.5") if args.drill == "corrupt-chunk" else ("--no-fsync",)
    cluster = LocalCluster(LocalClusterConfig(root=root, servers=args.servers, netns=args.drill == "partition",
                                              extra_args=extra))
    try:
        cluster.up(wait=90)
    except LauncherError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = ModelSpec()
    loaders = LoaderPool(cluster.addresses, spec)
    try:
        publish = make_publisher(cluster.addresses, spec)
        body = _body(args, cluster, spec)

        def run(report: DrillReport) -> None:
            w = Workload(report, publish=publish, load=loaders, config=WorkloadConfig(loaders=args.loaders))
            w.start()
            try:
                body(report, w)
            finally:
                w.stop()

        report = run_drill(args.drill, run, out_dir=args.out or root)
        print(f"report: {(args.out or root) / (args.drill + '.json')}")
        return report.exit_code()
    finally:
        loaders.close()
        cluster.down()


def _body(args: argparse.Namespace, cluster: object, spec: object) -> Callable[[DrillReport, Workload], None]:
    """The drill body for args.drill, closed over the cluster (and, for corrupt-chunk, a cold publisher)."""
    from .adapters import LoaderPool, ModelSpec, make_publisher

    if args.drill == "partition":
        from .partition import PartitionDrillConfig, run_partition

        return lambda r, w: run_partition(cluster, r, w, PartitionDrillConfig(hold_s=args.hold))  # type: ignore[arg-type]
    if args.drill == "kill-leader":
        from .kill_leader import KillLeaderConfig, run_kill_leader

        return lambda r, w: run_kill_leader(cluster, r, w, KillLeaderConfig(rounds=args.rounds))  # type: ignore[arg-type]
    from .corrupt_chunk import run_corrupt_chunk

    addresses = cluster.addresses  # type: ignore[attr-defined]
    cold = make_publisher(addresses, ModelSpec(model="drill-cold", tensors=2))

    def load_once():  # type: ignore[no-untyped-def]
        fresh = LoaderPool(addresses, spec)  # type: ignore[arg-type]
        try:
            return fresh(0, 0)
        finally:
            fresh.close()

    return lambda r, w: run_corrupt_chunk(cluster, r, w, load_once=load_once,  # type: ignore[arg-type]
                                          publish_cold=lambda: cold(1))  # type: ignore[arg-type,return-value]
