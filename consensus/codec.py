"""Conversions between the state machine's plain dicts and the public records."""
from __future__ import annotations

from typing import Any, Mapping

from .clock import VectorClock
from .records import MemberRecord, TagMove, TagRecord, VersionRecord


def version_record(data: Mapping[str, Any]) -> VersionRecord:
    return VersionRecord(
        model=data["model"],
        number=data["number"],
        manifest_id=data["manifest_id"],
        clock=VectorClock(data["clock"]),
        parent=data["parent"],
        created_at=data["created_at"],
        nbytes=data["nbytes"],
        chunk_count=data["chunk_count"],
        publisher=data["publisher"],
        forced=data.get("forced", False),
    )


def tag_record(data: Mapping[str, Any]) -> TagRecord:
    return TagRecord(
        model=data["model"],
        tag=data["tag"],
        version=data["version"],
        history=tuple(
            TagMove(from_version=m["from_version"], to_version=m["to_version"], who=m["who"], when=m["when"])
            for m in data["history"]
        ),
        rollback_to=data.get("rollback_to"),
    )


def member_record(data: Mapping[str, Any]) -> MemberRecord:
    return MemberRecord(
        server_id=data["server_id"],
        grpc_address=data["grpc_address"],
        raft_address=data["raft_address"],
        state=data.get("state", "up"),
        zone=data.get("zone", ""),
        # records written before the bulk port existed have no such key
        bulk_address=data.get("bulk_address", ""),
        clock_rule=data.get("clock_rule", 1),
    )


def member_command(member: MemberRecord) -> dict[str, Any]:
    # The record's JSON fields plus the clock rule, in the key order the log has always had.
    return {"op": "add_member", **member_to_json(member), "clock_rule": member.clock_rule}


def version_to_json(record: VersionRecord) -> dict[str, Any]:
    return {
        "model": record.model,
        "number": record.number,
        "manifest_id": record.manifest_id,
        "clock": dict(record.clock),
        "parent": record.parent,
        "created_at": record.created_at,
        "nbytes": record.nbytes,
        "chunk_count": record.chunk_count,
        "publisher": record.publisher,
        "forced": record.forced,
    }


def tag_to_json(record: TagRecord) -> dict[str, Any]:
    return {
        "model": record.model,
        "tag": record.tag,
        "version": record.version,
        "history": [
            {"from_version": m.from_version, "to_version": m.to_version, "who": m.who, "when": m.when}
            for m in record.history
        ],
    }


def member_to_json(record: MemberRecord) -> dict[str, Any]:
    return {
        "server_id": record.server_id,
        "grpc_address": record.grpc_address,
        "raft_address": record.raft_address,
        "state": record.state,
        "zone": record.zone,
        "bulk_address": record.bulk_address,
    }
