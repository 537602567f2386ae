"""Monotonic reads of tag resolutions (docs/architecture.md, invariant 4).

The worker remembers, per (model, tag), the newest resolution it has accepted: the version
number, its vector clock and the Raft commit index of the server that answered. A later
resolution whose clock is older (or concurrent) is refused as stale, so a stale or partitioned
server cannot roll the worker back.

A deliberate rollback (``paramctl rollback``) also points a tag at an older clock. It is told
apart from staleness by the commit index: a server whose commit index is above the one we saw
has applied every entry we had seen and more, so its answer is a later tag move, not a stale
one. ``allow_rollback=False`` refuses even those. The other way round, an answer with a newer
clock but a lower commit index than the one seen comes from a state before a rollback the client
has seen: it is refused, so a lagging server cannot undo a rollback either. The commit index of a
read is the last entry the answering server had applied (``consensus.node``).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from pathlib import Path


from paramserver.client.errors import MonotonicFileError as MonotonicFileError  # re-exported: its old home
from paramserver.client.errors import ConfigError, StaleRead


class Order(Enum):
    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


def compare_clocks(a: Mapping[str, int], b: Mapping[str, int]) -> Order:
    """How clock ``a`` relates to clock ``b`` (missing publishers count as 0)."""
    less = greater = False
    for key in set(a) | set(b):
        x, y = int(a.get(key, 0)), int(b.get(key, 0))
        less |= x < y
        greater |= x > y
    if less and greater:
        return Order.CONCURRENT
    if less:
        return Order.BEFORE
    if greater:
        return Order.AFTER
    return Order.EQUAL


@dataclass(frozen=True)
class Resolution:
    """One answer to "which version is model:tag?", as seen from one server."""

    model: str
    tag: str
    version: int
    manifest_id: str
    clock: Mapping[str, int] = field(default_factory=dict)
    commit_index: int = 0
    server: str = ""

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "tag": self.tag, "version": self.version, "manifest_id": self.manifest_id,
                "clock": dict(self.clock), "commit_index": self.commit_index, "server": self.server}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Resolution:
        clock = d.get("clock") or {}
        assert isinstance(clock, Mapping)
        return cls(str(d["model"]), str(d["tag"]), int(d["version"]), str(d["manifest_id"]),
                   {str(k): int(v) for k, v in clock.items()}, int(d.get("commit_index", 0)),
                   str(d.get("server", "")))


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason: str


def judge(seen: Resolution | None, new: Resolution, allow_rollback: bool = True) -> Verdict:
    """Pure rule: may ``new`` replace ``seen``? (No state, so it is easy to test.)"""
    if seen is None:
        return Verdict(True, "first resolution")
    order = compare_clocks(new.clock, seen.clock) if (new.clock or seen.clock) else None
    if order is None:  # versions without clocks: fall back to the version number
        order = Order.AFTER if new.version > seen.version else Order.EQUAL if new.version == seen.version else Order.BEFORE
    if order is Order.EQUAL and new.version != seen.version:
        # Two versions with one clock: forced siblings committed before each got a clock of its own
        # (consensus.state). Neither is newer; a move between them is judged as a concurrent one.
        order = Order.CONCURRENT
    if order is Order.EQUAL:
        return Verdict(True, order.value)
    if order is Order.AFTER and not (new.commit_index and new.commit_index < seen.commit_index):
        return Verdict(True, order.value)
    # A newer clock from an older state: the tag was moved back (rolled back) after the answering
    # server's state, and taking its answer would undo that. Refused like a stale answer below.
    fresher = new.commit_index > seen.commit_index
    if fresher and allow_rollback:
        return Verdict(True, f"tag moved back (rollback) at commit index {new.commit_index} > {seen.commit_index}")
    why = {Order.BEFORE: "older than", Order.AFTER: "from an older state (commit index) than"}.get(order, "concurrent with")
    return Verdict(
        False,
        f"{new.server or 'server'} resolved {new.model}:{new.tag} to v{new.version} (clock {dict(new.clock)}, commit index "
        f"{new.commit_index}), {why} v{seen.version} (clock {dict(seen.clock)}, commit index {seen.commit_index}) seen before",
    )


class MonotonicReads:
    """Thread-safe memory of the newest resolution per (model, tag); optionally persisted as JSON
    so a restarted worker cannot be rolled back either."""

    def __init__(self, path: str | Path | None = None, allow_rollback: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self.allow_rollback = allow_rollback
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], Resolution] = {}
        if self.path is not None and self.path.is_dir():
            raise MonotonicFileError(f"monotonic-read memory {self.path} is a directory; give a file path "
                                     "(--monotonic-file), e.g. a name inside it")
        if self.path is not None and self.path.exists():
            try:
                rows = json.loads(self.path.read_text())
                if not isinstance(rows, list):
                    raise TypeError(f"expected a JSON list, got {type(rows).__name__}")
                for row in rows:
                    if not isinstance(row, Mapping):
                        raise TypeError(f"expected JSON objects in the list, got {type(row).__name__}")
                    r = Resolution.from_json(row)
                    self._seen[(r.model, r.tag)] = r
            except OSError as exc:
                raise MonotonicFileError(f"monotonic-read memory {self.path} cannot be read ({exc.strerror or exc}); "
                                         "fix its permissions or give another file (--monotonic-file)") from None
            except (ValueError, KeyError, TypeError, AssertionError) as exc:
                raise MonotonicFileError(f"monotonic-read memory {self.path} is unreadable ({exc}); delete it to start "
                                         "afresh, or give another file (--monotonic-file)") from None

    def seen(self, model: str, tag: str) -> Resolution | None:
        with self._lock:
            return self._seen.get((model, tag))

    def check(self, new: Resolution) -> Verdict:
        return judge(self.seen(new.model, new.tag), new, self.allow_rollback)

    def accept(self, new: Resolution) -> Resolution:
        """Record ``new`` if it passes ``judge``; raise StaleRead otherwise."""
        with self._lock:
            seen = self._seen.get((new.model, new.tag))
            verdict = judge(seen, new, self.allow_rollback)
            if not verdict.accepted:
                raise StaleRead(verdict.reason + "; another server may be up to date, or wait for this one to catch up")
            if seen is None or seen != new:
                # Keep the highest commit index seen so a later stale answer is still caught.
                if seen is not None and seen.version == new.version and seen.commit_index > new.commit_index:
                    new = Resolution(new.model, new.tag, new.version, new.manifest_id, new.clock, seen.commit_index, new.server)
                self._seen[(new.model, new.tag)] = new
                self._save_locked()
            return new

    def remember(self, new: Resolution) -> None:
        """Force ``new`` into memory (tests, or seeding from an operator's known-good state)."""
        with self._lock:
            self._seen[(new.model, new.tag)] = new
            self._save_locked()

    def _save_locked(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps([r.to_json() for r in self._seen.values()], sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            # Not a MonotonicFileError: resolve_ref takes a StaleRead from accept() for a stale answer.
            raise ConfigError(f"monotonic-read memory {self.path} cannot be written ({exc.strerror or exc}); fix the "
                              "path or its permissions, or give another file (--monotonic-file)") from None


__all__ = ["MonotonicFileError", "MonotonicReads", "Order", "Resolution", "Verdict", "compare_clocks", "judge"]
