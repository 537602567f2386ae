"""The pieces every drill stands on: a background workload, bounded waits, invariant checks.

A drill plugs the real operations in as callables, so this module knows
nothing about gRPC, paramctl or the worker:

* ``publish(i) -> Published | None``: push and commit version i (and move a tag).
* ``load(loader_index, i) -> Loaded | None``: load a model by tag, verify it, say what it got.

The workload runs them on background threads with bounded loops, records
every success and every client error in the ``DrillReport``, and keeps what
the invariant checks need: the committed versions, and per loader the
versions each tag resolved to, in order.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from ..errors import DrillError as DrillError  # re-exported: its old home
from .report import DrillReport

T = TypeVar("T")


@dataclass(frozen=True)
class Published:
    model: str
    version: int
    tag: str | None = None
    nbytes: int = 0
    seed: int | None = None  # what the weights were generated from, when the publisher knows


@dataclass(frozen=True)
class Loaded:
    model: str
    tag: str
    version: int  # the version the tag resolved to for this load
    nbytes: int = 0  # bytes loaded and verified bit-exact
    verified: bool = True  # False: the loader saw wrong bytes (an invariant breach, not a client error)
    detail: str = ""


@dataclass(frozen=True)
class WorkloadConfig:
    loaders: int = 2
    publish_interval_s: float = 0.2  # pause between publishes (after success or failure)
    load_interval_s: float = 0.05
    max_iterations: int = 100_000  # per thread: a loop that never ends cannot hang CI
    error_backoff_s: float = 0.05  # after a failure, so a dead cluster is not hammered
    join_timeout_s: float = 30.0  # stop() waits this long per thread for an in-flight call
    # Loaders start after the publisher's first success, so "model not found" before the
    # first push never counts as a failed load; they start anyway after warmup_timeout_s.
    loaders_wait_for_publish: bool = True
    warmup_timeout_s: float = 60.0

    def validate(self) -> None:
        if not 0 <= self.loaders <= 64:
            raise DrillError(f"loaders must be between 0 and 64, got {self.loaders}")
        for name in ("publish_interval_s", "load_interval_s", "error_backoff_s"):
            if getattr(self, name) < 0:
                raise DrillError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_iterations < 1:
            raise DrillError(f"max_iterations must be >= 1, got {self.max_iterations}")
        if self.join_timeout_s <= 0:
            raise DrillError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")


@dataclass
class _Stats:
    ok: int = 0
    failed: int = 0
    last_ok: float = -1.0  # report time of the latest success
    successes: list[float] = field(default_factory=list)  # report times of successes, for 'first success after t'
    durations: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds) of each successful publish


class Workload:
    """A publisher and N loaders on background threads; start(), then stop() (or use as a context manager)."""

    def __init__(self, report: DrillReport, *, publish: Callable[[int], Published | None] | None = None,
                 load: Callable[[int, int], Loaded | None] | None = None,
                 config: WorkloadConfig = WorkloadConfig()) -> None:
        config.validate()
        if publish is None and (load is None or config.loaders == 0):
            raise DrillError("a workload needs a publish callable, or a load callable and loaders >= 1")
        self.report = report
        self.config = config
        self._publish = publish
        self._load = load
        self._stop = threading.Event()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.published: list[Published] = []
        self.loads: dict[int, list[Loaded]] = {}
        self.stats: dict[str, _Stats] = {}
        self._paused = False
        self._loading = 0  # loads in flight

    # ---- threads ---------------------------------------------------------------------------------
    def start(self) -> "Workload":
        if self._threads:
            raise DrillError("workload already started; a Workload runs once")
        if self._publish is not None:
            self._spawn("publisher", self._publisher_loop)
        if self._load is not None:
            for k in range(self.config.loaders):
                self.loads[k] = []
                self._spawn(f"loader-{k}", partial(self._loader_loop, k))
        self.report.event("workload_started", loaders=self.config.loaders if self._load else 0,
                          publisher=self._publish is not None)
        return self

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        self.stats[name] = _Stats()
        th = threading.Thread(target=target, name=f"drill-{name}", daemon=True)
        self._threads.append(th)
        th.start()

    def stop(self) -> None:
        """Stop every thread after its in-flight call; a thread stuck past join_timeout_s is reported.

        Idempotent: a drill body may stop the load before its final checks and the caller again in a finally.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        stuck = []
        for th in self._threads:
            th.join(self.config.join_timeout_s)
            if th.is_alive():
                stuck.append(th.name)
        self.report.event("workload_stopped", stuck=stuck)
        if stuck:
            self.report.client_error("workload", f"threads still in a call after {self.config.join_timeout_s}s: {stuck}",
                                     kind="STUCK")
        for name, st in self.stats.items():
            self.report.count(f"{name}.ok", st.ok)
            self.report.count(f"{name}.failed", st.failed)

    def __enter__(self) -> "Workload":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return any(th.is_alive() for th in self._threads)

    def _publisher_loop(self) -> None:
        assert self._publish is not None
        for i in range(1, self.config.max_iterations + 1):
            if self._stop.is_set():
                return
            started = self.report.now()
            try:
                result = self._publish(i)
            except Exception as exc:  # noqa: BLE001 - every client error is data for the report
                self._failed("publisher", exc)
                self._stop.wait(self.config.error_backoff_s)
                continue
            with self._cond:
                self.stats["publisher"].durations.append((started, self.report.now() - started))
            if result is not None:
                with self._cond:
                    self.published.append(result)
                    self._cond.notify_all()
                self.report.count("versions_published")
                self.report.count("bytes_published", result.nbytes)
            self._succeeded("publisher")
            self._stop.wait(self.config.publish_interval_s)

    def _loader_loop(self, k: int) -> None:
        assert self._load is not None
        name = f"loader-{k}"
        if self._publish is not None and self.config.loaders_wait_for_publish:
            deadline = time.monotonic() + self.config.warmup_timeout_s
            with self._cond:
                while not self.published and not self._stop.is_set() and time.monotonic() < deadline:
                    self._cond.wait(0.1)
        for i in range(1, self.config.max_iterations + 1):
            with self._cond:
                while self._paused and not self._stop.is_set():
                    self._cond.wait(0.1)
                if self._stop.is_set():
                    return
                self._loading += 1
            try:
                result = self._load(k, i)
            except Exception as exc:  # noqa: BLE001 - every client error is data for the report
                self._failed(name, exc)
                self._stop.wait(self.config.error_backoff_s)
                continue
            finally:
                with self._cond:
                    self._loading -= 1
                    self._cond.notify_all()
            if result is not None:
                with self._cond:
                    self.loads[k].append(result)
                if result.verified:
                    self.report.add_bytes_verified(result.nbytes)
                else:
                    self.report.count("loads_with_wrong_bytes")
                    self.report.event("wrong_bytes", loader=k, model=result.model, tag=result.tag,
                                      version=result.version, detail=result.detail)
            self._succeeded(name)
            self._stop.wait(self.config.load_interval_s)

    def _succeeded(self, name: str) -> None:
        t = self.report.now()
        with self._cond:
            st = self.stats[name]
            st.ok += 1
            st.last_ok = t
            st.successes.append(t)
            self._cond.notify_all()

    def _failed(self, name: str, exc: BaseException) -> None:
        with self._cond:
            self.stats[name].failed += 1
        self.report.client_error(name, exc)

    # ---- pausing the loaders (a drill that needs to be the first reader of something) ----------------------
    def pause_loaders(self, timeout: float = 30.0) -> bool:
        """Hold every loader before its next load and wait for in-flight loads; False if some are still running."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._paused = True
            while self._loading > 0 and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            quiet = self._loading == 0
        self.report.event("loaders_paused", quiet=quiet)
        return quiet

    def resume_loaders(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        self.report.event("loaders_resumed")

    # ---- queries for drills ------------------------------------------------------------------------
    def successes(self, name: str) -> list[float]:
        """Report times of every success of thread name ("publisher", "loader-0", ...)."""
        with self._cond:
            st = self.stats.get(name)
            return list(st.successes) if st else []

    def publish_seconds(self, before: float, last: int = 5) -> list[float]:
        """How long each of the ``last`` successful publishes that started before report time
        ``before`` took: what one push costs on this machine at its present load."""
        with self._cond:
            st = self.stats.get("publisher")
            return [d for t, d in (st.durations if st else []) if t < before][-last:]

    def first_success_after(self, name: str, t: float) -> float | None:
        with self._cond:
            st = self.stats.get(name)
            return next((s for s in (st.successes if st else []) if s > t), None)

    def wait_success(self, name: str, after: float, timeout: float) -> float | None:
        """Report time of the first success of thread name after time after, waiting up to timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                st = self.stats.get(name)
                if st is None:
                    raise DrillError(f"no workload thread {name!r}; have {sorted(self.stats)}")
                hit = next((s for s in st.successes if s > after), None)
                left = deadline - time.monotonic()
                if hit is not None or left <= 0 or self._stop.is_set():
                    return hit
                self._cond.wait(min(left, 0.1))

    def committed(self) -> list[Published]:
        with self._cond:
            return list(self.published)

    def failures(self) -> int:
        with self._cond:
            return sum(st.failed for name, st in self.stats.items() if name.startswith("loader-"))


def check_positive_seconds(config: object, names: Iterable[str]) -> None:
    """A drill config's durations: each of ``names`` must be above 0 seconds (DrillError names the first that is not)."""
    for name in names:
        if getattr(config, name) <= 0:
            raise DrillError(f"{name} must be > 0 seconds, got {getattr(config, name)}")


# ---- bounded waiting -------------------------------------------------------------------------------------
def wait_for(predicate: Callable[[], T | None], timeout: float, *, interval: float = 0.05,
             what: str = "condition") -> T:
    """Poll until predicate returns something truthy; exceptions count as 'not yet'. Raises TimeoutError."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - servers are electing or restarting while we poll
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} not reached within {timeout}s (last error: {last!r})")
        time.sleep(interval)


# ---- invariant checks -------------------------------------------------------------------------------------
def check_monotonic_reads(report: DrillReport, workload: Workload) -> bool:
    """No loader ever saw a tag resolve to an older version than it had already seen (invariant 4)."""
    rollbacks = []
    with workload._cond:
        loads = {k: list(v) for k, v in workload.loads.items()}
    for k, seen in loads.items():
        high: dict[tuple[str, str], int] = {}
        for ld in seen:
            key = (ld.model, ld.tag)
            if key in high and ld.version < high[key]:
                rollbacks.append(f"loader-{k} {ld.model}:{ld.tag} went {high[key]} -> {ld.version}")
            high[key] = max(high.get(key, ld.version), ld.version)
    total = sum(len(v) for v in loads.values())
    return report.check("monotonic_reads", not rollbacks,
                        "; ".join(rollbacks[:5]) or f"{total} loads, no tag ever went backwards")


def check_loads_bit_exact(report: DrillReport, workload: Workload) -> bool:
    """Every load that returned was verified bit-exact (invariant 3)."""
    with workload._cond:
        bad = [(k, ld) for k, v in workload.loads.items() for ld in v if not ld.verified]
        total = sum(len(v) for v in workload.loads.values())
    detail = "; ".join(f"loader-{k} {ld.model}:{ld.tag} v{ld.version}: {ld.detail}" for k, ld in bad[:5])
    return report.check("loads_bit_exact", not bad, detail or f"{total} loads verified")


def check_no_failed_loads(report: DrillReport, workload: Workload, allowed_kinds: Iterable[str] = ()) -> bool:
    """Zero failed worker loads, except errors of the allowed kinds (e.g. a clear staleness error)."""
    allowed = set(allowed_kinds)
    counts = {k: v for k, v in report.error_counts.items() if k.startswith("loader-")}
    bad = {k: v for k, v in counts.items() if k.split(":", 1)[1] not in allowed}
    return report.check("no_failed_loads", not bad, f"failed loads: {bad}" if bad else
                        f"0 failed loads{f' (allowed: {counts})' if counts else ''}")


def check_no_lost_commits(report: DrillReport, committed: Iterable[Published],
                          present: Callable[[Published], bool]) -> bool:
    """Every version the publisher saw committed is still there (invariant 5)."""
    items = list(committed)
    lost = []
    for p in items:
        try:
            if not present(p):
                lost.append(p)
        except Exception as exc:  # noqa: BLE001 - an error while looking counts as not found, with the reason
            lost.append(p)
            report.client_error("checker", exc)
    detail = ", ".join(f"{p.model} v{p.version}" for p in lost[:10])
    return report.check("no_lost_commits", not lost, f"lost: {detail}" if lost else f"{len(items)} commits all present")


def committed_present(state: Mapping[str, Any]) -> Callable[[Published], bool]:
    """For check_no_lost_commits: is a published version among ``state``'s (one server's probe state)."""
    return lambda p: any(v[0] == p.version for v in state.get(p.model, {}).get("versions", []))


def check_workload(report: DrillReport, workload: Workload, allowed_kinds: Iterable[str] = ()) -> None:
    """The loaders' invariants at the end of a drill: monotonic reads, bit-exact loads, no failed loads."""
    check_monotonic_reads(report, workload)
    check_loads_bit_exact(report, workload)
    check_no_failed_loads(report, workload, allowed_kinds=allowed_kinds)


def check_converged(report: DrillReport, states: Mapping[str, Any], name: str = "servers_converged") -> bool:
    """Every server holds the same state (versions, tags, vector clocks); the detail names who differs."""
    if not states:
        return report.check(name, False, "no server answered")
    items = list(states.items())
    ref_id, ref = items[0]
    differ = [sid for sid, st in items[1:] if st != ref]
    return report.check(name, not differ, f"{differ} differ from {ref_id}" if differ else
                        f"{len(items)} servers agree")


def check_within(report: DrillReport, name: str, seconds: float | None, limit: float) -> bool:
    """An interval was measured and stayed under its limit (e.g. a few election timeouts)."""
    if seconds is None:
        return report.check(name, False, f"never happened (limit {limit:.2f}s)")
    return report.check(name, seconds <= limit, f"{seconds:.3f}s (limit {limit:.2f}s)")


# ---- running a drill ------------------------------------------------------------------------------------
def run_drill(name: str, body: Callable[[DrillReport], None], *, out_dir: Path | str | None = None,
              render: bool = True, console: Any = None) -> DrillReport:
    """Run body with a fresh report; a crash counts as a broken 'drill_completed' check, never as a pass.

    Writes ``<out_dir>/<name>.json`` when out_dir is given, and prints the tables
    unless render is False. Returns the report; ``report.exit_code()`` is the CLI's exit status.
    """
    report = DrillReport(name)
    report.event("drill_started")
    try:
        body(report)
    except KeyboardInterrupt:
        report.check("drill_completed", False, "interrupted")
        raise
    except Exception as exc:  # noqa: BLE001 - the report must say what broke, and the run must fail
        report.event("drill_crashed", error=f"{type(exc).__name__}: {exc}")
        report.check("drill_completed", False, f"{type(exc).__name__}: {exc}")
    else:
        report.check("drill_completed", True, "")
    finally:
        report.event("drill_finished")
        report.finish()
        if out_dir is not None:
            report.write_json(Path(out_dir) / f"{name}.json")
        if render:
            report.render(console)
    return report


def summarize_rounds(values: Sequence[float]) -> dict[str, float]:
    """Median and max of per-round times, as the kill-leader drill reports them."""
    import statistics

    if not values:
        return {}
    return {"rounds": float(len(values)), "median": statistics.median(values), "max": max(values)}
