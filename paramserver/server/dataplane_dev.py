"""Run a single data-plane server (no Raft) for tests and benchmarks.

    python -m paramserver.server.dataplane_dev --data-dir DIR [--listen 127.0.0.1:0] [--port-file F]

Tokens come from $PARAMS_ADMIN_TOKEN and $PARAMS_READ_TOKEN. Prints ``LISTENING host:port`` on stdout once serving (and writes the port to
--port-file), then serves until SIGTERM/SIGINT. Metadata RPCs answer
UNAVAILABLE. The real entry point is ``paramserver serve``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from paramserver.server.config import DEFAULT_GET_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, ServerConfig
from paramserver.server.service import start_server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paramserver.server.dataplane_dev", description=__doc__.splitlines()[0])
    p.add_argument("--id", default="dev1", help="server id (default dev1)")
    p.add_argument("--data-dir", type=Path, required=True, help="data directory")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT, port 0 picks a free one (default 127.0.0.1:0)")
    p.add_argument("--port-file", type=Path, help="write the bound port here")
    p.add_argument("--backend-file", type=Path,
                   help="write the path of the unix socket behind the connection gate here (bench/bench_grpc_gate.py "
                        "reads gRPC straight from it, the same-run baseline of the gate)")
    # Tokens from the environment only: a value on the command line is visible in 'ps'.
    p.add_argument("--cache-bytes", type=int, default=256 << 20, help="hot-chunk cache budget (default 256 MiB)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="gRPC message limit (default 65 MiB)")
    p.add_argument("--get-message-bytes", type=int, default=DEFAULT_GET_MESSAGE_BYTES, help="GetChunks coalescing target (default 1 MiB)")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync (benchmarks only)")
    args = p.parse_args(argv)
    config = ServerConfig(
        server_id=args.id,
        data_dir=args.data_dir,
        listen=args.listen,
        admin_token=os.environ.get("PARAMS_ADMIN_TOKEN"),
        read_token=os.environ.get("PARAMS_READ_TOKEN"),
        cache_bytes=args.cache_bytes,
        max_message_bytes=args.max_message_bytes,
        get_message_bytes=args.get_message_bytes,
        fsync=not args.no_fsync,
    ).validate()
    running = start_server(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.port_file:
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(args.port_file)
    if args.backend_file:
        args.backend_file.write_text(running.gate.backend_path)
    print(f"LISTENING {running.address}", flush=True)
    stop.wait()
    running.stop(grace=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
