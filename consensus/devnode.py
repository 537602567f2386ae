"""A metadata node as a process, for tests and demos only (servers embed MetadataNode).

    python -m consensus.devnode --id n1 --raft 127.0.0.1:7001 \\
        --peer 127.0.0.1:7002 --peer 127.0.0.1:7003 --data-dir /tmp/n1

Reads one JSON object per line on stdin, ``{"id": 1, "op": "commit_version",
"args": {...}}``, and answers one line per request on stdout, ``{"id": 1,
"ok": true, "result": ...}`` or ``{"id": 1, "ok": false, "error": "Conflict",
"message": "...", "leader": null}``. Requests run concurrently, so answers can
come out of order. The cluster secret is read from the environment variable
named by ``--secret-env`` so that it never shows in ``ps``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .codec import member_to_json, tag_to_json, version_to_json
from .config import RaftConfig
from .errors import MetadataError, NotLeader
from .node import MetadataNode
from .records import MemberRecord, ReadResult, TagRecord, VersionRecord
from .state import CLOCK_RULE

_TUNABLES = {f.name: f.type for f in fields(RaftConfig)
             if f.name.endswith(("_timeout", "_period", "_retry")) or f.name.startswith("log_compaction_")}


def to_json(value: Any) -> Any:
    if isinstance(value, ReadResult):
        return {
            "value": to_json(value.value),
            "commit_index": value.commit_index,
            "server_id": value.server_id,
            "linearizable": value.linearizable,
            "extra": dict(value.extra),
        }
    if isinstance(value, VersionRecord):
        return version_to_json(value)
    if isinstance(value, TagRecord):
        return tag_to_json(value)
    if isinstance(value, MemberRecord):
        return member_to_json(value)
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def operations(node: MetadataNode) -> dict[str, Callable[..., Any]]:
    return {
        "status": node.status,
        "wait_ready": node.wait_ready,
        "is_leader": node.is_leader,
        "leader": node.leader_raft_address,
        "commit_version": node.commit_version,
        "set_tag": node.set_tag,
        "rollback_tag": node.rollback_tag,
        "delete_tag": node.delete_tag,
        "delete_version": node.delete_version,
        "add_member": lambda **member: node.add_member(MemberRecord(**{"clock_rule": CLOCK_RULE, **member})),
        "remove_member": node.remove_member,
        "resolve_tag": node.resolve_tag,
        "get_version": node.get_version,
        "head": node.head,
        "list_models": node.list_models,
        "list_versions": node.list_versions,
        "list_tags": node.list_tags,
        "members": node.members,
        "barrier": node.barrier,
        "transfer_leadership": node.transfer_leadership,
    }


def handle(ops: Mapping[str, Callable[..., Any]], request: Mapping[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = {"id": request.get("id")}
    op = request.get("op")
    if not isinstance(op, str) or op not in ops:
        return {**reply, "ok": False, "error": "Invalid", "message": f"unknown op {op!r}; one of {sorted(ops)}"}
    try:
        result = ops[op](**dict(request.get("args") or {}))
    except MetadataError as exc:
        return {**reply, "ok": False, "error": type(exc).__name__, "message": str(exc),
                "leader": exc.leader if isinstance(exc, NotLeader) else None}
    except TypeError as exc:
        return {**reply, "ok": False, "error": "Invalid", "message": f"bad arguments for {op}: {exc}"}
    return {**reply, "ok": True, "result": to_json(result)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m consensus.devnode", description=__doc__.split("\n")[0])
    parser.add_argument("--id", required=True, help="server id of this member")
    parser.add_argument("--raft", required=True, help="host:port to listen on for Raft (cluster members only)")
    parser.add_argument("--peer", action="append", default=[], help="another member's Raft host:port (repeat)")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--secret-env", help="name of an environment variable that holds the cluster secret")
    parser.add_argument("--no-fsync", action="store_true",
                        help="skip every fsync of the Raft state (tests and drills only: "
                             "a power loss can lose commits)")
    for name in _TUNABLES:
        kind = int if name == "log_compaction_min_entries" else float
        parser.add_argument("--" + name.replace("_", "-"), type=kind)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    secret = os.environ.get(args.secret_env) if args.secret_env else None
    if args.secret_env and not secret:
        print(f"environment variable {args.secret_env} is empty or unset", file=sys.stderr)
        return 2
    tuning = {name: getattr(args, name) for name in _TUNABLES if getattr(args, name) is not None}
    config = RaftConfig(args.id, args.raft, tuple(args.peer), args.data_dir, secret=secret,
                        fsync=not args.no_fsync, **tuning)
    node = MetadataNode(config)
    try:
        node.start()
    except MetadataError as exc:  # e.g. DamagedState naming the file: one line, no traceback
        print(f"devnode {args.id}: start-up failed: {exc}", file=sys.stderr)
        return 1
    out_lock = threading.Lock()

    def emit(obj: Mapping[str, Any]) -> None:
        line = json.dumps(obj)
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    ops = operations(node)

    def answer(request: Mapping[str, Any]) -> None:
        emit(handle(ops, request))

    emit({"event": "started", "server_id": args.id, "raft": args.raft, "pid": os.getpid()})
    with ThreadPoolExecutor(max_workers=8) as pool:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except json.JSONDecodeError as exc:
                emit({"id": None, "ok": False, "error": "Invalid", "message": f"not JSON: {exc}"})
                continue
            if request.get("op") == "shutdown":
                break
            pool.submit(answer, request)
    node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

