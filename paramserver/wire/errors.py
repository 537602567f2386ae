"""Errors of the wire contract; the server's and the client's errors build on these."""
from __future__ import annotations


class WireError(Exception):
    """Base class of every error raised by ``paramserver.wire``."""


class ConfigError(WireError, ValueError):
    """An option is invalid (an address, a limit, a TLS file); the message says which and how to fix it."""


class ProtocolError(WireError):
    """The peer sent something this protocol does not allow."""


class WriteSessionError(WireError):
    """A bulk write session could not be opened (``paramserver.wire.bulk_write_session``).

    ``stage``: "connect" (no connection), "handshake" (the connection broke during the hello) or
    "refused" (the server answered, not with a write welcome); ``status`` the welcome's status
    when refused; ``detail`` what the socket or the server said. Each writer words it its own way.
    """

    def __init__(self, address: str, stage: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"bulk write session to {address}: {stage}: {detail}")
        self.address = address
        self.stage = stage
        self.detail = detail
        self.status = status


__all__ = ["ConfigError", "ProtocolError", "WireError", "WriteSessionError"]
