"""A private redis-server for the benchmarks' Redis baseline (no persistence, loopback only)."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.local import free_port

if TYPE_CHECKING:
    import redis


class RedisServer:
    def __init__(self, root: Path, port: int | None = None) -> None:
        """``port``: a fixed one (a restart on the same address), else a free one."""
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed: apt-get install -y redis-server (Debian), then run again")
        self.port = port or free_port()
        # Its own session: a Ctrl-C to the benchmark reaches the benchmark, which stops it in order.
        self.proc = subprocess.Popen(
            [exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(root), "--protected-mode", "yes", "--maxmemory", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def client(self) -> redis.Redis:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


__all__ = ["RedisServer"]
