"""``paramworker``: load a model version from the cluster, or serve it and follow its tag.

    paramworker load MODEL:TAG --cluster HOST:PORT[,HOST:PORT] [--device cuda:0]
    paramworker serve --model MODEL:TAG --factory package.module:function --cluster HOST:PORT
    paramworker serve --model bert:prod --hf [--hf-class AutoModelForMaskedLM] --cluster HOST:PORT

Cluster addresses, tokens and TLS files come from ``paramserver.client.config`` (flags >
environment > client config file), exit codes from ``paramserver.client.exit_codes``: the same as
``paramctl``'s. Expected failures print one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import grpc

from chunking.errors import ChunkingError

from paramserver.client.config import ClientSettings, add_client_arguments, settings_from_args
from paramserver.wire.cli_args import OneLineParser, float_in, int_in
from paramserver.client.errors import ClientError
from paramserver.client.exit_codes import (
    BAD_ARGUMENTS, CLIENT_ENV_HELP, EXIT_CODES_HELP, INTERRUPTED, Failure,
    describe_failure, exit_code_for, one_line,
)  # fmt: skip
from worker.config import MAX_BODY_BYTES, MIB, CacheConfig, PrefetchConfig
from worker.errors import ConfigError, WorkerError

if TYPE_CHECKING:  # imported where used: `paramworker --help` stays quick
    from worker.peer_link import PeerLink, PeerLinkConfig
    from worker.serve import ServeConfig
    from paramserver.client.session import ClusterClient
    from worker.tiered_cache import TieredCache


def _common(p: argparse.ArgumentParser) -> None:
    add_client_arguments(p, write=False)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto = cuda:0 when CUDA is present (default auto)")
    p.add_argument("--cache-mb", type=int_in(0, 16777216, "--cache-mb"),
                   default=4096, help="memory tier (LRU-K) budget in MiB, 0 disables it (default 4096)")
    p.add_argument("--cache-k", type=int_in(1, 8, "--cache-k"), default=2, help="K of LRU-K (default 2)")
    p.add_argument("--disk-cache", default=None, metavar="DIR", help="directory of the disk tier (default: no disk tier)")
    p.add_argument("--disk-cache-mb", type=int_in(0, 67108864, "--disk-cache-mb"),
                   default=16384, help="disk tier budget in MiB (default 16384)")
    p.add_argument("--streams", type=int_in(1, 256, "--streams"), default=4, help="GetChunks streams in flight (default 4)")
    p.add_argument("--chunks-per-call", type=int_in(1, 4096, "--chunks-per-call"),
                   default=64, help="chunk ids per GetChunks call (default 64)")
    p.add_argument("--no-heatmap", action="store_true", help="fetch in manifest order, ignoring the servers' heatmap")
    p.add_argument("--verify", choices=("crc", "content"), default=None,
                   help="crc: every chunk's size and CRC32C from the (content-verified) manifest; content: also its BLAKE3 id "
                        "(env PARAMS_VERIFY, config file: verify; default crc)")
    p.add_argument("--no-bulk", action="store_true", help="read chunk bytes over gRPC GetChunks only, not the servers' bulk ports")
    p.add_argument("--monotonic-file", default=None, metavar="FILE",
                   help="persist the newest tag resolutions seen, so a restart cannot be rolled back (default: memory only)")
    peers = p.add_argument_group("peers (workers read chunks from each other; docs/workers.md, Peers)")
    peers.add_argument("--peer-listen", default=None, metavar="HOST:PORT",
                       help="the peer port other workers read this one's chunks from (its loads in progress, memory and "
                            "disk tiers; the cluster's read token required, under TLS this worker's certificate); off "
                            "loopback it needs a read token or --insecure; env PARAMS_PEER_LISTEN (default 127.0.0.1:0)")
    peers.add_argument("--peer-advertise", default=None, metavar="HOST:PORT",
                       help="the address other workers dial for the peer port (default: the address --peer-listen bound; "
                            "required when it binds 0.0.0.0; port 0: the port it bound); env PARAMS_PEER_ADVERTISE")
    peers.add_argument("--no-peers", action="store_true",
                       help="neither read from nor serve other workers: every chunk from the servers (env PARAMS_PEERS=off)")
    peers.add_argument("--peer-max-connections-per-source", type=int_in(1, 100000, "--peer-max-connections-per-source"),
                       default=None, metavar="N",
                       help="open peer-port connections one address may hold; beyond, refused (default 64)")


EPILOG = f"""\
A model reference is MODEL:TAG (e.g. resnet50:prod) or MODEL@N for the exact version N (e.g. resnet50@3).

{EXIT_CODES_HELP}

{CLIENT_ENV_HELP}
"""


HF_SERVE_HELP = """\
--hf serves a Hugging Face transformers model pushed as a save_pretrained folder
(paramctl push DIR: config.json + model.safetensors or its shards), without --factory: each
version's config.json builds the model (--hf-class, default AutoModel, the base model) with its
parameters on the meta device, filled from the cluster. POST /infer then takes token ids:
  {"input": [[101, 2023, 102]], "attention_mask": [[1, 1, 1]]}
(attention_mask is optional and has the shape of input; a bare [[101, 2023, 102]] works too;
the rows of one request must have the same length) and answers
  {"output": [[[...]]], "output_name": "logits" or "last_hidden_state", "model", "version", ...}
with the model's logits when it has a head (e.g. --hf-class AutoModelForCausalLM), else its
last_hidden_state, as nested lists of floats (batch x tokens x features).
"""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="paramworker",
        description="GPU worker for the parameter-server cluster: load model weights by tag, or serve a model that follows its tag.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    load = sub.add_parser("load", help="load a model version, print a progress bar and a summary",
                          description="Load MODEL:TAG or MODEL@N into memory (GPU when present) and print where the bytes came from.")
    load.add_argument("model", help="MODEL:TAG or MODEL@N")
    _common(load)
    load.add_argument("--repeat", type=int_in(1, 1000, "--repeat"),
                      default=1, help="load this many times in one process (shows the cache tiers; default 1)")
    load.add_argument("--json", action="store_true", help="print the summary as JSON lines instead of text")
    load.add_argument("--no-progress", action="store_true", help="no progress bar")
    load.add_argument("--insecure", action="store_true",
                      help="let --peer-listen listen off loopback without a read token (a warning at start)")
    serve = sub.add_parser("serve", help="keep a module loaded, follow tag moves, answer inference over HTTP",
                           description="Serve MODEL:TAG: POST /infer with a JSON list, GET /healthz. Tag moves are hot-swapped.",
                           epilog=HF_SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", required=True, help="MODEL:TAG (followed) or MODEL@N (fixed)")
    what = serve.add_mutually_exclusive_group(required=True)
    what.add_argument("--factory", help="package.module:function returning the nn.Module (built with its parameters on the "
                                        "meta device, worker.loader.empty_weights)")
    what.add_argument("--hf", action="store_true",
                      help="a transformers model from the version's config.json, no factory (see below; needs transformers)")
    serve.add_argument("--hf-class", default=None, metavar="CLASS",
                       help="with --hf: the transformers class, e.g. AutoModelForCausalLM or BertForMaskedLM (default AutoModel)")
    serve.add_argument("--listen", default="127.0.0.1:8080", help="HTTP HOST:PORT, port 0 picks a free one (default 127.0.0.1:8080)")
    serve.add_argument("--poll-s", type=float_in(0, 86400, "--poll-s", low_inclusive=True),
                       default=2.0, help="seconds between tag checks, 0 = never (default 2.0)")
    serve.add_argument("--heat-report-s", type=float_in(0, 86400, "--heat-report-s", low_inclusive=True), default=60.0,
                       help="seconds between reports of which chunks forward passes read, in order (default 60)")
    rt = serve.add_argument_group("router (paramrouter) and pre-warm")
    rt.add_argument("--router", action="append", default=[], metavar="URL",
                    help="register with the paramrouter at URL (http://HOST:PORT) and heartbeat to it every second: the versions "
                         "held, their bytes in the cache tiers, queue, requests running, device memory free; repeatable for "
                         "several routers side by side (default: none)")
    rt.add_argument("--advertise", default=None, metavar="HOST:PORT",
                    help="the address routers reach this worker at (default: the address --listen bound)")
    rt.add_argument("--worker-id", default=None, help="this worker's name in the routers' table (default: HOSTNAME:PORT)")
    rt.add_argument("--other-versions", type=int_in(0, 64, "--other-versions"), default=0, metavar="N",
                    help="load up to N versions besides the one followed, on demand, for requests a router sends for them "
                         "(least recently used dropped first); 0: such requests are answered 421 (default 0)")
    cred = serve.add_argument_group("credentials of the HTTP port (files, never values on the command line)")
    cred.add_argument("--admin-token-file", default=None, metavar="FILE",
                      help="the admin token POST /prewarm must carry (paramctl prewarm and paramrouter send it); env "
                           "PARAMS_ADMIN_TOKEN or the client config's admin_token_file; default: none, pre-warm is refused")
    cred.add_argument("--worker-token-file", default=None, metavar="FILE",
                      help="the worker token sent with every beat and leave to the --router (paramrouter "
                           "--worker-token-file with the same file); env PARAMS_WORKER_TOKEN; default: none")
    cred.add_argument("--insecure", action="store_true",
                      help="listen off loopback without --admin-token-file (a warning at start)")
    serve.add_argument("--no-cold-start", action="store_true",
                       help="answer only once the first version is fully loaded (default: answer at once; each layer "
                            "waits for its own weights, /healthz says loading with progress; not with --hf)")
    rc = serve.add_argument_group("result cache and admission")
    rc.add_argument("--result-cache-mb", type=int_in(0, 1048576, "--result-cache-mb"), default=64,
                    help="in-process result cache (L1, LRU-2) in MiB, 0 turns it off (default 64)")
    rc.add_argument("--result-cache-ttl", type=float_in(0, 30 * 86400, "--result-cache-ttl"), default=300.0, metavar="S",
                    help="seconds a cached result lives, plus up to 10%% random jitter (default 300)")
    rc.add_argument("--result-cache-redis", default=None, metavar="URL",
                    help="redis://HOST:PORT/DB shared by workers (L2, leases for single-flight across workers), or "
                         "rediss:// for TLS (a private CA: ?ssl_ca_certs=FILE); env PARAMS_RESULT_CACHE_REDIS; a URL with a "
                         "password only through the environment; needs --result-cache-key-file (default: none)")
    rc.add_argument("--result-cache-key-file", default=None, metavar="FILE",
                    help="the key L2 entries are authenticated with (HMAC-SHA256), the same for every worker sharing the "
                         "Redis and never given to Redis: a file of at least 32 random characters, not readable by other "
                         "users; required with --result-cache-redis; env PARAMS_RESULT_CACHE_KEY_FILE")
    rc.add_argument("--result-cache-redis-password-file", default=None, metavar="FILE",
                    help="Redis AUTH password, read from FILE (use rediss:// so it travels encrypted); env "
                         "PARAMS_RESULT_CACHE_REDIS_PASSWORD_FILE (default: none)")
    rc.add_argument("--max-concurrency", type=int_in(1, 1024, "--max-concurrency"), default=1,
                    help="forward passes at once (default 1)")
    rc.add_argument("--max-queue", type=int_in(0, 100000, "--max-queue"), default=64,
                    help="requests waiting for a forward slot; beyond, 503 with Retry-After at once (default 64)")
    rc.add_argument("--queue-timeout-s", type=float_in(0, 3600, "--queue-timeout-s"), default=10.0,
                    help="longest wait for a forward slot before a 503 (default 10)")
    rc.add_argument("--max-connections", type=int_in(1, 100000, "--max-connections"), default=512,
                    help="open HTTP connections (one thread each); at the cap the oldest one that has sent no request "
                         "is closed for a newcomer, else a 503 at once (default 512)")
    rc.add_argument("--max-connections-per-source", type=int_in(1, 100000, "--max-connections-per-source"), default=256,
                    metavar="N", help="open HTTP connections that have sent a request one client address may hold "
                                      "(at most --max-connections); beyond, 503 (default 256; a router counts as one address)")
    rc.add_argument("--request-read-timeout-s", type=float_in(0, 3600, "--request-read-timeout-s"), default=10.0, metavar="S",
                    help="a request's line, headers and body must arrive within S seconds of its first byte, "
                         "else the connection is closed (default 10)")
    rc.add_argument("--max-body-bytes", type=int_in(1, 1 << 30, "--max-body-bytes"), default=None, metavar="N",
                    help=f"largest request body; beyond, 413 (default {MAX_BODY_BYTES})")
    rc.add_argument("--body-budget-bytes", type=int_in(1, 64 << 30, "--body-budget-bytes"), default=None, metavar="N",
                    help="request body bytes read at once over all connections; beyond, 503 with Retry-After "
                         "(default 4x --max-body-bytes; at least --max-body-bytes)")
    _common(serve)
    return p


def _secret_file(path: str, flag: str) -> str:
    """A secret's text from ``path``: it must exist, be non-empty and not be readable by other users."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError(f"{flag} {path}: cannot read it ({why})") from None
    if mode & 0o007:
        raise ConfigError(f"{flag} {path} is readable or writable by other users (mode {mode & 0o777:04o}); chmod 600 {path}")
    if not text:
        raise ConfigError(f"{flag} {path} is empty; write the secret into it")
    return text


def serve_config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeConfig:
    """The serve flags as a validated ServeConfig (Redis URL: flag, else PARAMS_RESULT_CACHE_REDIS)."""
    from worker.admission import AdmissionConfig
    from worker.result_cache import ResultCacheConfig
    from worker.serve import ServeConfig

    url = args.result_cache_redis
    if url is not None and "@" in url.partition("://")[2].partition("/")[0]:
        raise ConfigError("--result-cache-redis: a URL with a password would be visible to every local user in the "
                          "process list; put it in PARAMS_RESULT_CACHE_REDIS instead")
    url = url or environ.get("PARAMS_RESULT_CACHE_REDIS") or None
    key: bytes | None = None
    password: str | None = None
    if url is not None:  # the secrets are read only when L2 is on
        key_file = args.result_cache_key_file or environ.get("PARAMS_RESULT_CACHE_KEY_FILE") or None
        if key_file is not None:  # none: ResultCacheConfig.validate refuses L2 without a key, after checking the URL
            key = _secret_file(key_file, "--result-cache-key-file").encode()
        password_file = args.result_cache_redis_password_file or environ.get("PARAMS_RESULT_CACHE_REDIS_PASSWORD_FILE") or None
        if password_file is not None:
            if "@" in url.partition("://")[2].partition("/")[0]:
                raise ConfigError("--result-cache-redis-password-file and a password in the Redis URL: give the password once")
            password = _secret_file(password_file, "--result-cache-redis-password-file")
    max_body = args.max_body_bytes or MAX_BODY_BYTES
    if args.body_budget_bytes is not None and args.body_budget_bytes < max_body:
        raise ConfigError(f"--body-budget-bytes {args.body_budget_bytes} is below --max-body-bytes ({max_body}): "
                          "one largest body must fit; raise it or leave it out (4x --max-body-bytes)")
    return ServeConfig(
        result_cache=ResultCacheConfig(l1_bytes=args.result_cache_mb * MIB, ttl_s=args.result_cache_ttl, redis_url=url,
                                       l2_key=key, redis_password=password),
        admission=AdmissionConfig(max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                                  queue_timeout_s=args.queue_timeout_s),
        max_connections=args.max_connections,
        max_connections_per_source=args.max_connections_per_source,
        request_read_timeout_s=args.request_read_timeout_s,
        max_body_bytes=max_body,
        body_budget_bytes=args.body_budget_bytes or 0,
    ).validate()


def peer_config_from_args(args: argparse.Namespace, settings: ClientSettings,
                          environ: Mapping[str, str] = os.environ) -> PeerLinkConfig:
    """The peer flags (> PARAMS_PEER_LISTEN / PARAMS_PEERS), validated, after the safe-default check
    of the peer port (off loopback: the read token this worker uses, or --insecure with a warning).
    Checked before anything touches the cluster."""
    from paramserver.wire.errors import ConfigError as WireConfigError
    from paramserver.wire.exposure import check_listeners
    from worker.peer_link import PeerLinkConfig

    config = PeerLinkConfig.from_env(environ, enabled=not args.no_peers, listen=args.peer_listen,
                                     advertise=args.peer_advertise,
                                     max_connections_per_source=args.peer_max_connections_per_source,
                                     insecure=args.insecure)
    if config.enabled:
        try:
            warnings = check_listeners([config.listener(settings.token_for(write=False))], insecure=args.insecure)
        except WireConfigError as exc:
            raise ConfigError(str(exc)) from None  # exit 2, one line
        for warning in warnings:
            print(f"paramworker: warning: {warning}", file=sys.stderr, flush=True)
    return config


def start_peers(client: ClusterClient, cache: TieredCache | None, config: PeerLinkConfig,
                worker_id: str | None = None) -> tuple[PeerLink | None, str | None]:
    """The process's peer link for ``client`` (attached: every load on it shares through it), or
    None with --no-peers, and a warning to print once the first load is in (None: none). A TLS
    cluster without this worker's certificate runs without peers (the warning says so; printed
    after the load, so a load refused for that same certificate stays one error line); a peer
    port that cannot listen is a one-line error."""
    import errno

    from worker.peer_link import PeerLink, attach

    if not config.enabled:
        attach(client, None)
        return None, None
    try:
        PeerLink.tls_files(client)
    except ConfigError as exc:
        attach(client, None)
        return None, f"paramworker: warning: {exc}; running without peers"
    try:
        link = PeerLink(client, cache, config, worker_id=worker_id).start()
    except OSError as exc:
        why = "the port is in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(f"--peer-listen {config.listen}: cannot listen there ({why}); pick another HOST:PORT "
                          "(port 0 picks a free one) or pass --no-peers") from None
    attach(client, link)
    return link, None


def _setup(args: argparse.Namespace, settings: ClientSettings) -> tuple[ClusterClient, TieredCache | None, PrefetchConfig]:
    from paramserver.client.session import ClusterClient, SessionConfig
    from worker.tiered_cache import TieredCache

    session = SessionConfig(call_timeout_s=settings.timeout_s, monotonic_path=args.monotonic_file)
    client = ClusterClient(settings.cluster, token=settings.token_for(write=False), config=session, bulk=settings.use_bulk,
                           verify=settings.verify, settings=settings)
    cache_config = CacheConfig(
        memory_bytes=args.cache_mb * MIB, k=args.cache_k, disk_dir=args.disk_cache,
        disk_bytes=args.disk_cache_mb * MIB if args.disk_cache else 0,
        # The disk tier is a cache verified on every read; fsync per chunk would halve cold loads.
        disk_fsync=False,
    )
    cache = TieredCache.from_config(cache_config) if (args.cache_mb > 0 or args.disk_cache) else None
    prefetch = PrefetchConfig(max_streams_in_flight=args.streams, chunks_per_stream=args.chunks_per_call,
                              use_heatmap=not args.no_heatmap)
    return client, cache, prefetch


def cmd_load(args: argparse.Namespace, settings: ClientSettings) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from worker.loader import ModelRef, resolve_device, resolve_ref, start_load

    console = Console(stderr=True)
    ref = ModelRef.parse(args.model)
    peer_config = peer_config_from_args(args, settings)
    client, cache, prefetch = _setup(args, settings)
    link: PeerLink | None = None
    try:
        link, note = start_peers(client, cache, peer_config)
        device = resolve_device(args.device)
        for _ in range(max(1, args.repeat)):
            info = resolve_ref(client, ref)
            manifest = client.manifest(info.manifest_id)
            total = manifest.raw_bytes
            with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                          TimeRemainingColumn(), console=console, disable=args.no_progress or args.json, transient=False) as bar:
                task = bar.add_task(f"{info.model} v{info.number}", total=total)
                handle = start_load(client, ref, device, cache, config=prefetch, info=info, manifest=manifest,
                                    on_progress=partial(bar.advance, task))
                _tensors, report = handle.result()
                handle.heat_sent(5.0)  # the heat report goes out behind the load; let it leave
            if args.json:
                print(json.dumps(report.to_dict(), sort_keys=True))
            else:
                print(report.summary())
        if note is not None:
            print(note, file=sys.stderr, flush=True)
    finally:
        if link is not None:
            link.close()
        client.close()
    return 0


def _credentials(args: argparse.Namespace, settings: ClientSettings) -> tuple[str | None, str | None]:
    """(admin token, worker token) of ``serve``, after the safe-default check of --listen (off
    loopback: the admin token, or --insecure with a warning)."""
    from paramserver.wire.errors import ConfigError as WireConfigError
    from paramserver.wire.exposure import Listener, check_listeners
    from worker.router_auth import ADMIN_TOKEN_ENV, WORKER_TOKEN_ENV, token_from

    admin = token_from(args.admin_token_file, "--admin-token-file", ADMIN_TOKEN_ENV, fallback=settings.admin_token)
    worker = token_from(args.worker_token_file, "--worker-token-file", WORKER_TOKEN_ENV)
    try:
        warnings = check_listeners([Listener("the worker's HTTP port", "--listen", args.listen, "admin token",
                                             admin is not None, "make the worker fetch any version (POST /prewarm)",
                                             "--admin-token-file FILE")], insecure=args.insecure)
    except WireConfigError as exc:
        raise ConfigError(str(exc)) from None  # exit 2, one line
    for warning in warnings:
        print(f"paramworker: warning: {warning}", file=sys.stderr, flush=True)
    return admin, worker


def cmd_serve(args: argparse.Namespace, settings: ClientSettings) -> int:
    from worker.hf import HFServing
    from worker.serve import ModelServer, load_factory

    if args.hf_class is not None and not args.hf:
        raise ConfigError("--hf-class goes with --hf")
    hf = HFServing(args.hf_class) if args.hf else None
    factory = load_factory(args.factory) if hf is None else None
    if hf is not None:
        hf.check()  # transformers installed and the class known, before touching the cluster
    admin_token, worker_token = _credentials(args, settings)
    serve_config = serve_config_from_args(args)
    peer_config = peer_config_from_args(args, settings)
    client, cache, prefetch = _setup(args, settings)
    link: PeerLink | None = None
    try:
        link, note = start_peers(client, cache, peer_config, args.worker_id)
        server = ModelServer(client, args.model, factory, args.device, cache, prefetch, heat_report_s=args.heat_report_s,
                             serve=serve_config, factory_name=args.factory or "", hf=hf, other_versions=args.other_versions,
                             cold_start=not args.no_cold_start, admin_token=admin_token, peers=link)
    except BaseException:
        if link is not None:
            link.close()
        client.close()
        raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        address = server.start(args.listen, args.poll_s)
        if args.router:
            advertise = args.advertise or address
            if advertise.startswith(("0.0.0.0:", "[::]:", ":::")):
                raise ConfigError(f"--listen {args.listen} binds every address: give --advertise HOST:PORT for the routers")
            server.register(args.router, advertise, args.worker_id, token=worker_token)
        _module, loaded = server.snapshot()
        state = "" if server.wait_loaded(0) else " (loading: answering while the weights arrive)"
        print(f"LISTENING {address} serving {loaded.info.model} v{loaded.info.number}{state}", flush=True)

        def when_loaded() -> None:
            server.wait_loaded()
            if server.load_exception is None:
                print(server.snapshot()[1].report.summary(), flush=True)
                if note is not None:
                    print(note, file=sys.stderr, flush=True)
            stop.set() if server.load_exception is not None else None

        threading.Thread(target=when_loaded, name="paramworker-loaded", daemon=True).start()
        stop.wait()
        if server.load_exception is not None:
            raise server.load_exception  # the first load failed: exit with its code and one line
    finally:
        server.stop()
        if link is not None:
            link.close()  # the leaving announce: peers stop asking this worker at once
        client.close()
    return 0


def worker_exit_code(exc: BaseException) -> int:
    """paramworker's exit code: the shared table (paramserver.client.exit_codes) for client, gRPC and
    chunking errors; the worker's own errors by what they mean (configuration 2, others 1)."""
    from worker import errors as we

    if isinstance(exc, we.TensorFailed) and isinstance(exc.cause, BaseException):
        return worker_exit_code(exc.cause)  # the chunk failure behind the tensor says what happened
    if isinstance(exc, we.ConfigError):
        return BAD_ARGUMENTS
    # Anything else goes by the shared table; a worker error raised while handling a failed call
    # keeps that call's status code, and one without any is 1.
    return exit_code_for(exc)


def describe_worker_failure(exc: BaseException, settings: ClientSettings | None) -> Failure:
    """Exit code and one-line message, as paramctl gives them (same codes, same TLS diagnosis)."""
    return describe_failure(exc, settings, code=worker_exit_code(exc))


def _fail(failure: Failure) -> int:
    print(f"paramworker: error: {one_line(failure.message)}", file=sys.stderr)
    return failure.code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings: ClientSettings | None = None
    try:
        settings = settings_from_args(args, write=False)
        return cmd_load(args, settings) if args.cmd == "load" else cmd_serve(args, settings)
    except (WorkerError, ClientError, grpc.RpcError, ChunkingError) as exc:
        return _fail(describe_worker_failure(exc, settings))
    except KeyboardInterrupt:
        return _fail(Failure(INTERRUPTED, _INTERRUPTED[args.cmd]))


# serve turns SIGINT into a clean stop once it is serving; these are the interrupts that end a command early.
_INTERRUPTED = {
    "load": "interrupted; the load was abandoned (chunks already in a --disk-cache stay there for the next load)",
    "serve": "interrupted before serving began; nothing was served",
}


if __name__ == "__main__":
    sys.exit(main())
