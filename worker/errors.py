"""Errors of the worker's own parts (caches, staging, readiness, heat, serving, routing). Messages say what to do next.

Failures of talking to the cluster (not found, unavailable, stale, data loss, bad references)
are the client's: ``paramserver.client.errors``.
"""
from __future__ import annotations

from collections.abc import Sequence


class WorkerError(Exception):
    """Base class for every error raised by ``worker``."""


class ConfigError(WorkerError, ValueError):
    """A worker configuration value is out of range or inconsistent."""


class CacheError(WorkerError):
    """A cache tier could not be opened or used."""


class StagingTimeout(WorkerError, TimeoutError):
    """No staging buffer became free in time (back-pressure from slow copies)."""

    def __init__(self, timeout: float, count: int, buffer_bytes: int) -> None:
        self.timeout = timeout
        super().__init__(
            f"no staging buffer became free within {timeout:g}s (pool of {count} x {buffer_bytes} bytes); "
            "release buffers after copying, or raise PrefetchConfig.staging_buffers / acquire_timeout_s."
        )


class BufferTooSmall(WorkerError, ValueError):
    """A write or copy does not fit in the staging buffer it targets."""


class UnknownTensor(WorkerError, KeyError):
    """A readiness query named a tensor that is not part of the load."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"tensor {name!r} is not part of this load; check the name against the manifest")

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class ReadinessTimeout(WorkerError, TimeoutError):
    """A tensor was not ready within the wait timeout."""

    def __init__(self, names: Sequence[str], timeout: float | None, missing_chunks: int) -> None:
        self.names = tuple(names)
        shown = ", ".join(self.names[:5]) + (" ..." if len(self.names) > 5 else "")
        super().__init__(
            f"tensor(s) {shown} not ready after {timeout:g}s ({missing_chunks} chunk(s) still missing); "
            "the fetch may be stalled: check the cluster or raise the timeout."
        )


class TensorFailed(WorkerError):
    """A chunk feeding this tensor could not be fetched or verified; the tensor will never be ready."""

    def __init__(self, name: str, cause: BaseException) -> None:
        self.name = name
        self.cause = cause
        super().__init__(f"tensor {name!r} cannot be loaded: {cause}")


class HeatmapMismatch(WorkerError, ValueError):
    """Heat reports of different model versions were merged."""


class FillError(WorkerError, RuntimeError):
    """The module and the checkpoint do not fit together; nothing in the module was changed."""


# ---------------------------------------------------------------------- serving (paramworker serve, paramrouter)


class BadRequest(WorkerError, ValueError):
    """The request body is not something the model can run; answered 400."""


class Misdirected(WorkerError):
    """A router asked for a version this worker neither holds nor loads on demand; answered 421."""


class UnknownVersion(WorkerError):
    """A request named a version of this worker's model that the cluster does not have; answered 404."""


class Shed(WorkerError):
    """The request was refused to protect the worker; retry after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(f"overloaded: {reason}; retry after {retry_after_s} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class HeartbeatError(WorkerError, ValueError):
    """A heartbeat body that is not what a worker sends (``paramrouter`` answers it 400)."""
