"""The bulk port's settings (a server config's ``bulk_*`` keys) and its token rules."""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Mapping

from paramserver.server.auth import AuthConfig
from paramserver.server.errors import ConfigError
from paramserver.wire.auth import ADMIN_TOKEN_ENV, READ_TOKEN_ENV
from paramserver.wire.bulk_frames import MAX_PUT_BYTES, MAX_TOKEN_BYTES


def check_token(token: str, auth: AuthConfig) -> str | None:
    """None when reads are allowed with ``token``, else the message (never echoing the token).

    The rule of paramserver.server.auth for reads: open without a read token; otherwise the read
    token or the admin token.
    """
    if auth.read_token is None:
        return None
    given = token.encode()
    for expected in (auth.read_token, auth.admin_token):
        if expected is not None and token and hmac.compare_digest(given, expected.encode()):
            return None
    problem = "no token was sent" if not token else "the token sent is wrong"
    return (f"bulk reads need the read token or the admin token (--token, ${READ_TOKEN_ENV} or ${ADMIN_TOKEN_ENV}) "
            f"in the bulk hello; {problem}")


def check_write_token(token: str, auth: AuthConfig) -> str | None:
    """None when writes are allowed with ``token``, else the message (never echoing the token).

    The rule of paramserver.server.auth for writes: open without an admin token; otherwise the
    admin token, and only it (the read token is not enough).
    """
    if auth.admin_token is None:
        return None
    if token and hmac.compare_digest(token.encode(), auth.admin_token.encode()):
        return None
    problem = "no token was sent" if not token else "the token sent is not the admin token"
    return f"bulk writes need the admin token (paramctl --token or ${ADMIN_TOKEN_ENV}) in the bulk hello; {problem}"


_BULK_KEYS: tuple[tuple[str, type], ...] = (
    ("max_connections", int), ("max_pending", int), ("max_per_ip", int), ("hello_timeout_s", float), ("idle_timeout_s", float),
    ("io_timeout_s", float), ("max_write_connections", int), ("write_buffer_bytes", int), ("store_workers", int),
    ("min_write_rate", int),
)
CONFIG_KEYS = ("bulk_writes", *(f"bulk_{name}" for name, _ in _BULK_KEYS))  # a server config's keys for the bulk port


def long_token(length: int) -> str:
    return (f"the hello declares a token of {length} bytes, over the limit of {MAX_TOKEN_BYTES}; send the cluster's "
            "read or admin token")


@dataclass(frozen=True)
class BulkServerConfig:
    max_connections: int = 64  # connections served at once (past their hello)
    max_pending: int = 64  # connections still owing their hello; the oldest is dropped for a new one
    idle_timeout_s: float = 300.0  # a connection with no request for this long is closed
    io_timeout_s: float = 30.0  # one send or the rest of a frame must not take longer
    hello_timeout_s: float = 5.0  # the whole hello must arrive within this
    max_per_ip: int = 16  # connections one client address may hold
    writes: bool = True  # serve write sessions (PUT); off: a write hello is refused and clients use PutChunks
    max_write_connections: int = 16  # write sessions at once (each holds up to store_workers + 1 PUTs)
    write_buffer_bytes: int = 256 << 20  # received PUT payloads held at once, over all write sessions
    store_workers: int = 2  # PUTs of one session stored at once (their fsyncs are grouped by the store)
    min_write_rate: int = 1 << 20  # bytes/s: a PUT must arrive within io_timeout_s + its size at this rate

    def validate(self) -> BulkServerConfig:
        if not 1 <= self.max_connections <= 4096:
            raise ConfigError(f"bulk max_connections must be 1..4096, got {self.max_connections}")
        if not 1 <= self.max_per_ip <= 4096:
            raise ConfigError(f"bulk max_per_ip must be 1..4096, got {self.max_per_ip}")
        if not 1 <= self.max_pending <= 4096:
            raise ConfigError(f"bulk max_pending must be 1..4096, got {self.max_pending}")
        if self.idle_timeout_s <= 0 or self.io_timeout_s <= 0 or self.hello_timeout_s <= 0:
            raise ConfigError("bulk idle_timeout_s, io_timeout_s and hello_timeout_s must be > 0")
        if not 1 <= self.max_write_connections <= 4096:
            raise ConfigError(f"bulk max_write_connections must be 1..4096, got {self.max_write_connections}")
        if self.write_buffer_bytes < MAX_PUT_BYTES:
            raise ConfigError(f"bulk write_buffer_bytes must be at least {MAX_PUT_BYTES} (one PUT of the largest chunk), "
                              f"got {self.write_buffer_bytes}")
        if not 1 <= self.store_workers <= 16:
            raise ConfigError(f"bulk store_workers must be 1..16, got {self.store_workers}")
        if self.min_write_rate < 1024:
            raise ConfigError(f"bulk min_write_rate must be at least 1024 bytes/s, got {self.min_write_rate}")
        return self

    @classmethod
    def from_extra(cls, extra: Mapping[str, object]) -> BulkServerConfig:
        """From a server config file's extra keys ``bulk_max_connections``, ``bulk_max_pending``, ``bulk_max_per_ip``,
        ``bulk_hello_timeout_s``, ``bulk_idle_timeout_s``, ``bulk_io_timeout_s``, ``bulk_writes`` (bool),
        ``bulk_max_write_connections``, ``bulk_write_buffer_bytes``, ``bulk_store_workers`` and
        ``bulk_min_write_rate``."""
        values: dict[str, float | int | bool] = {}
        for name, kind in _BULK_KEYS:
            value = extra.get(f"bulk_{name}")
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
                raise ConfigError(f"bulk_{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}")
            values[name] = kind(value)
        writes = extra.get("bulk_writes")
        if writes is not None:
            if not isinstance(writes, bool):
                raise ConfigError(f"bulk_writes must be true or false, got {writes!r}")
            values["writes"] = writes
        return cls(**values).validate()  # type: ignore[arg-type]


__all__ = ["CONFIG_KEYS", "BulkServerConfig", "check_token", "check_write_token", "long_token"]
