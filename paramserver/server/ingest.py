"""Received chunks into the store: the one way both write transports reach it.

The bulk port's write sessions (a PUT) and gRPC PutChunks (a request message) hand a list of
:class:`~paramserver.wire.chunk_record.ChunkRecord` to :func:`ingest` and get one
:class:`Outcome` per chunk back, in order; each transport only words the outcomes its own way
(bulk ACK statuses; PutChunks acks, or the status its call ends with). So both answer alike:

- A chunk sent twice in one call is stored once; the repeat is answered ALREADY_PRESENT (it is,
  once the first is durable), or with the first's error.
- ``put_many`` stops at the first chunk it cannot take (its bytes do not match its id, damaged in
  transit, an unknown codec): the chunks before it are stored, that one is answered INVALID or
  CORRUPT_IN_TRANSIT, and the rest are tried again without it.
- A full disk answers FULL (with the free bytes) for every chunk not yet stored; any other store
  error (the store closed or read-only, an I/O error) FAILED.
- Every chunk stored or already present here is a fresh verified copy: the repair queue is told.
- ``hot``: the call carries hot copies (PutChunks with ``hot_copy``): each is admitted as a
  leased extra, stored plainly (a ring replica here), or REFUSED with the reason; an admitted
  extra is confirmed once stored, cancelled otherwise.

An outcome is known only once ``put_many`` returned: the stored chunks are durable.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from paramserver.server.errors import ChunkError, ChunkTransferCorruptError, ParamServerError, StoreFullError
from paramserver.server.hot_chunks import HotChunks
from paramserver.server.repair import RepairQueue
from paramserver.server.store import ChunkStore
from paramserver.wire.chunk_record import ChunkRecord


class Kind(enum.Enum):
    STORED = "stored"  # written and synced by this call
    PRESENT = "present"  # an intact copy was here already (or the repeat of a chunk this call stored)
    INVALID = "invalid"  # its bytes are not its id's, or its codec is unknown
    CORRUPT_IN_TRANSIT = "corrupt_in_transit"  # its bytes fail their CRC32C: damaged on the way
    FULL = "full"  # the disk has no room for it
    FAILED = "failed"  # the store could not take it (closed, read-only, an I/O error)
    REFUSED = "refused"  # a hot copy this server does not take (bounds, hot chunks off)


ACCEPTED = frozenset({Kind.STORED, Kind.PRESENT})


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    message: str = ""  # why, naming this server (``where``); empty when accepted
    free_bytes: int = 0  # FULL: the bytes still free here
    error: BaseException | None = None  # the store's error behind it, when there was one

    @property
    def accepted(self) -> bool:
        return self.kind in ACCEPTED


@dataclass(frozen=True, slots=True)
class Ingested:
    """The outcomes of one call, one per chunk in the order sent, and what they add up to."""

    outcomes: list[Outcome]
    stored: int  # chunks this call wrote
    present: int  # chunks answered already present (repeats included)
    stored_bytes: int  # stored bytes this call wrote
    accepted_bytes: int  # stored bytes of every chunk answered stored or present (repeats included)

    def first_error(self) -> Outcome | None:
        """The first outcome that is neither accepted nor a refused hot copy."""
        return next((o for o in self.outcomes if not o.accepted and o.kind is not Kind.REFUSED), None)


_PRESENT = Outcome(Kind.PRESENT)
_STORED = Outcome(Kind.STORED)


def ingest(store: ChunkStore, chunks: list[ChunkRecord], *, where: str, repair_queue: RepairQueue | None = None,
           hot: HotChunks | None = None, hot_copy: bool = False) -> Ingested:
    """Store ``chunks`` (one ``put_many`` per retry, one group fsync each) and say what became of each.

    ``where`` names this server at the head of every message ("server ps1"); ``hot_copy``: the
    chunks are hot copies for ``hot`` to admit (None: this server runs without hot chunks).
    """
    n = len(chunks)
    out: list[Outcome | None] = [None] * n
    first: dict[str, int] = {}
    for k, c in enumerate(chunks):
        first.setdefault(c.id, k)  # a chunk sent twice in one call is stored (and decided) once
    todo = list(first.values())
    extras: set[str] = set()
    if hot_copy:
        todo = _admit(chunks, todo, out, extras, hot, where)
    _store(store, chunks, todo, out, where)
    outcomes: list[Outcome] = []
    stored = present = stored_bytes = accepted_bytes = 0
    for k, c in enumerate(chunks):
        j = first[c.id]
        outcome = out[j]
        assert outcome is not None
        if j != k and outcome.kind is Kind.STORED:
            outcome = _PRESENT  # the repeat finds the first durable
        outcomes.append(outcome)
        if outcome.kind is Kind.STORED:
            stored += 1
            stored_bytes += len(c.data)
        elif outcome.kind is Kind.PRESENT:
            present += 1
        if outcome.accepted:
            accepted_bytes += len(c.data)
    for chunk_id, j in first.items():
        outcome = outcomes[j]
        if chunk_id in extras:
            assert hot is not None
            hot.stored(chunk_id, outcome.kind is Kind.STORED)  # confirms the lease, or cancels it
        if outcome.accepted and repair_queue is not None:
            repair_queue.done(chunk_id)  # a fresh verified copy arrived
    return Ingested(outcomes, stored, present, stored_bytes, accepted_bytes)


def _admit(chunks: list[ChunkRecord], todo: list[int], out: list[Outcome | None], extras: set[str],
           hot: HotChunks | None, where: str) -> list[int]:
    """Of hot copies: those this server takes (``extras`` gets the ones kept as leased extras); the
    others are answered REFUSED with the reason (over the bounds, or hot chunks off)."""
    kept: list[int] = []
    for k in todo:
        c = chunks[k]
        decision = "this server runs with --hot-chunks off" if hot is None else hot.admit(c.id, len(c.data))
        if decision == HotChunks.ADMIT:
            extras.add(c.id)
        elif decision != HotChunks.PLAIN:
            out[k] = Outcome(Kind.REFUSED, f"{where}: hot copy refused: {decision}")
            continue
        kept.append(k)
    return kept


def _store(store: ChunkStore, chunks: list[ChunkRecord], todo: list[int], out: list[Outcome | None], where: str) -> None:
    """Put ``chunks[k]`` for k in ``todo`` (distinct ids) and fill in their outcomes."""
    while todo:
        present = [store.has(chunks[k].id) for k in todo]
        try:
            results = store.put_many([chunks[k] for k in todo])
        except ChunkError as exc:  # invalid, damaged in transit, unknown codec: the ones before it are stored
            j = next((i for i, k in enumerate(todo) if chunks[k].id == exc.chunk_id), None)
            if j is None:
                for k in todo:
                    out[k] = Outcome(Kind.FAILED, f"{where}: {exc}", error=exc)
                return
            for i in range(j):
                out[todo[i]] = _PRESENT if present[i] else _STORED
            kind = Kind.CORRUPT_IN_TRANSIT if isinstance(exc, ChunkTransferCorruptError) else Kind.INVALID
            out[todo[j]] = Outcome(kind, f"{where}: {exc}", error=exc)
            todo = todo[j + 1 :]
            continue
        except StoreFullError as exc:
            for k in todo:
                out[k] = Outcome(Kind.FULL, f"{where}: {exc}", exc.free_bytes, exc)
            return
        except (ParamServerError, OSError) as exc:
            for k in todo:
                out[k] = Outcome(Kind.FAILED, f"{where}: could not store chunk {chunks[k].id}: {exc}", error=exc)
            return
        for i, k in enumerate(todo):
            out[k] = _STORED if results[i] else _PRESENT
        return


__all__ = ["ACCEPTED", "Ingested", "Kind", "Outcome", "ingest"]
