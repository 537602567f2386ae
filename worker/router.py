"""``paramrouter``: send each inference request to a worker that already holds its model version.

    paramrouter --listen 127.0.0.1:8090 --cluster HOST:PORT[,HOST:PORT]     # any cluster flags of paramctl
    paramworker serve --model bert:prod --factory pkg:build --router http://127.0.0.1:8090
    curl -s localhost:8090/infer/bert:prod -d '{"input": [[1, 2, 3, 4]]}'   # or /infer/bert@3

A small asyncio HTTP service (aiohttp). The choice is ``worker.router_state`` (pure, unit-tested);
this module is the thin HTTP layer around it:

- ``POST /heartbeat``: a worker's beat (its lease: every second; three missed and it is dropped);
  ``POST /leave``: a worker stopping says so at once. Both carry the worker token (``--worker-token-file``,
  401 without it when configured) and the worker's instance secret: the id is bound to the first
  secret heard for it while its lease lasts (another: 409), and a new URL is routed to only once it
  answers ``GET /identity`` as that worker (``worker.router_auth``).
- ``POST /infer/MODEL:TAG`` (or ``MODEL@N``, ``MODEL``): the tag is resolved through the cluster
  (cached 1 s), or from what workers report when the cluster cannot be reached; the request goes
  to the chosen worker with a deadline (``X-Pdparams-Timeout-S`` header or ``?timeout_s=``,
  default ``--request-timeout-s``); a worker that fails, vanishes, sheds or does not hold the
  version is retried once on another. Errors are one-line JSON ``{"error": ...}``: 404 unknown
  model, tag or version (checked with the cluster when --cluster is given), 503 with
  ``Retry-After`` when no worker can answer, 504 past the deadline.
- ``POST /prewarm`` ``{"ref": "MODEL:TAG", "workers": N | null}``, with the admin token: asks N workers (null: all) to
  fetch that version into their cache tiers without swapping; ``GET /warm/MODEL:TAG``: how much of
  the version each worker caches (``paramctl prewarm --wait`` and ``paramctl tag --when-warm`` read it).
- ``GET /workers``: the table; ``GET /metrics``: Prometheus text; ``GET /healthz``.

State is soft: a restarted router rebuilds its table from the next beats; several routers can run
side by side (each worker beats to every ``--router`` it was given).
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import json
import math
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from paramserver.wire.address import split_host_port
from paramserver.wire.auth import AUTH_HEADER
from paramserver.wire.errors import ConfigError as WireConfigError
from paramserver.wire.exposure import Listener, check_listeners
from paramserver.client.config import CLUSTER_ENV, CONFIG_ENV, ClientSettings, add_client_arguments, settings_from_args
from paramserver.wire.cli_args import OneLineParser, float_in, int_in
from paramserver.client.errors import ClientError, NotFound
from paramserver.client.refs import BadModelRef, ModelRef
from worker.errors import ConfigError
from worker.router_auth import ADMIN_TOKEN_ENV, WORKER_TOKEN_ENV, check_identity, refusal, token_from
from worker.router_listen import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_SOURCE, connection_cap, serve
from worker.router_state import (
    DEADLINE_HEADER, EXACT_HEADER, INSTANCE_HEADER, MAX_SECRET_CHARS, MIN_SECRET_CHARS, MISDIRECTED, WANT_HEADER, Beat,
    Heartbeat, HeartbeatError, RefCache, RouterConfig, RouterState, VersionKey,
)  # fmt: skip

MAX_BODY = 64 << 20
MAX_TIMEOUT_S = 600.0
RESOLVE_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 10.0  # a beat, leave or pre-warm body must arrive within this
ROUTER_ENV = "PARAMS_ROUTER"
WORKER_HEADER = "X-Pdparams-Worker"  # on every answer: the worker that gave it


@dataclass(frozen=True)
class RouterOptions:
    listen: str = "127.0.0.1:8090"
    request_timeout_s: float = 30.0
    resolve_ttl_s: float = 1.0
    state: RouterConfig = RouterConfig()


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter("pdparams_router_routed", "Requests answered by a worker (any status)", registry=r)
        self.retried = Counter("pdparams_router_retried", "Second attempts on another worker (failed, vanished, shed or misdirected)",
                               registry=r)
        self.spilled = Counter("pdparams_router_spilled", "Requests sent past a holder whose queue reached --spill-queue",
                               registry=r)
        self.shed = Counter("pdparams_router_shed", "Requests answered 503 (no worker could take them, or all failed)",
                            registry=r)
        self.timeouts = Counter("pdparams_router_deadline_exceeded", "Requests answered 504 at their deadline", registry=r)
        self.hits = Counter("pdparams_router_affinity_hits", "Routed requests answered by a worker holding that exact version",
                            registry=r)
        self.ratio = Gauge("pdparams_router_affinity_hit_ratio", "affinity_hits / routed since start", registry=r)
        self.ratio.set_function(lambda: self.hits._value.get() / max(1.0, self.routed._value.get()))
        self.workers = Gauge("pdparams_router_workers", "Live workers in the table", registry=r)
        self.refused_connections = Counter("pdparams_router_refused_connections",
                                           "Client connections refused with a 503 because --max-connections were open",
                                           registry=r)
        self.evicted_connections = Counter("pdparams_router_evicted_connections",
                                           "Client connections that had sent no request, closed (503) for a newcomer",
                                           registry=r)
        self.seconds = Histogram("pdparams_router_seconds", "Request latency through the router", registry=r,
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps({"error": message}).encode(), content_type="application/json",
                        headers=headers)


class Router:
    """The HTTP layer: parse, resolve, ask ``RouterState``, forward with a deadline, count."""

    def __init__(self, options: RouterOptions, resolver: Callable[[ModelRef], Any] | None = None,
                 worker_token: str | None = None, admin_token: str | None = None) -> None:
        """``worker_token``: what a heartbeat or a leave must carry (None: taken from anyone who reaches
        the port, which off loopback needs --insecure); ``admin_token``: what a pre-warm must carry,
        and what the router sends the workers with it (None: pre-warm is refused)."""
        self.options = options
        self._worker_token = worker_token
        self._admin_token = admin_token
        self._checks: dict[str, asyncio.Task[None]] = {}  # worker id -> the check of its URL under way
        self.state = RouterState(time.monotonic, options.state, random.Random())
        self.refs = RefCache(time.monotonic, options.resolve_ttl_s)
        self.metrics = RouterMetrics()
        self.metrics.workers.set_function(lambda: len(self.state))
        self._resolver = resolver  # blocking: ClusterClient.resolve_ref (run in a thread)
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        app.router.add_post("/heartbeat", self.heartbeat)
        app.router.add_post("/leave", self.leave)
        app.router.add_post("/infer/{ref}", self.infer)
        app.router.add_post("/prewarm", self.prewarm)
        app.router.add_get("/warm/{ref}", self.warm)
        app.router.add_get("/workers", self.workers)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/healthz", self.healthz)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                              auto_decompress=False)

    async def _stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status == 413:  # aiohttp's own text is a sentence with a line of numbers; keep one line
                return error(413, f"the body is over {MAX_BODY} bytes")
            return error(exc.status, exc.reason if exc.status != 404 else
                         f"no endpoint {request.method} {request.path}; use POST /infer/MODEL:TAG, GET /workers or GET /metrics")
        except Exception as exc:  # noqa: BLE001 - one failed request must not take the router down; one line, no traceback
            return error(500, f"{type(exc).__name__}: {str(exc)[:300]}")

    # ------------------------------------------------------------ workers

    def _refused_beat(self, request: web.Request) -> web.Response | str:
        """The instance secret the beat or leave carries, or its refusal: 401 without the worker token
        (when one is configured; the cluster's read token is not enough, every reader holds it), 400
        without a secret. A beat names the URL requests go to and a leave takes a worker out."""
        if self._worker_token is not None:
            why = refusal(request.headers.get(AUTH_HEADER), self._worker_token, request.path,
                          "the worker token (--worker-token-file on paramrouter and paramworker serve)")
            if why is not None:
                return error(401, why)
        secret = request.headers.get(INSTANCE_HEADER, "")
        if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
            return error(400, f"{request.path} needs the worker's instance secret in {INSTANCE_HEADER} "
                              f"({MIN_SECRET_CHARS}..{MAX_SECRET_CHARS} characters; paramworker serve sends it)")
        return secret

    async def heartbeat(self, request: web.Request) -> web.Response:
        secret = self._refused_beat(request)
        if isinstance(secret, web.Response):
            return secret
        try:
            beat = Heartbeat.from_json(await _json(request))
        except (ValueError, HeartbeatError) as exc:
            return error(400, f"bad heartbeat: {exc}")
        outcome = self.state.heartbeat(beat, secret)
        if outcome is Beat.FULL:
            return error(503, "the router's table is full", {"Retry-After": "1"})
        if outcome is Beat.CONFLICT:
            return error(409, f"worker {beat.worker_id!r} is registered by another process (another instance secret); "
                              f"its id is free once its lease ({self.state.config.lease_s:g} s) runs out or it leaves")
        if outcome is Beat.VERIFY:
            self._check_url(beat.worker_id, secret, beat.url)
        return web.json_response({"ok": True, "lease_s": self.state.config.lease_s})

    def _check_url(self, wid: str, secret: str, url: str) -> None:
        """Ask ``url`` to prove it is ``wid`` (in the background; routed to only once it has)."""
        old = self._checks.get(wid)
        if old is not None and not old.done():
            old.cancel()

        async def check() -> None:
            why: str | None = "the check was cut short"
            try:
                assert self._session is not None
                why = await check_identity(self._session, url, wid, secret)
            finally:
                self.state.verified(wid, secret, url, why is None)
                if why is not None:
                    print(f"paramrouter: warning: worker {wid!r} is not routed to: {url} does not answer as it ({why})",
                          file=sys.stderr, flush=True)
                if self._checks.get(wid) is task:
                    del self._checks[wid]

        task = self._checks[wid] = asyncio.ensure_future(check())

    async def leave(self, request: web.Request) -> web.Response:
        secret = self._refused_beat(request)
        if isinstance(secret, web.Response):
            return secret
        try:
            body = await _json(request)
            worker_id = body["worker_id"]
        except (ValueError, KeyError, TypeError):
            return error(400, 'send {"worker_id": ID}')
        if not self.state.leave(str(worker_id), secret):
            return error(409, f"worker {str(worker_id)[:200]!r} registered with another instance secret: only it can leave")
        return web.json_response({"ok": True})

    async def workers(self, _request: web.Request) -> web.Response:
        return web.json_response({"workers": self.state.table()})

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"workers": len(self.state), "affinity": self.state.config.affinity})

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------ resolution

    async def _resolved(self, text: str, shed: bool = False) -> tuple[VersionKey, bool] | web.Response:
        """``resolve``, with its failures as the one-line JSON answer (400, 404, or 503 + Retry-After)."""
        try:
            return await self.resolve(text)
        except BadModelRef as exc:
            return error(400, str(exc))
        except NotFound as exc:
            return error(404, str(exc))
        except LookupError as exc:
            if shed:
                self.metrics.shed.inc()
            return error(503, str(exc), {"Retry-After": "1"})

    async def resolve(self, text: str) -> tuple[VersionKey, bool]:
        """``(model@N, exact)`` for a reference; raises BadModelRef, NotFound or LookupError (unresolvable).

        An exact version the cluster says does not exist is NotFound (404 at once), rather than a
        request no worker can answer (503, retried) or a pre-warm that never completes; when there is
        no cluster or it does not answer, it goes unverified and the workers say."""
        ref = ModelRef.parse(text)
        number, why = await self._cluster_number(ref)
        if ref.version is not None:
            return VersionKey(ref.model, ref.version), True
        if number is None:
            number = self.state.version_from_workers(ref.model, ref.tag)
            if number is None:
                raise LookupError(f"cannot resolve {ref}: {why}, and no worker reports it loaded")
        return VersionKey(ref.model, number), False

    async def _cluster_number(self, ref: ModelRef) -> tuple[int | None, str]:
        """The version number the cluster gives ``ref`` (reused for ``resolve_ttl_s``), or None and why
        not; NotFound when the cluster says it does not exist."""
        cache_key = str(ref)
        cached = self.refs.get(cache_key)
        if cached is not None:
            return cached, ""
        if self._resolver is None:
            return None, "no --cluster given"
        try:
            info = await asyncio.wait_for(asyncio.to_thread(self._resolver, ref), RESOLVE_TIMEOUT_S)
        except NotFound:
            raise
        except (ClientError, TimeoutError, OSError) as exc:
            return None, f"the cluster did not answer ({str(exc)[:200]})"
        self.refs.put(cache_key, int(info.number))
        return int(info.number), ""

    # ------------------------------------------------------------ inference

    def _deadline_s(self, request: web.Request) -> float:
        raw = request.headers.get(DEADLINE_HEADER) or request.query.get("timeout_s")
        if raw is None:
            return self.options.request_timeout_s
        try:
            value = float(raw)
        except ValueError:
            raise web.HTTPBadRequest(reason=f"timeout {raw!r} is not a number of seconds") from None
        if not 0 < value <= MAX_TIMEOUT_S or math.isnan(value):
            raise web.HTTPBadRequest(reason=f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {raw}")
        return value

    async def infer(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        try:
            return await self._infer(request, started)
        finally:
            self.metrics.seconds.observe(time.monotonic() - started)

    async def _infer(self, request: web.Request, started: float) -> web.Response:
        deadline = started + self._deadline_s(request)
        try:  # a body that trickles in holds a connection: it gets the request's deadline, no more
            body = await asyncio.wait_for(request.read(), max(0.001, deadline - time.monotonic()))
        except (TimeoutError, asyncio.TimeoutError):
            return error(408, f"the request body did not arrive within the deadline ({deadline - started:.3g} s)")
        resolved = await self._resolved(request.match_info["ref"], shed=True)
        if isinstance(resolved, web.Response):
            return resolved
        key, exact = resolved
        tried: list[str] = []
        last = f"no live worker can answer {key}"
        for attempt in range(2):
            decision = self.state.choose(key, exact=exact, exclude=tried)
            left = deadline - time.monotonic()
            if decision.worker_id is None or decision.url is None or left <= 0:
                break
            if attempt:
                self.metrics.retried.inc()
            if decision.spilled:
                self.metrics.spilled.inc()
            wid = decision.worker_id
            tried.append(wid)
            self.state.started(wid)
            try:
                status, data, headers = await self._forward(decision.url, key, exact, body, left)
            except (TimeoutError, asyncio.TimeoutError):
                self.state.finished(wid, ok=True)  # slow, not gone: its queue says so in the next beat
                self.metrics.timeouts.inc()
                return error(504, f"{key}: no answer from worker {wid} within the deadline "
                                  f"({deadline - started:.3g} s); retry later or raise the timeout")
            except (aiohttp.ClientError, OSError) as exc:
                self.state.finished(wid, ok=False)
                last = f"worker {wid} failed mid-request ({type(exc).__name__}: {str(exc)[:200]})"
                continue
            self.state.finished(wid, ok=True)
            if status in (MISDIRECTED, 503):
                last = f"worker {wid} answered {status} ({_error_text(data)})"
                continue
            self.metrics.routed.inc()
            if decision.hit:
                self.metrics.hits.inc()
            return web.Response(status=status, body=data, content_type="application/json", headers={WORKER_HEADER: wid})
        self.metrics.shed.inc()
        if time.monotonic() >= deadline:
            self.metrics.timeouts.inc()
            return error(504, f"{key}: deadline ({deadline - started:.3g} s) passed; {last}")
        return error(503, f"{key}: {last}; retry later", {"Retry-After": "1"})

    async def _forward(self, url: str, key: VersionKey, exact: bool, body: bytes, left: float) -> tuple[int, bytes, dict[str, str]]:
        assert self._session is not None
        headers = {"Content-Type": "application/json", WANT_HEADER: str(key), EXACT_HEADER: "1" if exact else "0",
                   DEADLINE_HEADER: f"{left:.3f}"}
        async with self._session.post(f"{url}/infer", data=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=left)) as r:
            data = await r.read()
            return r.status, data, dict(r.headers)

    # ------------------------------------------------------------ pre-warm

    async def prewarm(self, request: web.Request) -> web.Response:
        why = refusal(request.headers.get(AUTH_HEADER), self._admin_token, "POST /prewarm",
                      "the admin token (--admin-token-file on paramrouter; paramctl prewarm sends it)")
        if why is not None:
            return error(401, why)
        try:
            body = await _json(request)
            ref_text = body["ref"]
            count = body.get("workers")
        except (ValueError, KeyError, TypeError):
            return error(400, 'send {"ref": "MODEL:TAG", "workers": N or null}')
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            return error(400, f"workers must be a number >= 1 or null (all), got {count!r}")
        resolved = await self._resolved(str(ref_text))
        if isinstance(resolved, web.Response):
            return resolved
        key, _exact = resolved
        targets = self.state.prewarm_targets(key, count)
        if not targets:
            return error(503, "no worker is registered with this router", {"Retry-After": "1"})
        if count is not None and len(targets) < count:
            return error(409, f"{count} workers asked for, {len(targets)} registered; nothing was asked")

        async def ask(wid: str) -> dict[str, Any]:
            url = self.state.url_of(wid)
            assert self._session is not None and url is not None
            try:
                async with self._session.post(f"{url}/prewarm", json={"model": key.model, "version": key.version},
                                              headers={AUTH_HEADER: f"Bearer {self._admin_token}"},
                                              timeout=aiohttp.ClientTimeout(total=10)) as r:
                    data = await r.read()
                    if r.status >= 300:
                        return {"worker_id": wid, "accepted": False, "error": f"{r.status}: {_error_text(data)}"}
                    return {"worker_id": wid, "accepted": True}
            except (aiohttp.ClientError, OSError, TimeoutError, asyncio.TimeoutError) as exc:
                return {"worker_id": wid, "accepted": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}

        answers = await asyncio.gather(*(ask(w) for w in targets))
        return web.json_response({"model": key.model, "version": key.version, "workers": answers})

    async def warm(self, request: web.Request) -> web.Response:
        resolved = await self._resolved(request.match_info["ref"])
        if isinstance(resolved, web.Response):
            return resolved
        key, _exact = resolved
        rows = []
        for wid, cached, loaded in self.state.warm(key):
            rows.append({"worker_id": wid, "loaded": loaded, "complete": bool(cached is not None and cached.complete),
                         **({"bytes_total": cached.bytes_total, "bytes_cached": cached.bytes_cached,
                             "bytes_memory": cached.bytes_memory, "bytes_disk": cached.bytes_disk} if cached else {})})
        return web.json_response({"model": key.model, "version": key.version, "workers": rows,
                                  "complete": sum(1 for r in rows if r["complete"])})


async def _json(request: web.Request) -> Any:
    """A small JSON body (beats, leaves, pre-warms), read within BODY_TIMEOUT_S: a client that sends
    it slowly must not hold the connection."""
    try:
        return await asyncio.wait_for(request.json(), BODY_TIMEOUT_S)
    except (TimeoutError, asyncio.TimeoutError):
        raise web.HTTPRequestTimeout(reason=f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except RecursionError:  # json's recursion on deeply nested arrays: a bad request, not a 500
        raise ValueError("the body nests too deeply") from None


def _error_text(data: bytes) -> str:
    try:
        parsed = json.loads(data)
        if isinstance(parsed, dict) and "error" in parsed:
            return str(parsed["error"])[:300]
    except (ValueError, RecursionError):
        pass
    return data[:300].decode(errors="replace")


# ---------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="paramrouter", description=__doc__.splitlines()[0] if __doc__ else None,
                                epilog="Workers register with: paramworker serve ... --router http://HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:8090", help="HTTP HOST:PORT, port 0 picks a free one (default 127.0.0.1:8090)")
    p.add_argument("--request-timeout-s", type=float_in(0, MAX_TIMEOUT_S, "--request-timeout-s"), default=30.0,
                   help="deadline of a request without its own X-Pdparams-Timeout-S header (default 30)")
    p.add_argument("--spill-queue", type=int_in(1, 100000, "--spill-queue"), default=8,
                   help="a worker whose queue (waiting + running) reaches this is passed over for the next (default 8)")
    p.add_argument("--lease-s", type=float_in(0, 3600, "--lease-s"), default=3.0,
                   help="a worker not heard from for this long is dropped: three 1 s beats (default 3)")
    p.add_argument("--resolve-ttl-s", type=float_in(0, 3600, "--resolve-ttl-s"), default=1.0,
                   help="seconds a tag resolution is reused (default 1)")
    p.add_argument("--max-connections", type=int_in(1, 1_000_000, "--max-connections"), default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open client connections; beyond, 503 at once and closed, and at most half the open-file limit "
                        f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--max-connections-per-source", type=int_in(1, 1_000_000, "--max-connections-per-source"),
                   default=DEFAULT_MAX_CONNECTIONS_PER_SOURCE, metavar="N",
                   help="open connections that have sent a request one client address may hold; beyond, 503; connections "
                        "that have sent nothing give way to newcomers at the cap "
                        f"(default {DEFAULT_MAX_CONNECTIONS_PER_SOURCE})")
    p.add_argument("--no-affinity", action="store_true",
                   help="choose a random worker among those that can answer (the baseline affinity is measured against)")
    auth = p.add_argument_group("credentials of this port (files, never values on the command line)")
    auth.add_argument("--worker-token-file", default=None, metavar="FILE",
                      help=f"the worker token: heartbeats and leaves must carry it (paramworker serve --worker-token-file "
                           f"with the same file); env {WORKER_TOKEN_ENV}; default: none, beats are taken from anyone who "
                           "reaches the port (loopback only, unless --insecure)")
    auth.add_argument("--admin-token-file", default=None, metavar="FILE",
                      help=f"the admin token: POST /prewarm must carry it, and the router sends it to the workers; env "
                           f"{ADMIN_TOKEN_ENV} or the client config's admin_token_file; default: none, pre-warm is refused")
    auth.add_argument("--insecure", action="store_true",
                      help="listen off loopback without --worker-token-file and --admin-token-file (a warning at start): "
                           "anyone who reaches the port can register workers and get requests sent to them")
    add_client_arguments(p, write=False, cluster_default="none: tags are then resolved from what the workers report, "
                                                        "with a warning")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        host, port_no = split_host_port(args.listen)
    except ValueError:
        print(f"paramrouter: error: --listen {args.listen!r} must be HOST:PORT", file=sys.stderr)
        return 2
    resolver: Callable[[ModelRef], Any] | None = None
    client = None
    settings: ClientSettings | None = None
    try:
        if args.cluster or os.environ.get(CLUSTER_ENV) or args.config_file or os.environ.get(CONFIG_ENV):
            settings = settings_from_args(args, write=False)
        worker_token = token_from(args.worker_token_file, "--worker-token-file", WORKER_TOKEN_ENV)
        admin_token = token_from(args.admin_token_file, "--admin-token-file", ADMIN_TOKEN_ENV,
                                 fallback=settings.admin_token if settings is not None else None)
        warnings = check_listeners([Listener(
            "the router's HTTP port", "--listen", args.listen, "worker token and admin token",
            worker_token is not None and admin_token is not None,
            "register a worker and have requests (bodies included) sent to it, or make workers fetch any version",
            "--worker-token-file FILE and --admin-token-file FILE")], insecure=args.insecure)
        if settings is not None:
            from paramserver.client.session import ClusterClient, SessionConfig

            client = ClusterClient(settings.cluster, token=settings.token_for(write=False),
                                   config=SessionConfig(call_timeout_s=RESOLVE_TIMEOUT_S), settings=settings)
            resolver = client.resolve_ref
    except (ClientError, ConfigError, WireConfigError) as exc:
        print(f"paramrouter: error: {exc}", file=sys.stderr)
        return 2
    options = RouterOptions(args.listen, args.request_timeout_s, args.resolve_ttl_s,
                            RouterConfig(lease_s=args.lease_s, spill_queue=args.spill_queue, affinity=not args.no_affinity))
    router = Router(options, resolver, worker_token, admin_token)
    if resolver is None:
        warnings.append("no cluster given (--cluster, PARAMS_CLUSTER or PARAMS_CONFIG): tags are resolved from what "
                        "workers report")
    if worker_token is None:
        warnings.append(f"no --worker-token-file ({WORKER_TOKEN_ENV}): any process that reaches the port can register a "
                        "worker")
    try:
        warning = "\n".join(f"paramrouter: warning: {w}" for w in warnings) or None
        return asyncio.run(serve(router.app(), host or "127.0.0.1", port_no, connection_cap(args.max_connections),
                                 on_refused=router.metrics.refused_connections.inc,
                                 per_source=args.max_connections_per_source, on_evicted=router.metrics.evicted_connections.inc,
                                 banner=f" affinity={'on' if options.state.affinity else 'off'}", warning=warning))
    except OSError as exc:  # only binding --listen raises it this far
        why = (f"port {port_no} is in use; pick another --listen (port 0 picks a free one)" if exc.errno == errno.EADDRINUSE
               else f"{exc.strerror or exc}; give a local HOST:PORT")
        print(f"paramrouter: error: cannot listen on {args.listen}: {why}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # SIGINT once serving is a clean stop; before that it ends the start-up
        print("paramrouter: error: interrupted before the router was listening", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()


def router_from_env(flag: str | None) -> str | None:
    """The router URL: the flag, else PARAMS_ROUTER."""
    return flag or os.environ.get(ROUTER_ENV) or None


if __name__ == "__main__":
    sys.exit(main())
