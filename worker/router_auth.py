"""Credentials of the worker and router HTTP ports, and the router's check of a worker's URL.

Two credentials, each a token read from a file (or the environment), never from a flag's value:

- the **worker token** (``--worker-token-file``, env ``PARAMS_WORKER_TOKEN``): what a worker's beat
  and leave carry to its routers. Distinct from the cluster's read token, which every reader holds
  too: with the read token alone nobody can register a worker any more.
- the **admin token** (``--admin-token-file``, env ``PARAMS_ADMIN_TOKEN``, or the client config's
  ``admin_token_file``): what ``POST /prewarm`` needs on a worker and on a router (it makes workers
  fetch versions); ``paramctl prewarm`` sends the admin token it writes with. Without one
  configured, ``/prewarm`` is refused (401): nothing that changes a worker's state is open.

On top of the worker token, each worker process makes a random instance secret at start
(``new_instance_secret``) and sends it with every beat and leave; the router binds the worker id to
it (``worker.router_state.RouterState.heartbeat``) and, before routing to a new URL, asks
``GET {url}/identity?nonce=N`` for a proof under that secret (``check_identity``).
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.client.config import read_token_file as client_read_token_file
from paramserver.client.errors import ConfigError as ClientConfigError
from paramserver.wire.auth import bearer_token, tokens_match
from worker.errors import ConfigError
from worker.router_state import check_proof

WORKER_TOKEN_ENV = "PARAMS_WORKER_TOKEN"
ADMIN_TOKEN_ENV = "PARAMS_ADMIN_TOKEN"
IDENTITY_TIMEOUT_S = 2.0

if TYPE_CHECKING:  # the router's side only: a worker imports this module without aiohttp
    import aiohttp


def read_token_file(path: str | Path, flag: str) -> str:
    """The one token in ``path``; a ConfigError naming ``flag`` when it cannot be read or is not one token
    (the clients' own reader, paramserver.client.config.read_token_file, as a worker error)."""
    try:
        return client_read_token_file(Path(path), flag)
    except ClientConfigError as exc:
        raise ConfigError(str(exc)) from None


def token_from(path: str | Path | None, flag: str, env: str, environ: Mapping[str, str] = os.environ,
               fallback: str | None = None) -> str | None:
    """A credential: the file ``flag`` names, else the environment variable ``env``, else ``fallback``."""
    if path is not None:
        return read_token_file(path, flag)
    value = (environ.get(env) or "").strip()
    if value:
        if any(c.isspace() for c in value):
            raise ConfigError(f"${env} must hold one token (no spaces)")
        return value
    return fallback


def refusal(authorization: str | None, expected: str | None, what: str, fix: str) -> str | None:
    """None when ``authorization`` (the header) carries ``expected``; else the one-line reason for a 401.

    ``expected`` None: no credential is configured, so the request is refused too (``fix`` says how
    to configure one)."""
    if expected is None:
        return f"{what} is turned off here: no token is configured ({fix})"
    if tokens_match(bearer_token(authorization), expected):
        return None
    problem = "no token was sent" if not authorization else "the token sent is wrong"
    return f"{what} needs 'Authorization: Bearer <token>' with {fix}; {problem}"


def new_instance_secret() -> str:
    """A worker process's instance secret: random, made at start, never written anywhere."""
    return secrets.token_hex(32)


async def check_identity(session: aiohttp.ClientSession, url: str, worker_id: str, secret: str,
                         timeout_s: float = IDENTITY_TIMEOUT_S) -> str | None:
    """None when ``url`` answers ``GET /identity`` as ``worker_id`` holding ``secret``; else why not."""
    import aiohttp

    nonce = secrets.token_hex(16)
    try:
        async with session.get(f"{url}/identity", params={"nonce": nonce},
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return f"GET {url}/identity answered {r.status}"
            data = await r.content.read(4096)
        answer = json.loads(data)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError, RecursionError) as exc:
        return f"GET {url}/identity failed ({type(exc).__name__}: {str(exc)[:200]})"
    return check_proof(answer, secret, worker_id, nonce)


__all__ = ["ADMIN_TOKEN_ENV", "WORKER_TOKEN_ENV", "check_identity", "new_instance_secret", "read_token_file", "refusal",
           "token_from"]
