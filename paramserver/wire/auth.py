"""Auth on the wire: the token header, the token environment variables, which RPCs write.

Both sides read this: servers to check calls, clients to attach tokens.
"""
from __future__ import annotations

import hmac
from pathlib import Path

from paramserver.wire.errors import ConfigError
from paramserver.wire.proto import SERVICE_NAME

AUTH_HEADER = "authorization"
ADMIN_TOKEN_ENV = "PARAMS_ADMIN_TOKEN"
READ_TOKEN_ENV = "PARAMS_READ_TOKEN"

# RPCs that change state. Workers' reports (heat, corruption) are reads here:
# a worker holding only the read token must be able to send them.
WRITE_METHODS = frozenset(
    f"/{SERVICE_NAME}/{name}"
    for name in ("PutChunks", "CommitVersion", "SetTag", "RollbackTag", "DeleteTag", "AddMember", "RemoveMember")
)
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def token_metadata(token: str | None) -> list[tuple[str, str]]:
    return [] if not token else [(AUTH_HEADER, f"Bearer {token}")]


def bearer_token(value: str | bytes | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value (gRPC metadata or an HTTP header), else None."""
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else str(value)
    scheme, _, token = text.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def tokens_match(given: str | None, expected: str | None) -> bool:
    """Constant-time: a refused token does not leak how much of it was right."""
    return given is not None and expected is not None and hmac.compare_digest(given.encode(), expected.encode())


def read_tls_file(path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc


__all__ = ["ADMIN_TOKEN_ENV", "AUTH_HEADER", "OPEN_PREFIXES", "READ_TOKEN_ENV", "WRITE_METHODS", "bearer_token", "read_tls_file",
           "token_metadata", "tokens_match"]
