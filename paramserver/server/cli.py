"""``paramserver``: run one parameter server.

    paramserver serve --id ps1 --data-dir /var/lib/ps1 --listen 127.0.0.1:7000 \
        --raft 127.0.0.1:7100 --peer 127.0.0.1:7101 --peer 127.0.0.1:7102

Options given on the command line override those in ``--config FILE``.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Sequence

from paramserver.server.config import (
    CLUSTER_SECRET_ENV, DEFAULT_GET_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, SECRET_KEYS, MiB, ServerConfig,
)  # fmt: skip
from paramserver.server.errors import ConfigError
from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.cli_args import OneLineParser

_ENV = {"admin_token": ADMIN_TOKEN_ENV, "read_token": READ_TOKEN_ENV, "cluster_secret": CLUSTER_SECRET_ENV}


class _ServeParser(OneLineParser):
    """Lists the config keys (``%(keys)s`` in ``--config``'s help) only when help is shown: finding them
    imports the store and the data plane (torch among them), which parsing arguments must not."""

    def format_help(self) -> str:
        for action in self._actions:
            if action.dest == "config":
                action.keys = ", ".join(config_keys())  # type: ignore[attr-defined]
        return super().format_help()


def _parser() -> argparse.ArgumentParser:
    # defaults are shown from the one place they live
    d: dict[str, Any] = {f.name: f.default for f in fields(ServerConfig)}
    p = OneLineParser(
        prog="paramserver",
        description="Parameter server for model weights: content-addressed chunks on disk, metadata in Raft (pysyncobj), served over gRPC.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_ServeParser)
    s = sub.add_parser("serve", help="run a server until SIGTERM/SIGINT",
                       description="Run one parameter server. The Raft port must be reachable only by cluster members: "
                                   "pysyncobj unpickles peer messages. Every port off loopback needs its credential or the "
                                   "server refuses to start: --raft the cluster secret (--cluster-secret-file), --listen "
                                   "and --bulk-listen the admin token (--admin-token-file), --metrics-port the read token "
                                   "(--read-token-file); --insecure starts anyway, with a warning per open port.")
    s.add_argument("--config", type=Path,
                   help="TOML or JSON file of server settings, sizes in bytes, flags win, an unknown key is an error "
                        "(example: deploy/systemd/paramserver.toml.example). Keys: %(keys)s"),
    s.add_argument("--id", dest="server_id", help="server id, unique in the cluster (required here or in --config)")
    s.add_argument("--data-dir", type=Path, help="chunk store, Raft journal and dump (required here or in --config)")
    s.add_argument("--listen", help=f"gRPC listen address HOST:PORT (default {d['listen']})")
    s.add_argument("--advertise", help="gRPC address other servers and clients use (default: --listen)")
    s.add_argument("--raft", help=f"Raft listen address HOST:PORT, private to the cluster (default {d['raft']})")
    s.add_argument("--peer", action="append", dest="peers", metavar="HOST:PORT",
                   help="Raft address of another initial member; repeat for each (default: none, a one-server cluster)")
    s.add_argument("--zone", help="zone label; replicas of a chunk are spread over zones first")
    s.add_argument("--replication", type=int, dest="replication_factor",
                   help=f"replicas per chunk R, capped by the cluster size (default {d['replication_factor']})")
    s.add_argument("--write-quorum", type=int, dest="write_quorum", help="acks per chunk W before a commit (default: majority of R)")
    s.add_argument("--vnodes", type=int, help=f"virtual nodes per server on the hash ring (default {d['vnodes']})")
    s.add_argument("--admin-token-file", type=Path, metavar="FILE",
                   help="file holding the token required for writes (or env PARAMS_ADMIN_TOKEN); required when --listen "
                        "is not loopback, unless --insecure")
    s.add_argument("--read-token-file", type=Path, metavar="FILE",
                   help="file holding the token required for reads, the admin token also accepted (or env PARAMS_READ_TOKEN; "
                        "default: reads open)")
    s.add_argument("--cluster-secret-file", type=Path, metavar="FILE",
                   help="file holding the shared secret that encrypts and authenticates Raft traffic, the same on every "
                        "member (or env PARAMS_CLUSTER_SECRET); required when --raft is not loopback, unless --insecure")
    for flag in ("--admin-token", "--read-token", "--cluster-secret"):
        s.add_argument(flag, dest=f"argv_{flag[2:].replace('-', '_')}", metavar="VALUE", help=argparse.SUPPRESS)
    s.add_argument("--insecure", action="store_true",
                   help="start even when a non-loopback port lacks its credential: --raft without a cluster secret, --listen or "
                        "--bulk-listen without an admin token, --metrics-port without a read token (anyone who reaches "
                        "them can then run code, push, write chunks, change members; each logged at WARNING)")
    s.add_argument("--tls-cert", type=Path, help="server certificate (PEM) to serve gRPC over TLS; also the client certificate "
                                                 "this server presents when it calls its peers, so it needs clientAuth as well "
                                                 "as serverAuth usage (deploy/certs.py issues such)")
    s.add_argument("--tls-key", type=Path, help="private key (PEM) of --tls-cert")
    s.add_argument("--tls-ca", type=Path, help="CA (PEM) that client certificates must chain to (mutual TLS); peers' server "
                                               "certificates are checked against it too (default: system roots for peers)")
    s.add_argument("--cache-mb", type=int, help=f"hot-chunk memory cache in MiB (default {d['cache_bytes'] // MiB})")
    s.add_argument("--max-message-mb", type=int, help=f"largest gRPC message in MiB (default {DEFAULT_MAX_MESSAGE_BYTES // MiB})")
    s.add_argument("--get-message-kb", type=int,
                   help=f"GetChunks coalesces chunks into messages of about this size (default {DEFAULT_GET_MESSAGE_BYTES // 1024})")
    s.add_argument("--no-fsync", action="store_true", help="skip fsync on chunk writes and on the Raft state "
                   "(tests and drills only: a power loss can lose chunks and acknowledged commits)")
    s.add_argument("--scrub-mb-per-s", type=int,
                   help=f"background verification rate, 0 disables (default {d['scrub_bytes_per_s'] // MiB})")
    s.add_argument("--scrub-busy-fraction", type=float, dest="scrub_busy_fraction",
                   help="fraction of that rate the scrubber keeps while this server serves reads or writes "
                        f"(1 keeps the full rate; default {d['scrub_busy_fraction']})")
    s.add_argument("--scrub-quiet", type=float, dest="scrub_quiet_s",
                   help=f"seconds without reads or writes after which the scrubber is back at its full rate (default {d['scrub_quiet_s']})")
    s.add_argument("--repair-interval", type=float, dest="repair_interval_s",
                   help=f"seconds between repair passes (default {d['repair_interval_s']})")
    s.add_argument("--anti-entropy-interval", type=float, dest="anti_entropy_interval_s",
                   help=f"seconds between re-replication passes (default {d['anti_entropy_interval_s']})")
    s.add_argument("--gc-interval", type=float, dest="gc_interval_s",
                   help=f"seconds between orphan-chunk collections, 0 disables (default {d['gc_interval_s']})")
    s.add_argument("--orphan-grace", type=float, dest="orphan_grace_s",
                   help=f"an unreferenced chunk is deleted only when older than this many seconds (default {d['orphan_grace_s']})")
    s.add_argument("--segment-mb", type=int,
                   help="chunk store segment file size in MiB; a full segment is sealed and a new one started (default 256)")
    s.add_argument("--direct-writes", choices=("auto", "on", "off"),
                   help="chunk writes around the page cache (O_DIRECT): on, off, or auto = on with fsync, off with "
                        "--no-fsync (default auto)")
    s.add_argument("--compact-mb-per-s", type=int,
                   help="I/O budget of segment compaction (rewriting segments whose chunks were mostly deleted) (default 64)")
    s.add_argument("--workers", type=int, help=f"gRPC server threads (default {d['workers']})")
    s.add_argument("--bulk-listen", help="plain-TCP bulk chunk-read address HOST:PORT (default: the --listen host, a free port); "
                                         "advertised to clients, off when TLS is on")
    s.add_argument("--no-bulk", action="store_true", help="serve chunk bytes over gRPC GetChunks only (no bulk port)")
    s.add_argument("--hot-chunks", choices=["on", "off"],
                   help="extra copies of often-read chunks on servers beyond their R replicas, advertised to clients "
                        "(soft state, bounded, dropped when the chunk cools; no effect while R covers every server) "
                        "(default on)")
    s.add_argument("--hot-rate", type=float, help="reads per second of one chunk on this server (decayed over "
                                                  "hot_tau_s, default 10 s) that make it hot (default 2.0)")
    s.add_argument("--hot-extra-copies", type=int, help="extra copies per hot chunk, beyond its R replicas (default 2)")
    s.add_argument("--hot-cool-s", type=float, help="a hot chunk cools once its rate stayed below hot_cool_rate "
                                                    "(default a quarter of --hot-rate) this long (default 30)")
    s.add_argument("--hot-lease-s", type=float, help="an extra copy no replica renewed for this long is dropped (default 30)")
    s.add_argument("--hot-max-mb", type=int, help="bound in MiB on the hot chunks this server places extras for, and on "
                                                  "the extra copies it holds for others (default 256 each)")
    s.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on this port of the --listen host (default: off); with a read token "
                        "set, scrapes must send it as 'Authorization: Bearer' (Prometheus: authorization: credentials_file)")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default INFO)")
    return p


def _overrides(a: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {k: getattr(a, k) for k in (
        "server_id", "data_dir", "listen", "advertise", "raft", "zone", "replication_factor", "write_quorum", "vnodes",
        "tls_cert", "tls_key", "tls_ca", "repair_interval_s", "scrub_busy_fraction", "scrub_quiet_s",
        "anti_entropy_interval_s", "gc_interval_s", "orphan_grace_s", "workers", "bulk_listen")}
    o["peers"] = tuple(a.peers) if a.peers else None
    # Secrets: a file flag, else the environment; never a value on the command line (ps shows it to everyone).
    for key, env in (("admin_token", ADMIN_TOKEN_ENV), ("read_token", READ_TOKEN_ENV), ("cluster_secret", CLUSTER_SECRET_ENV)):
        path = getattr(a, f"{key}_file")
        if path is not None:
            o[f"{key}_file"] = path
        elif os.environ.get(env):
            o[key] = os.environ[env]
    if a.insecure:
        o["insecure"] = True
    if a.cache_mb is not None:
        o["cache_bytes"] = a.cache_mb * MiB
    if a.max_message_mb is not None:
        o["max_message_bytes"] = a.max_message_mb * MiB
    if a.get_message_kb is not None:
        o["get_message_bytes"] = a.get_message_kb * 1024
    if a.scrub_mb_per_s is not None:
        o["scrub_bytes_per_s"] = a.scrub_mb_per_s * MiB
    if a.segment_mb is not None:
        o["store_segment_bytes"] = a.segment_mb * MiB
    if a.direct_writes is not None:
        o["store_direct_writes"] = {"auto": "auto", "on": True, "off": False}[a.direct_writes]
    if a.compact_mb_per_s is not None:
        o["store_compact_bytes_per_s"] = a.compact_mb_per_s * MiB
    if a.hot_chunks is not None:
        o["hot_chunks"] = a.hot_chunks
    for flag, key in (("hot_rate", "hot_rate"), ("hot_extra_copies", "hot_extra_copies"), ("hot_cool_s", "hot_cool_s"),
                      ("hot_lease_s", "hot_lease_s")):
        if getattr(a, flag) is not None:
            o[key] = getattr(a, flag)
    if a.hot_max_mb is not None:
        o["hot_max_bytes"] = o["hot_max_extra_bytes"] = a.hot_max_mb * MiB
    if a.no_fsync:
        o["fsync"] = False
    if a.no_bulk:
        o["bulk"] = False
    if a.metrics_port is not None:
        o["metrics_port"] = a.metrics_port  # in the config: validate() checks the metrics listener with the others
    return o


def tuning_keys() -> set[str]:
    """The config keys each module reads besides ServerConfig's fields."""
    from paramserver.server import bulk_port, dataplane, hot_chunks, service, store

    return {*store.CONFIG_KEYS, *hot_chunks.CONFIG_KEYS, *bulk_port.CONFIG_KEYS, *dataplane.CONFIG_KEYS, *service.CONFIG_KEYS,
            "metrics_port"}


def config_keys() -> list[str]:
    """Every key a server config file may hold, sorted; secrets by their ``*_file`` keys (the
    secret itself is accepted too, but a file readable only by the server's user is the way)."""
    names = {f.name for f in fields(ServerConfig) if f.name != "extra"} - set(SECRET_KEYS)
    return sorted({*names, *(f"{k}_file" for k in SECRET_KEYS), *tuning_keys()})


def check_extra_keys(config: ServerConfig) -> None:
    """Refuse a config key nothing reads: a misspelt one would otherwise leave its default in force, silently."""
    unknown = sorted(set(config.extra) - tuning_keys())
    if not unknown:
        return
    names = [*config_keys(), *SECRET_KEYS]
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}: see paramserver serve --help "
                      "for the keys")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key in ("admin_token", "read_token", "cluster_secret"):
        if getattr(args, f"argv_{key}") is not None:
            flag = key.replace("_", "-")
            print(f"paramserver: --{flag} VALUE would show the secret to every user in 'ps'; put it in a file readable only "
                  f"by you and pass --{flag}-file FILE, or set ${_ENV[key]}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.config is not None:
            config = ServerConfig.from_file(args.config, **_overrides(args))
        else:
            config = ServerConfig.from_mapping({}, **_overrides(args))
        from paramserver.server.store import StoreConfig  # after parsing: --help stays fast

        StoreConfig.from_extra(config.extra)  # the store's options, checked before anything starts
        from paramserver.server.hot_chunks import HotConfig

        HotConfig.from_extra(config.extra)
        check_extra_keys(config)
        port = config.extra.get("metrics_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
            raise ConfigError(f"metrics_port must be a port number 0..65535, got {port!r}")
    except ConfigError as exc:
        print(f"paramserver: {exc}", file=sys.stderr)
        return 2
    from paramserver.server.process import ParamServer  # after argument checks: --help stays fast

    server = ParamServer(config, metrics_port=config.extra.get("metrics_port"))

    def stop(signum: int, frame: object) -> None:
        server._stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        server.start()
    except ConfigError as exc:  # the data dir is in use or another cluster's: the operator's to fix
        print(f"paramserver: {exc}", file=sys.stderr)
        server.stop()
        return 2
    except Exception as exc:  # noqa: BLE001 - start-up failures end the process with a readable line
        logging.getLogger("paramserver").error("start-up failed: %s", exc)
        server.stop()
        return 1
    code = server.serve_forever()
    server.stop()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
