"""Optional bearer tokens and TLS.

Server side, :class:`TokenAuthInterceptor` checks the ``authorization:
Bearer <token>`` metadata: writes need the admin token, reads the read token
or the admin token; the gRPC health service is always open so probes work
without secrets. A token that is not configured leaves its class of RPC open.
Clients: paramserver.client.channel.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import grpc

from paramserver.server.errors import ConfigError
from paramserver.wire.auth import (
    ADMIN_TOKEN_ENV, AUTH_HEADER, OPEN_PREFIXES, READ_TOKEN_ENV, WRITE_METHODS, bearer_token, read_tls_file, tokens_match,
)  # fmt: skip
from paramserver.wire.proto import SERVICE_NAME

@dataclass(frozen=True)
class AuthConfig:
    admin_token: str | None = None
    read_token: str | None = None

    def validate(self) -> AuthConfig:
        if self.read_token and not self.admin_token:
            raise ConfigError("a read token without an admin token would leave writes open; set an admin token too")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.admin_token or self.read_token)


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            return bearer_token(value)
    return None


def has_admin_token(metadata: Iterable[tuple[str, Any]] | None, config: AuthConfig) -> bool:
    """Whether a call may do what needs the admin token: no admin token configured, or it was sent."""
    return config.admin_token is None or tokens_match(_bearer(metadata), config.admin_token)


def check_call(method: str, metadata: Iterable[tuple[str, Any]] | None, config: AuthConfig) -> str | None:
    """None when the call may proceed, else the UNAUTHENTICATED message (never echoing the token)."""
    if method.startswith(OPEN_PREFIXES):
        return None
    token = _bearer(metadata)
    is_write = method in WRITE_METHODS
    if is_write:
        if config.admin_token is None or tokens_match(token, config.admin_token):
            return None
        expected = f"the admin token (paramctl --token or ${ADMIN_TOKEN_ENV})"
    else:
        if config.read_token is None:
            return None  # only writes are protected
        if tokens_match(token, config.read_token) or tokens_match(token, config.admin_token):
            return None
        expected = f"the read token or the admin token (--token, ${READ_TOKEN_ENV} or ${ADMIN_TOKEN_ENV})"
    name = method.rsplit("/", 1)[-1]
    if is_write and config.read_token is not None and tokens_match(token, config.read_token):
        return f"{name} is a write: it needs {expected}; the read token was sent, which only reads"
    problem = "no token was sent" if token is None else "the token sent is wrong"
    return f"{name} needs {expected} as 'authorization: Bearer <token>' metadata; {problem}"


# Read methods whose handler refuses some requests without the admin token (HasChunks with claim,
# the first call of a push): a refusal of a call that sent the read token says so (_ReadTokenSent).
ADMIN_CHECKED_INSIDE = frozenset({f"/{SERVICE_NAME}/HasChunks"})


class _ReadTokenSent:
    """A servicer context whose UNAUTHENTICATED refusals say the read token was sent: the handler's
    own message named the request ("HasChunks with claim"), not what the user did wrong."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context = context

    def abort(self, code: grpc.StatusCode, details: str) -> Any:
        if code == grpc.StatusCode.UNAUTHENTICATED:
            details = (f"a write needs the admin token (paramctl --token or ${ADMIN_TOKEN_ENV}), and the read token was "
                       f"sent, which only reads ({details.split(':', 1)[0]})")
        return self._context.abort(code, details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _with_read_token_note(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    inner = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary
    assert inner is not None

    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        return inner(request, _ReadTokenSent(context))  # type: ignore[arg-type]  # a proxy of the context

    return handler_like(handler, behaviour, handler.request_deserializer or _unparsed)


def _unparsed(raw: bytes) -> bytes:
    return raw


def handler_like(handler: grpc.RpcMethodHandler[Any, Any], behaviour: Callable[[Any, grpc.ServicerContext], Any],
                 request_deserializer: Callable[[bytes], Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A method handler of ``handler``'s kind (unary or streaming, each way) and response serializer,
    with another behaviour and request deserializer."""
    kwargs = dict(request_deserializer=request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)


def _abort_handler(handler: grpc.RpcMethodHandler[Any, Any], message: str) -> grpc.RpcMethodHandler[Any, Any]:
    def abort(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # A refused call's request is never read: as a request stream, even a unary method's message is
    # not received (grpc would buffer a unary request whole, up to the message limit, before the
    # handler runs: clients without a token held a server's memory), nor parsed (malformed bytes
    # must not reach a deserializer, nor grpc's traceback when it fails).
    kwargs = dict(request_deserializer=_unparsed, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort, **kwargs)
    return grpc.stream_unary_rpc_method_handler(abort, **kwargs)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, config: AuthConfig) -> None:
        self.config = config.validate()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or not self.config.enabled:
            return handler
        method, metadata = handler_call_details.method, handler_call_details.invocation_metadata
        message = check_call(method, metadata, self.config)
        if message is not None:
            return _abort_handler(handler, message)
        if (method in ADMIN_CHECKED_INSIDE and self.config.read_token is not None
                and tokens_match(_bearer(metadata), self.config.read_token)
                and not tokens_match(_bearer(metadata), self.config.admin_token)):
            return _with_read_token_note(handler)
        return handler


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> grpc.ServerCredentials:
    """TLS server credentials; with ``client_ca`` clients must present a certificate it signed."""
    cert_bytes, key_bytes = read_tls_file(cert), read_tls_file(key)
    assert cert_bytes is not None and key_bytes is not None
    ca = read_tls_file(client_ca)
    return grpc.ssl_server_credentials([(key_bytes, cert_bytes)], root_certificates=ca, require_client_auth=ca is not None)


__all__ = ["AuthConfig", "TokenAuthInterceptor", "check_call", "handler_like", "has_admin_token", "server_credentials"]
