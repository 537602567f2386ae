"""What the fleet fan-out integration tests share (issue 42): a model factory for ``paramworker serve``,
its seeded weights, real worker processes and what they report.

The worker processes import this module for their factory (``--factory tests.fanout_helpers:build``),
so it imports nothing heavy at module level besides torch. Layers are ``FANOUT_TEST_WIDTH`` square
float32 matrices (default 2048: 16 MiB each), ``FANOUT_TEST_LAYERS`` of them (default 4), plus an
odd-length bfloat16 vector and a 0-d buffer, so bit-exactness covers more than one dtype and shape.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
LAYERS_ENV, WIDTH_ENV = "FANOUT_TEST_LAYERS", "FANOUT_TEST_WIDTH"
MiB = 1 << 20


class Wide(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        self.odd = torch.nn.Parameter(torch.zeros(1001, dtype=torch.bfloat16))
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.get_buffer("scale")


def build() -> torch.nn.Module:
    """Factory for ``paramworker serve --factory tests.fanout_helpers:build``."""
    return Wide(int(os.environ.get(LAYERS_ENV, "4")), int(os.environ.get(WIDTH_ENV, "2048")))


def state_dict(layers: int, width: int = 2048, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(width, width, generator=g) for i in range(layers)}
    out["odd"] = torch.randn(1001, generator=g).to(torch.bfloat16)
    out["scale"] = torch.tensor(1.5 + seed)
    return out


def model_env(layers: int, width: int = 2048) -> dict[str, str]:
    return {LAYERS_ENV: str(layers), WIDTH_ENV: str(width)}


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


class Proc:
    """A child process whose output (stdout and stderr together) is read into ``lines`` as it comes."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.argv = list(argv)
        self.log = log
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=str(REPO), env=dict(env), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self._done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log, "a") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()
                self.lines.append(line.rstrip("\n"))
        self._done.set()

    def first(self, pattern: str) -> re.Match[str] | None:
        rx = re.compile(pattern)
        for line in list(self.lines):
            m = rx.search(line)
            if m:
                return m
        return None

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.first(pattern)
            if m:
                return m
            if self.proc.poll() is not None and self._done.is_set():
                break
            time.sleep(0.05)
        m = self.first(pattern)
        if m:
            return m
        raise AssertionError(f"{self.argv[:4]}: no line matching {pattern!r} within {timeout:g} s (exit {self.proc.poll()}): "
                             + " | ".join(self.lines[-8:])[-1500:])

    def wait_exit(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.argv[:4]} still running after {timeout:g} s: " + " | ".join(self.lines[-8:])[-1500:]) from None
        self._done.wait(10)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def worker_argv(cmd: str, model: str, *extra: str) -> list[str]:
    if cmd == "serve":
        return [sys.executable, "-m", "worker", "serve", "--model", model, "--factory", "tests.fanout_helpers:build",
                "--listen", "127.0.0.1:0", "--device", "cpu", "--result-cache-mb", "0", *extra]
    return [sys.executable, "-m", "worker", "load", model, "--device", "cpu", "--json", "--no-progress", *extra]


class Served(Proc):
    """``paramworker serve`` of the fan-out model: its HTTP port, load report, metrics and digests."""

    def __init__(self, model: str, env: Mapping[str, str], log: Path, *extra: str, prefix: Sequence[str] = (),
                 admin_token: str | None = None) -> None:
        super().__init__([*prefix, *worker_argv("serve", model, *extra)], env, log)
        self.model = model.split(":")[0].split("@")[0]
        self.admin_token = admin_token

    @property
    def address(self) -> str:
        m = self.first(r"^LISTENING (\S+)")
        assert m is not None, "not listening yet"
        return m.group(1)

    def wait_ready(self, timeout: float) -> str:
        """The load report line (printed once the first load is complete)."""
        self.wait_line(r"^LISTENING ", timeout)
        return self.wait_line(rf"^{re.escape(self.model)} v\d+", max(1.0, timeout - (time.monotonic() - self.t0))).string

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        try:
            conn.request("GET", path, headers=headers)
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (path, status, body[:300])
        return json.loads(body)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name with labels, e.g. ``pdparams_load_bytes_total{tier="peer"}``."""
        status, body = self.get("/metrics")
        assert status == 200, body[:300]
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def tiers(self) -> dict[str, float]:
        return {k.split('tier="', 1)[1].split('"', 1)[0]: v for k, v in self.metrics().items()
                if k.startswith("pdparams_load_bytes_total{")}

    def served_bytes(self) -> float:
        return self.metrics().get("pdparams_peer_served_bytes_total", 0.0)

    def digests(self, version: int | None = None) -> tuple[int, dict[str, str]]:
        path = f"/weights/digest?model={self.model}" + (f"&version={version}" if version is not None else "")
        body = self.json(path)
        return int(body["version"]), dict(body["tensors"])


def load_json(proc: Proc) -> dict[str, Any]:
    """The JSON report ``paramworker load --json`` printed (its last JSON line)."""
    for line in reversed(proc.lines):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError("no JSON report: " + " | ".join(proc.lines[-8:])[-1500:])


def served_total(addresses: Sequence[str], client_config: Callable[[str], Any]) -> int:
    """The chunk bytes every server has sent since it started (ServerStatus.served_bytes, summed)."""
    from paramserver.client.rpc import ParamServerClient

    total = 0
    for address in addresses:
        with ParamServerClient(client_config(address)) as c:
            total += int(c.server_status().served_bytes)
    return total


__all__ = ["LAYERS_ENV", "MiB", "Proc", "REPO", "Served", "WIDTH_ENV", "Wide", "build", "load_json", "model_env",
           "served_total", "state_dict", "wait_for", "worker_argv"]
