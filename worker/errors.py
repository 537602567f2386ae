"""Errors raised by the worker's building blocks. Messages say what to do next."""
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


class StaleRead(WorkerError):
    """Every reachable server answered with a tag resolution older than one already seen."""


class ChunkUnavailable(WorkerError):
    """No replica could serve a chunk (unreachable, missing, timed out or bad bytes)."""

    def __init__(self, chunk_id: str, attempts: dict[str, str], tensors: Sequence[str] = ()) -> None:
        self.chunk_id = chunk_id
        self.attempts = dict(attempts)
        self.tensors = tuple(tensors)
        tried = "; ".join(f"{s}: {r}" for s, r in self.attempts.items()) or "no server holds it"
        feeds = f" (feeds {', '.join(self.tensors[:4])}{' ...' if len(self.tensors) > 4 else ''})" if self.tensors else ""
        super().__init__(
            f"chunk {chunk_id}{feeds} could not be read from any replica [{tried}]; "
            "check that the servers are up (paramctl status) or repair the replicas"
        )


class ChunkDataLoss(ChunkUnavailable):
    """Every replica of a chunk returned bytes that failed verification (DATA_LOSS everywhere)."""

    def __init__(self, chunk_id: str, attempts: dict[str, str], tensors: Sequence[str] = ()) -> None:
        super().__init__(chunk_id, attempts, tensors)
        self.args = (
            f"DATA_LOSS: every replica of chunk {self.chunk_id} is corrupt [{'; '.join(f'{s}: {r}' for s, r in attempts.items())}]; "
            "no good copy is left in the cluster: re-push the model version that introduced it",
        )

    def __str__(self) -> str:
        return str(self.args[0])


class ClusterUnavailable(WorkerError):
    """No seed or member of the cluster answered."""


class ManifestUnavailable(WorkerError):
    """No server returned a manifest that matches its content id."""


class BadModelRef(WorkerError, ValueError):
    """A model reference is not MODEL:TAG or MODEL@VERSION."""


class ModelNotFound(WorkerError, LookupError):
    """The cluster does not know the model, tag or version asked for."""
