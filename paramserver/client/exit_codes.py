"""Exit codes of the client CLIs (``paramctl``, ``paramworker``): one table, one message format.

An expected failure ends as ONE line on stderr, ``<prog>: error: [CODE: ]message``, and an exit
code that says what happened; tracebacks are only for bugs. :func:`exit_code_for` maps an
exception to its code; :func:`describe_failure` also returns the line's text and, for "cluster
unavailable", checks whether the real cause is TLS (a refused client certificate reads as
"Socket closed" in gRPC) so that it exits 5 with the reason.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from chunking.errors import ChunkCorrupt, ChunkingError, ChunkMissing, ManifestError

from paramserver.client.channel import diagnose_tls
from paramserver.client.errors import ClientError, from_rpc, rpc_code

if TYPE_CHECKING:
    from paramserver.client.config import ClientSettings

OK = 0
OTHER = 1
BAD_ARGUMENTS = 2
NOT_FOUND = 3
CONFLICT = 4
AUTH = 5
UNAVAILABLE = 6
PRECONDITION = 7
DATA_LOSS = 8
INTERRUPTED = 130

EXIT_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: BAD_ARGUMENTS,
    grpc.StatusCode.OUT_OF_RANGE: BAD_ARGUMENTS,
    grpc.StatusCode.NOT_FOUND: NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: CONFLICT,
    grpc.StatusCode.ABORTED: CONFLICT,
    grpc.StatusCode.UNAUTHENTICATED: AUTH,
    grpc.StatusCode.PERMISSION_DENIED: AUTH,
    grpc.StatusCode.UNAVAILABLE: UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION: PRECONDITION,
    grpc.StatusCode.DATA_LOSS: DATA_LOSS,
}

# The status name a line starts with when the error itself carries none (the same word for either CLI).
_STATUS_OF_EXIT = {
    NOT_FOUND: grpc.StatusCode.NOT_FOUND, CONFLICT: grpc.StatusCode.ABORTED, AUTH: grpc.StatusCode.UNAUTHENTICATED,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION, DATA_LOSS: grpc.StatusCode.DATA_LOSS,
}  # fmt: skip

EXIT_CODES_HELP = """\
exit codes: 0 ok, 1 other error, 2 bad arguments or configuration (INVALID_ARGUMENT), 3 not found,
4 conflict (ABORTED: another version was committed first), 5 wrong or missing token, or a TLS
client certificate (or CA) the cluster refused, 6 cluster unavailable, 7 precondition failed
(chunks short of their write quorum), 8 data loss (no intact copy of a chunk), 130 interrupted."""

CLIENT_ENV_HELP = """\
environment: PARAMS_CLUSTER (addresses), PARAMS_ADMIN_TOKEN (writes), PARAMS_READ_TOKEN (reads; the
admin token works too), PARAMS_TLS_CA / PARAMS_TLS_CERT / PARAMS_TLS_KEY (TLS, mutual TLS),
PARAMS_VERIFY (crc|content), PARAMS_CONFIG (client config file, TOML; 'python -m deploy.local up'
writes one). Flags win over the environment, the environment over the config file."""


def _chunking_code(exc: ChunkingError) -> int:
    # Bytes that failed their checks, or a manifest that does not match its id: data loss.
    # Anything else from chunking is about the input given (a file, a chunk size): bad arguments.
    if isinstance(exc, (ChunkCorrupt, ManifestError, ChunkMissing)):
        return DATA_LOSS
    return BAD_ARGUMENTS


def _rpc_in_chain(exc: BaseException) -> grpc.RpcError | None:
    """The gRPC error an exception was raised from (``raise X from None`` still keeps ``__context__``)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, grpc.RpcError):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


def exit_code_for(exc: BaseException) -> int:
    """The exit code for a failure: ClientError and grpc.RpcError by status code, chunking errors 2 or 8."""
    if isinstance(exc, ClientError):
        return EXIT_CODES.get(exc.code, OTHER)
    if isinstance(exc, grpc.RpcError):
        return EXIT_CODES.get(rpc_code(exc), OTHER)
    if isinstance(exc, ChunkingError):
        return _chunking_code(exc)
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    rpc = _rpc_in_chain(exc)
    if rpc is not None:
        return EXIT_CODES.get(rpc_code(rpc), OTHER)
    return OTHER


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code an error stands for, when it has one (for the message prefix)."""
    if isinstance(exc, ClientError):
        return exc.code
    if isinstance(exc, grpc.RpcError):
        return rpc_code(exc)
    rpc = _rpc_in_chain(exc)
    return rpc_code(rpc) if rpc is not None else None


@dataclass(frozen=True)
class Failure:
    code: int
    message: str  # one line, without the "<prog>: error: " prefix


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def describe_failure(exc: BaseException, settings: ClientSettings | None = None, *, code: int | None = None) -> Failure:
    """Exit code and one-line message for ``exc``; ``code`` overrides the mapped exit code.

    When it reads "cluster unavailable" and ``settings`` are known, the seeds are probed once
    (``diagnose_tls``): if TLS is what failed, the code becomes 5 and the line says why.
    """
    if isinstance(exc, grpc.RpcError):
        exc = from_rpc(exc, "call failed")
    exit_code = exit_code_for(exc) if code is None else code
    if exit_code == UNAVAILABLE and settings is not None:
        problem = _tls_problem(settings)
        if problem is not None:
            return Failure(AUTH, one_line(f"{grpc.StatusCode.UNAUTHENTICATED.name}: {problem}"))
    status = status_of(exc)
    if status is None or status == grpc.StatusCode.UNKNOWN:
        status = _STATUS_OF_EXIT.get(exit_code, status)
    text = one_line(str(exc) or type(exc).__name__)
    generic = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT)
    if status is not None and status not in generic and not text.startswith(status.name):
        text = f"{status.name}: {text}"
    return Failure(exit_code, text)


def _tls_problem(settings: ClientSettings, timeout_s: float = 2.0) -> str | None:
    """The first seed's TLS complaint, probing up to three seeds at once (at most ``timeout_s`` in all)."""
    seeds = list(settings.cluster[:3])
    if not seeds:
        return None

    def probe(address: str) -> str | None:
        return diagnose_tls(address, tls=settings.tls, tls_ca=settings.tls_ca, tls_cert=settings.tls_cert,
                            tls_key=settings.tls_key, timeout_s=timeout_s)

    pool = ThreadPoolExecutor(max_workers=len(seeds), thread_name_prefix="tls-diagnosis")
    try:
        futures = [pool.submit(probe, a) for a in seeds]
        done, _ = wait(futures, timeout=timeout_s + 0.5)
        for future in futures:  # in seed order, among those that finished
            if future in done and future.exception() is None and future.result() is not None:
                return future.result()
        return None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


__all__ = [
    "AUTH", "BAD_ARGUMENTS", "CLIENT_ENV_HELP", "CONFLICT", "DATA_LOSS", "EXIT_CODES", "EXIT_CODES_HELP", "Failure", "INTERRUPTED",
    "NOT_FOUND", "OK", "OTHER", "PRECONDITION", "UNAVAILABLE", "describe_failure", "exit_code_for", "one_line", "status_of",
]
