"""Progress reporting for push and pull.

A progress sink is any callable ``(phase, done, total)``; push and pull call
it only from the caller's thread, so a sink may print, draw, or raise (an
exception there aborts the transfer and nothing is committed). ``RichProgress``
draws one bar per phase in a terminal.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)


class ProgressSink(Protocol):
    def __call__(self, phase: str, done: int, total: int) -> None: ...


ProgressFn = Callable[[str, int, int], None]


def no_progress(phase: str, done: int, total: int) -> None:
    return None


# Phases that get a bar (measured in bytes); the others are reported to sinks but not drawn.
BYTE_PHASES = frozenset({"pack", "upload", "fetch", "save"})
LABELS = {
    "pack": "chunk + hash",
    "check": "dedup check",
    "upload": "upload",
    "commit": "commit",
    "resolve": "resolve",
    "fetch": "fetch + verify",
    "save": "save",
}


class RichProgress:
    """A rich progress display; use as a context manager around push()/pull()."""

    def __init__(self, console: Console | None = None, *, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<15}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in BYTE_PHASES:
            return  # resolve / dedup check / commit take milliseconds: no bar for them
        # total 0 means "not known yet": rich shows a pulsing bar for total=None.
        size = total if total > 0 else None
        task = self._tasks.get(phase)
        if task is None:
            task = self._tasks[phase] = self._progress.add_task(LABELS.get(phase, phase), total=size)
        self._progress.update(task, completed=done, total=size)


__all__ = ["ProgressSink", "ProgressFn", "RichProgress", "no_progress", "BYTE_PHASES"]
