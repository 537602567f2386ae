"""Input checks shared by the state machine and the node configuration."""
from __future__ import annotations

import math
import re

from .errors import Invalid

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MANIFEST_ID = re.compile(r"[0-9a-f]{64}")


def check_name(kind: str, value: object) -> str:
    """Model names, tags, publisher and server ids: safe as path components and URL parts."""
    if not isinstance(value, str) or not value:
        raise Invalid(f"{kind} must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_LENGTH:
        raise Invalid(f"{kind} {value[:32]!r}... is {len(value)} chars; use at most {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(value) or ".." in value:
        raise Invalid(
            f"{kind} {value!r} is not allowed: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, without '..' or slashes"
        )
    return value


def check_manifest_id(value: object) -> str:
    if not isinstance(value, str) or not _MANIFEST_ID.fullmatch(value):
        raise Invalid(f"manifest id must be 64 lowercase hex characters, got {value!r}")
    return value


def check_count(kind: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid(f"{kind} must be an int >= 0, got {value!r}")
    return value


def check_version_number(kind: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Invalid(f"{kind} must be a version number >= 1, got {value!r}")
    return value


def check_timestamp(kind: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise Invalid(f"{kind} must be a finite timestamp >= 0 (seconds since the epoch), got {value!r}")
    return float(value)


def check_address(kind: str, value: object) -> str:
    """host:port, as both gRPC and pysyncobj take it."""
    if not isinstance(value, str) or ":" not in value:
        raise Invalid(f"{kind} must be 'host:port', got {value!r}")
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Invalid(f"{kind} must be 'host:port' with a port in 1..65535, got {value!r}")
    return value
