"""The HTTP front of ``paramworker serve``: connections, request parsing and the answers' status codes.

stdlib ``http.server``, HTTP/1.1 keep-alive, JSON; one thread per connection, at most
``max_connections``, at most ``max_connections_per_source`` from one client address; at a cap the
oldest connection that has not sent a request yet is closed for the newcomer, and when every one
has, the newcomer gets a 503 at once (written by ``worker.admission.Refuser``). What a
request runs on and how its result is cached is the app's (``worker.serve_app.ModelServer``),
seen here only through ``App``.

Connection bounds: one request's request line, headers and body must arrive within
``request_read_timeout_s`` of its first byte (a client trickling bytes cannot hold a connection);
between keep-alive requests a connection may idle ``idle_timeout_s``. Request bodies being read and
parsed share a byte budget (``body_budget_bytes``, default 4x ``max_body_bytes``): a request that
cannot get its share within ``body_budget_wait_s`` is a 503 with ``Retry-After``.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socket import MSG_DONTWAIT, SHUT_RDWR, socket
from typing import Any, Protocol, TypeVar, cast
from urllib.parse import parse_qs, urlsplit

from paramserver.wire.conn_limits import ConnectionLimits, ConnectionTable
from worker.admission import TOO_MANY_CONNECTIONS, Admission, AdmissionConfig, ByteBudget, Refuser
from worker.config import MAX_BODY_BYTES
from worker.errors import BadRequest, ConfigError, Misdirected, Shed, UnknownVersion, WorkerError
from worker.loader import LoadedModel
from worker.result_cache import ResultCacheConfig, canonical_json
from worker.result_service import Answer
from worker.router_auth import refusal
from worker.router_state import EXACT_HEADER, MISDIRECTED, WANT_HEADER
from paramserver.wire.auth import AUTH_HEADER
from worker.serve_metrics import CONTENT_TYPE, ServeMetrics

MAX_BODY = MAX_BODY_BYTES  # the default of ServeConfig.max_body_bytes
BODY_CHUNK = 64 << 10  # a body is read (and its budget taken) this many bytes at a time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """How ``paramworker serve`` answers: result cache, admission, connection and time bounds."""

    result_cache: ResultCacheConfig = field(default_factory=ResultCacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_connections: int = 512  # open HTTP connections (one thread each); beyond: 503 at once
    max_connections_per_source: int = 256  # of them from one client address (at most max_connections)
    request_timeout_s: float = 60.0  # a request waiting on an identical one gives up after this
    idle_timeout_s: float = 30.0  # a keep-alive connection with no request is closed after this
    max_body_bytes: int = MAX_BODY
    request_read_timeout_s: float = 10.0  # request line + headers + body, from its first byte
    body_budget_bytes: int = 0  # request body bytes read/parsed at once over all connections; 0: 4x max_body_bytes
    body_budget_wait_s: float = 1.0  # longest wait for body budget before a 503

    @property
    def body_budget(self) -> int:
        return self.body_budget_bytes or 4 * self.max_body_bytes

    def validate(self) -> ServeConfig:
        self.result_cache.validate()
        self.admission.validate()
        if not 1 <= self.max_connections <= 100_000:
            raise ConfigError(f"max_connections must be 1..100000, got {self.max_connections}")
        if not 1 <= self.max_connections_per_source <= 100_000:
            raise ConfigError(f"max_connections_per_source must be 1..100000, got {self.max_connections_per_source}")
        for name in ("request_timeout_s", "idle_timeout_s", "request_read_timeout_s", "body_budget_wait_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"{name} must be in (0, 3600] seconds, got {value}")
        if not 1 <= self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"max_body_bytes must be 1 B..1 GiB, got {self.max_body_bytes}")
        if self.body_budget_bytes and not self.max_body_bytes <= self.body_budget_bytes <= 64 << 30:
            raise ConfigError(f"body_budget_bytes must be 0 (4x max_body_bytes) or max_body_bytes..64 GiB, "
                              f"got {self.body_budget_bytes}")
        return self


# ---------------------------------------------------------------------- requests and answers


def _no_constant(name: str) -> Any:
    raise BadRequest(f"the request holds a number JSON cannot carry ({name})")


def parse_request(raw: bytes | bytearray) -> tuple[dict[str, Any], bool]:
    """(request without its ``cache`` field, whether to use the cache) of a ``POST /infer`` body.

    NaN and Infinity are refused here; a number that overflows to infinity (``1e999``) is refused by
    the one canonical pass over the request that ``ModelServer.infer`` makes (the result key's)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except BadRequest:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc}); send a JSON list or {{\"input\": [...]}}") from None
    except RecursionError:
        raise BadRequest("the body nests too deeply to be an input; send a JSON list of numbers") from None
    if isinstance(body, list):
        body = {"input": body}
    if not isinstance(body, dict) or body.get("input") is None:
        raise BadRequest('expected a JSON list or {"input": [...]}')
    use_cache = body.pop("cache", True)
    if not isinstance(use_cache, bool):
        raise BadRequest(f'"cache" must be true or false, got {use_cache!r}')
    return body, use_cache


def with_fields(body: bytes, **fields: Any) -> bytes:
    """A JSON object's bytes with ``fields`` added (without parsing the cached result again)."""
    extra = canonical_json(fields)[1:-1]
    if body.strip() in (b"{}", b""):
        return b"{" + extra + b"}"
    if not body.endswith(b"}"):
        raise ValueError("cached result is not a JSON object")
    return body[:-1] + b"," + extra + b"}"


Target = TypeVar("Target")


def answer_infer(raw: bytes | bytearray, want: str | None, exact: bool, metrics: ServeMetrics,
                 target_for: Callable[[str, bool], Target],
                 infer: Callable[[Any, bool, dict[str, Any], Target | None], tuple[Answer, LoadedModel]],
                 ) -> tuple[int, bytes, dict[str, str]]:
    """HTTP status, body and extra headers for one ``POST /infer`` body; counts it in ``metrics``.

    ``want`` (a router's ``X-Pdparams-Want: MODEL@N``): the version asked for, taken with ``target_for``;
    with ``exact`` False (a tag request) the version of that model loaded now does as well."""
    started = time.monotonic()
    outcome = "error"
    try:
        request, use_cache = parse_request(raw)
        target = target_for(want, exact) if want else None
        answer, loaded = infer(request["input"], use_cache, request, target)
        outcome = answer.outcome
        body = with_fields(answer.body, model=loaded.info.model, version=loaded.info.number,
                           fingerprint=loaded.manifest.fingerprint, cache=answer.outcome)
        return answer.status, body, {}
    except BadRequest as exc:
        return 400, canonical_json({"error": str(exc)}), {}
    except Misdirected as exc:
        return MISDIRECTED, canonical_json({"error": str(exc)}), {}
    except UnknownVersion as exc:
        return 404, canonical_json({"error": str(exc)}), {}
    except Shed as exc:
        outcome = "shed"
        return 503, canonical_json({"error": str(exc)}), {"Retry-After": str(exc.retry_after_s)}
    except TimeoutError as exc:
        return 504, canonical_json({"error": str(exc)}), {}
    except WorkerError as exc:
        return 503, canonical_json({"error": str(exc)}), {"Retry-After": "1"}
    except Exception as exc:  # noqa: BLE001 - one failed request must not take the worker down
        return 500, canonical_json({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}), {}
    finally:
        metrics.requests.labels(outcome).inc()
        metrics.seconds.observe(time.monotonic() - started)


# ---------------------------------------------------------------------- the server


class _ToJson(Protocol):
    def to_json(self) -> dict[str, Any]: ...


class App(Protocol):
    """What the HTTP front asks of the worker behind it."""

    @property
    def metrics(self) -> ServeMetrics: ...

    @property
    def admission(self) -> Admission: ...

    def handle_infer(self, raw: bytes | bytearray, want: str | None = None,
                     exact: bool = False) -> tuple[int, bytes, dict[str, str]]: ...

    def health(self) -> dict[str, Any]: ...

    def prewarm(self, model: str, version: int) -> _ToJson: ...

    @property
    def admin_token(self) -> str | None:
        """What ``POST /prewarm`` must carry (None: pre-warm is refused)."""

    def identity(self, nonce: str) -> dict[str, Any] | None:
        """``GET /identity``'s answer (None: not registered with a router)."""

    def weights_digest(self, model: str, version: int | None) -> dict[str, Any]:
        """``GET /weights/digest``'s answer (``worker.weights_digest``); UnknownVersion when not held."""


class HTTPFront(ThreadingHTTPServer):
    """One thread per connection, at most ``max_connections`` (``paramserver.wire.conn_limits``): at
    the cap a connection that has not sent a complete request line and headers yet is closed for the
    newcomer (answered 503), and when every one has, the newcomer gets a 503 at once. One client
    address holds at most ``per_source`` connections that have sent a request: past that, 503."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int,
                 per_source: int | None = None) -> None:
        self.max_connections = max_connections
        self.limits = ConnectionLimits(per_source or max_connections, max_connections).within(max_connections)
        self._table: ConnectionTable[socket] = ConnectionTable(self.limits)
        self._count_lock = threading.Lock()
        self.refused = 0
        self.evicted = 0
        self._refuser = Refuser()
        super().__init__(address, _marking_useful(handler))

    def process_request(self, request: Any, client_address: Any) -> None:
        source = str(client_address[0]) if isinstance(client_address, tuple) else str(client_address)
        with self._count_lock:
            decision = self._table.offer(request, source)
        for victim in decision.evict:  # answered 503; its thread's read ends at once and the thread closes it
            self.evicted += 1
            log.debug("HTTP connection closed for a newcomer: source=%s reason=%s (it had sent no request)",
                      source, decision.reason)
            try:
                victim.send(TOO_MANY_CONNECTIONS, MSG_DONTWAIT)
                victim.shutdown(SHUT_RDWR)
            except OSError:
                pass
        if not decision.admit:
            self.refused += 1
            self._refuser.refuse(cast(socket, request))
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._table.remove(request)

    def mark_useful(self, request: socket) -> bool:
        """``request`` has sent a complete request line and headers: never closed for a newcomer.
        False: its address already holds ``per_source`` such connections; the caller answers 503."""
        with self._count_lock:
            if self._table.useful(request):
                return True
        self.refused += 1
        return False

    def open_connections(self) -> int:
        with self._count_lock:
            return len(self._table)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, not a traceback: a client that went away (or was too slow) is routine."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):  # BrokenPipeError, ConnectionResetError, ...
            log.debug("HTTP connection from %s ended: %s: %s", client_address, type(exc).__name__, exc)
        else:
            log.warning("HTTP connection from %s failed: %s: %s", client_address, type(exc).__name__, exc)


def _marking_useful(handler: type[BaseHTTPRequestHandler]) -> type[BaseHTTPRequestHandler]:
    """``handler`` telling its HTTPFront when a request's line and headers have arrived in full."""

    class Marking(handler):  # type: ignore[valid-type, misc]
        def parse_request(self) -> bool:
            ok = bool(super().parse_request())
            if ok and isinstance(self.server, HTTPFront) and not self.server.mark_useful(self.connection):
                self.close_connection = True  # the request (and its body) is not read
                self.wfile.write(TOO_MANY_CONNECTIONS)
                return False
            return ok

    Marking.__name__ = Marking.__qualname__ = handler.__name__
    return Marking


def bind(listen: str, app: App, config: ServeConfig) -> HTTPFront:
    """The front listening on ``listen`` (HOST:PORT, port 0 picks a free one), not yet serving."""
    host, _, port = listen.rpartition(":")
    try:
        port_no = int(port or 0)
    except ValueError:
        raise ConfigError(f"--listen {listen!r} must be HOST:PORT") from None
    if not 0 <= port_no <= 65535:
        raise ConfigError(f"--listen {listen!r}: port must be 0..65535 (0 picks a free one)")
    try:
        return HTTPFront((host or "127.0.0.1", port_no), _handler(app, config), config.max_connections,
                         config.max_connections_per_source)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--listen {listen}: port {port_no} is in use; pick another --listen "
                              "(port 0 picks a free one)") from None
        raise ConfigError(f"--listen {listen}: cannot listen there ({exc.strerror or exc}); give a local "
                          "HOST:PORT") from None


class _DeadlineReader(io.RawIOBase):
    """A connection's socket reads, each under the idle timeout and, once a request's first byte has
    arrived (``deadline`` set), under the time left before its read deadline: trickling one byte at
    a time does not restart the clock."""

    def __init__(self, sock: socket, idle_s: float, request_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_s
        self._request_s = request_s
        self.deadline: float | None = None  # None: waiting for a request's first byte

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout = self._idle_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not arrive within {self._request_s:g} s")
            timeout = min(timeout, left)
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._idle_s)  # writes keep the idle timeout
        if n and self.deadline is None:
            self.deadline = time.monotonic() + self._request_s
        return n


def _handler(server: App, config: ServeConfig) -> type[BaseHTTPRequestHandler]:
    budget = ByteBudget(config.body_budget)
    chunk = min(BODY_CHUNK, budget.capacity)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # http.server assumes HTTP/0.9 until the request line parses, and an HTTP/0.9 answer has no
        # status line or headers: a garbled request line got a bare JSON body. No client speaks 0.9.
        default_request_version = "HTTP/1.0"
        timeout = config.idle_timeout_s
        # Headers and body leave in two writes: without TCP_NODELAY, Nagle holds the body back
        # until the client's delayed ACK (about 40 ms per answer on a keep-alive connection).
        disable_nagle_algorithm = True

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection, config.idle_timeout_s, config.request_read_timeout_s)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            self._reader.deadline = None  # the clock starts with this request's first byte
            super().handle_one_request()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, data: bytes, headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if not any(k.lower() == "connection" for k in headers or {}):
                # HTTP/1.0 closes after each answer unless both sides say keep-alive: http.server keeps
                # the connection when the client asked, but without saying so a 1.0 client (ab -k) waits
                # for a close that never comes. A connection about to close says so in any version.
                if self.close_connection:
                    self.send_header("Connection", "close")
                elif self.request_version == "HTTP/1.0":
                    self.send_header("Connection", "keep-alive")
            self.end_headers()
            self.wfile.write(data)

        def _json(self, code: int, body: dict[str, Any]) -> None:
            self._send(code, json.dumps(body).encode())

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (a malformed request line, headers too long or too many) as
            JSON like every other answer, not an HTML page; the connection ends with them."""
            self.close_connection = True
            reason = message or self.responses.get(code, ("error",))[0]
            data = canonical_json({"error": f"{reason}; send POST /infer, POST /prewarm, GET /healthz or GET /metrics"})
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if getattr(self, "command", None) != "HEAD":
                self.wfile.write(data)

        def _not_allowed(self) -> None:
            self.close_connection = True  # a body, if any, is not read
            data = canonical_json({"error": f"method {self.command} is not served here; "
                                            "send POST /infer, POST /prewarm, GET /healthz or GET /metrics"})
            self.send_response(405)
            self.send_header("Allow", "GET, POST")
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815 - http.server's method names

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/identity":
                self._identity()
            elif path in ("/healthz", ""):
                self._json(200, server.health())
            elif path == "/metrics":
                self._send(200, server.metrics.render(), content_type=CONTENT_TYPE)
            elif path == "/weights/digest":
                self._digest()
            else:
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer, GET /healthz or GET /metrics"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") == "/prewarm":
                self._prewarm()
                return
            if self.path.rstrip("/") not in ("/infer", ""):
                self._discard_body()
                self._json(404, {"error": f"no endpoint {self.path}; use POST /infer or POST /prewarm"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length <= 0 or length > config.max_body_bytes:
                self.close_connection = True  # the body (if any) is not read: this connection cannot go on
                self._json(400 if length <= config.max_body_bytes else 413,
                           {"error": f"send a JSON body of 1 to {config.max_body_bytes} bytes with a Content-Length"})
                return
            held = 0
            try:
                raw = bytearray(length)
                view = memoryview(raw)
                pos = 0
                while pos < length:  # the budget is taken as the bytes arrive, not for a Content-Length alone
                    n = min(chunk, length - pos)
                    if not budget.acquire(n, config.body_budget_wait_s):
                        self._shed_body()
                        return
                    held += n
                    end = pos + n
                    while pos < end:
                        got = self.rfile.readinto(view[pos:end])
                        if not got:  # the client went away mid-body
                            self.close_connection = True
                            return
                        pos += got
                view.release()
                want = self.headers.get(WANT_HEADER)
                code, data, headers = server.handle_infer(raw, want, self.headers.get(EXACT_HEADER, "1") != "0")
                del raw
            finally:
                budget.release(held)
            self._send(code, data, headers)

        def _shed_body(self) -> None:
            self.close_connection = True  # the rest of the body is not read
            server.metrics.requests.labels("shed").inc()
            retry = max(1, server.admission.retry_after_s())
            self._send(503, canonical_json({"error": f"overloaded: request bodies being read use the whole body budget "
                                                     f"({budget.capacity} bytes); retry after {retry} s"}),
                       {"Retry-After": str(retry), "Connection": "close"})

        def _identity(self) -> None:
            nonce = parse_qs(urlsplit(self.path).query).get("nonce", [""])[0]
            if not 16 <= len(nonce) <= 128:
                self._json(400, {"error": "send GET /identity?nonce=N (16 to 128 characters)"})
                return
            answer = server.identity(nonce)
            if answer is None:
                self._json(404, {"error": "this worker is not registered with a router (paramworker serve --router URL)"})
                return
            self._json(200, answer)

        def _digest(self) -> None:
            """Per-tensor BLAKE3 of a held version's tensors (admin token: it reads the whole model)."""
            why = refusal(self.headers.get(AUTH_HEADER), server.admin_token, "GET /weights/digest",
                          "the admin token (paramworker serve --admin-token-file)")
            if why is not None:
                self._json(401, {"error": why})
                return
            query = parse_qs(urlsplit(self.path).query)
            model, version = query.get("model", [""])[0], query.get("version", [""])[0]
            if not model or (version and not (version.isdigit() and int(version) >= 1)):
                self._json(400, {"error": "send GET /weights/digest?model=NAME[&version=N] (N >= 1)"})
                return
            try:
                self._json(200, server.weights_digest(model, int(version) if version else None))
            except UnknownVersion as exc:
                self._json(404, {"error": str(exc)})
            except ConfigError as exc:  # still loading
                self._json(409, {"error": str(exc)})

        def _prewarm(self) -> None:
            why = refusal(self.headers.get(AUTH_HEADER), server.admin_token, "POST /prewarm",
                          "the admin token (paramworker serve --admin-token-file; paramrouter sends its own)")
            if why is not None:
                try:  # a small body is read (the connection goes on); a larger one is not: it is closed
                    small = 0 <= int(self.headers.get("Content-Length") or 0) <= 4096
                except ValueError:
                    small = False
                if small:
                    self._discard_body()
                else:
                    self.close_connection = True
                self._json(401, {"error": why})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 < length <= 4096:
                self.close_connection = True
                self._json(400, {"error": 'send {"model": NAME, "version": N} with a Content-Length'})
                return
            try:
                body = json.loads(self.rfile.read(length))
                model, version = body["model"], body["version"]
                if not isinstance(model, str) or isinstance(version, bool) or not isinstance(version, int) or version < 1:
                    raise TypeError
            except (ValueError, KeyError, TypeError, RecursionError):
                self._json(400, {"error": 'send {"model": NAME, "version": N} (N >= 1)'})
                return
            try:
                entry = server.prewarm(model, version)
            except ConfigError as exc:
                self._json(409, {"error": str(exc)})
                return
            self._json(202, entry.to_json())

        def _discard_body(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            if 0 < length <= config.max_body_bytes:
                while length > 0:  # read and dropped a chunk at a time: no memory for a body nobody needs
                    got = len(self.rfile.read(min(chunk, length)))
                    if not got:
                        self.close_connection = True
                        return
                    length -= got
            elif length:
                self.close_connection = True

    return Handler


__all__ = ["App", "BODY_CHUNK", "HTTPFront", "MAX_BODY", "ServeConfig", "answer_infer", "bind", "parse_request",
           "with_fields"]
