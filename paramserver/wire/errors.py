"""Errors of the wire contract; the server's and the client's errors build on these."""
from __future__ import annotations


class WireError(Exception):
    """Base class of every error raised by ``paramserver.wire``."""


class ConfigError(WireError, ValueError):
    """An option is invalid (an address, a limit, a TLS file); the message says which and how to fix it."""


__all__ = ["ConfigError", "WireError"]
