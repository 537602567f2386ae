from __future__ import annotations

import pytest

from paramserver.server.auth import AuthConfig, check_call
from paramserver.server.errors import ConfigError

ADMIN, READ = "admin-secret-123", "read-secret-456"
PUT = "/pdparams.v1.ParamServer/PutChunks"
GET = "/pdparams.v1.ParamServer/GetChunks"
HEAT = "/pdparams.v1.ParamServer/ReportHeat"
HEALTH = "/grpc.health.v1.Health/Check"


def md(token: str | None) -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"Bearer {token}")]


BOTH = AuthConfig(ADMIN, READ)


def test_open_when_no_tokens() -> None:
    for method in (PUT, GET, HEALTH):
        assert check_call(method, [], AuthConfig()) is None


def test_writes_need_admin_token() -> None:
    assert check_call(PUT, md(ADMIN), BOTH) is None
    for token in (None, READ, "wrong-token-999"):
        message = check_call(PUT, md(token), BOTH)
        assert message is not None and "admin token" in message and "PutChunks" in message


def test_reads_accept_read_or_admin_token() -> None:
    assert check_call(GET, md(READ), BOTH) is None
    assert check_call(GET, md(ADMIN), BOTH) is None
    assert check_call(HEAT, md(READ), BOTH) is None  # workers report heat with the read token
    message = check_call(GET, md(None), BOTH)
    assert message is not None and "read token" in message and "no token was sent" in message
    message = check_call(GET, md("guess-guess-guess"), BOTH)
    assert message is not None and "wrong" in message and "guess" not in message  # never echo the token


def test_admin_only_leaves_reads_open_and_health_always_open() -> None:
    admin_only = AuthConfig(ADMIN)
    assert check_call(GET, [], admin_only) is None
    assert check_call(PUT, [], admin_only) is not None
    assert check_call(HEALTH, [], BOTH) is None


def test_scheme_must_be_bearer() -> None:
    assert check_call(GET, [("authorization", f"Basic {READ}")], BOTH) is not None


def test_read_token_without_admin_is_refused() -> None:
    with pytest.raises(ConfigError, match="admin"):
        AuthConfig(read_token=READ).validate()
