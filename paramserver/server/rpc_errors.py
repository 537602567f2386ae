"""The one place typed errors become gRPC status codes (used by the service modules only)."""
from __future__ import annotations

from typing import NoReturn

import grpc

from consensus.errors import Conflict, Invalid, MetadataError, NotFound, NotLeader, Unavailable

from paramserver.server.errors import (
    AuthError,
    ChunkCorruptError,
    ChunkNotFoundError,
    ChunkTransferCorruptError,
    InvalidChunkError,
    ParamServerError,
    StoreFullError,
)
from paramserver.server.errors import PreconditionFailed as PreconditionFailed  # re-exported: its old home

LEADER_METADATA_KEY = "pdparams-leader"  # trailing metadata on NotLeader: the leader's Raft address


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, ChunkTransferCorruptError | ChunkCorruptError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(exc, InvalidChunkError | Invalid):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ChunkNotFoundError | NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, Conflict):
        return grpc.StatusCode.ABORTED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, PreconditionFailed):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, StoreFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


MAPPED = (ParamServerError, MetadataError, ValueError)


MAX_DETAILS = 2000  # status details travel in trailers, which gRPC caps (8 KiB soft limit)


def _details(message: str) -> str:
    """A message that echoes a client's oversized name or id stays within the trailers' limit."""
    return message if len(message) <= MAX_DETAILS else f"{message[:MAX_DETAILS]}... ({len(message)} chars)"


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    if isinstance(exc, NotLeader) and exc.leader:
        context.set_trailing_metadata(((LEADER_METADATA_KEY, exc.leader),))
    context.abort(status_for(exc), _details(str(exc) or type(exc).__name__))
    raise AssertionError("context.abort returned")  # pragma: no cover


def invalid(context: grpc.ServicerContext, message: str) -> NoReturn:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(message))
    raise AssertionError("context.abort returned")  # pragma: no cover


__all__ = ["status_for", "abort_with", "invalid", "PreconditionFailed", "MAPPED", "LEADER_METADATA_KEY"]
