"""What a drill saw: timestamped events, measured intervals, client errors, invariant checks.

A ``DrillReport`` is filled from many threads (the workload's publisher and
loaders, the drill itself) and rendered at the end as rich tables and a JSON
file. ``exit_code()`` is non-zero as soon as one invariant broke, so a drill
run as a CLI or as a CI test fails for the right reason.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

SCHEMA = "pdparams.drill-report/1"
EXIT_OK = 0
EXIT_INVARIANT_BROKEN = 1
MAX_ERRORS_KEPT = 500  # a flapping client can fail thousands of times; keep counts for all, details for some


@dataclass(frozen=True)
class Event:
    name: str
    t: float  # seconds since the drill started (monotonic clock)
    wall: float  # Unix time, to line the event up with server logs
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Interval:
    name: str  # e.g. "time_to_new_leader"; repeated names (rounds) are summarised together
    seconds: float
    start: str = ""  # the events it spans, when it was measured between events
    end: str = ""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""
    t: float = 0.0


@dataclass(frozen=True)
class ClientError:
    source: str  # "publisher", "loader-2", ...
    kind: str  # exception type, or the gRPC status code name
    message: str
    t: float


def error_kind(exc: BaseException) -> str:
    """A gRPC status name (``UNAVAILABLE``, ``DATA_LOSS``) when the error carries one, else the type name.

    Wrappers are looked through: a worker's ``TensorFailed`` is classified by its
    ``cause``, and ``ChunkDataLoss`` (every replica corrupt) counts as ``DATA_LOSS``.
    """
    for _ in range(8):  # a bounded walk down wrapped causes
        inner = getattr(exc, "cause", None)
        if isinstance(inner, BaseException) and inner is not exc:
            exc = inner
            continue
        break
    if type(exc).__name__ == "ChunkDataLoss":
        return "DATA_LOSS"
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            value = code()
            name = getattr(value, "name", None)
            if isinstance(name, str):
                return name
        except Exception:  # noqa: BLE001 - code() of a half-built RpcError can raise; fall back to the type
            pass
    return type(exc).__name__


class DrillReport:
    """Thread-safe collector for one drill run."""

    def __init__(self, drill: str, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.drill = drill
        self._clock = clock
        self._wall = wall_clock
        self._t0 = clock()
        self.started_wall = wall_clock()
        self._lock = threading.Lock()
        self.events: list[Event] = []
        self.intervals: list[Interval] = []
        self.checks: list[Check] = []
        self.errors: list[ClientError] = []
        self.error_counts: dict[str, int] = {}  # "source:kind" -> count, never truncated
        self.counters: dict[str, int] = {}
        self.info: dict[str, Any] = {}  # free-form facts: cluster size, leader ids, the topology's cuts
        self.finished: float | None = None

    # ---- recording -------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the drill started, on the monotonic clock every entry uses."""
        return self._clock() - self._t0

    def event(self, name: str, **detail: Any) -> Event:
        ev = Event(name, self.now(), self._wall(), dict(detail))
        with self._lock:
            self.events.append(ev)
        return ev

    def find_event(self, name: str, after: float = -1.0) -> Event | None:
        """The first event called name at or after time after (None when there is none)."""
        with self._lock:
            return next((e for e in self.events if e.name == name and e.t >= after), None)

    def interval(self, name: str, seconds: float, start: str = "", end: str = "") -> Interval:
        iv = Interval(name, float(seconds), start, end)
        with self._lock:
            self.intervals.append(iv)
        return iv

    def measure(self, name: str, start: Event | str, end: Event | str) -> Interval:
        """The time between two events (objects, or names of recorded events: the first end after start)."""
        s = start if isinstance(start, Event) else self.find_event(start)
        if s is None:
            raise KeyError(f"no event {start!r} recorded; record it with report.event({start!r}) first")
        e = end if isinstance(end, Event) else self.find_event(end, after=s.t)
        if e is None:
            raise KeyError(f"no event {end!r} recorded after {s.name!r} at t={s.t:.3f}s")
        return self.interval(name, e.t - s.t, s.name, e.name)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record one invariant check; returns ok so callers can branch on it."""
        with self._lock:
            self.checks.append(Check(name, bool(ok), detail, self.now()))
        return bool(ok)

    def client_error(self, source: str, exc: BaseException | str, kind: str | None = None) -> None:
        message = str(exc)
        kind = kind or (error_kind(exc) if isinstance(exc, BaseException) else "error")
        with self._lock:
            key = f"{source}:{kind}"
            self.error_counts[key] = self.error_counts.get(key, 0) + 1
            if len(self.errors) < MAX_ERRORS_KEPT:
                self.errors.append(ClientError(source, kind, message[:500], self.now()))

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def add_bytes_verified(self, n: int) -> None:
        self.count("bytes_verified", n)

    def finish(self) -> None:
        if self.finished is None:
            self.finished = self.now()

    # ---- verdict -------------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        with self._lock:
            return all(c.ok for c in self.checks)

    @property
    def broken(self) -> list[Check]:
        with self._lock:
            return [c for c in self.checks if not c.ok]

    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_INVARIANT_BROKEN

    def summary(self) -> dict[str, dict[str, float]]:
        """Per interval name: count, median, max, min (rounds of one drill share a name)."""
        by_name: dict[str, list[float]] = {}
        with self._lock:
            for iv in self.intervals:
                by_name.setdefault(iv.name, []).append(iv.seconds)
        return {name: {"count": len(v), "median": statistics.median(v), "max": max(v), "min": min(v)}
                for name, v in by_name.items()}

    # ---- output ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        summary = self.summary()  # takes the lock itself: compute it before
        with self._lock:
            return {
                "schema": SCHEMA,
                "drill": self.drill,
                "ok": all(c.ok for c in self.checks),
                "started_wall": self.started_wall,
                "duration_s": self.finished if self.finished is not None else self._clock() - self._t0,
                "info": dict(self.info),
                "counters": dict(self.counters),
                "bytes_verified": self.counters.get("bytes_verified", 0),
                "events": [asdict(e) for e in self.events],
                "intervals": [asdict(i) for i in self.intervals],
                "summary": summary,
                "checks": [asdict(c) for c in self.checks],
                "client_errors": {"counts": dict(self.error_counts), "samples": [asdict(e) for e in self.errors]},
            }

    def write_json(self, path: Path | str) -> Path:
        """Write the report atomically (a reader never sees half a file); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, default=str))
        tmp.replace(path)
        return path

    def render(self, console: Any = None) -> None:
        """Print the report as rich tables (events, intervals, errors, checks) and a verdict line."""
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        data = self.to_dict()
        events = Table(title=f"drill {self.drill}: events", show_lines=False)
        for col in ("t (s)", "wall", "event", "detail"):
            events.add_column(col)
        for e in data["events"]:
            wall = time.strftime("%H:%M:%S", time.gmtime(e["wall"])) + f".{int(e['wall'] * 1000) % 1000:03d}"
            detail = ", ".join(f"{k}={v}" for k, v in e["detail"].items())
            events.add_row(f"{e['t']:.3f}", wall, e["name"], detail)
        console.print(events)
        if data["summary"]:
            times = Table(title="measured intervals (s)")
            for col in ("interval", "n", "median", "max", "min"):
                times.add_column(col)
            for name, s in data["summary"].items():
                times.add_row(name, str(s["count"]), f"{s['median']:.3f}", f"{s['max']:.3f}", f"{s['min']:.3f}")
            console.print(times)
        counters = Table(title="workload")
        counters.add_column("counter")
        counters.add_column("value")
        for name, value in sorted(data["counters"].items()):
            counters.add_row(name, f"{value:,}")
        for key, value in sorted(data["client_errors"]["counts"].items()):
            counters.add_row(f"client error {key}", f"{value:,}")
        console.print(counters)
        checks = Table(title="invariants")
        for col in ("check", "result", "detail"):
            checks.add_column(col)
        for c in data["checks"]:
            checks.add_row(c["name"], "[green]ok[/green]" if c["ok"] else "[bold red]BROKEN[/bold red]", c["detail"])
        console.print(checks)
        if data["ok"]:
            console.print(f"[green]drill {self.drill}: every invariant held[/green]")
        else:
            names = ", ".join(c.name for c in self.broken)
            console.print(f"[bold red]drill {self.drill}: invariant broken: {names}[/bold red]")


def load_report(path: Path | str) -> dict[str, Any]:
    """Read a report written by write_json, checking its schema."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a drill report ({SCHEMA}); got schema {data.get('schema')!r}")
    return data
