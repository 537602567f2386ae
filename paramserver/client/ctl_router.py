"""``paramctl prewarm`` and ``tag --when-warm``: the calls to the router the workers register with.

A pre-warm makes workers fetch a version, so the router takes it only with the admin token: the
one paramctl writes with (``--token``/``--token-file``, ``PARAMS_ADMIN_TOKEN`` or the client
config's ``admin_token_file``), sent as ``Authorization: Bearer``."""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rich.console import Console

from paramserver.client.cluster_view import ClusterOptions
from paramserver.client.config import ClientSettings, settings_from_args
from paramserver.client.errors import RouterFailure, UsageError
from paramserver.client.exit_codes import AUTH, BAD_ARGUMENTS, NOT_FOUND, OTHER, PRECONDITION, UNAVAILABLE
from paramserver.client.refs import ModelRef


ROUTER_ENV = "PARAMS_ROUTER"
# The router's HTTP status -> paramctl's exit code (the shared table's meanings)
_ROUTER_CODES = {400: BAD_ARGUMENTS, 401: AUTH, 404: NOT_FOUND, 409: PRECONDITION, 503: UNAVAILABLE,
                 504: UNAVAILABLE}


def router_url(args: argparse.Namespace) -> str:
    url = (args.router or os.environ.get(ROUTER_ENV) or "").strip().rstrip("/")
    if not url:
        raise UsageError(f"no router given: pass --router http://HOST:PORT or set {ROUTER_ENV}")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--router {url!r} must be http://HOST:PORT")
    return url


def router_call(url: str, path: str, body: dict[str, Any] | None = None, timeout: float = 15.0,
                token: str | None = None) -> dict[str, Any]:
    """One JSON call to the router (``token``: sent as a bearer token); its refusals and its absence
    become RouterFailure with an exit code."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}{path}", data=data, method="POST" if body is not None else "GET",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer
    except urllib.error.HTTPError as exc:
        try:
            message = str(json.loads(exc.read()).get("error", exc.reason))
        except (ValueError, AttributeError):
            message = str(exc.reason)
        raise RouterFailure(_ROUTER_CODES.get(exc.code, OTHER), f"router {url}: {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RouterFailure(UNAVAILABLE, f"UNAVAILABLE: router {url} did not answer ({reason}); is paramrouter running?") from None


def wait_warm(url: str, ref: str, need: int, timeout_s: float, workers: set[str] | None = None,
              poll_s: float = 0.25) -> dict[str, Any]:
    """Poll ``GET /warm/REF`` until ``need`` workers (of ``workers``, if given) report it fully cached."""
    deadline = time.monotonic() + timeout_s
    path = f"/warm/{urllib.parse.quote(ref, safe=':@')}"
    while True:
        state = router_call(url, path)
        done = [w["worker_id"] for w in state["workers"] if w["complete"] and (workers is None or w["worker_id"] in workers)]
        if len(done) >= need:
            return state
        if time.monotonic() >= deadline:
            partial_ = ", ".join(f"{w['worker_id']} {w.get('bytes_cached', 0)}/{w.get('bytes_total', '?')} B"
                                 for w in state["workers"]) or "no worker registered"
            raise RouterFailure(PRECONDITION, f"FAILED_PRECONDITION: after {timeout_s:g} s only {len(done)} of the {need} "
                                              f"workers needed report {state['model']}@{state['version']} fully cached "
                                              f"({partial_})")
        time.sleep(poll_s)


def admin_token(args: argparse.Namespace, opts: ClusterOptions) -> str | None:
    """The admin token paramctl writes with (``--token`` counts as it here, as for ``tag``)."""
    settings = settings_from_args(args, write=True, defaults=ClientSettings(cluster=opts.seeds))
    return settings.token_for(write=True)


def cmd_prewarm(args: argparse.Namespace, opts: ClusterOptions, out: Console) -> int:
    url = router_url(args)
    ref = str(ModelRef.parse(args.ref))
    answer = router_call(url, "/prewarm", {"ref": ref, "workers": args.workers}, token=admin_token(args, opts))
    model, version, asked = answer["model"], answer["version"], answer["workers"]
    accepted = {w["worker_id"] for w in asked if w["accepted"]}
    for w in asked:
        out.print(f"  {w['worker_id']}: " + ("fetching" if w["accepted"] else f"refused: {w.get('error', '?')}"),
                  markup=False, highlight=False)
    out.print(f"pre-warming {model}@{version} on {len(accepted)} of {len(asked)} workers", markup=False, highlight=False)
    if not accepted:
        raise RouterFailure(UNAVAILABLE, f"UNAVAILABLE: no worker accepted the pre-warm of {model}@{version}")
    if args.wait:
        t0 = time.monotonic()
        wait_warm(url, f"{model}@{version}", len(accepted), args.warm_timeout_s, accepted)
        out.print(f"{model}@{version} fully cached on {len(accepted)} workers after {time.monotonic() - t0:.1f} s",
                  markup=False, highlight=False)
    return 0 if len(accepted) == len(asked) else OTHER


__all__ = ["ROUTER_ENV", "RouterFailure", "cmd_prewarm", "router_call", "router_url", "wait_warm"]
