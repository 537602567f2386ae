"""``paramctl``: the admin CLI of a parameter-server cluster.

Every expected failure ends as one line on stderr and a non-zero exit code
(``paramserver.client.exit_codes``, shared with ``paramworker``); tracebacks are only for bugs.
Where the cluster is and which credentials to use come from ``paramserver.client.config``
(flags > environment > client config file).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from chunking.config import ChunkingConfig
from chunking.errors import ChunkingError
from chunking.manifest import Manifest

from paramserver.client.cluster_view import ClusterOptions, ClusterView
from paramserver.client.config import ClientSettings, add_client_arguments, settings_from_args
from paramserver.wire.cli_args import OneLineParser, float_in, int_in
from paramserver.client.errors import ClientError
from paramserver.client.exit_codes import EXIT_CODES  # noqa: F401 - re-exported: paramctl's table is the shared one
from paramserver.client.exit_codes import (
    BAD_ARGUMENTS, CLIENT_ENV_HELP, EXIT_CODES_HELP, INTERRUPTED, NOT_FOUND, OTHER, PRECONDITION, UNAVAILABLE, describe_failure,
)  # fmt: skip
from paramserver.client.progress import RichProgress
from paramserver.client.refs import MAX_VERSION
from paramserver.client.rpc import ParamServerClient
from paramserver.wire.proto import pb
from paramserver.client.folder import pull_folder, shard_plan
from paramserver.client.pull import PullOptions, pull
from paramserver.client.push import PushOptions, PushReport, fetch_manifest, push
from paramserver.client.refs import ModelRef
from paramserver.client.errors import PATH_ERRORS, ClusterUnreachable, TransferError
from paramserver.client import members as members_api
from paramserver.wire.address import split_host_port
from consensus.validation import check_name

DEFAULT_CLUSTER = "127.0.0.1:7000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULTS = ClientSettings(cluster=(DEFAULT_CLUSTER,), timeout_s=DEFAULT_TIMEOUT_S)

EPILOG = f"""\
{EXIT_CODES_HELP}

{CLIENT_ENV_HELP}
Writes (push, tag, rollback, untag, member) send the admin token; reads (pull, ls, status) the read token.
"""

KiB, MiB = 1024, 1 << 20


class UsageError(Exception):
    """Bad command-line input found after parsing (exit code 2)."""


class RouterFailure(Exception):
    """The router refused or could not be reached, or a pre-warm wait ran out; ``code`` is the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


ROUTER_ENV = "PARAMS_ROUTER"
# The router's HTTP status -> paramctl's exit code (the shared table's meanings)
_ROUTER_CODES = {400: BAD_ARGUMENTS, 404: NOT_FOUND, 409: PRECONDITION, 503: UNAVAILABLE, 504: UNAVAILABLE}


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


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
        help="ask workers, through the router, to fetch a version into their cache tiers without swapping to it",
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

    sub.add_parser("status", help="members, leader, term, and per-server chunk counts and disk use", epilog=EPILOG, formatter_class=fmt)

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


def _who() -> str:
    from paramserver.client.push import default_publisher

    return default_publisher()


# ------------------------------------------------------------------ commands


def cmd_push(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    config = ChunkingConfig(chunk_size=args.chunk_size, codec=args.codec)
    try:
        config.validate()
    except ChunkingError as exc:
        raise UsageError(str(exc)) from None
    if not args.file.is_file() and not args.file.is_dir():
        raise UsageError(f"weights file or model folder {args.file} does not exist")
    show = not args.no_progress and sys.stderr.isatty()
    with RichProgress(enabled=show) as bar:
        report = push(
            opts.seeds, str(args.file), model=args.model, tag=args.tag, parent=args.parent, publisher=args.publisher,
            config=config, progress=bar, options=PushOptions(), cluster=opts,
        )  # fmt: skip
    out.print(push_summary(report))
    return 0


def push_summary(r: PushReport) -> str:
    tag = f" tag {r.tag} ->" if r.tag else ""
    parent = f"parent v{r.parent}" if r.parent is not None else "first version"
    down = f"; unreachable: {', '.join(r.unreachable)}" if r.unreachable else ""
    down += "".join(f"; {s} failed: {m[:200]}" for s, m in r.refused.items())
    return (
        f"pushed {r.model}{tag} v{r.version} ({parent}, manifest {r.manifest_id[:16]})\n"
        f"  bytes {human_bytes(r.bytes_total)}  sent {human_bytes(r.bytes_sent)} "
        f"({100 * r.bytes_sent / max(1, r.bytes_stored):.1f}% of stored)"
        f"  over the wire {human_bytes(r.wire_bytes)} (R={r.replication}, W={r.write_quorum}{down})\n"
        f"  chunks {r.chunks_total} ({r.chunks_unique} distinct)  deduplicated {r.chunks_deduplicated}  sent {r.chunks_sent}\n"
        f"  {r.seconds:.2f} s  {r.gbps:.2f} GB/s "
        f"(pack {r.pack_seconds:.2f} s, upload {r.upload_seconds:.2f} s at {r.upload_gbps:.2f} GB/s on the wire)"
    )


def cmd_pull(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    if args.out is not None and args.out.suffix != ".safetensors":
        raise UsageError(f"--out {args.out} must end in .safetensors")
    if args.out_dir is not None and args.out_dir.exists():
        raise UsageError(f"--out-dir {args.out_dir} already exists; remove it or choose a new folder")
    if not 1 <= args.streams <= 16:
        raise UsageError(f"--streams must be between 1 and 16, got {args.streams}")
    show = not args.no_progress and sys.stderr.isatty()
    try:
        with RichProgress(enabled=show) as bar:
            options = PullOptions(streams_per_server=args.streams, verify=args.settings.verify, bulk=args.settings.bulk)
            if args.out_dir is not None:
                r = pull_folder(opts.seeds, args.ref, args.out_dir, progress=bar, options=options, cluster=opts)
            else:
                r = pull(opts.seeds, args.ref, args.out, progress=bar, options=options, cluster=opts)
    except ClientError as exc:
        if isinstance(exc, TransferError):
            raise
        raise UsageError(str(exc)) from None
    ref = f"{r.model}:{r.tag}" if r.tag else r.model
    out.print(
        f"pulled {ref} v{r.version} -> {r.path}\n"
        f"  bytes {human_bytes(r.bytes_total)}  chunks {r.chunks_total} "
        f"({r.chunks_unique} distinct, all verified by {args.settings.verify})"
        f"  from {', '.join(f'{s} {human_bytes(n)}' for s, n in sorted(r.per_server.items()))}"
        f"{f'  retried {r.retried}' if r.retried else ''}\n"
        f"  {r.seconds:.2f} s  {r.gbps:.2f} GB/s "
        f"(fetch + verify {r.fetch_seconds:.2f} s at {r.fetch_gbps:.2f} GB/s, save {r.save_seconds:.2f} s)"
    )
    return 0


class _NoLongerLeads(grpc.RpcError):
    """A member the view took for the leader answered as a follower: retryable, so ``leader_call``
    asks the others who leads now."""

    def __init__(self, address: str) -> None:
        super().__init__(f"{address} answered but does not lead")
        self.address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"{self.address} answered but is not the Raft leader, and no member named one that is"


def _leader_status(client: ParamServerClient) -> pb.ServerStatusReply:
    status = client.server_status()
    if not status.is_leader:
        raise _NoLongerLeads(client.address)
    return status


def _write_call(opts: ClusterOptions, call: Callable[[ClusterView], object]) -> object:
    """``call(view)`` once the leader answers as the leader. Found with ``leader_call`` (through an
    election, with its notice and its exit-6 message when there is none), the write itself is sent
    once: a rollback sent again after a lost answer would move the tag back twice."""
    with ClusterView.connect(opts) as view:
        view.leader_call(_leader_status)
        return call(view)


def _router_url(args: argparse.Namespace) -> str:
    url = (args.router or os.environ.get(ROUTER_ENV) or "").strip().rstrip("/")
    if not url:
        raise UsageError(f"no router given: pass --router http://HOST:PORT or set {ROUTER_ENV}")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--router {url!r} must be http://HOST:PORT")
    return url


def router_call(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = 15.0) -> dict[str, Any]:
    """One JSON call to the router; its refusals and its absence become RouterFailure with an exit code."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{url}{path}", data=data, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer
    except urllib.error.HTTPError as exc:
        try:
            message = str(json.loads(exc.read()).get("error", exc.reason))
        except (ValueError, AttributeError):
            message = str(exc.reason)
        raise RouterFailure(_ROUTER_CODES.get(exc.code, OTHER), f"router {url}: {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RouterFailure(UNAVAILABLE, f"UNAVAILABLE: router {url} did not answer ({reason}); is paramrouter running?") from None


def wait_warm(url: str, ref: str, need: int, timeout_s: float, workers: set[str] | None = None,
              poll_s: float = 0.25) -> dict[str, Any]:
    """Poll ``GET /warm/REF`` until ``need`` workers (of ``workers``, if given) report it fully cached."""
    deadline = time.monotonic() + timeout_s
    path = f"/warm/{urllib.parse.quote(ref, safe=':@')}"
    while True:
        state = router_call(url, path)
        done = [w["worker_id"] for w in state["workers"] if w["complete"] and (workers is None or w["worker_id"] in workers)]
        if len(done) >= need:
            return state
        if time.monotonic() >= deadline:
            partial_ = ", ".join(f"{w['worker_id']} {w.get('bytes_cached', 0)}/{w.get('bytes_total', '?')} B"
                                 for w in state["workers"]) or "no worker registered"
            raise RouterFailure(PRECONDITION, f"FAILED_PRECONDITION: after {timeout_s:g} s only {len(done)} of the {need} "
                                              f"workers needed report {state['model']}@{state['version']} fully cached "
                                              f"({partial_})")
        time.sleep(poll_s)


def cmd_prewarm(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    url = _router_url(args)
    ref = str(ModelRef.parse(args.ref))
    answer = router_call(url, "/prewarm", {"ref": ref, "workers": args.workers})
    model, version, asked = answer["model"], answer["version"], answer["workers"]
    accepted = {w["worker_id"] for w in asked if w["accepted"]}
    for w in asked:
        out.print(f"  {w['worker_id']}: " + ("fetching" if w["accepted"] else f"refused: {w.get('error', '?')}"),
                  markup=False, highlight=False)
    out.print(f"pre-warming {model}@{version} on {len(accepted)} of {len(asked)} workers", markup=False, highlight=False)
    if not accepted:
        raise RouterFailure(UNAVAILABLE, f"UNAVAILABLE: no worker accepted the pre-warm of {model}@{version}")
    if args.wait:
        t0 = time.monotonic()
        wait_warm(url, f"{model}@{version}", len(accepted), args.warm_timeout_s, accepted)
        out.print(f"{model}@{version} fully cached on {len(accepted)} workers after {time.monotonic() - t0:.1f} s",
                  markup=False, highlight=False)
    return 0 if len(accepted) == len(asked) else OTHER


def cmd_tag(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    if args.when_warm is not None:
        url = _router_url(args)
        t0 = time.monotonic()
        wait_warm(url, f"{args.model}@{args.version}", args.when_warm, args.warm_timeout_s)
        out.print(f"{args.model}@{args.version} fully cached on at least {args.when_warm} workers "
                  f"({time.monotonic() - t0:.1f} s); moving the tag", markup=False, highlight=False)
    reply = _write_call(opts, lambda v: v.leader_client().set_tag(args.model, args.tag, args.version, who=_who()))
    assert isinstance(reply, pb.TagReply)
    out.print(f"{args.model}:{args.tag} -> v{reply.tag.version}")
    return 0


def cmd_rollback(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    reply = _write_call(opts, lambda v: v.leader_client().rollback_tag(args.model, args.tag, who=_who()))
    assert isinstance(reply, pb.TagReply)
    out.print(f"{args.model}:{args.tag} rolled back -> v{reply.tag.version}")
    return 0


def cmd_untag(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    _write_call(opts, lambda v: v.leader_client().delete_tag(args.model, args.tag, who=_who()))
    if args.tag == "latest":  # never deleted: it follows the newest version again
        out.print(f"{args.model}:latest unpinned; it follows the newest version again", markup=False, highlight=False)
    else:
        out.print(f"{args.model}:{args.tag} deleted", markup=False, highlight=False)
    return 0


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def cmd_ls(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterView.connect(opts) as view:
        client = view.leader_client()  # the leader's view: a push that just returned is listed
        if args.model is None:
            models = client.list_models().models
            table = Table(title="models")
            for col in ("model", "versions", "latest", "size", "tags"):
                table.add_column(col, justify="right" if col in ("versions", "latest", "size") else "left")
            for name in models:
                versions = client.list_versions(name).versions
                tags = client.list_tags(name).tags
                latest = max(versions, key=lambda v: v.number) if versions else None
                table.add_row(
                    name, str(len(versions)), f"v{latest.number}" if latest else "-", human_bytes(latest.nbytes) if latest else "-",
                    ", ".join(f"{t.tag}=v{t.version}" for t in tags) or "-",
                )  # fmt: skip
            if not models:
                out.print("no models yet; push one with: paramctl push FILE --model NAME --tag prod")
                return 0
            out.print(table)
            return 0
        ref = ModelRef.parse(args.model) if (":" in args.model or "@" in args.model) else ModelRef(args.model, None, None)
        args.model = ref.model
        versions = client.list_versions(args.model).versions
        tags = client.list_tags(args.model).tags
        by_version: dict[int, list[str]] = {}
        for t in tags:
            by_version.setdefault(t.version, []).append(t.tag)
        shown = ref.version if ref.version is not None else next((t.version for t in tags if t.tag == ref.tag), None)
        if ref.tag is not None and shown is None:
            raise TransferError(f"{args.model} has no tag {ref.tag!r}; 'paramctl ls {args.model}' lists its tags",
                                grpc.StatusCode.NOT_FOUND)
        if ref.version is not None and all(v.number != ref.version for v in versions):
            raise TransferError(f"{args.model} has no version {ref.version}; 'paramctl ls {args.model}' lists its versions",
                                grpc.StatusCode.NOT_FOUND)
        vt = Table(title=f"{args.model}: versions")
        for col in ("version", "parent", "created", "size", "chunks", "publisher", "clock", "tags", "manifest"):
            vt.add_column(col)
        for v in versions:
            vt.add_row(
                f"v{v.number}{' (forced)' if v.forced else ''}", f"v{v.parent}" if v.HasField("parent") else "-", _when(v.created_at),
                human_bytes(v.nbytes), str(v.chunk_count), v.publisher, ", ".join(f"{k}:{n}" for k, n in sorted(v.clock.items())),
                ", ".join(by_version.get(v.number, [])), v.manifest_id[:16],
            )  # fmt: skip
        out.print(vt)
        tt = Table(title=f"{args.model}: tags")
        for col in ("tag", "version", "rollback to", "moves", "last moved by", "when"):
            tt.add_column(col)
        for t in tags:
            last = t.history[-1] if t.history else None
            back = f"v{t.rollback_to}" if t.HasField("rollback_to") else "-"
            tt.add_row(t.tag, f"v{t.version}", back, str(len(t.history)), last.who if last else "-", _when(last.when) if last else "-")
        out.print(tt)
        if shown is None and versions:
            shown = max(v.number for v in versions)
        if shown is not None:
            _print_files(out, fetch_manifest(view, args.model, shown))
        return 0


def _print_files(out: Console, manifest: Manifest) -> None:
    """The files a pull --out-dir of this version writes: weight shards and the other files."""
    ft = Table(title=f"{manifest.model} v{manifest.version}: files")
    for col in ("path", "kind", "size", "blake3 / tensors"):
        ft.add_column(col)
    # Paths are whatever the publisher's folder held: shown as text, never read as rich markup.
    for path, entries in shard_plan(manifest).items():
        ft.add_row(escape(path), "weights", human_bytes(sum(t.nbytes for t in entries)), f"{len(entries)} tensors")
    for f in manifest.files:
        ft.add_row(escape(f.path), "file", human_bytes(f.size), f.blake3[:16])
    out.print(ft)


def cmd_status(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterView.connect(opts) as view:
        info = view.info
        members = list(info.members)
        by_id = members_api.server_statuses(view, members)
        statuses = [by_id[m.server_id] for m in members]
        # The member that answered ClusterInfo may name a leader that has since died: only a leader
        # that says so itself is shown as one.
        leaders = [m.server_id for m, st in zip(members, statuses) if not isinstance(st, str) and st.is_leader]
        if leaders:
            leader = leaders[0]
        elif info.leader_id:
            leader = f"(none reachable; last known {info.leader_id})"
        else:
            leader = "(none: no member names one; a leader needs a majority of the members up and connected)"
        table = Table(title=f"cluster: leader {leader}  term {info.term}  commit index {info.commit_index}  "
                            f"R={info.ring.replication_factor} W={info.ring.write_quorum} vnodes={info.ring.vnodes}")  # fmt: skip
        for col in ("server", "grpc", "raft", "state", "zone", "role", "chunks", "disk", "repair queue", "quarantined", "cache"):
            table.add_column(col, justify="right" if col in ("chunks", "disk", "repair queue", "quarantined") else "left")
        for m, st in zip(members, statuses):
            if isinstance(st, str):
                table.add_row(m.server_id, m.grpc_address, m.raft_address, m.state, m.zone or "-", f"[red]{st.lower()}[/red]",
                              "-", "-", "-", "-", "-")
                continue
            role = "leader" if st.is_leader else "follower"
            cache = f"{human_bytes(st.cache.used_bytes)}/{human_bytes(st.cache.capacity_bytes)}"
            table.add_row(
                m.server_id, m.grpc_address, m.raft_address, m.state, m.zone or "-", role, str(st.chunk_count),
                human_bytes(st.bytes_on_disk),
                str(st.repair_queue), str(st.quarantined), cache,
            )  # fmt: skip
        out.print(table)
        if not leaders:
            answering = sum(not isinstance(st, str) for st in statuses)
            raise ClusterUnreachable(f"no reachable server is the Raft leader ({answering} of {len(members)} members answer): "
                                     "writes and linearizable reads wait for a majority; start the stopped servers")
        return 0


def cmd_member(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    def say(text: str) -> None:
        out.print(text, markup=False, highlight=False)

    sid = _checked_server_id(args.server_id)
    with ClusterView.connect(opts) as view:
        if args.member_command == "add":
            members = members_api.add_member(view, sid, args.grpc, args.raft, args.zone)
            say(f"{sid} is a member ({args.grpc}, Raft {args.raft}); members: "
                + ", ".join(f"{m.server_id} ({m.state})" for m in members))
            say("it catches up from the leader, and re-replication moves its share of the chunks to it "
                "(watch the chunk counts in 'paramctl status')")
            return 0
        if args.member_command == "drain":
            if members_api.drain(view, sid):
                say(f"{sid} marked leaving: the ring no longer places chunks on it")
            status = members_api.wait_drained(view, sid, args.wait) if args.wait else members_api.check_drain(view, sid)
            _print_placement(out, status)
            if status.drained:
                say(f"{status.summary()}\nnext: stop {sid}, then 'paramctl member remove {sid}'"
                    if status.target_answers else f"{status.summary()}\nnext: 'paramctl member remove {sid}'")
                return 0
            if not args.wait:
                say(f"{status.summary()}\nrun 'paramctl member drain {sid}' again to wait for it")
                return 0
            raise TransferError(f"after {args.wait:g} s: {status.summary()}", grpc.StatusCode.FAILED_PRECONDITION)
        members = members_api.remove_member(view, sid, force=args.force)
        say(f"{sid} removed; members: " + ", ".join(f"{m.server_id} ({m.state})" for m in members))
        return 0


def _checked_server_id(text: str) -> str:
    try:
        return check_name("server id", text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _print_placement(out: Console, status: members_api.DrainStatus) -> None:
    table = Table(title=f"placement on the ring {','.join(status.ring) or '(empty)'}")
    for col in ("server", "state", "chunks"):
        table.add_column(col)
    for p in status.members:
        table.add_row(p.server_id, p.state, p.detail)
    out.print(table)


COMMANDS: dict[str, Callable[[argparse.Namespace, ClusterOptions, Console], int]] = {
    "push": cmd_push,
    "pull": cmd_pull,
    "tag": cmd_tag,
    "rollback": cmd_rollback,
    "untag": cmd_untag,
    "ls": cmd_ls,
    "status": cmd_status,
    "prewarm": cmd_prewarm,
    "member": cmd_member,
}


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
