"""What a new manifest adds over an old one, in chunks and bytes."""
from __future__ import annotations

from dataclasses import dataclass

from chunking.manifest import Manifest


@dataclass(frozen=True)
class DiffResult:
    added: tuple[str, ...]
    shared: tuple[str, ...]
    removed: tuple[str, ...]
    added_bytes: int
    added_stored_bytes: int
    shared_bytes: int

    @property
    def shared_fraction(self) -> float:
        """Share of the new model's distinct chunk bytes already present in the old one."""
        total = self.added_bytes + self.shared_bytes
        return self.shared_bytes / total if total else 1.0


def diff(old: Manifest | None, new: Manifest) -> DiffResult:
    """Distinct chunk ids of ``new`` that ``old`` lacks (to upload), has (to reuse), and ids only ``old`` has."""
    old_ids = set(old.chunk_ids()) if old is not None else set()
    added, shared = [], []
    added_bytes = added_stored = shared_bytes = 0
    table = new.chunks  # columns: a big checkpoint has half a million chunks
    rows = table.first_rows
    for cid, raw, stored in zip([table.ids[i] for i in rows.tolist()], table.raw_size[rows].tolist(),
                                table.stored_size[rows].tolist()):
        if cid in old_ids:
            shared.append(cid)
            shared_bytes += raw
        else:
            added.append(cid)
            added_bytes += raw
            added_stored += stored
    new_ids = set(new.chunk_ids())
    removed = tuple(dict.fromkeys(i for i in old.chunk_ids() if i not in new_ids)) if old is not None else ()
    return DiffResult(tuple(added), tuple(shared), removed, added_bytes, added_stored, shared_bytes)
