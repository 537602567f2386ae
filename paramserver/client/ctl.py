"""``paramctl``: the admin CLI of a parameter-server cluster.

Every expected failure ends as one line on stderr and a non-zero exit code
(``paramserver.client.exit_codes``, shared with ``paramworker``); tracebacks are only for bugs.
Where the cluster is and which credentials to use come from ``paramserver.client.config``
(flags > environment > client config file).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import grpc
from rich.console import Console

from chunking.config import ChunkingConfig
from chunking.errors import ChunkingError

from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.config import ClientSettings, add_client_arguments, settings_from_args
from paramserver.wire.cli_args import OneLineParser, float_in, int_in
from paramserver.client.errors import PATH_ERRORS, ClientError
from paramserver.client.exit_codes import EXIT_CODES  # noqa: F401 - re-exported: paramctl's table is the shared one
from paramserver.client.exit_codes import BAD_ARGUMENTS, CLIENT_ENV_HELP, EXIT_CODES_HELP, INTERRUPTED, OTHER, describe_failure
from paramserver.client.refs import MAX_VERSION
from paramserver.client.pull import PullOptions
from paramserver.wire.address import split_host_port
# The commands, the router calls and the output live in their own modules (ctl_commands,
# ctl_router, ctl_output); these names are re-exported for the code that imports them from here.
from paramserver.client.ctl_commands import COMMANDS
from paramserver.client.ctl_output import human_bytes as human_bytes, push_summary as push_summary  # re-exported (deploy.demo)
from paramserver.client.ctl_router import ROUTER_ENV, RouterFailure
from paramserver.client.errors import UsageError
from paramserver.client.writes import leader_status as _leader_status  # noqa: F401 - re-exported (a unit test)

DEFAULT_CLUSTER = "127.0.0.1:7000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULTS = ClientSettings(cluster=(DEFAULT_CLUSTER,), timeout_s=DEFAULT_TIMEOUT_S)

EPILOG = f"""\
{EXIT_CODES_HELP}

{CLIENT_ENV_HELP}
Writes (push, tag, rollback, untag, member) send the admin token; reads (pull, ls, status) the read token.
"""

KiB, MiB = 1024, 1 << 20


def parse_size(text: str) -> int:
    """"262144", "256K", "256KiB", "1M" -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "KMG" else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 262144, 256K, 1M)")
    return int(digits) * mult


parse_version = int_in(1, MAX_VERSION, "a version number")


def parse_parent(text: str) -> int | str | None:
    low = text.strip().lower()
    if low in ("head", "none"):
        return "head" if low == "head" else None
    if not low.isdigit() or not 1 <= int(low) <= MAX_VERSION:
        raise argparse.ArgumentTypeError(f"--parent must be a version number from 1 to {MAX_VERSION}, 'head' or 'none', "
                                         f"got {text!r}")
    return int(low)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = OneLineParser(
        prog="paramctl", description="Admin CLI of a parameter-server cluster: push, pull, tag and inspect model versions.",
        epilog=EPILOG, formatter_class=fmt,
    )  # fmt: skip
    add_client_arguments(p, write=True, cluster_default=DEFAULT_CLUSTER)
    p.add_argument("--timeout", type=float_in(0, 3600, "--timeout"), default=None,
                   help=f"seconds for each unary call (config file: timeout_s; default {DEFAULT_TIMEOUT_S:g})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sp = sub.add_parser("push", help="push a weights file or a model folder as a new version", formatter_class=fmt, epilog=EPILOG)
    sp.add_argument("file", type=Path, metavar="FILE|DIR",
                    help="weights file (.safetensors, .pt, .pth or .bin: tensors only), or a model folder (a Hugging Face "
                         "checkpoint: its .safetensors shards become tensors, every other file is kept byte for byte; "
                         "symlinks are refused)")
    sp.add_argument("--model", required=True, help="model name (letters, digits, '.', '_', '-')")
    sp.add_argument("--tag", default=None, help="tag to point at the new version, e.g. prod (default: no tag)")
    sp.add_argument(
        "--parent", type=parse_parent, default="head",
        help="version the new one derives from: a number, 'head' (the latest version; default) or 'none' (first version). "
        "If it is not the head the push is refused as concurrent (exit 4)",
    )  # fmt: skip
    sp.add_argument(
        "--codec", choices=("off", "auto", "on"), default="off",
        help="zstd per chunk: off (default; fastest to load on a fast link), auto (only where it saves >= 10%%), on (always)",
    )  # fmt: skip
    sp.add_argument("--chunk-size", type=parse_size, default=ChunkingConfig().chunk_size,
                    help="chunk size, a power of two from 4K to 64M (default 256K)")
    sp.add_argument("--publisher", default=None, help="name recorded in the version's vector clock (default: user.host)")
    sp.add_argument("--no-progress", action="store_true", help="do not draw the progress bar (default: drawn on a terminal)")

    sp = sub.add_parser("pull", help="pull a version into a .safetensors file, verified chunk by chunk", formatter_class=fmt, epilog=EPILOG)
    sp.add_argument("ref", metavar="MODEL:TAG", help="MODEL:TAG, MODEL@VERSION or MODEL (its latest version)")
    out = sp.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", "-o", type=Path, help="output .safetensors file, the tensors only (written atomically)")
    out.add_argument("--out-dir", type=Path, help="output model folder, which must not exist: every file byte for byte and "
                                                  "the weights as safetensors shards with their index (written atomically)")
    sp.add_argument("--no-weights", action="store_true",
                    help="with --out-dir: only the version's other files (config, generation config, tokenizer): no weights in "
                         "any format and no weights index; for vllm serve DIR --load-format pdparams (docs/vllm.md)")
    sp.add_argument("--streams", type=int_in(1, 256, "--streams"), default=PullOptions().streams_per_server,
                    help=f"parallel GetChunks streams per server (default {PullOptions().streams_per_server})")
    sp.add_argument(
        "--verify", choices=("content", "crc"), default=None,
        help="crc: every chunk's size and CRC32C from the manifest, itself verified by its content id; "
        "content: also every chunk's BLAKE3 content id (safe even against a replica that forges CRCs; ~0.4 ns/byte more) "
        "(env PARAMS_VERIFY, config file: verify; default crc)",
    )  # fmt: skip
    sp.add_argument("--no-bulk", action="store_true", help="read chunk bytes over gRPC GetChunks only, not the servers' bulk ports")
    sp.add_argument("--no-progress", action="store_true", help="do not draw the progress bar (default: drawn on a terminal)")

    sp = sub.add_parser("tag", help="point TAG of MODEL at VERSION (history kept for rollback)", epilog=EPILOG, formatter_class=fmt)
    sp.add_argument("model", help="model name")
    sp.add_argument("tag", help="tag name, e.g. prod")
    sp.add_argument("version", type=parse_version, help="version number")
    sp.add_argument("--when-warm", type=int_in(1, 100000, "--when-warm"), default=None, metavar="K",
                    help="move the tag only once K workers registered with the router report VERSION fully in their cache "
                         "tiers (paramctl prewarm first); waits at most --warm-timeout-s, then exits 7 without moving it")
    _router_flags(sp)

    sp = sub.add_parser(
        "prewarm", formatter_class=fmt, epilog=EPILOG,
        help="ask workers, through the router, to fetch a version into their cache tiers without swapping to it "
             "(needs the router's admin token: --token, $PARAMS_ADMIN_TOKEN or the config's admin_token_file)",
    )  # fmt: skip
    sp.add_argument("ref", metavar="MODEL:TAG", help="MODEL:TAG, MODEL@VERSION or MODEL (resolved by the router)")
    who = sp.add_mutually_exclusive_group()
    who.add_argument("--workers", type=int_in(1, 100000, "--workers"), default=None, metavar="N",
                     help="this many workers, those following the model first (default: --all)")
    who.add_argument("--all", action="store_true", help="every worker registered with the router (the default)")
    sp.add_argument("--wait", action="store_true",
                    help="wait until those workers report the version fully cached (at most --warm-timeout-s; exit 7 after)")
    _router_flags(sp)

    sp = sub.add_parser("rollback", help="move TAG of MODEL back to the version it pointed at before", epilog=EPILOG, formatter_class=fmt)
    sp.add_argument("model", help="model name")
    sp.add_argument("tag", help="tag name")

    sp = sub.add_parser("untag", help="delete TAG of MODEL (its versions stay)", epilog=EPILOG, formatter_class=fmt)
    sp.add_argument("model", help="model name")
    sp.add_argument("tag", help="tag name")

    sp = sub.add_parser("ls", help="list models; with MODEL, its versions and tags", epilog=EPILOG, formatter_class=fmt)
    sp.add_argument("model", nargs="?", default=None,
                    help="model name (default: list every model); MODEL:TAG or MODEL@N also lists that version's files")

    sp = sub.add_parser("status", help="members, leader, term, and per-server chunk counts, disk use and bytes served",
                        epilog=EPILOG, formatter_class=fmt)
    sp.add_argument("--json", action="store_true",
                    help="print one JSON object instead of the table: the cluster's leader, term, commit index and ring, "
                         "and a 'servers' list with each server's id, addresses, role, chunks, disk bytes, cache and "
                         "served_bytes (chunk bytes it sent since it started); a server that did not answer has 'error'. "
                         "Exit codes as without --json (6: no reachable leader, after the object is printed)")

    sp = sub.add_parser(
        "member", formatter_class=fmt, epilog=MEMBER_EPILOG,
        help="add a server to the cluster, drain one (move its chunks off it), remove a stopped one",
    )  # fmt: skip
    msub = sp.add_subparsers(dest="member_command", metavar="ACTION", required=True)
    mp = msub.add_parser("add", formatter_class=fmt, epilog=MEMBER_EPILOG,
                         help="add a running server (started with --peer naming the members' Raft addresses), "
                              "or put a draining one back up")
    mp.add_argument("server_id", metavar="ID", help="its --id, e.g. ps4")
    mp.add_argument("--grpc", required=True, type=_address("--grpc"), metavar="HOST:PORT",
                    help="its gRPC address (its --advertise, else --listen)")
    mp.add_argument("--raft", required=True, type=_address("--raft"), metavar="HOST:PORT", help="its Raft address (--raft)")
    mp.add_argument("--zone", default="", help="its failure zone (--zone), if the cluster uses zones")
    mp = msub.add_parser("drain", formatter_class=fmt, epilog=MEMBER_EPILOG,
                         help="mark a server leaving: the ring stops placing chunks on it and re-replication copies "
                              "them to their new replicas; waits until every member reports its chunks placed")
    mp.add_argument("server_id", metavar="ID")
    mp.add_argument("--wait", type=float_in(0, 86400, "--wait", low_inclusive=True), default=600.0, metavar="S",
                    help="seconds to wait for the drain to finish (default 600; 0: mark it and report, do not wait); "
                         "exit 7 if it has not finished by then")
    mp = msub.add_parser("remove", formatter_class=fmt, epilog=MEMBER_EPILOG,
                         help="remove a drained, stopped server from Raft and the member list")
    mp.add_argument("server_id", metavar="ID")
    mp.add_argument("--force", action="store_true",
                    help="skip the checks (drained, stopped): chunks whose only copies are on it are lost, and a "
                         "removed server that still runs disturbs elections")

    sp = sub.add_parser(
        "drill", add_help=False, formatter_class=fmt,
        help="fault-injection drills: kill-leader, partition, corrupt-chunk, restart-server, restart-cluster "
        "('paramctl drill --help' for their options)",
    )  # fmt: skip
    sp.add_argument("drill_args", nargs=argparse.REMAINDER, help="the drill and its options")
    return p


MEMBER_EPILOG = f"""\
Scale out: start the new server with --peer for every member's Raft address and the cluster's
secret and tokens, then 'paramctl member add ps4 --grpc HOST:PORT --raft HOST:PORT'.
Take a server out: 'paramctl member drain ps3' (waits until its chunks are placed on the other
servers), stop it, then 'paramctl member remove ps3'. 'member add' with its addresses puts a
draining server back up.

{EXIT_CODES_HELP}
"""


def _address(flag: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            split_host_port(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return parse


def _router_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--router", default=None, metavar="URL",
                    help=f"the paramrouter the workers register with, http://HOST:PORT (env {ROUTER_ENV}; default: none)")
    sp.add_argument("--warm-timeout-s", type=float_in(0, 86400, "--warm-timeout-s"), default=300.0, metavar="S",
                    help="longest wait for workers to report a version cached (default 300)")


WRITES = frozenset({"push", "tag", "rollback", "untag", "member"})


def client_settings(args: argparse.Namespace) -> ClientSettings:
    """Flags > environment > client config file (--config / PARAMS_CONFIG) > paramctl's defaults."""
    return settings_from_args(args, write=args.command in WRITES, defaults=DEFAULTS)


def cluster_options(args: argparse.Namespace, settings: ClientSettings | None = None) -> ClusterOptions:
    settings = settings or client_settings(args)
    return settings.cluster_options(write=args.command in WRITES)


def _fail(err: Console, code: int, message: str) -> int:
    err.print(f"paramctl: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return code


def _drill(argv: Sequence[str]) -> int:
    # The drills live in deploy/, a layer above this one (they start, kill and partition servers):
    # paramctl is their front door, running them as their own program rather than importing them.
    env = {**os.environ, "PARAMS_DRILL_PROG": "paramctl drill"}
    try:
        return subprocess.call([sys.executable, "-m", "deploy.drills", *argv], env=env)
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command == "drill":
        return _drill([*args.drill_args, *extra])
    if extra:
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    # Piped output (scripts, CI logs) gets wide tables instead of rich's 80-column fallback. No emoji
    # codes: ':a:' in a model reference or a file name is text.
    out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200, emoji=False)
    err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 400, emoji=False)
    settings: ClientSettings | None = None
    try:
        settings = args.settings = client_settings(args)
        opts = replace(cluster_options(args, settings), notice=lambda line: err.print(f"paramctl: {line}", markup=False, highlight=False))
        return COMMANDS[args.command](args, opts, out)
    except UsageError as exc:
        return _fail(err, BAD_ARGUMENTS, str(exc))
    except RouterFailure as exc:
        return _fail(err, exc.code, str(exc))
    except (ClientError, ChunkingError, grpc.RpcError) as exc:
        failure = describe_failure(exc, settings)
        return _fail(err, failure.code, failure.message)
    except KeyboardInterrupt:
        return _fail(err, INTERRUPTED, _INTERRUPTED.get(args.command, _INTERRUPTED_WRITE).format(model=getattr(args, "model", "")))
    except OSError as exc:  # a local path: the output folder, an input file
        where = f" {exc.filename}" if exc.filename else ""
        code = BAD_ARGUMENTS if isinstance(exc, PATH_ERRORS) else OTHER
        return _fail(err, code, f"{exc.strerror or exc}:{where}; check the path and its permissions")


# What an interrupted command may have left: a commit or a tag move can land just before the
# interrupt does, so only commands that change nothing say that nothing changed.
_INTERRUPTED_WRITE = "interrupted; the change may or may not have been made: 'paramctl ls {model}' shows the state"
_INTERRUPTED = {
    "push": "interrupted; if the push reached its commit, {model} has a new version ('paramctl ls {model}' shows it); "
            "chunks sent without a commit are collected as orphans",
    "pull": "interrupted; nothing was written",
    "ls": "interrupted",
    "status": "interrupted",
    "prewarm": "interrupted; the workers keep fetching what they accepted",
    "member": "interrupted; the change may or may not have been made: 'paramctl status' shows the members",
}


if __name__ == "__main__":
    raise SystemExit(main())
