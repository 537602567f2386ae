"""The extra copies this server holds for hot chunks of others (``ExtraCopies``): bounded in count and
bytes, leased, listed in ``DATA_DIR/hot_extras.json``. Pure: the clock is injected."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

STATE_FILE = "hot_extras.json"


@dataclass
class _Extra:
    size: int
    expires: float
    baseline: float | None  # the store's claim time of the copy when it arrived (None: reserved, not stored yet)


class ExtraCopies:
    """The extra copies this server holds for hot chunks of others: bounded, leased. Pure (clock injected)."""

    def __init__(self, max_chunks: int, max_bytes: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_chunks, self.max_bytes, self.lease_s = max_chunks, max_bytes, lease_s
        self.clock = clock
        self._items: dict[str, _Extra] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.changed = False  # set when the stored set changed (for the state file)

    def reserve(self, chunk_id: str, size: int) -> bool:
        """Room for a new extra copy of ``size`` bytes? Reserves it (``confirm`` or ``cancel`` next).
        An id already held as an extra is renewed and answers True."""
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None:
                found.expires = self.clock() + self.lease_s
                return True
            if len(self._items) >= self.max_chunks or self._bytes + size > self.max_bytes:
                return False
            self._items[chunk_id] = _Extra(size, self.clock() + self.lease_s, None)
            self._bytes += size
            return True

    def confirm(self, chunk_id: str, baseline: float) -> None:
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None and found.baseline is None:
                found.baseline = baseline
                self.changed = True

    def cancel(self, chunk_id: str) -> None:
        """Drop a reservation that was not stored (the chunk was here already); a held extra stays."""
        with self._lock:
            found = self._items.get(chunk_id)
            if found is not None and found.baseline is None:
                del self._items[chunk_id]
                self._bytes -= found.size

    def renew(self, chunk_ids: Iterable[str]) -> int:
        now = self.clock()
        n = 0
        with self._lock:
            for cid in chunk_ids:
                found = self._items.get(cid)
                if found is not None:
                    found.expires = now + self.lease_s
                    n += 1
        return n

    def expired(self) -> list[tuple[str, float]]:
        """(id, baseline) of the stored extras whose lease ended."""
        now = self.clock()
        with self._lock:
            return [(cid, e.baseline) for cid, e in self._items.items() if e.baseline is not None and e.expires <= now]

    def forget(self, chunk_id: str) -> None:
        with self._lock:
            found = self._items.pop(chunk_id, None)
            if found is not None:
                self._bytes -= found.size
                self.changed = True

    def held(self) -> dict[str, int]:
        with self._lock:
            return {cid: e.size for cid, e in self._items.items() if e.baseline is not None}

    def __contains__(self, chunk_id: object) -> bool:
        with self._lock:
            found = self._items.get(chunk_id) if isinstance(chunk_id, str) else None
            return found is not None and found.baseline is not None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.size for e in self._items.values() if e.baseline is not None)

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._items.values() if e.baseline is not None)

    # state file: {"extras": {id: size}} -- baselines and leases are taken afresh on load
    def dump(self) -> bytes:
        return json.dumps({"extras": self.held()}, sort_keys=True).encode()

    def load(self, raw: bytes, baseline_of: Callable[[str], float | None]) -> int:
        """Re-register the extras listed in ``raw`` that are still stored (fresh lease); returns how many."""
        try:
            listed = json.loads(raw).get("extras", {})
        except (ValueError, AttributeError):
            return 0
        n = 0
        for cid, size in listed.items() if isinstance(listed, dict) else ():
            if not isinstance(cid, str) or not isinstance(size, int):
                continue
            baseline = baseline_of(cid)
            if baseline is not None and self.reserve(cid, size):
                self.confirm(cid, baseline)
                n += 1
        return n
