"""Auth on the wire: the token header, the token environment variables, which RPCs write.

Both sides read this: servers to check calls, clients to attach tokens.
"""
from __future__ import annotations

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


def read_tls_file(path: str | Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc


__all__ = ["ADMIN_TOKEN_ENV", "AUTH_HEADER", "OPEN_PREFIXES", "READ_TOKEN_ENV", "WRITE_METHODS", "read_tls_file", "token_metadata"]
