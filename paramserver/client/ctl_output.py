"""``paramctl``'s output: sizes, the push summary, the tables of files and placement, and the
cluster status (a table, or one JSON object with ``--json``)."""
from __future__ import annotations

import time
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from chunking.manifest import Manifest

from paramserver.client import members as members_api
from paramserver.client.folder import shard_plan
from paramserver.client.push import PushReport
from paramserver.wire.proto import pb


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def print_files(out: Console, manifest: Manifest) -> None:
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


def print_placement(out: Console, status: members_api.DrainStatus) -> None:
    table = Table(title=f"placement on the ring {','.join(status.ring) or '(empty)'}")
    for col in ("server", "state", "chunks"):
        table.add_column(col)
    for p in status.members:
        table.add_row(p.server_id, p.state, p.detail)
    out.print(table)


def status_json(info: pb.ClusterInfoReply, members: Sequence[pb.Member], statuses: Sequence[pb.ServerStatusReply | str],
                leader: str | None) -> dict[str, Any]:
    """``paramctl status --json``: the table's content as one object. Per server, the table's columns
    as fields (sizes in bytes) plus ``served_bytes`` and ``peer_entries``; a server that did not
    answer has ``error`` (the status code's name) and null figures. ``leader`` is null when no
    reachable server says it leads (``last_known_leader``: what ClusterInfo named)."""
    servers: list[dict[str, Any]] = []
    for m, st in zip(members, statuses):
        row: dict[str, Any] = {"id": m.server_id, "grpc": m.grpc_address, "raft": m.raft_address, "state": m.state,
                               "zone": m.zone or None}
        figures = ("role", "chunks", "disk_bytes", "repair_queue", "quarantined", "cache_used_bytes",
                   "cache_capacity_bytes", "served_bytes", "peer_entries")
        if isinstance(st, str):
            row.update(dict.fromkeys(figures), error=st)
        else:
            row.update(role="leader" if st.is_leader else "follower", chunks=st.chunk_count, disk_bytes=st.bytes_on_disk,
                       repair_queue=st.repair_queue, quarantined=st.quarantined, cache_used_bytes=st.cache.used_bytes,
                       cache_capacity_bytes=st.cache.capacity_bytes, served_bytes=st.served_bytes,
                       peer_entries=st.peer_entries)
        servers.append(row)
    return {
        "leader": leader, "last_known_leader": info.leader_id or None, "term": info.term, "commit_index": info.commit_index,
        "ring": {"replication_factor": info.ring.replication_factor, "write_quorum": info.ring.write_quorum,
                 "vnodes": info.ring.vnodes},
        "servers": servers,
        "served_bytes": sum(s["served_bytes"] or 0 for s in servers),  # of the servers that answered
    }


def print_status(out: Console, info: pb.ClusterInfoReply, members: Sequence[pb.Member],
                 statuses: Sequence[pb.ServerStatusReply | str], leaders: Sequence[str]) -> None:
    """``paramctl status``: one table, a row per member."""
    if leaders:
        leader = leaders[0]
    elif info.leader_id:
        leader = f"(none reachable; last known {info.leader_id})"
    else:
        leader = "(none: no member names one; a leader needs a majority of the members up and connected)"
    table = Table(title=f"cluster: leader {leader}  term {info.term}  commit index {info.commit_index}  "
                        f"R={info.ring.replication_factor} W={info.ring.write_quorum} vnodes={info.ring.vnodes}")  # fmt: skip
    right = ("chunks", "disk", "repair queue", "quarantined", "served")
    for col in ("server", "grpc", "raft", "state", "zone", "role", "chunks", "disk", "repair queue", "quarantined", "cache",
                "served"):
        table.add_column(col, justify="right" if col in right else "left")
    for m, st in zip(members, statuses):
        if isinstance(st, str):
            table.add_row(m.server_id, m.grpc_address, m.raft_address, m.state, m.zone or "-", f"[red]{st.lower()}[/red]",
                          "-", "-", "-", "-", "-", "-")
            continue
        role = "leader" if st.is_leader else "follower"
        cache = f"{human_bytes(st.cache.used_bytes)}/{human_bytes(st.cache.capacity_bytes)}"
        table.add_row(
            m.server_id, m.grpc_address, m.raft_address, m.state, m.zone or "-", role, str(st.chunk_count),
            human_bytes(st.bytes_on_disk), str(st.repair_queue), str(st.quarantined), cache, human_bytes(st.served_bytes),
        )  # fmt: skip
    out.print(table)


__all__ = ["human_bytes", "print_files", "print_placement", "print_status", "push_summary", "status_json", "when"]
