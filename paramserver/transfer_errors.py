"""Errors of the client-side transfers (push, pull, cluster discovery).

Each carries the gRPC status code it stands for (``code``), so the CLI maps
every failure, local or remote, to one exit code and one line of text.
"""
from __future__ import annotations

import grpc

from .errors import ParamServerError


class TransferError(ParamServerError):
    """A push, pull or cluster lookup failed; the message says what to do."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


class ClusterUnreachable(TransferError):
    """No seed address answered ClusterInfo."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)


class PushError(TransferError):
    """The push did not commit a version (nothing was committed)."""


class PushConflict(PushError):
    """Another version was committed on the same parent first (ABORTED)."""

    def __init__(self, message: str, *, model: str, parent: int | None, head: int | None) -> None:
        super().__init__(message, grpc.StatusCode.ABORTED)
        self.model, self.parent, self.head = model, parent, head


class PullError(TransferError):
    """The pull could not produce a verified copy of the version."""


def rpc_code(exc: grpc.RpcError) -> grpc.StatusCode:
    code = exc.code() if hasattr(exc, "code") else None
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN


def rpc_details(exc: grpc.RpcError) -> str:
    details = exc.details() if hasattr(exc, "details") else None
    return str(details or rpc_code(exc).name.lower())


__all__ = ["TransferError", "ClusterUnreachable", "PushError", "PushConflict", "PullError", "rpc_code", "rpc_details"]
