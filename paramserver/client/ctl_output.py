"""``paramctl``'s output: sizes, the push summary, and the tables of files and placement."""
from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from chunking.manifest import Manifest

from paramserver.client import members as members_api
from paramserver.client.folder import shard_plan
from paramserver.client.push import PushReport


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


__all__ = ["human_bytes", "print_files", "print_placement", "push_summary", "when"]
