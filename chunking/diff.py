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
    for ref in new.unique_chunks():
        if ref.id in old_ids:
            shared.append(ref.id)
            shared_bytes += ref.raw_size
        else:
            added.append(ref.id)
            added_bytes += ref.raw_size
            added_stored += ref.stored_size
    new_ids = set(new.chunk_ids())
    removed = tuple(r.id for r in old.unique_chunks() if r.id not in new_ids) if old is not None else ()
    return DiffResult(tuple(added), tuple(shared), removed, added_bytes, added_stored, shared_bytes)
