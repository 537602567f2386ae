"""Local cluster launcher: N real ``paramserver`` processes on 127.0.0.1.

    python -m deploy.local up --servers 3 --dir .cluster
    python -m deploy.local status --dir .cluster
    python -m deploy.local down --dir .cluster

With ``--netns`` (root on Linux, iproute2) each server runs in its own network
namespace on a private bridge (see ``deploy.netns``) and binds its namespace's
address instead of 127.0.0.1; clients in the root namespace reach every server
through the topology's host port. Then real partitions can be cut and healed:

    python -m deploy.local up --netns --dir .cluster
    python -m deploy.local partition --dir .cluster --group ps1 --group ps2,ps3
    python -m deploy.local heal --dir .cluster

The same ``LocalCluster`` class drives the integration tests and the fault
drills, so what the tests exercise is what a user launches.

Failures print one line, ``error: ...``, and exit with the CLIs' codes: 1 other, 2 bad arguments
(or a damaged cluster.json), 3 no cluster there, 4 a cluster already running there (or a port it
needs taken), 6 not ready in time, 130 interrupted.

The launcher's parts: ``local_layout`` (configuration, slots, ports), ``local_cluster`` (``LocalCluster``),
``local_files`` (secrets, certificates, client config, state file), ``local_procs`` (process checks).
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

from paramserver.wire.cli_args import OneLineParser, float_in, int_in

# The launcher's parts, one module each; every name below was importable from here when this was one module.
from .errors import (EXIT_BAD_ARGUMENTS, EXIT_CONFLICT, EXIT_INTERRUPTED, EXIT_NOT_FOUND, EXIT_OTHER, EXIT_UNAVAILABLE,
                     LauncherError)
from .local_cluster import LocalCluster
from .local_files import ClusterFiles, read_secret, write_private
from .local_layout import (CLIENT_CERT, CLIENT_CONFIG, NETNS_GRPC_PORT, NETNS_RAFT_PORT, SECRET_FILES, SECRETS_DIR,
                           STATE_FILE, TLS_DIR, LocalClusterConfig, ServerSlot, free_port, free_ports)
from .local_procs import alive, log_tail, signal_slot

_alive, _signal, _tail, _read_secret, _write_private = alive, signal_slot, log_tail, read_secret, write_private  # old names

__all__ = [
    "CLIENT_CERT", "CLIENT_CONFIG", "EXIT_BAD_ARGUMENTS", "EXIT_CONFLICT", "EXIT_INTERRUPTED", "EXIT_NOT_FOUND", "EXIT_OTHER",
    "EXIT_UNAVAILABLE", "NETNS_GRPC_PORT", "NETNS_RAFT_PORT", "SECRET_FILES", "SECRETS_DIR", "STATE_FILE", "TLS_DIR",
    "ClusterFiles", "LauncherError", "LocalCluster", "LocalClusterConfig", "ServerSlot", "free_port", "free_ports", "main",
]


def _secret_arg(key: str, path: Path | None, env: str) -> str | None:
    """A secret given to 'up': read as the servers read theirs, else from ``env``."""
    from paramserver.server.config import read_secret_file
    from paramserver.server.errors import ConfigError

    if path is None:
        return os.environ.get(env) or None
    try:
        return read_secret_file(key, path)
    except ConfigError as exc:
        raise LauncherError(str(exc), EXIT_BAD_ARGUMENTS) from None


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m deploy.local", description="Run a local paramserver cluster on 127.0.0.1.")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start N servers and wait for a leader")
    up.add_argument("--servers", type=int_in(1, 15, "--servers"), default=3, help="number of servers, 1 to 15 (default 3)")
    up.add_argument("--dir", default=".cluster", help="folder for data dirs, logs and cluster.json (default .cluster)")
    up.add_argument("--base-port", type=int, default=0, help="first port; gRPC = base+2i, Raft = base+2i+1 (default: free ports)")
    up.add_argument("--replication", type=int_in(1, 15, "--replication"), default=3,
                    help="replicas per chunk, 1 to 15, capped by the cluster size (default 3)")
    up.add_argument("--admin-token-file", type=Path, metavar="FILE",
                    help="file with the token for writes (or env PARAMS_ADMIN_TOKEN; default: generated)")
    up.add_argument("--read-token-file", type=Path, metavar="FILE",
                    help="file with the token for reads (or env PARAMS_READ_TOKEN; default: generated)")
    up.add_argument("--cluster-secret-file", type=Path, metavar="FILE",
                    help="file with the secret that encrypts and authenticates Raft traffic (or env PARAMS_CLUSTER_SECRET; "
                         "default: generated)")
    up.add_argument("--no-secrets", action="store_true",
                    help="generate no tokens and no cluster secret: every port open to anyone on this machine "
                         "(loopback only; not with --netns)")
    up.add_argument("--timeout", type=float_in(0, 3600, "--timeout"), default=60.0,
                    help="seconds to wait for a leader, above 0 and at most 3600 (default 60)")
    up.add_argument("--netns", action="store_true",
                    help="run each server in its own network namespace on a private bridge, so partitions can be cut "
                         "(root on Linux, iproute2); servers then bind 10.231.X.i instead of 127.0.0.1")
    up.add_argument("--subnet", help="with --netns: a private /24 for the bridge (default: a free 10.231.X.0/24)")
    up.add_argument("--client-namespaces", type=int_in(0, 16, "--client-namespaces"), default=0,
                    help="with --netns: extra client namespaces on the bridge, 0 to 16, for loaders on one side (default 0)")
    up.add_argument("--tls", action="store_true",
                    help="mutual TLS: make a private CA, a certificate per server and one client certificate under "
                         "DIR/tls (reused on restart); servers call each other with their own certificate; the bulk "
                         "read port is off (reads go over gRPC) (default: plaintext)")
    add = sub.add_parser("add", help="start one more server that joins the running cluster once "
                                     "'paramctl member add' (printed) adds it")
    add.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    start = sub.add_parser("start", help="start one stopped server of a running cluster again (after a crash or a kill), "
                                         "on its ports and data dir")
    start.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    start.add_argument("server_id", metavar="ID")
    forget = sub.add_parser("forget", help="stop a server and drop it from the folder's state, after "
                                           "'paramctl member remove' took it out of the cluster (its data stays)")
    forget.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
    forget.add_argument("server_id", metavar="ID")
    for name, text in (("down", "stop every server of the cluster"), ("status", "show servers, pids and the leader"),
                       ("partition", "cut the network between groups of servers (--netns clusters only)"),
                       ("heal", "restore full connectivity (--netns clusters only)")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("--dir", default=".cluster", help="the cluster's folder (default .cluster)")
        if name == "partition":
            sp.add_argument("--group", action="append", required=True, metavar="ID[,ID...]",
                            help="server ids on one side, e.g. --group ps1 --group ps2,ps3 (every server in one group)")
            sp.add_argument("--host-side", type=int, default=None, metavar="K",
                            help="attach root-namespace clients to group K (0-based); default: they reach every server")
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            if args.no_secrets and args.netns:
                raise LauncherError("--no-secrets cannot be used with --netns: servers on non-loopback addresses need "
                                    "a cluster secret and an admin token", EXIT_BAD_ARGUMENTS)
            cluster = LocalCluster(LocalClusterConfig(
                root=Path(args.dir), servers=args.servers, base_port=args.base_port, replication=args.replication,
                generate_secrets=not args.no_secrets,
                admin_token=_secret_arg("admin_token", args.admin_token_file, "PARAMS_ADMIN_TOKEN"),
                read_token=_secret_arg("read_token", args.read_token_file, "PARAMS_READ_TOKEN"),
                secret=_secret_arg("cluster_secret", args.cluster_secret_file, "PARAMS_CLUSTER_SECRET"),
                netns=args.netns, netns_subnet=args.subnet, netns_clients=args.client_namespaces, tls=args.tls))
            # up() stops what it started when the start fails; a refusal (a cluster already running
            # there) must leave that cluster and its state alone, so nothing more is stopped here.
            cluster.up(wait=args.timeout)
            leader = cluster.leader_id()
            c = cluster.config
            security = ", ".join(x for x in ("mutual TLS" if c.tls else "", "tokens" if c.admin_token else "",
                                             "cluster secret" if c.secret else "") if x) or "open: no tokens, no secret"
            print(f"cluster of {len(cluster.slots)} servers up under {cluster.root} (leader {leader}; {security})")
            for s in cluster.slots:
                where = f"  netns {s.netns}" if s.netns else ""
                print(f"  {s.server_id}  grpc {s.grpc}  raft {s.raft}  pid {s.pid}{where}  log {s.log_file}")
            if c.admin_token or c.secret:
                print(f"  secrets (0600) under {cluster.root / SECRETS_DIR}; the client config names them")
            print(f"client config written to {cluster.client_config_path}; point paramctl and paramworker at it with:")
            print(f"export PARAMS_CONFIG={shlex.quote(str(cluster.client_config_path))}")
            print("then e.g.:  paramctl status   paramctl push FILE --model NAME --tag prod   paramworker load NAME:prod")
            print(f"stop it with:   python -m deploy.local down --dir {args.dir}")
            return 0
        cluster = LocalCluster.load_state(Path(args.dir))
        if args.cmd == "down":
            cluster.down()
            print(f"cluster under {cluster.root} stopped")
            return 0
        if args.cmd == "add":
            slot = cluster.add_server()
            print(f"started {slot.server_id}  grpc {slot.grpc}  raft {slot.raft}  pid {slot.pid}  log {slot.log_file}")
            print(f"add it to the cluster with:   {cluster.join_command(slot.server_id)}")
            return 0
        if args.cmd == "start":
            cluster.restart(args.server_id, wait=60.0)
            slot = cluster.slot(args.server_id)
            print(f"started {slot.server_id}  grpc {slot.grpc}  raft {slot.raft}  pid {slot.pid}  log {slot.log_file}")
            return 0
        if args.cmd == "forget":
            cluster.forget(args.server_id)
            print(f"{args.server_id} stopped and dropped from {cluster.root / STATE_FILE} (its data dir stays)")
            return 0
        if args.cmd == "partition":
            groups = [[x.strip() for x in g.split(",") if x.strip()] for g in args.group]
            cluster.partition(groups, host_side=args.host_side)
            print(f"partitioned: {' | '.join(','.join(g) for g in groups)}"
                  f"{'' if args.host_side is None else f' (root-namespace clients with group {args.host_side})'}")
            return 0
        if args.cmd == "heal":
            cluster.heal()
            print("healed: every server reaches every other")
            return 0
        leader = cluster.leader_id() if cluster.running() else None
        for s in cluster.slots:
            state = "running" if s.pid and alive(s.pid) else "stopped"
            print(f"{s.server_id}  {state:8s} grpc {s.grpc}  raft {s.raft}  pid {s.pid}{'  (leader)' if s.server_id == leader else ''}")
        return 0
    except LauncherError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
