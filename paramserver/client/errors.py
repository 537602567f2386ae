"""The client's one exception hierarchy.

Every error carries the gRPC status code it stands for (``code``); :func:`from_rpc` is the one
place a ``grpc.RpcError`` becomes one of these, and the CLIs (``paramctl``, ``paramworker``)
map ``code`` to an exit code (``paramserver.client.exit_codes``), so a failure reads the same
whichever command hit it. Messages say what to do next.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from paramserver.wire.errors import ConfigError as WireConfigError


class ClientError(Exception):
    """Base class of every error raised by ``paramserver.client``."""

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code if code is not None else self.default_code


class ConfigError(ClientError, WireConfigError):
    """A client option, a model reference or a config file is invalid.

    The paramserver hierarchy's one ConfigError is the wire one (``paramserver.wire.errors``); this
    subclass exists because the CLIs catch ``ClientError`` and map its ``code`` (INVALID_ARGUMENT:
    exit 2, ``exit_codes.py``): a client config error must be both. The wire layer cannot import
    this package, so one class cannot be both.
    """

    default_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        ClientError.__init__(self, message, code)


class TransferError(ClientError):
    """A call, push, pull or load failed; the message says what to do."""


class ClientClosed(ClientError):
    """The client (or its cluster view) was closed; make a new one."""

    default_code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(TransferError):
    """The model, version, tag or manifest does not exist."""

    default_code = grpc.StatusCode.NOT_FOUND


class AuthFailed(TransferError):
    """The server refused the token or the client certificate."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class ClusterUnreachable(TransferError):
    """No server answered, or none could serve the request now."""

    default_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message, code)


class StaleRead(ClusterUnreachable):
    """Every reachable server answered with a tag resolution older than one already seen."""


class ChunkUnavailable(ClusterUnreachable):
    """No replica could serve a chunk (unreachable, missing, timed out, or bad bytes)."""

    def __init__(self, chunk_id: str, attempts: Mapping[str, str], tensors: Sequence[str] = ()) -> None:
        self.chunk_id = chunk_id
        self.attempts = dict(attempts)
        self.tensors = tuple(tensors)
        super().__init__(self._message())

    def _message(self) -> str:
        where = f" (tensor {', '.join(self.tensors[:3])})" if self.tensors else ""
        tried = "; ".join(f"{s}: {r}" for s, r in self.attempts.items()) or "no replica reachable"
        return (f"chunk {self.chunk_id}{where} could not be read from any replica ({tried}); "
                "retry when the servers are back, repair restores lost replicas")


class ChunkDataLoss(ChunkUnavailable):
    """Every replica that answered for a chunk gave bytes that failed verification (or said CORRUPT)."""

    default_code = grpc.StatusCode.DATA_LOSS

    def __init__(self, chunk_id: str, attempts: Mapping[str, str], tensors: Sequence[str] = ()) -> None:
        super().__init__(chunk_id, attempts, tensors)
        self.code = grpc.StatusCode.DATA_LOSS

    def _message(self) -> str:
        where = f" (tensor {', '.join(self.tensors[:3])})" if self.tensors else ""
        tried = "; ".join(f"{s}: {r}" for s, r in self.attempts.items())
        return (f"DATA_LOSS: chunk {self.chunk_id}{where}: no intact copy on any replica ({tried}); "
                "re-push the version, or restore a server that holds a good copy")


class PushError(TransferError):
    """The push did not commit a version (nothing was committed)."""


class PushConflict(PushError):
    """Another version was committed first: the push is concurrent with it (vector clocks)."""

    default_code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, *, model: str, parent: int | None, head: int | None) -> None:
        super().__init__(message, grpc.StatusCode.ABORTED)
        self.model = model
        self.parent = parent
        self.head = head


class PullError(TransferError):
    """The pull could not produce a verified copy of the version."""


class BulkError(Exception):
    """The bulk read path failed for this request; the caller falls back to GetChunks.

    Rooted on its own, not under :class:`ClientError`: a malformed bulk address in a member record
    raises it out of ``BulkPool.client`` through the fetch engine, and the CLIs' ``except
    ClientError`` must not start catching what used to escape them.
    """

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"bulk {address}: {message}")
        self.address = address


class BulkUnavailable(BulkError):
    """Cannot connect, the connection broke, or a timeout."""


class BulkUnauthenticated(BulkError):
    """The server refused the token; the message says which one it expects."""


class BulkProtocolFailure(BulkError):
    """The server sent bytes this client cannot accept, or refused the request."""


class BulkWriteError(ClientError):
    """A bulk write session failed; ``code`` is the gRPC status it stands for (the push sender
    catches every one of them: a fallback to PutChunks, or a failure of that server)."""

    def __init__(self, address: str, message: str, code: grpc.StatusCode) -> None:
        super().__init__(f"bulk write to {address}: {message}", code)
        self.address = address


class BulkWriteRefused(BulkWriteError):
    """The server did not open a write session (no bulk writes there, a limit, a bad token)."""


_BY_CODE: dict[grpc.StatusCode, type[TransferError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: AuthFailed,
    grpc.StatusCode.PERMISSION_DENIED: AuthFailed,
    grpc.StatusCode.UNAVAILABLE: ClusterUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: ClusterUnreachable,
}

_ADVICE = {
    grpc.StatusCode.UNAUTHENTICATED: "pass --token or set PARAMS_READ_TOKEN / PARAMS_ADMIN_TOKEN",
    grpc.StatusCode.PERMISSION_DENIED: "pass --token or set PARAMS_READ_TOKEN / PARAMS_ADMIN_TOKEN",
    grpc.StatusCode.UNAVAILABLE: "check that the servers run and the addresses (--cluster, PARAMS_CLUSTER)",
    grpc.StatusCode.DEADLINE_EXCEEDED: "check that the servers run and the addresses (--cluster, PARAMS_CLUSTER)",
}


def rpc_code(exc: grpc.RpcError) -> grpc.StatusCode:
    code = exc.code() if hasattr(exc, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def rpc_details(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or rpc_code(exc).name.lower())


def tls_problem(details: str) -> str | None:
    """Advice when a failed call's details look like a refused or failed TLS handshake."""
    text = details.lower()
    if any(k in text for k in ("ssl", "tls", "handshake", "certificate", "peer did not return")):
        return ("the TLS handshake failed: check --tls-ca (the cluster's CA), and --tls-cert/--tls-key "
                "(a client certificate the cluster's CA signed) or PARAMS_TLS_CA/PARAMS_TLS_CERT/PARAMS_TLS_KEY")
    return None


def from_rpc(exc: grpc.RpcError, what: str) -> TransferError:
    """The one mapping from a failed call to a client error: ``what`` says what was being done."""
    code = rpc_code(exc)
    details = rpc_details(exc)
    tls = tls_problem(details) if code == grpc.StatusCode.UNAVAILABLE else None
    if tls is not None:
        return AuthFailed(f"{what}: {details}; {tls}", grpc.StatusCode.UNAUTHENTICATED)
    cls = _BY_CODE.get(code, TransferError)
    advice = _ADVICE.get(code)
    return cls(f"{what}: {details}" + (f"; {advice}" if advice else ""), code)


class BadModelRef(ConfigError):
    """A model reference that is not MODEL:TAG, MODEL@N or MODEL."""


class MonotonicFileError(ConfigError, StaleRead):
    """The persisted memory cannot be read: a configuration error (exit 2), since only the operator
    can fix or remove the file. Still a StaleRead, which is what an unreadable file raised before."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotSafetensors(ValueError):
    """The version holds what a .safetensors file cannot: a dtype safetensors has no code for, or a
    tensor named ``__metadata__``. Loads into memory keep both."""


class UsageError(Exception):
    """Bad command-line input found after parsing (exit code 2).

    Not a ClientError, so no handler of client errors (``cmd_pull``'s, ``main``'s) takes it for one."""


# A local path the user named that cannot be used (read, written, made): a bad argument, exit 2.
PATH_ERRORS = (PermissionError, FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


class ReadBroken(Exception):
    """A read stopped before answering every id; ``replica_down``: do not ask that replica again."""

    def __init__(self, reason: str, replica_down: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.replica_down = replica_down


class NoLongerLeads(grpc.RpcError):
    """A member the view took for the leader answered as a follower: retryable, so ``leader_call``
    asks the others who leads now."""

    def __init__(self, address: str) -> None:
        super().__init__(f"{address} answered but does not lead")
        self.address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"{self.address} answered but is not the Raft leader, and no member named one that is"


class RouterFailure(Exception):
    """The router refused or could not be reached, or a pre-warm wait ran out; ``code`` is the exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


__all__ = [
    "PATH_ERRORS", "AuthFailed", "BulkError", "BulkProtocolFailure", "BulkUnauthenticated", "BulkUnavailable", "BulkWriteError",
    "BulkWriteRefused", "ChunkDataLoss", "ChunkUnavailable", "ClientClosed", "ClientError", "ClusterUnreachable",
    "ConfigError", "NotFound",
    "BadModelRef", "MonotonicFileError", "NotSafetensors",
    "PullError", "PushConflict", "PushError", "StaleRead", "TransferError", "UsageError", "from_rpc", "rpc_code", "rpc_details",
    "NoLongerLeads", "ReadBroken", "RouterFailure",
    "tls_problem",
]
