"""The router's choice logic: a pure state machine, no sockets, threads or wall clock.

Events in: a worker's heartbeat (its lease), a request starting and ending on a worker (with its
outcome). Decisions out: which worker a request for ``MODEL@N`` goes to, which workers a pre-warm
asks, which version a tag names when the cluster cannot be asked, how warm a version is.

Choice (``affinity=True``): among live workers that can answer, a worker with that exact version
loaded and the shortest queue; when every such worker's queue has reached ``spill_queue``, spill to
the next one (another holder under the bound, else the worker holding most of the version's
chunks in its cache tiers); with no holder, the worker holding most of the version's chunks. A
worker whose request failed is left out until it sends a heartbeat after the failure; a worker
missing ``lease_s`` of heartbeats (three beats) is dropped. ``affinity=False`` picks uniformly at
random among the workers that can answer (the baseline of ``bench/bench_fleet.py``).

Identity: a worker id is bound to the instance secret of its first beat while its lease lasts (a
beat or leave with another secret is refused), and a worker is routed to only once its URL proved
it is that worker (``identity_proof``, checked by the router's I/O; ``verified``). Workers whose
check failed make room first when the table is full.

The state is soft: a restarted router rebuilds it from heartbeats within one beat, and several
routers can run side by side (each counts only its own requests in flight, plus what the workers
report).
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.errors import HeartbeatError  # re-exported: its home is worker.errors

# Headers the router sends a worker with each request: which version it wants ("MODEL@N"),
# whether another version of that model will do ("0": a tag request) and the seconds left.
WANT_HEADER = "X-Pdparams-Want"
EXACT_HEADER = "X-Pdparams-Exact"
DEADLINE_HEADER = "X-Pdparams-Timeout-S"
MISDIRECTED = 421  # a worker's answer when it neither holds the version nor loads others on demand

# A worker's instance secret (made at its start, sent with each beat and leave): the router binds
# the worker id to the first secret it hears for it, for as long as that worker's lease lasts.
INSTANCE_HEADER = "X-Pdparams-Instance"
MIN_SECRET_CHARS, MAX_SECRET_CHARS = 32, 256
VERIFY_RETRY_S = 5.0  # a worker whose URL did not answer as it is asked again after this

HEARTBEAT_S = 1.0
LEASE_BEATS = 3
MAX_VERSIONS_REPORTED = 64
MAX_WORKERS = 4096


@dataclass(frozen=True)
class VersionKey:
    model: str
    version: int

    def __str__(self) -> str:
        return f"{self.model}@{self.version}"


@dataclass(frozen=True)
class Cached:
    """How much of one version a worker's cache tiers hold (bytes of distinct chunks)."""

    model: str
    version: int
    bytes_total: int
    bytes_cached: int  # in any tier
    bytes_memory: int = 0
    bytes_disk: int = 0

    @property
    def complete(self) -> bool:
        return self.bytes_total > 0 and self.bytes_cached >= self.bytes_total

    @property
    def fraction(self) -> float:
        return self.bytes_cached / self.bytes_total if self.bytes_total > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "bytes_total": self.bytes_total,
                "bytes_cached": self.bytes_cached, "bytes_memory": self.bytes_memory, "bytes_disk": self.bytes_disk}


def _int(d: Mapping[str, Any], key: str, default: int | None = None, low: int = 0) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HeartbeatError(f"heartbeat field {key!r} must be an integer >= {low}, got {value!r}")
    return value


def _str(d: Mapping[str, Any], key: str, limit: int = 512) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise HeartbeatError(f"heartbeat field {key!r} must be a non-empty string of at most {limit} characters")
    return value


@dataclass(frozen=True)
class Heartbeat:
    """What a worker reports every second (``paramworker serve --router URL``)."""

    worker_id: str
    url: str  # where the router reaches it, http://HOST:PORT
    serves: str  # the reference it follows, MODEL:TAG or MODEL@N
    loaded: tuple[VersionKey, ...]  # versions it can answer for without loading anything
    cached: tuple[Cached, ...] = ()
    queue: int = 0
    running: int = 0
    max_queue: int = 64
    other_versions: int = 0  # versions it loads on demand besides the one it follows (0: none)
    device_free_bytes: int | None = None
    # Whether its on-demand loads may be of other models (a Hugging Face worker builds any model from
    # its folder's config); a factory worker builds one architecture, so only its own model's versions.
    any_model: bool = False

    @property
    def model(self) -> str:
        return self.serves.partition(":")[0].partition("@")[0]

    @property
    def tag(self) -> str | None:
        _, sep, tag = self.serves.partition(":")
        return tag if sep else None

    def cached_of(self, key: VersionKey) -> Cached | None:
        for c in self.cached:
            if c.model == key.model and c.version == key.version:
                return c
        return None

    def to_json(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "url": self.url, "serves": self.serves,
                "loaded": [{"model": k.model, "version": k.version} for k in self.loaded],
                "cached": [c.to_json() for c in self.cached], "queue": self.queue, "running": self.running,
                "max_queue": self.max_queue, "other_versions": self.other_versions,
                "device_free_bytes": self.device_free_bytes, "any_model": self.any_model}

    @classmethod
    def from_json(cls, d: object) -> Heartbeat:
        if not isinstance(d, dict):
            raise HeartbeatError("a heartbeat is a JSON object")
        url = _str(d, "url")
        if not url.startswith(("http://", "https://")):
            raise HeartbeatError(f"heartbeat url must be http://HOST:PORT, got {url!r}")
        loaded_raw, cached_raw = d.get("loaded", []), d.get("cached", [])
        if not isinstance(loaded_raw, list) or not isinstance(cached_raw, list):
            raise HeartbeatError("heartbeat fields 'loaded' and 'cached' must be lists")
        if len(loaded_raw) > MAX_VERSIONS_REPORTED or len(cached_raw) > MAX_VERSIONS_REPORTED:
            raise HeartbeatError(f"a heartbeat reports at most {MAX_VERSIONS_REPORTED} versions")
        loaded = []
        for item in loaded_raw:
            if not isinstance(item, dict):
                raise HeartbeatError("each 'loaded' entry is {\"model\", \"version\"}")
            loaded.append(VersionKey(_str(item, "model"), _int(item, "version", low=1)))
        cached = []
        for item in cached_raw:
            if not isinstance(item, dict):
                raise HeartbeatError("each 'cached' entry is an object")
            cached.append(Cached(_str(item, "model"), _int(item, "version", low=1), _int(item, "bytes_total"),
                                 _int(item, "bytes_cached"), _int(item, "bytes_memory", 0), _int(item, "bytes_disk", 0)))
        any_model = d.get("any_model", False)
        if not isinstance(any_model, bool):
            raise HeartbeatError("heartbeat field 'any_model' must be true or false")
        free = d.get("device_free_bytes")
        if free is not None and (isinstance(free, bool) or not isinstance(free, int) or free < 0):
            raise HeartbeatError("heartbeat field 'device_free_bytes' must be null or an integer >= 0")
        return cls(worker_id=_str(d, "worker_id", 200), url=url, serves=_str(d, "serves"), loaded=tuple(loaded),
                   cached=tuple(cached), queue=_int(d, "queue", 0), running=_int(d, "running", 0),
                   max_queue=_int(d, "max_queue", 64), other_versions=_int(d, "other_versions", 0),
                   device_free_bytes=free, any_model=any_model)


def identity_proof(secret: str, worker_id: str, nonce: str) -> str:
    """What a worker answers ``GET /identity?nonce=N`` with: HMAC-SHA256 under its instance secret
    of its id and the router's nonce (the id is in it: a worker's proof never vouches for another)."""
    message = b"pdparams-identity\0" + worker_id.encode() + b"\0" + nonce.encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def check_proof(answer: object, secret: str, worker_id: str, nonce: str) -> str | None:
    """None when ``answer`` (the parsed JSON of ``GET /identity``) proves ``worker_id`` holds
    ``secret``; otherwise why not, in a few words."""
    if not isinstance(answer, dict):
        return "it did not answer a JSON object"
    if answer.get("worker_id") != worker_id:
        return f"it answered as worker {str(answer.get('worker_id'))[:80]!r}"
    proof = answer.get("proof")
    if not isinstance(proof, str) or not hmac.compare_digest(proof, identity_proof(secret, worker_id, nonce)):
        return "its proof does not match the secret the beats carry"
    return None


class Beat(enum.Enum):
    """What the table made of one heartbeat."""

    ACCEPTED = "accepted"
    VERIFY = "verify"  # recorded; check its URL answers as that worker before routing there
    CONFLICT = "conflict"  # the id is held, within its lease, by a worker with another instance secret
    FULL = "full"  # the table is full


@dataclass
class _Worker:
    beat: Heartbeat
    seen_at: float
    secret: str = ""  # the instance secret its first beat carried
    verified: bool = True  # its URL answered as it (routed to only then)
    verifying: bool = False  # a check of its URL is under way
    retry_at: float = 0.0  # a failed check is tried again from then
    inflight: int = 0  # this router's requests there now
    failed_at: float | None = None  # left out until a heartbeat newer than this


@dataclass(frozen=True)
class Decision:
    """Where one attempt of a request goes; ``worker_id`` None: no worker can answer (shed)."""

    worker_id: str | None
    url: str | None = None
    hit: bool = False  # the worker has that exact version loaded
    spilled: bool = False  # a holder was passed over because its queue reached the bound
    reason: str = ""


@dataclass(frozen=True)
class RouterConfig:
    lease_s: float = HEARTBEAT_S * LEASE_BEATS
    spill_queue: int = 8  # a holder whose queue (waiting + running) reaches this is passed over if another can take it
    affinity: bool = True
    verify_urls: bool = True  # route to a worker only once its URL answered as it (False: on its beat's word)
    verify_retry_s: float = VERIFY_RETRY_S

    def validate(self) -> RouterConfig:
        if not 0 < self.lease_s <= 3600:
            raise ValueError(f"lease_s must be in (0, 3600], got {self.lease_s}")
        if not 1 <= self.spill_queue <= 100_000:
            raise ValueError(f"spill_queue must be 1..100000, got {self.spill_queue}")
        if not 0 < self.verify_retry_s <= 3600:
            raise ValueError(f"verify_retry_s must be in (0, 3600], got {self.verify_retry_s}")
        return self


@dataclass
class RouterState:
    """The routing table and the choice. ``clock``: seconds, monotonic (injected for tests)."""

    clock: Callable[[], float]
    config: RouterConfig = field(default_factory=RouterConfig)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.config.validate()
        self._workers: dict[str, _Worker] = {}

    # ------------------------------------------------------------ events

    def heartbeat(self, beat: Heartbeat, secret: str = "") -> Beat:
        """Record a beat carrying the worker's instance secret. A new worker registers with its first
        (``VERIFY``: check its URL, then ``verified``); a live worker's id is bound to its secret, so a
        beat for it with another secret is a ``CONFLICT`` until its lease runs out (then the id is
        free: a restarted worker comes back). A changed URL is checked again."""
        now = self.clock()
        self.expire()
        entry = self._workers.get(beat.worker_id)
        if entry is None:
            if len(self._workers) >= MAX_WORKERS:
                # URLs that failed their check make room first: made-up workers cannot fill the table
                unproven = next((wid for wid, w in self._workers.items() if not w.verified and not w.verifying), None)
                if unproven is None:
                    return Beat.FULL
                del self._workers[unproven]
            check = self.config.verify_urls
            self._workers[beat.worker_id] = _Worker(beat, now, secret=secret, verified=not check, verifying=check)
            return Beat.VERIFY if check else Beat.ACCEPTED
        if not hmac.compare_digest(entry.secret.encode(), secret.encode()):
            return Beat.CONFLICT
        if beat.url != entry.beat.url and self.config.verify_urls:
            entry.verified, entry.verifying, entry.retry_at = False, False, 0.0
        entry.beat, entry.seen_at = beat, now
        if entry.failed_at is not None and now > entry.failed_at:
            entry.failed_at = None
        if not entry.verified and not entry.verifying and now >= entry.retry_at:
            entry.verifying = True
            return Beat.VERIFY
        return Beat.ACCEPTED

    def verified(self, worker_id: str, secret: str, url: str, ok: bool) -> None:
        """The outcome of checking that ``url`` answers as ``worker_id`` holding ``secret``; ignored when
        the entry changed meanwhile. A failure is checked again on a beat ``verify_retry_s`` later."""
        entry = self._workers.get(worker_id)
        if entry is None or entry.secret != secret or entry.beat.url != url:
            return
        entry.verifying = False
        entry.verified = ok
        if not ok:
            entry.retry_at = self.clock() + self.config.verify_retry_s

    def leave(self, worker_id: str, secret: str = "") -> bool:
        """Drop a worker at its word; False (nothing done) when ``secret`` is not the one it registered with."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return True
        if not hmac.compare_digest(entry.secret.encode(), secret.encode()):
            return False
        del self._workers[worker_id]
        return True

    def started(self, worker_id: str) -> None:
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.inflight += 1

    def finished(self, worker_id: str, ok: bool) -> None:
        """A request there ended; ``ok`` False: the worker failed or vanished (left out until it beats again)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return
        entry.inflight = max(0, entry.inflight - 1)
        if not ok:
            entry.failed_at = self.clock()

    def expire(self) -> list[str]:
        """Drop workers whose lease ran out; returns their ids."""
        cutoff = self.clock() - self.config.lease_s
        gone = [wid for wid, w in self._workers.items() if w.seen_at < cutoff]
        for wid in gone:
            del self._workers[wid]
        return gone

    # ------------------------------------------------------------ decisions

    def _live(self, exclude: Iterable[str] = ()) -> list[_Worker]:
        self.expire()
        skip = set(exclude)
        return [w for wid, w in sorted(self._workers.items()) if wid not in skip and w.failed_at is None and w.verified]

    @staticmethod
    def _load(w: _Worker) -> int:
        return max(w.beat.queue + w.beat.running, w.inflight)

    @staticmethod
    def _can_answer(w: _Worker, key: VersionKey, exact: bool) -> bool:
        b = w.beat
        if key in b.loaded:
            return True
        if b.other_versions > 0 and (b.model == key.model or b.any_model):
            return True
        # A tag request may be answered by a worker following that model on another version
        # (it serves the old version until the new one is loaded, as a worker does on its own).
        return not exact and b.model == key.model

    @staticmethod
    def _cached_fraction(w: _Worker, key: VersionKey) -> float:
        c = w.beat.cached_of(key)
        return c.fraction if c is not None else 0.0

    def choose(self, key: VersionKey, *, exact: bool = True, exclude: Iterable[str] = ()) -> Decision:
        """The worker for one attempt at ``key``; ``exclude``: workers already tried for this request."""
        able = [w for w in self._live(exclude) if self._can_answer(w, key, exact)]
        if not able:
            return Decision(None, reason=f"no live worker can answer {key}")
        if not self.config.affinity:
            w = self.rng.choice(able)
            return Decision(w.beat.worker_id, w.beat.url, hit=key in w.beat.loaded, reason="random")
        holders = sorted((w for w in able if key in w.beat.loaded), key=lambda w: (self._load(w), w.beat.worker_id))
        bound = self.config.spill_queue
        if holders and self._load(holders[0]) < bound:
            w = holders[0]
            return Decision(w.beat.worker_id, w.beat.url, hit=True, reason="holds the version, shortest queue")
        others = sorted((w for w in able if key not in w.beat.loaded),
                        key=lambda w: (-self._cached_fraction(w, key), self._load(w), w.beat.worker_id))
        under = [w for w in others if self._load(w) < bound]
        if holders:
            if under:
                w = under[0]
                return Decision(w.beat.worker_id, w.beat.url, hit=False, spilled=True,
                                reason="every holder's queue reached the bound: most cached of the others")
            w = holders[0]  # everyone is busy: the holder's queue is still the best place
            return Decision(w.beat.worker_id, w.beat.url, hit=True, reason="every queue reached the bound")
        w = (under or others)[0]
        return Decision(w.beat.worker_id, w.beat.url, hit=False, reason="no holder: most of its chunks cached")

    def prewarm_targets(self, key: VersionKey, count: int | None) -> list[str]:
        """Workers to ask to cache ``key``: those following its model first (they will swap to it), then
        those holding most of it already; ``count`` None: every live worker."""
        live = self._live()
        ranked = sorted(live, key=lambda w: (w.beat.model != key.model, -self._cached_fraction(w, key),
                                             self._load(w), w.beat.worker_id))
        chosen = ranked if count is None else ranked[:count]
        return [w.beat.worker_id for w in chosen]

    def warm(self, key: VersionKey) -> list[tuple[str, Cached | None, bool]]:
        """(worker id, what it caches of ``key``, whether it has ``key`` loaded) for every live worker."""
        return [(w.beat.worker_id, w.beat.cached_of(key), key in w.beat.loaded) for w in self._live()]

    def version_from_workers(self, model: str, tag: str | None) -> int | None:
        """The newest version of ``model`` that workers following ``model:tag`` have loaded (``tag`` None:
        any worker's newest of ``model``): the router's answer when the cluster cannot be asked."""
        best: int | None = None
        for w in self._live():
            b = w.beat
            if tag is not None and (b.model != model or b.tag != tag):
                continue
            for k in b.loaded:
                if k.model == model and (best is None or k.version > best):
                    best = k.version
        return best

    def url_of(self, worker_id: str) -> str | None:
        w = self._workers.get(worker_id)
        return w.beat.url if w is not None else None

    def table(self) -> list[dict[str, Any]]:
        """``GET /workers``: every live worker's last beat, its age and this router's requests there."""
        now = self.clock()
        rows = []
        for w in self._live():
            rows.append({**w.beat.to_json(), "age_s": round(now - w.seen_at, 3), "inflight_here": w.inflight,
                         "verified": True})
        for _wid, w in sorted(self._workers.items()):
            if w.failed_at is None and w.verified:
                continue
            rows.append({**w.beat.to_json(), "age_s": round(now - w.seen_at, 3), "inflight_here": w.inflight,
                         "verified": w.verified, **({"failed": True} if w.failed_at is not None else {})})
        return rows

    def __len__(self) -> int:
        self.expire()
        return len(self._workers)


@dataclass
class RefCache:
    """``MODEL:TAG`` -> version, kept ``ttl_s`` (the router asks the cluster at most once a second per tag)."""

    clock: Callable[[], float]
    ttl_s: float = 1.0
    max_entries: int = 4096

    def __post_init__(self) -> None:
        self._entries: dict[str, tuple[float, int]] = {}

    def get(self, ref: str) -> int | None:
        hit = self._entries.get(ref)
        if hit is None or self.clock() - hit[0] > self.ttl_s:
            return None
        return hit[1]

    def put(self, ref: str, version: int) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[ref] = (self.clock(), version)


__all__ = ["DEADLINE_HEADER", "EXACT_HEADER", "HEARTBEAT_S", "INSTANCE_HEADER", "LEASE_BEATS", "MAX_SECRET_CHARS",
           "MIN_SECRET_CHARS", "MISDIRECTED", "WANT_HEADER", "Beat", "Cached", "Decision", "Heartbeat", "HeartbeatError",
           "RefCache", "RouterConfig", "RouterState", "VersionKey", "check_proof", "identity_proof"]
