"""``paramctl``'s commands: each takes the parsed arguments, the cluster options and the console,
and returns the exit code (expected failures are raised, for ``ctl.main`` to report). Every
command that talks to the cluster holds one client session (``ClusterClient``) for its reads
and writes."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import grpc
from rich.console import Console
from rich.table import Table

from chunking.config import ChunkingConfig
from chunking.errors import ChunkingError
from consensus.validation import check_name

from paramserver.client import members as members_api
from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.ctl_output import (
    human_bytes, print_files, print_placement, print_status, push_summary, status_json, when,
)
from paramserver.client.ctl_router import cmd_prewarm, router_url, wait_warm
from paramserver.client.errors import ClientError, ClusterUnreachable, TransferError, UsageError
from paramserver.client.folder import pull_folder
from paramserver.client.progress import RichProgress
from paramserver.client.pull import PullOptions, pull
from paramserver.client.push import PushOptions, default_publisher, push
from paramserver.client.refs import ModelRef
from paramserver.client.session import ClusterClient


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


def cmd_pull(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    if args.out is not None and args.out.suffix != ".safetensors":
        raise UsageError(f"--out {args.out} must end in .safetensors")
    if args.no_weights and args.out_dir is None:
        raise UsageError("--no-weights writes a model folder without its weights: give it with --out-dir DIR")
    if args.out_dir is not None and args.out_dir.exists():
        raise UsageError(f"--out-dir {args.out_dir} already exists; remove it or choose a new folder")
    if not 1 <= args.streams <= 16:
        raise UsageError(f"--streams must be between 1 and 16, got {args.streams}")
    show = not args.no_progress and sys.stderr.isatty()
    try:
        with RichProgress(enabled=show) as bar:
            options = PullOptions(streams_per_server=args.streams, verify=args.settings.verify, bulk=args.settings.bulk)
            if args.out_dir is not None:
                r = pull_folder(opts.seeds, args.ref, args.out_dir, progress=bar, options=options, cluster=opts,
                                weights=not args.no_weights)
            else:
                r = pull(opts.seeds, args.ref, args.out, progress=bar, options=options, cluster=opts)
    except ClientError as exc:
        if isinstance(exc, TransferError):
            raise
        raise UsageError(str(exc)) from None
    ref = f"{r.model}:{r.tag}" if r.tag else r.model
    if args.no_weights:
        left = f"; left out too: {', '.join(r.skipped[:5])}{' ...' if len(r.skipped) > 5 else ''}" if r.skipped else ""
        out.print(f"pulled {ref} v{r.version} without its weights -> {r.path}{left}\n"
                  f"  {human_bytes(r.bytes_total)} in {r.chunks_total} chunks, every file checked against its BLAKE3; "
                  f"the weights stream at load time: --load-format pdparams with {{\"ref\": \"{args.ref}\"}}")
        return 0
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


def cmd_tag(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    if args.when_warm is not None:
        url = router_url(args)
        t0 = time.monotonic()
        wait_warm(url, f"{args.model}@{args.version}", args.when_warm, args.warm_timeout_s)
        out.print(f"{args.model}@{args.version} fully cached on at least {args.when_warm} workers "
                  f"({time.monotonic() - t0:.1f} s); moving the tag", markup=False, highlight=False)
    with ClusterClient.for_options(opts) as session:
        reply = session.set_tag(args.model, args.tag, args.version, who=default_publisher())
    out.print(f"{args.model}:{args.tag} -> v{reply.tag.version}")
    return 0


def cmd_rollback(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterClient.for_options(opts) as session:
        reply = session.rollback_tag(args.model, args.tag, who=default_publisher())
    out.print(f"{args.model}:{args.tag} rolled back -> v{reply.tag.version}")
    return 0


def cmd_untag(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterClient.for_options(opts) as session:
        session.delete_tag(args.model, args.tag, who=default_publisher())
    if args.tag == "latest":  # never deleted: it follows the newest version again
        out.print(f"{args.model}:latest unpinned; it follows the newest version again", markup=False, highlight=False)
    else:
        out.print(f"{args.model}:{args.tag} deleted", markup=False, highlight=False)
    return 0


def cmd_ls(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterClient.for_options(opts) as session:
        client = session.view().leader_client()  # the leader's view: a push that just returned is listed
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
                f"v{v.number}{' (forced)' if v.forced else ''}", f"v{v.parent}" if v.HasField("parent") else "-", when(v.created_at),
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
            tt.add_row(t.tag, f"v{t.version}", back, str(len(t.history)), last.who if last else "-", when(last.when) if last else "-")
        out.print(tt)
        if shown is None and versions:
            shown = max(v.number for v in versions)
        if shown is not None:
            print_files(out, session.manifest_of(args.model, shown))
        return 0


def cmd_status(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    with ClusterClient.for_options(opts) as session:
        view = session.view()
        info = view.info
        members = list(info.members)
        by_id = members_api.server_statuses(view, members)
        statuses = [by_id[m.server_id] for m in members]
        # The member that answered ClusterInfo may name a leader that has since died: only a leader
        # that says so itself is shown as one.
        leaders = [m.server_id for m, st in zip(members, statuses) if not isinstance(st, str) and st.is_leader]
        if getattr(args, "json", False):
            print(json.dumps(status_json(info, members, statuses, leaders[0] if leaders else None), sort_keys=True))
        else:
            print_status(out, info, members, statuses, leaders)
        if not leaders:
            answering = sum(not isinstance(st, str) for st in statuses)
            raise ClusterUnreachable(f"no reachable server is the Raft leader ({answering} of {len(members)} members answer): "
                                     "writes and linearizable reads wait for a majority; start the stopped servers")
        return 0


def cmd_member(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    def say(text: str) -> None:
        out.print(text, markup=False, highlight=False)

    sid = _checked_server_id(args.server_id)
    with ClusterClient.for_options(opts) as session:
        view = session.view()
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
            print_placement(out, status)
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


__all__ = ["COMMANDS", "cmd_ls", "cmd_member", "cmd_pull", "cmd_push", "cmd_rollback", "cmd_status", "cmd_tag", "cmd_untag"]
